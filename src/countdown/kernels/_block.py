"""The MLP half of a folded decode layer in two launches: out = h + mlp(RMSNorm(h)), one token.

    x   = RMSNorm(h)            computed by every program of the sparse kernel (_onepass.py NORM), not stored
    P   = the sparse MLP's fp32 partials of x          _onepass.py, indicator in the kernel (mono: |x W_up^T|)
    out = h + round(P.sum(0))   rounded as decode_add(h, y) rounds: _psum.py with the residual (RES)

Why: a folded layer's step (countdown.decode.layer) would otherwise run the post-attention norm, the sparse
kernel, the partials' sum and the residual add as four or five launches, each a few microseconds of fixed
latency for 8-16 KB of data (under a full-graph compile the sum is Inductor's, two kernels, which also break
the chain of programmatic dependent launches). Here they are two launches of ours, the second waiting on the
first by PDL. The norm costs each program of the sparse kernel one more 8 KB load (the norm's weight, from
L2) beside h.
(The package imports this file without Triton: the kernels' modules are loaded where they run.)

Serves the threshold methods whose indicator the one-launch kernel computes from x itself (mode "abs",
mono, with its default IND "kernel"; "abs_act", cats, only if its configuration is changed to IND
"kernel"), one token, where the one-launch kernel applies; :func:`applies` says so, else the caller runs the
norm (:func:`block_input`), the MLP and the add. Bits: the same as those three (the norm's fp32 sum of
squares in another order: x may differ in its last bit from the norm kernel's, as two compiles of the norm
may).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _common
from .threshold import cats_gated_mlp_ref, mono_gated_mlp_ref

MODES = ("abs", "abs_act")


def applies(h2: torch.Tensor, mode: str) -> bool:
    """Whether the two-launch block serves this [n_tok, d_model] residual for ``mode`` now (Triton needed)."""
    from . import _onepass

    return mode in MODES and _onepass.applies(h2) and not _onepass.indicator_outside(mode)


def block_ref(h, norm_w, eps: float, w_gate, w_up, w_down_t, threshold, mode: str, activation: str):
    """The same in PyTorch: transformers' RMSNorm, the threshold method's reference MLP, the add."""
    from ._rmsnorm import rms_norm_ref  # (Triton: the kernels' modules load it)

    ref = mono_gated_mlp_ref if mode == "abs" else cats_gated_mlp_ref
    return h + ref(rms_norm_ref(h, norm_w, eps), w_gate, w_up, w_down_t, threshold, activation)


@torch.library.custom_op("countdown::gated_block", mutates_args=("kept", "rows"))
def _block_op(h: torch.Tensor, norm_w: torch.Tensor, eps: float, w_gate: torch.Tensor, w_up: torch.Tensor,
              w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, rule: str,
              activation: str, kept: Optional[torch.Tensor] = None,
              rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    from . import _onepass, _psum  # Triton: only where the kernels run

    # the one-launch kernel normalising h itself, then the partials' sum adding h (``rule``: a mode of MODES,
    # not named ``mode``, see _onepass.py's op)
    w_ind = w_up if rule == "abs" else w_gate
    p = _onepass.onepass_partials(h, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, rule == "abs",
                                  rule != "abs", norm=(norm_w, eps), count=_common.op_count(kept, rows))
    return _psum.sum_partials(p, h.dtype, residual=h)


@_block_op.register_fake
def _(h, norm_w, eps, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, kept=None, rows=None):
    return torch.empty_like(h)


def threshold_block(h, norm_w, eps: float, w_gate, w_up, w_down_t, threshold, method: str,
                    activation: str, count=None) -> torch.Tensor | None:
    """h + mlp(RMSNorm(h)) for h [..., d_model] of one token, ``method`` "mono" or "cats" with its threshold
    (a float or a tensor, as mono_gated_mlp takes it), or None where :func:`applies` says no (the caller then
    runs the norm, the MLP and the add itself). With ``count`` = (kept, rows) the kept rows are added to a
    patched layer's Sparsity-Real counters (_count.py)."""
    mode = {"mono": "abs", "cats": "abs_act"}.get(method)
    if mode is None:
        raise ValueError(f"threshold_block serves 'mono' or 'cats', got {method!r}")
    d_model, _ = _common.check_mlp_args(h, w_gate, w_up, w_down_t)
    h2 = h.reshape(-1, d_model)
    if not _common.available(h2) or not applies(h2, mode):
        return None
    thr_t, thr_f = _common.split_threshold(threshold)
    kept, rows = _common.op_counters(count, h2.device)
    out = torch.ops.countdown.gated_block(h2, norm_w, float(eps), w_gate, w_up, w_down_t, thr_t, thr_f, mode,
                                          activation, kept, rows)
    return out.reshape(h.shape)


def block_input(h, norm_w, eps: float) -> torch.Tensor:
    """RMSNorm(h) on the folded layer's norm kernel (kernels/_rmsnorm.py), for the routes whose MLP needs x itself
    (a GEMV before the sparse kernel); they then take ``residual=h`` for the add."""
    from . import _rmsnorm  # noqa: F401  (registers countdown::decode_rms_norm; Triton)

    return torch.ops.countdown.decode_rms_norm(h, norm_w, float(eps))
