"""The balanced sparse phase (kernels/_balanced.py) against _onepass.py's, one token.

    cd benchmarks && PYTHONPATH=../src:. python balanced.py --out DIR [--budget SECONDS]
    cd benchmarks && PYTHONPATH=../src:. python balanced.py --smoke --out /tmp/b   # CPU: checks the script

Llama-3.1-8B's MLP shape (4096 x 14336, SiLU), bf16, batch 1, CUDA graphs over 4 rotating weight sets
and 8 inputs (benchmarks/kernels.py's Problem); roofline = the kept rows' bytes / the device-to-device
copy bandwidth of the same run. The indicator is given (mono: u = x W_up^T, |u| > t; dual: the
predictor's scores, score > t), so both kernels do exactly the sparse phase: read the indicator, find
the kept rows, load their gate / up / W_down^T rows, sum. Stages (results written after each; a stage
is skipped once --budget seconds have passed):

1. check: at the real shape, k = 0.9 and 0.5, both kernels' y against the float64 MLP on the kept rows.
2. sweep: k = 0.9, the sparse phase alone (op + the partials' sum), _onepass.py's default against
   _balanced.py under each configuration of SWEEP (registers and spills printed); the fastest kept.
3. ks: both kernels from nothing kept (k = 1) to everything kept (k = 0).
4. compiled: x + mlp(x) under torch.compile, the indicator GEMVs on the fixed GEMV as in a decode step
   (mono: u; dual: the rank-512 predictor), with each kernel, k = 0.7 / 0.8 / 0.9.
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
from countdown.bench import copy_bandwidth
from countdown.io import atomic_write
from countdown.kernels import _balanced, _onepass

from kernels import Compile, Problem, log, safe_time  # noqa: E402  (benchmarks/kernels.py)

ACT, E, RANK = "silu", 2, 512
_C = ("BM", "num_warps", "PER_SM", "PREFETCH", "BLOCK_R")
SWEEP = [dict(zip(_C, c)) for c in [
    (4, 8, 1, False, 16384), (4, 8, 1, False, 4096), (4, 8, 1, True, 16384), (2, 8, 1, True, 16384),
    (8, 8, 1, False, 16384), (8, 16, 1, False, 16384), (8, 16, 1, False, 4096), (4, 16, 1, True, 16384),
    (4, 4, 1, False, 4096)]]
# _onepass.py's own knobs around its default: one chunk per program (ROWS "auto": d_inter split evenly
# over the programs, not a power of two), larger tiles, fewer partial sums.
ONEPASS_SWEEP = [
    dict(STAGES=2, BLOCK_M=2), dict(STAGES=2, BLOCK_M=4), dict(STAGES=3, BLOCK_M=2), dict(STAGES=3, BLOCK_M=4),
    dict(ROWS="auto", BLOCK_M=4, num_warps=8, PER_SM=1), dict(ROWS="auto", BLOCK_M=4, num_warps=4, PER_SM=2),
    dict(CHUNK=128, BLOCK_M=8, num_warps=8, PER_SM=1), dict(CHUNK=128, BLOCK_M=4, num_warps=8, PER_SM=1, STAGES=2)]
MODES = {"mono": ("abs", True, False), "dual": ("gt", True, True)}  # mode, gate rows, up rows
T0 = time.time()


@contextlib.contextmanager
def sparse_kernel(name: str):
    old = _onepass.SPARSE_KERNEL
    _onepass.SPARSE_KERNEL = name
    try:
        yield
    finally:
        _onepass.SPARSE_KERNEL = old


def indicator(p: Problem, method: str, i: int) -> torch.Tensor:
    return p.u[i] if method == "mono" else p.score[i]


def threshold(p: Problem, method: str, k: float) -> float:
    if k >= 1:
        return 1e30
    if k <= 0:
        return -1e30 if method == "dual" else -1.0
    return p.thresholds(k)[method]


def kept_fraction(p: Problem, method: str, thr: float) -> float:
    vals = [indicator(p, method, i).float() for i in range(len(p.xs))]
    vals = [v.abs() if method == "mono" else v for v in vals]
    return float(torch.stack([(v > thr).float().mean() for v in vals]).mean())


def phase(p: Problem, method: str, thr: float, kernel: str, cfg: dict | None = None):
    """The sparse phase alone for input i: y = P.sum(0) in x's dtype, the indicator given."""
    mode, gate, up = MODES[method]

    def call(i):
        x, w, ind = p.xs[i], p.w(i), indicator(p, method, i)
        if kernel == "balanced":
            part = _balanced.balanced_partials(x, ind, w["wg"], w["wu"], w["wdt"], None, thr, mode, ACT, gate, up,
                                               config=cfg)
        else:
            part = _onepass.onepass_partials(x, None, None, w["wg"], w["wu"], w["wdt"], None, thr, mode, ACT, gate,
                                             up, config=cfg, ind=ind)
        return part.sum(0, keepdim=True).to(x.dtype)
    return call


