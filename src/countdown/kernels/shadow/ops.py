"""D-CountDown with a low-bit shadow indicator: score rows from 4-bit copies of W_gate and W_up, then
compute the exact Gated-MLP on the kept rows only.

    u~, g~  = x Q_up^T, x Q_gate^T                     (format.py's RTN shadows, fp32)
    keep    = |u~ * act(g~)| > cut                      (cut: float32, a 0-dim tensor or a float)
    y       = sum over kept rows i of (x W_up[i]^T) act(x W_gate[i]^T) w_down_t[i]   (x's precision)

Bytes read per token: the two shadows (``format.shadow_bytes``) plus 3 d_model x 2 bytes per kept row. The routes
(route.py, kind "shadow"): one token on CUDA, ``gemv.py``'s kernel writes the indicator |u~ act(g~)| (x rounded to
int8 per weight group, integer dot products: error bound in its docstring) and sparse_mlp/one_token.py's kernel
computes the kept rows in one launch. For 2-8 tokens the selecting kernel (sparse_mlp/select.py, fp32 products)
computes the shadow GEMVs, the cut and the kept rows of the three full-precision matrices (the union of the batch's
kept rows, each token's own rows nonzero only) and the masked down projection runs after; beyond 8 tokens
(prefill) the shadow scores come from it and the chain does the rest. Off CUDA (the interpreter) one token takes
the selecting kernel's one-launch form, whose fp32 scores are exactly the reference's.

GPU format (``prepare_shadow``): 4 bits (the default) or 8 bits, group * bits / 32 a power of two
(groups of 32, 64, 128 at 4 bits). Other widths (2, 3 bits) and groups run the float32 reference
(correct, not fast). Built once when a model is sparsified, on the model's device. ``count`` = (kept, rows):
the kernel that keeps the rows adds them to a patched layer's Sparsity-Real counters.
"""

from __future__ import annotations

import torch

from ..common import check_mlp_args, count_keep, op_counters, plus, split_threshold, threshold_value
from ..route import route
from ..sparse_mlp.ops import masked_gated_mlp
from ..sparse_mlp.reference import gated_mlp_masked_ref
from .format import pack_bits, shadow_score, shadow_scores_ref, unpack_bits


def prepare_shadow(q_gate, s_gate, q_up, s_up, bits: int = 4) -> dict[str, torch.Tensor]:
    """The kernel layout of the two shadows (q int8 [d_inter, d_model], s float16 [d_inter, d_model /
    group], from ``format.quantize_rtn``) -> {"q", "scale"}:

    * ``q``: 4 and 8 bits, int32 [d_inter, 2, d_model * bits / 32]: row i's gate words then its up
      words, side by side (one contiguous read per row); word c holds columns 32c/bits .. as packed
      by ``format.pack_bits``. Other widths (or groups the GPU path does not take): int8 [d_inter, 2,
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
    """(q_gate, s_gate, q_up, s_up) in format.py's format from ``prepare_shadow``'s output."""
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


def _words_here(x, q) -> bool:
    """Whether the shadows are in the kernels' layout (int32 words, 4 or 8 bits) on x's device."""
    return q.dtype == torch.int32 and q.device == x.device


def _gemv_fits(x2, q, scale) -> bool:
    """Whether gemv.py's kernel takes these shadow words (4 or 8 bits, whole words a group, a power of two)."""
    d_model = x2.shape[1]
    bits = 32 * q.shape[2] // d_model
    wpg = q.shape[2] // scale.shape[2]
    return bits in (4, 8) and q.shape[2] * 32 == d_model * bits and q.shape[2] % scale.shape[2] == 0 \
        and wpg >= 1 and (wpg & (wpg - 1)) == 0


def _scores(x2, q, scale, activation: str | None):
    """The shadows' scores on the kernels: (u~, g~) [2, T, d_inter], or with ``activation`` |u~ act(g~)| [T,
    d_inter] (fp32). One token: gemv.py's kernel where the words fit it, else the selecting kernel's fp32 scores."""
    from ..sparse_mlp import select  # noqa: F401  (Triton: registers countdown::shadow_scores)
    from . import gemv  # noqa: F401  (registers countdown::shadow_gemv_i8)

    if route("shadow_scores", x2) == "shadow_gemv" and _gemv_fits(x2, q, scale):
        return torch.ops.countdown.shadow_gemv_i8(x2, q, scale, activation or "silu", activation is not None)
    o = torch.ops.countdown.shadow_scores(x2, q, scale)
    return o if activation is None else shadow_score(o[0], o[1], activation)


def shadow_scores(x, prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d_model] -> (u~, g~) float32 [..., d_inter] (the two shadow GEMVs alone). One token on the kernels:
    gemv.py's kernel (x rounded to int8; error bound in its docstring); otherwise float32 products
    (sparse_mlp/select.py); the reference where the kernels do not run or the shadows are not in their layout."""
    q, scale = _check(x, prepared)
    x2 = x.reshape(-1, x.shape[-1])
    if not _words_here(x, q) or route("shadow_scores", x2) == "reference":
        qg, sg, qu, su = unpack_prepared(prepared, x.shape[-1])
        return shadow_scores_ref(x, qg, sg, qu, su)
    o = _scores(x2, q, scale, None)
    lead = x.shape[:-1]
    return o[0].reshape(*lead, -1), o[1].reshape(*lead, -1)


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
    x2 = x.reshape(-1, d_model)
    kernel = route("shadow", x2) if _words_here(x, q) else "reference"
    if kernel == "reference":
        return plus(_prepared_ref(x, prepared, cut, w_gate, w_up, w_down_t, activation, count), residual)
    cut_t, cut_f = split_threshold(cut)
    if cut_t is not None and cut_t.dim() != 0:
        raise ValueError("the shadow cut is one value per layer (a 0-dim tensor or a float)")
    from ..sparse_mlp import partial_sums

    if kernel == "one_token":  # the indicator |u~ act(g~)| from the scores' route, then the kept rows in one launch
        from ..sparse_mlp import one_token

        y = one_token.one_token_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation, gate=True, up=True,
                                    ind=_scores(x2, q, scale, activation), residual=residual, count=count)
        return y.reshape(x.shape)
    if kernel == "select":  # one launch scores, cuts and computes the kept rows (one token: its partials summed)
        from ..sparse_mlp import select  # noqa: F401  (registers the select ops)

        args = (x2, q, scale, None, None, None, None, cut_t, cut_f, w_gate, w_up, w_down_t, activation,
                *op_counters(count, x.device))
        if x2.shape[0] == 1:
            return partial_sums.reduce(torch.ops.countdown.select_one_token(*args), x2, residual).reshape(x.shape)
        y = torch.ops.countdown.select_few_tokens(*args)
        return partial_sums.add_residual(y, residual).reshape(x.shape)
    # "scores_chain" (a prompt): the scores, the cut in PyTorch, the masked chain
    u_t, g_t = _scores(x2, q, scale, None)
    keep = shadow_score(u_t, g_t, activation) > threshold_value(cut_t, cut_f, u_t)
    y = masked_gated_mlp(x2, w_gate, w_up, w_down_t, keep, activation, count=count)
    return partial_sums.add_residual(y, residual).reshape(x.shape)
