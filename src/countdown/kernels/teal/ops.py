"""TEAL Gated-MLP: input entries kept where |x| > tau_x, intermediate entries where |s| > tau_s.

    x_t[b, j] = x[b, j]  if |x[b, j]| > tau_x  else 0          (compared in float32)
    g = x_t W_gate^T,  u = x_t W_up^T                         only kept rows of W_gate^T, W_up^T read
    s[b, i] = u * act(g)  if |u * act(g)| > tau_s  else 0
    y[b] = sum_i s[b, i] * w_down_t[i, :]                      only kept rows of W_down^T read

Weights come transposed: ``w_gate_t``, ``w_up_t`` ``[d_model, d_inter]`` (unit inner stride, any row
stride: the ``.t()`` of a weight stored column-major, or of half of a fused gate_up) and
``w_down_t`` ``[d_inter, d_model]``. Two or three launches (``kernels.py``): the input-sparse gate/up GEMVs
over the compacted kept channels (split over the input channels, fp32 partials), the sum of the
splits with the activation, product, threshold and compaction of the kept s entries, and the
down projection over them; the down partials are summed outside the op (fused by torch.compile into
what follows). A group of up to 16 tokens reads the union of its kept rows once and applies each
token's own masks.

Bytes read per token: (2 d_inter n_x + d_model n_s) weights for n_x kept x entries and n_s kept s
entries, plus vectors (:func:`countdown.eval.cost.mlp_weight_bytes` kind ``"teal"``). ``count`` = (kept,
rows): the kernels add each token's kept share of the weights, :func:`kept_weight_fraction`, and 1 to a
patched layer's Sparsity-Real counters (jit_helpers.add_count). The route (route.py): the kernels for any number of
tokens (in groups of 16), wherever they run.
"""

from __future__ import annotations

import torch

from ..common import act_torch, op_counters, split_threshold, threshold_value
from ..route import route


def kept_weight_fraction(keep_x: torch.Tensor, keep_s: torch.Tensor) -> torch.Tensor:
    """Per token, the kept share of the Gated-MLP's weights, ``(2 n_x / d_model + n_s / d_inter) / 3``,
    from the keep masks ``[tokens, d_model]`` and ``[tokens, d_inter]`` (float64 ``[tokens]``)."""
    fx = keep_x.sum(dim=-1, dtype=torch.float64) / keep_x.shape[-1]
    fs = keep_s.sum(dim=-1, dtype=torch.float64) / keep_s.shape[-1]
    return (2.0 * fx + fs) / 3.0


def count_teal(count, keep_x: torch.Tensor, keep_s: torch.Tensor) -> None:
    """Add masks computed in PyTorch to ``count`` = (kept, rows), as the kernels add theirs."""
    if count is not None:
        count[0].add_(kept_weight_fraction(keep_x, keep_s).sum())
        count[1].add_(keep_x.shape[0])


def teal_keep_x(x, threshold) -> torch.Tensor:
    """|x| > tau_x, compared in float32."""
    thr_t, thr_f = split_threshold(threshold)
    return x.float().abs() > threshold_value(thr_t, thr_f, x)


def teal_masked_ref(x, w_gate_t, w_up_t, w_down_t, keep_x, keep_s, activation: str) -> torch.Tensor:
    """Plain PyTorch at the inputs' precision with the masks given (use float64 inputs for a reference)."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    xt = torch.where(keep_x, x, zero)
    s = (xt @ w_up_t) * act_torch(xt @ w_gate_t, activation)
    return torch.where(keep_s, s, zero.to(s.dtype)) @ w_down_t


def teal_gated_mlp_ref(x, w_gate_t, w_up_t, w_down_t, thr_x, thr_s, activation: str = "silu",
                       return_masks: bool = False):
    """Plain PyTorch at the inputs' precision: y, and with ``return_masks`` also (keep_x, keep_s)."""
    keep_x = teal_keep_x(x, thr_x)
    xt = torch.where(keep_x, x, torch.zeros((), dtype=x.dtype, device=x.device))
    s = (xt @ w_up_t) * act_torch(xt @ w_gate_t, activation)
    thr_t, thr_f = split_threshold(thr_s)
    keep_s = s.float().abs() > threshold_value(thr_t, thr_f, s)
    y = torch.where(keep_s, s, torch.zeros((), dtype=s.dtype, device=s.device)) @ w_down_t
    return (y, keep_x, keep_s) if return_masks else y


def _check(x, w_gate_t, w_up_t, w_down_t):
    d_model = x.shape[-1]
    if w_gate_t.dim() != 2 or w_gate_t.shape[0] != d_model:
        raise ValueError(f"w_gate_t must be W_gate transposed, [d_model={d_model}, d_inter], got {tuple(w_gate_t.shape)}")
    d_inter = w_gate_t.shape[1]
    for name, w, want in (("w_up_t", w_up_t, (d_model, d_inter)), ("w_down_t", w_down_t, (d_inter, d_model))):
        if tuple(w.shape) != want:
            raise ValueError(f"{name} must be {list(want)} (the weight transposed), got {tuple(w.shape)}")
    for name, w in (("w_gate_t", w_gate_t), ("w_up_t", w_up_t), ("w_down_t", w_down_t)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name} dtype {w.dtype} differs from x dtype {x.dtype}")
    return d_model


def teal_gated_mlp(x, w_gate_t, w_up_t, w_down_t, thr_x, thr_s, activation: str = "silu",
                   count=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model] in x's dtype; thresholds floats or 0-dim tensors (read on the
    device). The kernels where they run (route.py), else :func:`teal_gated_mlp_ref`. With ``count`` = (kept, rows)
    each token's kept share of the weights is added to a patched layer's Sparsity-Real counters."""
    d_model = _check(x, w_gate_t, w_up_t, w_down_t)
    for name, t in (("thr_x", thr_x), ("thr_s", thr_s)):
        if isinstance(t, torch.Tensor) and t.numel() != 1:
            raise ValueError(f"{name} must be one value (a float or a one-element tensor), got shape {tuple(t.shape)}")
    if route("teal", x) == "reference":
        y, keep_x, keep_s = teal_gated_mlp_ref(x, w_gate_t, w_up_t, w_down_t, thr_x, thr_s, activation, True)
        count_teal(count, keep_x.reshape(-1, d_model), keep_s.reshape(-1, keep_s.shape[-1]))
        return y
    # the kernels read unit-stride rows; a weight stored otherwise is copied (correct, slower)
    w_gate_t, w_up_t = (w if w.stride(1) == 1 else w.contiguous() for w in (w_gate_t, w_up_t))
    w_down_t = w_down_t.contiguous()
    tx_t, tx_f = split_threshold(thr_x)
    ts_t, ts_f = split_threshold(thr_s)
    from ..sparse_mlp import partial_sums
    from . import kernels  # noqa: F401  (registers countdown::teal_partials; Triton: only where the kernels run)

    # the partials' sum and cast stay outside the op: torch.compile fuses them with what follows; run
    # eagerly, sparse_mlp/partial_sums.py's op sums them
    p = torch.ops.countdown.teal_partials(x.reshape(-1, d_model), w_gate_t, w_up_t, w_down_t,
                                          tx_t, tx_f, ts_t, ts_f, activation, *op_counters(count, x.device))
    return partial_sums.reduce(p, x).reshape(x.shape)
