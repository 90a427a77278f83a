"""The split sparse phase (kernels/_split.py: coefficient list, then the down projection by columns)
against _onepass.py's (fp32 partials and their sum), one token.

    cd benchmarks && PYTHONPATH=../src:. python split.py --out DIR [--budget SECONDS]
    cd benchmarks && PYTHONPATH=../src:. python split.py --smoke --out /tmp/s   # CPU: checks the script

Llama-3.1-8B's MLP shape (4096 x 14336, SiLU), bf16, batch 1, CUDA graphs over 4 rotating weight sets
and 8 inputs (benchmarks/kernels.py's Problem); roofline = the kept rows' bytes / the device-to-device
copy bandwidth of the same run. The indicator is given (mono: |u| > t; dual: the predictor's scores > t).
Stages (results written after each; later stages are skipped once --budget seconds have passed):

1. check: at the real shape, k = 0.9 and 0.5, the split route's y against the float64 MLP on the kept rows.
2. sweep: k = 0.9, the sparse phase alone; _split.py's knobs one at a time from its default, each knob's
   fastest value kept before the next (coordinate descent), against _onepass.py's default (op + sum).
3. parts: k = 1 and 0.9, each launch alone (split's two; onepass's op and its partials' sum).
4. ks: both from nothing kept (k = 1, the fixed cost) to k = 0.7.
5. compiled: x + mlp(x) under torch.compile with the indicator GEMVs on the fixed GEMV as in a decode step
   (mono: u; dual: the rank-512 predictor), each route, k = 0.7 / 0.8 / 0.9.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

from countdown.bench import copy_bandwidth
from countdown.kernels import _onepass, _split

from balanced import (ACT, MODES, RANK, add, check_routes, given_keep, indicator, kept_fraction,  # noqa: E402
                      predictor_views, sparse_kernel, threshold, time_compiled, write_results)
from kernels import Problem, log, safe_time  # noqa: E402  (benchmarks/kernels.py)

KNOBS = [("BLOCK_C", (8192, 16384)), ("BT", (128, 512)), ("BN", (8, 32)), ("D_STAGES", (2, 3, 4, 5)),
         ("D_WARPS", (2, 8)), ("BLOCK_M", (2, 4, 8)), ("STAGES", (1, 2, 3)), ("PER_SM", (1, 4)), ("num_warps", (8,))]
T0 = time.time()


def phase(p: Problem, method: str, thr: float, kernel: str, cfg: dict | None = None):
    """The sparse phase alone for input i: y [1, d_model] in x's dtype, the indicator given."""
    mode, gate, up = MODES[method]

    def call(i):
        x, w, ind = p.xs[i], p.w(i), indicator(p, method, i)
        if kernel == "split":
            return _split.split_mlp(x, ind, w["wg"], w["wu"], w["wdt"], None, thr, mode, ACT, gate, up, config=cfg)
        part = _onepass.onepass_partials(x, None, None, w["wg"], w["wu"], w["wdt"], None, thr, mode, ACT, gate, up,
                                         ind=ind)
        return part.sum(0, keepdim=True).to(x.dtype)
    return call


def check(p: Problem) -> dict:
    return check_routes(p, {kernel: (lambda method, thr, kernel=kernel: phase(p, method, thr, kernel))
                            for kernel in ("onepass", "split")}, given_keep(p))


def _time(p, method, thr, kernel, cfg, label):
    us = safe_time(label, [lambda i=i: phase(p, method, thr, kernel, cfg)(i) for i in range(len(p.xs))])
    return us


