"""Operating points per real model: what speed at what quality (issue 15), in three steps.

    # 1. quality on the CPU (long; resumable; every k of every practical configuration, XSum held out)
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/operating_points.py quality \\
        --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b
    # 2. speed on one GPU, one call (the decode benchmark, one compile for every configuration); the
    #    masks the quality step saved (results/operating_points/quality/masks, not in git) travel in a
    #    carry folder:
    PYTHONPATH=src python benchmarks/decode.py --out $OUT --new-tokens 256 --masks <copy of that folder>
    # 3. merge: results/operating_points/<model>.csv / .md / .png and the recommendation per model
    PYTHONPATH=src python benchmarks/operating_points.py merge --speed results/decode_runs/<run>

results/operating_points/<model>.csv / .md / .png (2026-11-25): step 1 with the models above; step 2 as
``--out /root/out/ops --ks 0.5,0.6,0.7,0.8,0.9 --new-tokens 256 --no-breakdown --budget-s 380`` (H200, run
results/decode_runs/H200-run-BK); step 3 with ``--speed results/decode_runs/H200-run-BK``.

Quality (``harness.qualitygrid``): decode-style perplexity increase over dense, KL(dense ||
sparse) and top-1 agreement on the same positions, Sparsity-Real, on 2,048 held-out XSum tokens;
SP-Prac artifacts for k = 0.5 ... 0.9 through ``countdown.ensure_artifacts`` (calibration text:
Wikipedia passages, never XSum; cached and shared with the lm-eval sweep). Speed
(``harness.onecompile``): the Llama-3.1-8B shape with random weights, bf16, batch 1.
Merge (``harness.merge``): each row's speed is read off the 8B-shape curve of its method at
the Sparsity-Real measured on the real model (linear interpolation between the timed kept fractions).
"""

from __future__ import annotations

import argparse
import sys
import time

T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {message}", flush=True)


def quality(args) -> int:
    from harness.qualitygrid import run_quality_grid

    for name in [m for m in args.models.split(",") if m.strip()]:
        path = run_quality_grid(name.strip(), specs=args.methods, ks=[float(k) for k in args.ks.split(",")],
                                out_dir=args.out, max_tokens=args.tokens, window=args.window,
                                artifacts_dir=args.artifacts_dir, masks=not args.no_masks, log=log)
        log(f"{name}: {path}")
    return 0


def merge(args) -> int:
    from harness.merge import merge_operating_points

    written = merge_operating_points(args.speed.split(","), quality_dir=args.quality, out_dir=args.out,
                                     sweep_dir=args.sweep, models=args.models.split(",") if args.models else None,
                                     max_ppl_increase=args.max_ppl_increase,
                                     harnesses=tuple(args.harness.split(",")), note=args.note, log=log)
    for model, paths in written.items():
        print(f"{model}: {paths['recommendation']}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quality", help="the quality columns on the CPU (resumable)")
    q.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    q.add_argument("--methods", default="mono,cats,dual,dual[hybrid],dual[lowrank],dejavu,teal",
                   help="method specs (countdown.spec); those this library cannot build are skipped")
    q.add_argument("--ks", default="0.5,0.6,0.7,0.8,0.9")
    q.add_argument("--tokens", type=int, default=2048, help="held-out XSum tokens (as the demo)")
    q.add_argument("--window", type=int, default=512)
    q.add_argument("--artifacts-dir", default=None, help="default <countdown cache>/artifacts (shared with the sweep)")
    q.add_argument("--no-masks", action="store_true", help="do not save the k=0.8 masks for the replay check")
    q.add_argument("--out", default="results/operating_points/quality")
    q.set_defaults(func=quality)
    m = sub.add_parser("merge", help="join quality and speed into results/operating_points/<model>.csv/.md/.png")
    m.add_argument("--speed", required=True, help="comma-separated result folders of the speed run (decode.csv)")
    m.add_argument("--quality", default="results/operating_points/quality")
    m.add_argument("--sweep", default="results/quality", help="lm-eval sweep results (task scores where it has them)")
    m.add_argument("--models", default=None, help="default: every model with a quality table")
    m.add_argument("--max-ppl-increase", type=float, default=0.05)
    m.add_argument("--harness", default="one-compile,one-compile-eager",
                   help="decode rows that make the speed curves (compile-cdt: the earlier per-compile runs)")
    m.add_argument("--note", default="", help="a first line for each table and plot (e.g. that the speed is a trial's)")
    m.add_argument("--out", default="results/operating_points")
    m.set_defaults(func=merge)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
