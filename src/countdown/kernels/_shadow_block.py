"""A folded decode layer's MLP half for shadow dual, with no norm kernel: h + mlp(RMSNorm(h)), one token.

Why: in the batch-1 decode step a folded layer hands dual[shadow]'s MLP the residual stream h
(countdown.decode.layer.FOLD_MLP) and the chain was five launches: the post-attention RMSNorm
(kernels/_rmsnorm.py), x's int8 rounding for the shadow GEMV (_gemv_i8.py's ``_xprep_kernel``, 16 small
programs), the shadow GEMV, the sparse kernel and the partials' sum with the add. Each launch in that
chain waits for the one before (programmatic dependent launch) and each wait costs the previous grid's
tail. Here the norm moves into the x-prep kernel, so the chain is four launches (measured slower in the
decode step, so opt-in: see ENABLED):

1. ``_norm_xprep_kernel``: each of its programs reads the whole of h (8 KB for d_model 4096, from L2),
   computes ``r = 1 / sqrt(mean(h^2) + eps)`` itself (the same formula as _rmsnorm.py's ``_normed``),
   writes its slice of x = RMSNorm(h) (rounded as transformers rounds it) for the sparse kernel, then
   rounds that slice to int8 per weight group as ``_xprep_kernel`` does (its own groups, read back after
   a barrier);
2. the shadow GEMV with the prepared x (``_gemv_i8.launch(..., prep=...)``): |u~ act(g~)|;
3. the sparse kernel (_onepass.py) on x with that indicator, and the partials' sum adding h (_psum.py).

No program reads what another writes in step 1: x and its int8 words are the next grids' inputs.
The outputs equal the five-launch chain's: the same norm formula, the same rounding.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common, _pdl
from ._gemv_i8 import xprep_store
from ._glu import _pow2, _round_to
from ._pdl import gdc_launch_dependents, gdc_wait

# Opt-in (COUNTDOWN_SHADOW_BLOCK=1): slower in the decode step on an H100 (2026-11-27, session 24,
# benchmarks/results/norm_block/): the MLP half alone 51.41 against 51.80 us (k = 0.9), but dual[shadow4]'s step
# 292.8-293.6 tokens/s against 301.6 with the norm on its own kernel (288.2-292.6 with 4 or 1 wider x-prep programs).
ENABLED = os.environ.get("COUNTDOWN_SHADOW_BLOCK", "0") not in ("", "0")


@triton.jit
def _norm_xprep_kernel(H, G, eps, X, XA, XB, XS, XSUM, d, n_groups, BD: tl.constexpr, GB: tl.constexpr,
                       WPG: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr = 0):
    """x = RMSNorm(h) for this program's GB weight groups, stored, then rounded to int8 as _xprep_kernel does."""
    if PDL:  # launched early (_pdl.py): h is the previous kernel's output; a small grid, signal at once
        gdc_launch_dependents()
        gdc_wait()
    VPW: tl.constexpr = 32 // BITS
    GS: tl.constexpr = WPG * VPW  # values of x per weight group
    k = tl.arange(0, BD)
    hv = tl.load(H + k, mask=k < d, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(hv * hv, axis=0) / d + eps)
    e = tl.program_id(0) * (GB * GS) + tl.arange(0, GB * GS)
    em = e < d
    he = tl.load(H + e, mask=em, other=0.0).to(tl.float32)
    ge = tl.load(G + e, mask=em, other=0.0).to(tl.float32)
    DT: tl.constexpr = X.dtype.element_ty
    tl.store(X + e, _round_to(ge * _round_to(he * r, DT), DT).to(DT), mask=em)
    tl.debug_barrier()  # the slice just stored is read back by other threads of this program
    xprep_store(X, XA, XB, XS, XSUM, n_groups, GB, WPG, BITS)


def norm_prepare(h: torch.Tensor, norm_w: torch.Tensor, eps: float, n_words: int, n_groups: int, bits: int,
                 gb: int = 4, warps: int = 1):
    """(x, (xa, xb, xs, xsum)): x = RMSNorm(h) [1, d] in h's dtype and x's int8 words, group scales and sums for
    _gemv_i8.launch's ``prep`` (n_words / n_groups / bits of the shadows), in one launch of ``gb`` groups a program."""
    d = h.shape[1]
    if h.shape[0] != 1 or norm_w.shape != (d,) or norm_w.dtype != h.dtype:
        raise ValueError(f"norm_prepare takes h [1, d] and a norm weight [d] of h's dtype, got {tuple(h.shape)} "
                         f"{h.dtype} and {tuple(norm_w.shape)} {norm_w.dtype}")
    wpg = n_words // n_groups
    if wpg * (32 // bits) * n_groups != d:
        raise ValueError(f"{n_groups} groups of {wpg} {bits}-bit words do not cover d_model {d}")
    h, norm_w = h.contiguous(), norm_w.contiguous()
    x = _common.new_output((1, d), h.dtype, h.device)
    buf = torch.empty(2 * n_words + 2 * n_groups, dtype=torch.int32, device=h.device)
    xa, xb = buf[:n_words], buf[n_words:2 * n_words]
    xs = buf[2 * n_words:2 * n_words + n_groups].view(torch.float32)
    xsum = buf[2 * n_words + n_groups:]
    gb = min(_pow2(n_groups), _pow2(gb))
    pdl = _pdl.mode(h, "gemv")
    _norm_xprep_kernel[(triton.cdiv(n_groups, gb),)](
        h, norm_w, float(eps), x, xa, xb, xs, xsum, d, n_groups, BD=max(16, _pow2(d)), GB=gb, WPG=wpg, BITS=bits,
        PDL=pdl, num_warps=warps, **_pdl.launch_kwargs(pdl))
    return x, (xa, xb, xs, xsum)


@torch.library.custom_op("countdown::shadow_norm_gemv_i8", mutates_args=())
def _norm_gemv_op(h: torch.Tensor, norm_w: torch.Tensor, eps: float, q: torch.Tensor, scale: torch.Tensor,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, |u~ act(g~)|): x = RMSNorm(h) [1, d] and the shadow GEMV's indicator [1, d_inter] fp32, two launches."""
    from . import _gemv, _gemv_i8

    _, _, n_words, n_groups, bits, _ = _gemv.problem_shape(h, q, scale, "int8 shadow GEMV")
    cfg = _gemv_i8.CONFIG
    x, prep = norm_prepare(h, norm_w, eps, n_words, n_groups, bits, cfg["XPRE_GB"], cfg["XPRE_WARPS"])
    return x, _gemv_i8.launch(x, q, scale, activation, prep=prep)


@_norm_gemv_op.register_fake
def _(h, norm_w, eps, q, scale, activation):
    return torch.empty_like(h), h.new_empty((1, q.shape[0]), dtype=torch.float32)


def shadow_block(h2: torch.Tensor, norm_w: torch.Tensor, eps: float, q: torch.Tensor, scale: torch.Tensor,
                 cut_t: Optional[torch.Tensor], cut_f: float, w_gate, w_up, w_down_t, activation: str):
    """h2 + mlp(RMSNorm(h2)) for one token (the shadows prepared, the cut split), four launches; the caller
    (kernels/shadow.py :func:`~countdown.kernels.shadow.shadow_dual_block`) checks that this route serves."""
    from . import _onepass

    x, ind = torch.ops.countdown.shadow_norm_gemv_i8(h2, norm_w, float(eps), q, scale, activation)
    return _onepass.onepass_mlp(x, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation, gate=True, up=True,
                                ind=ind, residual=h2)
