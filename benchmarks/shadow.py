"""Shadow-indicator benchmark: the 4-bit shadow GEMV and the whole shadow / hybrid dual MLP on the GPU.

    PYTHONPATH=src python benchmarks/shadow.py --out DIR --compile --batches 1,2,4,8   # default DIR: results/shadow
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/shadow.py --tiny --batches 1 --out /tmp/s   # CPU smoke test

results/shadow/shadow.md (H200, 2026-11-23) came from the first command at commit 12e5c91 with
``--out /root/out/final``, which also timed the one-token routes then switchable (COUNTDOWN_SHADOW_ROUTE):
its ``dual[shadow4]`` batch-1 rows are the selecting kernel's route ("fused") and ``dual[shadow4-onepass]``
the default; here ``dual[shadow4]`` is the library's default at every batch (one token: route "one_token").

Llama-3.1-8B's MLP shape (4096 x 14336, SiLU), bf16, CUDA graphs over 4 rotating weight sets and 8
inputs (harness.mlpbench's ``Problem`` and ``safe_time``: over 1 GB per set of calls, far past
L2). Roofline = bytes a method must read / the copy bandwidth measured in the same run; every row prints
its ratio to the roofline and its speed-up over dense.

(c) first, correctness at the real shape: the shadow scores against the float32 reference (one token:
within the int8 GEMV's bound for x's rounding, kernels/shadow/gemv.py), the shadow and hybrid MLPs against
float64 (flash-attention rule, the keep mask of the reference); a failing method is not timed.
(a) the shadow GEMV of gate and up stacked (``shadow_scores``, 4 bits, group 64) against torch's
``aten._weight_int4pack_mm`` (group 128, gpt-fast's kernel) and gemlite's A16W4 (group 64, if
installed), and cuBLAS's bf16 GEMV of the same stacked matrix.
(b) per batch and k = 0.7 / 0.8 / 0.9 (the cut: the pooled k-quantile of the inputs' scores, in a gap):
dense cuBLAS, ``dual[shadow4]`` (shadow_dual_gated_mlp as the library routes it: one token, the shadow
GEMV, the score and sparse_mlp/one_token.py's kernel; 2-8 tokens, the selecting kernel), ``dual[shadow4-route]``
(shadow_scores, keep in PyTorch, masked_gated_mlp), ``dual[hybrid]`` (hybrid_gated_mlp: u and the latent
by cuBLAS before, one launch), ``dual[hybrid-route]`` (u and the keep mask in PyTorch, then
masked_gated_mlp: the route of the current HybridDualSelector).
(d) with --compile, x + mlp(x) under torch.compile at batch 1 (what a decode step runs).
--sweep first times candidate launch configurations of the hybrid selecting kernel at batch 1, k = 0.9
(the one batch-1 table of kernels/sparse_mlp/select.py the default routes use), and uses the fastest whose output
matches.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch

import countdown.kernels as K
from countdown.kernels import common as _common
from countdown.kernels.config import LAUNCH, launch_config
from countdown.kernels.shadow import format as quant
from countdown.kernels.shadow.format import shadow_bytes

from harness.launches import recorded
from harness.mlpbench import DTYPE, NSETS, Problem, dense_chain, gap_threshold, log, safe_time
from harness.timing import copy_bandwidth

D_MODEL, D_INTER, ACT = 4096, 14336, "silu"
BITS, GROUP, RANK = 4, 64, 128
KS = (0.7, 0.8, 0.9)
E = 2
_K = ("ROWS", "TILE_W", "BLOCK_M", "num_warps", "PER_SM")
SWEEP = {  # candidates per (kind, token bucket) of the select kernel's launch table, each over the default entry
    ("hybrid", 1): [dict(zip(_K, r)) for r in [
        (32, 64, 2, 4, 2), (16, 64, 2, 4, 4), (64, 64, 2, 8, 2), (32, 64, 4, 8, 2), (16, 64, 1, 4, 4),
        (64, 64, 4, 8, 1)]],
}


def add_shadows(p: Problem):
    for w in p.sets:
        qg, sg = K.quantize_rtn(w["wg"], BITS, GROUP)
        qu, su = K.quantize_rtn(w["wu"], BITS, GROUP)
        w["raw"] = (qg, sg, qu, su)
        w["prep"] = K.prepare_shadow(qg, sg, qu, su, BITS)
        w["bias"] = 0.1 * torch.randn(p.d_inter, device=p.sets[0]["wg"].device)
    p.shadow_score, p.hyb_score = [], []
    for i, x in enumerate(p.xs):
        w = p.w(i)
        ut, gt = K.shadow_scores_ref(x, *w["raw"])
        p.shadow_score.append(quant.shadow_score(ut, gt, ACT))
        g_hat = ((x @ w["pa"]) @ w["pbt"].t()).float() + w["bias"]
        p.hyb_score.append(p.u[i].float().abs() * _common.act_torch(g_hat, ACT).abs())


def cuts(p: Problem, k: float) -> dict:
    pool = lambda ts: torch.cat([t.flatten() for t in ts])
    dev = p.xs[0].device
    return {"shadow": torch.tensor(gap_threshold(pool(p.shadow_score), k), device=dev),
            "hybrid": torch.tensor(gap_threshold(pool(p.hyb_score), k), device=dev)}


def calls_for(p: Problem, method: str, cut: dict):
    """One closure per input slot (weights rotate with the slot)."""
    def make(i):
        x, w = p.xs[i], p.w(i)
        if method == "dense":
            return lambda: dense_chain(x, w["wg"], w["wu"], w["wd"], ACT)
        if method == "dual[shadow4]":  # the library's route
            return lambda: K.shadow_dual_gated_mlp(x, w["prep"], cut["shadow"], w["wg"], w["wu"], w["wdt"], ACT)
        if method == "dual[shadow4-route]":
            def f():
                ut, gt = K.shadow_scores(x, w["prep"])
                keep = quant.shadow_score(ut, gt, ACT) > cut["shadow"]
                return K.masked_gated_mlp(x, w["wg"], w["wu"], w["wdt"], keep, ACT)
            return f
        if method == "dual[hybrid]":
            def f():
                u = x @ w["wu"].t()
                return K.hybrid_gated_mlp(x, u, x @ w["pa"], w["pbt"], w["bias"], cut["hybrid"], w["wg"],
                                          w["wdt"], ACT)
            return f
        if method == "dual[hybrid-route]":
            def f():
                u = x @ w["wu"].t()
                keep = K.hybrid_keep(u, x @ w["pa"], w["pbt"], w["bias"], cut["hybrid"], ACT)
                return K.masked_gated_mlp(x, w["wg"], w["wu"], w["wdt"], keep, ACT)
            return f
        raise KeyError(method)
    return [make(i) for i in range(len(p.xs))]


def kept_union(p: Problem, method: str, cut: dict) -> float:
    scores = p.shadow_score if "shadow" in method else p.hyb_score
    c = cut["shadow" if "shadow" in method else "hybrid"]
    return sum((s > c).any(0).float().mean().item() for s in scores) / len(scores)


def roofline_bytes(method: str, kept: float, batch: int) -> float:
    rows = kept * D_INTER
    if method == "dense":
        return 3 * D_INTER * D_MODEL * E
    if method.startswith("dual[shadow4"):
        return shadow_bytes(D_INTER, D_MODEL, BITS, GROUP) + 3 * rows * D_MODEL * E
    # hybrid: W_up in full, A and B^T, then 2 (kernel) or 3 (route: W_up rows again) kept rows
    base = D_INTER * D_MODEL * E + (D_MODEL + D_INTER) * RANK * E
    return base + (2 if method == "dual[hybrid]" else 3) * rows * D_MODEL * E


# ---------------------------------------------------------------------------------------- checks
def int8_x_bound(x, q, scale) -> torch.Tensor:
    """[T, d_inter]: what rounding x to int8 per weight group may move a shadow GEMV's output (the one-token
    GEMV's, kernels/shadow/gemv.py): sum_g (max_{j in g} |x_j| / 254) sum_{j in g} |w~_j|."""
    w = quant.dequantize(q, scale).abs()
    half_step = x.float().abs().reshape(x.shape[0], -1, GROUP).amax(-1) / 254
    return half_step @ w.reshape(w.shape[0], -1, GROUP).sum(-1).t()


