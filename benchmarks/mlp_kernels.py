"""The kernel table: one sparse Gated-MLP per call against dense cuBLAS and its roofline, CUDA-graph timing.

    PYTHONPATH=src python benchmarks/mlp_kernels.py --out DIR --sweep   # produced results/kernels.md (H200, 2026-11-21)
    PYTHONPATH=src python benchmarks/mlp_kernels.py --compile-check     # no GPU: every variant compiled for sm_90
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/mlp_kernels.py --shapes tiny --batches 1 --ks 0.8 --out /tmp/k
                                                                    # CPU smoke test of this script

Per model shape (Llama-3.1-8B, Qwen2.5-14B, gemma-2-9b with GELU-tanh, phi-4), batch (1, 2, 4, 8) and target
sparsity k, bf16: dense cuBLAS, the optimal and naive gathers, cats / mono / dual (predictor included) and
dual_excl (its mask given) through the public ops (rows: ``harness.kerneltable``). Each timing is the
median over graph replays of 8 back-to-back calls cycling through 4 weight sets and 8 inputs (more than 1 GB
per shape, far past L2; ``harness.mlpbench``); roofline = the bytes a method must read over the copy
bandwidth of the same run. Every op is first checked against float64 at the real shapes
(``harness.kernelchecks``) and a wrong one is not timed; ``--sweep`` first picks the launch
configurations and where the indicator is computed. Writes kernels.csv / kernels.md / kernels.png (and
kernels_sweep.json) under ``--out``; prints the main shape's batch-1 rows with their ratios (x roofline,
speed-up over dense).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import sys
import time

import torch

import countdown.kernels as K
from countdown.kernels.config import launch_config
from harness.kernelchecks import CHECK_OK, check_real_shapes
from harness.kerneltable import bench_shape, plot, sweep, write_outputs
from harness.mlpbench import DEV, DOWN_SWEEP, GLU_SWEEP, MAIN, SHAPES, log
from harness.sm90 import compile_check
from harness.timing import copy_bandwidth


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--shapes", nargs="*", default=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--ks", nargs="*", type=float, default=[0.5, 0.7, 0.8, 0.9, 0.95])
    ap.add_argument("--rank", type=int, default=512, help="D-CountDown predictor rank")
    ap.add_argument("--sweep", action="store_true", help="first compare the candidate kernel configs")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-variants", action="store_true", help="skip the per-token variants")
    ap.add_argument("--plot-only", help="re-plot from a kernels.csv")
    ap.add_argument("--compile-check", action="store_true",
                    help="no GPU: compile every kernel variant for sm_90 and report registers / spills")
    ap.add_argument("--defaults-only", action="store_true", help="with --compile-check: default configs only")
    args = ap.parse_args()
    if args.compile_check:
        sys.exit(0 if compile_check(args.shapes, args.defaults_only) else 1)
    if args.plot_only:
        rows = list(csv.DictReader(open(args.plot_only)))
        for r in rows:
            r["batch"] = int(r["batch"])
        plot(rows, os.path.join(os.path.dirname(args.plot_only), "kernels.png"))
        return
    if DEV == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1" and args.shapes == ["tiny"], \
            "without a GPU only a smoke test runs: TRITON_INTERPRET=1 ... --shapes tiny"
    import triton

    t0 = time.time()
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke test)"
    log(f"device {dev}, torch {torch.__version__}, triton {triton.__version__}")
    bw = 1e10 if DEV == "cpu" else copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    os.makedirs(args.out, exist_ok=True)
    main_shape = MAIN if MAIN in args.shapes else args.shapes[0]
    sweep_out = {}
    winners = contextlib.ExitStack()  # the sweep's launch configurations, for the rest of the run
    if args.sweep:  # candidates are checked against the default configuration's output
        best, srows = sweep(args.rank, main_shape)
        sweep_out.update(glu={str(b): c for b, c in GLU_SWEEP.items()}, down={str(b): c for b, c in DOWN_SWEEP.items()},
                         rows=srows, best={f"{a}_b{b}": c for (a, b), c in best.items()})
        # use the winners for the rest of the run: batch 1's for one token, batch 8's for more
        winners.enter_context(K.overrides(launch={
            ("chain_gate_up" if kind == "glu" else "chain_down", 1 if batch == 1 else 16): cfg
            for (kind, batch), cfg in best.items()}))
        log(f"sweep done at {time.time() - t0:.0f}s: {best}")
    check_names = [n for n in (MAIN, "gemma-2-9b") if n in args.shapes] or args.shapes[:1]
    if not args.no_check:  # with the configurations that will be timed
        all_ok = check_real_shapes(check_names)
        log(f"checks done at {time.time() - t0:.0f}s: {'all ok' if all_ok else 'SOME KERNEL IS WRONG: not timed'}")
        if not all(CHECK_OK.get(f"{m}[cublas]", True) for m in ("mono", "cats", "dual", "dual_excl")):
            log("REFUSING TO TIME: a default kernel is wrong at real shapes")
            sys.exit(1)
    if args.sweep:
        sweep_out["check_ok"] = CHECK_OK
        with open(os.path.join(args.out, "kernels_sweep.json"), "w") as f:
            json.dump(sweep_out, f, indent=1)
    configs = dict(glu={b: launch_config("chain_gate_up", bucket=b) for b in (1, 16)},
                   down={b: launch_config("chain_down", bucket=b) for b in (1, 16)})
    rows = []
    meta = dict(device=dev, date=datetime.date.today().isoformat(), bw=bw, rank=args.rank,
                command="PYTHONPATH=src python benchmarks/mlp_kernels.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__, triton=triton.__version__, configs=json.dumps(configs))
    for name in args.shapes:
        rows += bench_shape(name, args.batches, args.ks, args.rank, bw, dev, not args.no_variants)
        write_outputs(rows, args.out, meta)  # after each shape, so a cut-off run keeps what it measured
        log(f"{name} done at {time.time() - t0:.0f}s")
    log(f"\n{dev}, copy bandwidth {bw / 1e12:.2f} TB/s, total {time.time() - t0:.0f}s")
    log(f"configs {json.dumps(configs)}")
    log(f"{'shape':13s} {'b':>2s} {'k':>5s} {'method':24s} {'us':>7s} {'roof':>6s} {'xroof':>5s} {'speedup':>7s}")
    for r in rows:
        if r["shape"] in (MAIN, "tiny") and r["batch"] == 1 and r["sparsity"] in (0.0, 0.7, 0.8, 0.9):
            log(f"{r['shape']:13s} {r['batch']:2d} {r['sparsity']:5.2f} {r['method']:24s} {r['us']:7.1f} "
                f"{r['roofline_us']:6.1f} {r['us'] / r['roofline_us']:5.2f} {r['speedup']:7.2f}")


if __name__ == "__main__":
    main()
