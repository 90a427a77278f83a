"""Triton kernel: the two shadow GEMVs of one token with integer dot products (x in int8, dp4a).

For the prepared shadows of ``ops.prepare_shadow`` (4 or 8 bits, int32 words, fp16 group scales):

    u~ = x Q_up^T,  g~ = x Q_gate^T                         fp32, [d_inter] each
    out = (u~, g~) as [2, 1, d_inter]                       (activation None: ``shadow_scores``)
    out = |u~ * act(g~)| as [1, d_inter]                    (the shadow indicator of the one-token route)

Why integers: a GEMV that turns each word into fp16 pairs and multiplies in fp16 (int4/words.py's arithmetic)
takes about 22 instructions a word, which keeps it instruction-bound, well short of the copy bandwidth. Here x is
rounded once per program to int8 per weight group and each word costs two masks, a shift and two integer dot
products of four bytes (``dp4a``):

    xs_g  = max_{j in g} |x_j| / 127,   xq_j = round(x_j / xs_g) in [-127, 127]   (per group g)
    4 bits, word c = nibbles n_0..n_7 (n_j = q_j + 8 at bits 4j, ``quant.pack_bits``):
        lo = c & 0x0F0F0F0F            bytes (n_0, n_2, n_4, n_6)
        hi = (c >> 4) & 0x0F0F0F0F     bytes (n_1, n_3, n_5, n_7)
        d  = dp4a(hi, (xq_1, xq_3, xq_5, xq_7), dp4a(lo, (xq_0, xq_2, xq_4, xq_6), 0))
    8 bits, word c = bytes n_0..n_3 (n_j = q_j + 128):  d = dp4a(c, (xq_0, .., xq_3), 0)
    D_g   = sum_{words of g} d - OFF * sum_{j in g} xq_j       (= sum_j q_j xq_j, exact int32)
    u~    = sum_g scale_g * xs_g * D_g                          fp32

Every integer step is exact, so the only error is x's rounding to int8 (the fp32 products and sums
add about d_model 2**-24 of the sum of |terms|):

    |u~ - x w~^T| <= sum_g (xs_g / 2) sum_{j in g} |w~_j|  (+ fp32 sums)

i.e. at most 1/254 of the group's largest |x| per weight, against the 4-bit shadow's own rounding of
up to 1/14 of the group's largest |w|: the shadow's error dominates, and ranking rows needs no more.

ASM=True (CUDA) issues and / shr / dp4a through ``tl.inline_asm_elementwise``; ASM=False computes
the same integers with plain Triton operations (each value extracted and multiplied) and runs under
TRITON_INTERPRET=1. Both give bit-identical outputs (tests/test_shadow_gemv_i8.py against float64 and
each other; benchmarks/shadow_dp4a.py on the GPU).

Grid: PER_SM persistent programs an SM walk blocks of R rows (p, p + PROGS, ...); per block the gate and up words
of R rows, [R, G groups, WPG words] each, the next block's words requested before this block's arithmetic
(PREFETCH; the first block's before x is prepared). XPRE: x rounded by a small kernel first, whose run the first
block's loads overlap under PDL (otherwise every program rounds x itself), XPRE_GB groups a program on XPRE_WARPS
warps: many small programs, since the GEMV under PDL waits for the slowest of them. Launch configuration:
config.LAUNCH["shadow_gemv"] (the fastest of benchmarks/shadow_dp4a.py's sweep with PDL on).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import act_code, interpreting, new_output, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode, persistent_programs
from ..jit_helpers import act, gdc_launch_dependents, gdc_wait


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




@triton.jit
def _dot_asm(w, xa, xb, BITS: tl.constexpr):
    """Per word: the integer dot product of its unsigned values with x's int8 values (packed)."""
    if BITS == 4:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, d;
            and.b32 lo, $1, 0x0F0F0F0F;
            shr.u32 hi, $1, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            dp4a.u32.s32 d, lo, $2, 0;
            dp4a.u32.s32 $0, hi, $3, d;
            }""",
            constraints="=r,r,r,r", args=[w, xa, xb], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            asm="dp4a.u32.s32 $0, $1, $2, 0;", constraints="=r,r,r,r", args=[w, xa, xb],
            dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dot_portable(w, q0, q1, q2, q3, q4, q5, q6, q7, BITS: tl.constexpr):
    """The same integers as _dot_asm with plain operations (q_j: x's int8 value j of each word)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    d = (w & MASK) * q0 + ((w >> BITS) & MASK) * q1 + ((w >> 2 * BITS) & MASK) * q2 + ((w >> 3 * BITS) & MASK) * q3
    if BITS == 4:
        d += ((w >> 16) & MASK) * q4 + ((w >> 20) & MASK) * q5 + ((w >> 24) & MASK) * q6 + ((w >> 28) & MASK) * q7
    return d


@triton.jit
def _xq(X, wcol, wm, J: tl.constexpr, VPW: tl.constexpr, inv):
    """x's value J of each word [G, WPG], rounded to int8 with its group's 1 / xs (half away from 0)."""
    if J < VPW:
        v = tl.load(X + wcol * VPW + J, mask=wm, other=0.0).to(tl.float32) * inv[:, None]
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        return tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)
    else:
        return tl.zeros(wcol.shape, dtype=tl.int32)


