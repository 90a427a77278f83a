"""The one-token sparse kernels' partial sums: kernels/_psum.py's op against Inductor's sum + cast.

    PYTHONPATH=src python benchmarks/psum.py

P [224, 4096] fp32 (the Llama-3.1-8B shape's partials at CHUNK 64): the op checked against float64,
then both routes compiled alone and timed as CUDA-graph replays over 8 partial buffers (median us).
Measured on an H200, 2026-11-23: 3.29 us (op) against 3.99 us (Inductor); in the decode step the
difference did not show (docs/decode.md); the op is the default where the MLP runs eagerly (_psum.ROUTE).
"""

import torch

from countdown.bench import time_graph
from countdown.kernels import _psum


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/psum.py times CUDA kernels: run it on a GPU machine")
    p = torch.randn(224, 4096, device="cuda")
    got, exact = _psum.sum_partials(p, torch.bfloat16).double(), p.double().sum(0, keepdim=True)
    print("op vs float64, max relative error:", ((got - exact).abs() / exact.abs().clamp_min(1e-3)).max().item())
    ps = [torch.randn(224, 4096, device="cuda") for _ in range(8)]
    like = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    routes = {"inductor sum + cast": torch.compile(lambda t: t.sum(0, keepdim=True).to(torch.bfloat16)),
              "kernels/_psum.py op": torch.compile(lambda t: torch.ops.countdown.sum_partials(t, like))}
    for name, fn in routes.items():
        fn(ps[0])
        print(f"{name:22s} {time_graph([lambda i=i: fn(ps[i]) for i in range(8)]):6.2f} us")


if __name__ == "__main__":
    main()
