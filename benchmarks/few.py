"""A sparse Gated-MLP of 2-8 tokens (a batched decode step): the one-launch kernel (kernels/sparse_mlp/few_tokens.py) against
dense cuBLAS and its roofline.

    PYTHONPATH=src python benchmarks/few.py --out DIR --budget 150
    PYTHONPATH=src python benchmarks/few.py --compile-check           # no GPU: registers, shared memory
    PYTHONPATH=src python benchmarks/few.py --smoke --out /tmp/f      # CPU: checks the script

results/few/ (H200, 2026-11-25) came from `cd benchmarks && PYTHONPATH=../src:. python few.py --out DIR
--budget 150` at commit 12e5c91, which also timed the chained kernels (chain.py, then down.py) that few_tokens.py
replaced, switched back on by COUNTDOWN_FEW=0 (its "chain" columns; the switch is gone, the chain is not
timed any more).

Llama-3.1-8B's MLP shape (4096 x 14336, SiLU), bf16, CUDA graphs over 4 rotating weight sets and 8
inputs (harness.mlpbench's Problem: random weights, so the tokens' masks are independent and the
union keeps about 1 - k^T of the rows, as on the real models: README, "Batch 2-8"). Every time is the
public op as a decode step calls it, indicator included (mono: u = x W_up^T; dual: the rank-512
predictor's (x A) B). Roofline = the bytes that op must read (the indicator's matrix or the predictor,
plus the union's rows of the other matrices) / the copy bandwidth of the same run. Stages (results
written after each; a stage is skipped once --budget seconds have passed):

1. check: at the real shape, T = 2 / 4 / 8, every method's output against float64 (flash-attention rule).
2. sweep: T = 4, dual and mono at k = 0.9 and dual at k = 0.7 (where chunks keep more rows than a tile),
   the kernel under each configuration of SWEEP; the fastest (summed) becomes the configuration of the table.
3. parts: T = 4, k = 0.9: the indicator alone, the kernel alone (also with nothing / everything kept), the sum.
4. table: T = 2 / 4 / 8 x k = 0.7 / 0.8 / 0.9 x mono / cats / dual: dense and the op (few); prints the
   speed-up over dense and the ratio to the roofline.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

import torch

import countdown.kernels as K
from countdown.io import atomic_write
from countdown.kernels.config import launch_config
from countdown.kernels.sparse_mlp import few_tokens as _few
from harness.launches import recorded, stand_in
from harness.mlpbench import Problem, dense_chain, gap_threshold, log, safe_time
from harness.sm90 import Compile
from harness.timing import copy_bandwidth


ACT, E, RANK = "silu", 2, 512
_C = ("TILE", "BK", "BN", "STAGES", "num_warps", "WIDE_BK", "WIDE_BN", "WIDE_STAGES")
SWEEP = [dict(zip(_C, c)) for c in [
    (64, 128, 256, 3, 8, 64, 128, 3), (64, 128, 256, 3, 8, 64, 128, 4), (64, 128, 256, 3, 8, 128, 128, 3),
    (64, 128, 256, 3, 8, 64, 256, 3), (64, 64, 128, 4, 8, 64, 128, 4), (32, 128, 256, 3, 8, 64, 128, 4),
    (64, 128, 256, 3, 4, 64, 128, 4), (64, 128, 128, 3, 8, 64, 128, 3)]]
METHODS = ("mono", "cats", "dual")
T0 = time.time()


def _cell(v) -> str:
    """One CSV cell: floats to 4 significant digits, text quoted where it holds a comma or a quote."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    text = str(v)
    return '"' + text.replace('"', '""') + '"' if "," in text or '"' in text else text


@contextlib.contextmanager
def few_config(cfg: dict | None = None):
    """The public ops with the few-token kernel under launch configuration ``cfg`` (entries of its launch table)."""
    with K.overrides(launch={"few_tokens": cfg or {}}):
        yield


