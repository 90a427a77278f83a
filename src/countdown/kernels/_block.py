"""The MLP half of a folded decode layer in two launches: out = h + mlp(RMSNorm(h)), one token.

    x   = RMSNorm(h)            computed by every program of the sparse kernel (_onepass.py NORM), not stored
    P   = the sparse MLP's fp32 partials of x          _onepass.py, indicator in the kernel (mono: |x W_up^T|)
    out = h + round(P.sum(0))   rounded as decode_add(h, y) rounds: _psum.py with the residual (RES)

Why: a folded layer's step (countdown.decode.layer) runs the post-attention norm, the sparse kernel, the
partials' sum and the residual add as four or five launches (under a full-graph compile the sum is
Inductor's, two kernels, which also break the chain of programmatic dependent launches); each costs a few
microseconds of fixed latency for 8-16 KB of data (docs/decode.md, sessions 13-21). Here they are two
launches of ours, the second waiting on the first by PDL. The norm costs each program of the sparse kernel
one more 8 KB load (the norm's weight, from L2) beside h.
(The package imports this file without Triton: the kernels' modules are loaded where they run.)

Serves the threshold methods whose indicator the one-launch kernel computes from x itself (mode "abs",
mono, with its default IND "kernel"; "abs_act", cats, only if its configuration is changed to IND
"kernel"), one token, where the one-launch kernel applies; :func:`applies` says so, else the caller runs the
norm, the MLP and the add as before. Bits: the same as those three (the norm's fp32 sum of squares in
another order: x may differ in its last bit from the norm kernel's, as two compiles of the norm may).

A predictor's variant (:func:`given_block`, for kernels/dual.py's ``dual_block``): the indicator computed before the
launch from RMSNorm(h) (the predictor's first GEMV with the norm folded in, kernels/_linear.py), the sparse kernel
normalising h itself for the kept rows and the sum adding h: no launch a norm of its own.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _common
from .cats import cats_gated_mlp_ref
from .mono import mono_gated_mlp_ref

MODES = ("abs", "abs_act")


def applies(h2: torch.Tensor, mode: str) -> bool:
    """Whether the two-launch block serves this [n_tok, d_model] residual for ``mode`` now (Triton needed)."""
    from . import _onepass

    cfg = _onepass.CONFIGS[mode]
    return (mode in MODES and _onepass.applies(h2) and _onepass.SPARSE_KERNEL == "onepass"
            and not _onepass.indicator_outside(mode) and not cfg.get("IND_DOT") and not cfg.get("IND_TMA"))


def block_ref(h, norm_w, eps: float, w_gate, w_up, w_down_t, threshold, mode: str, activation: str):
    """The same in PyTorch: transformers' RMSNorm, the threshold method's reference MLP, the add."""
    from ._rmsnorm import rms_norm_ref  # (Triton: the kernels' modules load it)

    ref = mono_gated_mlp_ref if mode == "abs" else cats_gated_mlp_ref
    return h + ref(rms_norm_ref(h, norm_w, eps), w_gate, w_up, w_down_t, threshold, activation)


@torch.library.custom_op("countdown::gated_block", mutates_args=())
def _block_op(h: torch.Tensor, norm_w: torch.Tensor, eps: float, w_gate: torch.Tensor, w_up: torch.Tensor,
              w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, mode: str,
              activation: str) -> torch.Tensor:
    w_ind = w_up if mode == "abs" else w_gate
    return _norm_mlp_add(h, norm_w, eps, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation,
                         mode == "abs", mode != "abs", v=h, w_ind=w_ind)


def _norm_mlp_add(h, norm_w, eps, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up, v=None,
                  w_ind=None, ind=None):
    """The two launches of both ops: the one-launch kernel normalising h itself, then the partials' sum adding h."""
    from . import _onepass, _psum  # Triton: only where the kernels run

    p = _onepass.onepass_partials(h, v, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up,
                                  ind=ind, norm=(norm_w, eps))
    return _psum.sum_partials(p, h.dtype, residual=h)


@_block_op.register_fake
def _(h, norm_w, eps, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation):
    return torch.empty_like(h)


def threshold_block(h, norm_w, eps: float, w_gate, w_up, w_down_t, threshold, method: str,
                    activation: str) -> torch.Tensor | None:
    """h + mlp(RMSNorm(h)) for h [..., d_model] of one token, ``method`` "mono" or "cats" with its threshold
    (a float or a tensor, as mono_gated_mlp takes it), or None where :func:`applies` says no (the caller then
    runs the norm, the MLP and the add itself)."""
    mode = {"mono": "abs", "cats": "abs_act"}.get(method)
    if mode is None:
        raise ValueError(f"threshold_block serves 'mono' or 'cats', got {method!r}")
    d_model, _ = _common.check_mlp_args(h, w_gate, w_up, w_down_t)
    h2 = h.reshape(-1, d_model)
    if not _common.available(h2) or not applies(h2, mode):
        return None
    thr_t, thr_f = _common.split_threshold(threshold)
    out = torch.ops.countdown.gated_block(h2, norm_w, float(eps), w_gate, w_up, w_down_t, thr_t, thr_f, mode,
                                          activation)
    return out.reshape(h.shape)


def applies_given(h2: torch.Tensor, mode: str) -> bool:
    """Whether the block with the indicator given (:func:`given_block`) serves this residual for ``mode`` now:
    one token on the one-launch kernel, the method's indicator computed before it (CONFIGS[mode]["IND"])."""
    from . import _onepass, _psum

    return (_onepass.applies(h2) and _onepass.SPARSE_KERNEL == "onepass" and _onepass.indicator_outside(mode)
            and not _psum.use_tail(h2))


@torch.library.custom_op("countdown::gated_block_given", mutates_args=())
def _given_op(h: torch.Tensor, norm_w: torch.Tensor, eps: float, ind: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, mode: str,
              activation: str, gate: bool, up: bool) -> torch.Tensor:
    return _norm_mlp_add(h, norm_w, eps, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up, ind=ind)


@_given_op.register_fake
def _(h, norm_w, eps, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up):
    return torch.empty_like(h)


def given_block(h2, norm_w, eps: float, ind, w_gate, w_up, w_down_t, thr_t, thr_f: float, mode: str,
                activation: str, gate: bool = True, up: bool = True) -> torch.Tensor:
    """h2 + mlp(RMSNorm(h2)) for one token whose indicator ``ind`` [1, d_inter] (compared by ``mode`` with the
    threshold) was computed before, from RMSNorm(h2) (a predictor's GEMVs with the norm folded into the first,
    kernels/dual.py :func:`dual_block`): the norm in every program of the sparse kernel, the add in the partials'
    sum; two launches. The caller checks :func:`applies_given`."""
    return torch.ops.countdown.gated_block_given(h2, norm_w, float(eps), ind, w_gate, w_up, w_down_t, thr_t,
                                                 float(thr_f), mode, activation, gate, up)


def block_input(h, norm_w, eps: float) -> torch.Tensor:
    """RMSNorm(h) on the folded layer's norm kernel (kernels/_rmsnorm.py), for the block routes whose MLP needs
    x itself (a predictor's GEMV first); they then take ``residual=h`` for the add."""
    from . import _rmsnorm  # noqa: F401  (registers countdown::decode_rms_norm; Triton)

    return torch.ops.countdown.decode_rms_norm(h, norm_w, float(eps))
