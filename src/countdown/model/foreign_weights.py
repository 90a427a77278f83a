"""Weights quantized by another tool, found before countdown patches or re-quantizes a model.

countdown sparsifies float weights and its own 4-bit ones (:func:`countdown.quantize`). A model whose Linears
another tool holds (torchao's tensor subclasses, bitsandbytes' ``Linear4bit`` / ``Linear8bitLt``, GPTQ / AWQ
``QuantLinear`` modules, HQQ, quanto, ...) would pass the Gated-MLP search and fail later, inside ``generate``, with
the other tool's error (torchao: ``NotImplementedError`` on the first sliced weight). :func:`refuse_foreign_quantization`
is called first by :func:`countdown.sparsify` and :func:`countdown.quantize` and raises
:class:`ForeignQuantizationError` in one line naming what it found and where. What it looks at, in order:

1. modules whose class comes from a quantization package or is named like one of their Linears;
2. parameters and buffers that are tensor subclasses of such a package (torchao's ``AffineQuantizedTensor``...);
3. a quantization config left by transformers (``model.hf_quantizer`` or ``config.quantization_config``) of another
   method whose weights were not de-quantized at load (``dequantize=True`` passes; so does GGUF, whose kept blocks
   are transformers' ``GgufLinear`` modules, found in 1).
"""

from __future__ import annotations

import re

from torch import nn

# Top-level packages whose modules or tensors hold quantized weights, and the name a user knows them by.
PACKAGES = {
    "torchao": "torchao", "bitsandbytes": "bitsandbytes", "auto_gptq": "AutoGPTQ", "gptqmodel": "GPTQModel",
    "awq": "AutoAWQ", "hqq": "HQQ", "quanto": "quanto", "optimum": "optimum-quanto", "compressed_tensors":
    "compressed-tensors", "eetq": "EETQ", "aqlm": "AQLM", "vptq": "VPTQ", "exllamav2": "ExLlamaV2",
}
# Class names of the quantized Linears of those tools (also where a package re-exports or vendors them).
# transformers' GgufLinear / GgufExperts hold a GGUF file's blocks (transformers >= 5.24 with `kernels`).
LINEAR_NAMES = re.compile(r"QuantLinear|^WQLinear|^Linear4bit$|^Linear8bitLt$|^HQQLinear|^QLinear$|^FP8Linear$"
                          r"|^Gguf(Linear|Experts)$")
# quant_method values whose config alone says nothing: countdown's own (its transformers quantizer), and GGUF, whose
# kept blocks are GgufLinear modules (found above) and whose de-quantized weights are plain floats
CONFIG_PASSES = ("countdown", "gguf")


class ForeignQuantizationError(ValueError):
    """A model holds weights quantized by another tool (see the module docstring)."""


def _package(cls: type) -> str | None:
    top = (cls.__module__ or "").split(".")[0]
    if top == "optimum" and ".quanto" not in cls.__module__:
        return None
    return PACKAGES.get(top)


def _config_method(model: nn.Module) -> str | None:
    """The quant_method of another tool's quantization config whose weights stay quantized, or None."""
    quantizer = getattr(model, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None)
    if config is None:
        config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    method = get("quant_method")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method is None or str(method) in CONFIG_PASSES or get("dequantize", False):
        return None
    return str(method)


def find_foreign_quantization(model: nn.Module) -> str | None:
    """What holds ``model``'s weights quantized by another tool, in words (None: nothing found)."""
    for name, module in model.named_modules():
        cls = type(module)
        package = _package(cls)
        if package is not None or LINEAR_NAMES.search(cls.__name__):
            return f"{package or 'a quantization tool'}'s {cls.__name__} at {name or 'the model itself'}"
    for kind, tensors in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in tensors:
            package = _package(type(tensor))
            if package is not None:
                return f"{package}'s tensor subclass {type(tensor).__name__} as the {kind} {name}"
    method = _config_method(model)
    if method is not None:
        return (f"a transformers quantization config of method {method!r} (model.hf_quantizer / "
                "config.quantization_config)")
    return None


def refuse_foreign_quantization(model: nn.Module, what: str) -> None:
    """Raise :class:`ForeignQuantizationError` if another tool quantized ``model``'s weights; ``what``: the
    refusing call, e.g. ``"countdown.sparsify"``."""
    found = find_foreign_quantization(model)
    if found is not None:
        raise ForeignQuantizationError(
            f"{what}: this model holds weights quantized by another tool ({found}); countdown runs float weights "
            "and its own 4-bit ones: load the model without that quantization (e.g. from_pretrained without "
            "quantization_config / load_in_4bit), then countdown.quantize(model) for 4-bit weights")