@triton.jit
def _xamax(X, wcol, wm, J: tl.constexpr, VPW: tl.constexpr):
    if J < VPW:
        return tl.max(tl.abs(tl.load(X + wcol * VPW + J, mask=wm, other=0.0).to(tl.float32)), axis=1)
    else:
        return tl.zeros([wcol.shape[0]], dtype=tl.float32)


@triton.jit
def _pack4(a, b, c, d):
    """Four int8 values (as int32) -> one int32 of four bytes, a in the lowest."""
    return (a & 0xFF) | ((b & 0xFF) << 8) | ((c & 0xFF) << 16) | ((d & 0xFF) << 24)


@triton.jit
def _row_dot(w, s, xs, xsum, xa, xb, q0, q1, q2, q3, q4, q5, q6, q7, BITS: tl.constexpr, ASM: tl.constexpr):
    """fp32 x~ . w~ for words w [R, G, WPG] and scales s [R, G]."""
    OFF: tl.constexpr = 1 << (BITS - 1)
    if ASM:
        d = _dot_asm(w, xa, xb, BITS)
    else:
        d = _dot_portable(w, q0, q1, q2, q3, q4, q5, q6, q7, BITS)
    dg = tl.sum(d, axis=2) - OFF * xsum  # [R, G] sum_j q_j xq_j, exact
    return tl.sum(dg.to(tl.float32) * (s * xs), axis=1)


@triton.jit
def _x_prepare(X, wcol, wm, VPW: tl.constexpr, BITS: tl.constexpr):
    """x's group scales xs [G], its int8 values by position j in a word q0..q7 [G, WPG] (int32), their sums
    per group [G] and the packed words xa, xb that dp4a multiplies."""
    amax = tl.maximum(tl.maximum(tl.maximum(_xamax(X, wcol, wm, 0, VPW), _xamax(X, wcol, wm, 1, VPW)),
                                 tl.maximum(_xamax(X, wcol, wm, 2, VPW), _xamax(X, wcol, wm, 3, VPW))),
                      tl.maximum(tl.maximum(_xamax(X, wcol, wm, 4, VPW), _xamax(X, wcol, wm, 5, VPW)),
                                 tl.maximum(_xamax(X, wcol, wm, 6, VPW), _xamax(X, wcol, wm, 7, VPW))))
    nz = amax > 0
    xs = tl.where(nz, amax / 127.0, 0.0)
    inv = tl.where(nz, 127.0 / tl.where(nz, amax, 1.0), 0.0)
    q0 = _xq(X, wcol, wm, 0, VPW, inv)
    q1 = _xq(X, wcol, wm, 1, VPW, inv)
    q2 = _xq(X, wcol, wm, 2, VPW, inv)
    q3 = _xq(X, wcol, wm, 3, VPW, inv)
    q4 = _xq(X, wcol, wm, 4, VPW, inv)
    q5 = _xq(X, wcol, wm, 5, VPW, inv)
    q6 = _xq(X, wcol, wm, 6, VPW, inv)
    q7 = _xq(X, wcol, wm, 7, VPW, inv)
    xsum = tl.sum(q0 + q1 + q2 + q3 + q4 + q5 + q6 + q7, axis=1)
    if BITS == 4:
        xa = _pack4(q0, q2, q4, q6)
        xb = _pack4(q1, q3, q5, q7)
    else:
        xa = _pack4(q0, q1, q2, q3)
        xb = xa
    return xs, xsum, xa, xb, q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _byte(v, K: tl.constexpr):
    """Signed byte K of int32 words."""
    return (v << (24 - 8 * K)) >> 24


