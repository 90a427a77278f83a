"""A saved 4-bit model's modules, built on the model's meta skeleton before ``from_pretrained`` loads the weights.

A saved 4-bit model is a Hugging Face folder whose safetensors hold, for each 4-bit Linear ``name``,
``name.qweight`` / ``name.scale`` / ``name.offset`` (and ``name.bias``) instead of ``name.weight``, and whose
config.json records what :func:`~countdown.int4.quantize.quantize` did (``quantization_config``'s ``weights``,
:mod:`countdown.saving`). The transformers quantizer (:mod:`countdown.hf_quantizer`) calls :func:`build_int4_modules`
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
from .quantize import CONFIG_ATTR, FORMAT

# safetensors' dtype names of the tensors a 4-bit Linear holds
DTYPES = {"U8": torch.uint8, "F16": torch.float16, "F32": torch.float32, "BF16": torch.bfloat16}


def check_int4_record(record: dict | None, where: str) -> None:
    """A 4-bit record (:func:`~countdown.int4.quantize.quantize`'s) this release can rebuild, else a ValueError."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{where}: the 4-bit record is not a {FORMAT} record "
                         f"({record.get('format') if isinstance(record, dict) else record!r}); save the model again "
                         "with countdown.save")


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
                if leaf in BUFFERS:
                    part = file.get_slice(key)
                    found.setdefault(module, {})[leaf] = (tuple(part.get_shape()), DTYPES.get(part.get_dtype()))
    return found


def build_int4_modules(model: nn.Module, checkpoint_files: list[str | Path], record: dict) -> list[str]:
    """Replace, on ``model``'s meta skeleton, each Linear whose codes the checkpoint holds by an :class:`Int4Linear`
    of the saved shapes and dtypes (compute dtype: the Linear's); returns the names replaced. A checkpoint whose
    4-bit tensors do not fit the model is refused here, before any weight is read."""
    headers = int4_headers(checkpoint_files)
    if not headers:
        raise ValueError("the folder records a 4-bit model but its safetensors hold no 4-bit weights "
                         "(name.qweight / .scale / .offset)")
    transposed = set(record.get("transposed", ()))
    for name, parts in headers.items():
        linear = model.get_submodule(name) if _has(model, name) else None
        if not isinstance(linear, nn.Linear) or set(parts) != set(BUFFERS) or None in (d for _, d in parts.values()):
            raise ValueError(f"the saved 4-bit tensors of {name} do not fit the model ({sorted(parts)} for "
                             f"{type(linear).__name__ if linear is not None else 'no such module'})")
        meta = Int4Weight(*(torch.empty(parts[leaf][0], dtype=parts[leaf][1], device="meta") for leaf in BUFFERS))
        t = name in transposed
        if meta.shape != tuple(linear.weight.shape)[:: -1 if t else 1]:
            raise ValueError(f"the saved 4-bit weight of {name} is {meta.shape}{' (W^T)' if t else ''}, the model's "
                             f"Linear {tuple(linear.weight.shape)}: the folder's config.json and weights disagree")
        bias = None if linear.bias is None else torch.empty_like(linear.bias, device="meta")
        module = Int4Linear(meta, bias, linear.weight.dtype, record["source"], transposed=t)
        module._is_hf_initialized = True  # loaded whole: transformers' init would de-quantize `weight` to fill a copy
        model.set_submodule(name, module)
    return sorted(headers)


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def finish_int4_modules(model: nn.Module, record: dict) -> None:
    """After the weights are loaded: the record back on the config, each 4-bit Linear's bias frozen (as
    :meth:`Int4Linear.from_linear` holds it)."""
    setattr(model.config, CONFIG_ATTR, record)
    for module in model.modules():
        if isinstance(module, Int4Linear) and module.bias is not None:
            module.bias.requires_grad_(False)
