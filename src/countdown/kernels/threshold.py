"""The threshold methods' Gated-MLP: rows kept where the method's own indicator passes a threshold.

M-CountDown (mono) thresholds u = x W_up^T, CATS (cats) the activated gate act(g), g = x W_gate^T:

    mono: keep[b, i] = |u[b, i]| > tau               cats: keep[b, i] = |act(g[b, i])| > tau
    s[b, i] = u[b, i] * act(g[b, i])   for kept rows only, else 0     (compared in float32)
    y[b] = sum_i s[b, i] * w_down_t[i, :]

The indicator is the dense GEMV (W_up for mono, W_gate for cats, read in full); the other GEMV is computed
for kept rows only with the activation fused, then the masked down projection reads only kept rows of
w_down_t. Bytes read: d_model d_inter + 2 d_model n_kept (+ vectors). One token on CUDA: the whole MLP in
one launch (_onepass.py); 2-8 tokens: the union's rows in one launch (_few.py); more: the fused gate / up
kernel (_glu.py) and the masked down projection (_down.py). ``count`` = (kept, rows): the kernel that keeps
the rows adds them to a patched layer's Sparsity-Real counters (_count.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import (act_torch, available, check_mlp_args, count_keep, op_count, op_counters, plus,
                      split_threshold, threshold_value)
from .masked import gated_chain, gated_mlp_masked_ref

# method -> (the one-launch kernels' mode, the indicator's weight, GATE, UP: which GEMVs the kept rows compute)
_ROLES = {"mono": ("abs", "w_up", True, False), "cats": ("abs_act", "w_gate", False, True)}


def mono_keep(x, w_up, threshold) -> torch.Tensor:
    """The keep mask M-CountDown uses: |u| > tau with u at the inputs' precision."""
    thr_t, thr_f = split_threshold(threshold)
    u = x @ w_up.t()
    return u.float().abs() > threshold_value(thr_t, thr_f, u)


def cats_keep(x, w_gate, threshold, activation: str = "silu") -> torch.Tensor:
    """The keep mask CATS uses: |act(g)| > tau, g at the inputs' precision, act in float32."""
    thr_t, thr_f = split_threshold(threshold)
    g = x @ w_gate.t()
    return act_torch(g.float(), activation).abs() > threshold_value(thr_t, thr_f, g)


def _keep_of(method, x, w_gate, w_up, threshold, activation):
    return mono_keep(x, w_up, threshold) if method == "mono" else cats_keep(x, w_gate, threshold, activation)


def mono_gated_mlp_ref(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu") -> torch.Tensor:
    """Plain PyTorch at the inputs' precision."""
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, mono_keep(x, w_up, threshold), activation)


def cats_gated_mlp_ref(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu") -> torch.Tensor:
    """Plain PyTorch at the inputs' precision."""
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, cats_keep(x, w_gate, threshold, activation), activation)


def _chain(method, x, w_gate, w_up, w_down_t, thr_t, thr_f, activation, per_token, count):
    """The fused gate / up kernel, then the masked down projection (any number of tokens)."""
    mode, ind_weight, gate, up = _ROLES[method]
    w_ind = w_up if ind_weight == "w_up" else w_gate
    return gated_chain(x, w_gate, w_up, w_down_t, ind=x @ w_ind.t(), thr_t=thr_t, thr_f=thr_f, mode=mode,
                       activation=activation, gate=gate, up=up, per_token=per_token, count=count)


@torch.library.custom_op("countdown::mono_gated_mlp", mutates_args=("kept", "rows"))
def _mono_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
             thr_t: Optional[torch.Tensor], thr_f: float, activation: str, per_token: bool,
             kept: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _chain("mono", x, w_gate, w_up, w_down_t, thr_t, thr_f, activation, per_token, op_count(kept, rows))


@_mono_op.register_fake
def _(x, w_gate, w_up, w_down_t, thr_t, thr_f, activation, per_token, kept=None, rows=None):
    return torch.empty_like(x)


@torch.library.custom_op("countdown::cats_gated_mlp", mutates_args=("kept", "rows"))
def _cats_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
             thr_t: Optional[torch.Tensor], thr_f: float, activation: str, per_token: bool,
             kept: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _chain("cats", x, w_gate, w_up, w_down_t, thr_t, thr_f, activation, per_token, op_count(kept, rows))


@_cats_op.register_fake
def _(x, w_gate, w_up, w_down_t, thr_t, thr_f, activation, per_token, kept=None, rows=None):
    return torch.empty_like(x)


def _threshold_mlp(method, x, w_gate, w_up, w_down_t, threshold, activation, per_token, residual, count):
    d_model, _ = check_mlp_args(x, w_gate, w_up, w_down_t)
    if not available(x):
        keep = _keep_of(method, x, w_gate, w_up, threshold, activation)
        count_keep(count, keep)
        return plus(gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation), residual)
    kept, rows = op_counters(count, x.device)
    thr_t, thr_f = split_threshold(threshold)
    x2 = x.reshape(-1, d_model)
    from . import _few, _onepass, _psum

    mode, ind_weight, gate, up = _ROLES[method]
    if _onepass.applies(x2):  # one token: the whole MLP in one launch
        y = _onepass.threshold_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, residual,
                                   count=count)
        return y.reshape(x.shape)
    if _few.applies(x2) and not per_token:  # 2-8 tokens: the union's rows in one launch
        w_ind = w_up if ind_weight == "w_up" else w_gate
        y = _few.few_mlp(x2, x2 @ w_ind.t(), w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation,
                         gate=gate, up=up, count=count)
        return _psum.add_residual(y, residual).reshape(x.shape)
    op = torch.ops.countdown.mono_gated_mlp if method == "mono" else torch.ops.countdown.cats_gated_mlp
    y = op(x2, w_gate, w_up, w_down_t, thr_t, thr_f, activation, per_token, kept, rows)
    return _psum.add_residual(y, residual).reshape(x.shape)


def mono_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu",
                   per_token: bool = False, residual=None, count=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]; threshold a float or a 0-dim tensor. With ``residual`` (x's shape
    and dtype: a folded layer's h) residual + y, the add inside the partials' sum on the one-token route; with
    ``count`` = (kept, rows) the kept rows added to a patched layer's Sparsity-Real counters."""
    return _threshold_mlp("mono", x, w_gate, w_up, w_down_t, threshold, activation, per_token, residual, count)


def cats_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu",
                   per_token: bool = False, residual=None, count=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]; threshold a float or a 0-dim tensor. With ``residual`` (x's shape
    and dtype: a folded layer's h) residual + y, the add inside the partials' sum on the one-token route; with
    ``count`` = (kept, rows) the kept rows added to a patched layer's Sparsity-Real counters."""
    return _threshold_mlp("cats", x, w_gate, w_up, w_down_t, threshold, activation, per_token, residual, count)
