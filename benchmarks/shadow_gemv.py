"""The one-token shadow GEMV (kernels/_gemv.py, fp16x2) and the shadow MLP it feeds, before and after.

    PYTHONPATH=src python benchmarks/shadow_gemv.py --out DIR [--budget SECONDS] [--tiny]

Llama-3.1-8B's MLP shape (4096 x 14336, SiLU), bf16, batch 1, CUDA graphs over 4 rotating weight sets
and 8 inputs (benchmarks/kernels.py's Problem; over 1 GB per round, far past L2); roofline = bytes
read / the device-to-device copy bandwidth measured in the same run. Stages, in order (a stage is
skipped once --budget seconds have passed; results are written after every stage):

1. check: at the real shape, the asm and portable paths of _gemv.py against float64 within the
   kernel's error bound; the default one-token MLP route against float64 on the rows its indicator
   keeps (flash-attention rule), and how many rows differ from float64's own keep mask.
2. sweep: launch configurations of _gemv.py (the indicator |u~ act(g~)|), the fastest one kept.
3. gemv: gate and up stacked: cuBLAS bf16; ours after (fp16x2: the indicator, and (u~, g~)); ours
   before (_select.py's fp32 SCORES kernel); torch's aten._weight_int4pack_mm (group 128, tinygemm);
   gemlite 0.6 A16W4 (group 64, if importable).
4. mlp: k = 0.7 / 0.8 / 0.9: dense cuBLAS; dual[shadow4] (the default route: fp16x2 indicator, then
   _onepass.py's sparse kernel); dual[shadow4] before (fp32 GEMV, score in PyTorch, same sparse
   kernel); the sparse phase alone (indicator given: issue 14's gap).
5. compiled: x + mlp(x) under torch.compile(fullgraph=True) for dense, after and before, each k.
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
from countdown.kernels import _common, _gemv, _onepass, shadow as kshadow
from countdown.kernels.quant import shadow_bytes

import shadow as sb  # noqa: E402  (benchmarks/shadow.py: shadows, cuts, kept rows)
from kernels import NSETS, Problem, dense_chain, log, safe_time  # noqa: E402

ACT, BITS, GROUP, KS, E = "silu", 4, 64, (0.7, 0.8, 0.9), 2
_C = ("R", "num_warps", "PER_SM", "PIN", "AHEAD", "ASM")
SWEEP = [dict(zip(_C, c), PREFETCH=True) for c in [  # PIN: next block's loads pinned before the arithmetic;
    (4, 4, 3, False, 1, True), (4, 4, 3, True, 1, True), (4, 4, 2, True, 1, True),  # AHEAD: blocks
    (2, 4, 4, True, 1, True), (2, 4, 5, True, 1, True), (2, 4, 6, True, 1, True),   # prefetched ahead
    (4, 4, 2, False, 2, True), (2, 4, 4, False, 2, True), (2, 4, 3, True, 2, True), (4, 8, 2, True, 1, True),
    (4, 4, 3, False, 1, False)]]
_S = ("CHUNK", "BLOCK_M", "num_warps", "PER_SM")
SPARSE_SWEEP = [dict(zip(_S, c), IND="torch", PREFETCH=False) for c in [  # _onepass.py, mode "gt"
    (64, 4, 4, 4), (32, 4, 4, 4), (16, 2, 4, 4), (32, 2, 4, 3), (64, 8, 8, 2), (128, 8, 8, 2), (16, 4, 4, 6)]]
T0 = time.time()


@contextlib.contextmanager
def gemv(name: str):
    """The one-token shadow GEMV the library routes to: "fp16x2" (after) or "fp32" (before)."""
    old = kshadow.ONE_TOKEN_GEMV
    kshadow.ONE_TOKEN_GEMV = name
    try:
        yield
    finally:
        kshadow.ONE_TOKEN_GEMV = old


def bound(x64, deq64):
    """_gemv.py's error bound for x . deq rows (fp16 products and lane sums, fp32 sums)."""
    return (5 * 2.0**-11 + 5000 * 2.0**-24) * (x64.abs() @ deq64.abs().t()) * 1.01 + 1e-30


