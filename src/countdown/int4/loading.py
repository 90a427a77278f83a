"""Loading a 4-bit model saved with ``countdown.save`` / ``save_pretrained``: the same modules, the same logits.

A saved 4-bit model is a Hugging Face folder whose safetensors hold, for each 4-bit Linear ``name``,
``name.qweight`` / ``name.scale`` / ``name.offset`` (and ``name.bias``) instead of ``name.weight``, and whose
config.json holds ``countdown_int4`` (what :func:`~countdown.int4.quantize.quantize` did); a model whose MLPs are
nested 8-bit weights (``nested_model.py``) holds ``name.high_qweight`` ... ``name.low_offset`` and config.json's
``countdown_nested`` instead, and is loaded the same way. ``transformers``
alone cannot load it (it would give those Linears fresh random weights); :func:`load_int4` builds the model
with ``from_pretrained``, which loads everything else (embeddings, norms, float Linears, buffers such as the
rotary frequencies), then puts an :class:`Int4Linear` made of the saved tensors, in the dtypes they were saved
in, in place of each such Linear. Transformers does allocate and initialise those Linears' float weights
first (dropped at once): loading costs the float model's memory for a moment (an open question: a
transformers ``HfQuantizer`` registered for this format would build the 4-bit modules before loading).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .format import Int4Weight
from .linear import BUFFERS, Int4Linear
from .nested_linear import BUFFERS as NESTED_BUFFERS
from .nested_model import CONFIG_ATTR as NESTED_ATTR, from_saved
from .quantize import CONFIG_ATTR, FORMAT


def saved_int4(folder: str | Path) -> dict | None:
    """The ``countdown_int4`` record of a saved folder's config.json, or None (not a 4-bit model)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text()).get(CONFIG_ATTR)
    if record is not None and record.get("format") != FORMAT:
        raise ValueError(f"{path}: {CONFIG_ATTR} is not a {FORMAT} record ({record.get('format')!r})")
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
                if leaf in BUFFERS or leaf in NESTED_BUFFERS:  # a 4-bit Linear's, or a nested 8-bit one's
                    found.setdefault(module, {})[leaf] = file.get_tensor(key)
    return found


def load_int4(folder: str | Path, dtype: torch.dtype, device: torch.device):
    """``(model, tokenizer)`` of a saved 4-bit folder, in eval mode; compute dtype ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    tensors = _int4_tensors(folder)
    if not tensors:
        raise ValueError(f"{folder} records a 4-bit model but its safetensors hold no 4-bit weights")
    report = logging.getLogger("transformers.modeling_utils")
    report.addFilter(_drop_load_report)  # its missing .weight / unexpected .qweight table is expected: checked below
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    finally:
        report.removeFilter(_drop_load_report)
    ours = {f"{name}.{leaf}" for name, parts in tensors.items() for leaf in parts}
    missing = set(info["missing_keys"]) - {f"{name}.weight" for name in tensors}
    unexpected = set(info["unexpected_keys"]) - ours
    if missing or unexpected or any(set(parts) not in (set(BUFFERS), set(NESTED_BUFFERS)) for parts in tensors.values()):
        raise ValueError(f"{folder}: the saved weights do not fit the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    record = getattr(model.config, CONFIG_ATTR, None) or {}
    source, transposed = record.get("source", ""), set(record.get("transposed", ()))
    low_transposed = set((getattr(model.config, NESTED_ATTR, None) or {}).get("low_transposed", ()))
    with torch.no_grad():
        for name, parts in tensors.items():
            bias = model.get_submodule(name).bias
            if set(parts) == set(NESTED_BUFFERS):  # a nested 8-bit MLP Linear (int4/nested_model.py)
                model.set_submodule(name, from_saved(parts, bias, dtype, name in low_transposed))
                continue
            weight = Int4Weight(*(parts[leaf] for leaf in BUFFERS))
            model.set_submodule(name, Int4Linear(weight, bias, dtype, source, transposed=name in transposed))
    tokenizer = None
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return model.to(device).eval(), tokenizer
