"""Triton kernel: a whole sparse Gated-MLP for one token in one launch (the decode step's case).

For the token x [d_model] and its indicator ind [d_inter] (u for mono, g for cats, the predictor's or the
shadows' scores for dual), either given (computed before the op, on decode_step/linear.py's fixed GEMV: ops.py)
or computed here from x and the indicator's rows (mono's default; route.py's "mono_indicator"):

    ind[i]  = x . W_ind[i]                  W_ind = W_up (mono), W_gate (cats)
    keep[i] = |ind| > t, |act(ind)| > t or ind > t[i]       (jit_helpers.KEEP_RULES)
    s[i]    = u[i] * act(g[i])              for kept rows; the GEMV that is not the indicator is
                                            computed for kept rows only
    P[p]    = sum over the rows program p owns of s[i] * w_down_t[i]          (fp32 partials)

and y = P.sum(0), in x's dtype, is left to the caller (``one_token_mlp``, through partial_sums.reduce): under
torch.compile that sum and cast fuse into the residual add that follows, so a decode step's sparse MLP is
one launch of ours instead of three (gate / up kernel, down kernel, cast: chain.py).

The grid is persistent: PROGS programs (a few per SM) walk the row chunks c = p, p + PROGS, ... Per chunk a
program reads the chunk's indicators (or streams the chunk's W_ind rows, RB rows a step, the steps
software-pipelined ISTAGES deep: no GEMV launch before the kernel and no round trip for the indicator),
compacts the kept rows in registers (prefix sum + one-hot select, as chain.py), then loads BLOCK_M kept rows
of every matrix it still needs, all loads issued before any arithmetic (one more round trip), and adds
s W_down rows into its fp32 accumulator [d_model]. Partials are written whole (no atomics, no zeroed
workspace): the reduction is deterministic.

With NORM X is the residual stream h and every program computes x = RMSNorm(h) itself, so a folded layer's MLP
half needs no norm launch: ``countdown::sparse_mlp_block`` below is that kernel and the partials' sum with the
residual add, two launches (the second waiting on the first by PDL) instead of the norm, the sparse kernel, the
sum and the add (ops.threshold_block; its bits are those four's, the norm's fp32 sum of squares in another order).
With COUNT every program adds the rows it kept (its chunks' counts, one atomic) to the caller's Sparsity-Real
counters (jit_helpers.add_count). Launch configuration by keep rule: config.LAUNCH["one_token"].
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import act_code, counters, new_output, op_count, op_counters, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode, persistent_programs
from ..jit_helpers import (KEEP_RULES, act, add_count, gdc_launch_dependents, gdc_wait, keep, load_vec, rms_norm_row,
                           round_to, store_partial)
from .partial_sums import reduce, sum_partials


@triton.jit
def _row_tiles(rows, valid, kd, d_model, BIG: tl.constexpr, EVEN_D: tl.constexpr):
    """Offsets [BM, BLOCK_D] of ``rows`` in a row-major [*, d_model] matrix and their load mask (with
    EVEN_D one value per row, so vector loads stay whole)."""
    if BIG:
        off = rows.to(tl.int64)[:, None] * d_model + kd[None, :]
    else:
        off = rows[:, None] * d_model + kd[None, :]
    if EVEN_D:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & (kd < d_model)[None, :]
    return off, mask


@triton.jit
def _accumulate_rows(yacc, wg, wu, wd, xv, valid, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr,
                     DT: tl.constexpr):
    """yacc [d] + sum over a tile's kept rows m of s_m wd[m], s = u act(g) rounded to DT: g (u) from the
    tile's gate (up) rows times x, or, where GATE (UP) is False, ``wg`` (``wu``) is the indicator [BM]
    itself (mono's u, cats' g). Rows not ``valid`` add nothing."""
    if GATE:
        g = tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
    else:
        g = wg
    if UP:
        u = tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    else:
        u = wu
    s = tl.where(valid, u * act(g, ACT), 0.0)
    s = round_to(s, DT)  # s in the model's dtype, as the chain computes it
    return yacc + tl.sum(wd.to(tl.float32) * s[:, None], axis=0)


# --- Triton helpers: one chunk of rows, from its indicators to its kept rows' sum ----------------------


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
    ``rmask``) and how many are kept (jit_helpers.keep's rules)."""
    kp = (keep(ind, thr, MODE, ACT) & rmask).to(tl.int32)
    return tl.where(kp > 0, tl.cumsum(kp, axis=0) - 1, -1), tl.sum(kp, axis=0)