def check_routes(p: Problem, routes: dict, keep_of, ks=(0.9, 0.5)) -> dict:
    """Each route's y against the float64 MLP on the rows ``keep_of(method, i, thr)`` keeps, inputs 0 and 1 of
    ``p`` at each k: ``routes`` maps a name to ``route(method, thr) -> (i -> y [1, d_model])``. The bound: twice
    PyTorch's own error at the model's dtype plus 1 % of the output's largest entry."""
    res = dict(ok=True, worst=0.0)
    for method in MODES:
        for k in ks:
            thr = threshold(p, method, k)
            for i in range(2):
                x, w = p.xs[i], p.w(i)
                keep = keep_of(method, i, thr)
                ref64 = K.gated_mlp_masked_ref(*[t.double() for t in (x, w["wg"], w["wu"], w["wdt"])], keep, ACT)
                ref_t = K.gated_mlp_masked_ref(x, w["wg"], w["wu"], w["wdt"], keep, ACT)
                for name, route in routes.items():
                    y = route(method, thr)(i)
                    err = (y.double() - ref64).abs()
                    margin = (err - 2 * (ref_t.double() - ref64).abs() - 1e-2 * ref64.abs().max()).max().item()
                    res["worst"] = max(res["worst"], err.max().item())
                    res["ok"] &= margin <= 0
                    log(f"check {method} k={k} input {i} {name}: max err {err.max().item():.3e} "
                        f"({'ok' if margin <= 0 else 'FAILED'})")
    return res


def given_keep(p: Problem):
    """keep_of for check_routes: the given indicator (mono's |u|, dual's scores) above the threshold."""
    def keep_of(method, i, thr):
        ind = indicator(p, method, i)
        return (ind.float().abs() if method == "mono" else ind.float()) > thr
    return keep_of


def check(p: Problem) -> dict:
    with sparse_kernel("onepass"):
        return check_routes(p, {kernel: (lambda method, thr, kernel=kernel: phase(p, method, thr, kernel))
                                for kernel in ("onepass", "balanced")}, given_keep(p))


def add(rows, stage, method, k, kernel, us, kept, bw, p, cfg=None, regs=None, spills=None):
    mats = 2 if method == "mono" else 3
    roof = mats * kept * p.d_inter * p.d_model * E / bw * 1e6
    rows.append(dict(stage=stage, method=method, k=k, kernel=kernel, us=us, kept=kept, roofline_us=roof,
                     x_roofline=us / roof if roof else float("nan"), config=json.dumps(cfg, sort_keys=True) if cfg else "",
                     regs=regs, spills=spills))
    log(f"{stage:8s} {method:5s} k={k:<5} {kernel:9s} {us:8.2f} us  roofline {roof:6.2f} us  {rows[-1]['config']} "
        f"{'' if regs is None else f'regs {regs} spills {spills}'}")


