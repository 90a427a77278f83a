"""D-CountDown Gated-MLP with its low-rank predictor included.

    score = (x A) B                 A [d_model, r], B [r, d_inter]: two small GEMVs (one token:
                                    kernels/_linear.py's, see _onepass.ind_linear)
    keep[b, i] = score[b, i] > cut  (compared in float32)
    s[b, i] = (x W_up[i]^T) * act(x W_gate[i]^T)   for kept rows only, else 0
    y[b] = sum_i s[b, i] * w_down_t[i, :]

The fused kernel reads the scores and applies the cut itself (no mask tensor is written), computes
both GEMVs for kept rows with the activation fused, then the masked down projection. Bytes read:
d_model r + r d_inter + 3 d_model n_kept (+ vectors).

Store the predictor's B transposed (``pred_b = bt.t()`` with ``bt`` a contiguous [d_inter, r]) and,
where ``_glu.FUSE_DENSE`` says so, the scores are computed inside the fused kernel too (the second
predictor GEMV and its launch disappear); a contiguous B takes the cuBLAS path.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ._common import available, check_mlp_args, plus, split_threshold, threshold_value
from .masked import gated_mlp_masked_ref


# A folded layer's MLP half (dual_block): the post-attention RMSNorm folded into the predictor's first GEMV and into
# the sparse kernel, so no norm kernel runs. Opt-in (COUNTDOWN_DUAL_BLOCK=1): it was slower on an H200 (2026-11-26,
# benchmarks/results/dual_block/): the MLP half at k = 0.9 27.4-27.7 us against 27.1 with the norm on its own kernel
# (the fixed GEMV's norm fold at four row blocks; k = 0.8 36.96 against 36.59), dual[lowrank] 1.78x in the decode step
# (432.5 tokens/s, the per-compile runner; run BM's 428.7-435.2 without it). With PDL the norm kernel's launch hides
# behind its neighbours; the fold costs the GEMV and each program of the sparse kernel h's and g's loads.
NORM_IN_PREDICTOR = os.environ.get("COUNTDOWN_DUAL_BLOCK", "0") not in ("", "0")
# The other way to drop the norm kernel (session 24, the default): the norm folded into the predictor's first GEMV
# only, which also writes x = RMSNorm(h) itself (a few columns a program, kernels/_linear.py x_out) for the sparse
# kernel, unchanged. COUNTDOWN_DUAL_XN=0: the norm on its own kernel. Measured on an H100 (2026-11-27,
# benchmarks/results/norm_block/): the MLP half alone 32.31 against 32.65 us at k = 0.9 (45.39 / 45.65 at 0.8);
# dual[lowrank] in the decode step 359.9-360.9 tokens/s against 355.8 (2.01-2.02x against 1.99x, one machine).
X_FROM_PREDICTOR = os.environ.get("COUNTDOWN_DUAL_XN", "1") not in ("", "0")


def dual_scores(x, pred_a, pred_b) -> torch.Tensor:
    """Predictor scores (x A) B at the predictor's precision."""
    return (x.to(pred_a.dtype) @ pred_a) @ pred_b


def dual_keep(x, pred_a, pred_b, cut) -> torch.Tensor:
    thr_t, thr_f = split_threshold(cut)
    score = dual_scores(x, pred_a, pred_b)
    return score.float() > threshold_value(thr_t, thr_f, score)


def dual_gated_mlp_ref(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation: str = "silu"):
    """Plain PyTorch at the inputs' precision."""
    keep = dual_keep(x, pred_a, pred_b, cut)
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation)


