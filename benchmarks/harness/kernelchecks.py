"""The kernel table's correctness gate: every sparse Gated-MLP op against float64 at real shapes.

Before ``benchmarks/mlp_kernels.py`` times anything, :func:`check_real_shapes` runs mono, cats, dual,
masked (per token, and with the mask given) and their indicator-inside-the-kernel variants at the real
shapes of :data:`harness.mlpbench.SHAPES` with poisoned outputs, against float64 (the
flash-attention rule: no worse than twice PyTorch's own error in the same dtype, plus a tolerance; see
tests/test_kernels.py), and records the verdict per op in :data:`CHECK_OK`; the table refuses to time an
op that failed.
"""

from __future__ import annotations

import contextlib

import torch

import countdown.kernels as K

from .mlpbench import DEV, DTYPE, SHAPES, Problem, gap_threshold, log

CHECK_OK: dict = {}  # op -> passed the real-shape check (a failed op is not timed)


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
                tag = op if op == "masked_per_token" else f"{op}[cublas]"
                ok &= run_check(f"{name:13s} b{batch} {tag:28s}", fn, ref, keep, x, f64, act, tol, [], key=tag)
            p = None  # frees the weights (the closures above are done with them)
    return ok


def run_check(label, fn, ref, keep, x, f64, act, tol, contexts, key) -> bool:
    """One op vs float64 with poisoned outputs; records CHECK_OK[key] (and the op's default path)."""
    try:
        with contextlib.ExitStack() as st:
            st.enter_context(K.overrides(poison_outputs=True))
            for c in contexts:
                st.enter_context(c)
            out = fn()
        torch.cuda.synchronize() if DEV == "cuda" else None
    except Exception as e:  # noqa: BLE001
        log(f"check {label} FAILED TO RUN: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
        CHECK_OK[key] = False
        return False
    out_t = ref()
    ref64 = K.gated_mlp_masked_ref(x.double(), *f64, keep, act)
    err = (out.double() - ref64).abs()
    bound = 2 * (out_t.double() - ref64).abs() + tol * max(1.0, ref64.abs().max().item())
    good = bool((err <= bound).all()) and not torch.isnan(out).any()
    CHECK_OK[key] = CHECK_OK.get(key, True) and good
    log(f"check {label} max err {err.max().item():.2e} torch {(out_t.double() - ref64).abs().max().item():.2e} "
        f"{'ok' if good else 'WRONG'}")
    return good
