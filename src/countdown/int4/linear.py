"""``Int4Linear``: an ``nn.Linear`` whose weight is held in the 4-bit format (``format.py``).

The module holds the format's tensors as buffers (``qweight``, ``scale``, ``offset``; saved with the model as
safetensors) and the bias as a parameter. Its forward is one call, :func:`int4_linear`, which today runs the
PyTorch reference (de-quantize, then ``F.linear``) and is where a GPU GEMV plugs in: a kernel registers
``(applies, run)`` with :func:`register_kernel`; ``applies(x, module)`` says whether it serves this call (a
CUDA tensor of a few tokens, a layout it takes) and ``run(x, module)`` computes ``x W~^T + b``. A kernel that
wants another layout (a Marlin-style permutation, torch's int4pack nibble order) builds it from the module's
buffers the first time and keeps it in ``module.kernel_layout`` (not saved, dropped when the module moves):
the format and the module stay as they are.

It is an ``nn.Linear`` so that code finding Linears by type keeps finding it: ``countdown.sparsify``'s
Gated-MLP adapter (``mlp.py``) reads ``module.weight``, which here is the de-quantized weight in the compute
dtype, built on each read (read-only; nothing is cached beside the 4-bit buffers). Code that needs a plain
``nn.Linear`` checks ``type(m) is nn.Linear`` (the fused decode routes do) and leaves this one alone.

``model.to(dtype)`` changes the compute dtype (the bias and what ``forward`` / ``weight`` produce); the
scales and offsets keep their own dtype (float32 ones are what make the GGUF route exact).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .format import Int4Weight, dequantize

BUFFERS = ("qweight", "scale", "offset")
_KERNELS: list[tuple[Callable, Callable]] = []


def int4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``F.linear(x, W~, bias)`` with W~ de-quantized (in float32, as the format defines it) and
    cast to x's dtype."""
    return F.linear(x, dequantize(qweight, scale, offset, x.dtype), bias)


def register_kernel(applies: Callable, run: Callable) -> None:
    """Add a kernel for :func:`int4_linear` (tried in the order registered, before the reference)."""
    _KERNELS.append((applies, run))


def int4_linear(x: torch.Tensor, module: "Int4Linear") -> torch.Tensor:
    """``x W~^T + b`` for an :class:`Int4Linear`: the first registered kernel that applies (``int4/backends.py``:
    our GEMV for one token, our one-pass de-quantization then ``F.linear`` for the rest on CUDA), else the reference
    (a module that holds W^T: ``F.linear`` of its de-quantized transpose)."""
    for applies, run in _KERNELS:
        if applies(x, module):
            return run(x, module)
    if module.transposed:
        return F.linear(x, dequantize(module.qweight, module.scale, module.offset, x.dtype).t(), module.bias)
    return int4_linear_ref(x, module.qweight, module.scale, module.offset, module.bias)


