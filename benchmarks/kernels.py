"""Kernel benchmark: one Gated-MLP per call, CUDA-graph timing, rotating weights and inputs.

    PYTHONPATH=src python benchmarks/kernels.py --out benchmarks/results [--sweep] [--quick]

Per model shape (Llama-3.1-8B, Qwen2.5-14B, gemma-2-9b with GELU-tanh, phi-4), batch (1, 2, 4, 8)
and target sparsity k, in bf16, it times:

    dense      cuBLAS F.linear chain (W_down in nn.Linear layout)
    optimal    the same dense chain with d_inter cut to the kept rows (a lower bound for gathers)
    naive      PyTorch index_select of the kept rows of all three matrices, then the dense chain
    cats       countdown.kernels.cats_gated_mlp     (dense g by cuBLAS, fused sparse kernels)
    mono       countdown.kernels.mono_gated_mlp     (dense u by cuBLAS, fused sparse kernels)
    dual       countdown.kernels.dual_gated_mlp     (predictor (x A) B included, rank --rank)
    dual_excl  countdown.kernels.masked_gated_mlp   (the same keep mask given: predictor excluded)

Thresholds are the empirical k-quantiles of |u|, |act(g)| and the predictor scores on the random
inputs, so the kept fraction matches k; the real kept fraction (per token, and the batch's union)
is written next to each row. Each timing is the median over graph replays of 8 back-to-back calls
cycling through 4 weight sets and 8 inputs (more than 1 GB per shape, far past L2). The roofline
time is the bytes a method must read (weights; vectors are < 0.1%) over the device-to-device copy
bandwidth measured in the same run (bytes read + written).

Before timing it checks every kernel against a float64 reference at the real shapes (flash-attention
rule, see tests/test_kernels.py) and refuses to time a wrong one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import countdown.kernels as K
from countdown.kernels import _common, _down, _glu

from countdown.bench import copy_bandwidth, time_graph
from countdown.eval.cost import mlp_weight_bytes

SHAPES = {  # name: (d_model, d_inter, activation)
    "Llama-3.1-8B": (4096, 14336, "silu"),
    "Qwen2.5-14B": (5120, 13824, "silu"),
    "gemma-2-9b": (3584, 14336, "gelu_tanh"),
    "phi-4": (5120, 17920, "silu"),
    "tiny": (67, 131, "silu"),  # CPU smoke test of this script (TRITON_INTERPRET=1), never by default
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
MAIN = "Llama-3.1-8B"
NSETS, NSLOTS = 4, 8  # weight sets, inputs per graph (slot i uses weight set i % NSETS)
DTYPE = torch.bfloat16
E = 2  # bytes per bf16 element

# Candidate launch configurations compared by --sweep (small on purpose: each costs a compile).
# BLOCK_K = 0: whole rows in one step. Batch 1 uses the FMA path, batch > 1 the tensor-core path.
GLU_SWEEP = {
    1: [
        dict(CHUNK=16, BLOCK_M=4, BLOCK_K=0, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=16, BLOCK_M=4, BLOCK_K=0, USE_DOT=False, num_warps=8, num_stages=1),
        dict(CHUNK=32, BLOCK_M=8, BLOCK_K=0, USE_DOT=False, num_warps=8, num_stages=1),
        dict(CHUNK=8, BLOCK_M=2, BLOCK_K=0, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=32, BLOCK_M=4, BLOCK_K=0, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=16, BLOCK_M=4, BLOCK_K=1024, USE_DOT=False, num_warps=4, num_stages=1),
    ],
    8: [
        dict(CHUNK=16, BLOCK_M=16, BLOCK_K=512, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=32, BLOCK_M=16, BLOCK_K=512, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=16, BLOCK_M=16, BLOCK_K=1024, USE_DOT=True, num_warps=8, num_stages=2),
        dict(CHUNK=64, BLOCK_M=16, BLOCK_K=256, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=32, BLOCK_M=32, BLOCK_K=256, USE_DOT=True, num_warps=4, num_stages=4),
    ],
}
DOWN_SWEEP = {
    1: [
        dict(CHUNK=128, BLOCK_M=16, BLOCK_N=512, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=64, BLOCK_M=8, BLOCK_N=1024, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=64, BLOCK_M=8, BLOCK_N=512, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=32, BLOCK_M=4, BLOCK_N=1024, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=128, BLOCK_M=16, BLOCK_N=1024, USE_DOT=False, num_warps=8, num_stages=1),
        dict(CHUNK=256, BLOCK_M=32, BLOCK_N=512, USE_DOT=False, num_warps=8, num_stages=1),
    ],
    8: [
        dict(CHUNK=256, BLOCK_M=16, BLOCK_N=256, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=32, BLOCK_M=16, BLOCK_N=256, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=64, BLOCK_M=32, BLOCK_N=256, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=32, BLOCK_M=16, BLOCK_N=512, USE_DOT=True, num_warps=8, num_stages=3),
        dict(CHUNK=64, BLOCK_M=16, BLOCK_N=128, USE_DOT=True, num_warps=4, num_stages=3),
    ],
}


class patched:
    """Temporarily update the per-batch-bucket tables of a kernel module (configs, switches)."""

    def __init__(self, module, table, **kv):
        self.module, self.table, self.kv = module, table, kv

    def __enter__(self):
        self.old = getattr(self.module, self.table)
        new = {}
        for b, v in self.old.items():
            new[b] = {**v, **self.kv} if isinstance(v, dict) else self.kv["value"]
        setattr(self.module, self.table, new)

    def __exit__(self, *exc):
        setattr(self.module, self.table, self.old)


def down_reduce(mode):
    """Switch the down projection's reduction ("atomic", "splitk")."""
    return patched(_down, "DOWN_CONFIGS", reduce=mode)


