"""Saving a sparsified model and loading it back the same.

    countdown.save(model, "my-model", tokenizer)      # or model.save_pretrained("my-model") on a sparsified model
    model, tok = countdown.load_model("my-model")     # the same sparsified model: same logits

A saved folder is a Hugging Face model folder (the weights as loaded: ``sparsify`` leaves them bit for bit) plus
``countdown.json`` (the spec, k, mode, scope and path ``sparsify`` was given) and, for SP-Prac,
``countdown_artifacts.safetensors`` (the selectors, checksummed). ``transformers.from_pretrained`` alone loads the
dense model; :func:`countdown.load_model` patches it again as :func:`saved_config` says. A 4-bit model
(``countdown.quantize``) saves its 4-bit Linears as their codes, scales and offsets, and its configuration in
config.json and in countdown.json's ``"int4"``: only :func:`countdown.load_model` rebuilds those Linears
(:mod:`countdown.int4.loading`). A configuration that cannot be rebuilt from files (a tensor-parallel shard, SP-Prac
selectors replaced by hand) is refused before anything is written. The folder is written beside its place and
renamed into it, so a failed save leaves no half folder and an existing folder is replaced only with
``overwrite=True``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from torch import nn

CONFIG_NAME = "countdown.json"
ARTIFACTS_NAME = "countdown_artifacts.safetensors"
FORMAT = "countdown-sparsified"
FORMAT_VERSION = 2  # 2: a 4-bit model's configuration under "int4"
PATCH_ATTR = "countdown_sparse"  # the patched layer sparsify hangs on each Gated-MLP module (not saved)


def _record(model: nn.Module) -> dict | None:
    """What ``countdown.json`` holds for ``model`` (None: a dense model with its weights as loaded), refusing what
    cannot round-trip. A 4-bit model (``countdown.quantize``) records its configuration under ``"int4"`` (format
    version 2); it also travels in config.json, which ``countdown.load_model`` reads to rebuild the 4-bit modules."""
    from . import __version__
    from .state import STATE_ATTR

    state = getattr(model, STATE_ATTR, None)
    int4 = getattr(getattr(model, "config", None), "countdown_int4", None)
    if state is None:
        if int4 is None:
            return None
        return {"format": FORMAT, "format_version": 2, "countdown": __version__, "spec": None, "sparsity": None,
                "mode": None, "scope": None, "path": None, "artifacts": None, "int4": int4}
    if any(layer.mlp.tp is not None for layer in state.layers):
        raise ValueError("a tensor-parallel shard cannot be saved as a sparsified model: save the model dense "
                         "(countdown.unsparsify first) with its artifacts, and sparsify it again after loading")
    if state.mode == "prac" and state.artifacts is None:
        raise ValueError("this SP-Prac model's selectors did not come from an artifact, so they cannot be saved; "
                         "build them with countdown.prepare and sparsify(..., artifacts=...) to save the model")
    record = {"format": FORMAT, "format_version": 1, "countdown": __version__, "spec": state.spec.label,
              "sparsity": state.sparsity, "mode": state.mode, "scope": state.scope, "path": state.path,
              "artifacts": ARTIFACTS_NAME if state.mode == "prac" else None}
    if int4 is not None:
        record.update(format_version=2, int4=int4)
    return record


def save(model: nn.Module, folder: str | os.PathLike, tokenizer=None, overwrite: bool = False,
         **save_pretrained_kwargs) -> Path:
    """Write ``model`` (dense or sparsified) and its sparsity configuration to ``folder``; returns the folder.
    ``tokenizer`` is saved with it when given; other keyword arguments go to ``save_pretrained``. The folder is
    written beside its place and renamed into it (:func:`countdown.io.atomic_folder`): a failed save (a full
    disk, a kill) leaves the folder that was there as it was; an existing, non-empty one is replaced only with
    ``overwrite=True``. The folder is checked writable and locked (``.<name>.lock`` beside it) before anything
    is written; a symbolic link is written through."""
    from .io import atomic_folder, check_writable_dir, file_lock, recover, resolve_link
    from .mlp import refuse_meta

    folder = Path(folder)
    refuse_meta(model, "save")  # meta tensors hold nothing to write: refused before the folder is touched
    record = _record(model)  # refuses before any write
    target = resolve_link(folder)
    recover(target)  # a save killed between its two renames: the old folder is put back first
    if os.path.exists(target) and not (os.path.isdir(target) and not any(target.iterdir())) and not overwrite:
        raise FileExistsError(f"{folder} exists and is not empty: pass overwrite=True to replace it, or another folder")
    check_writable_dir(target.parent, None)  # before the serialization: a read-only place fails at once
    with file_lock(target, what="saved model folder"), atomic_folder(target, what="saved model") as work:
        _write(model, record, work, tokenizer, save_pretrained_kwargs)
    return folder


def _write(model: nn.Module, record: dict | None, folder: Path, tokenizer, kwargs: dict) -> None:
    """The weights as loaded (the patch's own buffers left out), the tokenizer, the record and the artifact, into
    ``folder``."""
    from .io import atomic_write
    from .state import STATE_ATTR

    state = getattr(model, STATE_ATTR, None)
    if state is not None and "state_dict" not in kwargs:
        kwargs = {**kwargs, "state_dict": {name: t for name, t in model.state_dict().items()
                                           if f".{PATCH_ATTR}." not in f".{name}"}}
    _save_pretrained(model, folder, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if record is not None:
        if record["artifacts"]:
            from .artifacts import Artifacts, load_artifacts

            art = state.artifacts
            (art if isinstance(art, Artifacts) else load_artifacts(art)).save(folder / ARTIFACTS_NAME)
        atomic_write(folder / CONFIG_NAME, json.dumps(record, indent=2) + "\n")


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
    """``countdown.json`` of a saved folder, or None where the folder holds a dense model. ``spec`` is None in the
    record of a 4-bit model that is not sparsified."""
    path = Path(folder) / CONFIG_NAME
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
        from .io import file_lock, files_into, resolve_link

        if args:
            raise TypeError("save_pretrained on a sparsified model takes the folder and keyword arguments")
        folder = Path(save_directory)
        record = _record(model)  # refuses before any write
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
