"""SP-Prac artifacts: calibrated thresholds and trained predictors, saved and checked.

One artifact is one ``.safetensors`` file. Its tensors are the thresholds (``thresholds``:
``[n_sparsities, n_layers]``) or the predictors (``k=<k>/layer<i>/<name>``, and
``shared/layer<i>/<name>`` for tensors that serve every k); its header carries
the JSON metadata under the key ``countdown``:

    method, kind ("threshold" | "lowrank" | "ternary" | "hybrid"), sparsities, selection, d_rank,
    data (calibration text name, token count, window), training options, library version and
    the model it was made for (layer count, shapes, activation and a weight fingerprint).

plus ``countdown_sha256``, a checksum of every tensor's bytes, so a corrupted file is caught on
load and not silently used. Saving writes a temporary file beside the target and renames it
(atomic on POSIX): an interrupted save never leaves a half-written artifact under the real name.

:func:`prac_selectors` is what ``countdown.sparsify(..., mode="prac", artifacts=...)`` calls: it
checks that the artifact was made for this model, method and sparsity and builds one row selector
per Gated-MLP.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .mlp import GatedMLP
from .registry import Method, check_sparsity, get_method

FORMAT = "countdown-artifacts"
FORMAT_VERSION = 1
KINDS = ("threshold", "lowrank", "ternary", "hybrid")
SELECTIONS = ("threshold", "cut", "logit", "topk")
SPARSITY_TOL = 1e-6


class ArtifactError(ValueError):
    """An artifact file is missing, corrupt, or not a countdown artifact."""


class ArtifactMismatchError(ArtifactError):
    """An artifact does not fit the model, method or sparsity it is being used with."""


# --------------------------------------------------------------------------------------------
# Model fingerprint
# --------------------------------------------------------------------------------------------


def _slice_bytes(mlp: GatedMLP, which: str) -> bytes:
    """Rows 0, middle and last of the (global) weight ``which``, rounded to bfloat16 so that an fp32
    model and its bf16 copy share one fingerprint (the artifact is valid for both). On a
    tensor-parallel model the rows are gathered across ranks: the fingerprint is the one-process one."""
    n = mlp.weight_shape(which)[0]
    rows = sorted({0, n // 2, n - 1})
    part = mlp.weight_rows(which, rows).to(device="cpu", dtype=torch.bfloat16).contiguous()
    return part.view(torch.int16).numpy().tobytes()


def model_fingerprint(mlps: list[GatedMLP]) -> str:
    """sha256 over every Gated-MLP's weight shapes and three fixed rows of W_gate, W_up, W_down.

    Cheap (reads ~9 rows per layer) and enough to tell models apart: two checkpoints of one
    architecture differ in these rows, a different architecture differs in shapes or layer count.
    """
    h = hashlib.sha256()
    h.update(f"layers={len(mlps)}".encode())
    for m in mlps:
        for name in ("gate", "up", "down"):
            h.update(f"{name}{m.weight_shape(name)}".encode())
            h.update(_slice_bytes(m, name))
    return h.hexdigest()


def model_meta(mlps: list[GatedMLP]) -> dict:
    """What an artifact records about the model it was made for."""
    return {
        "fingerprint": model_fingerprint(mlps),
        "n_layers": len(mlps),
        "d_model": mlps[0].d_model if mlps else None,
        "d_inter": [m.d_inter for m in mlps],
        "act": mlps[0].act_name if mlps else None,
        "layers": [m.name for m in mlps],
    }


# --------------------------------------------------------------------------------------------
# The artifact object
# --------------------------------------------------------------------------------------------


def sparsity_key(k: float) -> str:
    """Tensor-name prefix for sparsity ``k``: ``"k=0.8"``."""
    return f"k={float(k):.6g}"


@dataclass
class Artifacts:
    """Thresholds or predictors for one (model, method), at one or more sparsities.

    ``meta`` is plain JSON-able data (see the module docstring); ``tensors`` maps names to CPU
    tensors. Use :meth:`save`, :func:`load_artifacts` and :func:`prac_selectors`.
    """

    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.meta["method"]

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def sparsities(self) -> list[float]:
        return [float(k) for k in self.meta["sparsities"]]

    @property
    def selection(self) -> str:
        return self.meta["selection"]

    def sparsity_index(self, sparsity: float) -> int:
        """Position of ``sparsity`` in :attr:`sparsities`; a clear error if it is not there."""
        k = float(sparsity)
        for i, have in enumerate(self.sparsities):
            if abs(have - k) <= SPARSITY_TOL:
                return i
        raise ArtifactMismatchError(
            f"these {self.method} artifacts hold k in {self.sparsities}, not k={k}: build them for "
            f"k={k} (countdown.calibrate / countdown.train_predictors / ensure_artifacts with "
            f"sparsity={k}, or a list that includes it)"
        )

    def layer_tensors(self, sparsity: float, layer: int) -> dict[str, torch.Tensor]:
        """The predictor tensors of one layer at one sparsity: ``{"A": ..., "B": ..., ...}``."""
        prefixes = (f"shared/layer{layer}/", f"{sparsity_key(self.sparsities[self.sparsity_index(sparsity)])}/layer{layer}/")
        return {name[len(prefix):]: t for prefix in prefixes
                for name, t in self.tensors.items() if name.startswith(prefix)}

    def with_selection(self, selection: str) -> "Artifacts":
        """A copy that selects rows differently (same tensors): "cut", "logit" or "topk" for
        predictors, "threshold" or "topk" for hybrid/threshold kinds where it applies."""
        check_selection(self.kind, selection)
        meta = json.loads(json.dumps(self.meta))
        meta["selection"] = selection
        return Artifacts(meta, dict(self.tensors))

    def thresholds(self, sparsity: float) -> torch.Tensor:
        """Per-layer thresholds ``[n_layers]`` at ``sparsity`` (threshold artifacts)."""
        return self.tensors["thresholds"][self.sparsity_index(sparsity)]

    def _one_sparsity(self) -> list[tuple[str, torch.Tensor]]:
        k = sparsity_key(self.sparsities[0])
        return [(name, t) for name, t in self.tensors.items() if name.startswith((k + "/", "shared/"))]

    def num_params(self) -> int:
        """Parameters of the predictors/thresholds at ONE sparsity (what a patched model holds)."""
        if self.kind == "threshold":
            return int(self.tensors["thresholds"].shape[1])
        return sum(t.numel() for _, t in self._one_sparsity())

    def num_bytes(self) -> int:
        """Bytes at ONE sparsity as deployed: ternary weights at 2 bits, everything else as stored."""
        if self.kind == "threshold":
            return int(self.tensors["thresholds"][0].numel() * 4)
        return sum((t.numel() + 3) // 4 if name.endswith("/ternary") else t.numel() * t.element_size()
                   for name, t in self._one_sparsity())

    def save(self, path: str | os.PathLike) -> Path:
        """Write to ``path`` atomically (temporary file + rename); returns the path."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in self.tensors.items()}
        header = {"countdown": json.dumps(self.meta, sort_keys=True),
                  "countdown_sha256": tensors_checksum(tensors)}
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=header)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path


