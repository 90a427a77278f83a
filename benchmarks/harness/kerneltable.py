"""The kernel table: one sparse Gated-MLP per call against dense cuBLAS and its roofline (``benchmarks/mlp_kernels.py``).

Per model shape (:data:`harness.mlpbench.SHAPES`), batch and target sparsity k, in bf16,
:func:`bench_shape` times:

    dense      cuBLAS F.linear chain (W_down in nn.Linear layout)
    optimal    the same dense chain with d_inter cut to the kept rows (a lower bound for gathers)
    naive      PyTorch index_select of the kept rows of all three matrices, then the dense chain
    cats       countdown.kernels.cats_gated_mlp
    mono       countdown.kernels.mono_gated_mlp
    dual       countdown.kernels.dual_gated_mlp     (predictor (x A) B included)
    dual_excl  countdown.kernels.masked_gated_mlp   (the same keep mask given: predictor excluded)

and on the main shape (``variants``) the per-token rows (batch > 1). Each op takes its indicator computed before
it, by cuBLAS (the ``[cublas]`` rows of earlier tables; their ``mono[cublas,splitk]`` rows timed a down reduction
since removed: docs/experiments.md).
Thresholds are the empirical k-quantiles of the indicators on the random inputs, so the kept fraction
matches k; the real kept fraction (per token, and the batch's union) is written next to each row. The
roofline time is the bytes a method must read (weights; vectors are < 0.1 %) over the copy bandwidth
measured in the same run. :func:`sweep` first picks the launch configurations (``--sweep``);
:func:`write_outputs` writes kernels.csv / .md / .png.
"""

from __future__ import annotations

import csv
import io
import os
import statistics

import torch
import torch.nn.functional as F

import countdown.kernels as K
from countdown.eval.cost import mlp_weight_bytes
from countdown.kernels import common as _common
from countdown.kernels.sparse_mlp import chain

from .kernelchecks import CHECK_OK
from .launches import recorded
from .mlpbench import (DOWN_SWEEP, E, GLU_SWEEP, MAIN, NSETS, NSLOTS, SHAPES, Problem, dense_chain, log, patched,
                       safe_time)
from .timing import time_graph


def sweep(rank, name=MAIN):
    """Time the candidate configurations of the two sparse kernels; return the winners.

    The GLU kernel is timed alone; the down kernel inside the masked chain (GLU + down: the GLU part
    is the same for every down candidate, and the chain is what clears the down's workspace). A
    candidate whose output differs from the default configuration's is dropped. Each row's ``info``: the
    registers, spills and shared memory of the kernel last compiled (:mod:`harness.launches`)."""
    with recorded("chain_gate_up", "chain_down") as launches:
        return _sweep(rank, name, launches)


