"""D-CountDown Gated-MLP with its low-rank predictor included.

    score = (x A) B                 A [d_model, r], B [r, d_inter]: two small GEMVs (one token:
                                    kernels/_linear.py's, see _onepass.ind_linear)
    keep[b, i] = score[b, i] > cut  (compared in float32)
    s[b, i] = (x W_up[i]^T) * act(x W_gate[i]^T)   for kept rows only, else 0
    y[b] = sum_i s[b, i] * w_down_t[i, :]

The fused kernels read the scores and apply the cut themselves (no mask tensor is written), compute
both GEMVs for kept rows with the activation fused, then the masked down projection. Bytes read:
d_model r + r d_inter + 3 d_model n_kept (+ vectors).

Store the predictor's A and B as the transposed views of contiguous A^T [r, d_model] and B^T [d_inter, r]:
for one token both GEMVs then run on kernels/_linear.py's fixed GEMV, which reads rows. ``count`` = (kept,
rows): the kernel that keeps the rows adds them to a patched layer's Sparsity-Real counters (_count.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import (available, check_mlp_args, count_keep, op_count, op_counters, plus,
                      split_threshold, threshold_value)
from .masked import gated_chain, gated_mlp_masked_ref


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


@torch.library.custom_op("countdown::dual_gated_mlp", mutates_args=("kept", "rows"))
def _dual_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
             pred_a: torch.Tensor, pred_b: torch.Tensor, cut_t: Optional[torch.Tensor], cut_f: float,
             activation: str, per_token: bool, kept: Optional[torch.Tensor] = None,
             rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    return gated_chain(x, w_gate, w_up, w_down_t, ind=dual_scores(x, pred_a, pred_b), thr_t=cut_t, thr_f=cut_f,
                       mode="gt", activation=activation, gate=True, up=True, per_token=per_token,
                       count=op_count(kept, rows))


@_dual_op.register_fake
def _(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut_t, cut_f, activation, per_token, kept=None, rows=None):
    return torch.empty_like(x)


def _check_predictor(pred_a, pred_b, d_model: int, d_inter: int) -> None:
    if pred_a.dim() != 2 or pred_a.shape[0] != d_model or pred_b.dim() != 2 \
            or pred_b.shape != (pred_a.shape[1], d_inter):
        raise ValueError(f"predictor must be A [{d_model}, r] and B [r, {d_inter}], got "
                         f"{tuple(pred_a.shape)} and {tuple(pred_b.shape)}")


def dual_block(h, norm_w, eps: float, w_gate, w_up, w_down_t, pred_a, pred_b, cut,
               activation: str = "silu", count=None) -> torch.Tensor | None:
    """h + mlp(RMSNorm(h)) for one token of a folded decode layer (h [..., d_model], the norm's weight and eps), in
    four launches and none of them a norm: the predictor's first GEMV with the norm folded in, which also writes
    x = RMSNorm(h) for the sparse kernel (kernels/_linear.py ``decode_norm_linear_x``), the scores latent B, then
    the sparse kernel and its partials' sum with the add. None where that route does not serve (not one token on
    the one-launch kernel, A^T or B^T not contiguous in h's dtype): the caller then runs the norm (block_input)
    and ``dual_gated_mlp(..., residual=h)``. ``count`` as dual_gated_mlp takes it."""
    d_model, d_inter = check_mlp_args(h, w_gate, w_up, w_down_t)
    _check_predictor(pred_a, pred_b, d_model, d_inter)
    h2 = h.reshape(-1, d_model)
    if not available(h2):
        return None
    from . import _onepass

    at, bt = pred_a.t(), pred_b.t()
    if not (_onepass.applies(h2) and (h2.is_cuda or _onepass.IND_GEMV_OFF_CUDA) and at.is_contiguous()
            and bt.is_contiguous() and at.dtype == bt.dtype == h2.dtype == norm_w.dtype):
        return None
    cut_t, cut_f = split_threshold(cut)
    latent, x2 = torch.ops.countdown.decode_norm_linear_x(h2, norm_w, float(eps), at)
    ind = torch.ops.countdown.decode_linear(latent, bt, None, None)
    return _onepass.onepass_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation, gate=True, up=True,
                                ind=ind, residual=h2, count=count).reshape(h.shape)


def dual_gated_mlp(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation: str = "silu",
                   per_token: bool = False, residual=None, count=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]; cut a float or a 0-dim tensor. With ``residual`` (x's shape and
    dtype: a folded layer's h) residual + y, the add inside the partials' sum where the one-token route runs;
    with ``count`` = (kept, rows) the kept rows added to a patched layer's Sparsity-Real counters."""
    d_model, d_inter = check_mlp_args(x, w_gate, w_up, w_down_t)
    _check_predictor(pred_a, pred_b, d_model, d_inter)
    if not available(x):
        keep = dual_keep(x, pred_a, pred_b, cut)
        count_keep(count, keep)
        return plus(gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation), residual)
    kept, rows = op_counters(count, x.device)
    cut_t, cut_f = split_threshold(cut)
    x2 = x.reshape(-1, d_model)
    from . import _few, _onepass, _psum

    if _onepass.applies(x2):
        # one token: the predictor's two GEMVs (on the fixed GEMV where A and B are stored as views of
        # contiguous A^T and B^T), then the whole MLP in one launch
        latent = _onepass.ind_linear(x2.to(pred_a.dtype), pred_a.t())
        ind = _onepass.ind_linear(latent, pred_b.t())
        y = _onepass.onepass_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation,
                                 gate=True, up=True, residual=residual, ind=ind, count=count)
        return y.reshape(x.shape)
    if _few.applies(x2) and not per_token:  # 2-8 tokens: the predictor's GEMMs here, then one launch
        y = _few.few_mlp(x2, dual_scores(x2, pred_a, pred_b), w_gate, w_up, w_down_t, cut_t, cut_f, "gt",
                         activation, gate=True, up=True, count=count)
        return _psum.add_residual(y, residual).reshape(x.shape)
    y = torch.ops.countdown.dual_gated_mlp(x2, w_gate, w_up, w_down_t,
                                           pred_a, pred_b, cut_t, cut_f, activation, per_token, kept, rows)
    return _psum.add_residual(y, residual).reshape(x.shape)