@torch.library.custom_op("countdown::dual_gated_mlp", mutates_args=())
def _dual_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
             pred_a: torch.Tensor, pred_b: torch.Tensor, cut_t: Optional[torch.Tensor], cut_f: float,
             activation: str, per_token: bool) -> torch.Tensor:
    from ._chain import gated_chain
    from ._glu import fuse_dense

    if fuse_dense(x) and _rows_of_bt(pred_b):
        # scores = (x A) B^T-rows inside the fused kernel: B is read once, by the kernel
        latent = x.to(pred_a.dtype) @ pred_a
        src = dict(dense=(latent, pred_b.t()))
    else:
        src = dict(ind=dual_scores(x, pred_a, pred_b))
    return gated_chain(x, w_gate, w_up, w_down_t, **src, thr_t=cut_t, thr_f=cut_f, mode="gt",
                       activation=activation, gate=True, up=True, per_token=per_token)


def _rows_of_bt(pred_b: torch.Tensor) -> bool:
    """Whether B [r, d_inter] is the transposed view of a contiguous B^T [d_inter, r]: then each score
    is a contiguous row dot product and the fused kernel can compute it."""
    return pred_b.dim() == 2 and pred_b.stride(0) == 1 and pred_b.stride(1) == pred_b.shape[0]


@_dual_op.register_fake
def _(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut_t, cut_f, activation, per_token):
    return torch.empty_like(x)


def _check_predictor(pred_a, pred_b, d_model: int, d_inter: int) -> None:
    if pred_a.dim() != 2 or pred_a.shape[0] != d_model or pred_b.dim() != 2 \
            or pred_b.shape != (pred_a.shape[1], d_inter):
        raise ValueError(f"predictor must be A [{d_model}, r] and B [r, {d_inter}], got "
                         f"{tuple(pred_a.shape)} and {tuple(pred_b.shape)}")


def dual_block(h, norm_w, eps: float, w_gate, w_up, w_down_t, pred_a, pred_b, cut,
               activation: str = "silu") -> torch.Tensor | None:
    """h + mlp(RMSNorm(h)) for one token of a folded decode layer (h [..., d_model], the norm's weight and eps), in
    four launches and none of them a norm: the latent RMSNorm(h) A on the fixed GEMV with the norm folded in
    (kernels/_linear.py), the scores latent B, then the sparse kernel and its partials' sum with the add. The
    sparse kernel's x: written by the first GEMV (X_FROM_PREDICTOR, the default) or, with NORM_IN_PREDICTOR
    (opt-in, slower), computed from h again in each of its programs (kernels/_block.py). None where neither serves
    (not one token on the one-launch kernel, the scores computed in the kernel, A^T or B^T not contiguous in h's
    dtype, both off): the caller then runs the norm (block_input) and ``dual_gated_mlp(..., residual=h)``."""
    d_model, d_inter = check_mlp_args(h, w_gate, w_up, w_down_t)
    _check_predictor(pred_a, pred_b, d_model, d_inter)
    h2 = h.reshape(-1, d_model)
    if not (NORM_IN_PREDICTOR or X_FROM_PREDICTOR) or not available(h2):
        return None
    from . import _block, _onepass

    at, bt = pred_a.t(), pred_b.t()
    if not (_block.applies_given(h2, "gt") and _onepass.IND_GEMV == "fixed"
            and (h2.is_cuda or _onepass.IND_GEMV_OFF_CUDA) and at.is_contiguous() and bt.is_contiguous()
            and at.dtype == bt.dtype == h2.dtype == norm_w.dtype):
        return None
    from . import _linear  # noqa: F401  (registers the GEMV ops; Triton)

    cut_t, cut_f = split_threshold(cut)
    if NORM_IN_PREDICTOR:
        latent = torch.ops.countdown.decode_norm_linear(h2, norm_w, float(eps), at, None)
        ind = torch.ops.countdown.decode_linear(latent, bt, None, None)
        return _block.given_block(h2, norm_w, eps, ind, w_gate, w_up, w_down_t, cut_t, cut_f, "gt",
                                  activation).reshape(h.shape)
    latent, x2 = torch.ops.countdown.decode_norm_linear_x(h2, norm_w, float(eps), at)
    ind = torch.ops.countdown.decode_linear(latent, bt, None, None)
    return _onepass.onepass_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation, gate=True, up=True,
                                ind=ind, residual=h2).reshape(h.shape)


