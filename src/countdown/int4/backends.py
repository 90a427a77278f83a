"""Which GEMV computes a 4-bit Linear's decode step: ours, PyTorch's int4 (tinygemm) or gemlite's.

    countdown.int4.use_backend(model, "countdown")   # the default once imported: kernels/int4/gemv.py
    countdown.int4.use_backend(model, "torch")       # aten._weight_int4pack_mm (gpt-fast's kernel), a baseline
    countdown.int4.use_backend(model, "gemlite")     # gemlite's A16W4 Triton GEMV (if installed), a baseline
    countdown.int4.use_backend(model, "reference")   # de-quantize, then F.linear (every call)

Every backend serves one-token calls (a batch-1 decode step) on CUDA (ours also on CPU tensors under
``TRITON_INTERPRET=1``, which is how CI runs it); any other call takes the reference. The baselines' own layouts
are built from the module's buffers on first use and kept in ``module.kernel_layout`` (not saved; a move drops
it), so the three compute the same weights: torch's ``(c - 8) * scale + zero`` with ``zero = offset + 8 scale``
(scales in bf16, its only dtype), gemlite's ``(c - z) * scale`` with ``z = -offset / scale`` (in the compute
dtype). Those conversions round the scales, ours reads them as stored: the baselines are for speed.

Ours (``countdown::int4_gemv``, opaque to torch.compile) returns fp32 partial sums over slices of K; the sum,
the cast and the bias are left to the traced code, where Inductor fuses them with what follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Int4Linear, register_kernel

BACKENDS = ("countdown", "torch", "gemlite", "reference")


@torch.library.custom_op("countdown::int4_gemv", mutates_args=())
def _int4_gemv(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
               activation: str, max_cols: int) -> torch.Tensor:
    from ..kernels.int4 import gemv

    return gemv.launch(x, words, scale, offset, activation or None, config={"MAX_COLS": max_cols})


@_int4_gemv.register_fake
def _(x, words, scale, offset, activation, max_cols):
    from ..kernels.int4 import gemv

    n, k = words.shape[0], 8 * words.shape[1]
    return x.new_empty((gemv.splits(n, k, k // scale.shape[1], {"MAX_COLS": max_cols}), n), dtype=torch.float32)


@torch.library.custom_op("countdown::int4_gemv_final", mutates_args=())
def _int4_gemv_final(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                     bias: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    from ..kernels.int4 import gemv

    return gemv.launch(x, words, scale, offset, None, final=True, bias=bias,
                        norm=None if norm_weight is None else (norm_weight, eps))


@_int4_gemv_final.register_fake
def _(x, words, scale, offset, bias, norm_weight, eps):
    return x.new_empty((1, words.shape[0]))


@torch.library.custom_op("countdown::int4_dequantize", mutates_args=())
def _int4_dequantize(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    from ..kernels.int4 import dequant

    return dequant.dequantize(qweight, scale, offset, dtype)


@_int4_dequantize.register_fake
def _(qweight, scale, offset, dtype):
    return qweight.new_empty((qweight.shape[0], 2 * qweight.shape[1]), dtype=dtype)


def gemv_final(x: torch.Tensor, module: Int4Linear, norm=None) -> torch.Tensor:
    """Our GEMV's finished output [1, N] in x's dtype, bias added (K in one slice); ``norm`` (an RMSNorm module of
    transformers' Llama kind): of that norm of x."""
    weight, eps = (None, 0.0) if norm is None else (norm.weight, float(norm.variance_epsilon))
    return torch.ops.countdown.int4_gemv_final(x, module.qweight.view(torch.int32), module.scale, module.offset,
                                               module.bias, weight, eps)


def gemv_partials(x: torch.Tensor, module: Int4Linear, activation: str | None = None) -> torch.Tensor:
    """Our GEMV's fp32 partial sums [S, N] for one token (``activation``: x is a fp32 [2, K] gate/up pair). The
    slices of K (S) are the shape's configuration when this is called, passed to the op: a compiled graph holds
    them as a constant, so a graph traced under another configuration (torch.compile's on-disk cache included,
    which does not see the launch table's shape entries, kernels/config.py) is not reused with the wrong output shape."""
    from ..kernels.int4 import gemv

    words = module.qweight.view(torch.int32)
    max_cols = gemv.config_for(words.shape[0], 8 * words.shape[1])["MAX_COLS"]
    return torch.ops.countdown.int4_gemv(x, words, module.scale, module.offset, activation or "", max_cols)


def finish(partials: torch.Tensor, module: Int4Linear, shape, dtype: torch.dtype) -> torch.Tensor:
    """The partials summed, cast, biased and shaped as the Linear's output."""
    y = partials.sum(0).to(dtype)
    if module.bias is not None:
        y = y + module.bias
    return y.view(*shape[:-1], module.out_features)


def one_token(x: torch.Tensor) -> bool:
    return x.numel() == x.shape[-1] and not (torch.is_grad_enabled() and x.requires_grad)


def backend_of(module: Int4Linear) -> str:
    """The module's backend; a stacked module (``int4.stack``) follows its first part."""
    parts = getattr(module, "stacked_from", None)
    return getattr(parts[0] if parts else module, "backend", "countdown")


def _applies(x: torch.Tensor, module: Int4Linear) -> bool:
    backend = backend_of(module)
    if backend == "reference" or not one_token(x) or module.transposed:
        return False
    if backend == "countdown":
        from ..kernels.common import available

        return available(x)
    return x.is_cuda


def _run(x: torch.Tensor, module: Int4Linear) -> torch.Tensor:
    backend = backend_of(module)
    if backend == "countdown":
        return finish(gemv_partials(x.reshape(1, -1), module), module, x.shape, x.dtype)
    layout = prepare(module)
    if backend == "torch":
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(1, -1).to(torch.bfloat16), layout[1], module.group,
                                               layout[2]).to(x.dtype)
        if module.bias is not None:
            y = y + module.bias
    else:
        y = layout[1](x.reshape(1, -1))
    return y.view(*x.shape[:-1], module.out_features)


DEQUANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what kernels/int4/dequant.py writes


def _applies_many(x: torch.Tensor, module: Int4Linear) -> bool:
    """The calls the one-token GEMVs leave (many tokens: a prompt; a module holding W^T) on CUDA, outside the
    reference backend, where Triton is installed: de-quantized by our kernel, then ``F.linear``. Decided without
    importing the kernel (which imports Triton): a CPU call, or an install without Triton, takes the reference."""
    from ..kernels.common import has_triton

    return x.is_cuda and backend_of(module) != "reference" and x.dtype in DEQUANT_DTYPES and has_triton()


def _run_many(x: torch.Tensor, module: Int4Linear) -> torch.Tensor:
    """``F.linear`` of the weight de-quantized in one pass (``kernels/int4/dequant.py``): the numbers of
    ``int4_linear_ref``, bit for bit, at a fraction of its passes over memory. (Eager, as a prompt runs, the kernel
    is called directly: the custom op's dispatch is host time on a host-bound path; traced, the op.)"""
    if torch.compiler.is_compiling():
        w = torch.ops.countdown.int4_dequantize(module.qweight, module.scale, module.offset, x.dtype)
    else:
        from ..kernels.int4 import dequant

        w = dequant.dequantize(module.qweight, module.scale, module.offset, x.dtype)
    return F.linear(x, w.t() if module.transposed else w, module.bias)


def _torch_layout(module: Int4Linear) -> tuple:
    codes = module.qweight
    swapped = (codes >> 4) | (codes << 4)  # torch wants the even column in the high nibble
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), 8)
    scale = module.scale.float()
    zero = module.offset.float() + 8 * scale
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K / G, N, 2]
    return packed, sz


def _gemlite_layout(module: Int4Linear) -> tuple:
    from gemlite.helper import A16W4_HQQ_INT  # an optional baseline: pip install gemlite

    from .format import unpack

    scale = module.scale.float()
    zeros = -module.offset.float() / scale
    lin = A16W4_HQQ_INT(device=str(module.qweight.device), dtype=module.compute_dtype).from_weights(
        unpack(module.qweight), scale.to(module.compute_dtype), zeros.to(module.compute_dtype),
        None if module.bias is None else module.bias.data)
    return (lin,)


_BUILD = {"torch": _torch_layout, "gemlite": _gemlite_layout}


def prepare(module: Int4Linear):
    """The module's layout for its backend, built now if missing (a baseline's; ours needs none). Built eagerly
    by :func:`use_backend` and ``int4_step``: built inside a compiled, CUDA-graphed step instead, it would live in
    the graph's memory pool and be overwritten by the next replay."""
    backend = backend_of(module)
    if module.transposed:  # W^T: no baseline takes it (the module runs its reference)
        return None
    if backend in _BUILD and (module.kernel_layout is None or module.kernel_layout[0] != backend):
        module.kernel_layout = (backend, *_BUILD[backend](module))
    return module.kernel_layout


def prepare_model(model: nn.Module) -> None:
    """:func:`prepare` every 4-bit Linear of ``model`` and every stacked one made of them (``int4.stack``)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            prepare(module)
            whole = module.__dict__.get("stacked_into")
            if whole is not None and whole() is not None:
                prepare(whole())


def use_backend(model: nn.Module, backend: str = "countdown") -> int:
    """Route every :class:`Int4Linear` of ``model`` through ``backend`` (one of :data:`BACKENDS`) for its one-token
    calls. Returns how many modules it set."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gemlite":
        try:
            import gemlite  # noqa: F401
        except ImportError as e:
            raise ValueError("backend='gemlite' needs the gemlite package: pip install gemlite") from e
    n = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.backend = backend
            n += 1
    prepare_model(model)
    return n


register_kernel(_applies, _run)
register_kernel(_applies_many, _run_many)
