"""A nested 8-bit weight (``int4/nested.py``) de-quantized in one pass: ``W8 = W~h + W~l`` in the compute dtype.

What a nested Linear's calls of many tokens (a prompt) run before ``F.linear`` on the GPU. The format's reference
(``NestedWeight.dequantize("both")``) de-quantizes each plane in eager PyTorch (unpack, an fp32 copy, scale, offset),
adds them and casts: about ten passes over tensors up to eight times the codes' bytes. Here each program reads a tile
of both planes' codes with their groups' scales and offsets once and writes the tile of W8 once, with the format's
arithmetic: ``fl32(fl32(fl32(sh h) + oh) + fl32(fl32(sl l) + ol))`` (each multiply and add rounded: the launch turns
off the compiler's fused multiply-add), rounded to nearest in the output dtype once. The low plane is laid out as the
high one, or transposed (W_down's: codes ``[K, N / 2]`` packed along N, scales and offsets ``[K / G, N]``). Bit for
bit the reference (tests/test_int4_nested_dequant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import new_output
from ..config import launch_config, launching
from ..jit_helpers import round_to
from .dequant import DTYPES


@triton.jit
def _plane(QW, SC, OF, r, cols, m, half, n_groups, GB: tl.constexpr):
    """fp32 (low-nibble columns, high-nibble columns) of a plane laid out as int4/format.py's, rows r, bytes cols."""
    b = tl.load(QW + r * half + cols[None, :], mask=m, other=0).to(tl.int32)
    g = r * n_groups + (cols // GB)[None, :]
    sc = tl.load(SC + g, mask=m, other=0.0).to(tl.float32)
    of = tl.load(OF + g, mask=m, other=0.0).to(tl.float32)
    return (b & 15).to(tl.float32) * sc + of, (b >> 4).to(tl.float32) * sc + of


@triton.jit
def _plane_t(QT, SCT, OFT, rows, k, m, n_rows, group):
    """fp32 values of a transposed plane at rows ``rows`` (of N) and columns ``k`` (of K): the code of (n, k) is
    nibble n % 2 of byte QT[k, n // 2], its scale and offset SCT / OFT[k // group, n]."""
    kk = k.to(tl.int64)[None, :]
    r = rows.to(tl.int64)[:, None]
    b = tl.load(QT + kk * (n_rows // 2) + r // 2, mask=m, other=0).to(tl.int32)
    q = (b >> ((r % 2) * 4).to(tl.int32)) & 15
    g = (kk // group) * n_rows + r
    sc = tl.load(SCT + g, mask=m, other=0.0).to(tl.float32)
    of = tl.load(OFT + g, mask=m, other=0.0).to(tl.float32)
    return q.to(tl.float32) * sc + of


@triton.jit
def nested_dequant_kernel(HQ, HS, HO, LQ, LS, LO, OUT, n_rows, half, n_groups, group, GB: tl.constexpr,
                          TRANSPOSED: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.program_id(1) * BB + tl.arange(0, BB)   # bytes: columns 2 cols (low nibble) and 2 cols + 1 (high)
    m = (rows < n_rows)[:, None] & (cols < half)[None, :]
    r = rows.to(tl.int64)[:, None]
    h_lo, h_hi = _plane(HQ, HS, HO, r, cols, m, half, n_groups, GB)
    if TRANSPOSED:
        l_lo = _plane_t(LQ, LS, LO, rows, 2 * cols, m, n_rows, group)
        l_hi = _plane_t(LQ, LS, LO, rows, 2 * cols + 1, m, n_rows, group)
    else:
        l_lo, l_hi = _plane(LQ, LS, LO, r, cols, m, half, n_groups, GB)
    DT: tl.constexpr = OUT.dtype.element_ty
    w = tl.reshape(tl.join(round_to(h_lo + l_lo, DT), round_to(h_hi + l_hi, DT)), (BN, 2 * BB))   # columns in order
    c2 = 2 * tl.program_id(1) * BB + tl.arange(0, 2 * BB)
    tl.store(OUT + r * (2 * half) + c2[None, :], w.to(DT), mask=(rows < n_rows)[:, None] & (c2 < 2 * half)[None, :])


def dequantize_both(weight, dtype: torch.dtype) -> torch.Tensor:
    """``W8 [N, K]`` in ``dtype`` (bf16, fp16 or fp32) of a :class:`~countdown.int4.nested.NestedWeight` (its low
    plane as the high one or transposed): ``weight.dequantize("both", dtype)``'s bits. Launch configuration:
    config.LAUNCH["int4_dequant"] (BN rows and BB packed bytes a program). (Spy hook:
    ``on_launch("int4_nested_dequant", high qweight)``.)"""
    if dtype not in DTYPES:
        raise ValueError(f"the nested de-quantization writes one of {DTYPES}, got {dtype}")
    high = weight.high
    n, half = high.qweight.shape
    n_groups = high.scale.shape[1]
    out = new_output((n, 2 * half), dtype, high.qweight.device)
    cfg = launch_config("int4_dequant", high.qweight.device)
    BN, BB = cfg["BN"], cfg["BB"]
    launching("int4_nested_dequant", high.qweight)
    nested_dequant_kernel[(triton.cdiv(n, BN), triton.cdiv(half, BB))](
        *(t.contiguous() for t in (high.qweight, high.scale, high.offset, weight.low_qweight, weight.low_scale,
                                   weight.low_offset)), out, n, half, n_groups, weight.group, GB=half // n_groups,
        TRANSPOSED=bool(weight.low_transposed), BN=BN, BB=BB, num_warps=4, enable_fp_fusion=False)
    return out
