"""The ``countdown`` command line: a thin shell over the Python API."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ..options import Parser, add_device_arg, add_number, check_at_most, path_option
from .common import (add_model_args, add_sparse_args, check_model_arg, fill_sparse_args, load_saved_weights, load_text_arg,
                     shell_advice, warnings_as_lines)
from .prac import add_prac_commands


def cmd_methods(args) -> int:
    from ..selectors.base import kinds_for
    from ..sparse_methods.registry import get_method, methods
    from ..spec import parse_spec, spec_forms

    for name in methods():
        m = get_method(name)
        aliases = f"  (aliases: {', '.join(m.aliases)})" if m.aliases else ""
        print(f"{name:<8} {m.description}{aliases}")
        kinds = kinds_for(name) if m.prac is not None else []
        if len(kinds) > 1:
            print(f"{'':<9}SP-Prac: {', '.join(spec_forms(name)[1:])}; default kind (built for plain {name}): "
                  f"{parse_spec(name).resolved().label}")
        elif kinds:
            print(f"{'':<9}SP-Prac: {name}[{kinds[0]}] (kind {kinds[0]})")
    print("\nA plain method is SP-Ideal (the exact per-token top-k); its SP-Prac kind in brackets, then the kind's "
          "options, make it SP-Prac: dual[shadow3g32], dual[lowrank256], dual[shadow4,cut_rule=pooled], "
          "mono[threshold,rule=pooled] (countdown.spec)")
    return 0


def _validated_method(args):
    """Check the method spec, sparsity, mode, artifacts and model argument before the (slow) model load; returns
    the spec, which says SP-Ideal or SP-Prac by itself (a deprecated ``--mode`` folded in, with a warning on
    stderr), and sets ``args.mode`` to its mode."""
    from ..sparse_methods.registry import check_sparsity, get_method
    from ..patch.sparsify import check_artifacts_given, mode_warning, with_mode
    from ..spec import parse_spec

    fill_sparse_args(args)  # a folder saved sparsified: its configuration, unless --method is given
    spec = parse_spec(args.method)
    method = get_method(spec.method)
    if not method.is_dense:
        check_sparsity(args.sparsity)
    if args.mode is not None:
        spec = with_mode(spec, args.mode, args.artifacts)
        print(f"countdown: {mode_warning(spec, args.mode)}", file=sys.stderr)
    args.mode = spec.mode
    # ppl: a spec naming its kind without --artifacts has it built after the load (and cached)
    args.build_artifacts = getattr(args, "build_artifacts", False) and spec.kind is not None and args.artifacts is None
    if not args.build_artifacts:
        check_artifacts_given(spec, args.artifacts)
    if args.artifacts is not None and not hasattr(args, "artifacts_path"):  # read now: a wrong file is named
        from ..artifacts.store import load_artifacts                               # before the model load

        args.artifacts_path, args.artifacts = args.artifacts, load_artifacts(args.artifacts)
    check_model_arg(args.model)
    return spec


def _load_sparsified(args, scope: str, path: str = "auto", spec=None):
    """Validate (unless ``spec``: validated already), then load ``args.model`` and patch it as the arguments say (a
    folder saved sparsified: its saved weights, the options filled as :func:`fill_sparse_args` says): (model, tok,
    spec)."""
    import countdown

    spec = spec or _validated_method(args)
    model, tok = load_saved_weights(args)
    artifacts = args.artifacts
    if args.build_artifacts:
        from ..data.texts import cache_root

        folder = cache_root() / "artifacts"
        print(f"countdown {args.command}: the {spec.label} artifact at k={args.sparsity:g}: built on first use from "
              f"the library's calibration text, then cached in {folder} (--artifacts FILE: your own)", file=sys.stderr)
        artifacts = countdown.prepare(model, tok, spec, args.sparsity, cache_dir=folder)
    countdown.sparsify(model, spec, None if spec.is_dense else args.sparsity,
                       scope=getattr(args, "scope", None) or scope, artifacts=artifacts, path=path)
    return model, tok, spec


def cmd_models(args) -> int:
    import countdown

    for name, description in countdown.catalogue().items():
        print(f"{name:<20} {description}")
    return 0


def cmd_ppl(args) -> int:
    import countdown

    spec = _validated_method(args)
    texts = load_text_arg(args.texts)  # a wrong --texts stops before the model load
    model, tok, spec = _load_sparsified(args, "decode", spec=spec)  # the metric, not the scope, decides what is sparse
    ppl, tokens = countdown.perplexity(model, tok, texts=texts, max_tokens=args.max_tokens, window=args.window,
                                       metric=args.metric, return_tokens=True)
    result = {"model": args.model, "method": spec.label, "mode": args.mode, "metric": args.metric,
              "sparsity": None if spec.is_dense else args.sparsity, "perplexity": ppl,
              "sparsity_real": None if spec.is_dense else countdown.sparsity_real(model)["mean"],
              "tokens": tokens}  # the text tokens scored, not the --max-tokens asked for
    if args.json:
        print(json.dumps(result))
    else:
        real = "" if spec.is_dense else f"   Sparsity-Real {result['sparsity_real']:.3f}"
        print(f"{spec.label} {args.mode} k={result['sparsity']} metric={args.metric}: perplexity {ppl:.3f}{real}")
    return 0


def cmd_generate(args) -> int:
    import torch

    import countdown
    from .demo import chat_prompt

    model, tok, _ = _load_sparsified(args, "decode")
    ids = chat_prompt(tok, args.prompt).to(next(model.parameters()).device)
    if ids.is_cuda:  # countdown.generate: the fastest step, compiled (static KV cache, CUDA graphs, sparse kernels)
        out, stats = countdown.generate(model, ids, args.max_new_tokens, do_sample=args.temperature > 0,
                                        temperature=args.temperature or 1.0, top_k=args.top_k, seed=args.seed,
                                        eos_token_id=tok.eos_token_id, return_stats=True)
        print(f"{stats['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    else:
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if args.seed is not None:
            torch.manual_seed(args.seed)
        out = model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=args.max_new_tokens,
                             do_sample=args.temperature > 0, temperature=args.temperature or None,
                             top_k=args.top_k, pad_token_id=pad)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return 0


def cmd_eval(args) -> int:
    import countdown

    spec = _validated_method(args)
    model, tok = load_saved_weights(args)
    result = countdown.evaluate(model, tok, args.tasks, limit=args.limit, method=spec,
                                sparsity=None if spec.is_dense else args.sparsity, artifacts=args.artifacts,
                                batch_size=args.batch_size)
    if args.artifacts is not None:
        result["config"]["artifacts"] = str(args.artifacts_path)  # the file, not the object read from it
    if args.json:
        print(json.dumps(result, default=str))
        return 0
    for task, metrics in result["tasks"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, float) and not k.endswith("stderr"))
        print(f"{task:<20} {shown}")
    if result.get("sparsity_real") is not None:
        print(f"Sparsity-Real {result['sparsity_real']:.3f}")
    return 0


def cmd_agreement(args) -> int:
    from ..eval.agreement import agreement

    spec = _validated_method(args)
    model, tok = load_saved_weights(args)
    result = agreement(model, tok, spec, None if spec.is_dense else args.sparsity, artifacts=args.artifacts, max_new_tokens=args.max_new_tokens,
                       judge_url=args.judge_url, judge_model=args.judge_model)
    print(json.dumps(result, indent=2, default=str))
    return 0


def cmd_demo(args) -> int:
    if not args.full:
        from .headline import run_headline

        run_headline(args.model, out_dir=args.out, max_tokens=args.max_tokens, device=args.device)
        return 0
    from .demo import run_demo

    run_demo(args.model, sparsities=args.sparsities, max_tokens=args.max_tokens, out_dir=args.out,
             prac_sparsities=[] if args.no_prac else args.prac_sparsities, device=args.device)
    return 0


def cmd_cost(args) -> int:
    from ..eval.cost import cost_table, format_cost_table

    d_model, d_inter = args.d_model, args.d_inter
    if args.model:
        import countdown

        model, _ = countdown.load_model(args.model)
        first = countdown.find_gated_mlps(model)[0]
        d_model, d_inter = first.d_model, first.d_inter
    if d_model is None or d_inter is None:
        raise ValueError("give --d-model and --d-inter (or --model to read them from a model)")
    d_rank = min(512, d_model) if args.d_rank is None else args.d_rank
    check_at_most("--d-rank", d_rank, f"{args.model}'s d_model" if args.model else "--d-model", d_model,
                  "a predictor's rank is at most its input's width")
    tables = {k: cost_table(d_model, d_inter, d_rank, k, c_act=args.c_act, dtype_bytes=args.dtype_bytes)
              for k in args.sparsity}
    if args.json:
        print(json.dumps({f"{k:g}": t for k, t in tables.items()}, indent=2))
    else:
        for k, table in tables.items():
            print(format_cost_table(table, title=f"d_model={d_model} d_inter={d_inter} d_rank={d_rank} k={k:g}"))
            print()
    return 0


def cmd_analyze(args) -> int:
    import countdown
    from ..eval.analysis import collect_indicator_stats, format_indicator_stats, plot_tornado
    from ..io import atomic_write, claim_output

    check_model_arg(args.model)
    texts = load_text_arg(args.texts)  # read before the model load: a wrong --texts is named at once
    with contextlib.ExitStack() as outputs:  # --plot / --json checked and locked before the model load
        for option, path, what in (("--plot", args.plot, "plot"), ("--json", args.json, "JSON file")):
            if path:
                outputs.enter_context(claim_output(path, option, what))
        model, tok = countdown.load_model(args.model, dtype=args.dtype, device=args.device)
        if texts is None:
            from ..data.texts import eval_texts

            texts = eval_texts()
        stats = collect_indicator_stats(model, tok, texts, sparsities=args.sparsity, max_tokens=args.max_tokens)
        print(format_indicator_stats(stats["overall"]))
        if args.plot:
            print(f"wrote {plot_tornado(stats['overall'], args.plot, title=f'{args.model}: u vs h against s')}")
        if args.json:
            atomic_write(args.json, json.dumps(stats, indent=2, default=float), what="JSON file", option="--json")
            print(f"wrote {args.json}")
    return 0


TEXTS_HELP = "held-out text: xsum (default), wiki, or a .txt/.jsonl file (a source name if it is one, else a path)"


def parse_args(argv: list[str] | None):
    """The parsed arguments, or the exit status where the parse ended (2 for a bad argument, its one-line message
    already printed; 0 after --help)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 2


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ..options import DEVICE_RULE

    parser = Parser(prog="countdown", description=__doc__,
                    epilog=f"Every command that loads a model takes --device ({DEVICE_RULE}; the default) and "
                           "--dtype (mostly auto: bf16 on cuda, fp32 on cpu). `countdown <command> --help` lists a "
                           "command's options and their defaults.")
    parser.add_argument("--version", action="version", version=f"countdown {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the sparsification methods")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("models", help="list the catalogue of models (real ones and paper-scale shapes)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("ppl", help="perplexity of a (sparsified) model on held-out text")
    add_model_args(p)
    # the default: the configuration the operating-point tables recommend (docs/results.md, within +5 %)
    add_sparse_args(p, default_scope=None, method="dual[shadow4]", sparsity=0.5, built_artifacts=True)
    p.add_argument("--metric", default="all", choices=["all", "decode"],
                   help="all: every position scored, every position sparse (the papers' convention); decode: the "
                        "first half of each window a dense prompt, the second half sparse and scored (default all)")
    add_number(p, "--max-tokens", range="max_tokens", default=8192, help="tokens of held-out text (default 8192)")
    add_number(p, "--window", range="window", default=512,
               help="tokens per forward window, at most the model's positions (default 512)")
    p.add_argument("--texts", default=None, help=TEXTS_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a line of text)")
    p.set_defaults(func=cmd_ppl)

    add_prac_commands(sub)

    p = sub.add_parser("generate", help="generate from a prompt, prompt dense and new tokens sparse")
    add_model_args(p)
    add_sparse_args(p)
    p.add_argument("--prompt", required=True, help="the user message (required)")
    add_number(p, "--max-new-tokens", range="max_new_tokens", default=64, help="tokens to generate (default 64)")
    add_number(p, "--temperature", range="temperature", default=0.0,
               help="sampling temperature; 0 = greedy (default 0)")
    add_number(p, "--top-k", range="top_k", default=None,
               help="sample from the k most likely tokens (default: all)")
    add_number(p, "--seed", range="seed", default=None, help="sampling seed (default: not seeded)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="downstream tasks through lm-evaluation-harness (prompt dense, continuation sparse)")
    add_model_args(p)
    add_sparse_args(p)
    p.add_argument("--tasks", default="arc_easy", help="comma-separated offline task names (default arc_easy)")
    add_number(p, "--limit", range="limit", default=None,
               help="first N items of each task, or this fraction of them (default: all)")
    add_number(p, "--batch-size", range="batch_size", default=8, help="lm-eval batch size (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("agreement", help="agreement with the dense model: match rate, KL, top-1 (optional judge)")
    add_model_args(p)
    add_sparse_args(p)
    add_number(p, "--max-new-tokens", range="max_new_tokens", default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--judge-url", default=None, help="OpenAI-compatible endpoint for a pairwise judge (default: none, no judge)")
    p.add_argument("--judge-model", default=None, help="model name at --judge-url (default: the endpoint's own)")
    p.set_defaults(func=cmd_agreement)

    from ..eval.sweep import add_arguments as sweep_arguments, sweep_from_args

    p = sub.add_parser("sweep", help="quality sweep: methods x modes x k on lm-eval tasks, perplexity and agreement (resumable)")
    sweep_arguments(p)
    p.set_defaults(func=sweep_from_args)

    from ..bench.cli import add_arguments as bench_arguments, bench_from_args
    bench_arguments(sub.add_parser("bench", help="speed and quality of each configuration on your model and machine, "
                                   "with a recommendation")).set_defaults(func=bench_from_args)

    from .serve import add_arguments as serve_arguments, cmd_serve
    serve_arguments(sub.add_parser("serve", help="an OpenAI-compatible server (transformers') on a countdown model, "
                                   "e.g. a folder countdown.save wrote")).set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="the main job: dense against the recommended practical configuration "
                                     "(quality, text, speed); --full: every method at several sparsities")
    p.add_argument("--model", default="smollm2-135m", help="model to run (default smollm2-135m)")
    add_device_arg(p)
    p.add_argument("--full", action="store_true",
                   help="the full grid: every method, SP-Ideal and SP-Prac, at several k (about 13 min on 2 cores)")
    add_number(p, "--sparsities", range="sparsities", default="0.5,0.7,0.8,0.9",
               help="with --full: k for the SP-Ideal rows (default 0.5,0.7,0.8,0.9)")
    add_number(p, "--max-tokens", range="max_tokens", default=2048, help="tokens of XSum per perplexity (default 2048)")
    p.add_argument("--out", default="demo_out", type=path_option, help="folder for demo.md / demo.csv / demo.png (default demo_out)")
    add_number(p, "--prac-sparsities", range="sparsities", default="0.7,0.8,0.9",
               help="k for the SP-Prac rows (default 0.7,0.8,0.9)")
    p.add_argument("--no-prac", action="store_true",
                   help="SP-Ideal rows only, no calibration or training (default: SP-Prac rows too)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("cost", help="theoretical FLOPs and memory traffic of each method (the paper's appendix)")
    add_number(p, "--d-model", range="d_model", help="hidden size (default: from --model; one of the two is needed)")
    add_number(p, "--d-inter", range="d_inter", help="Gated-MLP width (default: from --model)")
    add_number(p, "--d-rank", range="d_rank", default=None,
               help="predictor rank for dual / dejavu, at most d_model (default 512, or d_model where smaller)")
    add_number(p, "--sparsity", range="sparsity", nargs="+", default=[0.7, 0.8, 0.9],
               help="k values (default 0.7 0.8 0.9)")
    add_number(p, "--c-act", range="c_act", default=5.0, help="FLOPs per activation (SiLU ~ 5; default 5)")
    add_number(p, "--dtype-bytes", range="dtype_bytes", default=None,
               help="add real bytes for this element size (default: none, FLOPs and elements only)")
    p.add_argument("--model", default=None, help="read d_model / d_inter from this model instead (default none)")
    p.add_argument("--json", action="store_true", help="print JSON (default: tables)")
    p.set_defaults(func=cmd_cost)

    p = sub.add_parser("analyze", help="CIF / CAF of u and h against s (M-CountDown vs CATS analysis)")
    add_model_args(p)
    add_number(p, "--sparsity", range="sparsity", nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9],
               help="k values (default 0.5 0.6 0.7 0.8 0.9)")
    add_number(p, "--max-tokens", range="analysis_tokens", default=2048, help="tokens of text (default 2048)")
    p.add_argument("--texts", default=None, help=TEXTS_HELP)
    p.add_argument("--plot", default=None, type=path_option, help="write the tornado plot to this PNG (default: no plot)")
    p.add_argument("--json", default=None, type=path_option, help="write all figures (per layer too) to this JSON file (default: none)")
    p.set_defaults(func=cmd_analyze)
    _state_defaults(sub)
    return parser


def _state_defaults(sub) -> None:
    """Append "(default X)" to every option's help that does not state its default (a command
    registered from another module included); flags are off unless given."""
    for command in sub.choices.values():
        for action in command._actions:
            default = action.default
            if (not action.option_strings or action.required or isinstance(action, argparse._HelpAction)
                    or default in (None, False, argparse.SUPPRESS) or "default" in (action.help or "").lower()):
                continue
            shown = ",".join(str(v) for v in default) if isinstance(default, (list, tuple)) else str(default)
            action.help = f"{action.help} (default {shown})" if action.help else f"default {shown}"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's stop, ``kill``): unwinds like Ctrl-C, so every writer removes its temporary
    file and the previous output stays as it was."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """While a command runs, SIGTERM raises :class:`Terminated` in the main thread instead of ending the
    process where it stands (the default)."""
    import signal
    import threading

    got: list[int] = []  # the signals received (a handler further down may re-raise them as KeyboardInterrupt)
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def stop(signum, frame):
        got.append(signum)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    from ..data.texts import PackageUnavailableError
    from ..io import LockedError, UnwritableError, describe_os_error, os_error_of
    from ..data.models import CorruptDownloadError
    from ..patch.state import AlreadySparsifiedError, NotSparsifiedError

    args = parse_args(argv)
    if isinstance(args, int):
        return args
    got: list[int] = []
    try:
        with _sigterm_unwinds() as got, warnings_as_lines(args.command):
            return args.func(args)
    except KeyboardInterrupt as err:
        # Ctrl-C / SIGTERM: say what is safe and how to go on, not a traceback
        detail = shell_advice(str(err)) or "nothing of this run was saved except what it reported as written"
        how = "terminated (SIGTERM)" if got or isinstance(err, Terminated) else "interrupted"
        print(f"countdown {args.command}: {how}: {detail}", file=sys.stderr)
        return 143 if how != "interrupted" else 130
    except (ValueError, TypeError, FileNotFoundError, PackageUnavailableError, CorruptDownloadError,
            AlreadySparsifiedError, NotSparsifiedError, LockedError, UnwritableError) as err:
        print(f"countdown {args.command}: error: {shell_advice(str(err))}", file=sys.stderr)
        return 2
    except Exception as err:  # an OS error (disk full, read-only, permission, ...) from anywhere: one line
        if os_error_of(err) is None:
            raise
        print(f"countdown {args.command}: error: {describe_os_error(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
