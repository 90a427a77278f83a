"""Triton kernel: the two shadow GEMVs of one token near the bandwidth limit (fp16x2 dequantization).

For the prepared shadows of ``shadow.prepare_shadow`` (4 or 8 bits, int32 words, fp16 group scales):

    u~ = x Q_up^T,  g~ = x Q_gate^T                         fp32, [d_inter] each
    out = (u~, g~) as [2, 1, d_inter]                       (SCORE=False: ``shadow_scores``)
    out = |u~ * act(g~)| as [1, d_inter]                    (SCORE=True: the shadow indicator)

Why a kernel of its own: the shadow GEMV of _select.py (fp32 per value, x re-read from memory per
tile) is bound by instructions and L1 traffic, not by bytes.
Here each persistent program loads x once, keeps it in registers for every row it visits, and turns
the words into fp16 pairs with one integer operation per two values.

Dequantization, 4 bits. Word c holds n_j = q_j + 8 of column 8c + j at bits 4j (``quant.pack_bits``):

    lop3(w,      0x000F000F, 0x64006400)   = fp16x2 (1024 + n_0,      1024 + n_4)
    lop3(w,      0x00F000F0, 0x64006400)   = fp16x2 (1024 + 16 n_1,   1024 + 16 n_5)
    lop3(w >> 8, 0x000F000F, 0x64006400)   = fp16x2 (1024 + n_2,      1024 + n_6)
    lop3(w >> 8, 0x00F000F0, 0x64006400)   = fp16x2 (1024 + 16 n_3,   1024 + 16 n_7)

(fp16 0x6400 is 1024, whose unit in the last place is 1: the nibble lands in the mantissa exactly).
Subtracting 1032 (0x6408) or 1152 (0x6480) in fp16x2 leaves (q, q) or (16 q, 16 q) exactly. 8 bits:
two byte permutes (prmt) give (1024 + n_0, 1024 + n_2) and (1024 + n_1, 1024 + n_3), minus 1152.
No weight is permuted: the kernel pairs x to match instead, once per program: the fp16x2 pair for
(n_0, n_4) multiplies (x'_0, x'_4), the pair for (16 n_1, 16 n_5) multiplies (x'_1 / 16, x'_5 / 16),
and so on, where x' = x 2**e in fp16 with e a power of two per token putting max|x'| in
[2**(XL-1), 2**XL) (XL 10 for 4 bits, 7 for 8: no lane can overflow fp16, few values go subnormal).
Per word, one fp16x2 multiply and three (8 bits: one) fp16x2 fmas sum each lane over 4 (2) values;
the two lanes are added in fp32, the words of a group summed in fp32, times the group's scale, the
groups summed in fp32, times 2**-e.

Error (a bound, used by the tests): each lane of a word sums 4 products of an exact q with an fp16
x', rounded to fp16 after each operation, so |lane - exact| <= 4 u sum |q x'| with u = 2**-11 (plus
one more u for fp32 or fp16 x rounded to fp16, none for bf16 in range); the fp32 sums add about
d_model 2**-24. So |u~ - x w~^T| <= 5 u (|x| |w~|^T) + tiny: about 2e-3 of the sum of |terms| at
worst, far less in practice; ranking rows needs no more.

ASM=True (CUDA) issues lop3 / prmt / sub.f16x2 / fma.rn.f16x2 through ``tl.inline_asm_elementwise``;
ASM=False computes the same values with plain Triton operations (the nibble extracted, converted to
fp16, the same products and sums in the same order) and runs under TRITON_INTERPRET=1. Both are
tested against float64 (tests/test_shadow_gemv.py; the asm path on the GPU by benchmarks/shadow_gemv.py).

Grid: PROGS persistent programs (PER_SM per SM) walk blocks of R rows (p, p + PROGS, ...); per
block the gate and up words of R rows, [R, G groups, WPG words] each, with the next block's words
requested first (PREFETCH; the first block's before x is prepared). AHEAD=2 requests two blocks
ahead; PIN keeps the requests above the block's arithmetic (ptxas otherwise sinks them below it): a
barrier, then x's pairs OR-ed with a value loaded after it and masked by ``zmask`` = 0. Both are off in
CONFIG (they did not pay) and stay as options for other GPUs' sweeps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._glu import _act, _pow2
from ._pdl import gdc_launch_dependents

# Launch configuration, one token: the fastest of `benchmarks/shadow_gemv.py`'s sweep at the Llama-3.1-8B shape
# (its registers fit 3 programs an SM: PER_SM 4 would run a second wave). R: rows per block (a power of two);
# PER_SM: persistent programs per SM; ASM: the inline-asm dequantization on CUDA.
CONFIG = dict(R=4, num_warps=4, PER_SM=3, PREFETCH=True, AHEAD=1, PIN=False, ASM=True)
INTERPRETER_PROGS = 3
LAST_KERNEL = None


# ------------------------------------------------------------------------------ asm (CUDA only)
@triton.jit
def _deq_asm(w, BITS: tl.constexpr):
    """int32 words -> fp16x2 pairs (as int32) of exact q (or 16 q), see the module docstring."""
    if BITS == 4:
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
    else:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t0, t1, m, mb;
            mov.b32 m, 0x64646464;
            mov.b32 mb, 0x64806480;
            prmt.b32 t0, $2, m, 0x4240;
            prmt.b32 t1, $2, m, 0x4341;
            sub.f16x2 $0, t0, mb;
            sub.f16x2 $1, t1, mb;
            }""",
            constraints="=r,=r,r", args=[w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


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
def _dot2_asm(q0, q1, x0, x1):
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a;
        .reg .f16 lo, hi;
        .reg .f32 flo, fhi, s;
        mul.rn.f16x2 a, $1, $3;
        fma.rn.f16x2 a, $2, $4, a;
        mov.b32 {lo, hi}, a;
        cvt.f32.f16 flo, lo;
        cvt.f32.f16 fhi, hi;
        add.f32 s, flo, fhi;
        mov.b32 $0, s;
        }""",
        constraints="=r,r,r,r,r", args=[q0, q1, x0, x1], dtype=tl.int32, is_pure=True,
        pack=1).to(tl.float32, bitcast=True)


@triton.jit
def _pack2(lo, hi):
    """Two fp16 tensors -> their fp16x2 pairs as int32 (lo in the low half)."""
    lb = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hb = hi.to(tl.int16, bitcast=True).to(tl.int32) << 16
    return lb | hb


# ------------------------------------------------------------------------ portable (interpreter)
@triton.jit
def _q16(w, J: tl.constexpr, BITS: tl.constexpr):
    """Value J of each word as an exact fp16 q."""
    MASK: tl.constexpr = (1 << BITS) - 1
    OFF: tl.constexpr = 1 << (BITS - 1)
    return (((w >> (J * BITS)) & MASK) - OFF).to(tl.float16)


@triton.jit
def _lane4(w, J0: tl.constexpr, x0, x1, x2, x3):
    a = _q16(w, J0, 4) * x0
    a = tl.fma(_q16(w, J0 + 1, 4), x1, a)
    a = tl.fma(_q16(w, J0 + 2, 4), x2, a)
    return tl.fma(_q16(w, J0 + 3, 4), x3, a)


@triton.jit
def _word_dot(w, h0, h1, h2, h3, h4, h5, h6, h7, p0, p1, p2, p3, BITS: tl.constexpr, ASM: tl.constexpr):
    """fp32 x' . (q of the word). h_j: x' of value j in fp16 (portable path); p_i: the fp16x2 pairs
    the asm path multiplies (4 bits: (h0, h4), (h1/16, h5/16), (h2, h6), (h3/16, h7/16); 8 bits:
    (h0, h2), (h1, h3))."""
    if ASM:
        if BITS == 4:
            q0, q1, q2, q3 = _deq_asm(w, BITS)
            return _dot4_asm(q0, q1, q2, q3, p0, p1, p2, p3)
        else:
            q0, q1 = _deq_asm(w, BITS)
            return _dot2_asm(q0, q1, p0, p1)
    else:
        if BITS == 4:
            return _lane4(w, 0, h0, h1, h2, h3).to(tl.float32) + _lane4(w, 4, h4, h5, h6, h7).to(tl.float32)
        else:
            lo = tl.fma(_q16(w, 1, 8), h1, _q16(w, 0, 8) * h0)
            hi = tl.fma(_q16(w, 3, 8), h3, _q16(w, 2, 8) * h2)
            return lo.to(tl.float32) + hi.to(tl.float32)


# ------------------------------------------------------------------------------------ the kernel
@triton.jit
def _xload(X, col, cm, J: tl.constexpr, VPW: tl.constexpr):
    if J < VPW:
        return tl.load(X + col * VPW + J, mask=cm, other=0.0).to(tl.float32)
    else:
        return tl.zeros(col.shape, dtype=tl.float32)


@triton.jit
def _word_grid(n_groups, G: tl.constexpr, WPG: tl.constexpr):
    """A row's words as [G groups, WPG words]: group ids, their mask, word index and its mask."""
    return _word_grid_from(0, n_groups, G, WPG)