def check(p: Problem) -> dict:
    res, ok = dict(gemv_err_over_bound=0.0, mlp_maxerr=0.0, keep_flips=0, kept_rows=0), True
    c = sb.cuts(p, 0.9)
    for i in range(NSETS):
        x, w = p.xs[i], p.w(i)
        qg, sg, qu, su = w["raw"]
        x64 = x.double()
        dg, du = K.dequantize(qg, sg, torch.float64), K.dequantize(qu, su, torch.float64)
        u64, g64 = x64 @ du.t(), x64 @ dg.t()
        eu, eg = bound(x64, du), bound(x64, dg)
        for asm in (True, False):
            _common.POISON_OUTPUTS = True
            o = _gemv.launch(x, w["prep"]["q"], w["prep"]["scale"], None, dict(ASM=asm))
            ind = _gemv.launch(x, w["prep"]["q"], w["prep"]["scale"], ACT, dict(ASM=asm))
            _common.POISON_OUTPUTS = False
            r = max(((o[0].double() - u64).abs() / eu).max().item(), ((o[1].double() - g64).abs() / eg).max().item())
            res[f"gemv_err_over_bound_asm{int(asm)}"] = max(res.get(f"gemv_err_over_bound_asm{int(asm)}", 0.0), r)
            sref = (o[0].double() * _common.act_torch(o[1].double(), ACT)).abs()
            sr = ((ind.double() - sref).abs() / (1e-5 * sref + 1e-30)).max().item()
            ok &= r <= 1.0 and sr <= 1.0 and bool(torch.isfinite(o).all() and torch.isfinite(ind).all())
            res["gemv_err_over_bound"] = max(res["gemv_err_over_bound"], r)
        keep = ind > c["shadow"]
        res["keep_flips"] += int((keep != (p.shadow_score[i] > c["shadow"])).sum())
        res["kept_rows"] += int(keep.sum())
        with gemv("fp16x2"), sb.route("onepass"):
            out = K.shadow_dual_gated_mlp(x, w["prep"], c["shadow"], w["wg"], w["wu"], w["wdt"], ACT)
        f64 = [t.double() for t in (x, w["wg"], w["wu"], w["wdt"])]
        ref64 = K.gated_mlp_masked_ref(*f64, keep, ACT)
        ref_t = K.gated_mlp_masked_ref(x, w["wg"], w["wu"], w["wdt"], keep, ACT)
        err = (out.double() - ref64).abs()
        ok &= bool(((err - 2 * (ref_t.double() - ref64).abs() - 1e-2 * ref64.abs().max()).max() <= 0).item())
        res["mlp_maxerr"] = max(res["mlp_maxerr"], err.max().item())
    res["ok"] = bool(ok)
    return res


def row(rows, kind, method, us, nbytes, bw, k=0.0, kept=None, dense_us=None):
    r = dict(kind=kind, method=method, batch=1, k=k, us=us, kept=kept, mb=nbytes / 1e6,
             roofline_us=nbytes / bw * 1e6, vs_roofline=us / (nbytes / bw * 1e6), bw_share=nbytes / bw * 1e6 / us)
    if dense_us:
        r["vs_dense"] = dense_us / us
    rows.append(r)
    log(f"{kind:9s} {method:34s} k={k:.1f} {us:7.1f} us  {nbytes / 1e6:6.1f} MB  {r['bw_share']:5.0%} of copy bw")
    return r


