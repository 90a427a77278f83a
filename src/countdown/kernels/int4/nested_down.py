"""Triton kernel: low_down, the mixed Gated-MLP's last launch (``nested_rows.py`` says what the five compute): the
kept rows' correction ``sum_i s_i Delta_down[:, i]`` from W_down's transposed low plane, plus the high plane's down
GEMV partials q, as fp32 partials [P, d_model], or with a residual h, h + their sum (+ bias) in h's dtype.

The transposed low plane: codes uint8 [d_inter, d_model / 2] (a kept row i is one contiguous row; byte b holds
columns 2b, low nibble, and 2b + 1), scale and offset [d_inter / G, d_model] (a row per group of G rows of d_inter).
A grid of (D_SUB sets of the select's lists, column slices of D_CB bytes); a program reads its sets' kept counts
once and walks their kept rows as one flat sequence in tiles of D_T rows (``rows_list.tile_at``'s order) and for
each tile reads

* the codes [D_T, D_CB] of its rows,
* their groups' scales and offsets as fp16 (or fp32) *pairs*: the host views the scale / offset rows as int32 (int64)
  words, so one word holds the values of columns 2b and 2b + 1, the same [D_T, D_CB] shape and the same places in
  the threads as the codes (no stride-2 loads, no layout change between them); split in registers,
* s_i = act(g_i) u_i from gu's partial sums,

and adds ``s (fl32(fl32(S l) + O))`` (no fused multiply-add: the launch turns it off) to accumulators [D_T, D_CB]
for the low and the high nibbles: one accumulator an element, so a tile's rows are summed across threads only once,
after the last tile. A software pipeline keeps D_AHEAD tiles' loads in flight: while tile q is summed, tile q +
D_AHEAD's codes, scales, offsets and gu's partials are requested, and the row numbers of tile q + D_AHEAD + 1 (no
load of a tile waits on a row number requested in the same iteration). ptxas places a tile's loads after the
arithmetic of the iteration (sm_90 SASS), so with D_AHEAD = 1 they are barely ahead; D_AHEAD = 2 keeps a whole
iteration between a tile's request and its use, at ~14 registers a code byte a thread (~8 with 1).

PDL: every program signals at its start. D_EARLY (the mixed MLP launches the high plane's down GEMV with its signal
after its own wait, ``gemv.launch(late=True)``, so when this grid starts the select and low_gate_up have finished):
the lists and gu are read from L2 (``.cg``) before any wait and the whole walk, and the partials' store, overlap the
down GEMV where its programs leave an SM room (``Q_PER_SM``) and its last programs' tail otherwise; only what reads
q waits (the last program of each column slice, or with no residual the first sets' programs). Without D_EARLY each
program waits first. With a residual h, the last program of each column slice to
finish (a counter a slice, the select kernel zeroes them; set back to 0 after) sums the slice's P partials in
program order, then q's partials, then adds h (and the bias): the same numbers whichever program is last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import act_code, new_output, pow2
from ..config import launch_kwargs, launching, pdl_mode
from ..jit_helpers import act, gdc_launch_dependents, gdc_wait
from .rows_down import _add_when_last
from .rows_list import set_counts, tile_rows


@triton.jit
def _row_loads(GU, QT, SCP, OFP, rows, ok, cb, cm, d_inter, half, GROUP: tl.constexpr, GS: tl.constexpr,
               BIG: tl.constexpr, CG: tl.constexpr):
    """The codes [T, CB] (uint8, widened only where summed: fewer registers in flight), scale and offset pair words
    [T, CB] and gu's g and u [T] (summed over gu's GS slices; 0 past the end) of a tile's ``rows``: every load issued
    before any arithmetic on them."""
    m2 = ok[:, None] & cm[None, :]
    if BIG:
        r = rows.to(tl.int64)
    else:
        r = rows
    b = tl.load(QT + r[:, None] * half + cb[None, :], mask=m2, other=0)
    prow = (r // GROUP)[:, None] * half + cb[None, :]
    sp = tl.load(SCP + prow, mask=m2, other=0)
    op = tl.load(OFP + prow, mask=m2, other=0)
    cmod: tl.constexpr = ".cg" if CG else ""
    g = tl.load(GU + rows, mask=ok, other=0.0, cache_modifier=cmod)
    u = tl.load(GU + d_inter + rows, mask=ok, other=0.0, cache_modifier=cmod)
    for i in tl.static_range(1, GS):
        g += tl.load(GU + i * 2 * d_inter + rows, mask=ok, other=0.0, cache_modifier=cmod)
        u += tl.load(GU + i * 2 * d_inter + d_inter + rows, mask=ok, other=0.0, cache_modifier=cmod)
    return b, sp, op, g, u, ok


@triton.jit
def _pair(w, HIGH: tl.constexpr, WIDE: tl.constexpr):
    """fp32 value of the low (HIGH 0) or high half of pair words w: fp16 in int32 words, fp32 in int64 (WIDE)."""
    if WIDE:
        if HIGH:
            w = w >> 32
        return w.to(tl.int32).to(tl.float32, bitcast=True)
    if HIGH:
        w = w >> 16
    return w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _add_tile(acc_lo, acc_hi, b, sp, op, g, u, ok, ACT: tl.constexpr, WIDE: tl.constexpr):
    sv = tl.where(ok, act(g, ACT) * u, 0.0)[:, None]
    b = b.to(tl.int32)
    acc_lo += sv * ((b & 15).to(tl.float32) * _pair(sp, 0, WIDE) + _pair(op, 0, WIDE))
    acc_hi += sv * ((b >> 4).to(tl.float32) * _pair(sp, 1, WIDE) + _pair(op, 1, WIDE))
    return acc_lo, acc_hi


@triton.jit
def low_down_kernel(IDX, CNT, GU, Q, QT, SCP, OFP, P, H, B, Y, LOCK, n_sets, d_inter, d_model, half,
                    GROUP: tl.constexpr, SET: tl.constexpr, SUB: tl.constexpr, SUBP: tl.constexpr, T: tl.constexpr,
                    CB: tl.constexpr,
                    GS: tl.constexpr, QS: tl.constexpr, ACT: tl.constexpr, BIG: tl.constexpr, WIDE: tl.constexpr,
                    AHEAD: tl.constexpr = 1, EARLY: tl.constexpr = 0, FIX: tl.constexpr = 0, NP: tl.constexpr = 1,
                    HAS_B: tl.constexpr = 0, PDL: tl.constexpr = 0):
    if PDL:  # gu and q are the kernels' before this one (EARLY: gu already final, q not; the module docstring)
        gdc_launch_dependents()
        if not EARLY:
            gdc_wait()
    CG: tl.constexpr = EARLY * PDL   # read before the wait: lists and gu from L2
    part = tl.program_id(0)
    cs = tl.program_id(1)
    cb = tl.max_contiguous(tl.multiple_of(cs * CB, CB) + tl.arange(0, CB), 4)  # codes at the pair words' places
    cm = cb < half
    ti = tl.arange(0, T)
    acc_lo = tl.zeros([T, CB], dtype=tl.float32)
    acc_hi = tl.zeros([T, CB], dtype=tl.float32)
    counts = set_counts(CNT, part, n_sets, SUB, SUBP, CG)
    total = (tl.sum(counts, axis=0) + T - 1) // T
    rows, ok = tile_rows(IDX, counts, 0, part, ti, d_inter, SET, SUB, SUBP, T, CG)
    b, sp, op, g, u, ok = _row_loads(GU, QT, SCP, OFP, rows, ok, cb, cm, d_inter, half, GROUP, GS, BIG, CG)
    if AHEAD == 2:
        rows, ok_m = tile_rows(IDX, counts, 1, part, ti, d_inter, SET, SUB, SUBP, T, CG)
        b_m, sp_m, op_m, g_m, u_m, ok_m = _row_loads(GU, QT, SCP, OFP, rows, ok_m, cb, cm, d_inter, half, GROUP, GS,
                                                     BIG, CG)
    rows_n, ok_n = tile_rows(IDX, counts, AHEAD, part, ti, d_inter, SET, SUB, SUBP, T, CG)
    for q in range(0, total):  # tile q summed while tile q + AHEAD's loads and tile q + AHEAD + 1's rows are out
        rows_nn, ok_nn = tile_rows(IDX, counts, q + AHEAD + 1, part, ti, d_inter, SET, SUB, SUBP, T, CG)
        b_n, sp_n, op_n, g_n, u_n, ok_n = _row_loads(GU, QT, SCP, OFP, rows_n, ok_n, cb, cm, d_inter, half, GROUP, GS,
                                                     BIG, CG)
        acc_lo, acc_hi = _add_tile(acc_lo, acc_hi, b, sp, op, g, u, ok, ACT, WIDE)
        if AHEAD == 2:
            b, sp, op, g, u, ok = b_m, sp_m, op_m, g_m, u_m, ok_m
            b_m, sp_m, op_m, g_m, u_m, ok_m = b_n, sp_n, op_n, g_n, u_n, ok_n
        else:
            b, sp, op, g, u, ok = b_n, sp_n, op_n, g_n, u_n, ok_n
        rows_n, ok_n = rows_nn, ok_nn
    cols = 2 * cs * CB + tl.arange(0, 2 * CB)
    colm = cols < d_model
    acc = tl.reshape(tl.join(tl.sum(acc_lo, axis=0), tl.sum(acc_hi, axis=0)), (2 * CB,))  # columns in order
    if FIX:  # q's partials are added by the last program of the slice, with h
        tl.store(P + part * d_model + cols, acc, mask=colm)
        _add_when_last(P, H, B, Y, LOCK + cs, cols, d_model, NP, HAS_B, Q, QS, CG)
    else:  # the first sets' programs add q's partials: only they wait for the down GEMV
        if CG:
            if part == 0:
                gdc_wait()
        qm = colm & ((cols * 0 + part) == 0)
        for i in tl.static_range(QS):
            acc += tl.load(Q + i * d_model + cols, mask=qm, other=0.0, cache_modifier=".cg")
        tl.store(P + part * d_model + cols, acc, mask=colm)


def down_slices(d_model: int, cfg: dict) -> int:
    """The column slices of low_down (its residual add's counters)."""
    return -(-(d_model // 2) // cfg["D_CB"])


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """Scale / offset rows [n, d_model] as words of two columns' values: int32 for fp16, int64 for fp32."""
    word = {2: torch.int32, 4: torch.int64}.get(t.element_size())
    if word is None or t.shape[-1] % 2:
        raise ValueError(f"low_down reads the low plane's scales and offsets as fp16 or fp32 pairs of columns, got "
                         f"{t.dtype} {tuple(t.shape)}")
    return t.contiguous().view(word)


def low_down(idx, cnt, counters, gu, q, down_low_t, act_name, set_rows: int, cfg: dict, residual=None,
             bias=None) -> torch.Tensor:
    """fp32 partials ``[P, d_model]`` of ``q``'s sum (the high plane's down GEMV partials) plus the kept rows' low-plane
    correction ``sum_i s_i Delta_down[:, i]`` (s from ``gu``, refined); with ``residual`` h, h + that sum (+ bias) in
    h's dtype. ``down_low_t``: (codes uint8 [d_inter, d_model / 2], scale and offset [d_inter / G, d_model]).
    ``cfg["D_EARLY"]``: only where q's GEMV was launched with its PDL signal after its wait (the module docstring).
    (Spy hook: ``on_launch("int4_nested_low_down", idx)``.)"""
    qt, sct, oft = down_low_t
    d_inter, half = qt.shape
    d_model = 2 * half
    group = d_inter // sct.shape[0]
    n_sets = cnt.numel()
    n_parts = -(-n_sets // cfg["D_SUB"])
    n_slices = down_slices(d_model, cfg)
    out = new_output((n_parts, d_model), torch.float32, gu.device)
    fix = residual is not None
    if fix and (counters.dtype != torch.int32 or counters.numel() < n_slices):
        raise ValueError(f"the residual add counts finished programs in {n_slices} int32 zeros (select's fourth "
                         f"output), got {counters.dtype} {tuple(counters.shape)}")
    y = new_output(tuple(residual.shape), residual.dtype, gu.device) if fix else out
    pdl = pdl_mode(gu)
    launching("int4_nested_low_down", idx)
    low_down_kernel[(n_parts, n_slices)](
        idx, cnt, gu, q, qt.contiguous(), _pairs(sct), _pairs(oft), out,
        residual.contiguous() if fix else out, bias.contiguous() if bias is not None else out, y, counters, n_sets,
        d_inter, d_model, half, GROUP=group, SET=set_rows, SUB=cfg["D_SUB"], SUBP=pow2(cfg["D_SUB"]), T=cfg["D_T"],
        CB=cfg["D_CB"], GS=gu.shape[0], QS=q.shape[0], ACT=act_code(act_name),
        BIG=d_inter * half >= 2**31 or n_parts * d_model >= 2**31,
        WIDE=int(sct.element_size() == 4), AHEAD=cfg["D_AHEAD"], EARLY=int(cfg["D_EARLY"]), FIX=int(fix),
        NP=n_parts, HAS_B=int(bias is not None), PDL=pdl, num_warps=cfg["D_WARPS"], num_stages=1,
        enable_fp_fusion=False, **launch_kwargs(pdl))
    return y
