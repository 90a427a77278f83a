"""One-token Gated-MLP: the one-launch kernel (kernels/_onepass.py) against the two-kernel chain.

    PYTHONPATH=src python benchmarks/onepass.py --out DIR [--sweep]
    PYTHONPATH=src python benchmarks/onepass.py --compile-check      # no GPU: registers, spills

Llama-3.1-8B's MLP shape (and gemma-2-9b's for GELU-tanh), bf16, batch 1. First every path is
checked against float64 at the real shape on inputs from a coarse grid (every fp32 sum exact, so
the kernel's own indicator keeps the same rows as cuBLAS's); then, with --sweep, candidate launch
configurations of the one-launch kernel are timed at k = 0.9 per indicator kind (mono's W_up rows,
dual's predictor rows) and the fastest whose output matches the default's is used; then, per method
and k, it times (CUDA-graph replays of 8 calls over 4 weight sets, median, as benchmarks/kernels.py):

    chain            the two-kernel path (GLU kernel, down kernel, cast)
    onepass          the one-launch kernel, its partial sums reduced and cast by PyTorch (eager)
    chain+res cmp    x + mlp(x) under torch.compile: what a decode step runs
    onepass+res cmp  the same with the one-launch kernel (Inductor fuses the sum, cast and add)
    dense cmp        x + dense mlp(x) under torch.compile (Inductor's own GEMVs)

Roofline = bytes that must be read / the copy bandwidth measured in the run.
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
from countdown.kernels import _common, _onepass

from kernels import (DEV, DTYPE, SHAPES, Compile, Problem, gap_threshold, log, run_check,  # noqa: E402
                     safe_time)
from countdown.bench import copy_bandwidth  # noqa: E402

MAIN = "Llama-3.1-8B"
E = 2
# Candidates per indicator kind with the indicator given (IND="torch": only the chunk's indicators
# and the kept rows are loaded), CHUNK indicators per step, BLOCK_M kept rows per tile.
SWEEP = {mode: [dict(IND="torch", CHUNK=c, BLOCK_M=m, num_warps=w, PER_SM=p, PREFETCH=False)
                for c, m, w, p in ((16, 2, 4, 4), (16, 2, 4, 8), (8, 2, 4, 8), (32, 2, 4, 4), (32, 4, 4, 4),
                                   (16, 2, 8, 4), (32, 4, 8, 2), (64, 4, 4, 4))]
         for mode in ("abs", "gt")}


@contextlib.contextmanager
def onepass(on: bool, config: dict | None = None, mode: str | None = None):
    old = (_onepass.ONEPASS, {k: dict(v) for k, v in _onepass.CONFIGS.items()})
    _onepass.ONEPASS = on
    if config is not None:
        _onepass.CONFIGS[mode] = {**_onepass.CONFIGS[mode], **config}
    try:
        yield
    finally:
        _onepass.ONEPASS, _onepass.CONFIGS = old[0], old[1]


def op_call(method, x, w, thr, act):
    if method == "mono":
        return lambda xx=x: K.mono_gated_mlp(xx, w["wg"], w["wu"], w["wdt"], thr, act)
    if method == "cats":
        return lambda xx=x: K.cats_gated_mlp(xx, w["wg"], w["wu"], w["wdt"], thr, act)
    return lambda xx=x: K.dual_gated_mlp(xx, w["wg"], w["wu"], w["wdt"], w["pa"], w["pbt"].t(), thr, act)


def check(name) -> bool:
    """The one-launch path and the chain, b1, against float64 on exact (coarse-grid) inputs."""
    d_model, d_inter, act = SHAPES[name]
    torch.manual_seed(3)
    grid = lambda shape, step, lim: ((torch.randint(-lim, lim + 1, shape, device=DEV) * step)).to(DTYPE)
    x = grid((1, d_model), 1 / 8, 16)
    wg, wu = grid((d_inter, d_model), 1 / 64, 8), grid((d_inter, d_model), 1 / 64, 8)
    wdt = (torch.randn(d_inter, d_model, device=DEV) * d_inter**-0.5).to(DTYPE)
    pa, pbt = grid((d_model, 64), 1 / 64, 8), grid((d_inter, 64), 1 / 8, 8)
    w = dict(wg=wg, wu=wu, wdt=wdt, pa=pa, pbt=pbt)
    f64 = [t.double() for t in (wg, wu, wdt)]
    ok = True
    for method in ("mono", "cats", "dual"):
        for k in (0.7, 0.9):
            if method == "mono":
                thr = gap_threshold((x @ wu.t()).float().abs(), k)
                keep = K.mono_keep(x, wu, thr)
            elif method == "cats":
                thr = gap_threshold(_common.act_torch((x @ wg.t()).float(), act).abs(), k)
                keep = K.cats_keep(x, wg, thr, act)
            else:
                thr = gap_threshold(K.dual_scores(x, pa, pbt.t()).float(), k)
                keep = K.dual_keep(x, pa, pbt.t(), thr)
            ref = {"mono": K.mono_gated_mlp_ref, "cats": K.cats_gated_mlp_ref}.get(method)
            ref_fn = (lambda: ref(x, wg, wu, wdt, thr, act)) if ref else \
                (lambda: K.dual_gated_mlp_ref(x, wg, wu, wdt, pa, pbt.t(), thr, act))
            for on in (True, False):
                tag = f"{method}[{'onepass' if on else 'chain'}] k={k}"
                ok &= run_check(f"{name:13s} b1 {tag:24s}", op_call(method, x, w, thr, act), ref_fn, keep, x,
                                f64, act, 1e-2, [onepass(on)], key=tag)
    return ok


def sweep(p: Problem, thr) -> tuple[dict, list]:
    """Time the candidates per indicator kind at the given thresholds; return the winners."""
    best, rows = {}, []
    for mode, method in (("abs", "mono"), ("gt", "dual")):
        with onepass(True):
            want = op_call(method, p.xs[0], p.w(0), thr[method], p.act)()
        scores = []
        for cfg in SWEEP[mode]:
            with onepass(True, cfg, mode):
                try:
                    got = op_call(method, p.xs[0], p.w(0), thr[method], p.act)()
                    good = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
                except Exception as e:  # noqa: BLE001
                    log(f"sweep {mode} {cfg} FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
                    continue
                if not good:
                    log(f"sweep {mode} {cfg} output differs: dropped")
                    continue
                us = safe_time(f"{mode} {cfg}", [op_call(method, p.xs[i], p.w(i), thr[method], p.act)
                                                 for i in range(len(p.xs))])
                kern = _onepass.LAST_KERNEL
                info = getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)
            log(f"sweep {mode} {json.dumps(cfg)} {us:7.2f} us regs {info[0]} spills {info[1]}")
            rows.append(dict(mode=mode, config=cfg, us=us, regs=info[0], spills=info[1]))
            scores.append((us, cfg))
        scores = [s for s in scores if s[0] == s[0]]
        best[mode] = min(scores, key=lambda s: s[0])[1]
    return best, rows


def bench(name, ks, rank, bw) -> list[dict]:
    d_model, d_inter, act = SHAPES[name]
    p = Problem(d_model, d_inter, act, 1, rank)
    for s in p.sets:
        s["pbt"] = s["pb"].t().contiguous()
    mat = d_model * d_inter * E
    rows = []

    def row(method, k, variant, us, nbytes, kept=float("nan")):
        r = dict(shape=name, method=method, sparsity=k, variant=variant, us=us, roofline_us=nbytes / bw * 1e6,
                 kept=kept)
        rows.append(r)
        log(f"{name:13s} {method:5s} k={k:.2f} {variant:16s} {us:7.1f} us  roof {r['roofline_us']:6.1f}  "
            f"x{us / r['roofline_us']:.2f}")

    dense = lambda x, w: x + torch.nn.functional.linear(
        _common.act_torch(x @ w["wg"].t(), act) * (x @ w["wu"].t()), w["wdt"].t())
    dense_c = torch.compile(dense)
    row("dense", 0.0, "cmp", safe_time("dense cmp", [lambda i=i: dense_c(p.xs[i], p.w(i)) for i in range(8)]),
        3 * mat)
    for k in ks:
        thr = p.thresholds(k)
        masks, _ = p.masks(k)
        for method in ("mono", "cats", "dual"):
            kept = float(torch.stack([m.float().mean() for m in masks[method]]).mean())
            nbytes = (mat + 2 * mat * kept) if method != "dual" else \
                (d_model * rank * E + rank * d_inter * E + 3 * mat * kept)
            for on, cfg in ((False, None), (True, None), (True, _onepass.KERNEL_IND_CONFIGS["gt" if method == "dual" else "abs"])):
                tag = "chain" if not on else ("onepass" if cfg is None else "onepass[ind kernel]")
                mode = {"mono": "abs", "cats": "abs_act", "dual": "gt"}[method]
                with onepass(on, cfg, mode):
                    calls = [op_call(method, p.xs[i], p.w(i), thr[method], act) for i in range(8)]
                    row(method, k, tag, safe_time(tag, calls), nbytes, kept)
                    fn = torch.compile(lambda x, w, t, m=method: x + op_call(m, x, w, t, act)(x))
                    calls = [lambda i=i: fn(p.xs[i], p.w(i), thr[method]) for i in range(8)]
                    row(method, k, tag + "+res cmp", safe_time(tag + " cmp", calls), nbytes, kept)
                    torch._dynamo.reset()
    return rows


def stages(ks, rank, bw) -> list[dict]:
    """Where the one-launch kernel's time goes: the indicator phase alone (SPARSE=False: the
    indicator rows are read and compared, no kept row is loaded) against the whole kernel, and the
    dense indicator GEMV by cuBLAS and by Inductor for comparison (mono: x W_up^T, 117 MB)."""
    d_model, d_inter, act = SHAPES[MAIN]
    p = Problem(d_model, d_inter, act, 1, rank)
    for s in p.sets:
        s["pbt"] = s["pb"].t().contiguous()
    rows = []
    mat = d_model * d_inter * E

    def add(what, k, us, nbytes):
        rows.append(dict(what=what, k=k, us=us, roofline_us=nbytes / bw * 1e6))
        log(f"stages {what:34s} k={k:.2f} {us:7.1f} us  roof {nbytes / bw * 1e6:6.1f}")

    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True  # as the decode harness compiles (GEMVs -> Triton)
    gemv = torch.compile(lambda x, w: x @ w.t())
    add("u = x W_up^T, cuBLAS", 0, safe_time("cublas", [lambda i=i: p.xs[i] @ p.w(i)["wu"].t() for i in range(8)]), mat)
    add("u = x W_up^T, Inductor", 0, safe_time("inductor", [lambda i=i: gemv(p.xs[i], p.w(i)["wu"]) for i in range(8)]),
        mat)
    add("scores = (x A) B^T-rows, Inductor", 0,
        safe_time("inductor scores", [lambda i=i: gemv(gemv(p.xs[i], p.w(i)["pa"].t()), p.w(i)["pbt"])
                                      for i in range(8)]), (d_model + d_inter) * rank * E)
    for k in ks:
        thr = p.thresholds(k)
        for method, mode in (("mono", "abs"), ("dual", "gt")):
            ind_bytes = mat if method == "mono" else (d_model + d_inter) * rank * E
            for sparse in (False, True):
                with onepass(True, dict(SPARSE=sparse), mode):
                    calls = [op_call(method, p.xs[i], p.w(i), thr[method], act) for i in range(8)]
                    add(f"{method} onepass {'whole' if sparse else 'indicator phase only'}", k,
                        safe_time(f"{method} {sparse}", calls), ind_bytes)
    return rows


def compile_check() -> bool:
    failures = []
    _onepass._onepass_kernel = Compile(_onepass._onepass_kernel, failures)
    for name in (MAIN, "gemma-2-9b"):
        d_model, d_inter, act = SHAPES[name]
        e = lambda *shape: torch.empty(shape, dtype=DTYPE)
        x, w, lat, bt = e(1, d_model), e(d_inter, d_model), e(1, 512), e(d_inter, 512)
        cut = torch.empty(d_inter, dtype=torch.float32)
        for mode, cfgs in SWEEP.items():
            for cfg in [None] + (cfgs if name == MAIN else []):
                ind = e(1, d_inter)
                kern = [_onepass.KERNEL_IND_CONFIGS[mode]] if cfg is None else []
                if mode == "abs":
                    _onepass.onepass_partials(x, None, None, w, w, w, None, 0.5, "abs", act, True, False, cfg, ind=ind)
                    for c in kern:  # the indicator computed in the kernel
                        _onepass.onepass_partials(x, x, w, w, w, w, None, 0.5, "abs", act, True, False, c)
                    if cfg is None:
                        _onepass.onepass_partials(x, None, None, w, w, w, None, 0.5, "abs_act", act, False, True,
                                                  ind=ind)
                else:
                    _onepass.onepass_partials(x, None, None, w, w, w, cut, 0.0, "gt", act, True, True, cfg, ind=ind)
                    if cfg is None:  # dual_block's: x the residual h, the norm in the kernel (kernels/_block.py)
                        _onepass.onepass_partials(x, None, None, w, w, w, cut, 0.0, "gt", act, True, True, ind=ind,
                                                  norm=(e(d_model), 1e-5))
                    for c in kern:
                        _onepass.onepass_partials(x, lat, bt, w, w, w, cut, 0.0, "gt", act, True, True, c)
    log(f"compile check: {len(failures)} failures")
    return not failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/onepass")
    ap.add_argument("--ks", nargs="*", type=float, default=[0.7, 0.8, 0.9])
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--stages", action="store_true", help="only the stage-isolation timings (see stages())")
    ap.add_argument("--compile-check", action="store_true", help="no GPU: compile for sm_90, print registers")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke test of this script: TRITON_INTERPRET=1, the tiny shape, two candidates")
    args = ap.parse_args()
    if args.compile_check:
        sys.exit(0 if compile_check() else 1)
    global MAIN
    if args.smoke:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--smoke runs under TRITON_INTERPRET=1"
        _onepass.ONEPASS_OFF_CUDA = True
        MAIN = "tiny"
        for mode in SWEEP:
            SWEEP[mode] = SWEEP[mode][:2]
    elif DEV != "cuda":
        sys.exit("needs a GPU (use --compile-check or --smoke here)")
    import triton

    t0 = time.time()
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke test)"
    bw = copy_bandwidth() if DEV == "cuda" else 1e10
    log(f"device {dev}, torch {torch.__version__}, triton {triton.__version__}, copy BW {bw / 1e12:.3f} TB/s")
    os.makedirs(args.out, exist_ok=True)
    ok = all([check(MAIN), check("gemma-2-9b" if not args.smoke else MAIN)])
    log(f"checks {'all ok' if ok else 'FAILED'} at {time.time() - t0:.0f}s")
    if not ok:
        sys.exit(1)
    meta = dict(device=dev, date=datetime.date.today().isoformat(), bw=bw, rank=args.rank,
                command="PYTHONPATH=src python benchmarks/onepass.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__, triton=triton.__version__)
    if args.sweep:
        d_model, d_inter, act = SHAPES[MAIN]
        p = Problem(d_model, d_inter, act, 1, args.rank)
        for s in p.sets:
            s["pbt"] = s["pb"].t().contiguous()
        best, srows = sweep(p, p.thresholds(0.9))
        del p
        for mode, cfg in best.items():
            _onepass.CONFIGS[mode] = {**_onepass.CONFIGS[mode], **cfg}
            if mode == "abs":
                _onepass.CONFIGS["abs_act"] = {**_onepass.CONFIGS["abs_act"], **cfg}
        meta.update(sweep=srows, best=best)
        with open(os.path.join(args.out, "best.json"), "w") as f:  # COUNTDOWN_ONEPASS_CONFIGS for a decode run
            json.dump({"abs": best["abs"], "abs_act": best["abs"], "gt": best["gt"]}, f)
        log(f"sweep done at {time.time() - t0:.0f}s: {best}")
        if not check(MAIN):
            sys.exit("the chosen configurations fail the check")
    meta["configs"] = _onepass.CONFIGS
    if args.stages:
        rows = stages(args.ks, args.rank, bw)
        with open(os.path.join(args.out, "stages.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        return
    rows = bench(MAIN, args.ks, args.rank, bw)
    with open(os.path.join(args.out, "onepass.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# One-token Gated-MLP: one launch vs the two-kernel chain ({MAIN}, bf16, batch 1)", "",
             f"- device: {dev}; date: {meta['date']}; copy bandwidth {bw / 1e12:.2f} TB/s",
             f"- command: `{meta['command']}`", f"- configs: `{json.dumps(_onepass.CONFIGS)}`", "",
             "| method | k | variant | us | roofline us | x roof | kept |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['sparsity']:.2f} | {r['variant']} | {r['us']:.1f} | "
                     f"{r['roofline_us']:.1f} | {r['us'] / r['roofline_us']:.2f} | {r['kept']:.3f} |")
    with open(os.path.join(args.out, "onepass.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
