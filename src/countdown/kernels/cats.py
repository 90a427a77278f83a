"""CATS Gated-MLP: rows kept where |act(g)| > threshold, g = x W_gate^T.

    g = x W_gate^T                        dense, cuBLAS
    keep[b, i] = |act(g[b, i])| > tau     (act and compare in float32)
    s[b, i] = (x W_up[i]^T) * act(g[b, i])   for kept rows only, else 0
    y[b] = sum_i s[b, i] * w_down_t[i, :]

The same two kernels as M-CountDown with the roles of W_gate and W_up swapped: the fused kernel
computes the up GEMV for kept rows and applies the activation to the dense g itself.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import act_torch, available, check_mlp_args, plus, split_threshold, threshold_value
from .masked import gated_mlp_masked_ref


def cats_keep(x, w_gate, threshold, activation: str = "silu") -> torch.Tensor:
    """The keep mask CATS uses: |act(g)| > tau, g at the inputs' precision, act in float32."""
    thr_t, thr_f = split_threshold(threshold)
    g = x @ w_gate.t()
    return act_torch(g.float(), activation).abs() > threshold_value(thr_t, thr_f, g)


def cats_gated_mlp_ref(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu") -> torch.Tensor:
    """Plain PyTorch at the inputs' precision."""
    keep = cats_keep(x, w_gate, threshold, activation)
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation)


@torch.library.custom_op("countdown::cats_gated_mlp", mutates_args=())
def _cats_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
             thr_t: Optional[torch.Tensor], thr_f: float, activation: str, per_token: bool) -> torch.Tensor:
    from ._chain import gated_chain
    from ._glu import fuse_dense

    if fuse_dense(x):
        src = dict(dense=(x, w_gate))
    else:
        src = dict(ind=x @ w_gate.t())
    return gated_chain(x, w_gate, w_up, w_down_t, **src, thr_t=thr_t, thr_f=thr_f, mode="abs_act",
                       activation=activation, gate=False, up=True, per_token=per_token)


@_cats_op.register_fake
def _(x, w_gate, w_up, w_down_t, thr_t, thr_f, activation, per_token):
    return torch.empty_like(x)


def cats_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu",
                   per_token: bool = False, residual=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]; threshold a float or a 0-dim tensor. With ``residual`` (x's shape
    and dtype: a folded layer's h) residual + y, the add inside the partials' sum on the one-token route."""
    d_model, _ = check_mlp_args(x, w_gate, w_up, w_down_t)
    if not available(x):
        return plus(cats_gated_mlp_ref(x, w_gate, w_up, w_down_t, threshold, activation), residual)
    thr_t, thr_f = split_threshold(threshold)
    x2 = x.reshape(-1, d_model)
    from . import _few, _onepass, _psum

    if _onepass.applies(x2):  # one token: the whole MLP in one launch
        y = _onepass.threshold_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, "abs_act", activation, residual)
        return y.reshape(x.shape)
    if _few.applies(x2) and not per_token:  # 2-8 tokens: the union's rows in one launch
        y = _few.few_mlp(x2, x2 @ w_gate.t(), w_gate, w_up, w_down_t, thr_t, thr_f, "abs_act", activation,
                         gate=False, up=True)
        return _psum.add_residual(y, residual).reshape(x.shape)
    y = torch.ops.countdown.cats_gated_mlp(x2, w_gate, w_up, w_down_t,
                                           thr_t, thr_f, activation, per_token)
    return _psum.add_residual(y, residual).reshape(x.shape)
