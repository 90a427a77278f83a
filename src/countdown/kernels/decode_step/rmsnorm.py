"""Triton kernel: transformers' RMSNorm of a few decode tokens, one launch with a fixed configuration.

    y = g * round(x / sqrt(mean(x^2) + eps))       (computed in fp32, rounded as transformers rounds)

Why: in a compiled batch-1 decode step Inductor emits each layer's RMSNorm as a reduction of its own and
tunes it per compile, so the same norm's latency varies from call to call and compile to compile. This op
is opaque to Inductor (countdown.decode.layer calls it), one program per token row holding the whole row in
registers.

Rounding as transformers' LlamaRMSNorm: x / rms in fp32, rounded to x's dtype, then times the weight
(the product rounded to x's dtype again), so on the same input it gives the eager module's output up to
the order of the fp32 sum of squares.

``decode_add`` (h + m, rounded once, as PyTorch adds two bf16 tensors) is the folded layer's MLP residual on
a kernel of ours (countdown.decode.layer.mlp_half): with programmatic dependent launch on, a layer of folded
norms is then a chain of our kernels only, each able to launch while the one before finishes.
``decode_add_partials`` is the same add for a 4-bit layer (countdown.decode.int4_step): the residual plus the
fp32 partial sums a 4-bit GEMV leaves over slices of K; ``decode_add_norm`` adds them and takes the next RMSNorm
in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import new_output, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode
from ..jit_helpers import gdc_launch_dependents, gdc_wait, partial_sum, rms_norm_row, round_to
from .linear import MAX_TOKENS


@triton.jit
def rmsnorm_kernel(X, G, Y, eps, d, stride_x, stride_y, BD: tl.constexpr, EVEN: tl.constexpr,
                    PDL: tl.constexpr = 0):
    if PDL:  # launched early (PDL): x is the previous kernel's output; one small grid, signal at once
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0)
    k = tl.arange(0, BD)
    y = rms_norm_row(X + t * stride_x, G, eps, k, d, EVEN, Y.dtype.element_ty)
    if EVEN:
        tl.store(Y + t * stride_y + k, y.to(Y.dtype.element_ty))
    else:
        tl.store(Y + t * stride_y + k, y.to(Y.dtype.element_ty), mask=k < d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T <= 8, d] with weight [d] (same dtype and device): [T, d] in x's dtype. (Spy hook:
    ``on_launch("rms_norm", x)``.)"""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"rms_norm takes x [tokens <= {MAX_TOKENS}, d], got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{x.shape[1]}] of x's dtype and device ({x.dtype}, {x.device}), got "
                         f"{tuple(weight.shape)} {weight.dtype} {weight.device}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, d = x.shape
    y = new_output((n, d), x.dtype, x.device)
    bd = max(16, pow2(d))
    pdl = pdl_mode(x)
    launching("rms_norm", x)
    rmsnorm_kernel[(n,)](x, weight.contiguous(), y, float(eps), d, x.stride(0), y.stride(0), BD=bd, EVEN=bd == d,
                         PDL=pdl, num_warps=8 if bd >= 4096 else 4, **launch_kwargs(pdl))
    return y


