"""Triton kernels: the kept rows of a 4-bit Gated-MLP for one token (sparse rows on 4-bit weights).

On a 4-bit model (``countdown.int4``), for one token x whose indicator GEMV has already run (``kernels/_int4.py``,
fp32 partial sums over slices of K):

    "abs"     (mono)  ind = u = x W_up~^T      keep |u| > t          g of the kept rows from their W_gate~ rows
    "abs_act" (cats)  ind = g = x W_gate~^T    keep |act(g)| > t     u of the kept rows from their W_up~ rows
    "dual"    (dual)  ind = (g, u), both       keep |act(g) u| > t   (nothing more to compute)
    s[i] = u[i] act(g[i])                      kept rows only
    P[b] = sum over the kept rows of row set b of s[i] Wd~t[i]      fp32 partials [n_parts, d_model]

and y = P.sum(0) is left to the caller (a decode step adds it to the residual in one launch:
``decode_add_partials``). Wd~t is W_down^T in the 4-bit format, ``[d_inter, d_model]`` with groups along d_model: a
kept row is one contiguous run of d_model / 2 bytes and d_model / G scales and offsets, so a skipped row is bytes not
read. (In W_down's own layout, groups along d_inter, a row of W_down^T is one nibble of every word: nothing could be
skipped; docs/int4.md measures what the transposed grouping costs in quality.) Bytes a token: the indicator's matrix
in full (both for dual), then for each kept row one row of the other matrix (not for dual) and one row of Wd~t.

Two launches, each shaped like a GEMV rather than like a loop over chunks:

* **select** (one program per set of SET rows): sums the indicator's partials CHUNK rows at a time, keeps the rows
  past the threshold and writes them compacted (``IDX``: row numbers, ``SV``: their indicator), in row order, at the
  set's own offset, and their count (``CNT``). For mono / cats it then walks the compacted list BM rows at a time
  (the rows two tiles ahead and the words of the next requested before the current one's arithmetic) computing the
  other GEMV's rows
  (the dot products of kernels/_int4.py: x paired once per program) and overwrites ``SV`` with s. The kernel counts
  its kept rows (Sparsity-Real, ``_count.py``).
* **down** (a grid of SUB sets x column slices of SLICE words): NW warps a program, each its own stream of kept rows
  with its own accumulators (summed across the warps once, at the end), UR rows of a stream a tile (one flat loop over
  the sets' tiles: the rows two tiles ahead and the words of the next requested before the current one's arithmetic).
  A stream's UR rows are summed inside each thread as fp16x2 products: one ``lop3`` puts two nibbles in 1024's
  mantissa (as kernels/_gemv.py), one fma with (s', s') and -1024 (s', s') leaves c s' rounded once, s' = s scale
  2**e scaled per stream and group; then added to fp32 times 2**-e. The offsets' term (``s offset`` per group) is
  fp32. Partials are written whole (deterministic: no atomics but the count).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._count import add_count
from ._gemv import _word_dot, _xload
from ._glu import _act, _pow2
from ._int4 import _paired_x, _tile

MODES = {"abs": 0, "abs_act": 1, "dual": 2}
# select: SET rows a program, read CHUNK at a time, the other GEMV BM kept rows a tile on A_WARPS warps;
# down: SUB sets a program, d_model cut in column slices of SLICE words (128: a warp's 32 threads x 4 words), NW
# warps a program (one row stream each), UR rows a stream a tile. The fastest of benchmarks/int4_decode.py --parts
# rows at the Llama-3.1-8B MLP (NVIDIA H200, 2026-11-28, run R4 of results/int4/rows.csv; dual's best select launch
# differs by less than 1 %).
CONFIG = dict(CHUNK=64, SET=128, BM=8, A_WARPS=8, SUB=2, SLICE=128, UR=4, NW=4)


@triton.jit
def _select_kernel(IND, X, WO, SCO, OFO, IDX, SV, CNT, THR, KEPT, ROWS, d_inter, n_words, n_groups, ind_stride,
                   MODE: tl.constexpr, ACT: tl.constexpr, S: tl.constexpr, CHUNK: tl.constexpr, SET: tl.constexpr,
                   BM: tl.constexpr, SG: tl.constexpr, WPG: tl.constexpr, ASM: tl.constexpr, BIG: tl.constexpr,
                   COUNT: tl.constexpr):
    b = tl.program_id(0)
    set0 = b * SET
    if MODE != 2:  # x of the other GEMV first (paired as kernels/_int4.py pairs it): its loads overlap the indicator's
        gl = tl.arange(0, SG)
        gm = gl < n_groups
        wcol = gl[:, None] * WPG + tl.arange(0, WPG)[None, :]
        wm = gm[:, None] & (tl.arange(0, WPG) < WPG)[None, :]
        xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3 = _paired_x(
            _xload(X, wcol, wm, 0, 8), _xload(X, wcol, wm, 1, 8), _xload(X, wcol, wm, 2, 8),
            _xload(X, wcol, wm, 3, 8), _xload(X, wcol, wm, 4, 8), _xload(X, wcol, wm, 5, 8),
            _xload(X, wcol, wm, 6, 8), _xload(X, wcol, wm, 7, 8))
    thr = tl.load(THR).to(tl.float32)
    cr = tl.arange(0, CHUNK)
    n = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), axis=0)
    for c0 in tl.static_range(0, SET, CHUNK):
        r = set0 + c0 + cr
        rm = r < d_inter
        a = tl.zeros([CHUNK], dtype=tl.float32)
        g2 = tl.zeros([CHUNK], dtype=tl.float32)
        for i in tl.static_range(S):  # the indicator GEMV's partial sums over its slices of K
            a += tl.load(IND + i * ind_stride + r, mask=rm, other=0.0)
            if MODE == 2:
                g2 += tl.load(IND + i * ind_stride + d_inter + r, mask=rm, other=0.0)
        if MODE == 0:
            ind = a                      # u
        elif MODE == 1:
            ind = _act(a, ACT)           # act(g)
        else:
            ind = _act(a, ACT) * g2      # s = act(g) u
            a = ind
        keep = (tl.abs(ind) > thr) & rm
        ki = keep.to(tl.int32)
        pos = set0 + n + tl.cumsum(ki, axis=0) - 1
        tl.store(IDX + pos, r, mask=keep)
        tl.store(SV + pos, a, mask=keep)   # u (mono), g (cats) or s (dual)
        n += tl.sum(ki, axis=0)
    tl.store(CNT + b, n)
    if COUNT:
        add_count(KEPT, ROWS, n, d_inter, b == 0)
    if MODE != 2:  # s of the kept rows: the other GEMV's rows, BM at a time
        tl.debug_barrier()  # the compacted list, written by every thread of the program, is read back below
        ri = tl.arange(0, BM)
        rows = tl.where(ri < n, tl.load(IDX + set0 + ri, mask=ri < n, other=0), d_inter)
        av = tl.load(SV + set0 + ri, mask=ri < n, other=0.0)
        w, sc, of = _tile(WO, SCO, OFO, rows, d_inter, n_words, n_groups, wcol, gl, gm, BIG)
        rows_n = tl.where(BM + ri < n, tl.load(IDX + set0 + BM + ri, mask=BM + ri < n, other=0), d_inter)
        av_n = tl.load(SV + set0 + BM + ri, mask=BM + ri < n, other=0.0)
        for t in range(0, n, BM):
            mn = t + 2 * BM + ri  # the rows two tiles ahead, the words of the next tile (its rows are in)
            rows_nn = tl.where(mn < n, tl.load(IDX + set0 + mn, mask=mn < n, other=0), d_inter)
            av_nn = tl.load(SV + set0 + mn, mask=mn < n, other=0.0)
            w_n, sc_n, of_n = _tile(WO, SCO, OFO, rows_n, d_inter, n_words, n_groups, wcol, gl, gm, BIG)
            d = _word_dot(w, h0[None], h1[None], h2[None], h3[None], h4[None], h5[None], h6[None], h7[None],
                          e0, e1, e2, e3, 4, ASM)
            o = tl.sum(tl.sum(d, axis=2) * sc, axis=1) * down + tl.sum((of + 8.0 * sc) * xs[None, :], axis=1)
            if MODE == 0:
                sv = av * _act(o, ACT)   # u act(g)
            else:
                sv = o * _act(av, ACT)   # u act(g)
            tl.store(SV + set0 + t + ri, sv, mask=t + ri < n)
            av, w, sc, of, rows_n, av_n = av_n, w_n, sc_n, of_n, rows_nn, av_nn


@triton.jit
def _slots(IDX, SV, q, part, sj, cnts, tiles, ends, slot, d_inter, SET: tl.constexpr, SUB: tl.constexpr,
           T: tl.constexpr):
    """Row numbers (d_inter past the end) and s of tile ``q`` of a down program's sets, at ``slot`` (values 0..T-1,
    any shape): a flat walk of the sets' tiles of T rows; q at or past their sum gives no row."""
    j = tl.sum((ends <= q).to(tl.int32), axis=0)                 # the set holding tile q
    sel = sj == j
    first = tl.sum(tl.where(sel, ends - tiles, 0), axis=0)
    cnt = tl.sum(tl.where(sel, cnts, 0), axis=0)
    m = (q - first) * T + slot
    valid = m < cnt
    base = (part * SUB + j) * SET
    rows = tl.load(IDX + base + m, mask=valid, other=0)
    return tl.where(valid, rows, d_inter), tl.load(SV + base + m, mask=valid, other=0.0)


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
    mantissa (lop3, as kernels/_gemv.py), one fma with (s', s') or (s' / 16, s' / 16) and minus 1024 times it (exact)
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
def _down_kernel(IDX, SV, CNT, WD, SCD, OFD, P, n_sets, d_inter, n_words, n_groups, SET: tl.constexpr,
                 SUB: tl.constexpr, SUBP: tl.constexpr, UR: tl.constexpr, NW: tl.constexpr, GPS: tl.constexpr,
                 WPG: tl.constexpr, ASM: tl.constexpr, BIG: tl.constexpr):
    # A tile is UR x NW kept rows, words [UR, NW, GPS, WPG]: NW row streams (a warp each where a warp's threads cover
    # GPS x WPG words) keep their own accumulators, summed across streams once at the end; a stream's UR rows are
    # summed inside each thread, in fp16x2 (s' = s scale 2**e, e per stream and group putting the largest |s'| of the
    # tile in [16, 32): -1024 s' stays an fp16 even where s' rounds up to 32, and a sum of UR <= 16 products c s' stays
    # in fp16's range), then added to
    # fp32 times 2**-e. Tiles are requested ahead: the rows of tile q + 2 and the words of tile q + 1 (whose rows came
    # in the iteration before) while tile q is summed, so no word load waits on a row number just requested.
    part = tl.program_id(0)
    gi = tl.program_id(1) * GPS + tl.arange(0, GPS)               # this column slice's groups
    gm = gi < n_groups
    wcol = gi[:, None] * WPG + tl.arange(0, WPG)[None, :]         # [GPS, WPG] word index in a row
    wm = gm[:, None] & (tl.arange(0, WPG) < WPG)[None, :]
    sj = tl.arange(0, SUBP)
    sets = part * SUB + sj
    cnts = tl.load(CNT + sets, mask=(sj < SUB) & (sets < n_sets), other=0)
    T: tl.constexpr = UR * NW
    tiles = (cnts + T - 1) // T
    ends = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    slot = tl.arange(0, UR)[:, None] * NW + tl.arange(0, NW)[None, :]
    rows, s = _slots(IDX, SV, 0, part, sj, cnts, tiles, ends, slot, d_inter, SET, SUB, T)
    w, sc, of = _rows4(WD, SCD, OFD, rows, d_inter, n_words, n_groups, wcol, gi, gm, BIG)
    rows_n, s_n = _slots(IDX, SV, 1, part, sj, cnts, tiles, ends, slot, d_inter, SET, SUB, T)
    acc0 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc1 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc2 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc3 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc4 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc5 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc6 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    acc7 = tl.zeros([NW, GPS, WPG], dtype=tl.float32)
    boff = tl.zeros([NW, GPS], dtype=tl.float32)
    for q in range(0, total):
        rows_nn, s_nn = _slots(IDX, SV, q + 2, part, sj, cnts, tiles, ends, slot, d_inter, SET, SUB, T)
        w_n, sc_n, of_n = _rows4(WD, SCD, OFD, rows_n, d_inter, n_words, n_groups, wcol, gi, gm, BIG)
        boff += tl.sum(s[:, :, None] * of, axis=0)
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
        s, w, sc, of, rows_n, s_n = s_n, w_n, sc_n, of_n, rows_nn, s_nn
    if BIG:
        base = part.to(tl.int64) * n_words * 8
    else:
        base = part * n_words * 8
    boff = tl.sum(boff, axis=0)
    _store_col(P, base, wcol, wm, acc0, boff, 0)
    _store_col(P, base, wcol, wm, acc1, boff, 1)
    _store_col(P, base, wcol, wm, acc2, boff, 2)
    _store_col(P, base, wcol, wm, acc3, boff, 3)
    _store_col(P, base, wcol, wm, acc4, boff, 4)
    _store_col(P, base, wcol, wm, acc5, boff, 5)
    _store_col(P, base, wcol, wm, acc6, boff, 6)
    _store_col(P, base, wcol, wm, acc7, boff, 7)


