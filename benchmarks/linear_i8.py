"""The fixed GEMV with int8 rows (kernels/_linear.py ``w_scale``) against bf16 rows, for a rank-512 predictor's two
factors at the Llama-3.1-8B shape (A^T [512, 4096], B^T [14336, 512]), one token, over launch configurations.

    PYTHONPATH=src python benchmarks/linear_i8.py [--json]

Prints us a call (CUDA-graph replays over 8 weight sets) for bf16 at its default and int8 at each (BN, num_warps);
``--json`` prints last the fastest int8 configuration per shape as COUNTDOWN_LINEAR_I8_CONFIG's JSON.
"""

import argparse
import json

import torch

from countdown.bench import time_graph
from countdown.kernels import _linear
from countdown.kernels.quant import quantize_rows_int8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/linear_i8.py times CUDA kernels: run it on a GPU machine")
    best = {}
    for name, (n, k) in {"short": (512, 4096), "narrow": (14336, 512)}.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(8)]
        qs = [quantize_rows_int8(w) for w in ws]
        ref = time_graph([lambda w=w: _linear.decode_linear(x, w) for w in ws] * 4)
        mb = n * k * 2 / 1e6
        print(f"{name} [{n}, {k}] bf16 default {ref:.2f} us ({mb:.1f} MB)")
        err = (_linear.decode_linear(x, qs[0][0], w_scale=qs[0][1]).float() - _linear.decode_linear(x, ws[0]).float())
        print(f"  int8 vs bf16 output: max |diff| {float(err.abs().max()):.3g}")
        times = {}
        for bn in (1, 2, 4, 8, 16, 32):
            for warps in (1, 2, 4, 8):
                cfg = {"BN": bn, "num_warps": warps}
                try:
                    t = time_graph([lambda q=q, sc=sc: _linear.decode_linear(x, q, config=cfg, w_scale=sc)
                                    for q, sc in qs] * 4)
                except Exception as error:  # a configuration the compiler refuses: skip it
                    print(f"  int8 BN {bn} warps {warps}: {type(error).__name__}")
                    continue
                times[(bn, warps)] = t
        for (bn, warps), t in sorted(times.items(), key=lambda kv: kv[1])[:6]:
            print(f"  int8 BN {bn:2d} warps {warps}: {t:.2f} us ({ref / t:.2f}x bf16)")
        (bn, warps), t = min(times.items(), key=lambda kv: kv[1])
        best[name] = {"BN": bn, "num_warps": warps}
    if args.json:
        print(json.dumps(best))


if __name__ == "__main__":
    main()