@triton.jit
def _block(OUT, rows, n_rows, wg, wu, sg, su, xs2, xsum2, xa3, xb3, e0, e1, e2, e3, e4, e5, e6, e7,
           BITS: tl.constexpr, ACT: tl.constexpr, ASM: tl.constexpr, SCORE: tl.constexpr):
    """One block of rows: u~, g~ from their words and scales, then the score or both stored."""
    g = _row_dot(wg, sg, xs2, xsum2, xa3, xb3, e0, e1, e2, e3, e4, e5, e6, e7, BITS, ASM)
    u = _row_dot(wu, su, xs2, xsum2, xa3, xb3, e0, e1, e2, e3, e4, e5, e6, e7, BITS, ASM)
    rm = rows < n_rows
    if SCORE:
        tl.store(OUT + rows, tl.abs(u * act(g, ACT)), mask=rm)
    else:
        tl.store(OUT + rows, u, mask=rm)
        tl.store(OUT + n_rows + rows, g, mask=rm)


@triton.jit
def x_prepare_kernel(X, XA, XB, XS, XSUM, n_groups, GB: tl.constexpr, WPG: tl.constexpr, BITS: tl.constexpr,
                  PDL: tl.constexpr = 0):
    """XPRE: x prepared once for every program of the GEMV, GB groups a program."""
    if PDL:  # launched early (PDL): x is the previous kernel's output; a small grid, signal at once
        gdc_launch_dependents()
        gdc_wait()
    VPW: tl.constexpr = 32 // BITS
    gi, gm, wcol, wm = _word_grid_from(tl.program_id(0) * GB, n_groups, GB, WPG)
    xs, xsum, xa, xb, q0, q1, q2, q3, q4, q5, q6, q7 = _x_prepare(X, wcol, wm, VPW, BITS)
    tl.store(XA + wcol, xa, mask=wm)
    tl.store(XB + wcol, xb, mask=wm)
    tl.store(XS + gi, xs, mask=gm)
    tl.store(XSUM + gi, xsum, mask=gm)


