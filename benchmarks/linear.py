"""One-token linear layers of a decode step: Inductor's tuned GEMV vs cuBLAS vs kernels/decode_step/linear.py.

    PYTHONPATH=src python benchmarks/linear.py --out $OUT [--tokens 1] [--quick]   # default --out results/linear

results/linear/ (H200, 2026-11-23; README.md there): linear.* from ``--out $OUT/linear --budget-s 230``,
linear_sweep2.* from ``--shapes o_proj,down --out $OUT/linear2 --budget-s 120`` (whose winners are
kernels/config.py's launch table "linear"), pred/ from ``--shapes pred_b,pred_a,gate_or_up --budget-s 45 --out $OUT/linear``.

Per Llama-3.1-8B projection shape (bf16; W [N, K]): every route timed as CUDA-graph replays of calls
cycling over enough weight copies that none is found in L2 (harness.timing.time_graph), median us,
and its share of the device-to-device copy bandwidth measured in the same run (weight bytes / time):

    inductor   torch.compile(F.linear) with coordinate-descent tuning, as the decode step compiles it
               (Inductor rewrites a one-row product into a tuned Triton reduction)
    cublas     F.linear, eager (cuBLAS)
    triton     kernels/decode_step/linear.py at each candidate launch configuration (the best is reported, every
               one is in the CSV); each checked against cuBLAS first (within 2 bf16 ulps)

Writes linear.csv (every route and configuration), linear.md and linear_meta.json; prints the table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

T0 = time.perf_counter()
SHAPES = {  # name: (N, K), Llama-3.1-8B
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_or_up": (14336, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
    "pred_a": (512, 4096),  # the low-rank predictor of dual[lowrank] (rank 512): A^T
    "pred_b": (14336, 512),  # and B^T
}


def log(*parts) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *parts, flush=True)


def candidates(quick: bool, k: int) -> list[dict]:
    """Launch configurations to time for reduction length k (BK past k would repeat a smaller one)."""
    from countdown.kernels.decode_step import linear as _linear

    if quick:
        return [_linear.config_for(k), dict(BN=16, BK=512, num_warps=4, num_stages=3)]
    grid = itertools.product((1, 2, 4, 8, 16, 32), (512, 1024, 2048, 4096), (1, 2, 4, 8), (1, 2, 4))
    return [dict(BN=bn, BK=bk, num_warps=w, num_stages=s) for bn, bk, w, s in grid
            if 2048 <= bn * bk <= 16384 and bk // (32 * w) >= 4 and bk <= max(512, k)]


def plot(rows: list[dict], path: str, title: str) -> None:
    """Bars: each shape's best time per route as a share of copy bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from countdown.io import atomic_write

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    routes = ("cublas", "inductor", "triton")
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for j, route in enumerate(routes):
        best = [max((float(r["share"]) for r in rows if r["shape"] == s and r["route"] == route), default=0.0)
                for s in shapes]
        ax.bar([i + (j - 1) * 0.27 for i in range(len(shapes))], [100 * b for b in best], 0.27, label=route)
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylabel("% of copy bandwidth")
    ax.axhline(100, color="grey", lw=0.6)
    ax.set_title(f"One-token GEMV by route ({title})", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "results/linear"))
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="two triton configurations only")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop the triton sweep past this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/linear.py times CUDA kernels: run it on a GPU machine")
    import torch._inductor.config as inductor_config

    from harness.timing import copy_bandwidth, time_graph
    from countdown.io import atomic_write, write_json
    from countdown.kernels.decode_step import linear as _linear

    inductor_config.coordinate_descent_tuning = True
    dev, dtype = "cuda", torch.bfloat16
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s, L2 {l2 >> 20} MiB")
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, -(-3 * l2 // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]
        xs = [torch.randn(args.tokens, k, device=dev, dtype=dtype) for _ in range(copies)]
        calls = max(copies, 8)
        ref = F.linear(xs[0], ws[0]).float()
        tol = 2 * 2.0**-7 * ref.abs().clamp_min(1.0)

        def row(route, us, config=None):
            r = dict(shape=name, N=n, K=k, tokens=args.tokens, route=route, config=json.dumps(config or {}),
                     us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), share=round(nbytes / us / 1e3 / (bw / 1e9), 3))
            rows.append(r)
            return r

        row("cublas", time_graph([lambda i=i: F.linear(xs[i % copies], ws[i % copies]) for i in range(calls)]))
        lin = torch.compile(lambda a, b: F.linear(a, b), fullgraph=True, dynamic=False)
        got = lin(xs[0], ws[0]).float()
        if not ((got - ref).abs() <= tol).all():
            log(f"  {name}: inductor differs from cuBLAS by {(got - ref).abs().max().item():.3g}")
        row("inductor", time_graph([lambda i=i: lin(xs[i % copies], ws[i % copies]) for i in range(calls)]))
        best = None
        for cfg in candidates(args.quick, k):
            if time.perf_counter() - T0 > args.budget_s:
                log("  budget spent: triton sweep stopped")
                break
            got = _linear.decode_linear(xs[0], ws[0], config=cfg).float()
            if not ((got - ref).abs() <= tol).all():
                log(f"  {name} {cfg}: differs from cuBLAS by {(got - ref).abs().max().item():.3g}: skipped")
                continue
            r = row("triton", time_graph([lambda i=i: _linear.decode_linear(xs[i % copies], ws[i % copies], config=cfg)
                                          for i in range(calls)]), cfg)
            best = r if best is None or r["us"] < best["us"] else best
        for r in rows:
            if r["shape"] == name and r["route"] != "triton":
                log(f"  {name:10s} {r['route']:8s} {r['us']:8.1f} us  {r['share']:.0%}")
        if best:
            log(f"  {name:10s} triton   {best['us']:8.1f} us  {best['share']:.0%}  {best['config']}")
        ws = xs = None  # frees the copies (the closures above are done with them)
        torch.cuda.empty_cache()

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    atomic_write(os.path.join(args.out, "linear.csv"), buf.getvalue())
    date = datetime.date.today().isoformat()
    lines = [f"# One-token linear layers by route ({torch.cuda.get_device_name()}, {date})", "",
             f"`PYTHONPATH=src python benchmarks/linear.py {' '.join(sys.argv[1:] if argv is None else argv)}`; tokens {args.tokens}; "
             f"copy bandwidth {bw / 1e9:.0f} GB/s; share = weight bytes / time / copy bandwidth.", "",
             "| shape | N x K | cublas us (share) | inductor us (share) | triton best us (share) | triton config |",
             "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["shape"] for r in rows):
        by = {route: min((r for r in rows if r["shape"] == name and r["route"] == route), key=lambda r: r["us"],
                         default=None) for route in ("cublas", "inductor", "triton")}
        cell = {k: f"{v['us']:.1f} ({v['share']:.0%})" if v else "-" for k, v in by.items()}
        lines.append(f"| {name} | {SHAPES[name][0]} x {SHAPES[name][1]} | {cell['cublas']} | {cell['inductor']} | "
                     f"{cell['triton']} | `{by['triton']['config'] if by['triton'] else '-'}` |")
    md = "\n".join(lines) + "\n"
    plot(rows, os.path.join(args.out, "linear.png"), f"{torch.cuda.get_device_name()}, {date}")
    atomic_write(os.path.join(args.out, "linear.md"), md)
    write_json(os.path.join(args.out, "linear_meta.json"), dict(
        device=torch.cuda.get_device_name(), date=date, torch=torch.__version__, copy_gbps=bw / 1e9,
        command=f"PYTHONPATH=src python benchmarks/linear.py {' '.join(sys.argv[1:] if argv is None else argv)}"))
    print(md)


if __name__ == "__main__":
    main()