@triton.jit
def _word_grid_from(g0, n_groups, G: tl.constexpr, WPG: tl.constexpr):
    """:func:`_word_grid` of the G groups from group ``g0`` on."""
    gi = g0 + tl.arange(0, G)
    wi = tl.arange(0, WPG)
    gm = gi < n_groups
    return gi, gm, gi[:, None] * WPG + wi[None, :], gm[:, None] & (wi < WPG)[None, :]


@triton.jit
def _tile(Q, SC, rows, n_rows, n_words, n_groups, wcol, gcol, gm,
          BIG: tl.constexpr):
    """Gate and up words [R, G, WPG] and scales [R, G] of the rows (0 past the end)."""
    rm = rows < n_rows
    if BIG:
        r64 = rows.to(tl.int64)
        qb = r64 * (2 * n_words)
        sb = r64 * (2 * n_groups)
    else:
        qb = rows * (2 * n_words)
        sb = rows * (2 * n_groups)
    off = qb[:, None, None] + wcol[None, :, :]
    m3 = rm[:, None, None] & gm[None, :, None]  # constant along a group's words: 16-byte loads
    wg = tl.load(Q + off, mask=m3, other=0)
    wu = tl.load(Q + off + n_words, mask=m3, other=0)
    soff = sb[:, None] + gcol[None, :]
    m2 = rm[:, None] & gm[None, :]
    sg = tl.load(SC + soff, mask=m2, other=0.0).to(tl.float32)
    su = tl.load(SC + soff + n_groups, mask=m2, other=0.0).to(tl.float32)
    return wg, wu, sg, su


