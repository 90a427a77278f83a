"""Triton helpers: the dot products of 4-bit words with fp16x2 dequantization (the 4-bit GEMVs: gemv.py and
rows_other.py).

A little-endian int32 word c holds eight 4-bit codes n_j = q_j + 8 of columns 8c .. 8c + 7 at bits 4j (the format
of ``countdown.int4.format``; the shadows' ``pack_bits`` writes the same):

    lop3(w,      0x000F000F, 0x64006400)   = fp16x2 (1024 + n_0,      1024 + n_4)
    lop3(w,      0x00F000F0, 0x64006400)   = fp16x2 (1024 + 16 n_1,   1024 + 16 n_5)
    lop3(w >> 8, 0x000F000F, 0x64006400)   = fp16x2 (1024 + n_2,      1024 + n_6)
    lop3(w >> 8, 0x00F000F0, 0x64006400)   = fp16x2 (1024 + 16 n_3,   1024 + 16 n_7)

(fp16 0x6400 is 1024, whose unit in the last place is 1: the nibble lands in the mantissa exactly). Subtracting
1032 (0x6408) or 1152 (0x6480) in fp16x2 leaves (q, q) or (16 q, 16 q) exactly: one integer operation per two
values. No weight is permuted: x is paired to match instead, once per program: the pair for (n_0, n_4) multiplies
(x'_0, x'_4), the pair for (16 n_1, 16 n_5) multiplies (x'_1 / 16, x'_5 / 16), and so on, where x' = x 2**e in
fp16 with e a power of two per token keeping every lane within fp16's range. Per word, one fp16x2 multiply and
three fp16x2 fmas sum each lane over 4 values; the two lanes are added in fp32.

Error: each lane sums 4 products of an exact q with an fp16 x', rounded to fp16 after each operation, so
|lane - exact| <= 4 u sum |q x'| with u = 2**-11 (plus one more u for x rounded to fp16); the fp32 sums add about
K 2**-24: about 5 * 2**-11 of the sum of |terms| at worst (tests/test_int4_gemv.py bounds the GEMV with it).

ASM=True (CUDA) issues lop3 / sub.f16x2 / fma.rn.f16x2 through ``tl.inline_asm_elementwise``; ASM=False computes
the same values with plain Triton operations (the nibble extracted, converted to fp16, the same products and sums
in the same order) and runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ------------------------------------------------------------------------------ asm (CUDA only)
@triton.jit
def _deq_asm(w):
    """int32 words -> fp16x2 pairs (as int32) of exact q (or 16 q), see the module docstring."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 w8, t0, t1, t2, t3, ma, mb;
        mov.b32 ma, 0x64086408;
        mov.b32 mb, 0x64806480;
        shr.u32 w8, $4, 8;
        lop3.b32 t0, $4, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 t1, $4, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 t2, w8, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 t3, w8, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 $0, t0, ma;
        sub.f16x2 $1, t1, mb;
        sub.f16x2 $2, t2, ma;
        sub.f16x2 $3, t3, mb;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _dot4_asm(q0, q1, q2, q3, x0, x1, x2, x3):
    """fp32 sum of both lanes of q0 x0 + q1 x1 + q2 x2 + q3 x3 (fp16x2 multiply, fmas, lanes in fp32)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a;
        .reg .f16 lo, hi;
        .reg .f32 flo, fhi, s;
        mul.rn.f16x2 a, $1, $5;
        fma.rn.f16x2 a, $2, $6, a;
        fma.rn.f16x2 a, $3, $7, a;
        fma.rn.f16x2 a, $4, $8, a;
        mov.b32 {lo, hi}, a;
        cvt.f32.f16 flo, lo;
        cvt.f32.f16 fhi, hi;
        add.f32 s, flo, fhi;
        mov.b32 $0, s;
        }""",
        constraints="=r,r,r,r,r,r,r,r,r", args=[q0, q1, q2, q3, x0, x1, x2, x3],
        dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)


@triton.jit
def pack2(lo, hi):
    """Two fp16 tensors -> their fp16x2 pairs as int32 (lo in the low half)."""
    lb = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hb = hi.to(tl.int16, bitcast=True).to(tl.int32) << 16
    return lb | hb


# ------------------------------------------------------------------------ portable (interpreter)
@triton.jit
def _q16(w, J: tl.constexpr):
    """Value J of each word as an exact fp16 q."""
    return (((w >> (J * 4)) & 15) - 8).to(tl.float16)


@triton.jit
def _lane4(w, J0: tl.constexpr, x0, x1, x2, x3):
    a = _q16(w, J0) * x0
    a = tl.fma(_q16(w, J0 + 1), x1, a)
    a = tl.fma(_q16(w, J0 + 2), x2, a)
    return tl.fma(_q16(w, J0 + 3), x3, a)


@triton.jit
def word_dot(w, h0, h1, h2, h3, h4, h5, h6, h7, p0, p1, p2, p3, ASM: tl.constexpr):
    """fp32 x' . (q of the word). h_j: x' of value j in fp16 (portable path); p_i: the fp16x2 pairs the asm path
    multiplies, (h0, h4), (h1/16, h5/16), (h2, h6), (h3/16, h7/16) (:func:`pack2`)."""
    if ASM:
        q0, q1, q2, q3 = _deq_asm(w)
        return _dot4_asm(q0, q1, q2, q3, p0, p1, p2, p3)
    else:
        return _lane4(w, 0, h0, h1, h2, h3).to(tl.float32) + _lane4(w, 4, h4, h5, h6, h7).to(tl.float32)


@triton.jit
def xload(X, col, cm, J: tl.constexpr, VPW: tl.constexpr):
    """x's value J of each word (column col VPW + J) in fp32; zeros where J >= VPW."""
    if J < VPW:
        return tl.load(X + col * VPW + J, mask=cm, other=0.0).to(tl.float32)
    else:
        return tl.zeros(col.shape, dtype=tl.float32)
