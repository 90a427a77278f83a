"""Saving a sparsified or 4-bit model and loading it back the same.

    countdown.save(model, "my-model", tokenizer)      # or model.save_pretrained("my-model")
    model, tok = countdown.load_model("my-model")     # the same model: same logits (or, after import countdown,
                                                      # AutoModelForCausalLM.from_pretrained("my-model"))

A saved folder is a Hugging Face model folder (the weights as loaded: ``sparsify`` leaves them bit for bit; a 4-bit
model's Linears as their codes, scales and offsets) whose config.json carries the model's configuration
(:class:`countdown.spec.Spec`: ``Spec.of(model)``) as ``quantization_config``, the shape a transformers
``QuantizationConfigMixin`` is built from (:func:`quantization_config`)::

    "quantization_config": {"quant_method": "countdown", "format_version": 3, "countdown": "0.1.0",
                            "spec": "dual[shadow4]", "method": "dual", "kind": "shadow", "options": {"bits": 4},
                            "mode": "prac", "k": 0.5, "scope": "decode", "path": "auto",
                            "artifacts": "countdown_artifacts.safetensors", "weights": null}

``weights`` is the :class:`~countdown.spec.WeightFormat` of a 4-bit model (bits, group, source, scale dtype,
lm_head, and ``record``: what :func:`countdown.quantize` recorded, from which its modules are
rebuilt), ``artifacts`` the SP-Prac selectors' file in the folder (checksummed), ``spec`` null where the model is not
sparsified. After ``import countdown``, ``AutoModelForCausalLM.from_pretrained(folder)`` rebuilds the model as saved
(countdown's transformers quantizer, :mod:`countdown.model.hf_quantizer`; :func:`countdown.load_model` is that call);
transformers alone logs "Unknown quantization type, got countdown" and loads the weights alone (the dense model, a
4-bit one with random Linears). Folders of earlier releases (``countdown.json`` format versions 1 and 2,
``countdown_int4`` in config.json) load the same through :func:`countdown.load_model`, which hands transformers their
record (:func:`saved_config`; their config.json names none, so a bare ``from_pretrained`` loads them dense).
A configuration that cannot be rebuilt from files (a tensor-parallel shard, SP-Prac selectors replaced by hand) is
refused before anything is written. The folder is written beside its place and renamed into it, so a failed save
leaves no half folder and an existing folder is replaced only with ``overwrite=True``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from torch import nn

QUANT_METHOD = "countdown"  # quantization_config's quant_method (the transformers quantizer's name)
RECORD_VERSION = 3  # 3: the record in config.json's quantization_config
CONFIG_NAME = "countdown.json"  # versions 1 and 2 (read only): 1 the sparsity, 2 also a 4-bit model's "int4"
ARTIFACTS_NAME = "countdown_artifacts.safetensors"
FORMAT = "countdown-sparsified"  # countdown.json's format
FORMAT_VERSION = 2
NESTED_ATTR = "countdown_nested"  # model.config's attribute of the nested 8-bit record (countdown.int4.nested_model)
INT4_ATTR = "countdown_int4"  # model.config's attribute of countdown.quantize's record (countdown.int4.quantize)
PATCH_ATTR = "countdown_sparse"  # the patched layer sparsify hangs on each Gated-MLP module (not saved)


def quantization_config(model: nn.Module) -> dict | None:
    """The ``quantization_config`` record of ``model`` (None: a dense model with its weights as loaded), refusing
    what cannot round-trip."""
    from dataclasses import asdict

    from .. import __version__
    from ..spec import Spec
    from ..patch.state import STATE_ATTR

    state = getattr(model, STATE_ATTR, None)
    spec = Spec.of(model)
    nested = getattr(getattr(model, "config", None), NESTED_ATTR, None)  # nested 8-bit MLPs (dual[mixed])
    if state is None and spec.weights is None and nested is None:
        return None
    if state is not None and any(layer.mlp.tp is not None for layer in state.layers):
        raise ValueError("a tensor-parallel shard cannot be saved as a sparsified model: save the model dense "
                         "(countdown.unsparsify first) with its artifacts, and sparsify it again after loading")
    if state is not None and state.mode == "prac" and state.artifacts is None:
        raise ValueError("this SP-Prac model's selectors did not come from an artifact, so they cannot be saved; "
                         "build them with countdown.prepare and sparsify(..., artifacts=...) to save the model")
    patched = state is not None
    return {"quant_method": QUANT_METHOD, "format_version": RECORD_VERSION, "countdown": __version__,
            "spec": spec.label if patched else None, "method": spec.method if patched else None,
            "kind": spec.kind, "options": dict(spec.options) if patched else None,
            "mode": spec.mode if patched else None, "k": spec.k, "scope": spec.scope if patched else None,
            "path": state.path if patched else None,
            "artifacts": ARTIFACTS_NAME if patched and state.mode == "prac" else None,
            "weights": None if spec.weights is None else asdict(spec.weights),
            "nested": None if nested is None else dict(nested)}


def save(model: nn.Module, folder: str | os.PathLike, tokenizer=None, overwrite: bool = False,
         **save_pretrained_kwargs) -> Path:
    """Write ``model`` (dense, sparsified or 4-bit) and its configuration (:func:`quantization_config`, in
    config.json) to ``folder``; returns the folder.
    ``tokenizer`` is saved with it when given; other keyword arguments go to ``save_pretrained``. The folder is
    written beside its place and renamed into it (:func:`countdown.io.atomic_folder`): a failed save (a full
    disk, a kill) leaves the folder that was there as it was; an existing, non-empty one is replaced only with
    ``overwrite=True``. The folder is checked writable and locked (``.<name>.lock`` beside it) before anything
    is written; a symbolic link is written through."""
    from ..io import atomic_folder, check_writable_dir, file_lock, recover, resolve_link
    from .gated_mlp import refuse_meta

    folder = Path(folder)
    refuse_meta(model, "save")  # meta tensors hold nothing to write: refused before the folder is touched
    record = quantization_config(model)  # refuses before any write
    target = resolve_link(folder)
    recover(target)  # a save killed between its two renames: the old folder is put back first
    if os.path.exists(target) and not (os.path.isdir(target) and not any(target.iterdir())) and not overwrite:
        raise FileExistsError(f"{folder} exists and is not empty: pass overwrite=True to replace it, or another folder")
    check_writable_dir(target.parent, None)  # before the serialization: a read-only place fails at once
    with file_lock(target, what="saved model folder"), atomic_folder(target, what="saved model") as work:
        _write(model, record, work, tokenizer, save_pretrained_kwargs)
    return folder


def _write(model: nn.Module, record: dict | None, folder: Path, tokenizer, kwargs: dict) -> None:
    """The weights as loaded (the patch's own buffers left out), the tokenizer, the record (into config.json) and
    the artifact, into ``folder``."""
    from ..io import atomic_write
    from ..patch.state import STATE_ATTR

    state = getattr(model, STATE_ATTR, None)
    if state is not None and "state_dict" not in kwargs:
        kwargs = {**kwargs, "state_dict": weights_to_save(model)}
    _save_pretrained(model, folder, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if record is not None:
        if record["artifacts"]:
            from ..artifacts.store import Artifacts, load_artifacts

            art = state.artifacts
            (art if isinstance(art, Artifacts) else load_artifacts(art)).save(folder / ARTIFACTS_NAME)
        config = json.loads((folder / "config.json").read_text())
        config.pop(INT4_ATTR, None)  # in the record's weights now: one place
        config["quantization_config"] = record
        atomic_write(folder / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")


def weights_to_save(model: nn.Module) -> dict | None:
    """The state dict a save writes: a sparsified model's without the patch's own buffers (its counters, its
    selectors: the artifact holds those), None (the model's own) otherwise."""
    from ..patch.state import STATE_ATTR

    if getattr(model, STATE_ATTR, None) is None:
        return None
    return {name: t for name, t in model.state_dict().items() if f".{PATCH_ATTR}." not in f".{name}"}


def _save_pretrained(model: nn.Module, folder: Path, **kwargs) -> None:
    """transformers' own save_pretrained (the class's: a sparsified model's instance routes here). A model
    loaded from a GGUF file holds de-quantized weights: its GGUF quantizer, which refuses to save, is dropped."""
    if getattr(getattr(model, "hf_quantizer", None), "quantization_config", None) is not None and \
            getattr(model.hf_quantizer.quantization_config, "quant_method", None) == "gguf":
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    type(model).save_pretrained(model, folder, **kwargs)


def saved_config(folder: str | os.PathLike) -> dict | None:
    """The configuration a saved folder records, as :func:`quantization_config` writes it (None: a dense model, or
    no folder): config.json's ``quantization_config``, or the records of earlier releases (countdown.json versions
    1 and 2, ``countdown_int4`` in config.json) in the same shape, with their ``mode`` (the spec of a version 1 or 2
    record may need it: ``mono`` with mode ``prac``; :func:`countdown.patch.sparsify.with_mode`)."""
    from dataclasses import asdict

    from ..spec import WeightFormat

    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    record = config.get("quantization_config")
    if isinstance(record, dict) and record.get("quant_method") == QUANT_METHOD:
        if record.get("format_version", RECORD_VERSION) > RECORD_VERSION:
            raise ValueError(f"{config_path} was written by a newer countdown (record version "
                             f"{record['format_version']}); upgrade countdown to load it")
        return record
    old = _legacy_record(folder)
    int4 = config.get(INT4_ATTR) or (old or {}).get("int4")
    if old is None and int4 is None:
        return None
    old = old or {"format_version": 2, "spec": None}
    weights = WeightFormat.from_record(int4)
    return {"quant_method": QUANT_METHOD, "format_version": old.get("format_version", 1),
            "countdown": old.get("countdown"), "spec": old.get("spec"), "mode": old.get("mode"),
            "k": old.get("sparsity"), "scope": old.get("scope"), "path": old.get("path"),
            "artifacts": old.get("artifacts"), "weights": None if weights is None else asdict(weights)}


def _legacy_record(folder: Path) -> dict | None:
    """countdown.json of a folder saved by an earlier release (format versions 1 and 2), or None."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("format") != FORMAT:
        raise ValueError(f"{path} is not a countdown save (format {record.get('format')!r}); remove it or "
                         "save the model again with countdown.save")
    if record.get("format_version", 1) > FORMAT_VERSION:
        raise ValueError(f"{path} was written by a newer countdown (format version {record['format_version']}); "
                         "upgrade countdown to load it")
    return record


def save_pretrained_method(model: nn.Module):
    """The ``save_pretrained`` a sparsified model carries: transformers' own (into the folder, which keeps its
    other files, as transformers does), plus the sparsity record and the artifact. Everything is written
    beside, then each file replaces its namesake atomically (:func:`countdown.io.files_into`): a full disk
    leaves the folder as it was."""

    def save_pretrained(save_directory, *args, **kwargs):
        from ..io import file_lock, files_into, resolve_link

        if args:
            raise TypeError("save_pretrained on a sparsified model takes the folder and keyword arguments")
        folder = Path(save_directory)
        record = quantization_config(model)  # refuses before any write
        target = resolve_link(folder)
        with file_lock(target, what="saved model folder"), files_into(target, what="saved model") as work:
            _write(model, record, work, None, kwargs)
            written = {p.name for p in work.iterdir()}
        _drop_old_shards(target, written)
        return folder

    return save_pretrained


_SHARD = re.compile(r"(.*?)-\d{5}-of-\d{5}")


def _drop_old_shards(folder: Path, written: set[str]) -> None:
    """What transformers' save_pretrained does in place: the weight shards of an earlier save that this one did
    not write again are removed (they would mix with the new weights)."""
    for name in os.listdir(folder):
        stem = name.replace(".safetensors", "").replace(".bin", "")
        if name not in written and name.startswith(("model", "pytorch_model")) and _SHARD.fullmatch(stem) \
                and (folder / name).is_file():
            (folder / name).unlink()
