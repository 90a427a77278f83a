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
ROUTE = os.environ.get("COUNTDOWN_PSUM", "auto")
if ROUTE not in ("auto", "kernel", "inductor"):
    raise ValueError(f"COUNTDOWN_PSUM must be 'auto', 'kernel' or 'inductor', got {ROUTE!r}")
BD = 16  # columns per program: 256 programs at d_model 4096, each loading [programs, 16] fp32
MAX_ELEMS = 8192  # the most values one program loads at once; more rows are summed in steps
OFF_CUDA = False  # the op under the CPU interpreter too (tests only)


@triton.jit
def _psum_kernel(P, Y, n_rows, d, BR: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = 0):
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
    tl.store(Y + cols, acc.to(Y.dtype.element_ty), mask=cmask)


def sum_partials(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """p.sum(0) for fp32 partials p [rows, ...] (one token's [rows, d]: y [1, d]; a few tokens'
    [rows, tokens, d]: y [tokens, d]), rounded once to ``dtype``."""
    if p.dim() < 2 or p.dtype != torch.float32:
        raise ValueError(f"partials must be fp32 [rows, d_model] or [rows, tokens, d_model], got {p.dtype} "
                         f"{tuple(p.shape)}")
    out_shape = _out_shape(p)
    p = p.contiguous().reshape(p.shape[0], -1)
    rows, d = p.shape
    y = _common.new_output(out_shape, dtype, p.device)
    br = max(16, min(_pow2(rows), MAX_ELEMS // BD))
    pdl = _pdl.mode(p, "psum")
    _psum_kernel[(triton.cdiv(d, BD),)](p, y, rows, d, BR=br, BD=BD, PDL=pdl, num_warps=4, **_pdl.launch_kwargs(pdl))
    return y


def _out_shape(p: torch.Tensor) -> tuple:
    return (1, p.shape[1]) if p.dim() == 2 else tuple(p.shape[1:])


@torch.library.custom_op("countdown::sum_partials", mutates_args=())
def _psum_op(p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sum_partials(p, like.dtype)


@_psum_op.register_fake
def _(p, like):
    return p.new_empty(_out_shape(p), dtype=like.dtype)


def use_kernel(p: torch.Tensor) -> bool:
    """Whether :func:`reduce` takes this file's op for ``p`` now (see ROUTE)."""
    if ROUTE == "inductor" or not (p.is_cuda or OFF_CUDA):
        return False
    return ROUTE == "kernel" or not torch.compiler.is_compiling()


def reduce(p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """p.sum(0) in ``like``'s dtype (2-D p: [1, d], kept dim): this file's op or PyTorch's sum (ROUTE)."""
    if use_kernel(p):
        return torch.ops.countdown.sum_partials(p, like)
    return p.sum(0, keepdim=p.dim() == 2).to(like.dtype)
