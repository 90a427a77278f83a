"""Loading a 4-bit model saved with ``countdown.save`` / ``save_pretrained``: the same modules, the same logits.

A saved 4-bit model is a Hugging Face folder whose safetensors hold, for each 4-bit Linear ``name``,
``name.qweight`` / ``name.scale`` / ``name.offset`` (and ``name.bias``) instead of ``name.weight``, and whose
config.json records what :func:`~countdown.int4.quantize.quantize` did: under ``quantization_config``'s ``weights``
(:mod:`countdown.saving`), or as ``countdown_int4`` in folders of earlier releases. ``transformers``
alone cannot load it (it would give those Linears fresh random weights); :func:`load_int4` builds the model
with ``from_pretrained``, which loads everything else (embeddings, norms, float Linears, buffers such as the
rotary frequencies), then puts an :class:`Int4Linear` made of the saved tensors, in the dtypes they were saved
in, in place of each such Linear. Transformers does allocate and initialise those Linears' float weights
first (dropped at once): loading costs the float model's memory for a moment (an open question: a
transformers ``HfQuantizer`` registered for this format would build the 4-bit modules before loading).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .format import Int4Weight
from .linear import BUFFERS, Int4Linear
from .quantize import CONFIG_ATTR, FORMAT


def saved_int4(folder: str | Path) -> dict | None:
    """:func:`~countdown.int4.quantize.quantize`'s record of a saved folder (:func:`countdown.saving.saved_config`'s
    ``weights``), or None (not a 4-bit model)."""
    from ..saving import saved_config

    config = saved_config(folder)
    record = ((config or {}).get("weights") or {}).get("record")
    if record is not None and record.get("format") != FORMAT:
        raise ValueError(f"{Path(folder) / 'config.json'}: the 4-bit record is not a {FORMAT} record "
                         f"({record.get('format')!r})")
    return record


def _drop_load_report(record: logging.LogRecord) -> bool:
    return "LOAD REPORT" not in record.getMessage()


def _int4_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {"qweight", "scale", "offset"}} from every safetensors file of the folder."""
    from safetensors import safe_open

    found: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():
                module, _, leaf = key.rpartition(".")
                if leaf in BUFFERS:
                    found.setdefault(module, {})[leaf] = file.get_tensor(key)
    return found


def load_int4(folder: str | Path, dtype: torch.dtype, device: torch.device, record: dict | None = None):
    """``(model, tokenizer)`` of a saved 4-bit folder, in eval mode; compute dtype ``dtype`` on ``device``. ``record``:
    the folder's 4-bit record (default :func:`saved_int4`), which the model's config carries again as
    ``countdown_int4``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..saving import countdown_quantization_known

    folder = Path(folder)
    record = saved_int4(folder) if record is None else record
    tensors = _int4_tensors(folder)
    if not tensors:
        raise ValueError(f"{folder} records a 4-bit model but its safetensors hold no 4-bit weights")
    report = logging.getLogger("transformers.modeling_utils")
    report.addFilter(_drop_load_report)  # its missing .weight / unexpected .qweight table is expected: checked below
    try:
        with countdown_quantization_known():
            model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    finally:
        report.removeFilter(_drop_load_report)
    ours = {f"{name}.{leaf}" for name in tensors for leaf in BUFFERS}
    missing = set(info["missing_keys"]) - {f"{name}.weight" for name in tensors}
    unexpected = set(info["unexpected_keys"]) - ours
    if missing or unexpected or any(len(parts) != len(BUFFERS) for parts in tensors.values()):
        raise ValueError(f"{folder}: the saved weights do not fit the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    setattr(model.config, CONFIG_ATTR, record)
    source, transposed = record["source"], set(record.get("transposed", ()))
    with torch.no_grad():
        for name, parts in tensors.items():
            weight = Int4Weight(*(parts[leaf] for leaf in BUFFERS))
            model.set_submodule(name, Int4Linear(weight, model.get_submodule(name).bias, dtype, source,
                                                 transposed=name in transposed))
    tokenizer = None
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return model.to(device).eval(), tokenizer