def _words(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int32 words [N, K / 8], scale, offset) of an Int4Weight-like object (qweight, scale, offset)."""
    return weight.qweight.view(torch.int32), weight.scale, weight.offset


def _config(config: dict | None) -> dict:
    cfg = {**CONFIG, **(config or {})}
    cfg["CHUNK"] = min(cfg["CHUNK"], cfg["SET"])
    if cfg["SET"] % cfg["CHUNK"]:
        raise ValueError(f"SET ({cfg['SET']}) must be a multiple of CHUNK ({cfg['CHUNK']})")
    return cfg


def programs(d_inter: int, config: dict | None = None) -> int:
    """How many partials [P, d_model] the kernels write for ``d_inter`` rows: one per SUB sets of SET rows."""
    cfg = _config(config)
    return -(-(-(-d_inter // cfg["SET"])) // cfg["SUB"])


def kept_rows(ind: torch.Tensor, x: torch.Tensor, other, down_t, threshold: torch.Tensor, mode: str,
              activation: str = "silu", count: tuple[torch.Tensor, torch.Tensor] | None = None,
              config: dict | None = None) -> torch.Tensor:
    """fp32 partials ``[P, d_model]`` whose sum over P is the sparse MLP's output for one token ``x [1, d_model]``.

    ``ind``: the indicator GEMV's fp32 partial sums, ``[S, d_inter]`` (u for mode "abs", g for "abs_act") or
    ``[S, 2, d_inter]`` (g and u, mode "dual"); ``other``: the 4-bit weight (``qweight``, ``scale``, ``offset``) whose
    kept rows are computed (W_gate for "abs", W_up for "abs_act"; None for "dual"); ``down_t``: W_down^T in the
    format, ``[d_inter, d_model]``; ``threshold``: a one-value fp32 tensor; ``count`` = (kept, rows): the kept rows
    added to a patched layer's Sparsity-Real counters."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    words_d, sc_d, of_d = _words(down_t)
    words_o, sc_o, of_o = _words(other) if other is not None else (None, None, None)
    return launch(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, mode, activation, count, config)