def check_selection(kind: str, selection: str) -> str:
    allowed = {"threshold": ("threshold",), "lowrank": ("cut", "logit", "topk"),
               "ternary": ("cut", "logit", "topk"), "hybrid": ("cut", "topk")}[kind]
    if selection not in allowed:
        raise ValueError(f"selection {selection!r} does not apply to {kind} artifacts: choose one of "
                         f"{', '.join(allowed)}")
    return selection


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def load_artifacts(path: str | os.PathLike) -> Artifacts:
    """Read an artifact file written by :meth:`Artifacts.save`, verifying its checksum."""
    from safetensors import safe_open

    path = Path(path)
    rebuild = ("delete it and rebuild it (countdown.calibrate / countdown.train_predictors, "
               "or countdown.artifacts.ensure_artifacts)")
    if not path.is_file():
        raise ArtifactError(f"no artifact file at {path}: build one with countdown.calibrate / "
                            "countdown.train_predictors and save it, or use ensure_artifacts")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for truncated headers/data
        raise ArtifactError(f"artifact {path} is corrupt or truncated ({err}); {rebuild}") from None
    if "countdown" not in header:
        raise ArtifactError(f"{path} is a safetensors file but not a countdown artifact (no 'countdown' "
                            "metadata); pass a file written by Artifacts.save")
    try:
        meta = json.loads(header["countdown"])
    except json.JSONDecodeError as err:
        raise ArtifactError(f"artifact {path} has corrupt metadata ({err}); {rebuild}") from None
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a countdown artifact (format {meta.get('format')!r})")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise ArtifactError(f"{path} was written by a newer countdown (artifact format "
                            f"{meta['format_version']} > {FORMAT_VERSION}); upgrade countdown or rebuild it")
    if header.get("countdown_sha256") != tensors_checksum(tensors):
        raise ArtifactError(f"artifact {path} is corrupt: its tensors do not match the checksum written "
                            f"with them; {rebuild}")
    return Artifacts(meta, tensors)


