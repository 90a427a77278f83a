"""Triton kernel: y = P.sum(0) in the model's dtype, for the sparse kernels' fp32 partials.

The one-launch sparse kernel (_onepass.py) leaves one fp32 partial sum per program, P [programs,
d_model] (224 x 4096 at the Llama-3.1-8B shape); the few-token, TEAL and hybrid kernels [programs,
tokens, d_model]. In a compiled decode step Inductor splits that reduction into two kernels (2.3 + 1.2 us
a layer on an H200, `benchmarks/decode.py --profile`, 2026-11-23); run eagerly, PyTorch's sum and cast took
8.1 us. Here one launch does it (the default where the MLP runs eagerly, see ROUTE): program p owns BD columns and loads the whole [programs, BD] block at once (one round trip
to L2, where the partials were just written), sums it in fp32 and rounds once to the output dtype.
Deterministic (a fixed order per column), like the sum it replaces.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import _common, _pdl
from ._glu import _pow2, _round_to
from ._pdl import gdc_launch_dependents, gdc_wait

# Which sum runs (COUNTDOWN_PSUM): "auto" (the default) this file's op when the call runs eagerly and
# PyTorch's P.sum(0).to(dtype) while torch.compile traces it (Inductor then fuses the sum into the residual
# add); "kernel" / "inductor" one of them always. Why "auto": where the MLP runs eagerly (a plain eager
# step, a CUDA graph of one, the one-compile benchmark's opaque slots) PyTorch's sum is a generic reduction
# plus a cast: 7.0 + 1.1 us a layer on an H200 for [224, 4096] (`benchmarks/decode.py --profile`,
# 2026-11-25), against 3.3 us for this op alone (benchmarks/psum.py). Under a full-graph compile the op
# replaced Inductor's two kernels (3.5 us a layer) with 3.0 us, but the residual add then moved into the
# next RMSNorm kernel and the step did not get measurably faster (docs/decode.md, run Y).
#
# "tail" (opt-in): the one-token sparse kernel (_onepass.py) sums its own partials after its main loop
# (:func:`_sum_tail`), so no launch of its own is left for the sum, eager or compiled; elsewhere as "auto".
# Measured on an H200, 2026-11-25 (benchmarks/psum_tail.py, benchmarks/results/psum_tail/): 32-layer chains
# at k = 0.9 mono 7 % faster, dual[lowrank] 9-12 % slower; in the decode step no gain (mono 349.2 against
# 350.9 tokens/s, dual 418.7 against 424.0; runs AW). So not the default.
ROUTE = os.environ.get("COUNTDOWN_PSUM", "auto")
if ROUTE not in ("auto", "kernel", "inductor", "tail"):
    raise ValueError(f"COUNTDOWN_PSUM must be 'auto', 'kernel', 'inductor' or 'tail', got {ROUTE!r}")
BD = 16  # columns per program: 256 programs at d_model 4096, each loading [programs, 16] fp32
MAX_ELEMS = 8192  # the most values one program loads at once; more rows are summed in steps
OFF_CUDA = False  # the op under the CPU interpreter too (tests only)


@triton.jit
def _psum_kernel(P, Y, R, n_rows, d, BR: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = 0,
                 RES: tl.constexpr = False):
    pid = tl.program_id(0)
    if PDL == 1:  # launched early (_pdl.py); the next grid may launch now
        gdc_launch_dependents()
    if PDL:  # the partials are the previous kernel's output
        gdc_wait()
    cols = pid * BD + tl.arange(0, BD)
    cmask = cols < d
    acc = tl.zeros([BD], dtype=tl.float32)
    for r0 in range(0, n_rows, BR):
        r = r0 + tl.arange(0, BR)
        tile = tl.load(P + r[:, None] * d + cols[None, :], mask=(r < n_rows)[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    if PDL == 2:
        gdc_launch_dependents()
    acc = _round_to(acc, Y.dtype.element_ty)  # round to nearest (the interpreter's cast truncates)
    if RES:  # the residual add after it, rounded once more (as decode_add(h, y) rounds h + y)
        acc = _round_to(acc + tl.load(R + cols, mask=cmask, other=0.0).to(tl.float32), Y.dtype.element_ty)
    tl.store(Y + cols, acc.to(Y.dtype.element_ty), mask=cmask)


def sum_partials(p: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor | None = None) -> torch.Tensor:
    """p.sum(0) for fp32 partials p [rows, ...] (one token's [rows, d]: y [1, d]; a few tokens'
    [rows, tokens, d]: y [tokens, d]), rounded once to ``dtype``; with ``residual`` (y's shape and
    ``dtype``) residual + that sum, rounded once more (kernels/_block.py: the MLP's residual add)."""
    if p.dim() < 2 or p.dtype != torch.float32:
        raise ValueError(f"partials must be fp32 [rows, d_model] or [rows, tokens, d_model], got {p.dtype} "
                         f"{tuple(p.shape)}")
    out_shape = _out_shape(p)
    if residual is not None and (residual.numel() != p[0].numel() or residual.dtype != dtype
                                 or residual.device != p.device):
        raise ValueError(f"the residual must hold {tuple(out_shape)} values of {dtype} on {p.device}, got "
                         f"{tuple(residual.shape)} {residual.dtype} {residual.device}")
    p = p.contiguous().reshape(p.shape[0], -1)
    rows, d = p.shape
    y = _common.new_output(out_shape, dtype, p.device)
    br = max(16, min(_pow2(rows), MAX_ELEMS // BD))
    pdl = _pdl.mode(p, "psum")
    res = residual.contiguous() if residual is not None else y
    _psum_kernel[(triton.cdiv(d, BD),)](p, y, res, rows, d, BR=br, BD=BD, PDL=pdl, RES=residual is not None,
                                        num_warps=4, **_pdl.launch_kwargs(pdl))
    return y


def _out_shape(p: torch.Tensor) -> tuple:
    return (1, p.shape[1]) if p.dim() == 2 else tuple(p.shape[1:])


@torch.library.custom_op("countdown::sum_partials", mutates_args=())
def _psum_op(p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sum_partials(p, like.dtype)


@_psum_op.register_fake
def _(p, like):
    return p.new_empty(_out_shape(p), dtype=like.dtype)


@torch.library.custom_op("countdown::sum_partials_add", mutates_args=())
def _psum_add_op(p: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return sum_partials(p, residual.dtype, residual=residual)


@_psum_add_op.register_fake
def _(p, residual):
    return p.new_empty(_out_shape(p), dtype=residual.dtype)


def use_kernel(p: torch.Tensor) -> bool:
    """Whether :func:`reduce` takes this file's op for ``p`` now (see ROUTE)."""
    if ROUTE == "inductor" or not (p.is_cuda or OFF_CUDA):
        return False
    return ROUTE == "kernel" or not torch.compiler.is_compiling()


# --- The tail route: the sparse kernel's last programs sum the partials themselves ---------------------
#
# After a program has stored its partial row it takes a ticket (an atomic counter: its place in the order
# the programs finish). The last REDUCERS programs to finish each own BC columns: each waits until every
# program has a ticket (all partials stored and visible), sums its columns over all rows in a fixed order
# (deterministic, whoever finishes last) and rounds once to the output dtype; the last reducer done sets
# the counters back to zero for the next launch. Only REDUCERS programs ever wait, fewer than the GPU's SMs,
# so every other program of the grid always finds a place to run: no deadlock whatever the grid's size or
# the SMs' occupancy. Under the CPU interpreter programs run one after another, so there REDUCERS is 1 (the
# last program sums everything; it never waits). The counters assume one such kernel at a time per device
# (a decode step's layers run in order).
TAIL_REDUCERS = 64  # the most reducers (each sums [programs, d / REDUCERS] fp32 from L2)
_COUNTERS: dict = {}


@triton.jit
def _sum_tail(P, Y, T, n_rows, d, REDUCERS: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """Called by every program after storing its row of P [n_rows, d]: the last REDUCERS to arrive write
    Y [d] = P.sum(0) rounded to Y's dtype; T: two int32 counters, zero on entry and on exit."""
    tl.debug_barrier()  # every thread's share of this program's partial is stored before the ticket
    ticket = tl.atomic_add(T, 1, sem="acq_rel", scope="gpu")
    first = n_rows - REDUCERS
    if ticket >= first:
        while tl.atomic_add(T, 0, sem="acquire", scope="gpu") < n_rows:
            pass
        cols = (ticket - first) * BC + tl.arange(0, BC)
        cmask = cols < d
        acc = tl.zeros([BC], dtype=tl.float32)
        for r0 in range(0, n_rows, BR):
            r = r0 + tl.arange(0, BR)
            tile = tl.load(P + r[:, None] * d + cols[None, :], mask=(r < n_rows)[:, None] & cmask[None, :],
                           other=0.0, cache_modifier=".cg")
            acc += tl.sum(tile, axis=0)
        acc = _round_to(acc, Y.dtype.element_ty)
        tl.store(Y + cols, acc.to(Y.dtype.element_ty), mask=cmask)
        done = tl.atomic_add(T + 1, 1, sem="acq_rel", scope="gpu")
        if done == REDUCERS - 1:  # every reducer is past its wait: nobody reads the ticket counter again
            tl.atomic_xchg(T, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(T + 1, 0, sem="relaxed", scope="gpu")


def tail_shape(device, n_rows: int, d: int) -> tuple[int, int, int]:
    """(REDUCERS, BC, BR) for a kernel of ``n_rows`` programs: at most TAIL_REDUCERS reducers, fewer than
    half the SMs (so that waiting ones never hold every SM), one under the interpreter; BC columns each
    (a power of two, REDUCERS * BC >= d); BR rows a load."""
    device = torch.device(device)
    if device.type == "cuda" and not _common.interpreting():
        most = max(1, min(TAIL_REDUCERS, n_rows, _common.persistent_programs(device, 1, 1) // 2))
    else:
        most = 1
    bc = max(16, _pow2(triton.cdiv(d, most)))
    return triton.cdiv(d, bc), bc, max(1, min(_pow2(n_rows), MAX_ELEMS // bc))


def _key(device: torch.device) -> tuple:
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    return device.type, index


def prepare_tail(device) -> torch.Tensor:
    """Make the tail's two int32 counters on ``device`` (zeroed once, then kept at zero by the kernel). On
    CUDA call it once, eagerly, before a step is compiled or captured: an allocation made inside a compiled
    step's CUDA-graph pool is one torch.compile rejects (seen with the attention's counters, 2026-11-25)."""
    device = torch.device(device)
    found = _COUNTERS.get(_key(device))
    if found is None:
        found = _COUNTERS[_key(device)] = torch.zeros(2, dtype=torch.int32, device=device)
    return found


def counters(device) -> torch.Tensor | None:
    """The tail's counters on ``device``: made on first use off CUDA (the interpreter), on CUDA only by
    :func:`prepare_tail` (None before: the kernel then writes its partials and a launch sums them)."""
    device = torch.device(device)
    if device.type != "cuda":
        return prepare_tail(device)
    return _COUNTERS.get(_key(device))


def use_tail(x: torch.Tensor) -> bool:
    """Whether the one-token sparse kernel sums its own partials for this input now (ROUTE "tail")."""
    return ROUTE == "tail" and (x.is_cuda or OFF_CUDA)


def reduce(p: torch.Tensor, like: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """p.sum(0) in ``like``'s dtype (2-D p: [1, d], kept dim): this file's op or PyTorch's sum (ROUTE). With
    ``residual`` (a folded layer's h, kernels/_block.py) residual + that sum in residual's shape, on this file's
    kernel wherever the kernels run, compiled or not: one launch of ours for the sum and the add."""
    if residual is not None:
        if residual.dtype != like.dtype or residual.numel() != p[0].numel():
            raise ValueError(f"the residual must hold {p[0].numel()} values of {like.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        if p.is_cuda or OFF_CUDA:
            return torch.ops.countdown.sum_partials_add(p, residual.reshape(_out_shape(p))).view(residual.shape)
        return add_residual(reduce(p, like), residual)
    if use_kernel(p):
        return torch.ops.countdown.sum_partials(p, like)
    return p.sum(0, keepdim=p.dim() == 2).to(like.dtype)


def add_residual(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + y in residual's shape (y as many values), rounded once as PyTorch adds two tensors of one dtype:
    on kernels/_rmsnorm.py's decode_add where the kernels run (a launch of ours, chained by PDL), else PyTorch's
    add. ``residual`` None: y itself."""
    if residual is None:
        return y
    y = y.reshape(residual.shape)
    if y.is_cuda or OFF_CUDA:
        from . import _rmsnorm  # noqa: F401  (registers countdown::decode_add)

        return torch.ops.countdown.decode_add(residual, y)
    return residual + y