def launch(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, mode, activation="silu", count=None,
           config=None) -> torch.Tensor:
    """:func:`kept_rows` on the weights' tensors (words int32 [d_inter, d_model / 8], scales, offsets; the other
    weight's None for mode "dual")."""
    d_inter, n_words = words_d.shape
    d_model, n_groups = 8 * n_words, sc_d.shape[1]
    dual = mode == "dual"
    want = (2 * d_inter) if dual else d_inter
    if ind.dtype != torch.float32 or ind.numel() % want or x.numel() != d_model or (words_o is None) != dual:
        raise ValueError(f"kept_rows takes fp32 indicator partials [S, {'2, ' if dual else ''}{d_inter}], one token x "
                         f"[1, {d_model}] and {'no other weight' if dual else 'the other weight'} for mode {mode!r}; "
                         f"got ind {ind.dtype} {tuple(ind.shape)}, x {tuple(x.shape)}")
    if words_o is not None:
        if words_o.shape != words_d.shape or sc_o.shape != sc_d.shape:
            raise ValueError(f"the other weight's rows must match W_down^T's: words {tuple(words_o.shape)} vs "
                             f"{tuple(words_d.shape)}, scales {tuple(sc_o.shape)} vs {tuple(sc_d.shape)}")
    else:
        words_o, sc_o, of_o = words_d, sc_d, of_d  # not read
    cfg = _config(config)
    return down(*select(ind, x, words_o, sc_o, of_o, threshold, mode, activation, count, cfg), words_d, sc_d, of_d,
                cfg)


