"""``countdown sweep``: its arguments and the call into :func:`~countdown.eval.sweep.runner.run_sweep`."""

from __future__ import annotations

import sys

from ...io import LockedError, UnwritableError
from ...options import add_device_arg, add_number, path_option
from .cells import DEFAULT_METHODS, DEFAULT_MODES, DEFAULT_SPARSITIES, DEFAULT_TASKS, format_k
from .measure import DEFAULT_CHUNK, DEFAULT_PASS_CONFIGS
from .runner import run_sweep
from .store import DEFAULT_WAIT

EXIT_INTERRUPTED = 130  # the shell's code for a run ended by SIGINT


def add_arguments(p) -> None:
    """The arguments of ``countdown sweep`` on an argparse (sub)parser."""
    p.add_argument("--model", default="smollm2-135m", help="catalogue name, .gguf file or HF folder (default smollm2-135m)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated method specs (countdown.spec); an SP-Prac kind in brackets, e.g. "
                        "dense,mono,dual,dual[lowrank],dual[shadow4]; dense@mlp4g64: dense with 4-bit MLP weights "
                        "(default: the five methods)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="ideal,prac (dense has no mode; default both)")
    add_number(p, "--sparsity", "-k", range="sparsities", default=",".join(format_k(k) for k in DEFAULT_SPARSITIES),
               help="comma-separated k values (default 0.7,0.8,0.9)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma-separated offline lm-eval tasks (default: the six of the paper)")
    add_number(p, "--limit", range="limit_docs", default=None, help="first N documents of each task (default: all)")
    add_number(p, "--ppl-tokens", range="ppl_tokens", default=4096,
               help="tokens of XSum per perplexity (0 = skip; default 4096)")
    add_number(p, "--agreement-prompts", range="agreement_prompts", default=20,
               help="agreement prompts (0 = skip; default 20)")
    add_number(p, "--max-new-tokens", range="max_new_tokens", default=32,
               help="tokens generated per agreement prompt (default 32)")
    add_number(p, "--batch-size", range="batch_size", default=8, help="lm-eval batch size (default 8)")
    add_number(p, "--chunk", range="chunk", default=DEFAULT_CHUNK,
               help=f"prompts per shared-prompt batch of an lm-eval pass (default {DEFAULT_CHUNK})")
    add_number(p, "--pass-configs", range="pass_configs", default=DEFAULT_PASS_CONFIGS,
               help="configurations per shared pass over a task's documents; each pass is saved when it ends "
                    f"(default {DEFAULT_PASS_CONFIGS})")
    add_number(p, "--threads", range="threads", default=None, help="torch threads (default: cores - 1)")
    p.add_argument("--artifacts-dir", default=None, type=path_option, help="SP-Prac artifact cache (default <cache>/artifacts)")
    p.add_argument("--out", default="results/quality", type=path_option, help="folder for <model>.csv / .md / .png (default results/quality)")
    add_number(p, "--wait", range="wait", default=DEFAULT_WAIT,
               help="seconds to wait for another sweep's merge into the same --out "
                        f"(each merge holds the folder's lock briefly; default {DEFAULT_WAIT:g})")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite <model>.md / .png from the CSV as it stands; compute nothing")
    p.add_argument("--export", default=None, type=path_option, metavar="DIR",
                   help="write the job of the pending lm-eval cells (requests as token ids, SP-Prac artifacts) to DIR "
                        "for `python -m countdown.eval.offline.device` on a GPU; measure nothing (default: off)")
    p.add_argument("--scores", default=None, metavar="FILE[,FILE]",
                   help="scores files of such a job: lm-eval cells found there are replayed through lm-eval here (default: none)")
    p.add_argument("--dtype", default="fp32", help="model dtype (default fp32)")
    add_device_arg(p)


def split_list(text) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; brackets keep their commas (``dual[shadow4]``)."""
    parts, depth, current = [], 0, ""
    for ch in str(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def sparsity_list(text) -> list[float]:
    """``"0.7,0.8"`` -> ``[0.7, 0.8]`` (a list, as argparse parsed it, passes through); a part that is not a
    number is a ValueError naming it."""
    if isinstance(text, (list, tuple)):
        return list(text)
    out = []
    for part in split_list(text):
        try:
            out.append(float(part))
        except ValueError:
            raise ValueError(f"--sparsity: {part!r} is not a number; give k values like 0.7,0.8,0.9") from None
    return out


def sweep_from_args(args) -> int:
    """Run :func:`run_sweep` from parsed ``countdown sweep`` arguments; returns the exit code
    (0; 130 after Ctrl-C, with the resume command already printed; 2 when the folder is locked
    or cannot be written)."""
    try:
        run_sweep(args.model, methods=split_list(args.methods), modes=split_list(args.modes),
                  sparsities=sparsity_list(args.sparsity), tasks=split_list(args.tasks), limit=args.limit,
                  out_dir=args.out, ppl_tokens=args.ppl_tokens, agreement_prompts=args.agreement_prompts,
                  max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, threads=args.threads,
                  artifacts_dir=args.artifacts_dir, dtype=args.dtype, device=args.device,
                  report_only=args.report_only, wait=getattr(args, "wait", DEFAULT_WAIT),
                  chunk=getattr(args, "chunk", DEFAULT_CHUNK),
                  pass_configs=getattr(args, "pass_configs", DEFAULT_PASS_CONFIGS),
                  export=getattr(args, "export", None),
                  scores=split_list(args.scores) if getattr(args, "scores", None) else None)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (LockedError, UnwritableError) as err:
        print(f"countdown sweep: error: {err}", file=sys.stderr)
        return 2
    return 0
