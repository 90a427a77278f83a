"""The one-token shadow GEMV with int8 x and dp4a (kernels/_gemv_i8.py) against the fp16x2 one (_gemv.py).

    PYTHONPATH=src python benchmarks/shadow_dp4a.py --out DIR [--budget SECONDS] [--tiny]

Llama-3.1-8B's MLP shape (4096 x 14336, SiLU), bf16, batch 1, 4-bit shadows in groups of 64, CUDA
graphs over 4 rotating weight sets and 8 inputs (benchmarks/kernels.py's Problem); roofline = bytes
read / the device-to-device copy bandwidth measured in the same run. Stages (each skipped once
--budget seconds have passed; results written after every stage):

1. check: at the real shape, both kernels against float64 within their bounds, _gemv_i8's dp4a path
   bit-identical to its portable path, and the rows each indicator keeps at k = 0.9 against the
   float64 shadow score's (flips).
2. sweep: launch configurations of _gemv_i8.py (the indicator |u~ act(g~)|), the fastest kept.
3. gemv: gate and up stacked: cuBLAS bf16, fp16x2 and int8 (indicator; (u~, g~)).
4. mlp: dense cuBLAS and dual[shadow4] (the onepass route) with each GEMV, k = 0.7 / 0.8 / 0.9, eager,
   then x + mlp(x) under torch.compile(fullgraph=True).
"""

from __future__ import annotations

import argparse
import time

import torch

import countdown.kernels as K
from countdown.kernels import _common, _gemv, _gemv_i8
from countdown.kernels.quant import shadow_bytes

import shadow as sb  # noqa: E402  (benchmarks/shadow.py: shadows, cuts, kept rows)
import shadow_gemv as sg  # noqa: E402  (benchmarks/shadow_gemv.py: the fp16x2 bound, rows, the GEMV switch)
from kernels import NSETS, Problem, dense_chain, log, safe_time  # noqa: E402

ACT, BITS, GROUP, KS, E = "silu", 4, 64, (0.7, 0.8, 0.9), 2
_C = ("R", "num_warps", "PER_SM", "PREFETCH")
SWEEP = [dict(zip(_C, c), ASM=True, XPRE=True, STAGES=st) for *c, st in [  # PREFETCH False: tl.range's pipeliner
    (8, 4, 2, True, 1), (2, 4, 0, True, 1), (4, 4, 2, False, 3), (4, 4, 3, False, 3), (4, 4, 4, False, 2),
    (8, 4, 2, False, 3), (8, 4, 1, False, 4), (8, 8, 2, False, 3), (16, 8, 1, False, 3), (4, 4, 2, False, 4),
    (2, 4, 4, False, 4), (8, 8, 1, False, 4), (4, 8, 2, False, 3)]]
F16_SWEEP = [dict(zip(_C, c), ASM=True, AHEAD=1, PIN=False) for c in [(4, 4, 3, True)]]
GEMVS = (("fp16x2", _gemv), ("int8", _gemv_i8))
T0 = time.time()


def i8_bound(x, deq64):
    """_gemv_i8.py's bound: sum_g (xs_g / 2) sum_{j in g} |w~_j|, plus the float32 sums."""
    xf = x.float().reshape(-1, GROUP)
    xs = (xf.abs().amax(1) / 127.0).double()
    per_group = deq64.abs().reshape(deq64.shape[0], -1, GROUP).sum(-1)
    return 1.001 * (per_group * xs[None]).sum(-1)[None] / 2 + 1e-5 * (x.double().abs() @ deq64.abs().t()) + 1e-30


def check(p: Problem) -> dict:
    res, ok = dict(i8_err_over_bound=0.0, f16_err_over_bound=0.0, asm_equals_portable=True), True
    c = sb.cuts(p, 0.9)
    for name in ("fp16x2", "int8"):
        res[f"flips_{name}"] = 0
    res["kept_rows"] = 0
    for i in range(NSETS):
        x, w = p.xs[i], p.w(i)
        qg, sg_, qu, su = w["raw"]
        dg, du = K.dequantize(qg, sg_, torch.float64), K.dequantize(qu, su, torch.float64)
        u64, g64 = x.double() @ du.t(), x.double() @ dg.t()
        _common.POISON_OUTPUTS = True
        o = _gemv_i8.launch(x, w["prep"]["q"], w["prep"]["scale"], None, dict(ASM=True))
        o2 = _gemv_i8.launch(x, w["prep"]["q"], w["prep"]["scale"], None, dict(ASM=False))
        f = _gemv.launch(x, w["prep"]["q"], w["prep"]["scale"], None)
        _common.POISON_OUTPUTS = False
        res["asm_equals_portable"] &= bool(torch.equal(o, o2))
        r = max(((o[0].double() - u64).abs() / i8_bound(x, du)).max().item(),
                ((o[1].double() - g64).abs() / i8_bound(x, dg)).max().item())
        rf = max(((f[0].double() - u64).abs() / sg.bound(x.double(), du)).max().item(),
                 ((f[1].double() - g64).abs() / sg.bound(x.double(), dg)).max().item())
        res["i8_err_over_bound"] = max(res["i8_err_over_bound"], r)
        res["f16_err_over_bound"] = max(res["f16_err_over_bound"], rf)
        ok &= r <= 1.0 and rf <= 1.0 and bool(torch.isfinite(o).all())
        ref_keep = p.shadow_score[i] > c["shadow"]
        res["kept_rows"] += int(ref_keep.sum())
        for name, mod in GEMVS:
            ind = mod.launch(x, w["prep"]["q"], w["prep"]["scale"], ACT)
            res[f"flips_{name}"] += int(((ind > c["shadow"]) != ref_keep).sum())
    res["ok"] = bool(ok and res["asm_equals_portable"])
    return res