def fused_dense(on=True):
    """mono / cats / dual compute u / g / the scores inside the fused kernel instead of cuBLAS first."""
    return patched(_glu, "FUSE_DENSE", value=on)


class combo:
    """FUSE_DENSE: the indicator (u, g, predictor scores) inside the fused kernel, or cuBLAS first."""

    def __init__(self, dense: bool):
        self.ctx = [patched(_glu, "FUSE_DENSE", value=dense)]
        self.tag = "fused" if dense else "cublas"

    def __enter__(self):
        for c in self.ctx:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)


COMBOS = [False, True]


def current_tag(batch, m) -> str:
    b = 1 if batch == 1 else 16
    return "fused" if _glu.FUSE_DENSE[b] and m != "dual_excl" else "cublas"
CHECK_OK: dict = {}  # op -> passed the real-shape check (a failed op is not timed)



def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------- timing
def safe_time(label, calls) -> float:
    """time_graph, or NaN (logged) when the variant fails to compile or run."""
    try:
        return time_graph(calls)
    except Exception as e:  # noqa: BLE001
        log(f"FAILED {label}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        return float("nan")


# ---------------------------------------------------------------------------------------- problem
class Problem:
    """NSETS weight sets and NSLOTS inputs of one shape and batch, with per-k thresholds."""

    def __init__(self, d_model, d_inter, act, batch, rank, seed=0):
        torch.manual_seed(seed)
        self.d_model, self.d_inter, self.act, self.batch, self.rank = d_model, d_inter, act, batch, rank
        dev = DEV
        self.sets = []
        for _ in range(NSETS):
            wg = (torch.randn(d_inter, d_model, device=dev) * d_model**-0.5).to(DTYPE)
            wu = (torch.randn(d_inter, d_model, device=dev) * d_model**-0.5).to(DTYPE)
            wdt = (torch.randn(d_inter, d_model, device=dev) * d_inter**-0.5).to(DTYPE)
            wd = wdt.t().contiguous()  # nn.Linear layout for the dense baseline
            pa = (torch.randn(d_model, rank, device=dev) * d_model**-0.5).to(DTYPE)
            pbt = (torch.randn(d_inter, rank, device=dev) * rank**-0.5).to(DTYPE)  # B^T, rows contiguous
            self.sets.append(dict(wg=wg, wu=wu, wdt=wdt, wd=wd, pa=pa, pb=pbt.t().contiguous(), pbt=pbt))
        self.xs = [torch.randn(batch, d_model, device=dev).to(DTYPE) for _ in range(NSLOTS)]
        self.u, self.h, self.score = [], [], []
        for i, x in enumerate(self.xs):
            w = self.sets[i % NSETS]
            self.u.append(x @ w["wu"].t())
            g = x @ w["wg"].t()
            self.h.append(_common.act_torch(g.float(), act))
            self.score.append(K.dual_scores(x, w["pa"], w["pb"]))

    def w(self, i):
        return self.sets[i % NSETS]

    def thresholds(self, k):
        q = lambda ts: torch.quantile(torch.cat([t.float().abs().flatten() for t in ts]), k).item()
        cut = torch.quantile(torch.cat([t.float().flatten() for t in self.score]), k).item()
        return dict(mono=q(self.u), cats=q(self.h), dual=cut)

    def masks(self, k):
        t = self.thresholds(k)
        return dict(
            mono=[u.float().abs() > t["mono"] for u in self.u],
            cats=[h.abs() > t["cats"] for h in self.h],
            dual=[s.float() > t["dual"] for s in self.score],
        ), t


def dense_chain(x, wg, wu, wd, act):
    return F.linear(_common.act_torch(F.linear(x, wg), act) * F.linear(x, wu), wd)


# ---------------------------------------------------------------------------------------- checks
def gap_threshold(values: torch.Tensor, k: float) -> float:
    """The midpoint between the two distinct values around the k-quantile."""
    v = torch.unique(values.double().flatten())
    i = min(max(int(k * v.numel()), 1), v.numel() - 1)
    return ((v[i - 1] + v[i]) / 2).item()


def check_real_shapes(names) -> bool:
    """Every op against float64 at real shapes; the flash-attention rule."""
    ok = True
    tol = 1e-2
    for name in names:
        d_model, d_inter, act = SHAPES[name]
        for batch in (1, 8):
            p = Problem(d_model, d_inter, act, batch, rank=256, seed=1)
            # thresholds between two distinct indicator values: Triton's fp32 activation may differ
            # from PyTorch's by an ulp, which must not flip a row tied with an exact quantile
            t = dict(mono=gap_threshold(p.u[0].float().abs(), 0.8), cats=gap_threshold(p.h[0].abs(), 0.8),
                     dual=gap_threshold(p.score[0].float(), 0.8))
            masks = dict(mono=[K.mono_keep(p.xs[0], p.w(0)["wu"], t["mono"])],
                         cats=[K.cats_keep(p.xs[0], p.w(0)["wg"], t["cats"], act)],
                         dual=[K.dual_keep(p.xs[0], p.w(0)["pa"], p.w(0)["pb"], t["dual"])])
            x, w = p.xs[0], p.w(0)
            f64 = [w[n].double() for n in ("wg", "wu", "wdt")]
            cases = {
                "mono": (lambda: K.mono_gated_mlp(x, w["wg"], w["wu"], w["wdt"], t["mono"], act),
                         lambda: K.mono_gated_mlp_ref(x, w["wg"], w["wu"], w["wdt"], t["mono"], act), masks["mono"][0]),
                "cats": (lambda: K.cats_gated_mlp(x, w["wg"], w["wu"], w["wdt"], t["cats"], act),
                         lambda: K.cats_gated_mlp_ref(x, w["wg"], w["wu"], w["wdt"], t["cats"], act), masks["cats"][0]),
                "dual": (lambda: K.dual_gated_mlp(x, w["wg"], w["wu"], w["wdt"], w["pa"], w["pb"], t["dual"], act),
                         lambda: K.dual_gated_mlp_ref(x, w["wg"], w["wu"], w["wdt"], w["pa"], w["pb"], t["dual"], act),
                         masks["dual"][0]),
                "masked_per_token": (
                    lambda: K.masked_gated_mlp(x, w["wg"], w["wu"], w["wdt"], masks["dual"][0], act, per_token=True),
                    lambda: K.masked_gated_mlp_ref(x, w["wg"], w["wu"], w["wdt"], masks["dual"][0], act),
                    masks["dual"][0]),
            }
            cases["dual_excl"] = (
                lambda: K.masked_gated_mlp(x, w["wg"], w["wu"], w["wdt"], masks["dual"][0], act),
                lambda: K.masked_gated_mlp_ref(x, w["wg"], w["wu"], w["wdt"], masks["dual"][0], act),
                masks["dual"][0])
            for op, (fn, ref, keep) in cases.items():
                for reduce in ("atomic", "splitk") if op == "mono" else ("atomic",):
                    tag = op if op == "masked_per_token" else f"{op}[cublas]"
                    tag += ",splitk" if reduce == "splitk" else ""
                    ok &= run_check(f"{name:13s} b{batch} {tag:28s}", fn, ref, keep, x, f64, act, tol,
                                    [combo(False), down_reduce(reduce)], key=tag)
            del p
        ok &= check_fused(name)
    return ok


def run_check(label, fn, ref, keep, x, f64, act, tol, contexts, key) -> bool:
    """One op vs float64 with poisoned outputs; records CHECK_OK[key] (and the op's default path)."""
    import contextlib

    _common.POISON_OUTPUTS = True
    try:
        with contextlib.ExitStack() as st:
            for c in contexts:
                st.enter_context(c)
            out = fn()
        torch.cuda.synchronize() if DEV == "cuda" else None
    except Exception as e:  # noqa: BLE001
        log(f"check {label} FAILED TO RUN: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
        CHECK_OK[key] = False
        return False
    finally:
        _common.POISON_OUTPUTS = False
    out_t = ref()
    ref64 = K.gated_mlp_masked_ref(x.double(), *f64, keep, act)
    err = (out.double() - ref64).abs()
    bound = 2 * (out_t.double() - ref64).abs() + tol * max(1.0, ref64.abs().max().item())
    good = bool((err <= bound).all()) and not torch.isnan(out).any()
    CHECK_OK[key] = CHECK_OK.get(key, True) and good
    log(f"check {label} max err {err.max().item():.2e} torch {(out_t.double() - ref64).abs().max().item():.2e} "
        f"{'ok' if good else 'WRONG'}")
    return good


def check_fused(name) -> bool:
    """mono / cats with u / g computed inside the kernel. Inputs on a coarse grid make every fp32
    sum exact, so the kernel's u equals cuBLAS's bit for bit and both keep the same rows."""
    d_model, d_inter, act = SHAPES[name]
    ok = True
    torch.manual_seed(2)
    grid = lambda shape, step, lim: ((torch.randint(-lim, lim + 1, shape, device=DEV) * step)).to(DTYPE)
    for batch in (1, 8):
        x = grid((batch, d_model), 1 / 8, 16)
        wg, wu = grid((d_inter, d_model), 1 / 64, 8), grid((d_inter, d_model), 1 / 64, 8)
        wdt = (torch.randn(d_inter, d_model, device=DEV) * d_inter**-0.5).to(DTYPE)
        f64 = [w.double() for w in (wg, wu, wdt)]
        pa = grid((d_model, 64), 1 / 64, 8)
        pbt = grid((d_inter, 64), 1 / 8, 8)
        for op in ("mono", "cats", "dual"):
            if op == "dual":
                cut = gap_threshold(K.dual_scores(x, pa, pbt.t()).float(), 0.8)
                keep = K.dual_keep(x, pa, pbt.t(), cut)
                fn = lambda *a: K.dual_gated_mlp(*a[:4], pa, pbt.t(), cut, a[5])
                ref = lambda *a: K.dual_gated_mlp_ref(*a[:4], pa, pbt.t(), cut, a[5])
                thr = cut
            elif op == "mono":
                thr = torch.quantile((x @ wu.t()).float().abs().flatten(), 0.8).item()
                keep, fn, ref = K.mono_keep(x, wu, thr), K.mono_gated_mlp, K.mono_gated_mlp_ref
            else:
                thr = gap_threshold(_common.act_torch((x @ wg.t()).float(), act).abs(), 0.8)
                keep, fn, ref = K.cats_keep(x, wg, thr, act), K.cats_gated_mlp, K.cats_gated_mlp_ref
            tag = f"{op}[fused]"
            ok &= run_check(f"{name:13s} b{batch} {tag:28s}", lambda: fn(x, wg, wu, wdt, thr, act),
                            lambda: ref(x, wg, wu, wdt, thr, act), keep, x, f64, act, 1e-2,
                            [combo(True)], key=tag)
    return ok


# ---------------------------------------------------------------------------------------- sweep
def kernel_info(mod) -> str:
    k = mod.LAST_KERNEL
    try:
        return f"regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}"
    except AttributeError:
        return ""


def sweep(rank, name=MAIN):
    """Time the candidate configurations of the two sparse kernels; return the winners.

    The GLU kernel is timed alone; the down kernel inside the masked chain (GLU + down: the GLU part
    is the same for every down candidate, and the chain is what clears the down's workspace). A
    candidate whose output differs from the default configuration's is dropped."""
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
        ref_s = {kind: _glu.sparse_glu(*glu_args(0, kind, 0.9)).float() for kind in ("mono", "dual")}
        ref_y = K.masked_gated_mlp(p.xs[0], p.w(0)["wg"], p.w(0)["wu"], p.w(0)["wdt"], keep[0.9][0], act).float()
        res = []
        for ci, cfg in enumerate(GLU_SWEEP[batch]):
            tot, per = 0.0, []
            try:
                for kind in ("mono", "dual"):
                    s_c = _glu.sparse_glu(*glu_args(0, kind, 0.9), config=cfg).float()
                    if not torch.allclose(s_c, ref_s[kind], rtol=2e-2, atol=2e-2 * ref_s[kind].abs().max().item()):
                        raise RuntimeError(f"output differs from the default config's ({kind})")
            except Exception as e:  # noqa: BLE001
                log(f"sweep glu  b{batch} {ci} {cfg}: DROPPED: {type(e).__name__}: {str(e).splitlines()[-1][:200]}")
                continue
            for k in ks:
                for kind in ("mono", "dual"):
                    us = safe_time(f"glu {ci}", [lambda i=i: _glu.sparse_glu(*glu_args(i, kind, k), config=cfg)
                                                 for i in range(NSLOTS)])
                    tot += us
                    per.append(f"{kind}@{k}:{us:.1f}")
                    rows.append(dict(kernel="glu", kind=kind, batch=batch, k=k, config=ci, us=us,
                                     info=kernel_info(_glu)))
            if tot == tot:  # not NaN
                res.append((tot, ci))
            log(f"sweep glu  b{batch} {ci} {cfg}: {' '.join(per)} sum {tot:.1f} [{kernel_info(_glu)}]")
        if res:
            best[("glu", batch)] = GLU_SWEEP[batch][min(res)[1]]
        res = []
        with patched(_glu, "GLU_CONFIGS", **best.get(("glu", batch), {})):
            for ci, cfg in enumerate(DOWN_SWEEP[batch]):
                tot, per = 0.0, []
                with patched(_down, "DOWN_CONFIGS", **cfg):
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
                                         info=kernel_info(_down)))
                if tot == tot:
                    res.append((tot, ci))
                log(f"sweep down b{batch} {ci} {cfg}: chain {' '.join(per)} sum {tot:.1f} [{kernel_info(_down)}]")
        if res:
            best[("down", batch)] = DOWN_SWEEP[batch][min(res)[1]]
        del p
        torch.cuda.empty_cache()
    return best, rows


