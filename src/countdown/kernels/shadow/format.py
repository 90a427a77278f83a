"""Low-bit "shadow" copies of W_gate and W_up: the format and its plain-PyTorch reference maths.

Symmetric group-wise round-to-nearest (RTN) along d_model, for a weight ``w [N, K]`` and groups of
``group`` consecutive columns:

    qmax     = 2**(bits - 1) - 1                      (bits in 2, 3, 4, 8: qmax 1, 3, 7, 127)
    scale    = fp16( amax(|w| over the group) / qmax )  computed in float32, stored in float16;
                                                         an all-zero group gets scale 1
    q        = clamp(round(w / float32(scale)), -qmax, qmax)    int8
    w~       = q * scale                                (``dequantize``)

The shadow D-CountDown selector scores rows with ``u~ = x w~_up^T``, ``g~ = x w~_gate^T`` (float32)
and keeps rows with ``|u~ * act(g~)| > cut``; the MLP itself is then exact on the kept rows.

Storage (``pack_bits``): q + 2**(bits - 1) (offset binary, 1 .. 2**bits - 1) as a little-endian bit
stream per row: column k occupies bits [k * bits, (k + 1) * bits) of the row, byte b holds bits
8b .. 8b + 7. For 4 bits, byte b holds column 2b in its low nibble and 2b + 1 in its high nibble, so
a little-endian int32 word c holds columns 8c .. 8c + 7 at bits 4j (the GPU kernels' layout, see
``ops.prepare_shadow``).

Nothing here imports Triton: this module is used at calibration time and by the CPU path.
"""

from __future__ import annotations

import torch

from ..common import act_torch
from ..sparse_mlp.reference import gated_mlp_masked_ref

BITS = (2, 3, 4, 8)


def _check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return int(bits)


def quantize_rtn(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q int8 [N, K], scale float16 [N, K // group]).

    Symmetric round-to-nearest per group of ``group`` consecutive columns (see the module docstring);
    the scale is rounded to float16 before it divides w, so ``dequantize(q, scale)`` is the exact
    value the rounding aimed at."""
    bits = _check_bits(bits)
    if w.dim() != 2:
        raise ValueError(f"w must be a matrix [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if group < 1 or k % group:
        raise ValueError(f"K={k} columns are not a multiple of group={group}: pick a group size that "
                         f"divides K (e.g. 32, 64 or 128)")
    qmax = 2 ** (bits - 1) - 1
    wg = w.detach().float().reshape(n, k // group, group)
    amax = wg.abs().amax(dim=-1)
    scale = (amax / qmax).to(torch.float16)
    # amax / qmax can underflow float16 (tiny groups) or be 0: those groups get scale 1 and q from it
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wg / scale.float()[..., None]).clamp_(-qmax, qmax)
    return q.to(torch.int8).reshape(n, k), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int8 [N, K], scale float16 [N, K // group] -> w~ [N, K] in ``dtype`` (q * scale, computed in
    float32, exact there)."""
    n, k = q.shape
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"scale must be [N={n}, K / group] with K={k}, got {tuple(scale.shape)}")
    group = k // scale.shape[1]
    w = q.float().reshape(n, -1, group) * scale.float()[..., None]
    return w.reshape(n, k).to(dtype)


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q int8 [N, K] with |q| <= 2**(bits-1) - 1 -> uint8 [N, K * bits // 8] (bit stream per row)."""
    bits = _check_bits(bits)
    n, k = q.shape
    if (k * bits) % 8:
        raise ValueError(f"K * bits = {k} * {bits} is not a whole number of bytes: use K a multiple of 8")
    u = (q.to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
    if bits == 8:
        return u.contiguous()
    if bits in (2, 4):
        per = 8 // bits
        u = u.reshape(n, k // per, per)
        out = torch.zeros(n, k // per, dtype=torch.uint8, device=q.device)
        for j in range(per):
            out |= u[..., j] << (bits * j)
        return out
    # 3 bits: a bit stream; 8 values make 3 bytes
    u = u.reshape(n, k // 8, 8).to(torch.int32)
    word = torch.zeros(n, k // 8, dtype=torch.int32, device=q.device)
    for j in range(8):
        word |= u[..., j] << (3 * j)
    out = torch.stack([(word >> (8 * b)) & 0xFF for b in range(3)], dim=-1)
    return out.to(torch.uint8).reshape(n, k * 3 // 8)


def unpack_bits(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The inverse of ``pack_bits``: uint8 [N, K * bits // 8] -> int8 [N, K]."""
    bits = _check_bits(bits)
    if (k * bits) % 8:
        raise ValueError(f"K * bits = {k} * {bits} is not a whole number of bytes: use K a multiple of 8")
    n = packed.shape[0]
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k * bits // 8):
        raise ValueError(f"packed must be uint8 [N, {k * bits // 8}] for K={k} at {bits} bits, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    p = packed.to(torch.int32)
    if bits == 8:
        u = p
    elif bits in (2, 4):
        per, mask = 8 // bits, (1 << bits) - 1
        u = torch.stack([(p >> (bits * j)) & mask for j in range(per)], dim=-1).reshape(n, k)
    else:
        p = p.reshape(n, k // 8, 3)
        word = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)
        u = torch.stack([(word >> (3 * j)) & 7 for j in range(8)], dim=-1).reshape(n, k)
    return (u - 2 ** (bits - 1)).to(torch.int8)


def shadow_scores_ref(x, q_gate, s_gate, q_up, s_up, activation: str = "silu"):
    """x [..., K] -> (u~, g~) [..., N] in float32: x (as float32) times the dequantized shadows.

    ``activation`` is accepted for symmetry with the other shadow functions and not used here."""
    xf = x.float()
    return xf @ dequantize(q_up, s_up).t(), xf @ dequantize(q_gate, s_gate).t()


def shadow_score(u_t: torch.Tensor, g_t: torch.Tensor, activation: str) -> torch.Tensor:
    """|u~ * act(g~)| in float32 (the activation computed in float32)."""
    return (u_t.float() * act_torch(g_t.float(), activation)).abs()


def shadow_keep_ref(x, q_gate, s_gate, q_up, s_up, cut, activation: str = "silu") -> torch.Tensor:
    """keep [..., N] bool: |u~ * act(g~)| > cut, compared in float32 (cut a float or 0-dim tensor)."""
    u_t, g_t = shadow_scores_ref(x, q_gate, s_gate, q_up, s_up)
    score = shadow_score(u_t, g_t, activation)
    if isinstance(cut, torch.Tensor):
        cut = cut.to(device=score.device, dtype=torch.float32)
    return score > cut


def shadow_dual_gated_mlp_ref(x, q_gate, s_gate, q_up, s_up, cut, w_gate, w_up, w_down_t,
                              activation: str = "silu") -> torch.Tensor:
    """The exact Gated-MLP at x's precision on the rows the shadows keep (others contribute 0)."""
    keep = shadow_keep_ref(x, q_gate, s_gate, q_up, s_up, cut, activation)
    return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation)


def shadow_bytes(d_inter: int, d_model: int, bits: int, group: int) -> int:
    """Bytes the two shadows (gate and up) occupy and a scoring pass reads: packed integers plus the
    float16 scales."""
    bits = _check_bits(bits)
    return 2 * (d_inter * d_model * bits // 8 + d_inter * (d_model // group) * 2)
