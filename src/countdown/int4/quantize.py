"""``quantize(model, group=128, source="rtn")``: every decoder Linear of a model replaced in place by an
:class:`~countdown.int4.linear.Int4Linear`. The model stays the same transformers model (``generate``,
``save_pretrained``, ``countdown.sparsify`` keep working).

Sources:

* ``"rtn"``: round-to-nearest, min-max per group of ``group`` columns, from the weights as the model holds
  them (``format.quantize_rtn``; float16 scales and offsets unless ``scale_dtype=torch.float32``).
* ``"gguf"``: the 4-bit blocks of the GGUF file the model came from (``gguf=`` a path or a catalogue name
  otherwise): Q4_0 / Q4_1 / Q4_K tensors become the format exactly (groups of 32), and each is checked
  against the weight the model holds, which must be its de-quantized value (in the model's dtype): a model
  that does not hold this file's weights is refused. Tensors of other types (Q5_*, Q6_K, Q8_0, F16...) keep
  their precision, as loaded; ``requantize=True`` rounds them to 4 bits at ``group`` instead (RTN, from the
  loaded weights). A Linear the file does not hold (a tied ``lm_head``) stays as loaded, unless it is the
  output projection and ``lm_head=True`` (RTN then).

Which Linears: every ``nn.Linear`` of the model (attention q/k/v/o, the MLP's gate/up/down, fused ones
included) except the output embedding, which is quantized (RTN) only with ``lm_head=True`` (a head tied to the
input embedding is untied then: the embedding keeps its precision). RTN uses groups of ``group`` columns where
the input width is a multiple of it, else the largest of 64 / 32 that divides it (SmolLM2's d_model 576 takes
64 at ``group=128``); a Linear whose input width is not a multiple of 32 stays as it is. The function logs
what it did and keeps it in ``model.config.countdown_int4``; ``model.save_pretrained`` (as ``countdown.save``) writes
it into config.json's ``quantization_config``, from which ``from_pretrained`` rebuilds the 4-bit modules after
``import countdown`` (``loading.py``, :mod:`countdown.model.hf_quantizer`).
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch import nn

from ..data.texts import log
from ..model.foreign_weights import refuse_foreign_quantization
from .format import GROUPS, quantize_rtn
from .linear import Int4Linear

FORMAT = "countdown-int4"
CONFIG_ATTR = "countdown_int4"  # the record's place in model.config (and so in config.json)
SOURCES = ("rtn", "gguf")


def int4_config(model: nn.Module) -> dict | None:
    """What :func:`quantize` recorded on ``model`` (None: not quantized)."""
    return getattr(getattr(model, "config", None), CONFIG_ATTR, None)


def _refuse(model: nn.Module) -> None:
    from ..model.gated_mlp import refuse_meta
    from ..patch.state import is_sparsified

    refuse_meta(model, "quantize")
    if is_sparsified(model):
        raise ValueError("quantize the model before sparsifying it (countdown.unsparsify first): the selectors "
                         "were built on the weights as they are")
    if int4_config(model) is not None or any(isinstance(m, Int4Linear) for m in model.modules()):
        raise ValueError("this model is quantized to 4 bits already")
    if any(type(m.weight).__name__ == "DTensor" for m in model.modules() if isinstance(m, nn.Linear)):
        raise ValueError("a tensor-parallel model cannot be quantized in place: quantize it before sharding")


def quantize(model: nn.Module, group: int = 128, source: str = "rtn", lm_head: bool = False,
             gguf: str | os.PathLike | None = None, requantize: bool = False,
             scale_dtype: torch.dtype = torch.float16) -> nn.Module:
    """Replace the model's decoder Linears by 4-bit ones in place (see the module docstring); returns ``model``.

    group: columns per scale and offset for RTN (32, 64 or 128; smaller where it does not divide a Linear's
    input width). source: ``"rtn"`` or ``"gguf"``.
    lm_head: quantize the output projection too (RTN). gguf: the GGUF file for ``source="gguf"`` (a path or
    a catalogue name; default: the file the model was loaded from). requantize: with ``"gguf"``, round the
    tensors that are not 4-bit in the file to 4 bits too. scale_dtype: of RTN's scales and offsets.
    """
    refuse_foreign_quantization(model, "countdown.quantize")  # torchao / bitsandbytes / GPTQ... weights
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    _refuse(model)
    head = _head_name(model)
    from .nested_linear import NestedLinear

    names = [name for name, m in model.named_modules()  # nested 8-bit MLPs (dual[mixed]) keep their planes
             if isinstance(m, nn.Linear) and not isinstance(m, NestedLinear) and (lm_head or name != head)]
    record = {"format": FORMAT, "version": 1, "source": source, "lm_head": lm_head, "rtn_group": group,
              "rtn_scale_dtype": str(scale_dtype).removeprefix("torch."), "int4": {}, "kept": {}}
    tensors, path = {}, None
    if source == "gguf":
        from ..data.model_cache import file_sha256
        from .gguf_file import gguf_path, linear_tensors

        path = gguf_path(model, gguf)
        tensors = linear_tensors(path, model, names)
        record.update(gguf=path.name, gguf_sha256=file_sha256(path), requantize=requantize)
    done: Counter = Counter()
    kept: dict[str, list[str]] = {}
    with torch.no_grad():
        for name in names:
            linear = model.get_submodule(name)
            found = tensors.get(name)
            if found is not None and found.weight is not None:
                weight, how = found.weight, found.type_name
                _check_exact(name, linear, weight, path)
            elif source == "gguf" and not requantize and name != head:
                why = f"{found.type_name} in the GGUF file" if found is not None else "not in the GGUF file"
                kept.setdefault(why, []).append(name)
                continue
            else:
                k = linear.in_features
                fit = next((g for g in sorted(GROUPS, reverse=True) if g <= group and k % g == 0), None)
                if fit is None:
                    kept.setdefault(f"in_features not a multiple of {min(GROUPS)}", []).append(name)
                    continue
                weight, how = quantize_rtn(linear.weight, fit, scale_dtype), "rtn"
            model.set_submodule(name, Int4Linear.from_linear(linear, weight, source=how))
            done[f"{how} g{weight.group}"] += 1
    if head in names and getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is its own 4-bit module now; the embedding stays
    record["int4"], record["kept"] = dict(done), {why: len(which) for why, which in kept.items()}
    setattr(model.config, CONFIG_ATTR, record)
    if hasattr(type(model), "save_pretrained") and "save_pretrained" not in model.__dict__:
        from ..model.saving import save_pretrained_method  # model.save_pretrained writes the record (countdown.save)

        object.__setattr__(model, "save_pretrained", save_pretrained_method(model))
    left = "; ".join(f"{len(which)} kept as loaded ({why})" for why, which in kept.items()) or "none left in float"
    log(f"int4: {sum(done.values())} Linear layers 4-bit ({', '.join(f'{n} {how}' for how, n in done.items())}); "
        f"{left}; lm_head {'4-bit' if isinstance(model.get_submodule(head or ''), Int4Linear) else 'as loaded'}")
    return model


def _head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if m is head), None)


def _check_exact(name: str, linear: nn.Linear, weight, path) -> None:
    """The GGUF route reproduces the model's weights: refuse a model that does not hold this file's."""
    held = linear.weight
    mine = weight.dequantize().to(device=held.device, dtype=held.dtype)
    if not torch.equal(mine, held):
        diff = (mine.float() - held.float()).abs().max().item()
        raise ValueError(f"{name}: the 4-bit blocks of {path.name} de-quantize to a different weight than the model "
                         f"holds (max difference {diff:.3g}): this model was not loaded from this file, or its weights "
                         "changed since; quantize it with source='rtn' instead")