def sweep(p: Problem, bw) -> list[dict]:
    """Launch configurations of both kernels (the indicator); each kernel's fastest becomes its CONFIG."""
    nbytes = shadow_bytes(p.d_inter, p.d_model, BITS, GROUP)
    out = []
    for name, mod, cfgs in (("int8", _gemv_i8, SWEEP), ("fp16x2", _gemv, F16_SWEEP)):
        mine = []
        for cfg in cfgs:
            t = safe_time(str(cfg), [(lambda x=x, pr=p.w(i)["prep"], cfg=cfg, mod=mod: mod.launch(
                x, pr["q"], pr["scale"], ACT, cfg)) for i, x in enumerate(p.xs)])
            kern = mod.LAST_KERNEL
            mine.append(dict(gemv=name, cfg=cfg, us=t, regs=getattr(kern, "n_regs", -1),
                             spills=getattr(kern, "n_spills", -1)))
            log(f"sweep {name} {cfg} -> {t:.1f} us ({nbytes / bw * 1e6 / t:.0%}), regs {mine[-1]['regs']}, "
                f"spills {mine[-1]['spills']}")
        good = [r for r in mine if r["us"] == r["us"]]
        if good:
            mod.CONFIG.update(min(good, key=lambda r: r["us"])["cfg"])
        log(f"sweep best {name}: {mod.CONFIG}")
        out += mine
    return out


def gemv_rows(p: Problem, bw, rows):
    n, dm = 2 * p.d_inter, p.d_model
    sh = shadow_bytes(p.d_inter, dm, BITS, GROUP)
    stacked = [torch.cat([s["wg"], s["wu"]]) for s in p.sets]
    sg.row(rows, "gemv", "cublas bf16 (gate+up)", safe_time("cublas", [
        (lambda x=x, w=stacked[i % NSETS]: x @ w.t()) for i, x in enumerate(p.xs)]), n * dm * E, bw)
    del stacked
    for name, mod in GEMVS:
        for act, what in ((ACT, "indicator"), (None, "u~,g~")):
            sg.row(rows, "gemv", f"shadow4 {name} {what}", safe_time(name, [
                (lambda x=x, pr=p.w(i)["prep"], mod=mod, act=act: mod.launch(x, pr["q"], pr["scale"], act))
                for i, x in enumerate(p.xs)]), sh, bw)
    torch.cuda.empty_cache()


def mlp_rows(p: Problem, bw, rows, compiled: bool):
    kind = "mlp+res compiled" if compiled else "mlp"
    dense_fn = (torch.compile(lambda x, wg, wu, wd: x + dense_chain(x, wg, wu, wd, ACT), fullgraph=True)
                if compiled else (lambda x, wg, wu, wd: dense_chain(x, wg, wu, wd, ACT)))
    d_us = safe_time("dense", [(lambda x=x, w=p.w(i): dense_fn(x, w["wg"], w["wu"], w["wd"]))
                               for i, x in enumerate(p.xs)])
    sg.row(rows, kind, "dense", d_us, 3 * p.d_inter * p.d_model * E, bw, kept=1.0, dense_us=d_us)
    sh = shadow_bytes(p.d_inter, p.d_model, BITS, GROUP)
    mlp = lambda x, q, sc, cut, wg, wu, wdt: K.shadow_dual_gated_mlp(x, {"q": q, "scale": sc}, cut, wg, wu, wdt, ACT)
    fn = torch.compile(lambda x, *a: x + mlp(x, *a), fullgraph=True) if compiled else mlp
    for k in KS:
        c = sb.cuts(p, k)
        kept = sb.kept_union(p, "dual[shadow4]", c)
        for name, _ in GEMVS:
            def make(i, name=name, c=c):
                x, w = p.xs[i], p.w(i)

                def f():
                    with sg.gemv(name), sb.route("onepass"):
                        return fn(x, w["prep"]["q"], w["prep"]["scale"], c["shadow"], w["wg"], w["wu"], w["wdt"])
                return f
            sg.row(rows, kind, f"dual[shadow4] {name}", safe_time(name, [make(i) for i in range(len(p.xs))]),
                   sh + 3 * kept * p.d_inter * p.d_model * E, bw, k, kept, d_us)


def write(rows, out, meta):
    return sg.write(rows, out, meta, "shadow_dp4a", "One-token shadow GEMV: int8 x with dp4a against fp16x2", "int8 config")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; later stages are skipped past it")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1), small shapes")
    args = ap.parse_args()
    bw, meta = sg.setup("shadow_dp4a.py", args.tiny)
    p = Problem(sb.D_MODEL, sb.D_INTER, ACT, 1, sb.RANK if not args.tiny else 16)
    sb.add_shadows(p)
    meta["checks"] = check(p)
    log(f"check: {meta['checks']}")
    rows: list[dict] = []
    lines = write(rows, args.out, meta)
    stages = [("sweep", lambda: meta.__setitem__("sweep", sweep(p, bw)), 40), ("gemv", lambda: gemv_rows(p, bw, rows), 20),
              ("mlp", lambda: mlp_rows(p, bw, rows, False), 30), ("compiled", lambda: mlp_rows(p, bw, rows, True), 60)]
    skip = lambda name: (name == "sweep" and (args.no_sweep or args.tiny)) or (name == "compiled" and args.tiny)

    def after():
        meta["config"], meta["config_fp16x2"] = dict(_gemv_i8.CONFIG), dict(_gemv.CONFIG)
        return write(rows, args.out, meta)
    lines = sg.run_stages(stages, meta, args.budget, T0, skip, after, if_check_failed=()) or lines
    print("\n".join(lines[-len(rows) - 2:]))


if __name__ == "__main__":
    main()
