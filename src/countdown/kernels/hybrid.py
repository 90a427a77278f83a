"""D-CountDown's hybrid practical kind on the kernel path: u dense (given), the gate predicted.

    g^[b, i] = round(latent[b] . Bt[i]) + bias[i]       latent = x A [T, r] (given), Bt [d_inter, r]
    keep     = |u| * |act(g^)| > cut                    (float32)
    s[b, i]  = u[b, i] * act(x W_gate[i]^T)             kept rows only: W_up is not read again
    y[b]     = sum_i s[b, i] w_down_t[i]

u = x W_up^T is computed before the op (a dense GEMV: W_up is read once, in full); the kernel
(``_select.py``, KIND hybrid) computes g^ for every row, applies the cut and reads only the kept rows
of W_gate and W_down, in one launch for one token (the partial sums are reduced outside the op, where
torch.compile fuses them into the residual add). Bytes: W_up + Bt + 2 d_model x 2 bytes per kept row.
``count`` = (kept, rows): the kernel adds the kept rows to a patched layer's Sparsity-Real counters (_count.py).
"""

from __future__ import annotations

import torch

from ._common import act_torch, available, count_keep, op_counters, split_threshold, threshold_value
from .shadow import MAX_FUSED_TOKENS


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


def hybrid_gated_mlp(x, u, latent, bt, bias, cut, w_gate, w_down_t, activation: str = "silu",
                     count=None) -> torch.Tensor:
    """x [..., d_model], u = x W_up^T [..., d_inter] (x's dtype), latent = x A [..., r], bt = B^T
    [d_inter, r] contiguous, bias [d_inter] float32 or None, cut a 0-dim float32 tensor or a float,
    w_gate and w_down_t [d_inter, d_model] -> y [..., d_model] in x's dtype; ``count`` = (kept, rows): the
    kept rows added to a patched layer's Sparsity-Real counters."""
    d_model = x.shape[-1]
    d_inter = w_gate.shape[0]
    if w_gate.shape != (d_inter, d_model) or w_down_t.shape != (d_inter, d_model):
        raise ValueError(f"w_gate and w_down_t must be [d_inter, d_model={d_model}], got "
                         f"{tuple(w_gate.shape)} and {tuple(w_down_t.shape)}")
    if u.shape != (*x.shape[:-1], d_inter) or bt.dim() != 2 or bt.shape[0] != d_inter \
            or latent.shape != (*x.shape[:-1], bt.shape[1]):
        raise ValueError(f"need u [..., {d_inter}], latent [..., r] and bt [{d_inter}, r] matching x "
                         f"{tuple(x.shape)}; got {tuple(u.shape)}, {tuple(latent.shape)}, {tuple(bt.shape)}")
    if bias is not None and bias.shape != (d_inter,):
        raise ValueError(f"bias must be [{d_inter}], got {tuple(bias.shape)}")
    n_tok = x.numel() // d_model
    if not available(x) or n_tok > MAX_FUSED_TOKENS:
        return hybrid_gated_mlp_ref(x, u, latent, bt, bias, cut, w_gate, w_down_t, activation, count)
    cut_t, cut_f = split_threshold(cut)
    if cut_t is not None and cut_t.dim() != 0:
        raise ValueError("the hybrid cut is one value per layer (a 0-dim tensor or a float)")
    x2, u2, lat2 = x.reshape(n_tok, d_model), u.reshape(n_tok, d_inter), latent.reshape(n_tok, -1)
    args = (x2, None, None, u2, lat2, bt, bias, cut_t, cut_f, w_gate, None, w_down_t, activation,
            *op_counters(count, x.device))
    if n_tok == 1:
        from . import _psum  # Triton: only where the kernels run

        return _psum.reduce(torch.ops.countdown.select_partials(*args), x2).reshape(x.shape)
    return torch.ops.countdown.select_gated_mlp(*args).reshape(x.shape)
