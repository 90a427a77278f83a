"""M-CountDown Gated-MLP: rows kept where |u| > threshold, u = x W_up^T.

    u = x W_up^T                     dense, cuBLAS (it is the indicator)
    keep[b, i] = |u[b, i]| > tau     (compared in float32)
    s[b, i] = u[b, i] * act(x W_gate[i]^T)   for kept rows only, else 0
    y[b] = sum_i s[b, i] * w_down_t[i, :]

After the dense u, one fused Triton kernel does the gate GEMV for kept rows, the activation and the
product with u (``_glu.py``); then the masked down projection reads only kept rows of w_down_t
(``_down.py``). Bytes read: d_model d_inter (W_up) + 2 d_model n_kept (+ vectors).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import available, check_mlp_args, plus, split_threshold, threshold_value
from .masked import gated_mlp_masked_ref


def mono_keep(x, w_up, threshold) -> torch.Tensor:
    """The keep mask M-CountDown uses: |u| > tau with u at the inputs' precision."""
    thr_t, thr_f = split_threshold(threshold)
    u = x @ w_up.t()
    return u.float().abs() > threshold_value(thr_t, thr_f, u)


def mono_gated_mlp_ref(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu") -> torch.Tensor:
    """Plain PyTorch at the inputs' precision."""
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, mono_keep(x, w_up, threshold), activation)


@torch.library.custom_op("countdown::mono_gated_mlp", mutates_args=())
def _mono_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
             thr_t: Optional[torch.Tensor], thr_f: float, activation: str, per_token: bool) -> torch.Tensor:
    from ._chain import gated_chain
    from ._glu import fuse_dense

    # u by cuBLAS first, or (FUSE_DENSE) inside the fused kernel, which then reads all of W_up itself
    if fuse_dense(x):
        src = dict(dense=(x, w_up))
    else:
        src = dict(ind=x @ w_up.t())
    return gated_chain(x, w_gate, w_up, w_down_t, **src, thr_t=thr_t, thr_f=thr_f, mode="abs",
                       activation=activation, gate=True, up=False, per_token=per_token)


@_mono_op.register_fake
def _(x, w_gate, w_up, w_down_t, thr_t, thr_f, activation, per_token):
    return torch.empty_like(x)


def mono_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu",
                   per_token: bool = False, residual=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]; threshold a float or a 0-dim tensor. With ``residual`` (x's shape
    and dtype: a folded layer's h) residual + y, the add inside the partials' sum on the one-token route."""
    d_model, _ = check_mlp_args(x, w_gate, w_up, w_down_t)
    if not available(x):
        return plus(mono_gated_mlp_ref(x, w_gate, w_up, w_down_t, threshold, activation), residual)
    thr_t, thr_f = split_threshold(threshold)
    x2 = x.reshape(-1, d_model)
    from . import _few, _onepass, _psum

    if _onepass.applies(x2):  # one token: the whole MLP in one launch
        y = _onepass.threshold_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, "abs", activation, residual)
        return y.reshape(x.shape)
    if _few.applies(x2) and not per_token:  # 2-8 tokens: the union's rows in one launch
        y = _few.few_mlp(x2, x2 @ w_up.t(), w_gate, w_up, w_down_t, thr_t, thr_f, "abs", activation,
                         gate=True, up=False)
        return _psum.add_residual(y, residual).reshape(x.shape)
    y = torch.ops.countdown.mono_gated_mlp(x2, w_gate, w_up, w_down_t,
                                           thr_t, thr_f, activation, per_token)
    return _psum.add_residual(y, residual).reshape(x.shape)
