"""Triton kernel: the other GEMV of sparse rows on 4-bit weights, on the kept rows only (mono: W_gate's rows, cats:
W_up's; rows.py says what the launches compute).

For one token x and the select kernel's compacted row lists, fp32 partial sums over slices of K at each kept row's
list position:

    O[s, b SET + m] = sum over the columns of slice s of W~o[IDX[b SET + m], :] x      m < CNT[b]

(positions past a set's count are not written: the down kernel reads none of them). The arithmetic is the dense
4-bit GEMV's (``gemv.py``: x of a slice paired once per program, ``word_dot`` on int32 words, the group's scale,
the asymmetric part in fp32), and so is the shape of the work: a program holds one slice of x (at most ``O_COLS``
columns) and walks the kept rows of ``O_SUB`` sets in tiles of ``O_R`` rows (``rows_list.py``), the rows two
tiles ahead and the words of the next requested before the current one's dot products (two tiles of words in flight
lost: docs/int4.md).
(The select kernel computed
these rows itself before, one program a set holding all of K: ~4 us a launch more than deciding the rows alone at
zero kept rows and ~1.6 us a tile of 8 rows, measured on an H200 on 2026-11-28; docs/int4.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import interpreting, new_output, pow2
from ..config import launch_kwargs, launching, pdl_mode
from ..jit_helpers import gdc_enter
from .gemv import _paired_x, _slice_grid, _tile, split_for
from .rows_list import q_total, tile_at
from .words import word_dot, xload


@triton.jit
def rows_other_kernel(X, WO, SCO, OFO, IDX, CNT, O, n_sets, d_inter, n_words, n_groups, n_pos, SET: tl.constexpr,
                  SUB: tl.constexpr, R: tl.constexpr, SLICE: tl.constexpr, SG: tl.constexpr, WPG: tl.constexpr,
                  ASM: tl.constexpr, BIG: tl.constexpr, PDL: tl.constexpr = 0, LATE: tl.constexpr = 0):
    if PDL:  # launched early (PDL): the row lists are the select kernel's output; LATE: the down kernel launches
        gdc_enter(LATE)  # once every program here is past its wait (select has finished: it reads the lists early)
    part = tl.program_id(0)
    s = tl.program_id(1)
    gi, gm, wcol, wm = _slice_grid(s, SLICE, SG, WPG)
    ri = tl.arange(0, R)
    total = q_total(CNT, part, n_sets, SUB, R)
    rows, pos, ok = tile_at(IDX, CNT, 0, part, n_sets, ri, d_inter, SET, SUB, R)
    w, sc, of = _tile(WO, SCO, OFO, rows, d_inter, n_words, n_groups, wcol, gi, gm, BIG)   # before x is paired
    rows_n, pos_n, ok_n = tile_at(IDX, CNT, 1, part, n_sets, ri, d_inter, SET, SUB, R)
    xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3 = _paired_x(
        xload(X, wcol, wm, 0, 8), xload(X, wcol, wm, 1, 8), xload(X, wcol, wm, 2, 8),
        xload(X, wcol, wm, 3, 8), xload(X, wcol, wm, 4, 8), xload(X, wcol, wm, 5, 8),
        xload(X, wcol, wm, 6, 8), xload(X, wcol, wm, 7, 8))
    if BIG:
        out = O + s.to(tl.int64) * n_pos
    else:
        out = O + s * n_pos
    for q in range(0, total):
        # the rows two tiles ahead, the words of the next tile (its rows came in the iteration before)
        rows_nn, pos_nn, ok_nn = tile_at(IDX, CNT, q + 2, part, n_sets, ri, d_inter, SET, SUB, R)
        w_n, sc_n, of_n = _tile(WO, SCO, OFO, rows_n, d_inter, n_words, n_groups, wcol, gi, gm, BIG)
        d = word_dot(w, h0[None], h1[None], h2[None], h3[None], h4[None], h5[None], h6[None], h7[None],
                     e0, e1, e2, e3, ASM)
        y = tl.sum(tl.sum(d, axis=2) * sc, axis=1) * down + tl.sum((of + 8.0 * sc) * xs[None, :], axis=1)
        tl.store(out + pos, y, mask=ok)
        w, sc, of, pos, ok = w_n, sc_n, of_n, pos_n, ok_n
        rows_n, pos_n, ok_n = rows_nn, pos_nn, ok_nn


def other(x, words_o, sc_o, of_o, idx, cnt, cfg) -> torch.Tensor:
    """fp32 partial sums ``[S, n_pos]`` of the other 4-bit weight's kept rows times ``x`` at the lists' positions
    (``idx``, ``cnt``: the select kernel's lists of sets of ``cfg["SET"]`` rows). Configuration: ``O_SUB`` sets a
    program, ``O_R`` rows a tile, ``O_COLS`` most columns of a slice, ``O_WARPS`` warps a program; ``EARLY`` (with
    PDL): the down kernel after it may launch only once this grid is past its wait (it then reads the lists before its
    own). (Spy hook: ``on_launch("int4_rows_other", x, idx)``.)"""
    (d_inter, n_words), n_groups = words_o.shape, sc_o.shape[1]
    group = 8 * n_words // n_groups
    n_splits = split_for(n_groups, group, cfg["O_COLS"])
    n_pos, n_sets = idx.numel(), cnt.numel()
    out = new_output((n_splits, n_pos), torch.float32, x.device)
    pdl = pdl_mode(x)
    launching("int4_rows_other", x, idx)
    rows_other_kernel[(-(-n_sets // cfg["O_SUB"]), n_splits)](
        x.contiguous(), words_o.contiguous(), sc_o.contiguous(), of_o.contiguous(), idx, cnt, out, n_sets, d_inter,
        n_words, n_groups, n_pos, SET=cfg["SET"], SUB=cfg["O_SUB"], R=cfg["O_R"], SLICE=n_groups // n_splits,
        SG=pow2(n_groups // n_splits), WPG=group // 8, ASM=x.device.type == "cuda" and not interpreting(),
        BIG=d_inter * n_words >= 2**31 or n_splits * n_pos >= 2**31, PDL=pdl, LATE=int(cfg["EARLY"]),
        num_warps=cfg["O_WARPS"], num_stages=1, **launch_kwargs(pdl))
    return out
