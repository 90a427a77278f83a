"""TEAL Gated-MLP kernel against its roofline: new kernel (launch configurations swept), old, mono, dense.

    PYTHONPATH=src python benchmarks/teal_kernel.py --out DIR [--old PATH] [--sweep] [--ks 0.5,0.7,0.9]

At the Llama-3.1-8B MLP shape (d_model 4096, d_inter 14336, SiLU, bf16) it first checks the kernel's
output for one token and for three against a float64 reference under the same masks (relative L2
error, next to the plain bf16 PyTorch op's), then times, each in one CUDA graph cycling over 4 weight
sets x 8 inputs (more than 1 GB, far past L2), per k: dense (cuBLAS chain), mono
(``kernels.mono_gated_mlp``), teal new (``kernels.teal_gated_mlp``), and with ``--old`` the previous
``_teal.py`` (a file path, loaded as ``countdown.kernels._teal_old``). The teal cuts are the
k-quantiles of |x| and of |s| over the inputs, so x and s are both cut at k. Roofline: the weight
bytes a call reads (teal 2 d_inter n_x + d_model n_s, mono d_model d_inter + 2 d_model n_kept,
dense 3 d_model d_inter, bf16) over the device-to-device copy bandwidth of the same run. ``--sweep``
times launch configurations of the gate/up and down kernels (k = 0.5 and 0.9) and uses the fastest.
``--shape tiny`` is a CPU smoke test (TRITON_INTERPRET=1; host timing means nothing).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import countdown.kernels as K
from countdown.bench import copy_bandwidth, time_graph
from countdown.kernels import _pdl, _teal
from countdown.kernels._common import gap_cut

SHAPES = {"Llama-3.1-8B": (4096, 14336), "tiny": (67, 131)}
NSETS, NSLOTS = 4, 8
DTYPE = torch.bfloat16
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Batch-1 candidates: gate/up (KS, BN, BM, warps, stages) with the default down, then down
# (FB, BN2, BM2, warps2, stages2) with the best gate/up.
GATEUP = [dict(KS=1024, BN=128, BM=16, warps=4, stages=1), dict(KS=2048, BN=128, BM=16, warps=4, stages=1),
          dict(KS=1024, BN=64, BM=32, warps=4, stages=1), dict(KS=1024, BN=128, BM=16, warps=8, stages=1),
          dict(KS=512, BN=128, BM=16, warps=4, stages=1), dict(KS=1024, BN=128, BM=32, warps=8, stages=1)]
DOWN = [dict(FB=512, BN2=256, BM2=32, warps2=4, stages2=1, FUSE=False),
        dict(FB=512, BN2=256, BM2=32, warps2=4, stages2=1, FUSE=True),
        dict(FB=512, BN2=512, BM2=16, warps2=4, stages2=1, FUSE=False),
        dict(FB=512, BN2=512, BM2=16, warps2=4, stages2=1, FUSE=True),
        dict(FB=1024, BN2=256, BM2=32, warps2=4, stages2=1, FUSE=False),
        dict(FB=256, BN2=512, BM2=16, warps2=4, stages2=1, FUSE=True),
        dict(FB=512, BN2=256, BM2=16, warps2=4, stages2=1, FUSE=True)]

FUSED = {**_teal.TEAL_CONFIGS[1], "FUSE": True}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def load_old(path):
    """The previous _teal.py as countdown.kernels._teal_old (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location("countdown.kernels._teal_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class Problem:
    def __init__(self, d_model, d_inter, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.d_model, self.d_inter = d_model, d_inter
        self.sets = []
        for _ in range(NSETS):
            wg = (torch.randn(d_inter, d_model, device=DEV, generator=g) / d_model**0.5).to(DTYPE)
            wu = (torch.randn(d_inter, d_model, device=DEV, generator=g) / d_model**0.5).to(DTYPE)
            wdt = (torch.randn(d_inter, d_model, device=DEV, generator=g) / d_inter**0.5).to(DTYPE)
            self.sets.append(dict(wg=wg, wu=wu, wdt=wdt, wd=wdt.t().contiguous(),
                                  wg_t=wg.t().contiguous(), wu_t=wu.t().contiguous()))
        self.xs = [torch.randn(1, d_model, device=DEV, generator=g).to(DTYPE) for _ in range(NSLOTS)]
        self.xb = torch.randn(3, d_model, device=DEV, generator=g).to(DTYPE)

    def w(self, i):
        return self.sets[i % NSETS]

    def cuts(self, k):
        """teal's (cut_x, cut_s), mono's cut on |u|, and the mean kept counts (n_x, n_s, n_mono)."""
        ax = torch.cat([x.float().abs().flatten() for x in self.xs])
        cut_x = torch.quantile(ax, k).item()
        ss, us = [], []
        for i, x in enumerate(self.xs):
            w = self.w(i)
            xt = torch.where(x.float().abs() > cut_x, x, torch.zeros((), dtype=DTYPE, device=DEV))
            ss.append(((xt @ w["wu_t"]) * F.silu(xt @ w["wg_t"])).float().abs().flatten())
            us.append((x @ w["wu"].t()).float().abs().flatten())
        cut_s = torch.quantile(torch.cat(ss), k).item()
        cut_m = torch.quantile(torch.cat(us), k).item()
        n_x = sum((x.float().abs() > cut_x).sum().item() for x in self.xs) / NSLOTS
        n_s = sum((s > cut_s).sum().item() for s in ss) / NSLOTS
        n_m = sum((u > cut_m).sum().item() for u in us) / NSLOTS
        return cut_x, cut_s, cut_m, n_x, n_s, n_m


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(p, fn, k, label, cuts, x=None):
    """Relative L2 error of ``fn(x, w, cut_x, cut_s)`` and of the bf16 PyTorch op against float64 under
    the same masks (cut_s moved into a gap of |s| near its quantile, so that no entry flips)."""
    cut_x = cuts[0]
    w = p.w(0)
    x = p.xs[0] if x is None else x
    xt = torch.where(x.float().abs() > cut_x, x.double(), 0.0)
    cut_s = gap_cut(((xt @ w["wu_t"].double()) * F.silu(xt @ w["wg_t"].double())).abs(), k)
    out = fn(x, w, cut_x, cut_s)
    out_t, keep_x, keep_s = K.teal_gated_mlp_ref(x, w["wg_t"], w["wu_t"], w["wdt"], cut_x, cut_s, "silu",
                                                return_masks=True)
    ref = K.teal_masked_ref(x.double(), w["wg_t"].double(), w["wu_t"].double(), w["wdt"].double(),
                            keep_x, keep_s, "silu")
    e, et = rel_err(out, ref), rel_err(out_t, ref)
    ok = bool(torch.isfinite(out).all()) and e <= max(2 * et, 1e-2)
    log(f"check {label} k={k} batch={x.shape[0]}: rel err {e:.2e} (bf16 torch {et:.2e}) {'ok' if ok else 'FAIL'}")
    return dict(label=label, k=k, batch=x.shape[0], rel_err=e, torch_rel_err=et, ok=ok)


def teal_new(cfg=None):
    def fn(x, w, cx, cs):
        tx = torch.tensor(cx, device=DEV)
        ts = torch.tensor(cs, device=DEV)
        if cfg is None:
            return K.teal_gated_mlp(x, w["wg_t"], w["wu_t"], w["wdt"], tx, ts, "silu")
        return _teal.teal_mlp(x, w["wg_t"], w["wu_t"], w["wdt"], tx, 0.0, ts, 0.0, "silu", config=cfg)
    return fn


def teal_old(mod):
    def fn(x, w, cx, cs):
        return mod.teal_mlp(x, w["wg_t"], w["wu_t"], w["wdt"], torch.tensor(cx, device=DEV), 0.0,
                            torch.tensor(cs, device=DEV), 0.0, "silu")
    return fn


def time_fn(p, fn, cx, cs, xs=None):
    """Median us per call, cycling over the weight sets and inputs (cuts as device tensors made once)."""
    xs = p.xs if xs is None else xs
    tx, ts = torch.tensor(cx, device=DEV), torch.tensor(cs, device=DEV)
    calls = [lambda i=i, x=x: fn(x, p.w(i), tx, ts) for i, x in enumerate(xs)]
    return time_graph(calls, reps=25, device=DEV)


def new_timed(cfg=None):
    def fn(x, w, tx, ts):
        if cfg is None:
            return K.teal_gated_mlp(x, w["wg_t"], w["wu_t"], w["wdt"], tx, ts, "silu")
        return _teal.teal_mlp(x, w["wg_t"], w["wu_t"], w["wdt"], tx, 0.0, ts, 0.0, "silu", config=cfg)
    return fn


def old_timed(mod):
    return lambda x, w, tx, ts: mod.teal_mlp(x, w["wg_t"], w["wu_t"], w["wdt"], tx, 0.0, ts, 0.0, "silu")


def sweep(p, ks, cuts, budget):
    """Fastest gate/up config (default down), then fastest down config with it; sum over ``ks``."""
    table = []

    def total(cfg):
        if budget() < 0:
            return float("inf")
        tot = 0.0
        for k in ks:
            cx, cs = cuts[k][:2]
            try:
                us = time_fn(p, new_timed(cfg), cx, cs)
            except Exception as error:  # a config that does not compile or fit: skip it
                log(f"  config {cfg} failed: {type(error).__name__}: {str(error)[:200]}")
                return float("inf")
            table.append(dict(config=cfg, k=k, us=us))
            tot += us
        log(f"  {cfg}: {tot:.1f} us over k={ks}")
        return tot

    best_g = min(GATEUP, key=lambda c: total({**c, **DOWN[0]}))
    best_d = min(DOWN, key=lambda c: total({**best_g, **c}))
    return {**best_g, **best_d}, table


class Report:
    """Rows written out (csv, md, json) after each one, so that a run cut short still leaves them."""

    def __init__(self, out, meta, bw, d_model, d_inter):
        self.out, self.meta, self.bw, self.d_model, self.d_inter = out, meta, bw, d_model, d_inter
        self.rows = []

    def row(self, method, k, us, nbytes, n_x=float("nan"), n_s=float("nan"), batch=1):
        roof = nbytes / self.bw * 1e6
        xr = us / roof if roof > 0 else float("nan")
        self.rows.append(dict(method=method, k=k, batch=batch, us=round(us, 2), roofline_us=round(roof, 2),
                              x_roofline=round(xr, 2), bw_share=round(roof / us, 3),
                              kept_x=round(n_x / self.d_model, 4), kept_s=round(n_s / self.d_inter, 4)))
        log(f"{method:24s} k={k} b={batch}: {us:8.1f} us  roofline {roof:6.1f} us  x{xr:5.2f}")
        self.write()

    def table(self) -> str:
        lines = ["| method | k | batch | us | roofline us | x roofline | bandwidth share | kept x | kept s |",
                 "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['k']} | {r['batch']} | {r['us']} | {r['roofline_us']} | {r['x_roofline']} | "
                  f"{r['bw_share']:.0%} | {r['kept_x']} | {r['kept_s']} |" for r in self.rows]
        return "\n".join(lines)

    def write(self):
        with open(os.path.join(self.out, "teal_kernel.json"), "w") as f:
            json.dump(dict(meta=self.meta, rows=self.rows), f, indent=1, default=str)
        if self.rows:
            with open(os.path.join(self.out, "teal_kernel.csv"), "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=list(self.rows[0]))
                wr.writeheader()
                wr.writerows(self.rows)
        with open(os.path.join(self.out, "teal_kernel.md"), "w") as f:
            f.write(f"device {self.meta['device']}; copy bandwidth {self.bw / 1e9:.0f} GB/s; "
                    f"command `{self.meta['command']}`\n\n{self.table()}\n")


def profile(p, cuts, k, path):
    """Per-kernel device times (torch.profiler, eager calls) of the default kernel at k and with
    nothing kept, appended to ``path``."""
    from torch.profiler import ProfilerActivity, profile as prof_ctx

    with open(path, "a") as f:
        for label, (cx, cs) in ((f"k={k}", cuts[k][:2]), ("nothing kept", (1e9, 1e9))):
            fn = new_timed()
            tx, ts = torch.tensor(cx, device=DEV), torch.tensor(cs, device=DEV)
            for i, x in enumerate(p.xs):
                fn(x, p.w(i), tx, ts)
            torch.cuda.synchronize()
            with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(4):
                    for i, x in enumerate(p.xs):
                        fn(x, p.w(i), tx, ts)
                torch.cuda.synchronize()
            f.write(f"## {label}: kernel, calls, mean device us\n")
            for ev in prof.key_averages():
                total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
                if ev.count and total:
                    f.write(f"{ev.key[:90]:90s} {ev.count:5d} {total / ev.count:9.2f}\n")
    log(open(path).read())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/teal_kernel"))
    ap.add_argument("--old", default=None, help="path of the previous _teal.py, to time it too")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--pdl", action="store_true", help="also time the new kernel with PDL launches")
    ap.add_argument("--profile", action="store_true", help="per-kernel device times at the largest k")
    ap.add_argument("--ks", default="0.5,0.7,0.9")
    ap.add_argument("--shape", default="Llama-3.1-8B", choices=sorted(SHAPES))
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop sweeping after this many seconds")
    args = ap.parse_args()
    t0 = time.perf_counter()
    budget = lambda: args.budget_s - (time.perf_counter() - t0)
    os.makedirs(args.out, exist_ok=True)
    ks = [float(k) for k in args.ks.split(",")]
    d_model, d_inter = SHAPES[args.shape]
    p = Problem(d_model, d_inter)
    bw = copy_bandwidth() if DEV == "cuda" else float("nan")
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    log(f"device {device}; copy bandwidth {bw / 1e9:.0f} GB/s; shape {args.shape}")
    old = load_old(args.old) if args.old else None
    cuts = {k: p.cuts(k) for k in ks}
    checks = []
    meta = dict(device=device, date=datetime.date.today().isoformat(), copy_bw_gbs=bw / 1e9,
                torch=torch.__version__, shape=args.shape, command="python " + " ".join(sys.argv),
                default_configs=_teal.TEAL_CONFIGS, fb=_teal.FB, checks=checks)
    rep = Report(args.out, meta, bw, d_model, d_inter)
    for k in ks:
        checks.append(check(p, teal_new(), k, "teal new", cuts[k]))
        checks.append(check(p, teal_new(), k, "teal new", cuts[k], x=p.xb))
        checks.append(check(p, teal_new(FUSED), k, "teal new (finish fused)", cuts[k]))
        if old is not None:
            checks.append(check(p, teal_old(old), k, "teal old", cuts[k]))
    if not all(c["ok"] for c in checks):
        log("a kernel is wrong: not timing")
        rep.write()
        return
    e = 2  # bytes per bf16 weight

    def teal_bytes(n_x, n_s):  # kept weight rows, x, and the compacted s list (index + value)
        return (2 * d_inter * n_x + d_model * n_s) * e + d_model * e + 8 * n_s

    dense = lambda x, w, tx, ts: F.linear(F.silu(F.linear(x, w["wg"])) * F.linear(x, w["wu"]), w["wd"])
    rep.row("dense", "-", time_fn(p, dense, 0.0, 0.0), 3 * d_model * d_inter * e)
    mono = lambda x, w, tx, ts: K.mono_gated_mlp(x, w["wg"], w["wu"], w["wdt"], ts, "silu")
    for k in ks:
        cx, cs, cm, n_x, n_s, n_m = cuts[k]
        rep.row("teal new", k, time_fn(p, new_timed(), cx, cs), teal_bytes(n_x, n_s), n_x, n_s)
        rep.row("teal new (finish fused)", k, time_fn(p, new_timed(FUSED), cx, cs), teal_bytes(n_x, n_s), n_x, n_s)
        if old is not None:
            rep.row("teal old", k, time_fn(p, old_timed(old), cx, cs), teal_bytes(n_x, n_s), n_x, n_s)
        rep.row("mono (kept s = kept rows)", k, time_fn(p, mono, 0.0, cm),
                (d_model * d_inter + 2 * d_model * n_m) * e, n_s=n_m)
        nb = (p.xb.float().abs() > cx).any(0).sum().item()  # the batch's union of kept x entries
        rep.row("teal new", k, time_fn(p, new_timed(), cx, cs, xs=[p.xb] * NSLOTS), teal_bytes(nb, n_s), nb, n_s,
                batch=3)
    rep.row("teal new (nothing kept)", 1.0, time_fn(p, new_timed(), 1e9, 1e9), 0.0, 0.0, 0.0)
    rep.row("teal new (finish fused, nothing kept)", 1.0, time_fn(p, new_timed(FUSED), 1e9, 1e9), 0.0, 0.0, 0.0)
    if args.profile and DEV == "cuda":
        profile(p, cuts, ks[-1], os.path.join(args.out, "profile.txt"))
    if args.pdl and DEV == "cuda":
        _pdl.ENABLED = True
        for k in ks:
            cx, cs, _, n_x, n_s, _ = cuts[k]
            checks.append(check(p, teal_new(), k, "teal new + PDL", cuts[k]))
            rep.row("teal new + PDL", k, time_fn(p, new_timed(), cx, cs), teal_bytes(n_x, n_s), n_x, n_s)
        _pdl.ENABLED = False
    if args.sweep:
        best, table = sweep(p, [k for k in (0.5, 0.9) if k in cuts] or ks[:1], cuts, budget)
        meta.update(best_swept=best, sweep=table)
        log(f"best batch-1 config: {best}")
        for k in ks:
            cx, cs, _, n_x, n_s, _ = cuts[k]
            checks.append(check(p, teal_new(best), k, "teal new (swept)", cuts[k]))
            rep.row("teal new (best swept)", k, time_fn(p, new_timed(best), cx, cs), teal_bytes(n_x, n_s), n_x, n_s)
    rep.write()
    print(rep.table())


if __name__ == "__main__":
    main()