def sweep(p: Problem, bw, rows) -> dict:
    best: dict = {}
    for method in MODES:
        best[method] = {}
        thr = threshold(p, method, 0.9)
        kept = kept_fraction(p, method, thr)
        n = len(p.xs)
        us = safe_time("onepass", [lambda i=i: phase(p, method, thr, "onepass")(i) for i in range(n)])
        kern = _onepass.LAST_KERNEL
        add(rows, "sweep", method, 0.9, "onepass", us, kept, bw, p, None,
            getattr(kern, "n_regs", None), getattr(kern, "n_spills", None))
        want = phase(p, method, thr, "onepass")(0).float()
        scores = []
        for kernel, cfg in [("onepass", c) for c in ONEPASS_SWEEP] + [("balanced", c) for c in SWEEP]:
            try:
                got = phase(p, method, thr, kernel, cfg)(0).float()
            except Exception as e:  # noqa: BLE001
                log(f"sweep {method} {kernel} {cfg} FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
                continue
            if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                log(f"sweep {method} {kernel} {cfg}: output differs from the default, dropped")
                continue
            us = safe_time(f"{kernel} {cfg}", [lambda i=i: phase(p, method, thr, kernel, cfg)(i) for i in range(n)])
            kern = (_balanced if kernel == "balanced" else _onepass).LAST_KERNEL
            add(rows, "sweep", method, 0.9, kernel, us, kept, bw, p, cfg,
                getattr(kern, "n_regs", None), getattr(kern, "n_spills", None))
            if us == us:
                scores.append((us, kernel, cfg))
        for kernel in ("onepass", "balanced"):
            mine = [sc for sc in scores if sc[1] == kernel]
            best[method][kernel] = min(mine, key=lambda sc: sc[0])[2] if mine else None
            log(f"best {method} {kernel}: {best[method][kernel]}")
    return best


def variants(best, method) -> list:
    """The default onepass, then the fastest onepass and balanced configurations of the sweep."""
    out = [("onepass", None)]
    for kernel in ("onepass", "balanced"):
        if best[method].get(kernel):
            out.append((kernel, best[method][kernel]))
    return out


def over_ks(p: Problem, bw, rows, best, ks) -> None:
    n = len(p.xs)
    for method in MODES:
        for k in ks:
            thr = threshold(p, method, k)
            kept = kept_fraction(p, method, thr)
            for kernel, cfg in variants(best, method):
                us = safe_time(f"{kernel} {k}", [lambda i=i: phase(p, method, thr, kernel, cfg)(i) for i in range(n)])
                add(rows, "ks", method, k, kernel, us, kept, bw, p, cfg)


def predictor_views(p: Problem) -> None:
    """The predictor as LowRankFactors holds it: A and B views of contiguous A^T and B^T (sets' pa_v, pb_v)."""
    for s in p.sets:
        s["pa_v"] = s["pa"].t().contiguous().t()
        s["pb_v"] = s["pbt"].t()


def time_compiled(p: Problem, method: str, label: str, ks) -> list:
    """[(k, thr, us)] of x + mlp(x) under torch.compile with the one-token route of a decode step, whatever the
    routes' switches say now (call predictor_views(p) first)."""
    import torch._inductor.config as inductor_config

    inductor_config.force_disable_caches = True  # a configuration may change an op's output rows
    torch._dynamo.reset()
    if method == "mono":
        fn = torch.compile(lambda x, w, t: x + K.mono_gated_mlp(x, w["wg"], w["wu"], w["wdt"], t, ACT))
    else:
        fn = torch.compile(lambda x, w, t: x + K.dual_gated_mlp(x, w["wg"], w["wu"], w["wdt"], w["pa_v"], w["pb_v"],
                                                                t, ACT))
    out = []
    for k in ks:
        thr = threshold(p, method, k)
        try:  # a failure's whole message (safe_time logs its last line only)
            fn(p.xs[0], p.w(0), thr)
        except Exception as e:  # noqa: BLE001
            log(f"compiled {method} {label} k={k} FAILED: {type(e).__name__}: {str(e)[:1500]}")
            continue
        out.append((k, thr, safe_time(f"compiled {method} {label} {k}",
                                       [lambda i=i: fn(p.xs[i], p.w(i), thr) for i in range(len(p.xs))])))
    torch._dynamo.reset()
    return out


def compiled(p: Problem, bw, rows, best, ks) -> None:
    """x + mlp(x) under torch.compile with the one-token route of a decode step."""
    predictor_views(p)
    for method in MODES:
        mode = MODES[method][0]
        for kernel, cfg in variants(best, method):
            old_b, old_o = dict(_balanced.CONFIG), dict(_onepass.CONFIGS[mode])
            (_balanced.CONFIG if kernel == "balanced" else _onepass.CONFIGS[mode]).update(cfg or {})
            try:
                with sparse_kernel(kernel):
                    for k, thr, us in time_compiled(p, method, kernel, ks):
                        add(rows, "compiled", method, k, kernel, us, kept_fraction(p, method, thr), bw, p, cfg)
            finally:
                _balanced.CONFIG.clear()
                _balanced.CONFIG.update(old_b)
                _onepass.CONFIGS[mode] = old_o


def write_results(out: str, stem: str, title: str, rows: list, meta: dict, cols: list[str], md_rows=None) -> None:
    """OUT/STEM.json (meta and rows), .csv (``cols``) and .md (the meta's device, date, bandwidth, command, check
    and best, then a table of ``md_rows``, by default every row): the one-token sparse benchmarks' results."""
    os.makedirs(out, exist_ok=True)
    atomic_write(os.path.join(out, stem + ".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [",".join(cols)] + [",".join(_cell(r[c]) for c in cols) for r in rows]
    atomic_write(os.path.join(out, stem + ".csv"), "\n".join(lines) + "\n")
    shown = [c for c in cols if c not in ("kept", "regs", "spills")]
    md = [f"# {title} ({meta['shape']})", "",
          f"- device: {meta['device']}; date: {meta['date']}; copy bandwidth {meta['bw'] / 1e12:.2f} TB/s",
          f"- command: `{meta['command']}`", f"- check: {meta.get('check')}", f"- best: {meta.get('best')}", "",
          "| " + " | ".join(c.replace("_", " ") for c in shown) + " |", "|" + "---|" * len(shown)]
    md += ["| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in shown) + " |"
           for r in (rows if md_rows is None else md_rows)]
    atomic_write(os.path.join(out, stem + ".md"), "\n".join(md) + "\n")


def write(out: str, rows: list, meta: dict) -> None:
    write_results(out, "balanced", "Balanced vs onepass sparse phase, one token", rows, meta,
                  ["stage", "method", "k", "kernel", "us", "kept", "roofline_us", "x_roofline", "config", "regs", "spills"])


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    text = str(v)
    return '"' + text.replace('"', '""') + '"' if "," in text or '"' in text else text


def compile_check() -> bool:
    """No GPU needed: compile every SWEEP configuration for sm_90 and log registers and spills."""
    failures: list = []
    _balanced._balanced_kernel = Compile(_balanced._balanced_kernel, failures)
    e = lambda *shape: torch.empty(shape, dtype=torch.bfloat16)
    x, w, ind = e(1, 4096), e(14336, 4096), e(1, 14336)
    cut = torch.empty(14336, dtype=torch.float32)
    for cfg in [None] + SWEEP:
        _balanced.balanced_partials(x, ind, w, w, w, None, 0.5, "abs", ACT, True, False, config=cfg)
        _balanced.balanced_partials(x, ind, w, w, w, cut, 0.0, "gt", ACT, True, True, config=cfg)
    log(f"compile check: {len(failures)} failures")
    return not failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/balanced")
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--smoke", action="store_true", help="tiny shape (CPU interpreter): checks this script")
    ap.add_argument("--compile-check", action="store_true", help="no GPU: compile for sm_90, print registers")
    ap.add_argument("--stages", default="check,sweep,ks,compiled", help="comma-separated stages to run")
    ap.add_argument("--onepass-only", action="store_true", help="sweep _onepass.py's configurations only")
    args = ap.parse_args()
    if args.compile_check:
        return 0 if compile_check() else 1
    smoke = args.smoke or not torch.cuda.is_available()
    d_model, d_inter = (64, 200) if smoke else (4096, 14336)
    p = Problem(d_model, d_inter, ACT, 1, 16 if smoke else RANK)
    bw = copy_bandwidth() if torch.cuda.is_available() else 1e12
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
                date=datetime.date.today().isoformat(), bw=bw, shape=f"{d_model} x {d_inter}",
                command="cd benchmarks && PYTHONPATH=../src:. python balanced.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__)
    rows: list = []
    stages = set(args.stages.split(","))
    meta["check"] = check(p) if "check" in stages else None
    write(args.out, rows, meta)
    global SWEEP
    if smoke:
        SWEEP = SWEEP[:2]
    if args.onepass_only:
        SWEEP = []
    best = sweep(p, bw, rows) if "sweep" in stages else {m: dict(onepass=None, balanced=dict(_balanced.CONFIG))
                                                         for m in MODES}
    meta["best"] = best
    write(args.out, rows, meta)
    if time.time() - T0 < args.budget and "ks" in stages:
        over_ks(p, bw, rows, best, (1.0, 0.99, 0.9, 0.8, 0.7, 0.5, 0.0) if not smoke else (1.0, 0.9, 0.0))
        write(args.out, rows, meta)
    if time.time() - T0 < args.budget and not smoke and "compiled" in stages:
        compiled(p, bw, rows, best, (0.7, 0.8, 0.9))
        write(args.out, rows, meta)
    log("stage   method k     kernel         us")
    for r in rows:
        if r["stage"] != "sweep" or r["kernel"] == "onepass":
            log(f"{r['stage']:8s} {r['method']:5s} {r['k']:<5} {r['kernel']:9s} {r['us']:8.2f}  "
                f"(roofline {r['roofline_us']:.2f})")
    return 0 if meta["check"] is None or meta["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
