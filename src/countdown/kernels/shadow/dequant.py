"""Triton helpers: the shadows' words dequantized to fp32 without conversions (phase 1 of sparse_mlp/select.py).

For prepared shadows (``ops.prepare_shadow``: int32 words [d_inter, 2, W], gate then up words of a row side by side,
fp16 group scales [d_inter, 2, G]) a little-endian word holds 32 / BITS values, value j at bits
[j BITS, (j + 1) BITS), stored as n = q + 2**(BITS-1). For a value at bit position p <= 23 - BITS,
(word & (mask << p)) | 0x4B000000 read as fp32 is 2**23 + n 2**p exactly, so subtracting the constant
2**23 + 2**(BITS-1) 2**p leaves q 2**p exactly: one integer op (and-or, a LOP3) and one float add per value, no
int-to-float conversion (quarter rate on the GPU). Values above bit 23 - BITS come from the word shifted right once
(12 bits for 4-bit, 16 for 8-bit). The 2**p is folded into x: the kernel multiplies by x[j] 2**-p (exact,
:func:`x_scaled`). Products q x are exact in fp32 for bf16/fp16 x; the sums run in fp32, per word then times the
group's fp16 scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dequant(w, J: tl.constexpr, BITS: tl.constexpr):
    """q * 2**p (fp32, exact) of value J of each int32 word (see the module docstring)."""
    P: tl.constexpr = J * BITS
    if P + BITS <= 23:
        src = w
        POS: tl.constexpr = P
    else:
        SHIFT: tl.constexpr = 12 if BITS == 4 else 16
        src = w >> SHIFT
        POS: tl.constexpr = P - SHIFT
    MASK: tl.constexpr = ((1 << BITS) - 1) << POS
    MAGIC: tl.constexpr = 8388608.0 + float((1 << (BITS - 1)) << POS)
    v = ((src & MASK) | 0x4B000000).to(tl.float32, bitcast=True)
    return v - MAGIC


@triton.jit
def load_tile(Q, SC, qbase, sbase, g0, rmask, n_words, n_groups,
               GPT: tl.constexpr, WPG: tl.constexpr):
    grp = g0 + tl.arange(0, GPT)
    gm = grp < n_groups
    col = grp[:, None] * WPG + tl.arange(0, WPG)[None, :]
    m3 = rmask[:, None, None] & gm[None, :, None]
    off = qbase[:, None, None] + col[None, :, :]
    wg = tl.load(Q + off, mask=m3, other=0)
    wu = tl.load(Q + off + n_words, mask=m3, other=0)
    m2 = rmask[:, None] & gm[None, :]
    soff = sbase[:, None] + grp[None, :]
    sg = tl.load(SC + soff, mask=m2, other=0.0)
    su = tl.load(SC + soff + n_groups, mask=m2, other=0.0)
    return wg, wu, sg, su


@triton.jit
def bases(rows, n_words, n_groups, BIG: tl.constexpr):
    """Offsets of rows' gate words and gate scales (up follows each: + n_words, + n_groups)."""
    if BIG:
        qbase = rows.to(tl.int64) * (2 * n_words)
    else:
        qbase = rows * (2 * n_words)
    return qbase, rows * (2 * n_groups)


@triton.jit
def tile_scores(wg, wu, sg, su, XS, g0, tok0, n_tok, n_words, n_groups,
                 BITS: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr, GPT: tl.constexpr,
                 WPG: tl.constexpr):
    """This tile's part of (u~, g~), [BT, ROWS] fp32. XS [T, VPW, n_words] fp32 holds x[c VPW + j]
    2**-p_j at [t, j, c] (:func:`x_scaled` writes it): contiguous loads, no conversion."""
    VPW: tl.constexpr = 32 // BITS
    bi = tl.arange(0, BT)
    sgf = sg.to(tl.float32)
    suf = su.to(tl.float32)
    grp = g0 + tl.arange(0, GPT)
    wcol = grp[:, None] * WPG + tl.arange(0, WPG)[None, :]
    xm = (grp < n_groups)[:, None] & (tl.arange(0, WPG) < WPG)[None, :]
    acc_g = tl.zeros([BT, ROWS], dtype=tl.float32)
    acc_u = tl.zeros([BT, ROWS], dtype=tl.float32)
    for b in tl.static_range(BT):
        xok = xm & (wcol * 0 + tok0 + b < n_tok)  # a tensor: the interpreter takes no scalar in a mask
        pg = tl.zeros([ROWS, GPT, WPG], dtype=tl.float32)
        pu = tl.zeros([ROWS, GPT, WPG], dtype=tl.float32)
        for j in tl.static_range(VPW):
            xj = tl.load(XS + ((tok0 + b) * VPW + j) * n_words + wcol, mask=xok, other=0.0)[None, :, :]
            pg += dequant(wg, j, BITS) * xj
            pu += dequant(wu, j, BITS) * xj
        part_g = tl.sum(tl.sum(pg, axis=2) * sgf, axis=1)
        part_u = tl.sum(tl.sum(pu, axis=2) * suf, axis=1)
        if BT == 1:
            acc_g += part_g[None, :]
            acc_u += part_u[None, :]
        else:
            acc_g = tl.where(bi[:, None] == b, acc_g + part_g[None, :], acc_g)
            acc_u = tl.where(bi[:, None] == b, acc_u + part_u[None, :], acc_u)
    return acc_u, acc_g


@triton.jit
def fp32_scores(XS, Q, SC, rows, rmask, tok0, n_tok, n_words, n_groups,
                 BITS: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr, GPT: tl.constexpr,
                 WPG: tl.constexpr, BIG: tl.constexpr):
    """(u~, g~) [BT, ROWS] fp32 for tokens tok0 .. tok0 + BT of the rows ``rows``, tile after tile."""
    qbase, sbase = bases(rows, n_words, n_groups, BIG)
    acc_g = tl.zeros([BT, ROWS], dtype=tl.float32)
    acc_u = tl.zeros([BT, ROWS], dtype=tl.float32)
    for g0 in range(0, n_groups, GPT):
        wg, wu, sg, su = load_tile(Q, SC, qbase, sbase, g0, rmask, n_words, n_groups, GPT, WPG)
        pu, pg = tile_scores(wg, wu, sg, su, XS, g0, tok0, n_tok, n_words, n_groups, BITS, BT, ROWS, GPT, WPG)
        acc_u += pu
        acc_g += pg
    return acc_u, acc_g


_XSCALE: dict = {}  # the 2**-p of each value position, by (device, bits): made once


def x_scaled(x: torch.Tensor, bits: int) -> torch.Tensor:
    """XS [T, VPW, d_model / VPW] fp32: XS[t, j, c] = x[t, c VPW + j] 2**-p_j, p_j the bit position
    value j of a word is dequantized at (:func:`dequant`). One small elementwise kernel."""
    vpw = 32 // bits
    key = (x.device, bits)
    if key not in _XSCALE:
        pos = [j * bits if j * bits + bits <= 23 else j * bits - (12 if bits == 4 else 16) for j in range(vpw)]
        _XSCALE[key] = torch.tensor([2.0**-p for p in pos], dtype=torch.float32, device=x.device)
    n_tok, d_model = x.shape
    xs = torch.empty((n_tok, vpw, d_model // vpw), dtype=torch.float32, device=x.device)
    torch.mul(x.reshape(n_tok, d_model // vpw, vpw).transpose(1, 2), _XSCALE[key][:, None], out=xs)
    return xs
