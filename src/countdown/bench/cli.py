"""``countdown bench``: speed and quality of each configuration on the user's own model and machine.

    countdown bench --model smollm2-135m --methods mono,cats,dual[hybrid] --sparsity 0.7,0.8,0.9 --out bench_out
    countdown bench --model smollm2-135m --methods 'dual[shadow4],dual[mixed]' -k 0.8,0.9   # skip, or refine
    countdown bench --model llama-3.1-8b-shape            # random weights: speed only, and it says so
    countdown bench --model smollm2-135m --int4           # and the model in 4 bits, dense

A ``dual[mixed]`` spec (each token's top rows at 8 bits, the rest at 4: docs/mixed.md) runs on a copy of the model
with its MLPs nested and every other Linear in 4 bits, beside the dense 4-bit model (``countdown.quantize``, the
same group) and the skipping specs on the model as loaded; the recommendation picks among all of them.
Writes ``<out>/<model>.csv`` / ``.md`` / ``.png`` (columns model, method, sparsity, sparsity_real,
ppl_increase, kl, decode_speedup, device, date, ..., mlp_bits, run) and prints the table (per row: bits read per
MLP weight, speed-up, perplexity increase, all against the model as loaded) and a one-line recommendation. The CSV keeps the rows of every run into the folder (``run`` says which), the report and plot
show the latest run. :func:`add_arguments` and :func:`bench_from_args` are what ``countdown.cli`` registers.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from ..options import Parser, add_device_arg, add_number, path_option

DEFAULT_METHODS = "mono,cats,dual[hybrid],dual[lowrank],dual[shadow4],teal,dual[mixed]"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``countdown bench`` (see the module docstring)."""
    parser.add_argument("--model", default="smollm2-135m",
                        help="a catalogue name (`countdown models`), a .gguf file, a HF folder or a hub id; a "
                             "'*-shape' name gets random weights and a speed-only report")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="method specs (countdown.spec), e.g. mono,cats,dual[hybrid],dual[lowrank],dual[shadow4],teal "
                             "(a spec this library cannot run is refused, listing the valid ones); dual[mixed] runs "
                             "on a copy with its MLPs nested 8/4-bit and the other Linears 4-bit, beside the dense "
                             "4-bit model")
    add_number(parser, "--sparsity", "-k", range="sparsities", default=[0.7, 0.8, 0.9], help="target sparsities k")
    parser.add_argument("--out", default="bench_out", type=path_option, help="folder for <model>.csv / .md / .png")
    add_device_arg(parser)
    parser.add_argument("--dtype", default=None, help="bf16 / fp16 / fp32 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--texts", default=None, help="held-out text for quality: xsum (default), wiki or a .txt/.jsonl "
                                                      "(a source name if it is one, else a path)")
    parser.add_argument("--calib-texts", default=None, help="calibration / training text: a source name or a "
                                                            ".txt/.jsonl (default: the library's)")
    add_number(parser, "--calib-tokens", range="num_tokens", default=None,
               help="calibration / training tokens (default: the library's)")
    add_number(parser, "--ppl-tokens", range="max_tokens", default=4096,
               help="held-out tokens for perplexity, KL and top-1, at least one --window")
    add_number(parser, "--window", range="window", default=512,
               help="perplexity window (its first half a dense prompt), at most the model's positions")
    add_number(parser, "--batch", range="batch", default=1, help="rows decoded at once in the speed test")
    add_number(parser, "--prompt", range="prompt", default=64, help="prompt length of the speed test (random tokens)")
    add_number(parser, "--new-tokens", range="max_new_tokens", default=128, help="tokens generated per speed test")
    add_number(parser, "--samples", range="samples", default=3,
               help="rounds of alternated speed tests (dense, then every configuration once; dense again after the "
                    "last): each speed-up is the median of the rounds' ratios, printed with their min and max")
    add_number(parser, "--max-ppl-increase", range="max_ppl_increase", default=0.05,
               help="the recommendation's quality bound: relative perplexity increase (0.05 = 5 %%)")
    parser.add_argument("--artifacts-dir", default=None, type=path_option, help="SP-Prac artifact cache (default <countdown cache>/artifacts)")
    parser.add_argument("--speed-only", action="store_true", help="skip quality; speed-only artifacts")
    parser.add_argument("--plain-step", action="store_true",
                        help="CUDA: time transformers' own attention and Inductor's GEMVs instead of the fastest step "
                             "(countdown.decode.linears.fastest_step: fused attention, every projection on the fixed GEMV)")
    parser.add_argument("--int4", action="store_true",
                        help="also the model in 4 bits (countdown.quantize: every Linear and lm_head, RTN, the "
                             "dual[mixed] specs' group, else 64), dense: its quality against the model as loaded and "
                             "its speed on the same harness (measured anyway where a dual[mixed] spec is)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _load(args):
    import torch

    import countdown
    from ..data.models import shape_names

    device = args.device
    dtype = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    random_weights = args.model in shape_names()
    model, tok = countdown.load_model(args.model, dtype=dtype, device=device,
                                      **({"random_weights": True} if random_weights else {}))
    return model.eval(), tok, random_weights


def _is_folder(name: str) -> bool:
    from ..data.models import model_source

    try:
        return model_source(name)[0] == "folder"
    except (ValueError, FileNotFoundError):
        return False


def _command(args) -> str:
    argv = getattr(args, "argv", None)
    if argv is not None:  # python -m countdown.bench.cli
        return "countdown bench " + " ".join(shlex.quote(a) for a in argv)
    return "countdown " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def bench_from_args(args) -> int:
    """Run ``countdown bench`` with parsed ``args``; returns the exit status."""
    from ..spec import parse_specs

    try:
        specs = parse_specs(args.methods)
    except ValueError as error:
        print(f"countdown bench: {error}", file=sys.stderr)
        return 2
    if not args.speed_only and args.ppl_tokens < args.window - 1:
        print(f"countdown bench: error: --ppl-tokens {args.ppl_tokens} is less than one --window of {args.window} "
              f"(the window less its BOS): give --ppl-tokens >= {args.window - 1} or a smaller --window",
              file=sys.stderr)
        return 2
    import countdown

    try:  # read now: a wrong --texts / --calib-texts is named before the model load
        texts = countdown.load_texts(args.texts) if args.texts else None
        calib_texts = countdown.load_texts(args.calib_texts) if args.calib_texts else None
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"countdown bench: error: {error}", file=sys.stderr)
        return 2
    from ..io import check_writable_dir, read_table
    from .operating import COLUMNS, NEW_COLUMNS

    # the outputs are checked before the model loads, not after the measurements; the table is locked only while
    # this run adds its rows to it (runs into one folder proceed side by side and keep every row)
    check_writable_dir(args.out, "--out")
    read_table(_table(args), COLUMNS, "bench table", NEW_COLUMNS)  # a file there that is no bench table is refused now
    if args.artifacts_dir is not None and not args.speed_only:
        check_writable_dir(args.artifacts_dir, "--artifacts-dir")
    return _bench(args, specs, texts, calib_texts)


