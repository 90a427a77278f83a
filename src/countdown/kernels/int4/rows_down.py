"""Triton kernel: the down half of sparse rows on 4-bit weights (rows.py says what the launches
compute): fp32 partials [P, d_model], P[b] = sum over the kept rows of SUB sets of s[i] Wd~t[i], from the select
kernel's compacted row lists (s as select wrote it for dual; for mono / cats formed here from the indicator value
and the other GEMV's partial sums at the row's list position).

A grid of SUB sets x column slices of SLICE words; NW warps a program (one by default), each its own stream of kept
rows with its own accumulators (summed across the warps once, at the end), UR rows of a stream a tile: one flat
loop over the sets' tiles (``rows_list.py``), the rows two tiles ahead and the words of the next requested
before the current one's arithmetic. A stream's UR rows are summed inside each
thread as fp16x2 products: one ``lop3`` puts two nibbles in 1024's mantissa (as words.py), one fma with
(s', s') and -1024 (s', s') leaves c s' rounded once, s' = s scale 2**e scaled per stream and group; then added to
fp32 times 2**-e. The offsets' term (``s offset`` per group) is fp32, summed once at the end. Partials are written
whole; with a residual h (``FIX``) the last program of each column slice to finish (a counter a slice, one atomic a
program after its stores) sums the slice's partials in program order (as ``decode_add_partials``: the same numbers
whichever program is last), adds h (and the bias) and writes h' rounded once to h's dtype, then sets the counter back
to 0 (the select kernel zeroes them first: a buffer of the launch, no state kept between launches): the residual add
without a launch of its own (5.0 us of a 4-bit decode step's layer on the H200, run P1 of docs/int4.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import act_code, interpreting, new_output, pow2
from ..config import launch_kwargs, launching, pdl_mode
from ..jit_helpers import KEEP_RULES, act, gdc_launch_dependents, gdc_wait, partial_sum, round_to
from .rows_list import listed, q_total, tile_at


@triton.jit
def _listed_rows(IDX, SV, CNT, q, part, n_sets, slot, d_inter, SET: tl.constexpr, SUB: tl.constexpr, T: tl.constexpr,
                 CG: tl.constexpr = False):
    """(rows, list positions, valid, indicator value or s) of tile ``q`` of a down program's sets at ``slot``: the
    select kernel's output only (CG: read from L2, before the PDL wait)."""
    rows, pos, valid = tile_at(IDX, CNT, q, part, n_sets, slot, d_inter, SET, SUB, T, CG)
    return rows, pos, valid, listed(SV, pos, valid, 0.0, CG)


@triton.jit
def _s_of(O, sv, pos, valid, n_pos, OS: tl.constexpr, MODE: tl.constexpr, ACT: tl.constexpr):
    """s of listed rows: as the select kernel wrote it (OS = 0, dual), or from their indicator value and the other
    GEMV's OS partial sums at the rows' list positions (MODE abs, mono: u act(g); abs_act, cats: u of the partials
    times act(g))."""
    if OS > 0:
        o = tl.load(O + pos, mask=valid, other=0.0)
        for i in tl.static_range(1, OS):
            o += tl.load(O + i * n_pos + pos, mask=valid, other=0.0)
        if MODE == 2:  # abs
            sv = sv * act(o, ACT)
        else:
            sv = o * act(sv, ACT)
    return sv


@triton.jit
def _slots(IDX, SV, CNT, O, q, part, n_sets, slot, d_inter, n_pos, SET: tl.constexpr, SUB: tl.constexpr,
           T: tl.constexpr, OS: tl.constexpr, MODE: tl.constexpr, ACT: tl.constexpr):
    """Row numbers (d_inter past the end) and s of tile ``q`` of a down program's sets at ``slot``."""
    rows, pos, valid, sv = _listed_rows(IDX, SV, CNT, q, part, n_sets, slot, d_inter, SET, SUB, T)
    return rows, _s_of(O, sv, pos, valid, n_pos, OS, MODE, ACT)


