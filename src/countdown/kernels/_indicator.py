"""Triton helpers: a one-token sparse kernel's indicator computed inside it, one chunk of rows at a time.

Used by _onepass.py when the indicator's rows (W_up for mono, W_gate for cats, a predictor's B^T for dual) are
read by the sparse kernel itself instead of a GEMV before it (IND "kernel"). For a chunk of rows r0, r0 + 1, ...
(``n_rows`` of them, zero past them and past ``d_inter``) and the indicator's input ``v``:

- ``_rows``: whole rows, one DRAM round trip (the chunk's [CHUNK, k] tile at once);
- ``_stepped_indicator``: ``RB`` rows a step (``_step_rows``), the steps software-pipelined ``ISTAGES`` deep, each
  step's dot products put into their slots of the chunk's vector (a streaming GEMV; mono's default);
- ``_dot_indicator``: a product over K, ``BK`` columns a step, on the tensor cores (``v`` padded to 16 columns)
  or, ``FMA``, on the CUDA cores into a [CHUNK, BK] fp32 accumulator summed once;
- ``_tma_indicator``: [RB, BK] tiles by Hopper's tensor-memory accelerator into shared memory, ``ISTAGES`` in
  flight without holding registers, one pipelined loop over every (row block, K step) of the chunk.

Each returns the chunk's indicator [CHUNK] in fp32 holding values of the input's dtype (``_round_to``: rounded
as a dense GEMV of that dtype returns them), so the kept rows match the route with a GEMV before the kernel.
Timings: docs/kernels.md item 9 and benchmarks/results/ind_kernel/.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._glu import _round_to


@triton.jit
def _rows(W, r, k, n_k, n_rows, BIG: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows ``r`` (columns ``k``) of a row-major [n_rows, n_k] matrix; rows past the end read as 0."""
    if BIG:
        off = r.to(tl.int64)[:, None] * n_k + k[None, :]
    else:
        off = r[:, None] * n_k + k[None, :]
    if EVEN_K:
        return tl.load(W + off, mask=(r < n_rows)[:, None], other=0.0)
    return tl.load(W + off, mask=(r < n_rows)[:, None] & (k < n_k)[None, :], other=0.0)


@triton.jit
def _step_rows(WI, r0, j, n_rows, ki, k_ind, d_inter, RB: tl.constexpr, BIG: tl.constexpr, EVEN_I: tl.constexpr):
    """Rows r0 + j .. r0 + j + RB - 1 of W_ind [d_inter, k_ind] (zero from row n_rows of the chunk on). (As
    _rows with the rows past the chunk moved past the end it compiles to 168 registers a thread instead of 236
    for mono's default, three programs an SM: not faster on the H200, 2026-11-25, results/ind_kernel/.)"""
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
    return _round_to(ind, DT)  # as a dense GEMV would return it


@triton.jit
def _dot_indicator(WI, V, r0, n_rows, cr, k_ind, d_inter, CHUNK: tl.constexpr, BK: tl.constexpr,
                   ISTAGES: tl.constexpr, BIG: tl.constexpr, DT: tl.constexpr, F32: tl.constexpr,
                   FMA: tl.constexpr = False):
    """ind [CHUNK] (fp32 holding DT values) = v . W_ind rows r0 .. r0 + n_rows - 1 (zero past them) as a
    matrix product: [CHUNK, BK] tiles of W_ind times [BK, 16] (v in column 0, zeros elsewhere), K walked BK
    at a time, its tiles pipelined ISTAGES deep through shared memory and reduced by the tensor cores (no
    reduction across warps per step, as in _stepped_indicator). Measured slower than it (H200, 2026-11-25,
    benchmarks/results/ind_kernel/): opt-in. F32: both operands in fp32 (the same exact products and fp32
    sums; the CPU interpreter (Triton 3.9) multiplies bf16 operands wrongly). FMA: the same K walk on the CUDA
    cores, a [CHUNK, BK] fp32 accumulator summed once at the end (a GEMV's tile loop)."""
    rows = r0 + cr
    rmask = (cr < n_rows) & (rows < d_inter)
    if BIG:
        base = rows.to(tl.int64)[:, None] * k_ind
    else:
        base = rows[:, None] * k_ind
    kb = tl.arange(0, BK)
    col = tl.arange(0, 16)
    acc = tl.zeros([CHUNK, BK if FMA else 16], dtype=tl.float32)
    for k0 in tl.range(0, k_ind, BK, num_stages=ISTAGES):
        kk = k0 + kb
        kmask = kk < k_ind
        w = tl.load(WI + base + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        v = tl.load(V + kk, mask=kmask, other=0.0)
        if FMA:
            acc += w.to(tl.float32) * v.to(tl.float32)[None, :]
        else:
            vb = tl.where(col[None, :] == 0, v[:, None], tl.zeros_like(v)[:, None]).to(WI.dtype.element_ty)
            if F32:
                acc = tl.dot(w.to(tl.float32), vb.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, vb, acc)
    return _round_to(tl.sum(acc, axis=1), DT)  # (the product's other columns are exact zeros)


@triton.jit
def _tma_indicator(desc, V, r0, n_rows, cr, k_ind, RB: tl.constexpr, BK: tl.constexpr, ISTAGES: tl.constexpr,
                   DT: tl.constexpr):
    """ind [CHUNK] (fp32 holding DT values) = v . W_ind rows r0 .. r0 + n_rows - 1 for ``desc``, a host-side
    TensorDescriptor of W_ind [d_inter, k_ind] with block [RB, BK] (rows and columns past W_ind read as 0; rows of
    the next chunk land in slots >= n_rows, which the caller masks). One loop over every (row block, K step) of
    the chunk, software-pipelined ISTAGES deep: the tiles wait in shared memory, so the bytes in flight do not
    cost registers (the registers hold an [RB, BK] fp32 sum, reduced once per row block). benchmarks/tma_gemv.py
    streams a chunk this way at 87-90 % of the copy bandwidth on an H200 (2026-11-25)."""
    rb = tl.arange(0, RB)
    kb = tl.arange(0, BK)
    nk = tl.cdiv(k_ind, BK)
    acc = tl.zeros([RB, BK], dtype=tl.float32)
    ind = tl.zeros(cr.shape, dtype=tl.float32)
    for i in tl.range(0, tl.cdiv(n_rows, RB) * nk, num_stages=ISTAGES):
        b = i // nk
        k0 = (i - b * nk) * BK
        w = desc.load([r0 + b * RB, k0])
        v = tl.load(V + k0 + kb, mask=k0 + kb < k_ind, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * v[None, :]
        if k0 + BK >= k_ind:  # the row block's last K step: its dot products into their slots
            d = tl.sum(acc, axis=1)
            ind += tl.sum(tl.where(cr[:, None] == (b * RB + rb)[None, :], d[None, :], 0.0), axis=1)
            acc = tl.zeros([RB, BK], dtype=tl.float32)
    return _round_to(ind, DT)  # as a dense GEMV would return it
