"""Fitting a kind layer by layer from captured activations, with resumable checkpoints.

The unpatched model runs over the calibration text; forward pre-hooks copy each Gated-MLP's input
into memory (float32, on the model's device, for as many layers as ``max_activation_gb`` allows per
pass; the forward stops after the last wanted layer), then each layer is fitted by the kind's
``fit_layer(method, mlp, layer, X, ks, opts)`` and its inputs freed. Nothing goes to disk except,
with a ``checkpoint`` folder, each finished layer's tensors with their checksum: a rerun with the same
settings continues after the last finished layer with the same result (a layer file damaged between the runs
fails its checksum and is fitted again, with a line naming it), and a run interrupted by Ctrl-C says how many
layers are safe and how to resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from ..artifacts.store import model_fingerprint, tensors_checksum
from ..io import atomic_path, atomic_write, file_lock, read_safetensors
from .stream import stream_mlp_inputs
from .base import FitContext

FitLayer = Callable[..., dict]


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during a layer-by-layer fit; the message says what was saved and how to resume."""


def save_layer(tensors: dict[str, torch.Tensor], path: Path, layer: int | None = None,
               config: dict | None = None) -> None:
    """One finished layer's tensors, written atomically, with a checksum over them (as an artifact carries) and,
    given ``layer`` and ``config``, which layer of which run they are: :func:`load_checkpoint` verifies both, so a
    layer file damaged between runs is fitted again, never built into an artifact with a fresh checksum."""
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in tensors.items()}
    header = {CHECKSUM: tensors_checksum(tensors)}
    if layer is not None:
        header[BINDING] = _binding(layer, config)
    with atomic_path(path, suffix=".safetensors", what="checkpoint layer") as tmp:
        save_file(tensors, str(tmp), metadata=header)


CHECKSUM = "countdown_sha256"  # of the layer's tensors (artifacts.tensors_checksum)
BINDING = "countdown_checkpoint"  # the layer index and the sha256 of its run's config.json


def _binding(layer: int, config: dict | None) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return json.dumps({"layer": layer, "config_sha256": digest}, sort_keys=True)


def read_layer(path: Path, layer: int | None = None, config: dict | None = None) -> tuple[dict | None, str]:
    """``(tensors, "")`` of a checkpoint layer file that passes its checks, else ``(None, why)``: unreadable, no
    checksum (written before layers carried one), a checksum that does not match (damaged), or a file of another
    layer or another run."""
    try:
        header, tensors = read_safetensors(path)  # one open: a concurrent replace cannot mix two writes
    except Exception as error:  # noqa: BLE001 - safetensors' own error types for a truncated or bad file
        return None, f"unreadable ({' '.join(str(error).split())[:120]})"
    if CHECKSUM not in header:
        return None, "it carries no checksum (written by an older countdown), so it cannot be trusted"
    if header[CHECKSUM] != tensors_checksum(tensors):
        return None, "damaged: its tensors do not match the checksum written with them"
    if layer is not None and BINDING in header and header[BINDING] != _binding(layer, config):
        return None, "it belongs to another layer or another run's settings"
    return tensors, ""


def load_checkpoint(folder: Path, config: dict, n_layers: int) -> dict[int, dict[str, torch.Tensor]]:
    """Finished layers of an earlier run with the same config; raises if the config differs. A layer file that
    fails its checks (:func:`read_layer`) is removed, to be fitted again, with one line on stderr naming it."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg_path = folder / "config.json"
    if cfg_path.exists():
        try:
            old = json.loads(cfg_path.read_text())
        except ValueError:
            old = None
        if old != config:
            diff = (sorted(key for key in set(old) | set(config) if old.get(key) != config.get(key))
                    if isinstance(old, dict) else ["config.json unreadable"])
            raise ValueError(f"checkpoint folder {folder} belongs to a run with other settings ({', '.join(diff)} "
                             "differ): pass another checkpoint path, or delete the folder to start over")
    else:
        atomic_write(cfg_path, json.dumps(config, sort_keys=True, indent=1))
    done = {}
    for i in range(n_layers):
        path = folder / f"layer{i:03d}.safetensors"
        if path.exists():
            tensors, why = read_layer(path, i, config)
            if tensors is not None:
                done[i] = tensors
                continue
            print(f"countdown: checkpoint layer {path} is not used: {why}; fitting layer {i} again",
                  file=sys.stderr, flush=True)
            path.unlink()
    return done


def fit_by_capture(ctx: FitContext, fit_layer: FitLayer, desc: str) -> dict[str, torch.Tensor]:
    """Every layer's tensors from ``fit_layer``, capturing inputs in groups that fit
    ``ctx.opts["max_activation_gb"]`` (default 2 GB) and resuming from ``ctx.checkpoint``."""
    from tqdm.auto import tqdm

    mlps = ctx.mlps
    n_tokens = sum(w.numel() for w in ctx.windows)
    folder = Path(ctx.checkpoint) if ctx.checkpoint is not None else None
    lock = file_lock(folder / "config.json", what="checkpoint folder") if folder is not None else None
    if lock is not None:
        folder.mkdir(parents=True, exist_ok=True)
        lock.__enter__()
    done: dict[int, dict[str, torch.Tensor]] = {}
    try:
        if folder is not None:
            config = {"method": ctx.method.name, "kind": ctx.kind, "sparsities": ctx.ks, "data": ctx.extra_meta.get("data"),
                      "fingerprint": model_fingerprint(mlps), **ctx.opts}
            done = load_checkpoint(folder, config, len(mlps))
        todo = [i for i in range(len(mlps)) if i not in done]
        per_layer_bytes = n_tokens * mlps[0].d_model * 4
        budget = float(ctx.opts.get("max_activation_gb", 2.0))
        per_pass = max(1, int(budget * 2**30 // max(per_layer_bytes, 1)))
        bar = tqdm(total=len(mlps), initial=len(done), desc=desc, disable=not ctx.progress)
        try:
            for start in range(0, len(todo), per_pass):
                group = todo[start:start + per_pass]
                captured: dict[int, list[torch.Tensor]] = {i: [] for i in group}

                def on_input(i: int, x: torch.Tensor) -> None:
                    # float32 on the model's device: a GPU model fits its selectors on the GPU
                    captured[i].append(x.detach().float().clone())

                stream_mlp_inputs(ctx.model, mlps, ctx.windows, on_input, layers=group, progress=ctx.progress,
                                  desc=f"capturing layers {group[0]}-{group[-1]}")
                for i in group:
                    X = torch.cat(captured.pop(i))
                    tensors = fit_layer(ctx.method, mlps[i], i, X, ctx.ks, ctx.opts, progress=ctx.progress)
                    del X
                    if folder is not None:
                        save_layer(tensors, folder / f"layer{i:03d}.safetensors", i, config)
                    done[i] = tensors
                    bar.update(1)
        except KeyboardInterrupt:
            if folder is None:
                where = (f"{len(done)} of {len(mlps)} layers were fitted and are lost (no checkpoint folder): "
                         "pass --checkpoint DIR (checkpoint=...) to make the run resumable")
            else:
                where = (f"{len(done)} of {len(mlps)} layers are saved in {folder}: run the same command again "
                         "to resume after them")
            raise TrainingInterrupted(where) from None
        finally:
            bar.close()
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
    return {name: t for i in range(len(mlps)) for name, t in done[i].items()}


def checkpoint_files(folder: str | os.PathLike) -> list[str]:
    """Names of the finished layer files in a checkpoint folder (for reports and tests)."""
    return sorted(p.name for p in Path(folder).glob("layer*.safetensors"))
