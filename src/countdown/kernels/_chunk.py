"""Triton helpers: one chunk of a one-token sparse kernel, from its indicators to its kept rows' sum.

``_row_thresholds`` and ``_kept_places`` are shared by _onepass.py, _overlap.py and _split.py: the chunk's
thresholds (its rows' own or one for all) and, from the keep rule, each kept row's place among the chunk's
kept rows. ``_add_kept_rows`` (_onepass.py's own chunks, _overlap.py's consumers' chunks): given a chunk's
rows ``r`` [CHUNK], its indicator ``ind`` and the kept rows' places ``pos`` (-1 where not kept; 0 .. cnt-1 in
row order, from a prefix sum of the keep mask), the kept rows are taken BLOCK_M at a time: a one-hot select
puts them in a tile's slots, every load of the tile (gate / up rows where GATE / UP, W_down^T rows) is issued
before any arithmetic (one round trip), and s W_down rows are added into ``yacc`` (_glu._accumulate_rows).
STAGES > 1 software-pipelines the tile loop (tl.range's num_stages: the next tile's loads in flight).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._glu import _accumulate_rows, _keep, _row_tiles


@triton.jit
def _row_thresholds(THR, r, rmask, thr_s, THR_VEC: tl.constexpr):
    """Rows ``r``'s thresholds: their own (THR_VEC: THR holds one per row, fp32) or ``thr_s`` for all."""
    if THR_VEC:  # (if / else, one return each: a return after a constexpr if fails to compile for the GPU)
        return tl.load(THR + r, mask=rmask, other=0.0).to(tl.float32)
    else:
        return thr_s


@triton.jit
def _kept_places(ind, thr, rmask, MODE: tl.constexpr, ACT: tl.constexpr):
    """(pos, cnt): each row's place among the chunk's kept rows in row order (-1 where not kept, or past
    ``rmask``) and how many are kept (the MODEs of _glu._keep)."""
    keep = (_keep(ind, thr, MODE, ACT) & rmask).to(tl.int32)
    return tl.where(keep > 0, tl.cumsum(keep, axis=0) - 1, -1), tl.sum(keep, axis=0)


@triton.jit
def _add_kept_rows(yacc, pos, cnt, r, ind, xv, kd, WG, WU, WD, d_model, GATE: tl.constexpr, UP: tl.constexpr,
                   ACT: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr, BIG: tl.constexpr,
                   EVEN_D: tl.constexpr, DT: tl.constexpr):
    for t in tl.range(0, cnt, BLOCK_M, num_stages=STAGES):
        m = t + tl.arange(0, BLOCK_M)
        valid = m < cnt
        sel = pos[None, :] == m[:, None]  # [BLOCK_M, CHUNK] one-hot: tile slot -> chunk row
        rows = tl.sum(tl.where(sel, r[None, :], 0), axis=1)
        it = tl.sum(tl.where(sel, ind[None, :], 0.0), axis=1)
        roff, wmask = _row_tiles(rows, valid, kd, d_model, BIG, EVEN_D)
        if GATE:
            wg = tl.load(WG + roff, mask=wmask, other=0.0)
        else:  # the indicator is g itself (cats)
            wg = it
        if UP:
            wu = tl.load(WU + roff, mask=wmask, other=0.0)
        else:  # the indicator is u itself (mono)
            wu = it
        wd = tl.load(WD + roff, mask=wmask, other=0.0)
        yacc = _accumulate_rows(yacc, wg, wu, wd, xv, valid, GATE, UP, ACT, DT)
    return yacc