@triton.jit
def add_kernel(H, M, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    if PDL:  # m is the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(H + i, mask=i < n, other=0.0).to(tl.float32) + tl.load(M + i, mask=i < n, other=0.0).to(tl.float32)
    tl.store(Y + i, round_to(s, Y.dtype.element_ty).to(Y.dtype.element_ty), mask=i < n)


def decode_add(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """h + m for two tensors of one shape, dtype and device (a decode step's residual add): in h's dtype,
    the fp32 sum rounded once to nearest, as PyTorch's add of two bf16 / fp16 tensors. (Spy hook:
    ``on_launch("decode_add", h, m)``.)"""
    if h.shape != m.shape or h.dtype != m.dtype or h.device != m.device:
        raise ValueError(f"decode_add takes two tensors of one shape, dtype and device, got {tuple(h.shape)} "
                         f"{h.dtype} {h.device} and {tuple(m.shape)} {m.dtype} {m.device}")
    h, m = h.contiguous(), m.contiguous()
    y = new_output(tuple(h.shape), h.dtype, h.device)
    n = h.numel()
    pdl = pdl_mode(h)
    block = launch_config("decode_add")["BLOCK"]
    launching("decode_add", h, m)
    add_kernel[(triton.cdiv(n, block),)](h, m, y, n, BLOCK=block, PDL=pdl, num_warps=4, **launch_kwargs(pdl))
    return y


@triton.jit
def add_partials_kernel(H, P, B, Y, n, S: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = 0):
    if PDL:  # the partials are the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(H + i, mask=i < n, other=0.0).to(tl.float32) + partial_sum(P, B, i, n, S, HAS_B)
    tl.store(Y + i, round_to(s, Y.dtype.element_ty).to(Y.dtype.element_ty), mask=i < n)


def decode_add_partials(h: torch.Tensor, partials: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """h + the sum over S of fp32 ``partials [S, *h.shape]`` (+ ``bias`` [h.shape[-1]]): a 4-bit GEMV's slices of
    K and the residual add in one launch (countdown.decode.int4_step), rounded once to h's dtype. (Spy hook:
    ``on_launch("decode_add_partials", h, partials)``.)"""
    if partials.dtype != torch.float32 or tuple(partials.shape[1:]) != (h.numel(),) or h.shape[:-1].numel() != 1:
        raise ValueError(f"decode_add_partials takes one row h and fp32 partials [S, {h.numel()}], got h "
                         f"{tuple(h.shape)} and partials {partials.dtype} {tuple(partials.shape)}")
    h, partials = h.contiguous(), partials.contiguous()
    y = new_output(tuple(h.shape), h.dtype, h.device)
    n = h.numel()
    pdl = pdl_mode(h)
    block = launch_config("decode_add")["BLOCK"]
    launching("decode_add_partials", h, partials)
    add_partials_kernel[(triton.cdiv(n, block),)](h, partials, partials if bias is None else bias.contiguous(), y, n,
                                                  S=partials.shape[0], HAS_B=bias is not None, BLOCK=block, PDL=pdl,
                                                  num_warps=4, **launch_kwargs(pdl))
    return y


@triton.jit
def add_norm_kernel(H, P, B, G, Y, X, eps, d, S: tl.constexpr, HAS_B: tl.constexpr, BD: tl.constexpr,
                     PDL: tl.constexpr = 0):
    if PDL:  # the partials are the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    k = tl.arange(0, BD)
    DT: tl.constexpr = Y.dtype.element_ty
    h = round_to(tl.load(H + k, mask=k < d, other=0.0).to(tl.float32) + partial_sum(P, B, k, d, S, HAS_B), DT)
    tl.store(Y + k, h.to(DT), mask=k < d)
    r = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / d + eps)
    g = tl.load(G + k, mask=k < d, other=0.0).to(tl.float32)
    tl.store(X + k, round_to(g * round_to(h * r, DT), DT).to(DT), mask=k < d)


def decode_add_norm(h: torch.Tensor, partials: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h' = h + sum(partials) (+ bias)`` as :func:`decode_add_partials`, and transformers' RMSNorm of h' (weight,
    eps), in one launch of one program: a 4-bit layer's residual add and the next norm (countdown.decode.int4_step).
    (Spy hook: ``on_launch("decode_add_norm", h, partials)``.)"""
    n = h.numel()
    if partials.dtype != torch.float32 or tuple(partials.shape[1:]) != (n,) or h.shape[:-1].numel() != 1 \
            or weight.shape != (n,) or weight.dtype != h.dtype:
        raise ValueError(f"decode_add_norm takes one row h, fp32 partials [S, {n}] and a norm weight [{n}] of h's "
                         f"dtype, got h {tuple(h.shape)}, partials {partials.dtype} {tuple(partials.shape)}, weight "
                         f"{weight.dtype} {tuple(weight.shape)}")
    h, partials = h.contiguous(), partials.contiguous()
    y = new_output(tuple(h.shape), h.dtype, h.device)
    x = new_output(tuple(h.shape), h.dtype, h.device)
    bd = max(16, pow2(n))
    pdl = pdl_mode(h)
    launching("decode_add_norm", h, partials)
    add_norm_kernel[(1,)](h, partials, partials if bias is None else bias.contiguous(), weight.contiguous(), y, x,
                          float(eps), n, S=partials.shape[0], HAS_B=bias is not None, BD=bd, PDL=pdl,
                          num_warps=8 if bd >= 4096 else 4, **launch_kwargs(pdl))
    return y, x


@torch.library.custom_op("countdown::decode_add_norm", mutates_args=())
def _decode_add_norm_op(h: torch.Tensor, partials: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return decode_add_norm(h, partials, bias, weight, eps)


@_decode_add_norm_op.register_fake
def _(h, partials, bias, weight, eps):
    return torch.empty_like(h), torch.empty_like(h)


@torch.library.custom_op("countdown::decode_add_partials", mutates_args=())
def _decode_add_partials_op(h: torch.Tensor, partials: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return decode_add_partials(h, partials, bias)


@_decode_add_partials_op.register_fake
def _(h, partials, bias):
    return torch.empty_like(h)


@torch.library.custom_op("countdown::decode_add", mutates_args=())
def _decode_add_op(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return decode_add(h, m)


@_decode_add_op.register_fake
def _(h, m):
    return torch.empty_like(h)


@torch.library.custom_op("countdown::decode_rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)
