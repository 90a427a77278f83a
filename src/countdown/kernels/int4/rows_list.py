"""Triton helpers: the select kernel's compacted row lists, walked in tiles (rows.py).

The select kernel writes each set of SET rows' kept rows compacted at the set's own offset (``IDX[b SET + m]``,
m < ``CNT[b]``). A program of the other GEMV or of the down kernel takes SUB consecutive sets and walks their kept
rows as one flat sequence, packed across the sets (the rows of set j follow those of set j - 1 within a tile), in
tiles of T rows: only the program's last tile is padded. Which set a slot of a tile falls in is found from the sets'
counts by scalar prefix sums and SUB compares a slot (a reduction over the sets would cross warps at every tile: a
shared-memory round trip and barriers). (Each set starting a tile of its own left up to T - 1 empty slots
a set: at k = 0.7, SET 128 and T 32, 8 tiles a down program for 5 of rows.)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def listed(P, i, mask, other, CG: tl.constexpr):
    """P[i] of the select kernel's lists; CG: from L2, not L1 (read before the kernel's PDL wait, while the kernel
    before it still runs: nothing of them may come from an earlier launch's lines)."""
    return tl.load(P + i, mask=mask, other=other, cache_modifier=".cg" if CG else "")


@triton.jit
def q_total(CNT, part, n_sets, SUB: tl.constexpr, T: tl.constexpr, CG: tl.constexpr = False):
    """The number of tiles of T rows of program ``part``'s SUB sets."""
    total = part * 0
    for jj in tl.static_range(SUB):
        set_j = part * SUB + jj
        total += listed(CNT, set_j, set_j < n_sets, 0, CG)
    return (total + T - 1) // T


@triton.jit
def tile_at(IDX, CNT, q, part, n_sets, slot, d_inter, SET: tl.constexpr, SUB: tl.constexpr, T: tl.constexpr,
            CG: tl.constexpr = False):
    """(row numbers, list positions, valid) of tile ``q`` of program ``part``'s sets at ``slot`` (values 0..T-1, any
    shape): row d_inter and valid False past the sets' kept rows, and everywhere for q at or past the tiles' number.
    The counts are read again each tile (from L1)."""
    m = q * T + slot                     # the slot's place in the program's flat sequence of kept rows
    pos = m * 0 - 1                      # its list position (-1: past the end)
    start = q * 0
    for jj in tl.static_range(SUB):
        set_j = part * SUB + jj
        c = listed(CNT, set_j, set_j < n_sets, 0, CG)
        pos = tl.where((m >= start) & (m < start + c), set_j * SET + (m - start), pos)
        start += c
    valid = pos >= 0
    rows = listed(IDX, pos, valid, 0, CG)
    return tl.where(valid, rows, d_inter), pos, valid


@triton.jit
def set_counts(CNT, part, n_sets, SUB: tl.constexpr, SUBP: tl.constexpr, CG: tl.constexpr):
    """The kept counts [SUBP] of program ``part``'s SUB sets (0 past them): read once a program (from L2 where CG,
    where :func:`tile_at` reads them again each tile: nested_down.py)."""
    js = tl.arange(0, SUBP)
    set_j = part * SUB + js
    return listed(CNT, set_j, (js < SUB) & (set_j < n_sets), 0, CG)


@triton.jit
def tile_rows(IDX, counts, q, part, slot, d_inter, SET: tl.constexpr, SUB: tl.constexpr, SUBP: tl.constexpr,
              T: tl.constexpr, CG: tl.constexpr):
    """(row numbers, valid) of tile ``q`` of the program's flat sequence of kept rows (:func:`tile_at`'s, from the
    counts :func:`set_counts` read): row d_inter and valid False past the end."""
    m = q * T + slot
    pos = m * 0 - 1
    start = q * 0
    js = tl.arange(0, SUBP)
    for jj in tl.static_range(SUB):
        c = tl.sum(tl.where(js == jj, counts, 0), axis=0)
        pos = tl.where((m >= start) & (m < start + c), (part * SUB + jj) * SET + (m - start), pos)
        start += c
    valid = pos >= 0
    rows = listed(IDX, pos, valid, 0, CG)
    return tl.where(valid, rows, d_inter), valid