@triton.jit
def _add_kept_rows(yacc, pos, cnt, r, ind, xv, kd, WG, WU, WD, d_model, GATE: tl.constexpr, UP: tl.constexpr,
                   ACT: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr, BIG: tl.constexpr,
                   EVEN_D: tl.constexpr, DT: tl.constexpr):
    """yacc plus the s W_down rows of the chunk's kept rows (rows ``r``, indicator ``ind``, places ``pos``),
    BLOCK_M at a time: a one-hot select puts them in a tile's slots and every load of the tile (gate / up rows
    where GATE / UP, W_down^T rows) is issued before any arithmetic (one round trip a tile)."""
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


@triton.jit
def _step_rows(WI, r0, j, n_rows, ki, k_ind, d_inter, RB: tl.constexpr, BIG: tl.constexpr, EVEN_I: tl.constexpr):
    """Rows r0 + j .. r0 + j + RB - 1 of W_ind [d_inter, k_ind] (zero from row n_rows of the chunk on)."""
    rb = tl.arange(0, RB)
    rows = r0 + j + rb
    rmask = (j + rb < n_rows) & (rows < d_inter)
    if BIG:
        off = rows.to(tl.int64)[:, None] * k_ind + ki[None, :]
    else:
        off = rows[:, None] * k_ind + ki[None, :]
    if EVEN_I:
        return tl.load(WI + off, mask=rmask[:, None], other=0.0)
    else:
        return tl.load(WI + off, mask=rmask[:, None] & (ki < k_ind)[None, :], other=0.0)


@triton.jit
def _stepped_indicator(WI, vv, r0, n_rows, cr, ki, k_ind, d_inter, w0, first, RB: tl.constexpr,
                       ISTAGES: tl.constexpr, W_EARLY: tl.constexpr, BIG: tl.constexpr, EVEN_I: tl.constexpr,
                       DT: tl.constexpr):
    """ind [CHUNK] (fp32 holding DT values) = v . W_ind rows r0 .. r0 + n_rows - 1 (zero past them), RB rows
    of W_ind a step: each step's dot products go into their slots of the chunk's vector (one-hot), so
    the chunk's rows stream through registers RB at a time instead of being loaded whole. W_EARLY: in the
    program's ``first`` chunk the first step's rows are ``w0``, loaded at the program's start."""
    rb = tl.arange(0, RB)
    ind = tl.zeros(cr.shape, dtype=tl.float32)
    start = 0
    if W_EARLY:
        if first:
            d0 = tl.sum(w0.to(tl.float32) * vv[None, :], axis=1)
            ind += tl.sum(tl.where(cr[:, None] == rb[None, :], d0[None, :], 0.0), axis=1)
            start = RB
    for j in tl.range(start, n_rows, RB, num_stages=ISTAGES):
        w = _step_rows(WI, r0, j, n_rows, ki, k_ind, d_inter, RB, BIG, EVEN_I)
        d = tl.sum(w.to(tl.float32) * vv[None, :], axis=1)
        ind += tl.sum(tl.where(cr[:, None] == (j + rb)[None, :], d[None, :], 0.0), axis=1)
    return round_to(ind, DT)  # as a dense GEMV would return it