@triton.jit
def _rows4(WD, SCD, OFD, rows, d_inter, n_words, n_groups, wcol, gi, gm, BIG: tl.constexpr):
    """Words [UR, NW, GPS, WPG], scales and offsets [UR, NW, GPS] (fp32) of the rows [UR, NW] (none past the end)."""
    rm = rows < d_inter
    if BIG:
        qb = rows.to(tl.int64) * n_words
        sb = rows.to(tl.int64) * n_groups
    else:
        qb = rows * n_words
        sb = rows * n_groups
    w = tl.load(WD + qb[:, :, None, None] + wcol[None, None, :, :],
                mask=rm[:, :, None, None] & gm[None, None, :, None], other=0)
    m3 = rm[:, :, None] & gm[None, None, :]
    sc = tl.load(SCD + sb[:, :, None] + gi[None, None, :], mask=m3, other=0.0).to(tl.float32)
    of = tl.load(OFD + sb[:, :, None] + gi[None, None, :], mask=m3, other=0.0).to(tl.float32)
    return w, sc, of


@triton.jit
def _products_asm(w, sa):
    """fp16x2 pairs (c0, c4), (c1, c5), (c2, c6), (c3, c7) times s' of int32 words w: each nibble lands in 1024's
    mantissa (lop3, as words.py), one fma with (s', s') or (s' / 16, s' / 16) and minus 1024 times it (exact)
    leaves c s' rounded once to fp16."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 w8, t0, t1, t2, t3, a, b, na, nb, k16, k1024;
        mov.b32 k16, 0x2C002C00;
        mov.b32 k1024, 0xE400E400;
        cvt.rn.f16x2.f32 a, $5, $5;
        mul.rn.f16x2 b, a, k16;
        mul.rn.f16x2 na, a, k1024;
        mul.rn.f16x2 nb, b, k1024;
        shr.u32 w8, $4, 8;
        lop3.b32 t0, $4, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 t1, $4, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 t2, w8, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 t3, w8, 0x00F000F0, 0x64006400, 0xEA;
        fma.rn.f16x2 $0, t0, a, na;
        fma.rn.f16x2 $1, t1, b, nb;
        fma.rn.f16x2 $2, t2, a, na;
        fma.rn.f16x2 $3, t3, b, nb;
        }""",
        constraints="=r,=r,=r,=r,r,r", args=[w, sa],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _hadd2(a, b):
    return tl.inline_asm_elementwise(asm="add.rn.f16x2 $0, $1, $2;", constraints="=r,r,r", args=[a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _flush_asm(p, d, lo, hi):
    """(lo + p.lo d, hi + p.hi d) in fp32 for fp16x2 pairs p."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .f16 l, h;
        .reg .f32 fl, fh;
        mov.b32 {l, h}, $2;
        cvt.f32.f16 fl, l;
        cvt.f32.f16 fh, h;
        fma.rn.f32 $0, fl, $3, $4;
        fma.rn.f32 $1, fh, $3, $5;
        }""",
        constraints="=r,=r,r,r,r,r", args=[p, d, lo, hi], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _hadd(a, b):
    return a + b


@triton.jit
def _nibble_sum(w, J: tl.constexpr, a16):
    """Portable path, the asm's operations in fp16 (an overflow too): (1024 + c) a - 1024 a for nibble J of w, with
    a = s' (J even) or s' / 16 times 16 c (J odd) in fp16, summed over axis 0 in fp16."""
    if J % 2 == 0:
        a = a16
        t = ((w >> (4 * J)) & 15).to(tl.float32) + 1024.0
    else:
        a = (a16 * 0.0625).to(tl.float16).to(tl.float32)
        t = ((w >> (4 * J)) & 15).to(tl.float32) * 16.0 + 1024.0
    na = (a * -1024.0).to(tl.float16).to(tl.float32)
    p = (t * a + na).to(tl.float16)
    return tl.reduce(p, 0, _hadd).to(tl.float32)


@triton.jit
def _store_col(P, base, wcol, wm, acc, boff, J: tl.constexpr):
    tl.store(P + base + wcol * 8 + J, tl.sum(acc, axis=0) + boff[:, None], mask=wm)


@triton.jit
def _add_when_last(P, H, B, Y, lock, i, n, S: tl.constexpr, HAS_B: tl.constexpr, Q, QS: tl.constexpr = 0,
                   WAIT: tl.constexpr = 0):
    """For a launch whose S programs (one per partial) each store their partials [S, n] at entries ``i``: count this
    program done on its ``lock``; the last of the S sums the partials in order (``decode_add_partials``'s sum, from
    L2), then the QS partials [QS, n] of Q (none where QS is 0; WAIT: after the PDL wait, Q being the kernel before's
    output: nested_down.py), adds the bias B and the residual H and stores h' in Y's dtype, rounded once; then clears
    the lock for the next launch. (The residual add of a decode step inside the down kernel's launch.)"""
    tl.debug_barrier()  # every thread's stores before the count (the atomic's release, by one thread, covers them)
    done = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
    if done == S - 1:
        tl.debug_barrier()  # the acquire (one thread) before any thread reads the others' partials
        if WAIT:
            gdc_wait()
        DT: tl.constexpr = Y.dtype.element_ty
        y = partial_sum(P, B, i, n, S, 0, True)
        for k in tl.static_range(QS):
            y += tl.load(Q + k * n + i, mask=i < n, other=0.0, cache_modifier=".cg")
        if HAS_B:
            y += tl.load(B + i, mask=i < n, other=0.0).to(tl.float32)
        y = tl.load(H + i, mask=i < n, other=0.0).to(tl.float32) + y
        tl.store(Y + i, round_to(y, DT).to(DT), mask=i < n)
        tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def rows_down_kernel(IDX, SV, CNT, O, WD, SCD, OFD, P, H, B, Y, LOCK, n_sets, d_inter, n_words, n_groups, n_pos,
                 SET: tl.constexpr, SUB: tl.constexpr, UR: tl.constexpr, NW: tl.constexpr, GPS: tl.constexpr,
                 WPG: tl.constexpr, ASM: tl.constexpr, BIG: tl.constexpr, OS: tl.constexpr, MODE: tl.constexpr,
                 ACT: tl.constexpr, AHEAD: tl.constexpr = 1, FIX: tl.constexpr = 0, NP: tl.constexpr = 1,
                 HAS_B: tl.constexpr = 0, PDL: tl.constexpr = 0, EARLY: tl.constexpr = 0):
    # A tile is UR x NW kept rows, words [UR, NW, GPS, WPG]: NW row streams (a warp each where a warp's threads cover
    # GPS x WPG words) keep their own accumulators, summed across streams once at the end; a stream's UR rows are
    # summed inside each thread, in fp16x2 (s' = s scale 2**e, e per stream and group putting the largest |s'| of the
    # tile in [16, 32): -1024 s' stays an fp16 even where s' rounds up to 32, and a sum of UR <= 16 products c s' stays
    # in fp16's range), then added to
    # fp32 times 2**-e. Tiles are requested ahead: the rows of tile q + AHEAD + 1 and the words of tile q + AHEAD (whose
    # rows came in the iteration before) while tile q is summed, so no word load waits on a row number just requested;
    # AHEAD = 2 keeps two tiles' words in flight a warp (twice the bytes in flight with one warp a program).
    # EARLY (PDL behind the other GEMV, which signals only once past its own wait, so the select kernel has finished):
    # the lists, the first tiles' words and the counts are read before the wait, the other GEMV's partials after it.
    if PDL:  # launched early (PDL)
        gdc_launch_dependents()
        if not EARLY:  # the row lists are the select kernel's output: nothing before the wait
            gdc_wait()
    part = tl.program_id(0)
    gi = tl.program_id(1) * GPS + tl.arange(0, GPS)               # this column slice's groups
    gm = gi < n_groups
    wcol = gi[:, None] * WPG + tl.arange(0, WPG)[None, :]         # [GPS, WPG] word index in a row
    wm = gm[:, None] & (tl.arange(0, WPG) < WPG)[None, :]
    T: tl.constexpr = UR * NW
    total = q_total(CNT, part, n_sets, SUB, T, EARLY)
    slot = tl.arange(0, UR)[:, None] * NW + tl.arange(0, NW)[None, :]
    rows, pos, ok, s = _listed_rows(IDX, SV, CNT, 0, part, n_sets, slot, d_inter, SET, SUB, T, EARLY)
    w, sc, of = _rows4(WD, SCD, OFD, rows, d_inter, n_words, n_groups, wcol, gi, gm, BIG)
    if AHEAD == 2:  # tile 1's words too, tile 2's rows
        rows_m, pos_m, ok_m, s_m = _listed_rows(IDX, SV, CNT, 1, part, n_sets, slot, d_inter, SET, SUB, T, EARLY)
        w_m, sc_m, of_m = _rows4(WD, SCD, OFD, rows_m, d_inter, n_words, n_groups, wcol, gi, gm, BIG)
    rows_n, pos_n, ok_n, s_n = _listed_rows(IDX, SV, CNT, AHEAD, part, n_sets, slot, d_inter, SET, SUB, T, EARLY)
    if EARLY:
        if PDL:
            gdc_wait()  # the other GEMV's partials: s of the rows above
    s = _s_of(O, s, pos, ok, n_pos, OS, MODE, ACT)
    if AHEAD == 2:
        s_m = _s_of(O, s_m, pos_m, ok_m, n_pos, OS, MODE, ACT)
    s_n = _s_of(O, s_n, pos_n, ok_n, n_pos, OS, MODE, ACT)
    acc0 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc1 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc2 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc3 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc4 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc5 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc6 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc7 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    boff = tl.zeros([UR, NW, GPS], dtype=tl.float32)
    for q in range(0, total):
        rows_nn, s_nn = _slots(IDX, SV, CNT, O, q + AHEAD + 1, part, n_sets, slot, d_inter, n_pos, SET, SUB, T, OS,
                               MODE, ACT)
        w_n, sc_n, of_n = _rows4(WD, SCD, OFD, rows_n, d_inter, n_words, n_groups, wcol, gi, gm, BIG)
        boff += s[:, :, None] * of
        sa = s[:, :, None] * sc                                    # [UR, NW, GPS]: s * scale
        ebits = (tl.max(tl.abs(sa), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.minimum(tl.maximum(131 - ebits, -126), 126)        # [NW, GPS]: max |s'| in [16, 32)
        dn = (((127 - e) << 23).to(tl.float32, bitcast=True))[:, :, None]
        sa = (sa * ((e + 127) << 23).to(tl.float32, bitcast=True)[None, :, :])[:, :, :, None]
        if ASM:
            p0, p1, p2, p3 = _products_asm(w, sa)
            acc0, acc4 = _flush_asm(tl.reduce(p0, 0, _hadd2), dn, acc0, acc4)
            acc1, acc5 = _flush_asm(tl.reduce(p1, 0, _hadd2), dn, acc1, acc5)
            acc2, acc6 = _flush_asm(tl.reduce(p2, 0, _hadd2), dn, acc2, acc6)
            acc3, acc7 = _flush_asm(tl.reduce(p3, 0, _hadd2), dn, acc3, acc7)
        else:
            a16 = sa.to(tl.float16).to(tl.float32)
            acc0 += _nibble_sum(w, 0, a16) * dn
            acc1 += _nibble_sum(w, 1, a16) * dn
            acc2 += _nibble_sum(w, 2, a16) * dn
            acc3 += _nibble_sum(w, 3, a16) * dn
            acc4 += _nibble_sum(w, 4, a16) * dn
            acc5 += _nibble_sum(w, 5, a16) * dn
            acc6 += _nibble_sum(w, 6, a16) * dn
            acc7 += _nibble_sum(w, 7, a16) * dn
        if AHEAD == 2:
            s, w, sc, of, s_m, w_m, sc_m, of_m = s_m, w_m, sc_m, of_m, s_n, w_n, sc_n, of_n
        else:
            s, w, sc, of = s_n, w_n, sc_n, of_n
        rows_n, s_n = rows_nn, s_nn
    if BIG:
        base = part.to(tl.int64) * n_words * 8
    else:
        base = part * n_words * 8
    boff = tl.sum(tl.sum(boff, axis=0), axis=0)
    _store_col(P, base, wcol, wm, acc0, boff, 0)
    _store_col(P, base, wcol, wm, acc1, boff, 1)
    _store_col(P, base, wcol, wm, acc2, boff, 2)
    _store_col(P, base, wcol, wm, acc3, boff, 3)
    _store_col(P, base, wcol, wm, acc4, boff, 4)
    _store_col(P, base, wcol, wm, acc5, boff, 5)
    _store_col(P, base, wcol, wm, acc6, boff, 6)
    _store_col(P, base, wcol, wm, acc7, boff, 7)
    if FIX:  # the last program of this column slice adds the residual (and the bias) to the slice's partials
        cols = wcol[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]   # the slice's columns (all < n_cols where wm)
        _add_when_last(P, H, B, Y, LOCK + tl.program_id(1), cols, n_words * 8, NP, HAS_B, P)


def column_slices(n_words: int, n_groups: int, cfg: dict) -> tuple[int, int]:
    """(groups a column slice, column slices) of the down kernel's grid for W~d^T rows of ``n_words`` words in
    ``n_groups`` groups: SLICE words a slice."""
    gps = min(pow2(n_groups), max(1, cfg["SLICE"] // (n_words // n_groups)))
    return gps, -(-n_groups // gps)


def down(idx, sv, cnt, counters, words_d, sc_d, of_d, cfg, other=None, mode="dual", activation="silu", residual=None,
         bias=None) -> torch.Tensor:
    """The down kernel: fp32 partials [P, d_model] of s times the kept rows of W~d^T (``select``'s lists), or with a
    ``residual`` h ([1, d_model]) h + their sum (+ ``bias``) in h's dtype, in the same launch (``counters``: int32, a
    zero for each of :func:`column_slices`' slices, as ``select`` leaves them; each launch leaves them at 0). ``other``:
    the other GEMV's partial sums at the lists' positions (``rows_other.other``) for mode "abs" / "abs_act",
    whose s is formed from them and the indicator value in ``sv``; None: ``sv`` holds s (dual). (Spy hook:
    ``on_launch("int4_rows_down", idx, mode)``.)"""
    d_inter, n_words = words_d.shape
    n_groups = sc_d.shape[1]
    n_parts = -(-(-(-d_inter // cfg["SET"])) // cfg["SUB"])  # one partial per SUB sets of SET rows
    out = new_output((n_parts, 8 * n_words), torch.float32, words_d.device)
    pdl = pdl_mode(words_d)
    gps, n_slices = column_slices(n_words, n_groups, cfg)
    fix = residual is not None
    if fix:
        if residual.numel() != 8 * n_words or (bias is not None and bias.numel() != 8 * n_words):
            raise ValueError(f"the down kernel's residual and bias have d_model = {8 * n_words} entries, got "
                             f"{tuple(residual.shape)} and {None if bias is None else tuple(bias.shape)}")
        if counters is None or counters.dtype != torch.int32 or counters.numel() < n_slices:
            raise ValueError(f"the down kernel's residual add counts finished programs in {n_slices} int32 zeros "
                             f"(select's fourth output); got {None if counters is None else counters.dtype}")
        y = new_output(tuple(residual.shape), residual.dtype, words_d.device)
    launching("int4_rows_down", idx, mode)
    rows_down_kernel[(n_parts, n_slices)](
        idx, sv, cnt, sv if other is None else other, words_d.contiguous(), sc_d.contiguous(), of_d.contiguous(), out,
        residual.contiguous() if fix else out, bias.contiguous() if bias is not None else out, y if fix else out,
        counters if fix else cnt, cnt.numel(), d_inter, n_words, n_groups, idx.numel(), SET=cfg["SET"],
        SUB=cfg["SUB"], UR=cfg["UR"], NW=cfg["NW"], GPS=gps, WPG=n_words // n_groups, AHEAD=cfg["AHEAD"],
        ASM=words_d.device.type == "cuda" and not interpreting(),
        BIG=d_inter * n_words >= 2**31 or n_parts * 8 * n_words >= 2**31, OS=0 if other is None else other.shape[0],
        MODE=KEEP_RULES[mode], ACT=act_code(activation), FIX=int(fix), NP=n_parts,
        HAS_B=int(bias is not None), PDL=pdl, EARLY=int(bool(cfg["EARLY"] and other is not None)),
        num_warps=cfg["NW"], num_stages=1, **launch_kwargs(pdl))
    return y if fix else out
