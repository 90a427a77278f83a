"""Triton kernel: y = P.sum(0) in the model's dtype, for the sparse kernels' fp32 partials.

The one-token kernels (one_token.py, select.py) leave one fp32 partial sum per program, P [programs, d_model];
the few-token and TEAL kernels [programs, tokens, d_model]. Inductor splits that reduction into two kernels, and
PyTorch run eagerly into a generic reduction plus a cast. Here one launch does it (where the MLP runs eagerly:
:func:`reduce`, by route.py's "partial_sums"): program p owns BD columns and loads the whole [programs, BD] block
at once (one round trip to L2, where the partials were just written), sums it in fp32
and rounds once to the output dtype. Deterministic (a fixed order per column), like the sum it replaces.
With a residual (a folded layer's h) the MLP's residual add rides in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import new_output, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode
from ..jit_helpers import gdc_launch_dependents, gdc_wait, round_to
from ..route import route


@triton.jit
def partial_sums_kernel(P, Y, R, n_rows, d, BR: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = 0,
                 RES: tl.constexpr = False):
    pid = tl.program_id(0)
    if PDL:  # launched early (PDL); the next grid may launch now
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
    acc = round_to(acc, Y.dtype.element_ty)  # round to nearest (the interpreter's cast truncates)
    if RES:  # the residual add after it, rounded once more (as decode_add(h, y) rounds h + y)
        acc = round_to(acc + tl.load(R + cols, mask=cmask, other=0.0).to(tl.float32), Y.dtype.element_ty)
    tl.store(Y + cols, acc.to(Y.dtype.element_ty), mask=cmask)


def sum_partials(p: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor | None = None) -> torch.Tensor:
    """p.sum(0) for fp32 partials p [rows, ...] (one token's [rows, d]: y [1, d]; a few tokens'
    [rows, tokens, d]: y [tokens, d]), rounded once to ``dtype``; with ``residual`` (y's shape and
    ``dtype``) residual + that sum, rounded once more (a folded layer's MLP residual add). Launch configuration:
    config.LAUNCH["partial_sums"], BD columns a program (256 programs at d_model 4096), at most MAX_ELEMS values
    loaded at once (more rows summed in steps). (Spy hook: ``on_launch("partial_sums", p, residual)``.)"""
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
    y = new_output(out_shape, dtype, p.device)
    cfg = launch_config("partial_sums", p.device)
    BD = cfg["BD"]
    br = max(16, min(pow2(rows), cfg["MAX_ELEMS"] // BD))
    pdl = pdl_mode(p)
    res = residual.contiguous() if residual is not None else y
    launching("partial_sums", p, residual)
    partial_sums_kernel[(triton.cdiv(d, BD),)](p, y, res, rows, d, BR=br, BD=BD, PDL=pdl, RES=residual is not None,
                                               num_warps=4, **launch_kwargs(pdl))
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


def reduce(p: torch.Tensor, like: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """p.sum(0) in ``like``'s dtype (2-D p: [1, d], kept dim; ``like``: the MLP's input x [tokens, d]): this file's
    op where route.py's "partial_sums" takes it and the call runs eagerly (a plain eager step, a CUDA graph of one,
    an opaque slot, where PyTorch's sum is a generic reduction plus a cast), else PyTorch's sum (while
    torch.compile traces it, so that Inductor fuses the sum into the residual add that follows). With ``residual``
    (a folded layer's h) residual + that sum in residual's shape, on this file's kernel wherever its route takes
    it, compiled or not: one launch of ours for the sum and the add."""
    kernel = route("partial_sums", like) == "partial_sums"
    if residual is not None:
        if residual.dtype != like.dtype or residual.numel() != p[0].numel():
            raise ValueError(f"the residual must hold {p[0].numel()} values of {like.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        if kernel:
            return torch.ops.countdown.sum_partials_add(p, residual.reshape(_out_shape(p))).view(residual.shape)
        return add_residual(reduce(p, like), residual)
    if kernel and not torch.compiler.is_compiling():
        return torch.ops.countdown.sum_partials(p, like)
    return p.sum(0, keepdim=p.dim() == 2).to(like.dtype)


def add_residual(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + y in residual's shape (y as many values), rounded once as PyTorch adds two tensors of one dtype:
    on decode_step/rmsnorm.py's decode_add where route.py's "residual_add" takes it (a launch of ours, chained by
    PDL), else PyTorch's add. ``residual`` None: y itself."""
    if residual is None:
        return y
    y = y.reshape(residual.shape)
    if route("residual_add", y) == "residual_add":
        from ..decode_step import rmsnorm  # noqa: F401  (registers countdown::decode_add)

        return torch.ops.countdown.decode_add(residual, y)
    return residual + y