def check(p: Problem, k: float) -> dict:
    """Max errors against float32 / float64 references; ok only if every method passes."""
    c = cuts(p, k)
    res, ok = {}, True
    for i in range(min(len(p.xs), NSETS)):
        x, w = p.xs[i], p.w(i)
        ut, gt = K.shadow_scores(x, w["prep"])
        ur, gr = K.shadow_scores_ref(x, *w["raw"])
        rel = max(((ut - ur).abs().max() / ur.abs().max()).item(), ((gt - gr).abs().max() / gr.abs().max()).item())
        res["scores_rel_err"] = max(res.get("scores_rel_err", 0.0), rel)
        if p.batch == 1:  # x rounded to int8 (its bound), plus fp32 sums
            qg, sg, qu, su = w["raw"]
            ok &= bool(((ut - ur).abs() <= int8_x_bound(x, qu, su) + 1e-5 * ur.abs().max()).all()
                       and ((gt - gr).abs() <= int8_x_bound(x, qg, sg) + 1e-5 * gr.abs().max()).all())
        else:  # float32 products (sparse_mlp/select.py)
            ok &= rel < 1e-5
        keep_s = p.shadow_score[i] > c["shadow"]
        keep_h = p.hyb_score[i] > c["hybrid"]
        f64 = [t.double() for t in (x, w["wg"], w["wu"], w["wdt"])]
        for name, out, ref_t, keep in (
            ("dual[shadow4]", K.shadow_dual_gated_mlp(x, w["prep"], c["shadow"], w["wg"], w["wu"], w["wdt"], ACT),
             K.shadow_dual_gated_mlp_ref(x, *w["raw"], c["shadow"], w["wg"], w["wu"], w["wdt"], ACT), keep_s),
            ("dual[hybrid]", K.hybrid_gated_mlp(x, p.u[i], x @ w["pa"], w["pbt"], w["bias"], c["hybrid"], w["wg"],
                                                w["wdt"], ACT),
             K.hybrid_gated_mlp_ref(x, p.u[i], x @ w["pa"], w["pbt"], w["bias"], c["hybrid"], w["wg"], w["wdt"], ACT),
             keep_h)):
            if name.startswith("dual[shadow4"):
                ref64 = K.gated_mlp_masked_ref(*f64, keep, ACT)
            else:  # u as given (bf16), the rest in float64
                s = p.u[i].double() * _common.act_torch(f64[0] @ f64[1].t(), ACT)
                ref64 = torch.where(keep, s, 0.0) @ f64[3]
            err = (out.double() - ref64).abs()
            bound = 2 * (ref_t.double() - ref64).abs() + 1e-2 * ref64.abs().max()
            worst = (err - bound).max().item()
            res[f"{name}_maxerr"] = max(res.get(f"{name}_maxerr", 0.0), err.max().item())
            if not (worst <= 0 and torch.isfinite(out).all()):
                ok = False
                log(f"CHECK FAILED {name} batch {p.batch} slot {i}: err {err.max().item():.3e}, over by {worst:.3e}")
    res["ok"] = bool(ok)
    return res