class Int4Linear(nn.Linear):
    """A Linear layer with a 4-bit weight; see the module docstring. Build it with :meth:`from_weight` or
    :meth:`from_linear`."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 source: str = "", transposed: bool = False):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a float weight
        # transposed: the buffers hold W^T [in, out] in the format (groups along the output): a W_down whose rows of
        # d_inter are the sparse kernels' rows (kernels/int4/rows.py); forward and weight give W as ever
        self.transposed = bool(transposed)
        self.out_features, self.in_features = weight.shape[::-1] if self.transposed else weight.shape
        self.group = weight.group
        self.source = source  # how the codes were made: "rtn" or the GGUF type ("Q4_1", ...)
        for name in BUFFERS:
            self.register_buffer(name, getattr(weight, name))
        set_frozen_bias(self, bias, dtype)
        self.compute_dtype = dtype
        self.kernel_layout = None

    @classmethod
    def from_weight(cls, weight: Int4Weight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                    source: str = "", transposed: bool = False) -> "Int4Linear":
        return cls(weight, bias, dtype, source, transposed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight: Int4Weight, source: str = "",
                    transposed: bool = False) -> "Int4Linear":
        """The 4-bit replacement of ``linear`` (its bias, dtype and device kept); ``transposed``: ``weight`` is W^T."""
        if weight.shape != tuple(linear.weight.shape)[:: -1 if transposed else 1]:
            raise ValueError(f"a 4-bit weight of shape {weight.shape} cannot replace a Linear of "
                             f"{tuple(linear.weight.shape)}")
        device = linear.weight.device
        moved = Int4Weight(*(getattr(weight, name).to(device) for name in BUFFERS))
        return cls(moved, linear.bias, linear.weight.dtype, source, transposed)

    @property
    def int4(self) -> Int4Weight:
        """The weight as held: W, or W^T where ``transposed``."""
        return Int4Weight(self.qweight, self.scale, self.offset)

    @property
    def weight(self) -> torch.Tensor:
        """The de-quantized weight [out, in] in the compute dtype (a new tensor on each read)."""
        w = dequantize(self.qweight, self.scale, self.offset, self.compute_dtype)
        return w.t() if self.transposed else w

    @weight.setter
    def weight(self, value) -> None:
        raise AttributeError("an Int4Linear's weight is its 4-bit codes (qweight, scale, offset): replace the module "
                             "to change it")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self)

    def _apply(self, fn, recurse=True):
        apply_keeping_dtypes(self, fn, recurse, BUFFERS)
        self.kernel_layout = None
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group={self.group}, scale={str(self.scale.dtype).removeprefix('torch.')}, source={self.source}"
                + (", transposed" if self.transposed else ""))


def stack(modules: list[Int4Linear]) -> Int4Linear:
    """One :class:`Int4Linear` whose rows are the ``modules``' rows in order (q, k, v; gate, up), whose buffers
    the parts then view (no memory added): one GEMV computes all of them. The parts must share the group size,
    the scale dtype, the device, the compute dtype and whether they have a bias."""
    first = modules[0]
    if any(m.transposed for m in modules):
        raise ValueError("stack takes 4-bit Linears that hold W, not W^T (transposed)")
    for m in modules[1:]:
        if (m.in_features, m.group, m.scale.dtype, m.qweight.device, m.compute_dtype, m.bias is None) != \
                (first.in_features, first.group, first.scale.dtype, first.qweight.device, first.compute_dtype,
                 first.bias is None):
            raise ValueError("stack takes 4-bit Linears of one input size, group, scale dtype, device, compute "
                             "dtype and bias or none")
    with torch.no_grad():
        weight = Int4Weight(*(torch.cat([getattr(m, name) for m in modules]) for name in BUFFERS))
        bias = None if first.bias is None else torch.cat([m.bias for m in modules])
    whole = Int4Linear(weight, bias, first.compute_dtype, first.source)
    whole.stacked_from = tuple(modules)  # a plain attribute (not submodules): its backend follows theirs
    for m in modules:
        m.__dict__["stacked_into"] = weakref.ref(whole)
    rows = [m.out_features for m in modules]
    for name in BUFFERS:
        for m, part in zip(modules, getattr(whole, name).split(rows)):
            m._buffers[name] = part
    if bias is not None:
        for m, part in zip(modules, whole.bias.split(rows)):
            m.bias = nn.Parameter(part, requires_grad=False)
    return whole


def set_frozen_bias(module: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Register ``bias`` (checked against ``module.out_features``; None: no bias) on a quantized Linear as a frozen
    parameter in the compute dtype ``dtype``."""
    if bias is not None and tuple(bias.shape) != (module.out_features,):
        raise ValueError(f"bias must have {module.out_features} values, got shape {tuple(bias.shape)}")
    kept = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    module.register_parameter("bias", kept)


def apply_keeping_dtypes(module: nn.Module, fn, recurse: bool, names: tuple[str, ...]) -> None:
    """``nn.Module._apply`` for a quantized Linear (``module``, whose buffers ``names`` hold its codes and scales):
    ``.to(dtype)`` / ``.half()`` would convert every floating buffer, so these keep their dtype and only move;
    ``module.compute_dtype`` follows the conversion."""
    before = {name: module._buffers[name] for name in names}
    nn.Module._apply(module, fn, recurse)
    for name, old in before.items():
        new = module._buffers[name]
        if new.dtype != old.dtype:
            module._buffers[name] = old.to(new.device)
    device = module._buffers[names[0]].device
    module.compute_dtype = fn(torch.empty(0, dtype=module.compute_dtype, device=device)).dtype