@triton.jit
def shadow_gemv_kernel(X, XA, XB, XS, XSUM, Q, SC, OUT, n_rows, d_model, n_words, n_groups, n_blocks, n_progs,
                    BITS: tl.constexpr, ACT: tl.constexpr, R: tl.constexpr, G: tl.constexpr, WPG: tl.constexpr,
                    ASM: tl.constexpr, SCORE: tl.constexpr, PREFETCH: tl.constexpr, BIG: tl.constexpr,
                    XPRE: tl.constexpr, STAGES: tl.constexpr = 1, PDL: tl.constexpr = 0):
    pid = tl.program_id(0)
    if PDL:  # the sparse kernel may launch now; it waits for this grid before reading what it writes
        gdc_launch_dependents()
    VPW: tl.constexpr = 32 // BITS
    gi, gm, wcol, wm = _word_grid(n_groups, G, WPG)                # wcol: [G, WPG] word index
    ri = tl.arange(0, R)
    if PREFETCH:  # the first block's words, requested before x is prepared (weights are no grid's output)
        nwg, nwu, nsg, nsu = _tile(Q, SC, pid * R + ri, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
    if XPRE:  # x prepared by x_prepare_kernel: loaded (from L2) once that grid is done
        if PDL:
            gdc_wait()
        xa = tl.load(XA + wcol, mask=wm, other=0)
        xb = tl.load(XB + wcol, mask=wm, other=0)
        xs = tl.load(XS + gi, mask=gm, other=0.0)
        xsum = tl.load(XSUM + gi, mask=gm, other=0)
        if BITS == 4:
            q0, q2, q4, q6 = _byte(xa, 0), _byte(xa, 1), _byte(xa, 2), _byte(xa, 3)
            q1, q3, q5, q7 = _byte(xb, 0), _byte(xb, 1), _byte(xb, 2), _byte(xb, 3)
        else:
            q0, q1, q2, q3 = _byte(xa, 0), _byte(xa, 1), _byte(xa, 2), _byte(xa, 3)
            q4, q5, q6, q7 = q0 * 0, q0 * 0, q0 * 0, q0 * 0
    else:
        if PDL:
            gdc_wait()
        xs, xsum, xa, xb, q0, q1, q2, q3, q4, q5, q6, q7 = _x_prepare(X, wcol, wm, VPW, BITS)
    xs2, xsum2 = xs[None, :], xsum[None, :]
    xa3, xb3 = xa[None], xb[None]
    e0, e1, e2, e3, e4, e5, e6, e7 = q0[None], q1[None], q2[None], q3[None], q4[None], q5[None], q6[None], q7[None]
    if PREFETCH:  # each block's words were requested one block before; request the next
        for blk in range(pid, n_blocks, n_progs):
            rows = blk * R + ri
            wg, wu, sg, su = nwg, nwu, nsg, nsu
            nwg, nwu, nsg, nsu = _tile(Q, SC, rows + n_progs * R, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
            _block(OUT, rows, n_rows, wg, wu, sg, su, xs2, xsum2, xa3, xb3, e0, e1, e2, e3, e4, e5, e6, e7,
                   BITS, ACT, ASM, SCORE)
    else:  # STAGES > 1: Triton's pipeliner keeps STAGES - 1 blocks' words in flight (shared memory, async copies)
        for blk in tl.range(pid, n_blocks, n_progs, num_stages=STAGES):
            rows = blk * R + ri
            wg, wu, sg, su = _tile(Q, SC, rows, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
            _block(OUT, rows, n_rows, wg, wu, sg, su, xs2, xsum2, xa3, xb3, e0, e1, e2, e3, e4, e5, e6, e7,
                   BITS, ACT, ASM, SCORE)


def launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, activation: str | None,
           config: dict | None = None) -> torch.Tensor:
    """x [1, d_model] (fp32/fp16/bf16); q int32 [N, 2, W], scale fp16 [N, 2, G] from prepare_shadow.
    activation None: (u~, g~) as [2, 1, N] fp32; else |u~ act(g~)| as [1, N] fp32. (Spy hook:
    ``on_launch("shadow_gemv", x, activation)``.)"""
    cfg = launch_config("shadow_gemv", x.device, extra=config)
    n_rows, d_model, n_words, n_groups, bits, wpg = problem_shape(x, q, scale, "int8 shadow GEMV")
    x, q, scale = x.contiguous(), q.contiguous(), scale.contiguous()
    R = cfg["R"]
    n_blocks = -(-n_rows // R)
    # PER_SM 0: one program per block (no persistent loop), the hardware filling the SMs
    per_sm = cfg["PER_SM"]
    progs = n_blocks if per_sm == 0 else max(1, min(n_blocks, persistent_programs(x.device, per_sm,
                                                                                   cfg.get("PROGRAMS", 0))))
    asm = bool(cfg["ASM"]) and x.device.type == "cuda" and not interpreting()
    out = new_output((2, 1, n_rows) if activation is None else (1, n_rows), torch.float32, x.device)
    pdl, G = pdl_mode(x), pow2(n_groups)
    xpre = bool(cfg.get("XPRE", False))
    if xpre:  # x's int8 words, scales and sums once, XPRE_GB groups a program (one int32 scratch buffer)
        buf = torch.empty(2 * n_words + 2 * n_groups, dtype=torch.int32, device=x.device)
        xa, xb = buf[:n_words], buf[n_words:2 * n_words]
        xs = buf[2 * n_words:2 * n_words + n_groups].view(torch.float32)
        xsum = buf[2 * n_words + n_groups:]
        gb = min(G, pow2(int(cfg["XPRE_GB"])))
        x_prepare_kernel[(-(-n_groups // gb),)](x, xa, xb, xs, xsum, n_groups, GB=gb, WPG=wpg, BITS=bits, PDL=pdl,
                                                num_warps=cfg["XPRE_WARPS"], **launch_kwargs(pdl))
    else:
        xa = xb = xs = xsum = x
    launching("shadow_gemv", x, activation)
    shadow_gemv_kernel[(progs,)](
        x, xa, xb, xs, xsum, q, scale, out, n_rows, d_model, n_words, n_groups, n_blocks, progs,
        BITS=bits, ACT=act_code(activation or "silu"), R=R, G=G, WPG=wpg, ASM=asm,
        SCORE=activation is not None, PREFETCH=bool(cfg["PREFETCH"]), BIG=n_rows * 2 * n_words >= 2**31,
        XPRE=xpre, STAGES=int(cfg.get("STAGES", 1)), PDL=pdl, num_warps=cfg["num_warps"], num_stages=1,
        **launch_kwargs(pdl))
    return out


@torch.library.custom_op("countdown::shadow_gemv_i8", mutates_args=())
def _gemv_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, activation: str, score: bool) -> torch.Tensor:
    """One token: (u~, g~) as [2, 1, d_inter] fp32, or (score) |u~ act(g~)| as [1, d_inter] fp32, x in int8."""
    return launch(x, q, scale, activation if score else None)


@_gemv_op.register_fake
def _(x, q, scale, activation, score):
    shape = (1, q.shape[0]) if score else (2, 1, q.shape[0])
    return x.new_empty(shape, dtype=torch.float32)
