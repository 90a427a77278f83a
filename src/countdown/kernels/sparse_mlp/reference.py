"""The sparse Gated-MLP's PyTorch references and keep rules (no Triton): what every kernel of this family computes.

    s[b, i] = u[b, i] * act(g[b, i])   for kept rows, else 0        u = x W_up^T, g = x W_gate^T
    y[b]    = sum_i s[b, i] * w_down_t[i, :]                         w_down_t = W_down^T [d_inter, d_model]

Keep rules (compared in float32): mono |u| > tau, cats |act(g)| > tau, dual (a predictor A [d_model, r],
B [r, d_inter]) (x A) B > cut, hybrid |u| |act(latent Bt^T + bias)| > cut, or a mask given.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common import act_torch, count_keep, split_threshold, threshold_value


def gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation: str) -> torch.Tensor:
    """Plain PyTorch at the inputs' precision: the dense computation with unkept s zeroed."""
    g = x @ w_gate.t()
    u = x @ w_up.t()
    s = u * act_torch(g, activation)
    s = torch.where(keep, s, torch.zeros((), dtype=s.dtype, device=s.device))
    return s @ w_down_t


masked_gated_mlp_ref = gated_mlp_masked_ref


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


def mono_gated_mlp_ref(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu") -> torch.Tensor:
    """Plain PyTorch at the inputs' precision."""
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, mono_keep(x, w_up, threshold), activation)


def cats_gated_mlp_ref(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu") -> torch.Tensor:
    """Plain PyTorch at the inputs' precision."""
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, cats_keep(x, w_gate, threshold, activation), activation)


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


def hybrid_keep(u, latent, bt, bias, cut, activation: str = "silu") -> torch.Tensor:
    """keep [..., d_inter]: |u| * |act(latent Bt^T + bias)| > cut, in float32 (latent Bt^T at latent's
    precision, as ``countdown.predictors.HybridDualSelector`` computes it)."""
    g_hat = (latent @ bt.t()).float()
    if bias is not None:
        g_hat = g_hat + bias.float()
    score = u.float().abs() * act_torch(g_hat, activation).abs()
    thr_t, thr_f = split_threshold(cut)
    return score > threshold_value(thr_t, thr_f, score)


def hybrid_gated_mlp_ref(x, u, latent, bt, bias, cut, w_gate, w_down_t, activation: str = "silu", count=None):
    """Plain PyTorch at x's precision (the kept rows added to ``count`` if given)."""
    keep = hybrid_keep(u, latent, bt, bias, cut, activation)
    count_keep(count, keep)
    s = u * act_torch(x @ w_gate.t(), activation)
    s = torch.where(keep, s, torch.zeros((), dtype=s.dtype, device=s.device))
    return s @ w_down_t


def sparse_down_proj_ref(s: torch.Tensor, keep: Optional[torch.Tensor], w_down_t: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch at s's precision (any leading dims): y = masked s @ w_down_t."""
    if keep is not None:
        s = torch.where(keep, s, torch.zeros((), dtype=s.dtype, device=s.device))
    return s @ w_down_t


def block_ref(h, norm_w, eps: float, w_gate, w_up, w_down_t, threshold, mode: str, activation: str):
    """h + mono's ("abs") or cats' ("abs_act") MLP of RMSNorm(h) in PyTorch: transformers' RMSNorm, the method's
    reference MLP, the add (what ``ops.threshold_block`` computes)."""
    from ..decode_step.reference import rms_norm_ref

    ref = mono_gated_mlp_ref if mode == "abs" else cats_gated_mlp_ref
    return h + ref(rms_norm_ref(h, norm_w, eps), w_gate, w_up, w_down_t, threshold, activation)