def sweep(p: Problem, bw, rows) -> list[dict]:
    nbytes = shadow_bytes(p.d_inter, p.d_model, BITS, GROUP)
    out = []
    for cfg in SWEEP:
        calls = [(lambda x=x, pr=p.w(i)["prep"], cfg=cfg: _gemv.launch(x, pr["q"], pr["scale"], ACT, cfg))
                 for i, x in enumerate(p.xs)]
        t = safe_time(str(cfg), calls)
        kern = _gemv.LAST_KERNEL
        out.append(dict(cfg=cfg, us=t, regs=getattr(kern, "n_regs", -1), spills=getattr(kern, "n_spills", -1)))
        log(f"sweep {cfg} -> {t:.1f} us ({nbytes / bw * 1e6 / t:.0%}), regs {out[-1]['regs']}, spills {out[-1]['spills']}")
    good = [r for r in out if r["us"] == r["us"] and r["cfg"]["ASM"]]
    if good:
        _gemv.CONFIG.update(min(good, key=lambda r: r["us"])["cfg"])
    log(f"sweep best: {_gemv.CONFIG}")
    x, pr = p.xs[0], p.w(0)["prep"]
    _gemv.launch(x, pr["q"], pr["scale"], ACT)
    try:  # the chosen kernel's SASS, for the notes (instructions per word, where the loads sit)
        with open(os.path.join(ARGS.out, "gemv_best.sass"), "w") as f:
            f.write(_gemv.LAST_KERNEL.asm["sass"])
    except Exception as e:  # noqa: BLE001
        log(f"no SASS: {type(e).__name__}: {str(e)[:200]}")
    return out


