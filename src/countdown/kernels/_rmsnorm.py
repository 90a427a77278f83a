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

from . import _common, _pdl
from ._glu import _pow2, _round_to
from ._pdl import gdc_launch_dependents, gdc_wait

MAX_TOKENS = _common.DECODE_GEMV_MAX_TOKENS


@triton.jit
def _normed(X, G, eps, k, d, EVEN: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of the row X[k] with weight G[k] (k covers d; EVEN: exactly), in fp32 rounded as transformers
    rounds to DT. Shared with the sparse kernel that computes the norm of its own input (_onepass.py NORM)."""
    if EVEN:
        x = tl.load(X + k).to(tl.float32)
        g = tl.load(G + k).to(tl.float32)
    else:
        x = tl.load(X + k, mask=k < d, other=0.0).to(tl.float32)
        g = tl.load(G + k, mask=k < d, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    return _round_to(g * _round_to(x * r, DT), DT)


@triton.jit
def _rmsnorm_kernel(X, G, Y, eps, d, stride_x, stride_y, BD: tl.constexpr, EVEN: tl.constexpr,
                    PDL: tl.constexpr = 0):
    if PDL:  # launched early (_pdl.py): x is the previous kernel's output; one small grid, signal at once
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0)
    k = tl.arange(0, BD)
    y = _normed(X + t * stride_x, G, eps, k, d, EVEN, Y.dtype.element_ty)
    if EVEN:
        tl.store(Y + t * stride_y + k, y.to(Y.dtype.element_ty))
    else:
        tl.store(Y + t * stride_y + k, y.to(Y.dtype.element_ty), mask=k < d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T <= 8, d] with weight [d] (same dtype and device): [T, d] in x's dtype."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"rms_norm takes x [tokens <= {MAX_TOKENS}, d], got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{x.shape[1]}] of x's dtype and device ({x.dtype}, {x.device}), got "
                         f"{tuple(weight.shape)} {weight.dtype} {weight.device}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, d = x.shape
    y = _common.new_output((n, d), x.dtype, x.device)
    bd = max(16, _pow2(d))
    pdl = _pdl.mode(x)
    _rmsnorm_kernel[(n,)](x, weight.contiguous(), y, float(eps), d, x.stride(0), y.stride(0), BD=bd, EVEN=bd == d,
                          PDL=pdl, num_warps=8 if bd >= 4096 else 4, **_pdl.launch_kwargs(pdl))
    return y


ADD_BLOCK = 1024


@triton.jit
def _add_kernel(H, M, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    if PDL:  # m is the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(H + i, mask=i < n, other=0.0).to(tl.float32) + tl.load(M + i, mask=i < n, other=0.0).to(tl.float32)
    tl.store(Y + i, _round_to(s, Y.dtype.element_ty).to(Y.dtype.element_ty), mask=i < n)


def decode_add(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """h + m for two tensors of one shape, dtype and device (a decode step's residual add): in h's dtype,
    the fp32 sum rounded once to nearest, as PyTorch's add of two bf16 / fp16 tensors."""
    if h.shape != m.shape or h.dtype != m.dtype or h.device != m.device:
        raise ValueError(f"decode_add takes two tensors of one shape, dtype and device, got {tuple(h.shape)} "
                         f"{h.dtype} {h.device} and {tuple(m.shape)} {m.dtype} {m.device}")
    h, m = h.contiguous(), m.contiguous()
    y = _common.new_output(tuple(h.shape), h.dtype, h.device)
    n = h.numel()
    pdl = _pdl.mode(h)
    _add_kernel[(triton.cdiv(n, ADD_BLOCK),)](h, m, y, n, BLOCK=ADD_BLOCK, PDL=pdl, num_warps=4,
                                              **_pdl.launch_kwargs(pdl))
    return y


@triton.jit
def _partial_sum(P, B, i, n, S: tl.constexpr, HAS_B: tl.constexpr, CG: tl.constexpr = False):
    """Entries ``i`` of the sum over S of fp32 partials [S, n] (plus the bias B[i] where HAS_B), in fp32, in order.
    CG: the partials from L2, not L1 (written by other programs of the same launch: kernels/_int4_rows_down.py)."""
    cm: tl.constexpr = ".cg" if CG else ""
    m = tl.load(P + i, mask=i < n, other=0.0, cache_modifier=cm)
    for j in tl.static_range(1, S):
        m += tl.load(P + j * n + i, mask=i < n, other=0.0, cache_modifier=cm)
    if HAS_B:
        m += tl.load(B + i, mask=i < n, other=0.0).to(tl.float32)
    return m


@triton.jit
def _add_when_last(P, H, B, Y, lock, i, n, S: tl.constexpr, HAS_B: tl.constexpr):
    """For a launch whose S programs (one per partial) each store their partials [S, n] at entries ``i``: count this
    program done on its ``lock``; the last of the S sums the partials in order (``_add_partials_kernel``'s sum, from
    L2), adds the residual H (and the bias B) and stores h' in Y's dtype, rounded once; then clears the lock for the
    next launch. (The residual add of a decode step inside the kept-rows down kernel's launch: _int4_rows_down.py.)"""
    tl.debug_barrier()  # every thread's stores before the count (the atomic's release, by one thread, covers them)
    done = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
    if done == S - 1:
        tl.debug_barrier()  # the acquire (one thread) before any thread reads the others' partials
        DT: tl.constexpr = Y.dtype.element_ty
        y = tl.load(H + i, mask=i < n, other=0.0).to(tl.float32) + _partial_sum(P, B, i, n, S, HAS_B, True)
        tl.store(Y + i, _round_to(y, DT).to(DT), mask=i < n)
        tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def _add_partials_kernel(H, P, B, Y, n, S: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = 0):
    if PDL:  # the partials are the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(H + i, mask=i < n, other=0.0).to(tl.float32) + _partial_sum(P, B, i, n, S, HAS_B)
    tl.store(Y + i, _round_to(s, Y.dtype.element_ty).to(Y.dtype.element_ty), mask=i < n)


def decode_add_partials(h: torch.Tensor, partials: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """h + the sum over S of fp32 ``partials [S, *h.shape]`` (+ ``bias`` [h.shape[-1]]): a 4-bit GEMV's slices of
    K and the residual add in one launch (countdown.decode.int4_step), rounded once to h's dtype."""
    if partials.dtype != torch.float32 or tuple(partials.shape[1:]) != (h.numel(),) or h.shape[:-1].numel() != 1:
        raise ValueError(f"decode_add_partials takes one row h and fp32 partials [S, {h.numel()}], got h "
                         f"{tuple(h.shape)} and partials {partials.dtype} {tuple(partials.shape)}")
    h, partials = h.contiguous(), partials.contiguous()
    y = _common.new_output(tuple(h.shape), h.dtype, h.device)
    n = h.numel()
    pdl = _pdl.mode(h)
    _add_partials_kernel[(triton.cdiv(n, ADD_BLOCK),)](h, partials, partials if bias is None else bias.contiguous(), y,
                                                       n, S=partials.shape[0], HAS_B=bias is not None,
                                                       BLOCK=ADD_BLOCK, PDL=pdl, num_warps=4, **_pdl.launch_kwargs(pdl))
    return y


@triton.jit
def _add_norm_kernel(H, P, B, G, Y, X, eps, d, S: tl.constexpr, HAS_B: tl.constexpr, BD: tl.constexpr,
                     PDL: tl.constexpr = 0):
    if PDL:  # the partials are the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    k = tl.arange(0, BD)
    DT: tl.constexpr = Y.dtype.element_ty
    h = _round_to(tl.load(H + k, mask=k < d, other=0.0).to(tl.float32) + _partial_sum(P, B, k, d, S, HAS_B), DT)
    tl.store(Y + k, h.to(DT), mask=k < d)
    r = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / d + eps)
    g = tl.load(G + k, mask=k < d, other=0.0).to(tl.float32)
    tl.store(X + k, _round_to(g * _round_to(h * r, DT), DT).to(DT), mask=k < d)


def decode_add_norm(h: torch.Tensor, partials: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h' = h + sum(partials) (+ bias)`` as :func:`decode_add_partials`, and transformers' RMSNorm of h' (weight,
    eps), in one launch of one program: a 4-bit layer's residual add and the next norm (countdown.decode.int4_step)."""
    n = h.numel()
    if partials.dtype != torch.float32 or tuple(partials.shape[1:]) != (n,) or h.shape[:-1].numel() != 1 \
            or weight.shape != (n,) or weight.dtype != h.dtype:
        raise ValueError(f"decode_add_norm takes one row h, fp32 partials [S, {n}] and a norm weight [{n}] of h's "
                         f"dtype, got h {tuple(h.shape)}, partials {partials.dtype} {tuple(partials.shape)}, weight "
                         f"{weight.dtype} {tuple(weight.shape)}")
    h, partials = h.contiguous(), partials.contiguous()
    y = _common.new_output(tuple(h.shape), h.dtype, h.device)
    x = _common.new_output(tuple(h.shape), h.dtype, h.device)
    bd = max(16, _pow2(n))
    pdl = _pdl.mode(h)
    _add_norm_kernel[(1,)](h, partials, partials if bias is None else bias.contiguous(), weight.contiguous(), y, x,
                           float(eps), n, S=partials.shape[0], HAS_B=bias is not None, BD=bd, PDL=pdl,
                           num_warps=8 if bd >= 4096 else 4, **_pdl.launch_kwargs(pdl))
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


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in PyTorch (the module's own arithmetic)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
