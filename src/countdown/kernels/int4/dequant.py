"""A 4-bit weight (``int4/format.py``) de-quantized in one pass: ``W~`` in the compute dtype.

What a 4-bit Linear's calls of many tokens (a prompt) run before ``F.linear`` on the GPU. The format's reference
(``format.dequantize``, eager PyTorch) unpacks the codes to uint8, converts them to an fp32 copy and scales and
offsets it in place before the cast: five passes over tensors up to eight times the codes' bytes. Here each program
reads a tile of packed codes with their groups' scales and offsets once and writes the tile of ``W~`` once, with the
format's arithmetic: ``fl32(fl32(scale * q) + offset)`` (a multiply then an add, each rounded: the launch turns
off the compiler's fused multiply-add), rounded to nearest in the output dtype. Bit for bit ``format.dequantize``
(tests/test_int4_dequant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import new_output
from ..config import launch_config, launching
from ..jit_helpers import round_to

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def dequant_kernel(QW, SC, OF, OUT, n_rows, half, n_groups, GB: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.program_id(1) * BB + tl.arange(0, BB)   # bytes: columns 2 cols (low nibble) and 2 cols + 1 (high)
    m = (rows < n_rows)[:, None] & (cols < half)[None, :]
    r = rows.to(tl.int64)[:, None]
    b = tl.load(QW + r * half + cols[None, :], mask=m, other=0).to(tl.int32)
    g = r * n_groups + (cols // GB)[None, :]           # GB bytes a group: both nibbles of a byte share it
    sc = tl.load(SC + g, mask=m, other=0.0).to(tl.float32)
    of = tl.load(OF + g, mask=m, other=0.0).to(tl.float32)
    lo = (b & 15).to(tl.float32) * sc + of             # no fused multiply-add (the launch's enable_fp_fusion)
    hi = (b >> 4).to(tl.float32) * sc + of
    DT: tl.constexpr = OUT.dtype.element_ty
    w = tl.reshape(tl.join(round_to(lo, DT), round_to(hi, DT)), (BN, 2 * BB))   # columns in order
    c2 = 2 * tl.program_id(1) * BB + tl.arange(0, 2 * BB)
    tl.store(OUT + r * (2 * half) + c2[None, :], w.to(DT), mask=(rows < n_rows)[:, None] & (c2 < 2 * half)[None, :])


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W~ [N, K]`` in ``dtype`` (bf16, fp16 or fp32) of the packed codes ``qweight`` uint8 [N, K / 2] and the
    groups' ``scale`` / ``offset`` [N, K / G] (fp16 or fp32; the caller checks the format: ``format._check``).
    Launch configuration: config.LAUNCH["int4_dequant"], BN rows and BB packed bytes (two columns each) a program,
    the fastest of a sweep (docs/int4.md). (Spy hook: ``on_launch("int4_dequant", qweight)``.)"""
    if dtype not in DTYPES:
        raise ValueError(f"the 4-bit de-quantization writes one of {DTYPES}, got {dtype}")
    n, half = qweight.shape
    n_groups = scale.shape[1]
    out = new_output((n, 2 * half), dtype, qweight.device)
    cfg = launch_config("int4_dequant", qweight.device)
    BN, BB = cfg["BN"], cfg["BB"]
    grid = (triton.cdiv(n, BN), triton.cdiv(half, BB))
    launching("int4_dequant", qweight)
    dequant_kernel[grid](qweight.contiguous(), scale.contiguous(), offset.contiguous(), out, n, half, n_groups,
                          GB=half // n_groups, BN=BN, BB=BB, num_warps=4, enable_fp_fusion=False)
    return out
