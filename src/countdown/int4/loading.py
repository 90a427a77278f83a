"""A saved 4-bit model's modules, built on the model's meta skeleton before ``from_pretrained`` loads the weights.

A saved 4-bit model is a Hugging Face folder whose safetensors hold, for each 4-bit Linear ``name``,
``name.qweight`` / ``name.scale`` / ``name.offset`` (and ``name.bias``) instead of ``name.weight``, and whose
config.json records what :func:`~countdown.int4.quantize.quantize` did (``quantization_config``'s ``weights``,
:mod:`countdown.model.saving`). The transformers quantizer (:mod:`countdown.model.hf_quantizer`) calls :func:`build_int4_modules`
on the skeleton (meta tensors, no memory): each such Linear becomes an :class:`Int4Linear` whose buffers have the
saved shapes and dtypes, read from the files' headers (no tensor is read), so transformers loads the codes, scales
and offsets straight into them, in the dtypes they were saved in (float16 / float32 scales stay as saved whatever the
compute dtype). No float copy of a 4-bit Linear is allocated. :func:`finish_int4_modules` then puts the record
back on the model's config (``countdown_int4``, what ``Spec.of`` and the decode step read).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .format import Int4Weight
from .linear import BUFFERS, Int4Linear
from .nested_linear import BUFFERS as NESTED_BUFFERS
from .nested_model import CONFIG_ATTR as NESTED_ATTR, from_saved
from .quantize import CONFIG_ATTR, FORMAT

# safetensors' dtype names of the tensors a 4-bit Linear holds
DTYPES = {"U8": torch.uint8, "F16": torch.float16, "F32": torch.float32, "BF16": torch.bfloat16}


def check_int4_record(record: dict | None, where: str) -> None:
    """A 4-bit record (:func:`~countdown.int4.quantize.quantize`'s) this release can rebuild, else a ValueError."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{where}: the 4-bit record is not a {FORMAT} record "
                         f"({record.get('format') if isinstance(record, dict) else record!r}); save the model again "
                         "with countdown.save")
    if record.get("transposed"):
        raise ValueError(f"{where}: this 4-bit model holds its W_down transposed (saved after "
                         "countdown.quantize(..., transposed_down=True)), a layout this release no longer builds or "
                         "loads: quantize the float model again without transposed_down "
                         "(countdown.quantize(model, group=...)) and save it")


def int4_headers(checkpoint_files: list[str | Path]) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """{module name: {"qweight" | "scale" | "offset": (shape, dtype)}} from the safetensors files' headers."""
    from safetensors import safe_open

    found: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    for path in checkpoint_files:
        if not str(path).endswith(".safetensors"):
            raise ValueError(f"{path}: a saved 4-bit model's weights are safetensors files; save it again with "
                             "countdown.save")
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():
                module, _, leaf = key.rpartition(".")
                if leaf in BUFFERS or leaf in NESTED_BUFFERS:  # a 4-bit Linear's, or a nested 8-bit one's
                    part = file.get_slice(key)
                    found.setdefault(module, {})[leaf] = (tuple(part.get_shape()), DTYPES.get(part.get_dtype()))
    return found


def build_int4_modules(model: nn.Module, checkpoint_files: list[str | Path], record: dict | None,
                       nested: dict | None = None) -> list[str]:
    """Replace, on ``model``'s meta skeleton, each Linear whose codes the checkpoint holds by an :class:`Int4Linear`
    (``record``: the 4-bit record) or a nested 8-bit :class:`~countdown.int4.nested_linear.NestedLinear` (``nested``:
    the nested record, :mod:`countdown.int4.nested_model`) of the saved shapes and dtypes (compute dtype: the
    Linear's); returns the names replaced. A checkpoint whose tensors do not fit the model or the records is refused
    here, before any weight is read."""
    headers = int4_headers(checkpoint_files)
    if not headers:
        raise ValueError("the folder records a 4-bit or nested 8-bit model but its safetensors hold no such weights "
                         "(name.qweight / .scale / .offset, or name.high_qweight ... .low_offset)")
    low_transposed = set((nested or {}).get("low_transposed", ()))
    for name, parts in headers.items():
        linear = model.get_submodule(name) if _has(model, name) else None
        kind = {frozenset(BUFFERS): "4-bit", frozenset(NESTED_BUFFERS): "nested"}.get(frozenset(parts))
        if not isinstance(linear, nn.Linear) or kind is None or None in (d for _, d in parts.values()) or \
                (kind == "4-bit" and record is None) or (kind == "nested" and nested is None):
            raise ValueError(f"the saved {kind or 'quantized'} tensors of {name} do not fit the model or its record "
                             f"({sorted(parts)} for {type(linear).__name__ if linear is not None else 'no such module'})")
        meta = {leaf: torch.empty(shape, dtype=dtype, device="meta") for leaf, (shape, dtype) in parts.items()}
        bias = None if linear.bias is None else torch.empty_like(linear.bias, device="meta")
        if kind == "nested":
            module = from_saved(meta, bias, linear.weight.dtype, name in low_transposed)
            if (module.out_features, module.in_features) != tuple(linear.weight.shape):
                raise ValueError(f"the saved nested weight of {name} is {(module.out_features, module.in_features)}, "
                                 f"the model's Linear {tuple(linear.weight.shape)}: the folder's config.json and "
                                 "weights disagree")
        else:
            weight = Int4Weight(*(meta[leaf] for leaf in BUFFERS))
            if weight.shape != tuple(linear.weight.shape):
                raise ValueError(f"the saved 4-bit weight of {name} is {weight.shape}, the model's Linear "
                                 f"{tuple(linear.weight.shape)}: the folder's config.json and weights disagree")
            module = Int4Linear(weight, bias, linear.weight.dtype, record["source"])
        module._is_hf_initialized = True  # loaded whole: transformers' init would de-quantize `weight` to fill a copy
        model.set_submodule(name, module)
    return sorted(headers)


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def finish_int4_modules(model: nn.Module, record: dict | None, nested: dict | None = None) -> None:
    """After the weights are loaded: the records back on the config, each 4-bit or nested Linear's bias frozen (as
    :meth:`Int4Linear.from_linear` holds it)."""
    from .nested_linear import NestedLinear

    if record is not None:
        setattr(model.config, CONFIG_ATTR, record)
    if nested is not None:
        setattr(model.config, NESTED_ATTR, nested)
    for module in model.modules():
        if isinstance(module, (Int4Linear, NestedLinear)) and module.bias is not None:
            module.bias.requires_grad_(False)