def _sweep(rank, name, launches):
    d_model, d_inter, act = SHAPES[name]
    best = {}
    rows = []
    for batch in (1, 8):
        p = Problem(d_model, d_inter, act, batch, rank)
        ks = (0.7, 0.9)
        th = {k: p.thresholds(k) for k in ks}
        keep = {k: [sc.float() > th[k]["dual"] for sc in p.score] for k in ks}
        keep[1.0] = [torch.zeros_like(kp) for kp in keep[0.9]]  # nothing kept: the fixed cost
        parts = {  # the cuBLAS pieces of the chains, alone
            "cublas_up": lambda i: p.xs[i] @ p.w(i)["wu"].t(),
            "cublas_predictor": lambda i: K.dual_scores(p.xs[i], p.w(i)["pa"], p.w(i)["pb"]),
            "cublas_latent": lambda i: p.xs[i] @ p.w(i)["pa"],
        }
        for kind, fn in parts.items():
            us = safe_time(kind, [lambda i=i: fn(i) for i in range(NSLOTS)])
            rows.append(dict(kernel=kind, kind=kind, batch=batch, k=0.0, config=-1, us=us))
            log(f"sweep {kind} b{batch}: {us:.1f} us")
        glu_args = lambda i, kind, k: (p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.u[i] if kind == "mono" else p.score[i],
                                       None, th[k][kind], "abs" if kind == "mono" else "gt", act, True, kind == "dual")
        ref_s = {kind: chain.gate_up(*glu_args(0, kind, 0.9)).float() for kind in ("mono", "dual")}
        ref_y = K.masked_gated_mlp(p.xs[0], p.w(0)["wg"], p.w(0)["wu"], p.w(0)["wdt"], keep[0.9][0], act).float()
        res = []
        for ci, cfg in enumerate(GLU_SWEEP[batch]):
            tot, per = 0.0, []
            try:
                for kind in ("mono", "dual"):
                    s_c = chain.gate_up(*glu_args(0, kind, 0.9), config=cfg).float()
                    if not torch.allclose(s_c, ref_s[kind], rtol=2e-2, atol=2e-2 * ref_s[kind].abs().max().item()):
                        raise RuntimeError(f"output differs from the default config's ({kind})")
            except Exception as e:  # noqa: BLE001
                log(f"sweep glu  b{batch} {ci} {cfg}: DROPPED: {type(e).__name__}: {str(e).splitlines()[-1][:200]}")
                continue
            for k in ks:
                for kind in ("mono", "dual"):
                    us = safe_time(f"glu {ci}", [lambda i=i: chain.gate_up(*glu_args(i, kind, k), config=cfg)
                                                 for i in range(NSLOTS)])
                    tot += us
                    per.append(f"{kind}@{k}:{us:.1f}")
                    rows.append(dict(kernel="glu", kind=kind, batch=batch, k=k, config=ci, us=us,
                                     info=launches.info("chain_gate_up")))
            if tot == tot:  # not NaN
                res.append((tot, ci))
            log(f"sweep glu  b{batch} {ci} {cfg}: {' '.join(per)} sum {tot:.1f} [{launches.info('chain_gate_up')}]")
        if res:
            best[("glu", batch)] = GLU_SWEEP[batch][min(res)[1]]
        res = []
        with patched("chain_gate_up", **best.get(("glu", batch), {})):
            for ci, cfg in enumerate(DOWN_SWEEP[batch]):
                tot, per = 0.0, []
                with patched("chain_down", **cfg):
                    try:
                        y_c = K.masked_gated_mlp(p.xs[0], p.w(0)["wg"], p.w(0)["wu"], p.w(0)["wdt"], keep[0.9][0],
                                                 act).float()
                        if not torch.allclose(y_c, ref_y, rtol=2e-2, atol=2e-2 * ref_y.abs().max().item()):
                            raise RuntimeError("output differs from the default config's")
                    except Exception as e:  # noqa: BLE001
                        log(f"sweep down b{batch} {ci} {cfg}: DROPPED: {type(e).__name__}: "
                            f"{str(e).splitlines()[-1][:200]}")
                        continue
                    for k in (*ks, 1.0):
                        us = safe_time(f"down {ci}", [lambda i=i: K.masked_gated_mlp(
                            p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"], keep[k][i], act) for i in range(NSLOTS)])
                        tot += us if k < 1 else 0.0
                        per.append(f"{k}:{us:.1f}")
                        rows.append(dict(kernel="masked_chain", kind="down", batch=batch, k=k, config=ci, us=us,
                                         info=launches.info("chain_down")))
                if tot == tot:
                    res.append((tot, ci))
                log(f"sweep down b{batch} {ci} {cfg}: chain {' '.join(per)} sum {tot:.1f} [{launches.info('chain_down')}]")
        if res:
            best[("down", batch)] = DOWN_SWEEP[batch][min(res)[1]]
        p = None  # frees the weights (the closures above are done with them)
        torch.cuda.empty_cache()
    return best, rows


def bench_shape(name, batches, ks, rank, bw, device_name, variants):
    d_model, d_inter, act = SHAPES[name]
    out = []
    for batch in batches:
        p = Problem(d_model, d_inter, act, batch, rank)
        dense_us = time_graph([lambda i=i: dense_chain(p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wd"], act)
                               for i in range(NSLOTS)])
        full = 3 * d_model * d_inter * E

        def row(method, k, us, nbytes, kept=float("nan"), union=float("nan"), note=""):
            r = dict(device=device_name, shape=name, method=method, sparsity=k, batch=batch, us=round(us, 2),
                     roofline_us=round(nbytes / bw * 1e6, 2), dense_us=round(dense_us, 2),
                     speedup=round(dense_us / us, 3), bytes=int(nbytes), kept_frac=round(kept, 4),
                     union_frac=round(union, 4), note=note)
            out.append(r)
            return r

        row("dense", 0.0, dense_us, full, 1.0, 1.0)
        for k in ks:
            masks, t = p.masks(k)
            frac = {m: statistics.mean(v.float().mean().item() for v in masks[m]) for m in masks}
            uni = {m: statistics.mean(v.any(0).float().mean().item() for v in masks[m]) for m in masks}
            n_u = {m: uni[m] * d_inter for m in masks}
            n_opt = K_kept = max(1, int(d_inter * (1 - k) + 1e-9))
            wd_views = [p.w(i)["wd"][:, :n_opt] for i in range(NSETS)]
            us = time_graph([lambda i=i: dense_chain(p.xs[i], p.w(i)["wg"][:n_opt], p.w(i)["wu"][:n_opt],
                                                     wd_views[i % NSETS], act) for i in range(NSLOTS)])
            row("optimal", k, us, 3 * d_model * n_opt * E, K_kept / d_inter, K_kept / d_inter)
            keep = masks["dual"]
            idx = [kp.any(0).nonzero().squeeze(1) for kp in keep]
            kp_sel = [kp[:, ix] for kp, ix in zip(keep, idx)]

            def naive(i):
                w, ix = p.w(i), idx[i]
                g = F.linear(p.xs[i], w["wg"].index_select(0, ix))
                u = F.linear(p.xs[i], w["wu"].index_select(0, ix))
                s = (_common.act_torch(g, act) * u) * kp_sel[i]
                return s @ w["wdt"].index_select(0, ix)

            us = time_graph([lambda i=i: naive(i) for i in range(NSLOTS)])
            row("naive", k, us, 9 * d_model * n_u["dual"] * E, frac["dual"], uni["dual"])
            sparse = {
                "cats": lambda i, pt=False: K.cats_gated_mlp(p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"],
                                                              t["cats"], act, per_token=pt),
                "mono": lambda i, pt=False: K.mono_gated_mlp(p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"],
                                                              t["mono"], act, per_token=pt),
                "dual": lambda i, pt=False: K.dual_gated_mlp(p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"],
                                                              p.w(i)["pa"], p.w(i)["pbt"].t(), t["dual"], act,
                                                              per_token=pt),
                "dual_excl": lambda i, pt=False: K.masked_gated_mlp(p.xs[i], p.w(i)["wg"], p.w(i)["wu"],
                                                                     p.w(i)["wdt"], keep[i], act, per_token=pt),
            }
            roof = lambda kind, m: mlp_weight_bytes(kind, d_model, d_inter, uni[m], elem_bytes=E, d_rank=rank)
            nbytes = {"cats": roof("cats", "cats"), "mono": roof("mono", "mono"), "dual": roof("lowrank", "dual"),
                      "dual_excl": 3 * d_model * n_u["dual"] * E}  # the mask given: the kept rows of all three
            mask_of = dict(cats="cats", mono="mono", dual="dual", dual_excl="dual")
            for m, fn in sparse.items():
                ok = CHECK_OK.get(f"{m}[cublas]", True)
                us = safe_time(f"{name} b{batch} k{k} {m}", [lambda i=i: fn(i) for i in range(NSLOTS)]) \
                    if ok else float("nan")
                r = row(m, k, us, nbytes[m], frac[mask_of[m]], uni[mask_of[m]],
                        note=(f"rank {rank}" if m == "dual" else "") + ("" if ok else " FAILED CHECK: not timed"))
                log(f"{name:13s} b{batch} k={k:.2f} {m:10s} {us:8.1f} us  roofline {r['roofline_us']:7.1f}  "
                    f"x{r['us'] / r['roofline_us']:.2f} of roofline  {dense_us / us:5.2f}x dense  "
                    f"kept {frac[mask_of[m]]:.3f} union {uni[mask_of[m]]:.3f}")
            if variants and name in (MAIN, "tiny"):
                if batch > 1:  # per-token rows instead of the batch's union
                    for m in ("mono", "dual"):
                        us = safe_time(f"{m}[per_token]", [lambda i=i: sparse[m](i, True) for i in range(NSLOTS)])
                        per_tok = frac[mask_of[m]] * batch * d_model * d_inter
                        nb = nbytes[m] - (3 if m == "dual" else 2) * d_model * n_u[mask_of[m]] * E \
                            + (3 if m == "dual" else 2) * per_tok * E
                        row(m + "[per_token]", k, us, nb, frac[mask_of[m]], uni[mask_of[m]])
            wd_views = None
        log(f"{name:13s} b{batch} dense {dense_us:.1f} us")
        p = None  # frees the weights (the closures above are done with them)
        torch.cuda.empty_cache()
    return out



def write_outputs(rows, outdir, meta):
    os.makedirs(outdir, exist_ok=True)
    cols = ["device", "shape", "method", "sparsity", "batch", "us", "roofline_us", "dense_us", "speedup",
            "bytes", "kept_frac", "union_frac", "note"]
    from countdown.io import atomic_write

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow({c: r.get(c, "") for c in cols})
    atomic_write(os.path.join(outdir, "kernels.csv"), buf.getvalue(), what="kernel table")
    lines = ["# Kernel benchmark: one Gated-MLP, bf16", "",
             f"- device: {meta['device']}", f"- date: {meta['date']}", f"- command: `{meta['command']}`",
             f"- copy bandwidth (read + write): {meta['bw'] / 1e12:.2f} TB/s; roofline = bytes / that",
             f"- torch {meta['torch']}, triton {meta['triton']}; dual rank {meta['rank']}",
             f"- configs: {meta.get('configs', '')}", "",
             "us = median per call of CUDA-graph replays (8 calls, 4 weight sets); x roof = us / roofline_us; "
             "speedup = dense_us / us; kept = real kept fraction per token (union over the batch).", ""]
    for batch in sorted({r["batch"] for r in rows}):
        lines += [f"## batch {batch}", "", "| shape | method | k | us | roofline us | x roof | speedup | kept (union) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["batch"] != batch:
                continue
            lines.append(f"| {r['shape']} | {r['method']} | {r['sparsity']:.2f} | {r['us']:.1f} | "
                         f"{r['roofline_us']:.1f} | {r['us'] / r['roofline_us']:.2f} | {r['speedup']:.2f} | "
                         f"{r['kept_frac']:.3f} ({r['union_frac']:.3f}) |")
        lines.append("")
    atomic_write(os.path.join(outdir, "kernels.md"), "\n".join(lines), what="kernel table")
    plot(rows, os.path.join(outdir, "kernels.png"))


def plot(rows, path, batch=1):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = [s for s in SHAPES if any(r["shape"] == s and r["batch"] == batch for r in rows)]
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rs = [r for r in rows if r["shape"] == shape and r["batch"] == batch]
        dense = [r for r in rs if r["method"] == "dense"]
        if dense:
            ax.axhline(dense[0]["us"], color="k", lw=1, label="dense (cuBLAS)")
        for m in ("optimal", "naive", "cats", "mono", "dual", "dual_excl"):
            pts = sorted((float(r["sparsity"]), float(r["us"])) for r in rs if r["method"] == m)
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=m)
        ax.set_title(f"{shape} (batch {batch})")
        ax.set_xlabel("sparsity k")
        ax.set_ylabel("us per Gated-MLP")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    from countdown.io import atomic_path

    with atomic_path(path, suffix=".png", what="kernel plot") as tmp:
        fig.savefig(tmp, dpi=120)

