"""``NestedLinear``: an ``nn.Linear`` whose weight is held in the nested 8-bit format (``nested.py``): two 4-bit planes.

The module holds both planes' tensors as buffers (``high_qweight``, ``high_scale``, ``high_offset``, ``low_qweight``,
``low_scale``, ``low_offset``; saved with the model as safetensors) and the bias as a parameter. ``read`` says which
weight its forward and ``weight`` give: ``"both"`` (the 8-bit weight, the default) or ``"high"`` (the high plane
alone: a 4-bit weight of step 16 S). Its forward is one call, :func:`nested_linear`, which runs the PyTorch
reference (de-quantize, then ``F.linear``) unless a registered kernel serves the call (``register_kernel``, as
``linear.py``'s: a GPU GEMV of one plane, or of both, plugs in there). ``weight`` is built on each read in the compute
dtype (read-only; nothing is cached beside the planes), so code that reads ``module.weight`` (``countdown.sparsify``'s
Gated-MLP adapter, the artifacts' fingerprint) sees the weight the module computes with.

``model.to(dtype)`` changes the compute dtype; the scales and offsets keep their own dtype.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .format import Int4Weight
from .linear import apply_keeping_dtypes, set_frozen_bias
from .nested import NestedWeight, quantize_nested

BUFFERS = ("high_qweight", "high_scale", "high_offset", "low_qweight", "low_scale", "low_offset")
READS = ("both", "high")
_KERNELS: list[tuple[Callable, Callable]] = []


def register_kernel(applies: Callable, run: Callable) -> None:
    """Add a kernel for :func:`nested_linear` (tried in the order registered, before the reference):
    ``applies(x, module)`` says whether it serves the call, ``run(x, module)`` computes ``x W^T + b`` with W the
    module's ``read`` weight."""
    _KERNELS.append((applies, run))


def nested_linear(x: torch.Tensor, module: "NestedLinear") -> torch.Tensor:
    """``x W^T + b`` for a :class:`NestedLinear` (W: the 8-bit weight, or the high plane where ``read="high"``)."""
    for applies, run in _KERNELS:
        if applies(x, module):
            return run(x, module)
    return F.linear(x, module.nested.dequantize(module.read, x.dtype), module.bias)


class NestedLinear(nn.Linear):
    """A Linear layer with a nested 8-bit weight; see the module docstring. Build it with :meth:`from_linear` or
    from a :class:`~countdown.int4.nested.NestedWeight`."""

    def __init__(self, weight: NestedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 read: str = "both"):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a float weight
        self.out_features, self.in_features = weight.shape
        self.group = weight.group
        self.low_transposed = weight.low_transposed
        for name, tensor in zip(BUFFERS, _tensors(weight)):
            self.register_buffer(name, tensor)
        set_frozen_bias(self, bias, dtype)
        self.compute_dtype = dtype
        self.read = read

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = 64, scale_dtype: torch.dtype = torch.float16,
                    low_transposed: bool = False) -> "NestedLinear":
        """The nested 8-bit replacement of ``linear`` (8-bit RTN of its weight; its bias, dtype and device kept)."""
        weight = quantize_nested(linear.weight.detach(), group, scale_dtype, low_transposed)
        return cls(weight, linear.bias, linear.weight.dtype)

    @property
    def read(self) -> str:
        return self._read

    @read.setter
    def read(self, value: str) -> None:
        if value not in READS:
            raise ValueError(f"read must be one of {READS} (the 8-bit weight, or the high plane alone), got {value!r}")
        self._read = value

    @property
    def nested(self) -> NestedWeight:
        """The weight as held (views of the buffers)."""
        return NestedWeight(self.high, self.low_qweight, self.low_scale, self.low_offset, self.low_transposed)

    @property
    def high(self) -> Int4Weight:
        """The high plane: an ordinary 4-bit weight [out, in]."""
        return Int4Weight(self.high_qweight, self.high_scale, self.high_offset)

    @property
    def weight(self) -> torch.Tensor:
        """The ``read`` weight [out, in] in the compute dtype (a new tensor on each read)."""
        return self.nested.dequantize(self.read, self.compute_dtype)

    @weight.setter
    def weight(self, value) -> None:
        raise AttributeError("a NestedLinear's weight is its two 4-bit planes: replace the module to change it")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nested_linear(x, self)

    def _apply(self, fn, recurse=True):
        apply_keeping_dtypes(self, fn, recurse, BUFFERS)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group={self.group}, scale={str(self.high_scale.dtype).removeprefix('torch.')}, read={self.read}"
                + (", low plane transposed" if self.low_transposed else ""))


def _tensors(weight: NestedWeight) -> tuple[torch.Tensor, ...]:
    high = weight.high
    return high.qweight, high.scale, high.offset, weight.low_qweight, weight.low_scale, weight.low_offset


def _applies_many(x: torch.Tensor, module: NestedLinear) -> bool:
    """Calls on CUDA where Triton is installed (a prompt; a one-token call outside the mixed step): the weight
    de-quantized by one kernel pass, then ``F.linear``. Decided without importing the kernel (which imports Triton):
    a CPU call, or an install without Triton, takes the reference."""
    from ..kernels.common import has_triton
    from .backends import DEQUANT_DTYPES

    return x.is_cuda and x.dtype in DEQUANT_DTYPES and has_triton()


def _run_many(x: torch.Tensor, module: NestedLinear) -> torch.Tensor:
    """``F.linear`` of the module's ``read`` weight de-quantized in one pass (``kernels/int4/nested_dequant.py`` for
    both planes, ``kernels/int4/dequant.py`` for the high plane): the reference's numbers, without its eager passes."""
    nested = module.nested
    if module.read == "high":
        from ..kernels.int4.dequant import dequantize

        high = nested.high
        return F.linear(x, dequantize(high.qweight, high.scale, high.offset, x.dtype), module.bias)
    from ..kernels.int4.nested_dequant import dequantize_both

    return F.linear(x, dequantize_both(nested, x.dtype), module.bias)


register_kernel(_applies_many, _run_many)
