"""D-CountDown with a low-bit shadow indicator: score rows from 4-bit copies of W_gate and W_up, then
compute the exact Gated-MLP on the kept rows only.

    u~, g~  = x Q_up^T, x Q_gate^T                     (quant.py's RTN shadows, fp32)
    keep    = |u~ * act(g~)| > cut                      (cut: float32, a 0-dim tensor or a float)
    y       = sum over kept rows i of (x W_up[i]^T) act(x W_gate[i]^T) w_down_t[i]   (x's precision)

Bytes read per token: the two shadows (``quant.shadow_bytes``) plus 3 d_model x 2 bytes per kept row. One token
on CUDA: ``_gemv_i8.py``'s kernel writes the indicator |u~ act(g~)| (x rounded to int8 per weight group, integer
dot products: error bound in its docstring; fewer instructions a word than a float dequantization, so nearer the
copy bandwidth) and ``_onepass.py``'s kernel computes the kept rows in one launch. For 2-8 tokens the selecting
kernel (``_select.py``, fp32 products) computes the shadow GEMVs, the cut and the kept rows of the three
full-precision matrices (the union of the batch's kept rows, each token's own rows nonzero only) and the masked
down projection runs after; beyond 8 tokens (prefill) the shadow scores come from it and the masked kernel
(masked.py) does the rest. Off CUDA (the interpreter) one token takes the selecting kernel's one-launch form,
whose fp32 scores are exactly the reference's.

GPU format (``prepare_shadow``): 4 bits (the default) or 8 bits, group * bits / 32 a power of two
(groups of 32, 64, 128 at 4 bits). Other widths (2, 3 bits) and groups run the float32 reference
(correct, not fast). Built once when a model is sparsified, on the model's device. ``count`` = (kept, rows):
the kernel that keeps the rows adds them to a patched layer's Sparsity-Real counters (_count.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import (available, check_mlp_args, count_keep, op_count, op_counters, plus,
                      split_threshold, threshold_value)
from .masked import gated_mlp_masked_ref, masked_gated_mlp
from .quant import pack_bits, shadow_score, shadow_scores_ref, unpack_bits

MAX_FUSED_TOKENS = 8


def prepare_shadow(q_gate, s_gate, q_up, s_up, bits: int = 4) -> dict[str, torch.Tensor]:
    """The kernel layout of the two shadows (q int8 [d_inter, d_model], s float16 [d_inter, d_model /
    group], from ``quant.quantize_rtn``) -> {"q", "scale"}:

    * ``q``: 4 and 8 bits, int32 [d_inter, 2, d_model * bits / 32]: row i's gate words then its up
      words, side by side (one contiguous read per row); word c holds columns 32c/bits .. as packed
      by ``quant.pack_bits``. Other widths (or groups the GPU path does not take): int8 [d_inter, 2,
      d_model] unpacked, for the reference path.
    * ``scale``: float16 [d_inter, 2, d_model / group], gate then up.

    Move it with the model (``{k: v.to(device)}``); bits and group are read back from the shapes."""
    if q_gate.shape != q_up.shape or s_gate.shape != s_up.shape or q_gate.dim() != 2 \
            or s_gate.shape[0] != q_gate.shape[0] or q_gate.shape[1] % s_gate.shape[1]:
        raise ValueError(f"shadows must be q [d_inter, d_model] int8 and scale [d_inter, d_model / group], "
                         f"the same for gate and up; got q {tuple(q_gate.shape)}, {tuple(q_up.shape)} and "
                         f"scale {tuple(s_gate.shape)}, {tuple(s_up.shape)}")
    scale = torch.stack([s_gate, s_up], dim=1).to(torch.float16).contiguous()
    if gpu_layout(q_gate.shape[1], q_gate.shape[1] // s_gate.shape[1], bits):
        words = [pack_bits(q, bits).view(torch.int32) for q in (q_gate, q_up)]
        return {"q": torch.stack(words, dim=1).contiguous(), "scale": scale}
    return {"q": torch.stack([q_gate, q_up], dim=1).to(torch.int8).contiguous(), "scale": scale}


def gpu_layout(d_model: int, group: int, bits: int) -> bool:
    """Whether the kernel takes this shadow (else the reference path runs)."""
    wpg = group * bits / 32
    return bits in (4, 8) and d_model % group == 0 and wpg == int(wpg) and wpg >= 1 \
        and (int(wpg) & (int(wpg) - 1)) == 0


def unpack_prepared(prepared: dict, d_model: int):
    """(q_gate, s_gate, q_up, s_up) in quant.py's format from ``prepare_shadow``'s output."""
    q, scale = prepared["q"], prepared["scale"]
    if q.dtype == torch.int8:
        qg, qu = q[:, 0], q[:, 1]
    else:
        bits = 32 * q.shape[2] // d_model
        qg, qu = (unpack_bits(q[:, i].contiguous().view(torch.uint8), bits, d_model) for i in (0, 1))
    return qg, scale[:, 0], qu, scale[:, 1]


def _check(x, prepared):
    q, scale = prepared["q"], prepared["scale"]
    d_model = x.shape[-1]
    if q.dim() != 3 or q.shape[1] != 2 or scale.dim() != 3 or scale.shape[:2] != q.shape[:2] \
            or d_model % scale.shape[2]:
        raise ValueError(f"prepared shadows must come from prepare_shadow for d_model={d_model}, got q "
                         f"{tuple(q.shape)} {q.dtype} and scale {tuple(scale.shape)}")
    return q, scale


def _fast(x, q) -> bool:
    return q.dtype == torch.int32 and available(x) and q.device == x.device


def _one_token_gemv(x2, q, scale) -> bool:
    """Whether _gemv_i8.py's kernel takes these shadow GEMVs (one token, 4 or 8 bits, whole words a group)."""
    if x2.shape[0] != 1:
        return False
    d_model = x2.shape[1]
    bits = 32 * q.shape[2] // d_model
    return bits in (4, 8) and q.shape[2] * 32 == d_model * bits and q.shape[2] % scale.shape[2] == 0 \
        and _pow2_ok(q.shape[2] // scale.shape[2])


def _pow2_ok(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def shadow_scores(x, prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d_model] -> (u~, g~) float32 [..., d_inter] (the two shadow GEMVs alone). One token
    on the fast path: _gemv_i8.py's kernel (x rounded to int8; error bound in its docstring); otherwise
    float32 products (_select.py)."""
    q, scale = _check(x, prepared)
    if not _fast(x, q):
        qg, sg, qu, su = unpack_prepared(prepared, x.shape[-1])
        return shadow_scores_ref(x, qg, sg, qu, su)
    x2 = x.reshape(-1, x.shape[-1])
    if _one_token_gemv(x2, q, scale):
        o = torch.ops.countdown.shadow_gemv_i8(x2, q, scale, "silu", False)
    else:
        o = torch.ops.countdown.shadow_scores(x2, q, scale)
    lead = x.shape[:-1]
    return o[0].reshape(*lead, -1), o[1].reshape(*lead, -1)


def _onepass_applies(x2) -> bool:
    from . import _onepass

    return _onepass.applies(x2)


def _reduce(p: torch.Tensor, x2: torch.Tensor, residual=None) -> torch.Tensor:
    """y [1, d_model] in x's dtype from one-token fp32 partials (kernels/_psum.py), plus ``residual``."""
    from . import _psum

    return _psum.reduce(p, x2, residual)


def _added(y: torch.Tensor, residual) -> torch.Tensor:
    from . import _psum

    return _psum.add_residual(y, residual)


def _prepared_ref(x, prepared, cut, w_gate, w_up, w_down_t, activation: str = "silu", count=None):
    """Plain PyTorch: the reference scores (float32), the cut, the masked MLP at x's precision."""
    qg, sg, qu, su = unpack_prepared(prepared, x.shape[-1])
    u_t, g_t = shadow_scores_ref(x, qg.to(x.device), sg.to(x.device), qu.to(x.device), su.to(x.device))
    thr_t, thr_f = split_threshold(cut)
    keep = shadow_score(u_t, g_t, activation) > threshold_value(thr_t, thr_f, u_t)
    count_keep(count, keep)
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation)


def shadow_dual_gated_mlp(x, prepared, cut, w_gate, w_up, w_down_t, activation: str = "silu",
                          residual=None, count=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model] in x's dtype; ``prepared`` from ``prepare_shadow``; cut a
    0-dim float32 tensor (read on the device, no host sync) or a float; w_down_t = W_down^T
    [d_inter, d_model] contiguous, like w_gate and w_up. With ``residual`` (x's shape and dtype: a folded
    layer's h) residual + y, the add inside the partials' sum on the one-token routes; with ``count`` =
    (kept, rows) the kept rows added to a patched layer's Sparsity-Real counters."""
    d_model, d_inter = check_mlp_args(x, w_gate, w_up, w_down_t)
    q, scale = _check(x, prepared)
    if q.shape[0] != d_inter:
        raise ValueError(f"the shadows have {q.shape[0]} rows, the MLP d_inter={d_inter}")
    if not _fast(x, q):
        return plus(_prepared_ref(x, prepared, cut, w_gate, w_up, w_down_t, activation, count), residual)
    kept, rows = op_counters(count, x.device)
    cut_t, cut_f = split_threshold(cut)
    if cut_t is not None and cut_t.dim() != 0:
        raise ValueError("the shadow cut is one value per layer (a 0-dim tensor or a float)")
    x2 = x.reshape(-1, d_model)
    n_tok = x2.shape[0]
    if n_tok == 1 and _onepass_applies(x2):
        from . import _onepass

        if _one_token_gemv(x2, q, scale):  # the indicator |u~ act(g~)| straight from the GEMV kernel
            ind = torch.ops.countdown.shadow_gemv_i8(x2, q, scale, activation, True)
        else:
            u_t, g_t = shadow_scores(x2, prepared)
            ind = shadow_score(u_t, g_t, activation)
        y = _onepass.onepass_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation, gate=True, up=True,
                                 ind=ind, residual=residual, count=count)
        return y.reshape(x.shape)
    if n_tok == 1:  # off CUDA: the selecting kernel in one launch (exact fp32 scores), its partials summed
        p = torch.ops.countdown.select_partials(x2, q, scale, None, None, None, None, cut_t, cut_f,
                                                w_gate, w_up, w_down_t, activation, kept, rows)
        return _reduce(p, x2, residual).reshape(x.shape)
    if n_tok <= MAX_FUSED_TOKENS:
        y = torch.ops.countdown.select_gated_mlp(x2, q, scale, None, None, None, None, cut_t, cut_f,
                                                 w_gate, w_up, w_down_t, activation, kept, rows)
        return _added(y, residual).reshape(x.shape)
    u_t, g_t = shadow_scores(x2, prepared)
    keep = shadow_score(u_t, g_t, activation) > threshold_value(cut_t, cut_f, u_t)
    y = masked_gated_mlp(x2, w_gate, w_up, w_down_t, keep, activation, count=count)
    return _added(y, residual).reshape(x.shape)


# ------------------------------------------------------------------ the custom ops (shadow and hybrid)
@torch.library.custom_op("countdown::shadow_scores", mutates_args=())
def _scores_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from . import _select

    return _select.launch(x, "shadow", "scores", None, 0.0, "silu", q=q, scale=scale)


@_scores_op.register_fake
def _(x, q, scale):
    return x.new_empty((2, x.shape[0], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("countdown::shadow_gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, activation: str, score: bool) -> torch.Tensor:
    """One token: (u~, g~) as [2, 1, d_inter] fp32, or (score) |u~ act(g~)| as [1, d_inter] fp32, with x in fp16
    pairs (kernels/_gemv.py; the routes take countdown::shadow_gemv_i8)."""
    from . import _gemv

    return _gemv.launch(x, q, scale, activation if score else None)


def _gemv_fake(x, q, scale, activation, score):
    shape = (1, q.shape[0]) if score else (2, 1, q.shape[0])
    return x.new_empty(shape, dtype=torch.float32)


_gemv_op.register_fake(_gemv_fake)


@torch.library.custom_op("countdown::shadow_gemv_i8", mutates_args=())
def _gemv_i8_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, activation: str, score: bool) -> torch.Tensor:
    """As countdown::shadow_gemv, with x rounded to int8 per weight group (kernels/_gemv_i8.py)."""
    from . import _gemv_i8

    return _gemv_i8.launch(x, q, scale, activation if score else None)


_gemv_i8_op.register_fake(_gemv_fake)


def _select_args(q, scale, u, latent, bt, bias, w_gate, w_up, w_down_t):
    kind = "shadow" if q is not None else "hybrid"
    return kind, dict(q=q, scale=scale, u=u, latent=latent, bt=bt, bias=bias, w_gate=w_gate, w_up=w_up,
                      w_down_t=w_down_t)


@torch.library.custom_op("countdown::select_partials", mutates_args=("kept", "rows"))
def _partials_op(x: torch.Tensor, q: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                 u: Optional[torch.Tensor], latent: Optional[torch.Tensor], bt: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], cut_t: Optional[torch.Tensor], cut_f: float,
                 w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down_t: torch.Tensor,
                 activation: str, kept: Optional[torch.Tensor] = None,
                 rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token: fp32 partial sums P [programs, d_model] of the shadow (q given) or hybrid MLP."""
    from . import _select

    kind, args = _select_args(q, scale, u, latent, bt, bias, w_gate, w_up, w_down_t)
    return _select.launch(x, kind, "partials", cut_t, cut_f, activation, count=op_count(kept, rows), **args)


@_partials_op.register_fake
def _(x, q, scale, u, latent, bt, bias, cut_t, cut_f, w_gate, w_up, w_down_t, activation, kept=None, rows=None):
    from . import _select

    kind = "shadow" if q is not None else "hybrid"
    progs = _select.n_programs(x.device, w_gate.shape[0], _select.config(kind, 1))
    return x.new_empty((progs, x.shape[1]), dtype=torch.float32)


@torch.library.custom_op("countdown::select_gated_mlp", mutates_args=("kept", "rows"))
def _mlp_op(x: torch.Tensor, q: Optional[torch.Tensor], scale: Optional[torch.Tensor],
            u: Optional[torch.Tensor], latent: Optional[torch.Tensor], bt: Optional[torch.Tensor],
            bias: Optional[torch.Tensor], cut_t: Optional[torch.Tensor], cut_f: float,
            w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down_t: torch.Tensor,
            activation: str, kept: Optional[torch.Tensor] = None,
            rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """2-8 tokens: s of the batch's kept rows (the selecting kernel), then the masked down projection."""
    from . import _select
    from ._down import sparse_down

    kind, args = _select_args(q, scale, u, latent, bt, bias, w_gate, w_up, w_down_t)
    s = _select.launch(x, kind, "s", cut_t, cut_f, activation, count=op_count(kept, rows), **args).to(x.dtype)
    return sparse_down(s, None, w_down_t)


@_mlp_op.register_fake
def _(x, q, scale, u, latent, bt, bias, cut_t, cut_f, w_gate, w_up, w_down_t, activation, kept=None, rows=None):
    return torch.empty_like(x)