def _table(args):
    from pathlib import Path

    return Path(args.out) / f"{str(args.model).replace('/', '_')}.csv"


def _bench(args, specs, texts, calib_texts) -> int:
    from .operating import COLUMNS, NEW_COLUMNS, BenchSettings, operating_points, write_operating_points

    model, tok, random_weights = _load(args)
    speed_only = args.speed_only or tok is None
    if speed_only:
        why = ("--speed-only" if args.speed_only and tok is not None else "the model folder has no tokenizer"
               if not random_weights and _is_folder(args.model) else "random weights (a paper-scale shape)")
        print(f"countdown bench: {args.model}: speed only ({why}): quality columns are not measured; "
              "SP-Prac artifacts are speed-only (random predictors, cuts fitted on the model's own decode steps)")
    settings = BenchSettings(
        specs=specs, ks=list(args.sparsity), texts=texts, calib_texts=calib_texts,
        calib_tokens=args.calib_tokens, ppl_tokens=args.ppl_tokens, window=args.window, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens,
        samples=args.samples, artifacts_dir=args.artifacts_dir, speed_only=speed_only, fast_step=not args.plain_step,
        int4=args.int4)
    skipped: list[str] = []

    def log(message: str) -> None:
        if message.startswith("skipping "):
            skipped.append(message[len("skipping "):])
        print(f"countdown bench: {message}", file=sys.stderr)

    rows = operating_points(model, None if speed_only else tok, settings, model_name=args.model, log=log,
                            progress=not args.no_progress)
    meta = {"model": args.model, "prompt": args.prompt, "samples": args.samples, "skipped": skipped,
            "step": "plain" if args.plain_step else "fastest (fused attention, fixed GEMVs) on CUDA",
            "command": _command(args)}
    from ..io import adding_rows

    with adding_rows(_table(args), COLUMNS, "bench table", "--out", optional=NEW_COLUMNS) as (work, added):  # earlier runs' rows kept
        paths = write_operating_points(rows, str(work), meta, args.max_ppl_increase, columns=COLUMNS)
        added.extend(rows)
    paths = {key: value if key == "recommendation" else f"{args.out}/{os.path.basename(value)}"
             for key, value in paths.items()}
    from .opreport import label, spread

    width = max([16] + [len(label(r)) for r in rows])
    print(f"{'method':{width}s} {'k':>4s} {'real':>6s} {'bits/MLP w':>10s} {'ppl +%':>8s} {'KL':>7s} "
          f"{'speed-up (min-max)':>20s} {'tok/s':>8s}")
    for r in rows:
        inc = "-" if r["ppl_increase"] in ("", None) else f"{100 * r['ppl_increase']:+.1f}"
        kl = "-" if r["kl"] in ("", None) else f"{r['kl']:.3f}"
        bits = "-" if r.get("mlp_bits") in ("", None) else f"{r['mlp_bits']:.2f}"
        low, high = spread(r)
        speed = f"{r['decode_speedup']:.2f}x ({low:.2f}-{high:.2f})"
        print(f"{label(r):{width}s} {r['sparsity']:4g} {r['sparsity_real']:6.3f} {bits:>10s} {inc:>8s} {kl:>7s} "
              f"{speed:>20s} {r['tokens_per_s']:8.1f}")
    print("bits/MLP w: bits a decode step reads per MLP weight (scales and selectors included); speed-up and "
          "ppl +% against the model as loaded")
    print(paths["recommendation"])
    if not speed_only:  # the recommended spec, pasteable into the API and the command line
        for line in usage_lines(rows, args.max_ppl_increase, args.model):
            print(line)
    print(f"wrote {paths['csv']}, {paths['markdown']}, {paths['plot']}")
    return 0