@triton.jit
def one_token_kernel(
    X, WI, IND, WG, WU, WD, THR, P, NW, KEPT, ROWS,
    thr_f, norm_eps, d_model, d_inter, k_ind, n_chunks, n_progs, rows_per_chunk,
    MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr,
    THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr, EVEN_D: tl.constexpr, EVEN_I: tl.constexpr,
    BIG: tl.constexpr, DENSE: tl.constexpr, PDL: tl.constexpr = 0, STAGES: tl.constexpr = 1,
    RB: tl.constexpr = 0, ISTAGES: tl.constexpr = 1, W_EARLY: tl.constexpr = False, NORM: tl.constexpr = False,
    COUNT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if PDL:  # launched early (PDL); the partials' sum may launch now, it waits for this grid
        gdc_launch_dependents()
    kd = tl.arange(0, BLOCK_D)
    ki = tl.arange(0, BLOCK_I)
    w0 = 0.0
    if W_EARLY:  # the first step's indicator rows: weights, so before the wait for the previous kernel
        w0 = _step_rows(WI, pid * rows_per_chunk, 0, rows_per_chunk, ki, k_ind, d_inter, RB, BIG, EVEN_I)
    if PDL:  # nothing of the previous kernel's output is read before this
        gdc_wait()
    if NORM:  # X is the residual stream h and x = RMSNorm(h) (weight NW), computed by every program
        xv = rms_norm_row(X, NW, norm_eps, kd, d_model, EVEN_D, X.dtype.element_ty)
    else:
        xv = load_vec(X, kd, d_model, EVEN_D)
    if THR_PTR:
        thr_s = tl.load(THR).to(tl.float32)
    else:
        thr_s = thr_f
    yacc = tl.zeros([BLOCK_D], dtype=tl.float32)
    cr = tl.arange(0, CHUNK)
    n_kept = tl.zeros([], dtype=tl.int32)  # the rows this program keeps (COUNT)

    for c in range(pid, n_chunks, n_progs):
        r = c * rows_per_chunk + cr  # rows_per_chunk <= CHUNK rows (ROWS "auto": not a power of two)
        rmask = (cr < rows_per_chunk) & (r < d_inter)
        if DENSE:  # the indicator from x and W_ind's rows, RB rows a step (a streaming GEMV)
            ind = _stepped_indicator(WI, xv, c * rows_per_chunk, rows_per_chunk, cr, ki, k_ind, d_inter, w0,
                                     c == pid, RB, ISTAGES, W_EARLY, BIG, EVEN_I, X.dtype.element_ty)
        else:  # the indicator was computed before the launch
            ind = tl.load(IND + r, mask=rmask, other=0.0).to(tl.float32)
        pos, cnt = _kept_places(ind, _row_thresholds(THR, r, rmask, thr_s, THR_VEC), rmask, MODE, ACT)
        n_kept += cnt
        yacc = _add_kept_rows(yacc, pos, cnt, r, ind, xv, kd, WG, WU, WD, d_model, GATE, UP, ACT, BLOCK_M, STAGES,
                              BIG, EVEN_D, X.dtype.element_ty)

    store_partial(P, pid, yacc, kd, d_model, BIG, EVEN_D)
    if COUNT:
        add_count(KEPT, ROWS, n_kept, d_inter, pid == 0)


def _chunking(device: torch.device, d_inter: int, cfg: dict) -> tuple[int, int, int]:
    """(rows per chunk, CHUNK = the power of two that holds them, programs). ROWS "auto": one chunk per
    program, d_inter split evenly over PER_SM programs per SM (in whole RB steps)."""
    most = persistent_programs(device, cfg["PER_SM"], cfg.get("PROGRAMS", 0))
    if cfg.get("ROWS") == "auto":
        step = max(1, cfg.get("RB", 0))  # whole indicator steps a program (no row of the next one read)
        rows = triton.cdiv(triton.cdiv(d_inter, most), step) * step
        chunk = max(16, pow2(rows))
    else:
        rows = chunk = cfg["CHUNK"]
    return rows, chunk, max(1, min(triton.cdiv(d_inter, rows), most))


def n_programs(device: torch.device, d_inter: int, mode: str, config: dict | None = None) -> int:
    """How many partial sums the kernel writes for this device, shape and mode (the op's output rows)."""
    return _chunking(device, d_inter, launch_config("one_token", device, mode, config))[2]


def one_token_partials(x, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str,
                     gate: bool, up: bool, config: dict | None = None, ind=None,
                     norm: tuple | None = None, count=None) -> torch.Tensor:
    """The fp32 partial sums P [n_programs, d_model] for x [1, d_model]; y = P.sum(0). The indicator is
    ``ind`` [1, d_inter] if given, else computed in the kernel as x . w_ind [d_inter, d_model] rows (RB rows a
    step). With ``norm`` = (weight [d_model], eps) ``x`` is the residual stream h and the MLP's input is
    RMSNorm(h), computed in the kernel (``countdown::sparse_mlp_block``); an indicator computed here then reads it
    too. The kept rows are added to ``count`` = (kept, rows) if given. (Spy hook: ``on_launch("one_token", x, mode,
    norm)``.)"""
    cfg = launch_config("one_token", x.device, mode, config)
    n_tok, d_model = x.shape
    if n_tok != 1:
        raise ValueError(f"the one-launch kernel takes one token, got {n_tok}")
    d_inter = w_gate.shape[0]
    if ind is not None:
        if ind.shape != (1, d_inter):
            raise ValueError(f"indicator must be [1, {d_inter}], got {tuple(ind.shape)}")
        ind = ind.contiguous()
        w_ind = w_gate  # a placeholder, never read
    elif w_ind is None or w_ind.shape != (d_inter, d_model):
        raise ValueError(f"the indicator's rows must be w_ind [{d_inter}, {d_model}] (read against x), got "
                         f"{None if w_ind is None else tuple(w_ind.shape)}")
    k_ind = w_ind.shape[1]
    x, w_ind = x.contiguous(), w_ind.contiguous()
    w_gate, w_up, w_down_t = w_gate.contiguous(), w_up.contiguous(), w_down_t.contiguous()
    thr_vec = thr_t is not None and thr_t.dim() == 1
    if thr_vec and thr_t.numel() != d_inter:
        raise ValueError(f"a per-row threshold needs d_inter={d_inter} values, got {thr_t.numel()}")
    rows, chunk, progs = _chunking(x.device, d_inter, cfg)
    rb = int(cfg.get("RB", 0)) if ind is None else 0
    if ind is None and (rb < 1 or rb & (rb - 1) or rb > chunk):
        raise ValueError(f"RB (indicator rows a step) must be a power of two <= CHUNK {chunk}, got {rb}")
    if norm is not None:
        norm_w = norm[0]
        if norm_w.shape != (d_model,) or norm_w.dtype != x.dtype or norm_w.device != x.device:
            raise ValueError(f"the norm's weight must be [{d_model}] of x's dtype and device ({x.dtype}, "
                             f"{x.device}), got {tuple(norm_w.shape)} {norm_w.dtype} {norm_w.device}")
        norm_w = norm_w.contiguous()
    block_d, block_i = max(16, pow2(d_model)), max(16, pow2(k_ind))
    p = new_output((progs, d_model), torch.float32, x.device)
    kept, n_rows = counters(count, x.device)
    pdl = pdl_mode(x)
    launching("one_token", x, mode, norm)
    one_token_kernel[(progs,)](
        x, w_ind, ind if ind is not None else p, w_gate, w_up, w_down_t, thr_t if thr_t is not None else p, p,
        norm_w if norm is not None else p, kept if kept is not None else p, n_rows if n_rows is not None else p,
        float(thr_f), float(norm[1]) if norm is not None else 0.0, d_model,
        d_inter, k_ind, triton.cdiv(d_inter, rows), progs, rows,
        MODE=KEEP_RULES[mode], GATE=gate, UP=up, ACT=act_code(activation),
        THR_PTR=thr_t is not None, THR_VEC=thr_vec, CHUNK=chunk, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_D=block_d, BLOCK_I=block_i, EVEN_D=block_d == d_model, EVEN_I=block_i == k_ind,
        BIG=d_inter * max(d_model, k_ind) >= 2**31, DENSE=ind is None, PDL=pdl, STAGES=int(cfg.get("STAGES", 1)),
        RB=rb, ISTAGES=int(cfg.get("ISTAGES", 1)), W_EARLY=bool(rb and cfg.get("W_EARLY", False)),
        NORM=norm is not None, COUNT=kept is not None,
        num_warps=cfg["num_warps"], num_stages=1, **launch_kwargs(pdl),
    )
    return p


# (the keep rule is ``rule``, not ``mode``: see chain.py's op)
@torch.library.custom_op("countdown::sparse_mlp_one_token", mutates_args=("kept", "rows"))
def _one_token_op(x: torch.Tensor, w_ind: Optional[torch.Tensor], ind: Optional[torch.Tensor], w_gate: torch.Tensor,
                  w_up: torch.Tensor, w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, rule: str,
                  activation: str, gate: bool, up: bool, kept: Optional[torch.Tensor] = None,
                  rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    return one_token_partials(x, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, gate, up, ind=ind,
                              count=op_count(kept, rows))


@_one_token_op.register_fake
def _(x, w_ind, ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, gate, up, kept=None, rows=None):
    return x.new_empty((n_programs(x.device, w_gate.shape[0], rule), x.shape[1]), dtype=torch.float32)


def one_token_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str, gate: bool, up: bool,
                  *, ind=None, w_ind=None, residual=None, count=None) -> torch.Tensor:
    """y [1, d_model] in x's dtype from the indicator ``ind`` [1, d_inter] or its rows ``w_ind`` (read against
    x in the kernel): the op's partials summed and cast outside it (partial_sums.reduce: PyTorch's sum while
    torch.compile traces it, which fuses it with its neighbours; run eagerly, its op). With ``residual`` (a folded
    layer's h, in residual's shape) residual + y, the add in the partials' sum; with ``count`` = (kept, rows) the
    kept rows added to a patched layer's Sparsity-Real counters."""
    kept, rows = op_counters(count, x2.device)
    p = torch.ops.countdown.sparse_mlp_one_token(x2, w_ind, ind, w_gate, w_up, w_down_t, thr_t, thr_f,
                                                 mode, activation, gate, up, kept, rows)
    return reduce(p, x2, residual)


@torch.library.custom_op("countdown::sparse_mlp_block", mutates_args=("kept", "rows"))
def _block_op(h: torch.Tensor, norm_w: torch.Tensor, eps: float, w_gate: torch.Tensor, w_up: torch.Tensor,
              w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, rule: str,
              activation: str, kept: Optional[torch.Tensor] = None,
              rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h + mono's ("abs") or cats' ("abs_act") MLP of RMSNorm(h), one token: this kernel normalising h itself and
    computing its indicator, then the partials' sum adding h."""
    w_ind = w_up if rule == "abs" else w_gate
    p = one_token_partials(h, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, rule == "abs",
                           rule != "abs", norm=(norm_w, eps), count=op_count(kept, rows))
    return sum_partials(p, h.dtype, residual=h)


@_block_op.register_fake
def _(h, norm_w, eps, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, kept=None, rows=None):
    return torch.empty_like(h)
