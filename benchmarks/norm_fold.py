"""The input RMSNorm folded into the QKV GEMV (kernels/_linear.py, countdown.decode.layer) against the norm
as its own kernel before the GEMV.

    PYTHONPATH=src python benchmarks/norm_fold.py [--out DIR]

Llama-3.1-8B shapes, bf16, one token, on a GPU: x [1, 4096], g [4096], W_qkv [6144, 4096] (and W_o
[4096, 4096]). Checks each route against float64 first, then times as CUDA-graph replays over 8 weight
sets (median us): the norm compiled by Inductor (what a compiled decode step ran) then the fixed GEMV;
the folded op at its default and at other row blocks / warps. Prints the table; ``--out`` writes it as
norm_fold.md.
"""

import argparse
import datetime
import os

import torch

from countdown.bench import time_graph
from countdown.kernels import _linear

CONFIGS = [{}, dict(BN=1), dict(BN=2, num_warps=4), dict(BN=4), dict(BN=4, num_warps=4), dict(BN=8, BK=2048, num_warps=4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/norm_fold.py times CUDA kernels: run it on a GPU machine")
    torch.manual_seed(0)
    d, eps = 4096, 1e-5
    lines = [f"# RMSNorm folded into the fixed GEMV ({torch.cuda.get_device_name()}, {datetime.date.today()})", "",
             "`PYTHONPATH=src python benchmarks/norm_fold.py`; one token, bf16, CUDA-graph replays over 8 weight sets, "
             "median us.", "", "| GEMV | route | config | us | max rel. error vs float64 |", "|---|---|---|---|---|"]
    for name, n in (("QKV [6144, 4096]", 6144), ("O [4096, 4096]", 4096)):
        ws = [(torch.randn(n, d, device="cuda") / d**0.5).to(torch.bfloat16) for _ in range(8)]
        gs = [(1 + 0.3 * torch.randn(d, device="cuda")).to(torch.bfloat16) for _ in range(8)]
        xs = [torch.randn(1, d, device="cuda").to(torch.bfloat16) * 3 for _ in range(8)]

        def norm(x, g):
            xf = x.float()
            return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        cnorm = torch.compile(norm, options={"coordinate_descent_tuning": True})
        exact = [_linear.decode_linear_ref(x, w, None, None, g, eps).double() for x, w, g in zip(xs, ws, gs)]

        def err(ys):
            return max(((y.double() - e).abs() / e.abs().clamp_min(0.05)).max().item() for y, e in zip(ys, exact))

        sep = [_linear.decode_linear(cnorm(x, g), w) for x, w, g in zip(xs, ws, gs)]
        us = time_graph([lambda i=i: _linear.decode_linear(cnorm(xs[i], gs[i]), ws[i]) for i in range(8)])
        lines.append(f"| {name} | Inductor norm + fixed GEMV | default | {us:.2f} | {err(sep):.2e} |")
        us = time_graph([lambda i=i: _linear.decode_linear(xs[i], ws[i]) for i in range(8)])
        lines.append(f"| {name} | fixed GEMV alone (no norm) | default | {us:.2f} | - |")
        for cfg in CONFIGS:
            ys = [_linear.decode_linear(x, w, None, None, cfg, g, eps) for x, w, g in zip(xs, ws, gs)]
            us = time_graph([lambda i=i: _linear.decode_linear(xs[i], ws[i], None, None, cfg, gs[i], eps)
                             for i in range(8)])
            shown = {**_linear.config_for(d, cfg, norm=True)}
            lines.append(f"| {name} | folded | {'default ' if not cfg else ''}{shown} | {us:.2f} | {err(ys):.2e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        from countdown.io import atomic_write

        os.makedirs(args.out, exist_ok=True)
        atomic_write(os.path.join(args.out, "norm_fold.md"), text)


if __name__ == "__main__":
    main()