def select(ind, x, words_o, sc_o, of_o, threshold, mode, activation, count, cfg):
    """The select kernel: (IDX, SV, CNT), the kept rows of each set of ``cfg["SET"]`` rows compacted (row numbers, s),
    and their count per set. ``words_o`` etc.: the other weight's (W_down^T's for dual: any of the same shape)."""
    from ._common import act_code, interpreting

    (d_inter, n_words), n_groups = words_o.shape, sc_o.shape[1]
    n_sets = -(-d_inter // cfg["SET"])
    want = (2 * d_inter) if mode == "dual" else d_inter
    idx = torch.empty(n_sets * cfg["SET"], dtype=torch.int32, device=x.device)
    sv = torch.empty(n_sets * cfg["SET"], dtype=torch.float32, device=x.device)
    cnt = torch.empty(n_sets, dtype=torch.int32, device=x.device)
    kept, rows = count if count is not None else (cnt, cnt)
    _select_kernel[(n_sets,)](
        ind.contiguous(), x.contiguous(), words_o.contiguous(), sc_o.contiguous(), of_o.contiguous(), idx, sv, cnt,
        threshold.reshape(1).to(device=x.device, dtype=torch.float32), kept, rows, d_inter, n_words, n_groups, want,
        MODE=MODES[mode], ACT=act_code(activation), S=ind.numel() // want, CHUNK=cfg["CHUNK"], SET=cfg["SET"],
        BM=cfg["BM"], SG=_pow2(n_groups), WPG=n_words // n_groups,
        ASM=x.device.type == "cuda" and not interpreting(), BIG=d_inter * n_words >= 2**31, COUNT=count is not None,
        num_warps=cfg["A_WARPS"], num_stages=1)
    return idx, sv, cnt


def down(idx, sv, cnt, words_d, sc_d, of_d, cfg) -> torch.Tensor:
    """The down kernel: fp32 partials [P, d_model] of s times the kept rows of W~d^T (``select``'s output)."""
    from ._common import interpreting, new_output

    d_inter, n_words = words_d.shape
    n_groups = sc_d.shape[1]
    n_parts = programs(d_inter, cfg)
    out = new_output((n_parts, 8 * n_words), torch.float32, words_d.device)
    wpg = n_words // n_groups
    gps = min(_pow2(n_groups), max(1, cfg["SLICE"] // wpg))  # groups of a column slice: SLICE words
    _down_kernel[(n_parts, -(-n_groups // gps))](
        idx, sv, cnt, words_d.contiguous(), sc_d.contiguous(), of_d.contiguous(), out, cnt.numel(), d_inter, n_words,
        n_groups, SET=cfg["SET"], SUB=cfg["SUB"], SUBP=_pow2(cfg["SUB"]), UR=cfg["UR"], NW=cfg["NW"], GPS=gps,
        WPG=wpg, ASM=words_d.device.type == "cuda" and not interpreting(),
        BIG=d_inter * n_words >= 2**31 or n_parts * 8 * n_words >= 2**31, num_warps=cfg["NW"], num_stages=1)
    return out


@torch.library.custom_op("countdown::int4_kept_rows", mutates_args=("kept", "rows"))
def _kept_rows_op(ind: torch.Tensor, x: torch.Tensor, words_o: torch.Tensor, sc_o: torch.Tensor, of_o: torch.Tensor,
                  words_d: torch.Tensor, sc_d: torch.Tensor, of_d: torch.Tensor, threshold: torch.Tensor,
                  keep_rule: str, activation: str, kept: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # (the rule is not called "mode": torch.compile's functionalization of a mutating op takes a "mode" of its own)
    from ._common import op_count

    other = (None, None, None) if keep_rule == "dual" else (words_o, sc_o, of_o)
    return launch(ind, x, *other, words_d, sc_d, of_d, threshold, keep_rule, activation, op_count(kept, rows))


@_kept_rows_op.register_fake
def _(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, keep_rule, activation, kept, rows):
    return x.new_empty((programs(words_d.shape[0]), 8 * words_d.shape[1]), dtype=torch.float32)


def kept_rows_ref(x: torch.Tensor, gate, up, down_t, threshold: float, mode: str, activation: str = "silu",
                  ind: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [d_model], keep [d_inter]) in float64 from the de-quantized weights (``Int4Weight``-like objects with
    ``dequantize``): what :func:`kept_rows` computes, with every product and sum exact to float64. ``ind``: the
    indicator GEMV's partials as the kernel takes them; the rows kept are then decided on their float32 sum, as the
    kernel decides them (the float64 indicator otherwise)."""
    from ._common import act_torch

    x64 = x.reshape(-1).double()
    g = gate.dequantize(torch.float64) @ x64
    u = up.dequantize(torch.float64) @ x64
    h = act_torch(g, activation)
    if ind is None:
        decide = {"abs": u, "abs_act": h, "dual": h * u}[mode]
    else:
        total = ind.float().sum(0).cpu()
        decide = {"abs": lambda: total, "abs_act": lambda: act_torch(total, activation),
                  "dual": lambda: act_torch(total[0], activation) * total[1]}[mode]()
    keep = decide.abs() > threshold
    s = torch.where(keep, u * h, torch.zeros((), dtype=torch.float64))
    return down_t.dequantize(torch.float64).t() @ s, keep