def sweep(p: Problem, bw, rows, smoke: bool) -> dict:
    best = {}
    for method in MODES:
        mode = MODES[method][0]
        thr = threshold(p, method, 0.9)
        kept = kept_fraction(p, method, thr)
        add(rows, "sweep", method, 0.9, "onepass", _time(p, method, thr, "onepass", None, "onepass"), kept, bw, p)
        want = phase(p, method, thr, "onepass")(0).float()
        cur = dict(_split.CONFIGS[mode])
        cur_us = _time(p, method, thr, "split", cur, "split default")
        add(rows, "sweep", method, 0.9, "split", cur_us, kept, bw, p, cur)
        for knob, values in KNOBS[:2] if smoke else KNOBS:
            for v in values:
                if time.time() - T0 > ARGS.budget * 0.45:
                    break
                cfg = {**cur, knob: v}
                try:
                    got = phase(p, method, thr, "split", cfg)(0).float()
                except Exception as e:  # noqa: BLE001
                    log(f"sweep {method} {cfg} FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
                    continue
                if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                    log(f"sweep {method} {knob}={v}: output differs from onepass's, dropped")
                    continue
                us = _time(p, method, thr, "split", cfg, f"split {knob}={v}")
                add(rows, "sweep", method, 0.9, "split", us, kept, bw, p, cfg)
                if us == us and us < cur_us:
                    cur, cur_us = cfg, us
        best[method] = cur
        log(f"best {method} split: {json.dumps(cur, sort_keys=True)} {cur_us:.2f} us")
    return best


def parts(p: Problem, bw, rows, best, ks) -> None:
    """Each launch alone: split's coefficient kernel, its down kernel on a list made beforehand, onepass's
    op without its sum, and the sum of onepass's partials alone."""
    for method in MODES:
        mode, gate, up = MODES[method]
        cfg = {**_split.CONFIGS[mode], **best[method]}
        for k in ks:
            thr = threshold(p, method, k)
            kept = kept_fraction(p, method, thr)
            n = len(p.xs)
            coef = lambda i: _split.coefficients(p.xs[i], indicator(p, method, i), p.w(i)["wg"], p.w(i)["wu"], None,  # noqa: E731
                                                  thr, mode, ACT, gate, up, cfg)
            lists = [coef(i) for i in range(n)]
            down = lambda i: _split.down_by_columns(*lists[i], p.w(i)["wdt"], p.xs[i].dtype, cfg)  # noqa: E731
            part = lambda i: _onepass.onepass_partials(p.xs[i], None, None, p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"],  # noqa: E731
                                                       None, thr, mode, ACT, gate, up, ind=indicator(p, method, i))
            sums = [part(i) for i in range(n)]
            psum = lambda i: sums[i].sum(0, keepdim=True).to(p.xs[i].dtype)  # noqa: E731
            for name, fn in (("split-coef", coef), ("split-down", down), ("onepass-op", part), ("onepass-sum", psum)):
                us = safe_time(f"parts {method} {name} {k}", [lambda i=i: fn(i) for i in range(n)])
                add(rows, "parts", method, k, name, us, kept, bw, p, cfg if name.startswith("split") else None)


def over_ks(p: Problem, bw, rows, best, ks) -> None:
    for method in MODES:
        for k in ks:
            thr = threshold(p, method, k)
            kept = kept_fraction(p, method, thr)
            for kernel, cfg in (("onepass", None), ("split", best[method])):
                add(rows, "ks", method, k, kernel, _time(p, method, thr, kernel, cfg, f"{kernel} {k}"), kept, bw, p, cfg)


def compiled(p: Problem, bw, rows, best, ks) -> None:
    """x + mlp(x) under torch.compile with the one-token route of a decode step, each sparse kernel."""
    predictor_views(p)
    for method in MODES:
        mode = MODES[method][0]
        for kernel in ("onepass", "split"):
            old = dict(_split.CONFIGS[mode])
            if kernel == "split":
                _split.CONFIGS[mode] = dict(best[method])
            try:
                with sparse_kernel(kernel):
                    for k, thr, us in time_compiled(p, method, kernel, ks):
                        add(rows, "compiled", method, k, kernel, us, kept_fraction(p, method, thr), bw, p,
                            best[method] if kernel == "split" else None)
            finally:
                _split.CONFIGS[mode] = old


def write(out: str, rows: list, meta: dict) -> None:
    write_results(out, "split", "Split vs onepass sparse phase, one token", rows, meta,
                  ["stage", "method", "k", "kernel", "us", "kept", "roofline_us", "x_roofline", "config"])


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/split")
    ap.add_argument("--budget", type=float, default=420)
    ap.add_argument("--smoke", action="store_true", help="tiny shape (CPU interpreter): checks this script")
    ap.add_argument("--stages", default="check,sweep,parts,ks,compiled", help="comma-separated stages to run")
    ARGS = ap.parse_args()
    smoke = ARGS.smoke or not torch.cuda.is_available()
    d_model, d_inter = (64, 200) if smoke else (4096, 14336)
    p = Problem(d_model, d_inter, ACT, 1, 16 if smoke else RANK)
    bw = copy_bandwidth() if torch.cuda.is_available() else 1e12
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
                date=datetime.date.today().isoformat(), bw=bw, shape=f"{d_model} x {d_inter}",
                command="cd benchmarks && PYTHONPATH=../src:. python split.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__)
    rows: list = []
    stages = set(ARGS.stages.split(","))
    meta["check"] = check(p) if "check" in stages else None
    write(ARGS.out, rows, meta)
    best = sweep(p, bw, rows, smoke) if "sweep" in stages else {m: dict(_split.CONFIGS[MODES[m][0]]) for m in MODES}
    meta["best"] = best
    write(ARGS.out, rows, meta)
    if time.time() - T0 < ARGS.budget and "parts" in stages:
        parts(p, bw, rows, best, (1.0, 0.9))
        write(ARGS.out, rows, meta)
    if time.time() - T0 < ARGS.budget and "ks" in stages:
        over_ks(p, bw, rows, best, (1.0, 0.9, 0.7) if not smoke else (1.0, 0.9))
        write(ARGS.out, rows, meta)
    if time.time() - T0 < ARGS.budget and not smoke and "compiled" in stages:
        compiled(p, bw, rows, best, (0.7, 0.8, 0.9))
        write(ARGS.out, rows, meta)
    log("stage    method k     kernel         us  (roofline)")
    picked = {m: json.dumps(cfg, sort_keys=True) for m, cfg in best.items()}
    for r in rows:  # the sweep's onepass rows and the best split configuration; every row of the other stages
        if r["stage"] != "sweep" or r["kernel"] == "onepass" or r["config"] == picked[r["method"]]:
            log(f"{r['stage']:8s} {r['method']:5s} {r['k']:<5} {r['kernel']:9s} {r['us']:8.2f}  "
                f"(roofline {r['roofline_us']:.2f})")
    for m, cfg in best.items():
        log(f"best {m}: {json.dumps(cfg, sort_keys=True)}")
    return 0 if meta["check"] is None or meta["check"]["ok"] else 1


ARGS = None
if __name__ == "__main__":
    sys.exit(main())
