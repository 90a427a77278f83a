"""Triton kernels: one token's sparse phase in two launches, the down projection split by output columns.

_onepass.py gives each program whole chunks of rows: it loads the kept rows of W_gate / W_up and of
W_down^T and writes an fp32 partial sum of the whole output, which a third launch sums. At the
Llama-3.1-8B shape that is PROGS x d_model x 4 bytes = 3.7-8.6 MB written and read back per MLP, as much
as the kept rows' own bytes at k = 0.9, and each program's chain (indicators, compaction, rows, partial)
runs once per chunk. Here, for x [1, d_model] and its indicator ind [d_inter] (given):

1. ``_coef_kernel``: program p takes chunks c = p, p + PROGS, ... of CHUNK rows. It counts the kept rows
   before its chunk (the indicator is small and in L2: every program re-reading it is cheaper than a
   grid-wide scan), compacts its own kept rows, loads their gate / up rows and writes each kept row and
   its coefficient at its place in one list ordered by row::

       o = #{kept rows < i}:   ROWS[o] = i,   S[o] = u[i] act(g[i])   (rounded to x's dtype)

   and the program of the last chunk writes the list's length.
2. ``_down_kernel``: program q owns BN output columns and walks the list BT entries at a time::

       y[cols] = sum over o of S[o] W_down^T[ROWS[o], cols]           (fp32, then x's dtype)

No partial sums, no third launch, and the result does not depend on timing: the list is in row order and
every column is summed in that order. Both launches chain with programmatic dependent launch (_pdl.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common, _pdl
from ._common import act_code
from ._chunk import _kept_places, _row_thresholds
from ._glu import MODES, _act, _keep, _load_vec, _pow2, _round_to, _row_tiles
from ._pdl import gdc_launch_dependents, gdc_wait

# Launch configurations by indicator kind ("abs": mono's |u|, "abs_act": cats' |act(g)|, "gt": dual's scores).
# _coef_kernel: CHUNK rows per chunk, BLOCK_M kept rows per step (STAGES: the step loop software-pipelined),
# PER_SM programs per SM, BLOCK_C indicator entries per step of the count before a chunk (C_STAGES deep).
# _down_kernel: BN columns per program, BT list entries per step, D_STAGES deep, D_WARPS warps.
# COUNTDOWN_SPLIT_CONFIGS='{"abs": {...}}' (JSON) overrides entries, for tuning runs.
# Defaults: the fastest of `benchmarks/split.py`'s second sweep (H200, 2026-11-25, Llama-3.1-8B shape, k = 0.9,
# benchmarks/results/split/). Measured there: the sparse phase alone mono 19.8 us against onepass's 21.5
# (op + sum), dual 25.1 against 24.4; with nothing kept 7.4 / 6.8 against 10.2 / 11.2 (no partials); but in
# the decode step mono's MLP took 50.7 us against 44.3 (run BA, 1.40x against 1.47x): the coefficient kernel
# keeps onepass's per-chunk chain, and the down kernel costs more than the partials' sum it replaces. Opt-in.
_BASE = dict(CHUNK=64, BLOCK_M=4, num_warps=4, PER_SM=2, STAGES=2, BLOCK_C=8192, C_STAGES=2,
             BN=32, BT=256, D_STAGES=4, D_WARPS=4)
CONFIGS = {
    "abs": dict(_BASE),
    "abs_act": dict(_BASE),
    "gt": dict(_BASE, BLOCK_M=8, STAGES=1, BLOCK_C=4096, BN=16, BT=128, D_WARPS=2),
}
INTERPRETER_PROGS = 3
LAST_KERNELS: tuple = ()


_common.env_configs("COUNTDOWN_SPLIT_CONFIGS", CONFIGS, '{"abs": {"BN": 64}}')


@triton.jit
def _coef_kernel(
    X, IND, WG, WU, THR, ROWS, S, TOTAL, thr_f, d_model, d_inter, n_chunks, n_progs,
    MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr,
    THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BIG: tl.constexpr, BLOCK_C: tl.constexpr,
    C_STAGES: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    if PDL:  # the down kernel may launch now (it waits for this grid); the indicator is the last grid's
        gdc_launch_dependents()
        gdc_wait()
    kd = tl.arange(0, BLOCK_D)
    xv = _load_vec(X, kd, d_model, EVEN_D)
    if THR_PTR:
        thr_s = tl.load(THR).to(tl.float32)
    else:
        thr_s = thr_f
    cr = tl.arange(0, CHUNK)
    cb = tl.arange(0, BLOCK_C)
    for c in range(pid, n_chunks, n_progs):
        r0 = c * CHUNK
        before = 0  # kept rows before this chunk: this chunk's first place in the list
        for b in tl.range(0, r0, BLOCK_C, num_stages=C_STAGES):
            rb = b + cb
            mb = rb < r0
            vb = tl.load(IND + rb, mask=mb, other=0.0)
            before += tl.sum((_keep(vb, _row_thresholds(THR, rb, mb, thr_s, THR_VEC), MODE, ACT) & mb).to(tl.int32),
                             axis=0)
        r = r0 + cr
        rmask = r < d_inter
        ind = tl.load(IND + r, mask=rmask, other=0.0).to(tl.float32)
        pos, cnt = _kept_places(ind, _row_thresholds(THR, r, rmask, thr_s, THR_VEC), rmask, MODE, ACT)
        if c == n_chunks - 1:
            tl.store(TOTAL, before + cnt)
        for t in tl.range(0, cnt, BLOCK_M, num_stages=STAGES):
            m = t + tl.arange(0, BLOCK_M)
            valid = m < cnt
            sel = pos[None, :] == m[:, None]  # [BLOCK_M, CHUNK] one-hot: step slot -> chunk row
            rows = tl.sum(tl.where(sel, r[None, :], 0), axis=1)
            it = tl.sum(tl.where(sel, ind[None, :], 0.0), axis=1)
            roff, wmask = _row_tiles(rows, valid, kd, d_model, BIG, EVEN_D)
            if GATE:
                g = tl.sum(tl.load(WG + roff, mask=wmask, other=0.0).to(tl.float32) * xv[None, :], axis=1)
            else:  # the indicator is g itself (cats)
                g = it
            if UP:
                u = tl.sum(tl.load(WU + roff, mask=wmask, other=0.0).to(tl.float32) * xv[None, :], axis=1)
            else:  # the indicator is u itself (mono)
                u = it
            s = _round_to(u * _act(g, ACT), X.dtype.element_ty)  # s in the model's dtype, as the chain
            tl.store(ROWS + before + m, rows, mask=valid)
            tl.store(S + before + m, s, mask=valid)


@triton.jit
def _down_kernel(ROWS, S, TOTAL, WD, Y, d_model, BN: tl.constexpr, BT: tl.constexpr, BIG: tl.constexpr,
                 EVEN_N: tl.constexpr, D_STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    pid = tl.program_id(0)
    cols = pid * BN + tl.arange(0, BN)
    cmask = cols < d_model
    if PDL:  # the residual add after this may launch now; the list is the coefficient kernel's
        gdc_launch_dependents()
        gdc_wait()
    total = tl.load(TOTAL)
    bt = tl.arange(0, BT)
    acc = tl.zeros([BT, BN], dtype=tl.float32)  # summed over its rows once, after the loop
    for t in tl.range(0, total, BT, num_stages=D_STAGES):
        j = t + bt
        valid = j < total
        rows = tl.load(ROWS + j, mask=valid, other=0)
        s = tl.load(S + j, mask=valid, other=0.0)
        if BIG:
            off = rows.to(tl.int64)[:, None] * d_model + cols[None, :]
        else:
            off = rows[:, None] * d_model + cols[None, :]
        if EVEN_N:
            w = tl.load(WD + off, mask=valid[:, None], other=0.0)
        else:
            w = tl.load(WD + off, mask=valid[:, None] & cmask[None, :], other=0.0)
        acc += w.to(tl.float32) * s[:, None]
    y = tl.sum(acc, axis=0)
    tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=cmask)


def n_programs(device: torch.device, d_inter: int, mode: str, config: dict | None = None) -> int:
    """Programs of the coefficient kernel on ``device`` for ``d_inter`` rows."""
    cfg = {**CONFIGS[mode], **(config or {})}
    most = _common.persistent_programs(device, cfg["PER_SM"], INTERPRETER_PROGS)
    return max(1, min(triton.cdiv(d_inter, cfg["CHUNK"]), most))


def split_mlp(x, ind, w_gate, w_up, w_down_t, thr_t: Optional[torch.Tensor], thr_f: float, mode: str,
              activation: str, gate: bool, up: bool, config: dict | None = None) -> torch.Tensor:
    """y [1, d_model] in x's dtype for x [1, d_model] and its indicator ``ind`` [1, d_inter]: the kept
    rows (``mode``, threshold ``thr_t`` if given, else ``thr_f``; a 1-dim thr_t is one per row) summed
    as s W_down^T rows. ``gate`` / ``up``: whether the gate / up rows are loaded (False: that factor is
    the indicator itself)."""
    global LAST_KERNELS
    cfg = {**CONFIGS[mode], **(config or {})}
    n_tok, d_model = x.shape
    d_inter = w_gate.shape[0]
    if n_tok != 1:
        raise ValueError(f"the split sparse kernels take one token, got {n_tok}")
    if ind.shape != (1, d_inter):
        raise ValueError(f"indicator must be [1, {d_inter}], got {tuple(ind.shape)}")
    for name, w in (("w_up", w_up), ("w_down_t", w_down_t)):
        if w.shape != (d_inter, d_model):
            raise ValueError(f"{name} must be [d_inter, d_model] = {(d_inter, d_model)}, got {tuple(w.shape)}")
    thr_vec = thr_t is not None and thr_t.dim() == 1
    if thr_vec and thr_t.numel() != d_inter:
        raise ValueError(f"a per-row threshold needs d_inter={d_inter} values, got {thr_t.numel()}")
    if cfg["CHUNK"] & (cfg["CHUNK"] - 1) or cfg["BN"] & (cfg["BN"] - 1) or cfg["BT"] & (cfg["BT"] - 1):
        raise ValueError(f"CHUNK, BN and BT must be powers of two, got {cfg}")
    x, ind = x.contiguous(), ind.contiguous()
    rows, s, total = coefficients(x, ind, w_gate.contiguous(), w_up.contiguous(), thr_t, thr_f, mode, activation,
                                  gate, up, cfg)
    y = down_by_columns(rows, s, total, w_down_t.contiguous(), x.dtype, cfg)
    LAST_KERNELS = (COEF_LAST, DOWN_LAST)
    return y


COEF_LAST = DOWN_LAST = None


def coefficients(x, ind, w_gate, w_up, thr_t, thr_f, mode, activation, gate, up, cfg):
    """The first launch (contiguous inputs, checked by split_mlp): (ROWS int32 [d_inter], S fp32 [d_inter],
    TOTAL int32 [1]); only the first TOTAL entries of the list are written."""
    global COEF_LAST
    d_inter, d_model = w_gate.shape
    thr_vec = thr_t is not None and thr_t.dim() == 1
    progs = n_programs(x.device, d_inter, mode, cfg)
    block_d = max(16, _pow2(d_model))
    rows = torch.empty(d_inter, dtype=torch.int32, device=x.device)
    s = torch.empty(d_inter, dtype=torch.float32, device=x.device)
    total = torch.empty(1, dtype=torch.int32, device=x.device)
    pdl = _pdl.mode(x, "split")
    COEF_LAST = _coef_kernel[(progs,)](
        x, ind, w_gate, w_up, thr_t if thr_t is not None else s, rows, s, total, float(thr_f), d_model, d_inter,
        triton.cdiv(d_inter, cfg["CHUNK"]), progs,
        MODE=MODES[mode], GATE=gate, UP=up, ACT=act_code(activation), THR_PTR=thr_t is not None, THR_VEC=thr_vec,
        CHUNK=cfg["CHUNK"], BLOCK_M=cfg["BLOCK_M"], BLOCK_D=block_d, EVEN_D=block_d == d_model,
        BIG=d_inter * d_model >= 2**31, BLOCK_C=cfg["BLOCK_C"], C_STAGES=cfg["C_STAGES"], STAGES=cfg["STAGES"],
        PDL=pdl, num_warps=cfg["num_warps"], num_stages=1, **_pdl.launch_kwargs(pdl))
    return rows, s, total


def down_by_columns(rows, s, total, w_down_t, dtype, cfg) -> torch.Tensor:
    """The second launch: y [1, d_model] in ``dtype`` from the list (contiguous w_down_t)."""
    global DOWN_LAST
    d_inter, d_model = w_down_t.shape
    y = _common.new_output((1, d_model), dtype, w_down_t.device)
    pdl = _pdl.mode(w_down_t, "split")
    DOWN_LAST = _down_kernel[(triton.cdiv(d_model, cfg["BN"]),)](
        rows, s, total, w_down_t, y, d_model, BN=cfg["BN"], BT=cfg["BT"], BIG=d_inter * d_model >= 2**31,
        EVEN_N=d_model % cfg["BN"] == 0, D_STAGES=cfg["D_STAGES"], PDL=pdl, num_warps=cfg["D_WARPS"],
        num_stages=1, **_pdl.launch_kwargs(pdl))
    return y


@torch.library.custom_op("countdown::gated_split", mutates_args=())
def _split_op(x: torch.Tensor, ind: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
              thr_t: Optional[torch.Tensor], thr_f: float, mode: str, activation: str, gate: bool,
              up: bool) -> torch.Tensor:
    return split_mlp(x, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up)


@_split_op.register_fake
def _(x, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up):
    return torch.empty_like(x)