def dual_block_int8(h, norm_w, eps: float, w_gate, w_up, w_down_t, a_q, a_s, bt_q, bt_s, cut,
                    activation: str = "silu") -> torch.Tensor | None:
    """:func:`dual_block`'s X_FROM_PREDICTOR route with the predictor's factors as int8 rows and float32 scales
    (A^T: ``a_q`` [r, d_model], ``a_s`` [r]; B^T: ``bt_q`` [d_inter, r], ``bt_s`` [d_inter]; quant.quantize_rows_int8):
    half the predictor's bytes. None where the route does not serve (as dual_block)."""
    d_model, d_inter = check_mlp_args(h, w_gate, w_up, w_down_t)
    h2 = h.reshape(-1, d_model)
    if not X_FROM_PREDICTOR or NORM_IN_PREDICTOR or not available(h2):
        return None
    from . import _block, _onepass

    if not (_block.applies_given(h2, "gt") and _onepass.IND_GEMV == "fixed" and (h2.is_cuda or _onepass.IND_GEMV_OFF_CUDA)
            and a_q.shape[1] == d_model and bt_q.shape == (d_inter, a_q.shape[0]) and norm_w.dtype == h2.dtype):
        return None
    from . import _linear  # noqa: F401  (registers the GEMV ops; Triton)

    cut_t, cut_f = split_threshold(cut)
    latent, x2 = torch.ops.countdown.decode_norm_linear_x_q(h2, norm_w, float(eps), a_q, a_s)
    ind = torch.ops.countdown.decode_linear_q(latent, bt_q, bt_s)
    return _onepass.onepass_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation, gate=True, up=True,
                                ind=ind, residual=h2).reshape(h.shape)


def dual_gated_mlp(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation: str = "silu",
                   per_token: bool = False, residual=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]; cut a float or a 0-dim tensor. With ``residual`` (x's shape and
    dtype: a folded layer's h) residual + y, the add inside the partials' sum where the one-token route runs."""
    d_model, d_inter = check_mlp_args(x, w_gate, w_up, w_down_t)
    _check_predictor(pred_a, pred_b, d_model, d_inter)
    if not available(x):
        return plus(dual_gated_mlp_ref(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation), residual)
    cut_t, cut_f = split_threshold(cut)
    x2 = x.reshape(-1, d_model)
    from . import _few, _onepass, _psum

    outside = _onepass.indicator_outside("gt")
    if _onepass.applies(x2) and (outside or _rows_of_bt(pred_b)):
        # one token: the predictor's GEMVs here, outside the op (torch.compile turns them into its
        # tuned GEMVs), or x A here and the scores from B^T rows in the kernel; then the whole MLP
        # in one launch
        # (on the fixed GEMV where A and B are stored as views of contiguous A^T and B^T)
        latent = _onepass.ind_linear(x2.to(pred_a.dtype), pred_a.t())
        src = dict(ind=_onepass.ind_linear(latent, pred_b.t())) if outside else dict(v=latent, w_ind=pred_b.t())
        y = _onepass.onepass_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation,
                                 gate=True, up=True, residual=residual, **src)
        return y.reshape(x.shape)
    if _few.applies(x2) and not per_token:  # 2-8 tokens: the predictor's GEMMs here, then one launch
        y = _few.few_mlp(x2, dual_scores(x2, pred_a, pred_b), w_gate, w_up, w_down_t, cut_t, cut_f, "gt",
                         activation, gate=True, up=True)
        return _psum.add_residual(y, residual).reshape(x.shape)
    y = torch.ops.countdown.dual_gated_mlp(x2, w_gate, w_up, w_down_t,
                                           pred_a, pred_b, cut_t, cut_f, activation, per_token)
    return _psum.add_residual(y, residual).reshape(x.shape)