def new_meta(method: Method, kind: str, sparsities: list[float], mlps: list[GatedMLP], *,
             selection: str, data: dict, **extra: Any) -> dict:
    """Metadata common to every artifact (the builders add their own options as ``extra``)."""
    from . import __version__

    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": method.name,
        "kind": kind,
        "sparsities": [float(k) for k in sparsities],
        "selection": check_selection(kind, selection),
        "data": data,
        "version": __version__,
        "model": model_meta(mlps),
    }
    meta.update(extra)
    return meta


# --------------------------------------------------------------------------------------------
# Using artifacts
# --------------------------------------------------------------------------------------------


def check_artifacts(artifacts: Artifacts, mlps: list[GatedMLP], method: str | Method,
                    sparsity: float) -> int:
    """Raise :class:`ArtifactMismatchError` unless ``artifacts`` fit; returns the sparsity index."""
    m = get_method(method)
    if artifacts.method != m.name:
        raise ArtifactMismatchError(
            f"these artifacts were made for method {artifacts.method!r}, not {m.name!r}: build {m.name} "
            f"artifacts for this model (countdown.calibrate / countdown.train_predictors with "
            f"method={m.name!r}), or sparsify with method={artifacts.method!r}"
        )
    k = check_sparsity(sparsity)
    index = artifacts.sparsity_index(k)
    want = artifacts.meta["model"]
    have_shapes = [m_.d_inter for m_ in mlps]
    if want["n_layers"] != len(mlps) or want["d_inter"] != have_shapes or want["d_model"] != (
            mlps[0].d_model if mlps else None):
        raise ArtifactMismatchError(
            f"these artifacts were made for another model ({want['n_layers']} Gated-MLPs, d_model "
            f"{want['d_model']}, d_inter {sorted(set(want['d_inter']))}); this one has {len(mlps)} "
            f"(d_model {mlps[0].d_model if mlps else None}, d_inter {sorted(set(have_shapes))}): "
            "build artifacts for this model"
        )
    have = model_fingerprint(mlps)
    if have != want["fingerprint"]:
        raise ArtifactMismatchError(
            f"these artifacts were made for a model with other weights (fingerprint "
            f"{want['fingerprint'][:12]}, this model {have[:12]}; same shapes, so probably another "
            "checkpoint or a fine-tune): build artifacts for this model"
        )
    return index


