"""Probe: can a persistent program that owns a contiguous chunk of W_up rows stream them at the fixed GEMV's
speed? The question behind mono's in-kernel indicator (kernels/_indicator.py): its u phase runs at 1.3x the
fixed GEMV (about 36 against 27.5 us, docs/kernels.md item 9), and every variant tried so far held the weight
tiles in registers (bytes in flight bounded by 236 registers a thread, two programs an SM). Here the tiles go
through shared memory instead: Hopper's tensor-memory accelerator (a host-side ``TensorDescriptor``) with
Triton's software pipeliner keeping STAGES tiles in flight, registers holding only a [RB, BK] fp32 sum.

    PYTHONPATH=src python benchmarks/tma_gemv.py --out DIR            # on a GPU (sm_90 for TMA)
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/tma_gemv.py --smoke   # the kernels' arithmetic on CPU

u = x W^T for W [14336, 4096] bf16 (Llama-3.1-8B's W_up), one token; rows: the fixed GEMV (kernels/_linear.py,
one row a program) and this kernel with plain pointer loads (PTR) or descriptor loads (TMA), the K walk per
block of RB rows (NESTED) or one loop over every (block, K step) of the chunk (FLAT). Each checked against
float64; timed over 4 weight sets in one CUDA graph (countdown.bench.timing.time_graph). DIR/tma_gemv.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_gemv(W, desc, X, U, N, K, CHUNK: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr,
                TMA: tl.constexpr, FLAT: tl.constexpr, STAGES: tl.constexpr):
    """Program p: u for rows [p CHUNK, (p + 1) CHUNK), RB rows a block, [RB, BK] tiles."""
    r_start = tl.program_id(0) * CHUNK
    ri = tl.arange(0, RB)
    kk = tl.arange(0, BK)
    NB: tl.constexpr = (CHUNK + RB - 1) // RB
    nk = tl.cdiv(K, BK)
    if FLAT:
        acc = tl.zeros([RB, BK], dtype=tl.float32)
        for i in tl.range(0, NB * nk, num_stages=STAGES):
            b = i // nk
            kb = i - b * nk
            r0 = r_start + b * RB
            if TMA:
                w = desc.load([r0, kb * BK])
            else:
                rows = r0 + ri
                w = tl.load(W + rows[:, None].to(tl.int64) * K + (kb * BK + kk)[None, :],
                            mask=(rows < N)[:, None], other=0.0)
            xk = tl.load(X + kb * BK + kk).to(tl.float32)
            acc += w.to(tl.float32) * xk[None, :]
            if kb == nk - 1:
                rows = r0 + ri
                tl.store(U + rows, tl.sum(acc, axis=1), mask=(rows < N) & (ri < CHUNK - b * RB))
                acc = tl.zeros([RB, BK], dtype=tl.float32)
    else:
        for b in range(NB):
            r0 = r_start + b * RB
            rows = r0 + ri
            acc = tl.zeros([RB, BK], dtype=tl.float32)
            for kb in tl.range(0, nk, num_stages=STAGES):
                if TMA:
                    w = desc.load([r0, kb * BK])
                else:
                    w = tl.load(W + rows[:, None].to(tl.int64) * K + (kb * BK + kk)[None, :],
                                mask=(rows < N)[:, None], other=0.0)
                xk = tl.load(X + kb * BK + kk).to(tl.float32)
                acc += w.to(tl.float32) * xk[None, :]
            tl.store(U + rows, tl.sum(acc, axis=1), mask=(rows < N) & (ri < CHUNK - b * RB))


def chunk_gemv(x: torch.Tensor, w: torch.Tensor, cfg: dict) -> torch.Tensor:
    """u = x w^T (fp32 [N]) for x [1, K], w [N, K] bf16, with this probe's kernel and ``cfg``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, k = w.shape
    if k % cfg["BK"]:
        raise ValueError(f"K {k} must be a multiple of BK {cfg['BK']}")
    u = torch.empty(n, dtype=torch.float32, device=w.device)
    desc = TensorDescriptor.from_tensor(w, [cfg["RB"], cfg["BK"]]) if cfg["TMA"] else w
    grid = (triton.cdiv(n, cfg["CHUNK"]),)
    _chunk_gemv[grid](w, desc, x, u, n, k, CHUNK=cfg["CHUNK"], RB=cfg["RB"], BK=cfg["BK"], TMA=cfg["TMA"],
                      FLAT=cfg["FLAT"], STAGES=cfg["STAGES"], num_warps=cfg["num_warps"], num_stages=1)
    return u


def configs(which: str) -> list[dict]:
    """The variants of one run: "smoke" (CPU), "first" (the first sweep: STAGES 3 / 5, PTR and TMA, FLAT and
    NESTED; H200 2026-11-25: TMA at 5 stages 33.2 us, every PTR variant 43 us or more), "stages" (TMA only,
    deeper pipelines and the shapes that led)."""
    if which == "smoke":
        return [dict(CHUNK=24, RB=8, BK=32, TMA=t, FLAT=f, STAGES=2, num_warps=4)
                for t, f in itertools.product((False, True), (False, True))]
    out = []
    if which == "first":
        for tma, flat, (chunk, rb), bk, stages, warps in itertools.product(
                (True, False), (True, False), ((56, 8), (112, 16), (56, 4)), (256, 128), (3, 5), (4, 8)):
            if not tma and stages == 5:
                continue
            out.append(dict(CHUNK=chunk, RB=rb, BK=bk, TMA=tma, FLAT=flat, STAGES=stages, num_warps=warps))
        return out
    for flat, (chunk, rb), stages, warps in itertools.product(
            (True, False), ((56, 8), (112, 16), (112, 8), (56, 16)), (6, 8, 12, 16), (4, 2)):
        if rb == 16 and stages > 12:
            continue
        out.append(dict(CHUNK=chunk, RB=rb, BK=256, TMA=True, FLAT=flat, STAGES=stages, num_warps=warps))
    return out