def gemv_rows(p: Problem, bw, rows):
    n, dm = 2 * p.d_inter, p.d_model
    sh = shadow_bytes(p.d_inter, dm, BITS, GROUP)
    xs = p.xs
    stacked = [torch.cat([s["wg"], s["wu"]]) for s in p.sets]
    row(rows, "gemv", "cublas bf16 (gate+up)", safe_time("cublas", [
        (lambda x=x, w=stacked[i % NSETS]: x @ w.t()) for i, x in enumerate(xs)]), n * dm * E, bw)
    del stacked
    prep = lambda i: p.w(i)["prep"]
    row(rows, "gemv", "shadow4 fp16x2 indicator (after)", safe_time("after", [
        (lambda x=x, pr=prep(i): torch.ops.countdown.shadow_gemv(x, pr["q"], pr["scale"], ACT, True))
        for i, x in enumerate(xs)]), sh, bw)
    row(rows, "gemv", "shadow4 fp16x2 u~,g~ (after)", safe_time("after2", [
        (lambda x=x, pr=prep(i): torch.ops.countdown.shadow_gemv(x, pr["q"], pr["scale"], ACT, False))
        for i, x in enumerate(xs)]), sh, bw)
    row(rows, "gemv", "shadow4 fp32 u~,g~ (before)", safe_time("before", [
        (lambda x=x, pr=prep(i): torch.ops.countdown.shadow_scores(x, pr["q"], pr["scale"]))
        for i, x in enumerate(xs)]), sh, bw)
    try:  # torch's tinygemm int4 kernel (gpt-fast), group 128
        packs = []
        for _ in range(NSETS):
            wq = torch.randint(0, 16, (n, dm // 2), dtype=torch.uint8, device="cuda")
            packs.append((torch.ops.aten._convert_weight_to_int4pack(wq, 8),
                          torch.randn(dm // 128, n, 2, device="cuda").to(torch.bfloat16)))
        row(rows, "gemv", "torch int4pack_mm (g128)", safe_time("int4", [
            (lambda x=x, pk=packs[i % NSETS]: torch.ops.aten._weight_int4pack_mm(x, pk[0], 128, pk[1]))
            for i, x in enumerate(xs)]), n * dm // 2 + n * (dm // 128) * 4, bw)
        del packs
    except Exception as e:  # noqa: BLE001
        log(f"torch int4pack_mm unavailable: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.empty_cache()


def gemlite_rows(p: Problem, bw, rows):
    n, dm, xs = 2 * p.d_inter, p.d_model, p.xs
    try:
        from gemlite.helper import A16W4_HQQ_INT

        lins = []
        for _ in range(NSETS):
            wq = torch.randint(0, 16, (n, dm), dtype=torch.uint8, device="cuda")
            sc = torch.rand(n, dm // GROUP, device="cuda").to(torch.bfloat16)
            lins.append(A16W4_HQQ_INT(device="cuda:0", dtype=torch.bfloat16).from_weights(wq, sc, torch.full_like(sc, 8.0)))
        row(rows, "gemv", "gemlite A16W4 (g64)", safe_time("gemlite", [
            (lambda x=x, lin=lins[i % NSETS]: lin(x)) for i, x in enumerate(xs)]), n * dm // 2 + n * (dm // GROUP) * 4, bw)
        del lins
    except Exception as e:  # noqa: BLE001
        log(f"gemlite unavailable: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.empty_cache()


def mlp_rows(p: Problem, bw, rows) -> float:
    d_us = safe_time("dense", [(lambda x=x, w=p.w(i): dense_chain(x, w["wg"], w["wu"], w["wd"], ACT))
                               for i, x in enumerate(p.xs)])
    row(rows, "mlp", "dense", d_us, 3 * p.d_inter * p.d_model * E, bw, kept=1.0, dense_us=d_us)
    sh = shadow_bytes(p.d_inter, p.d_model, BITS, GROUP)
    for k in KS:
        c = sb.cuts(p, k)
        kept = sb.kept_union(p, "dual[shadow4]", c)
        kept_b = 3 * kept * p.d_inter * p.d_model * E
        for name, g in (("dual[shadow4] (after)", "fp16x2"), ("dual[shadow4] (before)", "fp32")):
            def make(i, g=g):
                x, w = p.xs[i], p.w(i)

                def f():
                    with gemv(g), sb.route("onepass"):
                        return K.shadow_dual_gated_mlp(x, w["prep"], c["shadow"], w["wg"], w["wu"], w["wdt"], ACT)
                return f
            row(rows, "mlp", name, safe_time(name, [make(i) for i in range(len(p.xs))]), sh + kept_b, bw, k, kept, d_us)
        inds = [_gemv.launch(x, p.w(i)["prep"]["q"], p.w(i)["prep"]["scale"], ACT) for i, x in enumerate(p.xs)]
        row(rows, "mlp", "sparse phase alone (indicator given)", safe_time("sparse", [
            (lambda x=x, w=p.w(i), ind=inds[i]: _onepass.onepass_mlp(
                x, w["wg"], w["wu"], w["wdt"], c["shadow"], 0.0, "gt", ACT, gate=True, up=True, ind=ind))
            for i, x in enumerate(p.xs)]), kept_b, bw, k, kept, d_us)
    return d_us


def sparse_sweep(p: Problem, bw, rows) -> list[dict]:
    """The sparse phase alone (indicator given) under other _onepass.py configurations (measured only:
    mode "gt" is shared with the low-rank dual)."""
    out = []
    for k in (0.9, 0.7):
        c = sb.cuts(p, k)
        kept = sb.kept_union(p, "dual[shadow4]", c)
        inds = [_gemv.launch(x, p.w(i)["prep"]["q"], p.w(i)["prep"]["scale"], ACT) for i, x in enumerate(p.xs)]
        for cfg in SPARSE_SWEEP:
            t = safe_time(str(cfg), [(lambda x=x, w=p.w(i), ind=inds[i], cfg=cfg: _onepass.onepass_partials(
                x, None, None, w["wg"], w["wu"], w["wdt"], c["shadow"], 0.0, "gt", ACT, True, True, config=cfg,
                ind=ind).sum(0, keepdim=True).to(x.dtype)) for i, x in enumerate(p.xs)])
            nbytes = 3 * kept * p.d_inter * p.d_model * E
            out.append(dict(k=k, cfg=cfg, us=t, bw_share=nbytes / bw * 1e6 / t))
            log(f"sparse k={k} {cfg} -> {t:.1f} us ({out[-1]['bw_share']:.0%})")
    return out


def compiled_rows(p: Problem, bw, rows, which: str):
    """which: "after" (dense too) or "before"."""
    d_us = [r["us"] for r in rows if r["method"] == "dense cmp"]
    if which == "after":
        dense = torch.compile(lambda x, wg, wu, wd: x + dense_chain(x, wg, wu, wd, ACT), fullgraph=True)
        d_us = [safe_time("dense cmp", [(lambda x=x, w=p.w(i): dense(x, w["wg"], w["wu"], w["wd"]))
                                        for i, x in enumerate(p.xs)])]
        row(rows, "mlp+res compiled", "dense cmp", d_us[0], 3 * p.d_inter * p.d_model * E, bw, kept=1.0,
            dense_us=d_us[0])
    d_us = d_us[0] if d_us else None
    sh = shadow_bytes(p.d_inter, p.d_model, BITS, GROUP)
    for name, g in ((f"dual[shadow4] cmp ({which})", "fp16x2" if which == "after" else "fp32"),):
        fn = torch.compile(lambda x, q, sc, cut, wg, wu, wdt: x + K.shadow_dual_gated_mlp(
            x, {"q": q, "scale": sc}, cut, wg, wu, wdt, ACT), fullgraph=True)
        for k in KS:
            c = sb.cuts(p, k)
            kept = sb.kept_union(p, "dual[shadow4]", c)

            def make(i, g=g, c=c):
                x, w = p.xs[i], p.w(i)

                def f():
                    with gemv(g), sb.route("onepass"):
                        return fn(x, w["prep"]["q"], w["prep"]["scale"], c["shadow"], w["wg"], w["wu"], w["wdt"])
                return f
            row(rows, "mlp+res compiled", name, safe_time(name, [make(i) for i in range(len(p.xs))]),
                sh + 3 * kept * p.d_inter * p.d_model * E, bw, k, kept, d_us)


def write(rows, out, meta, stem="shadow_gemv", title="One-token shadow GEMV and shadow MLP",
          config_label="GEMV config"):
    """The rows as ``stem``.csv / .json / .md (each written whole, then renamed over the old one) and a plot."""
    os.makedirs(out, exist_ok=True)

    def publish(name, text):
        tmp = os.path.join(out, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))
    keys = ["kind", "method", "batch", "k", "us", "kept", "mb", "roofline_us", "vs_dense", "vs_roofline", "bw_share"]
    cell = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    publish(f"{stem}.csv", "".join(",".join(cell(r.get(k)) for k in keys) + "\n" for r in [dict(zip(keys, keys))] + rows))
    publish(f"{stem}.json", json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    fmt = lambda v, s="{:.2f}": "" if v is None else s.format(v)
    lines = [f"# {title} ({meta['device']}, {meta['date']})", "", f"`{meta['command']}`", "",
             f"Copy bandwidth {meta['copy_bw_tbs']:.2f} TB/s. {config_label} {meta.get('config')}. Checks: {meta.get('checks')}", "",
             "| kind | method | k | us | kept | MB | roofline us | x roofline | share of copy bw | x dense |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['method']} | {r['k']} | {r['us']:.1f} | {fmt(r.get('kept'), '{:.3f}')} | "
                     f"{r['mb']:.1f} | {r['roofline_us']:.1f} | {r['vs_roofline']:.2f} | {r['bw_share']:.0%} | "
                     f"{fmt(r.get('vs_dense'))} |")
    publish(f"{stem}.md", "\n".join(lines) + "\n")
    try:
        plot(rows, os.path.join(out, f"{stem}.png"))
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {e}")
    return lines


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    g = [r for r in rows if r["kind"] == "gemv"]
    a1.barh([r["method"] for r in g], [100 * r["bw_share"] for r in g], color="tab:blue")
    for i, r in enumerate(g):
        a1.text(100 * r["bw_share"] + 1, i, f"{r['us']:.1f} us", va="center", fontsize=8)
    a1.set_xlabel("% of copy bandwidth (gate + up, batch 1)")
    a1.set_xlim(0, 115)
    a1.invert_yaxis()
    for kind, ls in (("mlp", "-"), ("mlp+res compiled", "--")):
        for r in [r for r in rows if r["kind"] == kind and r["method"].startswith("dense")]:
            a2.axhline(r["us"], color="gray", ls=ls, label=r["method"])
        for m in sorted({r["method"] for r in rows if r["kind"] == kind and "shadow4" in r["method"]}):
            rs = [r for r in rows if r["kind"] == kind and r["method"] == m]
            a2.plot([r["k"] for r in rs], [r["us"] for r in rs], "o" + ls, label=m)
    rs = [r for r in rows if r["kind"] == "mlp" and r["method"] == "dual[shadow4] (after)"]
    a2.plot([r["k"] for r in rs], [r["roofline_us"] for r in rs], "k:", label="shadow4 roofline")
    a2.set_xlabel("k (fraction of rows skipped)")
    a2.set_ylabel("us per MLP (Llama-3.1-8B shape, bf16, batch 1)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; later stages are skipped past it")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1), small shapes")
    ARGS = ap.parse_args()
    args_tiny = ARGS.tiny
    bw, meta = setup("shadow_gemv.py", args_tiny)
    p = Problem(sb.D_MODEL, sb.D_INTER, ACT, 1, sb.RANK if not args_tiny else 16)
    sb.add_shadows(p)
    meta["checks"] = check(p)
    log(f"check: {meta['checks']}")
    rows: list[dict] = []
    lines = write(rows, ARGS.out, meta)
    stages = [("sweep", lambda: meta.__setitem__("sweep", sweep(p, bw, rows)), 60),
              ("gemv", lambda: gemv_rows(p, bw, rows), 40), ("mlp", lambda: mlp_rows(p, bw, rows), 30),
              ("sparse-sweep", lambda: meta.__setitem__("sparse_sweep", sparse_sweep(p, bw, rows)), 50),
              ("compiled", lambda: compiled_rows(p, bw, rows, "after"), 50),
              ("gemlite", lambda: gemlite_rows(p, bw, rows), 30),
              ("compiled-before", lambda: compiled_rows(p, bw, rows, "before"), 30)]
    skip = lambda name: (name.endswith("sweep") and (ARGS.no_sweep or args_tiny)) or (
        name.startswith("compiled") and args_tiny)

    def after():
        meta["config"] = dict(_gemv.CONFIG)
        return write(rows, ARGS.out, meta)
    lines = run_stages(stages, meta, ARGS.budget, T0, skip, after) or lines
    print("\n".join(lines[-len(rows) - 2:]))


def setup(script: str, tiny: bool) -> tuple[float, dict]:
    """(copy bandwidth, run metadata); --tiny: small shapes under the interpreter (a CPU smoke test)."""
    if tiny:
        sb.D_MODEL, sb.D_INTER = 128, 96
        bw, device = 1e12, "cpu (smoke test)"
        _onepass.ONEPASS_OFF_CUDA = True
    elif not torch.cuda.is_available():
        sys.exit(f"benchmarks/{script} needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    else:
        bw, device = copy_bandwidth(), torch.cuda.get_device_name()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s on {device}")
    return bw, dict(device=device, date=datetime.date.today().isoformat(), copy_bw_tbs=bw / 1e12,
                    command="PYTHONPATH=src python " + " ".join(sys.argv), torch=torch.__version__)


def run_stages(stages, meta, budget, t0, skip, after, if_check_failed=("gemv",)):
    """Run (name, fn, seconds needed) stages in order: skipped where ``skip(name)``, once the check failed
    (but those named in ``if_check_failed``) or when fewer than the seconds needed are left of ``budget``
    since ``t0``; ``after()`` (the results written) follows each. Returns the last ``after()``."""
    out = None
    for name, fn, need in stages:
        if skip(name):
            continue
        if not meta["checks"]["ok"] and name not in if_check_failed:
            log(f"{name} skipped: the check failed")
            continue
        if time.time() - t0 > budget - need:
            log(f"{name} skipped (budget: {time.time() - t0:.0f} s used)")
            continue
        fn()
        meta["elapsed_s"] = round(time.time() - t0, 1)
        out = after()
    return out


if __name__ == "__main__":
    main()
