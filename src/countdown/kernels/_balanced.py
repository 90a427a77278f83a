"""Triton kernel: one token's sparse phase with the kept rows split evenly, in one launch.

_onepass.py gives each program whole chunks of 64 rows and lets it find the kept ones itself: at
k = 0.9 a chunk keeps 6 rows on average but up to 15, 224 chunks land on 132 SMs, and each chunk's
kept rows arrive in serial round trips of 4, so the busiest SM, not the bytes, sets the time (mono's
sparse kernel took 13.2 us a layer for 5.6 us of kept rows in the 8B decode step, dual's 17.5 for
8.3). _stream.py balanced the work with a list written by the indicator kernel, which only the shadow
GEMV can write, at the cost of a second launch. Here one launch balances it for every method:

1. every program reads the whole indicator ind [d_inter] (28 KB at the Llama shape; after the first
   program, from L2) and counts the kept rows, n;
2. program p owns the kept rows of global rank lo <= j < hi, lo = p n // PROGS, hi = (p + 1) n // PROGS
   (the same count within one for every program); a second pass over ind (in L1) ranks each kept row
   with a prefix sum and the program writes its own rows' ids and indicators to its scratch row;
3. after a barrier, it streams them: BM kept rows per step, the gate / up / W_down^T rows of a step
   requested together (with PREFETCH, the next step's before this step's arithmetic), and adds
   s W_down^T[row] into an fp32 [d_model] accumulator, written as its partial sum P[p].

keep[i] is the MODE test of _glu.py (|u| > t for mono, |act(g)| > t for cats, score > t[i] for dual),
so the rows are exactly those of _onepass.py; only the grouping of the fp32 sums differs. y = P.sum(0)
in x's dtype is the caller's (_onepass.onepass_mlp). Deterministic: the ranks do not depend on timing
and every program sums its rows in rank order.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common, _pdl
from ._common import act_code
from ._glu import MODES, _accumulate_rows, _keep, _load_vec, _pow2, _row_tiles, _store_partial
from ._pdl import gdc_wait

# BM kept rows per step, PER_SM programs per SM; an indicator of at most BLOCK_R rows (padded to a power
# of two) is read in one load and ranked in one pass, a longer one in two passes of LOOP_R rows.
# Chosen by benchmarks/balanced.py.
CONFIG = dict(BM=4, num_warps=8, PER_SM=1, PREFETCH=False, BLOCK_R=16384, LOOP_R=4096)
INTERPRETER_PROGS = 3
LAST_KERNEL = None


@triton.jit
def _kept(IND, THR, r, d_inter, thr_s, MODE: tl.constexpr, ACT: tl.constexpr, THR_VEC: tl.constexpr):
    """keep [BLOCK_R] (int32) and ind (fp32) of rows ``r``; rows past d_inter are not kept."""
    rmask = r < d_inter
    ind = tl.load(IND + r, mask=rmask, other=0.0).to(tl.float32)
    if THR_VEC:
        thr = tl.load(THR + r, mask=rmask, other=0.0).to(tl.float32)
    else:
        thr = thr_s
    return (_keep(ind, thr, MODE, ACT) & rmask).to(tl.int32), ind


@triton.jit
def _balanced_kernel(
    X, IND, WG, WU, WD, THR, P, S,
    thr_f, d_model, d_inter, n_progs, s_cap,
    MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr,
    THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, ONE_BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BIG: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kd = tl.arange(0, BLOCK_D)
    xv = _load_vec(X, kd, d_model, EVEN_D)
    if PDL:  # launched early (_pdl.py): the indicator is the previous kernel's output
        gdc_wait()
    if THR_PTR:
        thr_s = tl.load(THR).to(tl.float32)
    else:
        thr_s = thr_f
    cr = tl.arange(0, BLOCK_R)

    s_ids = S + pid.to(tl.int64) * (2 * s_cap)
    s_ind = s_ids + s_cap
    if ONE_BLOCK:  # the whole indicator in one load: count, rank and write in one pass
        keep, ind = _kept(IND, THR, cr, d_inter, thr_s, MODE, ACT, THR_VEC)
        total = tl.sum(keep, axis=0)
        lo = (pid * total) // n_progs
        hi = ((pid + 1) * total) // n_progs
        rank = tl.cumsum(keep, axis=0) - 1
        mine = (keep > 0) & (rank >= lo) & (rank < hi)
        tl.store(s_ids + (rank - lo), cr.to(tl.float32), mask=mine)
        if not (GATE and UP):  # mono / cats: the indicator is u / g itself
            tl.store(s_ind + (rank - lo), ind, mask=mine)
    else:
        # 1. how many rows are kept in all; this program's share of ranks [lo, hi)
        total = 0
        for r0 in range(0, d_inter, BLOCK_R):
            keep, ind = _kept(IND, THR, r0 + cr, d_inter, thr_s, MODE, ACT, THR_VEC)
            total += tl.sum(keep, axis=0)
        lo = (pid * total) // n_progs
        hi = ((pid + 1) * total) // n_progs
        # 2. rank every kept row; write this program's rows (ids as fp32, exact below 2**24) and indicators
        base = 0
        for r0 in range(0, d_inter, BLOCK_R):
            r = r0 + cr
            keep, ind = _kept(IND, THR, r, d_inter, thr_s, MODE, ACT, THR_VEC)
            rank = base + tl.cumsum(keep, axis=0) - 1
            mine = (keep > 0) & (rank >= lo) & (rank < hi)
            tl.store(s_ids + (rank - lo), r.to(tl.float32), mask=mine)
            if not (GATE and UP):
                tl.store(s_ind + (rank - lo), ind, mask=mine)
            base += tl.sum(keep, axis=0)
    tl.debug_barrier()  # the scratch row, written by every thread of this program, read by every thread

    # 3. stream the rows
    yacc = tl.zeros([BLOCK_D], dtype=tl.float32)
    n_mine = hi - lo
    if PREFETCH:  # the first step's rows
        valid_n, wg_n, wu_n, wd_n = _load_step(s_ids, s_ind, 0, n_mine, WG, WU, WD, kd, d_model,
                                               GATE, UP, BM, EVEN_D, BIG)
    for t in range(lo, hi, BM):
        if PREFETCH:  # this step's rows are in flight; request the next step's
            valid, wg, wu, wd = valid_n, wg_n, wu_n, wd_n
            valid_n, wg_n, wu_n, wd_n = _load_step(s_ids, s_ind, t + BM - lo, n_mine, WG, WU, WD, kd,
                                                   d_model, GATE, UP, BM, EVEN_D, BIG)
        else:
            valid, wg, wu, wd = _load_step(s_ids, s_ind, t - lo, n_mine, WG, WU, WD, kd, d_model,
                                           GATE, UP, BM, EVEN_D, BIG)
        yacc = _accumulate_rows(yacc, wg, wu, wd, xv, valid, GATE, UP, ACT, X.dtype.element_ty)

    _store_partial(P, pid, yacc, kd, d_model, BIG, EVEN_D)


@triton.jit
def _load_step(S_IDS, S_IND, j, n_mine, WG, WU, WD, kd, d_model, GATE: tl.constexpr, UP: tl.constexpr,
               BM: tl.constexpr, EVEN_D: tl.constexpr, BIG: tl.constexpr):
    """The program's kept rows j .. j + BM - 1 (of n_mine): validity and the gate / up / W_down^T tiles,
    all requested together; where GATE (UP) is False the indicator [BM] stands in for the gate (up) tile."""
    m = j + tl.arange(0, BM)
    valid = m < n_mine
    rows = tl.load(S_IDS + m, mask=valid, other=0.0).to(tl.int32)
    off, wmask = _row_tiles(rows, valid, kd, d_model, BIG, EVEN_D)
    if GATE:
        wg = tl.load(WG + off, mask=wmask, other=0.0)
    else:
        wg = tl.load(S_IND + m, mask=valid, other=0.0)
    if UP:
        wu = tl.load(WU + off, mask=wmask, other=0.0)
    else:
        wu = tl.load(S_IND + m, mask=valid, other=0.0)
    wd = tl.load(WD + off, mask=wmask, other=0.0)
    return valid, wg, wu, wd


def n_programs(device: torch.device, d_inter: int, config: dict | None = None) -> int:
    """Partial sums written (the op's output rows) for this device and shape."""
    cfg = {**CONFIG, **(config or {})}
    return max(1, min(d_inter, _common.persistent_programs(device, cfg["PER_SM"], INTERPRETER_PROGS)))


def balanced_partials(x, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str,
                      gate: bool, up: bool, config: dict | None = None) -> torch.Tensor:
    """fp32 partial sums P [n_programs, d_model] for x [1, d_model] and its indicator ind [1, d_inter];
    y = P.sum(0). Keeps the rows _onepass.py keeps (the same MODE test)."""
    global LAST_KERNEL
    cfg = {**CONFIG, **(config or {})}
    n_tok, d_model = x.shape
    d_inter = w_gate.shape[0]
    if n_tok != 1 or ind.shape != (1, d_inter):
        raise ValueError(f"the balanced kernel takes one token and ind [1, {d_inter}], got x "
                         f"{tuple(x.shape)} and ind {tuple(ind.shape)}")
    if d_inter >= 2**24:
        raise ValueError(f"d_inter={d_inter} is too large for the fp32 row ids of the scratch (< 2**24)")
    thr_vec = thr_t is not None and thr_t.dim() == 1
    if thr_vec and thr_t.numel() != d_inter:
        raise ValueError(f"a per-row threshold needs d_inter={d_inter} values, got {thr_t.numel()}")
    x, ind = x.contiguous(), ind.contiguous()
    w_gate, w_up, w_down_t = w_gate.contiguous(), w_up.contiguous(), w_down_t.contiguous()
    progs = n_programs(x.device, d_inter, cfg)
    s_cap = triton.cdiv(d_inter, progs) + 1  # ranks per program: at most ceil(n / PROGS) <= this
    block_d = max(16, _pow2(d_model))
    one_block = _pow2(d_inter) <= cfg["BLOCK_R"]  # the whole indicator in one load
    block_r = max(16, _pow2(d_inter) if one_block else cfg["LOOP_R"])
    p = _common.new_output((progs, d_model), torch.float32, x.device)
    scratch = torch.empty((progs, 2 * s_cap), dtype=torch.float32, device=x.device)
    pdl = _pdl.mode(x, "balanced")
    LAST_KERNEL = _balanced_kernel[(progs,)](
        x, ind, w_gate, w_up, w_down_t, thr_t if thr_t is not None else p, p, scratch,
        float(thr_f), d_model, d_inter, progs, s_cap,
        MODE=MODES[mode], GATE=gate, UP=up, ACT=act_code(activation),
        THR_PTR=thr_t is not None, THR_VEC=thr_vec, BM=cfg["BM"], BLOCK_R=block_r, ONE_BLOCK=one_block,
        BLOCK_D=block_d, EVEN_D=block_d == d_model, BIG=d_inter * d_model >= 2**31,
        PREFETCH=bool(cfg["PREFETCH"]), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=1, **_pdl.launch_kwargs(pdl),
    )
    return p


@torch.library.custom_op("countdown::gated_balanced", mutates_args=())
def _balanced_op(x: torch.Tensor, ind: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, mode: str, activation: str,
                 gate: bool, up: bool) -> torch.Tensor:
    return balanced_partials(x, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up)


@_balanced_op.register_fake
def _(x, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up):
    return x.new_empty((n_programs(x.device, w_gate.shape[0]), x.shape[1]), dtype=torch.float32)