def op(p: Problem, method: str, thr: float, dtype_ref: bool = False):
    """The public op (or its PyTorch reference) for input i."""
    def call(i):
        x, w = p.xs[i], p.w(i)
        if method == "mono":
            f = K.mono_gated_mlp_ref if dtype_ref else K.mono_gated_mlp
            return f(x, w["wg"], w["wu"], w["wdt"], thr, ACT)
        if method == "cats":
            f = K.cats_gated_mlp_ref if dtype_ref else K.cats_gated_mlp
            return f(x, w["wg"], w["wu"], w["wdt"], thr, ACT)
        f = K.dual_gated_mlp_ref if dtype_ref else K.dual_gated_mlp
        return f(x, w["wg"], w["wu"], w["wdt"], w["pa"], w["pb"], thr, ACT)
    return call


def keep_mask(p: Problem, method: str, thr: float, i: int) -> torch.Tensor:
    x, w = p.xs[i], p.w(i)
    if method == "mono":
        return K.mono_keep(x, w["wu"], thr)
    if method == "cats":
        return K.cats_keep(x, w["wg"], thr, ACT)
    return K.dual_keep(x, w["pa"], w["pb"], thr)


def fractions(p: Problem, method: str, thr: float) -> tuple[float, float]:
    """(kept per token, kept by the union of the batch), averaged over the inputs."""
    ks = [keep_mask(p, method, thr, i) for i in range(len(p.xs))]
    return (float(torch.stack([k.float().mean() for k in ks]).mean()),
            float(torch.stack([k.any(0).float().mean() for k in ks]).mean()))


def roofline_us(p: Problem, method: str, union: float, bw: float) -> float:
    full = p.d_inter * p.d_model * E
    if method == "dual":
        fixed, mats = (p.d_model + p.d_inter) * p.rank * E, 3
    else:
        fixed, mats = full, 2
    return (fixed + mats * union * full) / bw * 1e6


def gap_thresholds(p: Problem, k: float) -> dict:
    """Per method a cut between two distinct indicator values near the k-quantile of input 0 and 1, so that
    the kernel's fp32 activation (an ulp from PyTorch's) cannot flip a row tied with the cut."""
    vals = dict(mono=[u.float().abs() for u in p.u[:2]], cats=[h.abs() for h in p.h[:2]],
                dual=[sc.float() for sc in p.score[:2]])
    return {m: gap_threshold(torch.cat([t.flatten() for t in v]), k) for m, v in vals.items()}


def check(p: Problem) -> dict:
    res = dict(ok=True, worst=0.0)
    cuts = gap_thresholds(p, 0.8)
    for method in METHODS:
        thr = cuts[method]
        for i in range(2):
            keep = keep_mask(p, method, thr, i)
            x, w = p.xs[i], p.w(i)
            ref64 = K.gated_mlp_masked_ref(*[t.double() for t in (x, w["wg"], w["wu"], w["wdt"])], keep, ACT)
            ref_t = op(p, method, thr, dtype_ref=True)(i)
            y = op(p, method, thr)(i)
            err = (y.double() - ref64).abs()
            margin = (err - 2 * (ref_t.double() - ref64).abs() - 1e-2 * ref64.abs().max()).max().item()
            res["worst"] = max(res["worst"], err.max().item())
            res["ok"] &= bool(margin <= 0)
            log(f"check T={p.batch} {method} input {i}: max err {err.max().item():.3e} ({'ok' if margin <= 0 else 'FAILED'})")
    return res


def add(rows, stage, p, method, k, path, us, fr, bw, dense_us=None, cfg=None, kern=None, roof=None):
    roof = roofline_us(p, method, fr[1], bw) if roof is None else roof
    rows.append(dict(stage=stage, batch=p.batch, method=method, k=k, path=path, us=us, kept=fr[0], union=fr[1],
                     roofline_us=roof, x_roofline=us / roof if roof else float("nan"),
                     speedup=dense_us / us if dense_us else float("nan"),
                     config=json.dumps(cfg, sort_keys=True) if cfg else "",
                     regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None)))
    r = rows[-1]
    log(f"{stage:6s} T={p.batch} {method:5s} k={k:<4} {path:6s} {us:8.2f} us  roofline {roof:6.2f}  "
        f"x dense {r['speedup']:.2f}  union {fr[1]:.3f}  {r['config']}  regs {r['regs']} spills {r['spills']}")