def prac_selectors(artifacts: Artifacts | str | os.PathLike, mlps: list[GatedMLP],
                   method: str | Method, sparsity: float) -> list:
    """One SP-Prac row selector per Gated-MLP (in ``find_gated_mlps`` order).

    ``artifacts`` is an :class:`Artifacts` or a path to one. Threshold artifacts give
    :class:`countdown.sparse.ThresholdSelector`; predictor artifacts give the selectors of
    :mod:`countdown.predictors`.
    """
    from .sparse import ThresholdSelector

    if not isinstance(artifacts, Artifacts):
        artifacts = load_artifacts(artifacts)
    m = get_method(method)
    check_artifacts(artifacts, mlps, m, sparsity)
    if artifacts.kind == "threshold":
        taus = artifacts.thresholds(sparsity)
        return [ThresholdSelector(m, taus[i]) for i in range(len(mlps))]
    from .predictors import selector_from_tensors

    return [selector_from_tensors(artifacts, mlp, i, sparsity) for i, mlp in enumerate(mlps)]


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def _as_list(sparsity) -> list[float]:
    ks = [sparsity] if isinstance(sparsity, (int, float)) else list(sparsity)
    if not ks:
        raise ValueError("give at least one sparsity")
    return sorted({round(check_sparsity(k), 6) for k in ks})


def _options_key(method: Method, options: dict) -> str:
    from . import __version__

    # The version is part of the key: another release may change the defaults behind the options.
    text = json.dumps({"method": method.name, "version": __version__, **options}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def ensure_artifacts(model, tokenizer, method: str | Method, sparsity, cache_dir: str | os.PathLike,
                     **options: Any) -> Artifacts:
    """Load cached artifacts for (model, method, sparsity, options) or build and save them.

    ``sparsity`` is one k or a list (one file then holds all of them; a later call for any subset
    reuses it). Threshold methods go through :func:`countdown.calibrate.calibrate`, predictor methods
    through :func:`countdown.predictors.train_predictors`; ``options`` are passed on (and are part of
    the cache key with the library version, so other options build other files). Files are named
    ``<method>-<model fingerprint[:12]>-<options hash>-k<k1>_<k2>.safetensors``; a corrupt cached file
    is skipped and rebuilt.
    """
    from .mlp import require_gated_mlps

    m = get_method(method)
    ks = _as_list(sparsity)
    if m.prac is None:
        raise ValueError(f"method {m.name!r} has no SP-Prac artifacts (it skips nothing)")
    mlps = require_gated_mlps(model)
    fp = model_fingerprint(mlps)[:12]
    # Options that change the result name the file; progress bars and checkpoint folders do not.
    keyed = {key: value for key, value in options.items() if key not in ("progress", "checkpoint")}
    stem = f"{m.name}-{fp}-{_options_key(m, keyed)}"
    cache = Path(cache_dir).expanduser()
    if cache.is_dir():
        for candidate in sorted(cache.glob(stem + "-k*.safetensors")):
            try:
                art = load_artifacts(candidate)
            except ArtifactError:
                continue  # a corrupt cache entry is rebuilt below, under the requested name
            if all(any(abs(k - have) <= SPARSITY_TOL for have in art.sparsities) for k in ks):
                return art
    if m.prac == "threshold":
        from .calibrate import calibrate

        options.pop("checkpoint", None)  # one pass, nothing to resume
        art = calibrate(model, tokenizer, m, ks, **options)
    else:
        from .predictors import train_predictors

        art = train_predictors(model, tokenizer, m, ks, **options)
    art.save(cache / f"{stem}-k{'_'.join(f'{k:g}' for k in ks)}.safetensors")
    return art


def footprint(artifacts: Artifacts, model) -> dict:
    """Size of the predictors/thresholds for ONE sparsity against the model's own parameters.

    ``share`` counts parameters (the paper's "6-7% of model parameters"); ``byte_share`` counts bytes
    as deployed (ternary weights at 2 bits each, the rest as stored) against the model's bytes.
    """
    params = artifacts.num_params()
    model_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"params": params, "model_params": model_params, "share": params / model_params,
            "bytes": artifacts.num_bytes(), "byte_share": artifacts.num_bytes() / model_bytes}
