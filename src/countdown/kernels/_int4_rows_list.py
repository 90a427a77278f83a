"""Triton helpers: the select kernel's compacted row lists, walked in tiles (kernels/_int4_rows.py).

The select kernel writes each set of SET rows' kept rows compacted at the set's own offset (``IDX[b SET + m]``,
m < ``CNT[b]``). A program of the other GEMV or of the down kernel takes SUB consecutive sets and walks their kept
rows as one flat sequence of tiles of T rows: a set's last tile is padded (its slots past the count give no row),
the next set starts a new tile. The set of a tile is found by scalar arithmetic on the sets' counts (a reduction
over the sets would cross warps at every tile: a shared-memory round trip and barriers, session 30).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def q_total(CNT, part, n_sets, SUB: tl.constexpr, T: tl.constexpr):
    """The number of tiles of T rows of program ``part``'s SUB sets."""
    total = part * 0
    for jj in tl.static_range(SUB):
        set_j = part * SUB + jj
        total += (tl.load(CNT + set_j, mask=set_j < n_sets, other=0) + T - 1) // T
    return total


@triton.jit
def tile_at(IDX, CNT, q, part, n_sets, slot, d_inter, SET: tl.constexpr, SUB: tl.constexpr, T: tl.constexpr):
    """(row numbers, list positions, valid) of tile ``q`` of program ``part``'s sets at ``slot`` (values 0..T-1, any
    shape): row d_inter and valid False past a set's count, and everywhere for q at or past the tiles' number. The
    counts are read again each tile (from L1)."""
    end = q * 0
    first = end
    cnt = end
    j = end
    for jj in tl.static_range(SUB):
        set_j = part * SUB + jj
        c = tl.load(CNT + set_j, mask=set_j < n_sets, other=0)
        t = (c + T - 1) // T
        inside = (q >= end) & (q < end + t)
        first = tl.where(inside, end, first)
        cnt = tl.where(inside, c, cnt)
        j = tl.where(inside, jj, j)
        end += t
    m = (q - first) * T + slot
    valid = m < cnt
    pos = (part * SUB + j) * SET + m
    rows = tl.load(IDX + pos, mask=valid, other=0)
    return tl.where(valid, rows, d_inter), pos, valid