def choose_combos(rank, name=MAIN):
    """Per batch bucket, the FUSE_DENSE setting (among those that passed their checks) with the least
    mono + dual time at k = 0.7 and 0.9; sets the kernel module's table."""
    d_model, d_inter, act = SHAPES[name]
    rows = []
    for batch in (1, 8):
        b = 1 if batch == 1 else 16
        p = Problem(d_model, d_inter, act, batch, rank)
        res = []
        for dense in COMBOS:
            with combo(dense) as cb:
                if not all(CHECK_OK.get(f"{m}[{cb.tag}]", True) for m in ("mono", "dual")):
                    log(f"combo b{batch} {cb.tag}: skipped (failed its check)")
                    continue
                tot = 0.0
                for k in (0.7, 0.9):
                    t = p.thresholds(k)
                    tot += safe_time(cb.tag, [lambda i=i: K.mono_gated_mlp(
                        p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"], t["mono"], act) for i in range(NSLOTS)])
                    tot += safe_time(cb.tag, [lambda i=i: K.dual_gated_mlp(
                        p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"], p.w(i)["pa"], p.w(i)["pbt"].t(),
                        t["dual"], act) for i in range(NSLOTS)])
                log(f"combo b{batch} {cb.tag}: mono + dual at k 0.7, 0.9: {tot:.1f} us")
                rows.append(dict(batch=batch, combo=cb.tag, us=tot))
                if tot == tot:
                    res.append((tot, dense))
        if res:
            _glu.FUSE_DENSE[b] = min(res)[1]
        del p
        torch.cuda.empty_cache()
    log(f"chosen: FUSE_DENSE {_glu.FUSE_DENSE}")
    return rows


# ---------------------------------------------------------------------------------------- bench
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
                ok = CHECK_OK.get(f"{m}[{current_tag(batch, m)}]", True)
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
                with combo(False), down_reduce("splitk"):
                    us = safe_time("mono[splitk]", [lambda i=i: sparse["mono"](i) for i in range(NSLOTS)])
                row("mono[cublas,splitk]", k, us, nbytes["mono"], frac["mono"], uni["mono"])
                for dense in COMBOS:
                    with combo(dense) as cb:
                        for m in ("mono", "cats", "dual", "dual_excl"):
                            if m == "dual_excl" and dense:
                                continue
                            us = safe_time(f"{m}[{cb.tag}]", [lambda i=i: sparse[m](i) for i in range(NSLOTS)]) \
                                if CHECK_OK.get(f"{m}[{cb.tag}]", True) else float("nan")
                            row(f"{m}[{cb.tag}]", k, us, nbytes[m], frac[mask_of[m]], uni[mask_of[m]])
            del wd_views
        log(f"{name:13s} b{batch} dense {dense_us:.1f} us")
        del p
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------- compile check
class Compile:
    """Stands in for ``kernel[grid](...)``: compiles for sm_90 with the launch's own arguments (no GPU
    needed: Triton's own ptxas) and logs registers, spills and shared memory; failures are appended
    to ``failures``."""

    TYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.uint8: "u8", torch.int64: "i64"}
    TAG_KEYS = ("MODE", "GATE", "UP", "BP", "CHUNK", "BLOCK_M", "BLOCK_K", "BLOCK_N", "USE_DOT", "DENSE",
                "REDUCE", "HAS_KEEP", "PREFETCH", "BLOCK_I")

    def __init__(self, jit, failures: list):
        self.jit, self.failures = jit, failures

    def __getitem__(self, grid):
        def run(*args, **kw):
            import inspect
            import subprocess
            import tempfile

            import triton
            import triton.language as tl
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource

            cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
            opts = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
            kw.pop("launch_pdl", None)  # a launch attribute, not a kernel argument
            params = inspect.signature(self.jit.fn).parameters
            binding = inspect.signature(self.jit.fn).bind(*args, **kw)
            binding.apply_defaults()
            bound = binding.arguments
            sig, const, attrs = {}, {}, {}
            for i, (name, prm) in enumerate(params.items()):
                v = bound[name]
                if prm.annotation is tl.constexpr or "constexpr" in str(prm.annotation):
                    sig[name], const[(i,)] = "constexpr", v
                elif isinstance(v, torch.Tensor):
                    sig[name], attrs[(i,)] = "*" + self.TYS[v.dtype], [["tt.divisibility", 16]]
                elif isinstance(v, int) and v == 1:  # Triton specialises ints equal to 1
                    sig[name], const[(i,)] = "constexpr", 1
                elif isinstance(v, int):
                    sig[name] = "i32"
                    if v % 16 == 0:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    sig[name] = "fp32"
            tag = f"{self.jit.fn.__name__} {grid} {opts} " + " ".join(
                f"{k}={bound[k]}" for k in self.TAG_KEYS if k in bound)
            try:
                c = triton.compile(ASTSource(self.jit, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                   options=opts)
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(c.asm["cubin"])
                    f.flush()
                    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
                use = " ".join(w for l in res.splitlines() if "REG:" in l for w in l.split()
                               if w.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL"))
                ptx = c.asm.get("ptx", "")
                use += f" DYN_SHARED:{c.metadata.shared}" + "".join(  # what the loop became on sm_90
                    f" {name}" for name, key in (("MMA", "mma."), ("ASYNC", "cp.async")) if key in ptx)
                log(f"ok   {use:40s} {tag}")
            except Exception as e:  # noqa: BLE001
                self.failures.append(tag)
                log(f"FAIL {tag}: {str(e).splitlines()[-1][:300]}")
        return run


def compile_check(shapes, only_defaults=False) -> bool:
    """Compile every kernel variant for sm_90 on this machine (no GPU needed: Triton's own ptxas) and
    print registers, spills and shared memory; False if any fails to compile. Catches what the CPU
    interpreter cannot (type and layout errors of the real compiler) before spending device time."""
    failures = []
    _glu._sparse_glu_kernel = Compile(_glu._sparse_glu_kernel, failures)
    _down._sparse_down_kernel = Compile(_down._sparse_down_kernel, failures)
    _down._sum_partials_kernel = Compile(_down._sum_partials_kernel, failures)
    for name in shapes:
        d_model, d_inter, act = SHAPES[name]
        for batch in (1, 8):
            b = 1 if batch == 1 else 8
            glu_cfgs = [None] + (GLU_SWEEP[b] if name == MAIN and not only_defaults else [])
            down_cfgs = [None] + (DOWN_SWEEP[b] if name == MAIN and not only_defaults else [])
            dtypes = (DTYPE, torch.float16, torch.float32) if name == MAIN else (DTYPE,)
            for dt in dtypes:
                e = lambda *shape, d=dt: torch.empty(shape, dtype=d)
                x, w, ind, lat, bt = e(batch, d_model), e(d_inter, d_model), e(batch, d_inter), e(batch, 64), e(d_inter, 64)
                mask = torch.empty(batch, d_inter, dtype=torch.uint8)
                plan = _down.DownPlan(batch, d_inter, d_model)
                work = plan.workspace("cpu", zeroed=False)
                thr_t = torch.empty((), dtype=torch.float32)
                for cfg in glu_cfgs if dt == DTYPE else [None]:
                    for mode, gate, up, kw in (("abs", True, False, {}), ("abs_act", False, True, {}),
                                               ("gt", True, True, {}), ("mask", True, True, {}),
                                               ("abs", True, False, dict(dense=(x, w))),
                                               ("gt", True, True, dict(dense=(lat, bt)))):
                        src = mask if mode == "mask" else (None if "dense" in kw else ind)
                        _glu.sparse_glu(x, w, w, src, thr_t if mode == "abs" else None, 0.5, mode, act, gate, up,
                                        config=cfg, zero=work, **kw)
                    if cfg is None and batch > 1:
                        _glu.sparse_glu(x, w, w, ind, None, 0.5, "gt", act, True, True, per_token=True)
                for cfg in down_cfgs if dt == DTYPE else [None]:
                    for reduce in ("atomic", "splitk"):
                        c = {**(cfg or {}), "reduce": reduce}
                        pl = _down.DownPlan(batch, d_inter, d_model, config=c)
                        _down.sparse_down(ind, None, w, plan=pl)
                    if cfg is None:
                        _down.sparse_down(ind, mask.bool(), w, plan=plan, workspace=work)
                        if batch > 1:
                            pl = _down.DownPlan(batch, d_inter, d_model, per_token=True)
                            _down.sparse_down(ind, None, w, per_token=True, plan=pl)
    log(f"compile check: {len(failures)} failures")
    return not failures


# ---------------------------------------------------------------------------------------- output
def write_outputs(rows, outdir, meta):
    import csv

    os.makedirs(outdir, exist_ok=True)
    cols = ["device", "shape", "method", "sparsity", "batch", "us", "roofline_us", "dense_us", "speedup",
            "bytes", "kept_frac", "union_frac", "note"]
    with open(os.path.join(outdir, "kernels.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in cols})
    lines = [f"# Kernel benchmark: one Gated-MLP, bf16", "",
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
    with open(os.path.join(outdir, "kernels.md"), "w") as f:
        f.write("\n".join(lines))
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
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", nargs="*", default=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--ks", nargs="*", type=float, default=[0.5, 0.7, 0.8, 0.9, 0.95])
    ap.add_argument("--rank", type=int, default=512, help="D-CountDown predictor rank")
    ap.add_argument("--sweep", action="store_true", help="first compare the candidate kernel configs")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-variants", action="store_true", help="skip per-token and reduce-mode variants")
    ap.add_argument("--plot-only", help="re-plot from a kernels.csv")
    ap.add_argument("--compile-check", action="store_true",
                    help="no GPU: compile every kernel variant for sm_90 and report registers / spills")
    ap.add_argument("--defaults-only", action="store_true", help="with --compile-check: default configs only")
    args = ap.parse_args()
    if args.compile_check:
        sys.exit(0 if compile_check(args.shapes, args.defaults_only) else 1)
    if args.plot_only:
        import csv

        rows = list(csv.DictReader(open(args.plot_only)))
        for r in rows:
            r["batch"] = int(r["batch"])
        plot(rows, os.path.join(os.path.dirname(args.plot_only), "kernels.png"))
        return
    if DEV == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1" and args.shapes == ["tiny"], \
            "without a GPU only a smoke test runs: TRITON_INTERPRET=1 ... --shapes tiny"
    import triton

    t0 = time.time()
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke test)"
    log(f"device {dev}, torch {torch.__version__}, triton {triton.__version__}")
    bw = 1e10 if DEV == "cpu" else copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    os.makedirs(args.out, exist_ok=True)
    sweep_out = {}
    if args.sweep:  # candidates are checked against the default configuration's output
        best, srows = sweep(args.rank, MAIN if MAIN in args.shapes else args.shapes[0])
        sweep_out.update(glu={str(b): c for b, c in GLU_SWEEP.items()}, down={str(b): c for b, c in DOWN_SWEEP.items()},
                         rows=srows, best={f"{a}_b{b}": c for (a, b), c in best.items()})
        # use the winners: batch 1's for one token, batch 8's for more
        for (kind, batch), cfg in best.items():
            table = _glu.GLU_CONFIGS if kind == "glu" else _down.DOWN_CONFIGS
            table[1 if batch == 1 else 16] = {**cfg, "reduce": "atomic"} if kind == "down" else cfg
        log(f"sweep done at {time.time() - t0:.0f}s: {best}")
    check_names = [n for n in (MAIN, "gemma-2-9b") if n in args.shapes] or args.shapes[:1]
    if not args.no_check:  # with the configurations that will be timed
        all_ok = check_real_shapes(check_names)
        log(f"checks done at {time.time() - t0:.0f}s: {'all ok' if all_ok else 'SOME KERNEL IS WRONG: not timed'}")
        if not all(CHECK_OK.get(f"{m}[cublas]", True) for m in ("mono", "cats", "dual", "dual_excl")):
            log("REFUSING TO TIME: a default kernel is wrong at real shapes")
            sys.exit(1)
    if args.sweep:
        sweep_out["combos"] = choose_combos(args.rank, MAIN if MAIN in args.shapes else args.shapes[0])
        sweep_out["check_ok"] = CHECK_OK
        with open(os.path.join(args.out, "kernels_sweep.json"), "w") as f:
            json.dump(sweep_out, f, indent=1)
    configs = dict(glu=_glu.GLU_CONFIGS, down=_down.DOWN_CONFIGS, fuse_dense=_glu.FUSE_DENSE)
    rows = []
    meta = dict(device=dev, date=datetime.date.today().isoformat(), bw=bw, rank=args.rank,
                command="PYTHONPATH=src python benchmarks/kernels.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__, triton=triton.__version__, configs=json.dumps(configs))
    for name in args.shapes:
        rows += bench_shape(name, args.batches, args.ks, args.rank, bw, dev, not args.no_variants)
        write_outputs(rows, args.out, meta)  # after each shape, so a cut-off run keeps what it measured
        log(f"{name} done at {time.time() - t0:.0f}s")
    log(f"\n{dev}, copy bandwidth {bw / 1e12:.2f} TB/s, total {time.time() - t0:.0f}s")
    log(f"configs {json.dumps(configs)}")
    log(f"{'shape':13s} {'b':>2s} {'k':>5s} {'method':24s} {'us':>7s} {'roof':>6s} {'xroof':>5s} {'speedup':>7s}")
    for r in rows:
        if r["shape"] in (MAIN, "tiny") and r["batch"] == 1 and r["sparsity"] in (0.0, 0.7, 0.8, 0.9):
            log(f"{r['shape']:13s} {r['batch']:2d} {r['sparsity']:5.2f} {r['method']:24s} {r['us']:7.1f} "
                f"{r['roofline_us']:6.1f} {r['us'] / r['roofline_us']:5.2f} {r['speedup']:7.2f}")


if __name__ == "__main__":
    main()
