"""The overlapped sparse MLP (kernels/_overlap.py: the sparse rows loaded while the indicator's GEMV streams)
against the default one-token route (the indicator on the fixed GEMV, then _onepass.py), whole MLPs.

    cd benchmarks && PYTHONPATH=../src:. python overlap.py --out DIR [--budget SECONDS]
    cd benchmarks && PYTHONPATH=../src:. python overlap.py --smoke --out /tmp/o   # CPU: checks the script

Llama-3.1-8B's MLP shape (4096 x 14336, SiLU), bf16, batch 1, CUDA graphs over 4 rotating weight sets and 8
inputs (benchmarks/kernels.py's Problem); roofline = the bytes read (the indicator's weight, dense, plus the
kept rows) / the device-to-device copy bandwidth of the same run. mono: u = x W_up^T, |u| > t; dual: the
rank-512 predictor's scores (x A) B > t, x A on the fixed GEMV in both routes. Stages:

1. check: at the real shape, k = 0.9 and 0.5, both routes' y against the float64 MLP on the rows the
   route's own indicator keeps (their indicators may differ by a rounding at a tie: counted, not failed).
2. sweep: k = 0.9, the overlapped kernel's knobs one at a time from its default (coordinate descent).
3. producer (only when asked): the indicator GEMV alone, the fixed GEMV against the persistent producers
   with and without their counting.
4. ks: both routes at k = 1 (nothing kept), 0.9, 0.8, 0.7.
5. compiled: x + mlp(x) under torch.compile (fixed GEMV for the indicators) with each route, k = 0.7-0.9.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

import countdown.kernels as K
from countdown.bench import copy_bandwidth
from countdown.kernels import _onepass, _overlap

from balanced import (ACT, MODES, RANK, check_routes, predictor_views, sparse_kernel, threshold,  # noqa: E402
                      time_compiled, write_results)
from kernels import Problem, log, safe_time  # noqa: E402  (benchmarks/kernels.py)

E = 2
KNOBS = [("producer", [dict(PROD=a, RB=r, PSTAGES=1, EVERY=e) for a, r, e in
                       ((4, 2, 2), (4, 2, 4), (4, 4, 2), (6, 2, 2), (6, 2, 4), (8, 2, 2), (8, 2, 4))]),
         ("PUBLISH", [dict(PUBLISH="chunk", PSTAGES=2), dict(PUBLISH="chunk", PSTAGES=2, PROD=2, P_WARPS=8, RB=8,
                                                                CHUNK=32)]),
         ("PSTAGES", [dict(PSTAGES=n) for n in (2, 3)]),
         ("CONS/C_WARPS", [dict(CONS=2, C_WARPS=4), dict(CONS=1, C_WARPS=8)]),
         ("CHUNK", [dict(CHUNK=c) for c in (16, 64)]), ("BLOCK_M", [dict(BLOCK_M=b) for b in (2, 8)]),
         ("STAGES", [dict(STAGES=2)])]
T0 = time.time()
BW = 1e12


def mlp(p: Problem, method: str, thr: float, route: str, cfg: dict | None = None):
    """The whole MLP of input i as a decode step runs it (y [1, d_model] in x's dtype)."""
    mode, gate, up = MODES[method]

    def call(i):
        x, w = p.xs[i], p.w(i)
        if method == "mono":
            v, w_ind = x, w["wu"]
        else:
            v, w_ind = _onepass.ind_linear(x, w["pat"]), w["pbt"]
        if route == "overlap":
            part = _overlap.overlap_partials(x, v, w_ind, w["wg"], w["wu"], w["wdt"], None, thr, mode, ACT, gate, up,
                                             config=cfg)
        else:
            ind = _onepass.ind_linear(v, w_ind)
            part = _onepass.onepass_partials(x, None, None, w["wg"], w["wu"], w["wdt"], None, thr, mode, ACT, gate,
                                             up, ind=ind)
        return part.sum(0, keepdim=True).to(x.dtype)
    return call


def indicator(p: Problem, method: str, i: int) -> torch.Tensor:
    x, w = p.xs[i], p.w(i)
    return (x @ w["wu"].t()).float().abs() if method == "mono" else K.dual_scores(x, w["pa"], w["pb"]).float()


def kept_fraction(p, method, thr) -> float:
    return float(torch.stack([(indicator(p, method, i) > thr).float().mean() for i in range(len(p.xs))]).mean())


def add(rows, stage, method, k, route, us, kept, bw, p, cfg=None):
    ind_bytes = p.d_inter * (p.d_model if method == "mono" else p.rank) * E + (0 if method == "mono" else p.d_model * p.rank * E)
    mats = 2 if method == "mono" else 3
    roof = (ind_bytes + mats * kept * p.d_inter * p.d_model * E) / bw * 1e6
    rows.append(dict(stage=stage, method=method, k=k, route=route, us=us, kept=kept, roofline_us=roof,
                     x_roofline=us / roof if roof else float("nan"), config=json.dumps(cfg, sort_keys=True) if cfg else ""))
    log(f"{stage:8s} {method:5s} k={k:<5} {route:8s} {us:8.2f} us  roofline {roof:6.2f} us  {rows[-1]['config']}")


def check(p: Problem) -> dict:
    """Both routes against float64 on the rows their indicator keeps (mono's |u|, dual's scores above thr)."""
    return check_routes(p, {route: (lambda method, thr, route=route: mlp(p, method, thr, route))
                            for route in ("onepass", "overlap")},
                        lambda method, i, thr: indicator(p, method, i) > thr)


def time_route(p, method, thr, route, cfg=None):
    return safe_time(f"{method} {route} {cfg}", [lambda i=i: mlp(p, method, thr, route, cfg)(i) for i in range(len(p.xs))])


def sweep(p: Problem, bw, rows, smoke: bool) -> dict:
    best = {}
    for method in MODES:
        thr = threshold(p, method, 0.9)
        kept = kept_fraction(p, method, thr)
        add(rows, "sweep", method, 0.9, "onepass", time_route(p, method, thr, "onepass"), kept, bw, p)
        cur = dict(_overlap.CONFIG)
        cur_us = time_route(p, method, thr, "overlap", cur)
        add(rows, "sweep", method, 0.9, "overlap", cur_us, kept, bw, p, cur)
        want = mlp(p, method, thr, "onepass")(0).float()
        for knob, values in KNOBS[1:2] if smoke else KNOBS:
            for val in values:
                cfg = {**cur, **val}
                try:
                    got = mlp(p, method, thr, "overlap", cfg)(0).float()
                except Exception as e:  # noqa: BLE001
                    log(f"sweep {method} {cfg} FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
                    continue
                if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                    log(f"sweep {method} {knob}={val}: output differs from onepass's, dropped")
                    continue
                us = time_route(p, method, thr, "overlap", cfg)
                add(rows, "sweep", method, 0.9, "overlap", us, kept, bw, p, cfg)
                if us == us and us < cur_us:
                    cur, cur_us = cfg, us
        best[method] = cur
        log(f"best {method} overlap: {json.dumps(cur, sort_keys=True)} {cur_us:.2f} us")
    return best


PRODUCERS = [dict(PROD=a, P_WARPS=w, RB=r, PSTAGES=n, EVERY=e) for a, w, r, n, e in
             ((8, 4, 2, 1, 1), (8, 4, 2, 1, 2), (8, 4, 2, 1, 4), (4, 4, 2, 1, 1), (4, 4, 2, 1, 2), (4, 4, 2, 1, 4),
              (4, 4, 4, 1, 2), (4, 4, 4, 2, 2), (6, 4, 2, 1, 2), (6, 4, 2, 1, 4), (16, 2, 2, 1, 2))]


def producer(p: Problem, rows) -> None:
    """The indicator GEMV alone: the fixed GEMV (the default route's) against the persistent producers, counting
    each step (as the consumers need) or not (the GEMV's own speed), into a scratch counter buffer."""
    cnt = torch.zeros(_overlap.MAX_CHUNKS, dtype=torch.int32, device=p.xs[0].device)
    for method in MODES:
        def v_w(i):
            x, w = p.xs[i], p.w(i)
            return (x, w["wu"]) if method == "mono" else (latents[i], w["pbt"])
        latents = [_onepass.ind_linear(x, p.w(i)["pat"]) for i, x in enumerate(p.xs)]
        n = len(p.xs)
        w_bytes = p.d_inter * (p.d_model if method == "mono" else p.rank) * E
        fixed = safe_time(f"fixed {method}", [lambda i=i: _onepass.ind_linear(*v_w(i)) for i in range(n)])
        rows.append(dict(stage="producer", method=method, k="", route="fixed-gemv", us=fixed, kept=0.0,
                         roofline_us=w_bytes / BW * 1e6, x_roofline=fixed / (w_bytes / BW * 1e6), config=""))
        log(f"producer {method} fixed GEMV {fixed:.2f} us")
        for cfg in PRODUCERS:
            full = {**_overlap.CONFIG, **cfg}
            for count in (False, True):
                ind = torch.empty(p.d_inter, dtype=p.xs[0].dtype, device=p.xs[0].device)
                us = safe_time(f"producer {method} {cfg} {count}",
                               [lambda i=i: _overlap.produce(*v_w(i), ind, cnt, full, 0, count) for i in range(n)])
                rows.append(dict(stage="producer", method=method, k="", route="counted" if count else "uncounted", us=us,
                                 kept=0.0, roofline_us=w_bytes / BW * 1e6, x_roofline=us / (w_bytes / BW * 1e6),
                                 config=json.dumps(cfg, sort_keys=True)))
                log(f"producer {method} {'counted' if count else 'uncounted'} {cfg} {us:.2f} us")


def over_ks(p: Problem, bw, rows, best, ks) -> None:
    for method in MODES:
        for k in ks:
            thr = threshold(p, method, k)
            kept = kept_fraction(p, method, thr)
            for route, cfg in (("onepass", None), ("overlap", best[method])):
                add(rows, "ks", method, k, route, time_route(p, method, thr, route, cfg), kept, bw, p, cfg)


def compiled(p: Problem, bw, rows, best, ks) -> None:
    """x + mlp(x) under torch.compile with the one-token route of a decode step, each route."""
    predictor_views(p)
    for method in MODES:
        for route in ("onepass", "overlap"):
            old = dict(_overlap.CONFIG)
            _overlap.CONFIG.update(best[method] if route == "overlap" else {})
            try:
                with sparse_kernel(route):
                    for k, thr, us in time_compiled(p, method, route, ks):
                        add(rows, "compiled", method, k, route, us, kept_fraction(p, method, thr), bw, p,
                            best[method] if route == "overlap" else None)
            finally:
                _overlap.CONFIG.clear()
                _overlap.CONFIG.update(old)


def write(out: str, rows: list, meta: dict) -> None:
    write_results(out, "overlap", "Overlapped vs default one-token sparse MLP", rows, meta,
                  ["stage", "method", "k", "route", "us", "kept", "roofline_us", "x_roofline", "config"],
                  md_rows=[r for r in rows if r["stage"] != "sweep"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/overlap")
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--smoke", action="store_true", help="tiny shape (CPU interpreter): checks this script")
    ap.add_argument("--stages", default="check,sweep,ks,compiled", help="comma-separated stages to run")
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    d_model, d_inter = (64, 200) if smoke else (4096, 14336)
    p = Problem(d_model, d_inter, ACT, 1, 16 if smoke else RANK)
    for s in p.sets:  # A^T contiguous, as the predictor holds it
        s["pat"] = s["pa"].t().contiguous()
    dev = p.xs[0].device
    _overlap.prepare(dev)  # its counters, before anything is captured
    bw = copy_bandwidth() if torch.cuda.is_available() else 1e12
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
                date=datetime.date.today().isoformat(), bw=bw, shape=f"{d_model} x {d_inter}",
                command="cd benchmarks && PYTHONPATH=../src:. python overlap.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__)
    rows: list = []
    stages = set(args.stages.split(","))
    meta["check"] = check(p) if "check" in stages else None
    write(args.out, rows, meta)
    best = sweep(p, bw, rows, smoke) if "sweep" in stages else {m: dict(_overlap.CONFIG) for m in MODES}
    meta["best"] = best
    write(args.out, rows, meta)
    global BW
    BW = bw
    if "producer" in stages:
        producer(p, rows)
        write(args.out, rows, meta)
    if time.time() - T0 < args.budget and "ks" in stages:
        over_ks(p, bw, rows, best, (1.0, 0.9, 0.8, 0.7) if not smoke else (1.0, 0.9))
        write(args.out, rows, meta)
    if time.time() - T0 < args.budget and not smoke and "compiled" in stages:
        compiled(p, bw, rows, best, (0.7, 0.8, 0.9))
        write(args.out, rows, meta)
    log("stage    method k     route          us  (roofline)")
    for r in rows:
        if r["stage"] != "sweep" or r["config"] in ("", json.dumps(best[r["method"]], sort_keys=True)):
            log(f"{r['stage']:8s} {r['method']:5s} {r['k']:<5} {r['route']:8s} {r['us']:8.2f}  (roofline {r['roofline_us']:.2f})")
    for m, cfg in best.items():
        log(f"best {m}: {json.dumps(cfg, sort_keys=True)}")
    return 0 if meta["check"] is None or meta["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