def name(c: dict) -> str:
    return (f"{'tma' if c['TMA'] else 'ptr'} {'flat' if c['FLAT'] else 'nest'} chunk{c['CHUNK']} rb{c['RB']} "
            f"bk{c['BK']} s{c['STAGES']} w{c['num_warps']}")


def plot(json_paths: list[str], out_png: str) -> str:
    """us against STAGES for every TMA variant with BK 256 (a line per flat / nested, chunk, RB and warps) of the
    runs given, the fixed GEMV as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines, fixed = {}, []
    for path in json_paths:
        with open(path) as f:
            run = json.load(f)
        for r in run["rows"]:
            c = r.get("cfg")
            if c is None:
                fixed.append(r["us"])
            elif c["TMA"] and c["BK"] == 256:
                key = f"{'flat' if c['FLAT'] else 'nest'} chunk{c['CHUNK']} rb{c['RB']} w{c['num_warps']}"
                lines.setdefault(key, {})[c["STAGES"]] = r["us"]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    colors = plt.cm.tab20.colors
    for i, (key, pts) in enumerate(sorted(lines.items())):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", ls="-" if key.startswith("flat") else "--", label=key,
                color=colors[i % len(colors)])
    if fixed:
        ax.axhline(min(fixed), color="k", lw=2, label=f"fixed GEMV (kernels/_linear.py) {min(fixed):.1f} us")
    ax.set_xlabel("STAGES (tiles in flight a program)")
    ax.set_ylabel("us, u = x W_up^T (Llama-3.1-8B, bf16, one token)")
    ax.set_ylim(0, 80)
    ax.set_title("A chunk of W_up a program through shared memory by TMA (H200)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return out_png


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="small shapes, every variant checked, nothing timed")
    ap.add_argument("--set", default="stages", choices=("first", "stages"), help="the variants (see configs())")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--plot", default=None, help="JSON,JSON,...: redraw the plot of those runs next to the first")
    a = ap.parse_args()
    if a.plot:
        paths = a.plot.split(",")
        print(plot(paths, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(paths[0]))), "tma_gemv.png")))
        return
    import time

    from countdown.bench.timing import copy_bandwidth, time_graph

    t_start = time.time()
    dev = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    n, k, sets = (100, 64, 1) if a.smoke else (14336, 4096, 4)
    torch.manual_seed(0)
    ws = [(torch.randn(n, k, device=dev) * k**-0.5).to(torch.bfloat16) for _ in range(sets)]
    xs = [torch.randn(1, k, device=dev).to(torch.bfloat16) for _ in range(sets)]
    refs = [(x.double() @ w.double().t())[0] for x, w in zip(xs, ws)]
    bound = [(x.double().abs() @ w.double().abs().t())[0] * 2.0**-20 + 1e-6 for x, w in zip(xs, ws)]
    rows, bw = [], copy_bandwidth() if dev == "cuda" else float("nan")
    nbytes = n * k * 2
    if dev == "cuda":
        from countdown.kernels import _linear

        us = time_graph([lambda i=i: _linear.decode_linear(xs[i], ws[i]) for i in range(sets)] * 2)
        rows.append(dict(name="fixed GEMV (kernels/_linear.py)", us=us, ok=True))
        print(f"{rows[-1]['name']:45s} {us:7.2f} us  {nbytes / us * 1e6 / bw:5.0%} of copy bw", flush=True)
    for c in configs("smoke" if a.smoke else a.set):
        if time.time() - t_start > a.budget_s:
            print("budget spent", flush=True)
            break
        label = name(c)
        try:
            got = [chunk_gemv(x, w, c) for x, w in zip(xs, ws)]
            ok = all(bool(((g.double() - r).abs() <= b).all()) for g, r, b in zip(got, refs, bound))
            calls = [lambda i=i: chunk_gemv(xs[i], ws[i], c) for i in range(sets)] * 2
            us = time_graph(calls) if dev == "cuda" else 0.0
        except Exception as e:  # noqa: BLE001
            print(f"FAILED {label}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}", flush=True)
            continue
        rows.append(dict(name=label, cfg=c, us=us, ok=ok))
        print(f"{label:45s} {us:7.2f} us  {nbytes / max(us, 1e-9) * 1e6 / bw:5.0%} of copy bw  ok={ok}", flush=True)
    if not all(r["ok"] for r in rows):
        raise SystemExit("a variant disagreed with float64")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", date=str(datetime.date.today()),
                    copy_bw_bytes_per_s=bw, triton=triton.__version__, torch=torch.__version__, shape=[n, k])
        with open(os.path.join(a.out, "tma_gemv.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        best = sorted(rows, key=lambda r: r["us"])
        with open(os.path.join(a.out, "tma_gemv.md"), "w") as f:
            f.write(f"# u = x W^T, W [{n}, {k}] bf16, one token ({meta['device']}, {meta['date']})\n\n")
            f.write("| variant | us | share of copy bandwidth |\n|---|---|---|\n")
            for r in best:
                f.write(f"| {r['name']} | {r['us']:.2f} | {nbytes / r['us'] * 1e6 / bw:.0%} |\n")


if __name__ == "__main__":
    main()