def sweep(p: Problem, bw, rows, launches) -> dict:
    n = len(p.xs)
    totals: dict = {}
    for method, k in (("dual", 0.9), ("mono", 0.9), ("dual", 0.7)):  # k = 0.7: chunks past TILE kept rows
        thr = p.thresholds(k)[method]
        fr = fractions(p, method, thr)
        want = op(p, method, thr)(0).float()
        for j, cfg in enumerate(SWEEP):
            with few_config(cfg):
                try:
                    got = op(p, method, thr)(0).float()
                except Exception as e:  # noqa: BLE001
                    log(f"sweep {method} {cfg} FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
                    continue
                if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                    log(f"sweep {method} {cfg}: output differs from the default, dropped")
                    continue
                us = safe_time(f"few {cfg}", [lambda i=i: op(p, method, thr)(i) for i in range(n)])
                add(rows, "sweep", p, method, k, "few", us, fr, bw, cfg=cfg, kern=launches.last["few_tokens"])
            if us == us:
                totals[j] = totals.get(j, 0.0) + us
    best = SWEEP[min(totals, key=totals.get)] if totals else launch_config("few_tokens")
    log(f"best configuration: {best}")
    return best


def parts(p: Problem, bw, rows, best, launches) -> None:
    """Where a batched sparse MLP's time goes (T = p.batch, k = 0.9): the indicator alone, the kernel alone
    with the indicator given (also with nothing and everything kept: its fixed cost and its streaming rate),
    the partials' sum alone."""
    n = len(p.xs)
    with few_config(best):
        for method in ("dual", "mono"):
            mode, gate, up = ("gt", True, True) if method == "dual" else ("abs", True, False)
            ind = [p.score[i] if method == "dual" else p.u[i] for i in range(n)]
            fr = fractions(p, method, p.thresholds(0.9)[method])
            if method == "dual":
                us = safe_time("predictor", [lambda i=i: K.dual_scores(p.xs[i], p.w(i)["pa"], p.w(i)["pb"]) for i in range(n)])
            else:
                us = safe_time("u", [lambda i=i: p.xs[i] @ p.w(i)["wu"].t() for i in range(n)])
            full = p.d_inter * p.d_model * E
            fixed = (p.d_model + p.d_inter) * p.rank * E if method == "dual" else full
            add(rows, "parts", p, method, 0.9, "ind", us, fr, bw, roof=fixed / bw * 1e6)
            for k, label in ((0.9, "kernel"), (1.0, "none"), (0.0, "all")):
                thr = 1e30 if k >= 1 else (-1e30 if k <= 0 else p.thresholds(k)[method])
                frk = fractions(p, method, thr) if 0 < k < 1 else ((0.0, 0.0) if k >= 1 else (1.0, 1.0))
                us = safe_time(label, [lambda i=i: _few.few_tokens_partials(
                    p.xs[i], ind[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"], None, thr, mode, ACT, gate, up)
                                       for i in range(n)])
                roof = (3 if method == "dual" else 2) * frk[1] * full / bw * 1e6
                add(rows, "parts", p, method, k, label, us, frk, bw, kern=launches.last["few_tokens"], roof=roof)
            part = _few.few_tokens_partials(p.xs[0], ind[0], p.w(0)["wg"], p.w(0)["wu"], p.w(0)["wdt"], None, 0.0,
                                            mode, ACT, gate, up)
            us = safe_time("sum", [lambda: part.sum(0).to(p.xs[0].dtype) for _ in range(n)])
            add(rows, "parts", p, method, 0.9, "sum", us, fr, bw, roof=part.numel() * 4 / bw * 1e6)


def table(p: Problem, bw, rows, best, ks, launches) -> None:
    n = len(p.xs)
    dense_us = safe_time("dense", [lambda i=i: dense_chain(p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wd"], ACT)
                                   for i in range(n)])
    add(rows, "table", p, "dense", 0.0, "cublas", dense_us, (1.0, 1.0), bw, dense_us)
    rows[-1]["roofline_us"] = 3 * p.d_inter * p.d_model * E / bw * 1e6
    for method in METHODS:
        for k in ks:
            thr = p.thresholds(k)[method]
            fr = fractions(p, method, thr)
            with few_config(best):
                us = safe_time(f"{method} {k} few", [lambda i=i: op(p, method, thr)(i) for i in range(n)])
            add(rows, "table", p, method, k, "few", us, fr, bw, dense_us, cfg=best, kern=launches.last["few_tokens"])


def compile_check() -> bool:
    """No GPU needed: compile every SWEEP configuration for sm_90 and log registers and shared memory."""
    failures: list = []
    e = lambda *shape: torch.empty(shape, dtype=torch.bfloat16)
    x, w, ind = e(4, 4096), e(14336, 4096), e(4, 14336)
    with stand_in(["few_tokens"], lambda name, jit: Compile(jit, failures)), K.overrides(sm_count=132):  # H100 / H200
        for cfg in [None] + SWEEP:
            _few.few_tokens_partials(x, ind, w, w, w, None, 0.5, "abs", ACT, True, False, config=cfg)
            _few.few_tokens_partials(x, ind, w, w, w, None, 0.5, "gt", ACT, True, True, config=cfg)
    log(f"compile check: {len(failures)} failures")
    return not failures


def write(out: str, rows: list, meta: dict) -> None:
    os.makedirs(out, exist_ok=True)
    atomic_write(os.path.join(out, "few.json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    cols = ["stage", "batch", "method", "k", "path", "us", "kept", "union", "roofline_us", "x_roofline", "speedup",
            "config", "regs", "spills"]
    lines = [",".join(cols)] + [",".join(_cell(r[c]) for c in cols) for r in rows]
    atomic_write(os.path.join(out, "few.csv"), "\n".join(lines) + "\n")
    md = [f"# Sparse Gated-MLP of 2-8 tokens: one launch (few_tokens.py) against dense ({meta['shape']})", "",
          f"- device: {meta['device']}; date: {meta['date']}; copy bandwidth {meta['bw'] / 1e12:.2f} TB/s; "
          f"torch {meta['torch']}", f"- command: `{meta['command']}`", f"- checks: {meta.get('check')}",
          f"- configuration of the table: {meta.get('best')}", "",
          "us = median per call in one CUDA graph (8 calls, 4 weight sets), indicator included; x dense = dense "
          "cuBLAS time / us; union = rows the batch reads.", "",
          "| batch | method | k | union | dense us | few us | roofline us | few x roofline | few x dense |",
          "|---|---|---|---|---|---|---|---|---|"]
    tab = [r for r in rows if r["stage"] == "table"]
    for r in tab:
        if r["path"] != "few":
            continue
        dense = next((c for c in tab if c["batch"] == r["batch"] and c["method"] == "dense"), None)
        md.append(f"| {r['batch']} | {r['method']} | {r['k']} | {r['union']:.3f} | {dense['us']:.1f} | "
                  f"{r['us']:.1f} | {r['roofline_us']:.1f} | {r['x_roofline']:.2f} | {r['speedup']:.2f}x |")
    pa = [r for r in rows if r["stage"] == "parts"]
    if pa:
        md += ["", "Parts (T = 4): the indicator alone; the kernel alone with it given at k = 0.9, with nothing kept "
               "(none) and with every row kept (all); the partials' sum alone:", "",
               "| method | part | k | us | roofline us | x roofline |", "|---|---|---|---|---|---|"]
        md += [f"| {r['method']} | {r['path']} | {r['k']} | {r['us']:.2f} | {r['roofline_us']:.2f} | {r['x_roofline']:.2f} |"
               for r in pa]
    sw = [r for r in rows if r["stage"] == "sweep"]
    if sw:
        md += ["", "Sweep (T = 4):", "", "| method | k | config | us | x roofline | regs | spills |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {r['method']} | {r['k']} | {r['config']} | {r['us']:.2f} | {r['x_roofline']:.2f} | {r['regs']} | {r['spills']} |"
               for r in sw]
    atomic_write(os.path.join(out, "few.md"), "\n".join(md) + "\n")
    plot(out, tab, meta)


def plot(out: str, tab: list, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in tab})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], batches):
        for method, color in zip(METHODS, ("C0", "C1", "C2")):
            pts = sorted((r["k"], r["speedup"]) for r in tab if r["batch"] == b and r["method"] == method
                         and r["path"] == "few")
            if pts:
                ax.plot(*zip(*pts), "-", marker="o", color=color, label=method)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("k (sparsity per token)")
    axes[0][0].set_ylabel("speed-up over dense cuBLAS MLP")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{meta['device']}, {meta['date']}: one Gated-MLP ({meta['shape']}), bf16", fontsize=9)
    fig.tight_layout()
    tmp = os.path.join(out, ".few.png.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, os.path.join(out, "few.png"))
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/few")
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--smoke", action="store_true", help="tiny shape (CPU interpreter): checks this script")
    ap.add_argument("--compile-check", action="store_true", help="no GPU: compile for sm_90, print registers")
    ap.add_argument("--stages", default="check,sweep,parts,table", help="comma-separated stages to run")
    ap.add_argument("--batches", default="2,4,8")
    args = ap.parse_args()
    if args.compile_check:
        return 0 if compile_check() else 1
    smoke = args.smoke or not torch.cuda.is_available()
    stack = contextlib.ExitStack()
    if smoke:  # the CPU interpreter takes the few-token route as CUDA does
        stack.enter_context(K.overrides(cuda_routes=("few_tokens",)))
    d_model, d_inter = (64, 200) if smoke else (4096, 14336)
    bw = copy_bandwidth() if torch.cuda.is_available() else 1e12
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
                date=datetime.date.today().isoformat(), bw=bw, shape=f"{d_model} x {d_inter}",
                command="PYTHONPATH=src python benchmarks/few.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__, check={})
    rows: list = []
    stages = set(args.stages.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    problems = {b: Problem(d_model, d_inter, ACT, b, 16 if smoke else RANK) for b in batches}
    if "check" in stages:
        for b, p in problems.items():
            meta["check"][b] = check(p)
    write(args.out, rows, meta)
    global SWEEP
    if smoke:
        SWEEP = [dict(ROWS="chunk", TILE=16, BK=32, BN=32, STAGES=2, num_warps=4, WIDE_BK=32, WIDE_BN=32)]
    best = launch_config("few_tokens")
    with recorded("few_tokens") as launches:  # each row's registers and spills: the kernel it last compiled
        if "sweep" in stages and 4 in problems:
            best = sweep(problems[4], bw, rows, launches)
        meta["best"] = best
        write(args.out, rows, meta)
        if "parts" in stages and 4 in problems:
            parts(problems[4], bw, rows, best, launches)
            write(args.out, rows, meta)
        if "table" in stages:
            for b, p in problems.items():
                if time.time() - T0 > args.budget:
                    log(f"budget spent: batch {b} skipped")
                    break
                table(p, bw, rows, best, (0.7, 0.8, 0.9), launches)
                write(args.out, rows, meta)
    log("batch method k    union  dense   few     roof   few x roof  few x dense")
    tab = [r for r in rows if r["stage"] == "table"]
    for r in tab:
        if r["path"] == "few":
            dense = next(c for c in tab if c["batch"] == r["batch"] and c["method"] == "dense")
            log(f"{r['batch']:<5} {r['method']:6s} {r['k']:<4} {r['union']:.3f}  {dense['us']:6.1f}  {r['us']:6.1f}  "
                f"{r['roofline_us']:5.1f}  {r['x_roofline']:9.2f}  {r['speedup']:.2f}x")
    ok = all(c["ok"] for c in meta["check"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
