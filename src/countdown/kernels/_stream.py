"""Triton kernel: the sparse phase of one token from a list of kept rows, the work split evenly.

_onepass.py gives each program whole chunks of rows and lets it find the kept ones itself; at
k = 0.9 a chunk of 64 rows keeps 6 on average but up to 15, so the slowest program, not the bytes,
might set the time (31 % of the copy bandwidth on an H200, docs/kernels_shadow.md). Here the indicator
kernel (the shadow GEMV of _gemv.py with a cut) has already written the kept rows as L lists, one
per program of its own, ``lists[l * cap : l * cap + counts[l]]``. Every program of this kernel reads
the L counts (a few hundred integers), forms their prefix sums, and takes the kept rows
``j = pid * BM, pid * BM + PROGS * BM, ...`` of the concatenated lists: BM rows per step, the same
number of steps (within one) for every program. Per step::

    list l of row j = #{l' : incl[l'] <= j}      (incl: inclusive prefix sums of the counts)
    row             = lists[l * cap + j - excl[l]]
    s               = (x . W_up[row]) * act(x . W_gate[row])     fp32, rounded to x's dtype
    P[pid]         += s * W_down^T[row]                           fp32 [d_model]

With PREFETCH the next step's rows are requested before the current step's arithmetic (two steps
of rows in flight per program). The partial sums P [PROGS, d_model] are written whole and summed
by the caller (under torch.compile, fused into the residual add), so the result does not depend on
timing: the lists are in a fixed order and every program sums its rows in that order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common, _pdl
from ._common import act_code
from ._glu import _act, _load_vec, _pow2, _round_to, _row_tiles, _store_partial
from ._pdl import gdc_wait

# Launch configuration: BM kept rows per step, PER_SM programs per SM. The fastest of
# `benchmarks/stream.py`'s sweep on an H200, 2026-11-23, Llama-3.1-8B shape (benchmarks/results/stream/):
# the sparse phase alone 24.3 us at k = 0.9 (onepass 26.4), 43.2 us at k = 0.7 (onepass 46.0); the
# whole shadow MLP no faster than the onepass route (compiled k = 0.9: 50.5 vs 49.4 us), so the route
# stays opt-in. The same run's probe: with nothing kept the phase still costs 8.8-11 us (launches,
# partials and their sum), with everything kept it streams at 85-87 % of copy bandwidth: at high k the
# gap is that fixed cost, not the balance of work that this kernel fixes.
CONFIG = dict(BM=4, num_warps=4, PER_SM=2, PREFETCH=False)
INTERPRETER_PROGS = 3
LAST_KERNEL = None


@triton.jit
def _kept_rows(LISTS, incl, excl, li, j, total, cap):
    """The row ids of kept-row positions ``j`` [BM] of the concatenated lists (0 past ``total``)."""
    valid = j < total
    owner = tl.sum((incl[None, :] <= j[:, None]).to(tl.int32), axis=1)
    start = tl.sum(tl.where(li[None, :] == owner[:, None], excl[None, :], 0), axis=1)
    return tl.load(LISTS + owner * cap + (j - start), mask=valid, other=0), valid


@triton.jit
def _load_rows(WG, WU, WD, rows, valid, kd, d_model, BIG: tl.constexpr, EVEN_D: tl.constexpr):
    off, m = _row_tiles(rows, valid, kd, d_model, BIG, EVEN_D)
    return (tl.load(WG + off, mask=m, other=0.0), tl.load(WU + off, mask=m, other=0.0),
            tl.load(WD + off, mask=m, other=0.0))


@triton.jit
def _stream_kernel(X, LISTS, COUNTS, WG, WU, WD, P, n_lists, cap, d_model, n_progs,
                   ACT: tl.constexpr, BM: tl.constexpr, NL: tl.constexpr, BLOCK_D: tl.constexpr,
                   EVEN_D: tl.constexpr, BIG: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    kd = tl.arange(0, BLOCK_D)
    xv = _load_vec(X, kd, d_model, EVEN_D)
    if PDL:  # launched during the GEMV: its lists are complete and visible after this
        gdc_wait()
    li = tl.arange(0, NL)
    counts = tl.load(COUNTS + li, mask=li < n_lists, other=0)
    incl = tl.cumsum(counts, axis=0)
    excl = incl - counts
    total = tl.sum(counts, axis=0)
    bm = tl.arange(0, BM)
    yacc = tl.zeros([BLOCK_D], dtype=tl.float32)
    step = n_progs * BM
    if PREFETCH:
        rows_n, valid_n = _kept_rows(LISTS, incl, excl, li, pid * BM + bm, total, cap)
        wg_n, wu_n, wd_n = _load_rows(WG, WU, WD, rows_n, valid_n, kd, d_model, BIG, EVEN_D)
    for t in range(pid * BM, total, step):
        if PREFETCH:  # this step's rows arrived during the last one; request the next step's
            wg, wu, wd, valid = wg_n, wu_n, wd_n, valid_n
            rows_n, valid_n = _kept_rows(LISTS, incl, excl, li, t + step + bm, total, cap)
            wg_n, wu_n, wd_n = _load_rows(WG, WU, WD, rows_n, valid_n, kd, d_model, BIG, EVEN_D)
        else:
            rows, valid = _kept_rows(LISTS, incl, excl, li, t + bm, total, cap)
            wg, wu, wd = _load_rows(WG, WU, WD, rows, valid, kd, d_model, BIG, EVEN_D)
        g = tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        u = tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
        s = _round_to(tl.where(valid, u * _act(g, ACT), 0.0), X.dtype.element_ty)
        yacc += tl.sum(wd.to(tl.float32) * s[:, None], axis=0)
    _store_partial(P, pid, yacc, kd, d_model, BIG, EVEN_D)


def n_programs(device: torch.device, config: dict | None = None) -> int:
    """Rows of the partial sums this kernel writes on ``device``."""
    cfg = {**CONFIG, **(config or {})}
    return _common.persistent_programs(device, cfg["PER_SM"], INTERPRETER_PROGS)


def stream_partials(x, lists, counts, cap: int, w_gate, w_up, w_down_t, activation: str,
                    config: dict | None = None) -> torch.Tensor:
    """fp32 partial sums P [programs, d_model] of the kept rows in ``lists`` / ``counts`` (see the
    module docstring; from ``_gemv.launch(..., cut=...)``) for x [1, d_model]; y = P.sum(0)."""
    global LAST_KERNEL
    cfg = {**CONFIG, **(config or {})}
    if x.shape[0] != 1:
        raise ValueError(f"the streaming sparse kernel takes one token, got {x.shape[0]}")
    d_inter, d_model = w_gate.shape
    if w_up.shape != (d_inter, d_model) or w_down_t.shape != (d_inter, d_model):
        raise ValueError(f"w_gate, w_up and w_down_t must all be [d_inter, d_model] = {(d_inter, d_model)}, got "
                         f"{tuple(w_up.shape)} and {tuple(w_down_t.shape)}")
    if lists.numel() != counts.numel() * cap:
        raise ValueError(f"{counts.numel()} lists of {cap} slots need {counts.numel() * cap} entries, got {lists.numel()}")
    x, w_gate, w_up, w_down_t = x.contiguous(), w_gate.contiguous(), w_up.contiguous(), w_down_t.contiguous()
    progs = n_programs(x.device, cfg)
    block_d = max(16, _pow2(d_model))
    p = _common.new_output((progs, d_model), torch.float32, x.device)
    pdl = _pdl.mode(x, "stream")
    LAST_KERNEL = _stream_kernel[(progs,)](
        x, lists, counts, w_gate, w_up, w_down_t, p, counts.numel(), cap, d_model, progs,
        ACT=act_code(activation), BM=cfg["BM"], NL=max(16, _pow2(counts.numel())), BLOCK_D=block_d,
        EVEN_D=block_d == d_model, BIG=d_inter * d_model >= 2**31, PREFETCH=bool(cfg["PREFETCH"]), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=1, **_pdl.launch_kwargs(pdl))
    return p