@triton.jit(do_not_specialize=["zmask"])
def _gemv_kernel(X, Q, SC, OUT, n_rows, d_model, n_words, n_groups, n_blocks, n_progs, zmask,
                 BITS: tl.constexpr, ACT: tl.constexpr, R: tl.constexpr, G: tl.constexpr,
                 WPG: tl.constexpr, XL: tl.constexpr, ASM: tl.constexpr, SCORE: tl.constexpr,
                 PREFETCH: tl.constexpr, AHEAD: tl.constexpr, PIN: tl.constexpr, BIG: tl.constexpr,
                 PDL: tl.constexpr = 0):
    pid = tl.program_id(0)
    if PDL:  # the sparse kernel may launch now; it waits for this grid before reading what it writes
        gdc_launch_dependents()
    VPW: tl.constexpr = 32 // BITS
    gi, gm, wcol, wm = _word_grid(n_groups, G, WPG)                # wcol: [G, WPG] word index
    ri = tl.arange(0, R)
    if PREFETCH:  # the first block's words (AHEAD 2: two blocks'), requested before x is prepared
        nwg, nwu, nsg, nsu = _tile(Q, SC, pid * R + ri, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
        if AHEAD == 2:
            mwg, mwu, msg, msu = _tile(Q, SC, (pid + n_progs) * R + ri, n_rows, n_words, n_groups, wcol, gi, gm,
                                       BIG)
    # ---- x once per program: per value position j of a word, [G, WPG] fp32
    x0 = _xload(X, wcol, wm, 0, VPW)
    x1 = _xload(X, wcol, wm, 1, VPW)
    x2 = _xload(X, wcol, wm, 2, VPW)
    x3 = _xload(X, wcol, wm, 3, VPW)
    x4 = _xload(X, wcol, wm, 4, VPW)
    x5 = _xload(X, wcol, wm, 5, VPW)
    x6 = _xload(X, wcol, wm, 6, VPW)
    x7 = _xload(X, wcol, wm, 7, VPW)
    amax = tl.maximum(tl.maximum(tl.maximum(tl.max(tl.abs(x0)), tl.max(tl.abs(x1))),
                                 tl.maximum(tl.max(tl.abs(x2)), tl.max(tl.abs(x3)))),
                      tl.maximum(tl.maximum(tl.max(tl.abs(x4)), tl.max(tl.abs(x5))),
                                 tl.maximum(tl.max(tl.abs(x6)), tl.max(tl.abs(x7)))))
    # x' = x 2**e with max|x'| in [2**(XL-1), 2**XL): e from amax's exponent field
    ebits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(XL + 126 - ebits, -126), 126)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    h0 = (x0 * up).to(tl.float16)
    h1 = (x1 * up).to(tl.float16)
    h2 = (x2 * up).to(tl.float16)
    h3 = (x3 * up).to(tl.float16)
    h4 = (x4 * up).to(tl.float16)
    h5 = (x5 * up).to(tl.float16)
    h6 = (x6 * up).to(tl.float16)
    h7 = (x7 * up).to(tl.float16)
    if BITS == 4:  # the asm path's pairs (unused by the portable path)
        p0 = _pack2(h0, h4)
        p1 = _pack2((x1 * (up * 0.0625)).to(tl.float16), (x5 * (up * 0.0625)).to(tl.float16))
        p2 = _pack2(h2, h6)
        p3 = _pack2((x3 * (up * 0.0625)).to(tl.float16), (x7 * (up * 0.0625)).to(tl.float16))
    else:
        p0 = _pack2(h0, h2)
        p1 = _pack2(h1, h3)
        p2 = p0
        p3 = p1

    e0, e1, e2, e3 = p0[None], p1[None], p2[None], p3[None]  # [1, G, WPG]: in the tiles' layout once
    for blk in range(pid, n_blocks, n_progs):
        rows = blk * R + ri
        if PREFETCH:  # this block's words were requested one (AHEAD 2: two) blocks ago; request the next
            wg, wu, sg, su = nwg, nwu, nsg, nsu
            if AHEAD == 2:
                nwg, nwu, nsg, nsu = mwg, mwu, msg, msu
                mwg, mwu, msg, msu = _tile(Q, SC, rows + 2 * n_progs * R, n_rows, n_words, n_groups, wcol, gi,
                                           gm, BIG)
            else:
                nwg, nwu, nsg, nsu = _tile(Q, SC, rows + n_progs * R, n_rows, n_words, n_groups, wcol, gi, gm,
                                           BIG)
        else:
            wg, wu, sg, su = _tile(Q, SC, rows, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
        a0, a1, a2, a3 = e0, e1, e2, e3
        if PIN:  # the loads above stay above: a barrier, then x's pairs made to depend on a load after it
            tl.debug_barrier()  # (zmask is 0 at run time; the compiler cannot know it)
            z = tl.load(SC + pid * 0).to(tl.int16, bitcast=True).to(tl.int32) & zmask
            a0, a1, a2, a3 = e0 | z, e1 | z, e2 | z, e3 | z
        dg = _word_dot(wg, h0[None], h1[None], h2[None], h3[None], h4[None], h5[None], h6[None], h7[None],
                       a0, a1, a2, a3, BITS, ASM)
        du = _word_dot(wu, h0[None], h1[None], h2[None], h3[None], h4[None], h5[None], h6[None], h7[None],
                       a0, a1, a2, a3, BITS, ASM)
        g = tl.sum(tl.sum(dg, axis=2) * sg, axis=1) * down
        u = tl.sum(tl.sum(du, axis=2) * su, axis=1) * down
        rm = rows < n_rows
        if SCORE:
            tl.store(OUT + rows, tl.abs(u * _act(g, ACT)), mask=rm)
        else:
            tl.store(OUT + rows, u, mask=rm)
            tl.store(OUT + n_rows + rows, g, mask=rm)


def supports(n_tok: int, bits: int, wpg: int) -> bool:
    """Whether this kernel takes the problem: one token, 4 or 8 bits, whole words per group."""
    return n_tok == 1 and bits in (4, 8) and wpg >= 1 and (wpg & (wpg - 1)) == 0


def problem_shape(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, kernel: str) -> tuple[int, ...]:
    """(n_rows, d_model, n_words, n_groups, bits, words per group) of a one-token shadow GEMV, or a
    ValueError naming ``kernel`` and what it takes."""
    n_rows, d_model = q.shape[0], x.shape[1]
    n_words, n_groups = q.shape[2], scale.shape[2]
    bits = 32 * n_words // d_model
    wpg = n_words // n_groups
    if x.shape[0] != 1 or not supports(1, bits, wpg) or n_words * 32 != d_model * bits or n_words != n_groups * wpg:
        raise ValueError(f"the one-token {kernel} takes x [1, d_model] and 4- or 8-bit shadows with whole words "
                         f"per group, got x {tuple(x.shape)}, q {tuple(q.shape)}, scale {tuple(scale.shape)}")
    return n_rows, d_model, n_words, n_groups, bits, wpg


def launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, activation: str | None,
           config: dict | None = None) -> torch.Tensor:
    """x [1, d_model] (fp32/fp16/bf16); q int32 [N, 2, W], scale fp16 [N, 2, G] from prepare_shadow.
    activation None: (u~, g~) as [2, 1, N] fp32; else |u~ act(g~)| as [1, N] fp32."""
    global LAST_KERNEL
    from . import _pdl
    from ._common import act_code, interpreting, new_output, persistent_programs

    cfg = {**CONFIG, **(config or {})}
    n_rows, d_model, n_words, n_groups, bits, wpg = problem_shape(x, q, scale, "shadow GEMV")
    x, q, scale = x.contiguous(), q.contiguous(), scale.contiguous()
    R = cfg["R"]
    n_blocks = -(-n_rows // R)
    progs = max(1, min(n_blocks, persistent_programs(x.device, cfg["PER_SM"], INTERPRETER_PROGS)))
    asm = bool(cfg["ASM"]) and x.device.type == "cuda" and not interpreting()
    shape = (2, 1, n_rows) if activation is None else (1, n_rows)
    out = new_output(shape, torch.float32, x.device)
    LAST_KERNEL = _gemv_kernel[(progs,)](
        x, q, scale, out, n_rows, d_model, n_words, n_groups, n_blocks, progs, 0,
        BITS=bits, ACT=act_code(activation or "silu"), R=R, G=_pow2(n_groups), WPG=wpg,
        XL=10 if bits == 4 else 7, ASM=asm, SCORE=activation is not None, PREFETCH=bool(cfg["PREFETCH"]),
        AHEAD=int(cfg.get("AHEAD", 1)), PIN=bool(cfg.get("PIN", False)),
        BIG=n_rows * 2 * n_words >= 2**31, PDL=_pdl.mode(x), num_warps=cfg["num_warps"], num_stages=1)
    return out