# ---------------------------------------------------------------------------------------- GEMV
def gemv_rows(bw: float) -> list[dict]:
    torch.manual_seed(1)
    n = 2 * D_INTER
    rows = []
    sets = []
    for _ in range(NSETS):
        w = (torch.randn(n, D_MODEL, device="cuda") * D_MODEL**-0.5).to(DTYPE)
        qg, sg = K.quantize_rtn(w[:D_INTER], BITS, GROUP)
        qu, su = K.quantize_rtn(w[D_INTER:], BITS, GROUP)
        sets.append(dict(w=w, prep=K.prepare_shadow(qg, sg, qu, su, BITS)))
    xs = [torch.randn(1, D_MODEL, device="cuda").to(DTYPE) for _ in range(8)]

    def row(name, nbytes, calls):
        t = safe_time(name, calls)
        rows.append(dict(kind="gemv", method=name, batch=1, k=0.0, us=t, mb=nbytes / 1e6,
                         roofline_us=nbytes / bw * 1e6, bw_share=nbytes / bw * 1e6 / t))
        log(f"gemv {name:28s} {t:7.1f} us  {nbytes / 1e6:6.1f} MB  {nbytes / bw * 1e6 / t:5.0%} of copy bw")

    row("cublas bf16 (gate+up)", n * D_MODEL * E,
        [(lambda x=x, w=sets[i % NSETS]["w"]: x @ w.t()) for i, x in enumerate(xs)])
    row("shadow4 (ours, g64)", shadow_bytes(D_INTER, D_MODEL, BITS, GROUP),
        [(lambda x=x, pr=sets[i % NSETS]["prep"]: K.shadow_scores(x, pr)) for i, x in enumerate(xs)])
    try:  # torch's tinygemm int4 kernel (gpt-fast), group 128
        packs = []
        for s in sets:
            wq = torch.randint(0, 16, (n, D_MODEL // 2), dtype=torch.uint8, device="cuda")
            packed = torch.ops.aten._convert_weight_to_int4pack(wq, 8)
            sz = torch.randn(D_MODEL // 128, n, 2, device="cuda").to(DTYPE)
            packs.append((packed, sz))
        row("torch int4pack_mm (g128)", n * D_MODEL // 2 + n * (D_MODEL // 128) * 4,
            [(lambda x=x, pk=packs[i % NSETS]: torch.ops.aten._weight_int4pack_mm(x, pk[0], 128, pk[1]))
             for i, x in enumerate(xs)])
    except Exception as e:  # noqa: BLE001
        log(f"torch int4pack_mm unavailable: {type(e).__name__}: {e}")
    try:
        from gemlite.helper import A16W4_HQQ_INT

        lins = []
        for _ in range(NSETS):
            wq = torch.randint(0, 16, (n, D_MODEL), dtype=torch.uint8, device="cuda")
            sc = torch.rand(n, D_MODEL // GROUP, device="cuda").to(DTYPE)
            z = torch.full_like(sc, 8.0)
            lins.append(A16W4_HQQ_INT(device="cuda:0", dtype=DTYPE).from_weights(wq, sc, z))
        row("gemlite A16W4 (g64)", n * D_MODEL // 2 + n * (D_MODEL // GROUP) * 4,
            [(lambda x=x, lin=lins[i % NSETS]: lin(x)) for i, x in enumerate(xs)])
    except Exception as e:  # noqa: BLE001
        log(f"gemlite unavailable: {type(e).__name__}: {str(e)[:200]}")
    del sets
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------- sweep
def sweep(p: Problem, bw: float) -> tuple[dict, dict]:
    """Per kernel configuration key, time each candidate (k = 0.9) and keep the fastest whose output
    matches the default's; each with the registers and spills of the select kernel it compiled. Returns the
    results by key and the winners as launch overrides (``{("select", key): knobs}``)."""
    with recorded("select") as launches:
        return _sweep(p, launches)


def _sweep(p: Problem, launches) -> tuple[dict, dict]:
    c = cuts(p, 0.9)
    out, winners = {}, {}
    for key, cands in SWEEP.items():
        method = "dual[shadow4]" if key[0] == "shadow" else "dual[hybrid]"
        calls = calls_for(p, method, c)
        run = lambda i: calls[i]()
        ref = [run(i) for i in range(len(p.xs))]
        base = launch_config("select", bucket=key)
        results = []
        for cfg in [base] + [{**base, **cand} for cand in cands]:
            try:
                with K.overrides(launch={("select", key): cfg}):
                    same = all(((run(i).float() - r.float()).abs().max() <= 2e-2 * r.float().abs().max()).item()
                               for i, r in enumerate(ref))
                    t = safe_time(str(cfg), calls) if same else float("nan")
                kern = launches.last["select"]
                regs, spills = getattr(kern, "n_regs", -1), getattr(kern, "n_spills", -1)
            except Exception as e:  # noqa: BLE001
                log(f"config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                t, regs, spills, same = float("nan"), -1, -1, False
            results.append(dict(cfg=cfg, us=t, regs=regs, spills=spills, same=same))
            log(f"sweep {key} {method} {cfg} -> {t:.1f} us (regs {regs}, spills {spills}, same {same})")
        good = [r for r in results if r["us"] == r["us"]]
        best = min(good, key=lambda r: r["us"])["cfg"] if good else base
        winners[("select", key)] = dict(best)
        log(f"sweep best {key}: {best}")
        out[str(key)] = dict(results=results, best=best)
    return out, winners


# ---------------------------------------------------------------------------------------- main
def bench(batches, bw, checks) -> list[dict]:
    rows = []
    for batch in batches:
        p = Problem(D_MODEL, D_INTER, ACT, batch, RANK)
        add_shadows(p)
        checks[f"batch{batch}"] = check(p, 0.9)
        log(f"check batch {batch}: {checks[f'batch{batch}']}")
        t_dense = safe_time("dense", calls_for(p, "dense", {}))
        rows.append(dict(kind="mlp", method="dense", batch=batch, k=0.0, us=t_dense, kept=1.0,
                         mb=roofline_bytes("dense", 1.0, batch) / 1e6,
                         roofline_us=roofline_bytes("dense", 1.0, batch) / bw * 1e6))
        for k in KS:
            c = cuts(p, k)
            for method in ("dual[shadow4]", "dual[shadow4-route]", "dual[hybrid]", "dual[hybrid-route]"):
                kept = kept_union(p, method, c)
                nbytes = roofline_bytes(method, kept, batch)
                t = safe_time(f"{method} b{batch} k{k}", calls_for(p, method, c)) \
                    if checks[f"batch{batch}"]["ok"] else float("nan")
                rows.append(dict(kind="mlp", method=method, batch=batch, k=k, us=t, kept=kept, mb=nbytes / 1e6,
                                 roofline_us=nbytes / bw * 1e6, vs_dense=t_dense / t,
                                 vs_roofline=t / (nbytes / bw * 1e6)))
                log(f"b{batch} k{k} {method:20s} {t:7.1f} us  kept {kept:.3f}  roofline {nbytes / bw * 1e6:6.1f} us"
                    f"  {t_dense / t:4.2f}x dense")
        del p
        torch.cuda.empty_cache()
    return rows


def compiled_rows(bw, k=0.9) -> list[dict]:
    """x + mlp(x) under torch.compile(fullgraph=True), batch 1: what a decode step runs (the kernel's
    partial sums fuse into the residual add)."""
    p = Problem(D_MODEL, D_INTER, ACT, 1, RANK)
    add_shadows(p)
    c = cuts(p, k)
    dense = torch.compile(lambda x, wg, wu, wd: x + dense_chain(x, wg, wu, wd, ACT), fullgraph=True)
    shad = torch.compile(lambda x, q, sc, cut, wg, wu, wdt: x + K.shadow_dual_gated_mlp(
        x, {"q": q, "scale": sc}, cut, wg, wu, wdt, ACT), fullgraph=True)
    hyb = torch.compile(lambda x, wu, a, bt, bias, cut, wg, wdt: x + K.hybrid_gated_mlp(
        x, x @ wu.t(), x @ a, bt, bias, cut, wg, wdt, ACT), fullgraph=True)
    rows = []
    for name, make in (
            ("dense cmp", lambda x, w: lambda: dense(x, w["wg"], w["wu"], w["wd"])),
            ("dual[shadow4] cmp", lambda x, w: lambda: shad(x, w["prep"]["q"], w["prep"]["scale"], c["shadow"],
                                                            w["wg"], w["wu"], w["wdt"])),
            ("dual[hybrid] cmp", lambda x, w: lambda: hyb(x, w["wu"], w["pa"], w["pbt"], w["bias"], c["hybrid"],
                                                          w["wg"], w["wdt"]))):
        calls = [make(x, p.w(i)) for i, x in enumerate(p.xs)]
        method = name.split()[0]
        kept = 1.0 if method == "dense" else kept_union(p, method, c)
        nbytes = roofline_bytes(method, kept, 1)
        t = safe_time(name, calls)
        rows.append(dict(kind="mlp+res compiled", method=name, batch=1, k=0.0 if method == "dense" else k, us=t,
                         kept=kept, mb=nbytes / 1e6, roofline_us=nbytes / bw * 1e6, vs_roofline=t / (nbytes / bw * 1e6)))
        log(f"compiled {name:22s} {t:7.1f} us  roofline {nbytes / bw * 1e6:6.1f} us")
    d = [r["us"] for r in rows if r["method"] == "dense cmp"][0]
    for r in rows:
        r["vs_dense"] = d / r["us"]
    del p
    torch.cuda.empty_cache()
    return rows


def write(rows, out, meta, sweep_res):
    os.makedirs(out, exist_ok=True)
    keys = ["kind", "method", "batch", "k", "us", "kept", "mb", "roofline_us", "vs_dense", "vs_roofline", "bw_share"]
    with open(os.path.join(out, "shadow.csv"), "w") as f:
        f.write(",".join(keys) + "\n")
        for r in rows:
            f.write(",".join("" if r.get(k) is None else (f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]))
                             for k in keys) + "\n")
    with open(os.path.join(out, "shadow.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweep_res), f, indent=1, default=str)
    lines = [f"# Shadow indicator kernels ({meta['device']}, {meta['date']})", "", f"`{meta['command']}`", "",
             f"Copy bandwidth {meta['copy_bw_tbs']:.2f} TB/s. Checks: {meta['checks']}", "",
             "| kind | method | batch | k | us | kept (union) | MB | roofline us | x roofline | x dense |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        xr = r.get("vs_roofline") or (1 / r["bw_share"] if r.get("bw_share") else r["us"] / r["roofline_us"])
        lines.append(f"| {r['kind']} | {r['method']} | {r['batch']} | {r['k']} | {r['us']:.1f} | "
                     f"{r.get('kept', float('nan')):.3f} | {r['mb']:.1f} | {r['roofline_us']:.1f} | {xr:.2f} | "
                     f"{r.get('vs_dense', float('nan')):.2f} |")
    with open(os.path.join(out, "shadow.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(rows, os.path.join(out, "shadow.png"))
    print("\n".join(lines))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    mlp = [r for r in rows if r["kind"] == "mlp" and r["batch"] == 1]
    dense = [r["us"] for r in mlp if r["method"] == "dense"]
    for method in ("dual[shadow4]", "dual[hybrid]", "dual[hybrid-route]"):
        rs = [r for r in mlp if r["method"] == method]
        ax.plot([r["k"] for r in rs], [r["us"] for r in rs], "o-", label=method)
        if method == "dual[shadow4]":
            ax.plot([r["k"] for r in rs], [r["roofline_us"] for r in rs], "k:", label="shadow4 roofline")
    if dense:
        ax.axhline(dense[0], color="gray", ls="--", label="dense cuBLAS")
    ax.set_xlabel("k (fraction of rows skipped)")
    ax.set_ylabel("us per MLP (batch 1, bf16)")
    ax.set_title("Llama-3.1-8B MLP shape")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replot(json_path: str) -> None:
    """Redraw shadow.png beside a shadow.json written by an earlier run."""
    with open(json_path) as f:
        plot(json.load(f)["rows"], os.path.join(os.path.dirname(json_path), "shadow.png"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/shadow")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--no-gemv", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also x + mlp(x) under torch.compile, batch 1")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test of this script (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global D_MODEL, D_INTER, RANK
    if args.tiny:
        D_MODEL, D_INTER, RANK = 128, 96, 16
        bw, device = 1e12, "cpu (smoke test)"
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/shadow.py needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    else:
        bw, device = copy_bandwidth(), torch.cuda.get_device_name()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s on {device}")
    meta = dict(device=device, date=datetime.date.today().isoformat(),
                command="PYTHONPATH=src python " + " ".join(sys.argv), copy_bw_tbs=bw / 1e12,
                torch=torch.__version__, configs={str(k): launch_config("select", bucket=k) for k in LAUNCH["select"]})
    sweep_res = None
    run_with = contextlib.ExitStack()
    if args.sweep:
        p = Problem(D_MODEL, D_INTER, ACT, 1, RANK)
        add_shadows(p)
        sweep_res, winners = sweep(p, bw)
        run_with.enter_context(K.overrides(launch=winners))  # the winners for the rest of the run
        meta["configs"] = {str(k): launch_config("select", bucket=k) for k in LAUNCH["select"]}
        del p
        torch.cuda.empty_cache()
    rows = [] if args.no_gemv or args.tiny else gemv_rows(bw)
    checks = {}
    rows += bench([int(b) for b in args.batches.split(",")], bw, checks)
    if args.compile and not args.tiny:
        rows += compiled_rows(bw)
    meta["checks"] = checks
    write(rows, args.out, meta, sweep_res)


if __name__ == "__main__":
    main()