def usage_lines(rows: list[dict], max_ppl_increase: float, model_name: str) -> list[str]:
    """How to run the recommended configuration, pasteable: the Python API and, where the command line builds it,
    the shell (the same spec in both; the artifacts built once, then passed). The dense 4-bit row and a dual[mixed]
    row (its other Linears 4-bit) are built in Python; ``countdown.save`` then gives a folder every command runs."""
    from ..artifacts.prepare import TRAINED
    from ..spec import parse_spec
    from .opreport import recommended

    best = recommended(rows, max_ppl_increase)
    if best is None:
        return []
    if best["method"] == "dense":  # the dense 4-bit row (the reference is never recommended)
        return [f"  Python: countdown.quantize(model, group={best.get('group') or 64}, lm_head=True)",
                "          countdown.save(model, \"my-model-int4\", tokenizer)   # then: countdown generate --model "
                "my-model-int4 --prompt '...'"]
    spec, k = parse_spec(best["method"]).resolved(), f"{best['sparsity']:g}"
    label, model = shlex.quote(spec.label), shlex.quote(model_name)
    if spec.kind == "mixed":
        g = spec.options.get("group", 64)
        return [f"  Python: art = countdown.prepare(model, tokenizer, \"{spec.label}\", {k})   # the MLPs nested "
                "8-bit, cuts calibrated",
                f"          countdown.quantize(model, group={g}, lm_head=True)   # every other Linear 4-bit",
                f"          countdown.sparsify(model, \"{spec.label}\", {k}, artifacts=art)",
                "          countdown.save(model, \"my-model-mixed\", tokenizer)   # then: countdown generate --model "
                "my-model-mixed --prompt '...'"]
    build = "train" if spec.kind in TRAINED else "calibrate"
    out = f"{spec.slug}-k{k}.safetensors"
    return [f"  Python: countdown.sparsify(model, \"{spec.label}\", {k}, "
            f"artifacts=countdown.prepare(model, tokenizer, \"{spec.label}\", {k}))",
            f"  shell:  countdown {build} --model {model} --method {label} -k {k} --out {out}",
            f"          countdown generate --model {model} --method {label} -k {k} --artifacts {out} "
            "--prompt '...'"]


def main(argv=None) -> int:
    """``python -m countdown.bench.cli ...`` (the same as ``countdown bench ...``)."""
    parser = add_arguments(Parser(prog="countdown bench", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return bench_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
