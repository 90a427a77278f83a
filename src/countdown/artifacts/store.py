"""SP-Prac artifacts: calibrated thresholds, predictors and shadows, saved and checked.

One artifact is one ``.safetensors`` file. Its tensors are named by the kind that made it
(:mod:`countdown.selectors`): per layer and sparsity ``k=<k>/layer<i>/<name>``, per layer for every k
``shared/layer<i>/<name>``, or kind-wide (threshold files: ``thresholds [n_sparsities, n_layers]``).
Its header carries the JSON metadata under the key ``countdown``:

    format, format_version, method, kind, sparsities, selection, data (calibration text name, token
    count, window), the kind's options, library version, and the model it was made for (layer count,
    shapes, activation and a weight fingerprint),

plus ``countdown_sha256``: a checksum over the canonical JSON of that metadata *and* every tensor's
name, dtype, shape and bytes. An edited label (say two sparsities swapped) or a changed tensor is
caught on load, never silently used. Format 1 files (whose checksum covered the tensors only) are
refused with the command that rebuilds them.

Saving goes through :mod:`countdown.io` (temporary file beside the target, fsync, rename): an
interrupted save never leaves a half-written artifact under the real name, and :meth:`Artifacts.save`
refuses to replace a file that is not a countdown artifact unless ``force=True``.
This module only reads, writes and checks files; the kinds that make and use them live in
:mod:`countdown.selectors`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..model.fingerprint import dtype_name, model_fingerprint, model_meta, model_probe, other_weights  # noqa: F401
from ..io import atomic_path, entry_kind, read_safetensors, refuse_special
from ..model.gated_mlp import GatedMLP
from ..sparse_methods.registry import Method, check_sparsity, get_method

FORMAT = "countdown-artifacts"
FORMAT_VERSION = 2
SPARSITY_TOL = 1e-6
REBUILD = ("delete it and rebuild it (`countdown calibrate` / `countdown train`, or countdown.prepare; "
           "prepare(..., cache_dir=...) rebuilds a cached one)")
# Metadata every artifact must carry, with the JSON type it must have.
REQUIRED_META = {"format": str, "format_version": int, "method": str, "kind": str, "sparsities": list,
                 "selection": str, "data": dict, "version": str, "model": dict}
REQUIRED_MODEL_META = {"fingerprint": str, "n_layers": int, "d_model": int, "d_inter": list, "act": str}


class ArtifactError(ValueError):
    """An artifact file is missing, corrupt, or not a countdown artifact."""


class ArtifactMismatchError(ArtifactError):
    """An artifact does not fit the model, method or sparsity it is being used with."""


# --------------------------------------------------------------------------------------------
# The artifact object
# --------------------------------------------------------------------------------------------


def sparsity_key(k: float) -> str:
    """Tensor-name prefix for sparsity ``k``: ``"k=0.8"``."""
    return f"k={float(k):.6g}"


@dataclass
class Artifacts:
    """SP-Prac tensors for one (model, method, kind), at one or more sparsities.

    ``meta`` is plain JSON-able data (see the module docstring); ``tensors`` maps names to CPU
    tensors. Use :meth:`save`, :func:`load_artifacts` and ``countdown.sparsify(..., artifacts=...)``.
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

    def __repr__(self) -> str:
        """One line: what the artifact is for, never its tensors (an 8B model's shadows hold gigabytes)."""
        meta, model = self.meta, self.meta.get("model", {})
        n_bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        opts = "".join(f", {k}={meta[k]}" for k in ("bits", "group", "d_rank") if k in meta)
        shape = f"{model.get('n_layers', '?')} layers, d_model {model.get('d_model', '?')}"
        return (f"Artifacts(method={meta.get('method')!r}, kind={meta.get('kind')!r}{opts}, "
                f"sparsities={meta.get('sparsities')}, model: {shape}, {len(self.tensors)} tensors, "
                f"{n_bytes / 2**20:.1f} MiB)")

    def sparsity_index(self, sparsity: float) -> int:
        """Position of ``sparsity`` in :attr:`sparsities`; a clear error if it is not there."""
        k = float(sparsity)
        for i, have in enumerate(self.sparsities):
            if abs(have - k) <= SPARSITY_TOL:
                return i
        raise ArtifactMismatchError(
            f"these {self.method} artifacts hold k in {self.sparsities}, not k={k}: build them for "
            f"k={k} (countdown.prepare with sparsity={k}, or a list that includes it)"
        )

    def key(self, sparsity: float) -> str:
        """The tensor-name prefix of the stored k that matches ``sparsity``."""
        return sparsity_key(self.sparsities[self.sparsity_index(sparsity)])

    def layer_tensors(self, sparsity: float, layer: int) -> dict[str, torch.Tensor]:
        """The tensors of one layer at one sparsity (its ``shared/`` ones too): ``{"A": ..., ...}``."""
        prefixes = (f"shared/layer{layer}/", f"{self.key(sparsity)}/layer{layer}/")
        return {name[len(prefix):]: t for prefix in prefixes
                for name, t in self.tensors.items() if name.startswith(prefix)}

    def with_selection(self, selection: str) -> "Artifacts":
        """A copy that selects rows by another rule (same tensors); checked when it is used."""
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
        """Parameters (stored elements) at ONE sparsity: what a patched model holds."""
        if "thresholds" in self.tensors:
            return int(self.tensors["thresholds"].shape[1])
        return sum(t.numel() for _, t in self._one_sparsity())

    def num_bytes(self) -> int:
        """Bytes at ONE sparsity as deployed: ternary weights at 2 bits, everything else as stored
        (packed low-bit shadows are stored packed)."""
        if "thresholds" in self.tensors:
            return int(self.tensors["thresholds"][0].numel() * 4)
        return sum((t.numel() + 3) // 4 if name.endswith("/ternary") else t.numel() * t.element_size()
                   for name, t in self._one_sparsity())

    def save(self, path: str | os.PathLike, force: bool = False) -> Path:
        """Write to ``path`` atomically (:func:`countdown.io.atomic_path`: the mode of the file it replaces
        kept, a symbolic link written through, a disk-full or read-only error one :class:`~countdown.io.WriteError`
        with the previous file unchanged); returns the path.

        An existing file at ``path`` is replaced only if it is a countdown artifact (any version):
        anything else (a notes file passed by mistake) raises :class:`ArtifactError` unless
        ``force=True``. What is no regular file (a FIFO, a device, a socket) and an empty path are refused
        whatever ``force`` says (:func:`countdown.io.refuse_special`).
        """
        from safetensors.torch import save_file

        if not force:
            refuse_foreign(path)
        else:
            refuse_special(path)  # a FIFO, a device or an empty path, whatever force says
        path = Path(path)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in self.tensors.items()}
        header = {"countdown": canonical_meta(self.meta), "countdown_sha256": artifact_checksum(self.meta, tensors)}
        with atomic_path(path, suffix=".safetensors", what="artifact") as tmp:  # OS errors: one WriteError
            save_file(tensors, str(tmp), metadata=header)
        return path


def canonical_meta(meta: dict) -> str:
    """The metadata as the checksum sees it: key-sorted JSON without spaces."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"))


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def artifact_checksum(meta: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the canonical metadata and every tensor (format 2)."""
    return hashlib.sha256(f"{canonical_meta(meta)}\n{tensors_checksum(tensors)}".encode()).hexdigest()


def is_artifact_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors file with countdown metadata (any format version)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return "countdown" in (f.metadata() or {})
    except Exception:  # not safetensors at all
        return False


def read_meta(path: str | os.PathLike) -> dict | None:
    """The countdown metadata of an artifact file from its header alone (no tensors read, nothing checked), or None
    where the file has none; for choosing among cached files before :func:`load_artifacts` checks one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["countdown"])
        return meta if isinstance(meta, dict) else None
    except Exception:  # not safetensors, no countdown metadata, bad JSON: not a candidate
        return None


def refuse_foreign(path: str | os.PathLike) -> None:
    """Raise :class:`ArtifactError` if ``path`` exists and is not a countdown artifact."""
    if os.path.isdir(path):
        raise ArtifactError(f"{path} is a folder: give a file name for the artifact (e.g. {Path(path)}/mono.safetensors)")
    refuse_special(path)  # a FIFO or a device: refused whatever force says (opening a FIFO would block)
    path = Path(path)
    if os.path.exists(path) and not is_artifact_file(path):
        raise ArtifactError(f"{path} exists and is not a countdown artifact: refusing to replace it; choose another "
                            "path, or pass --force (force=True) to overwrite it")


def _check_meta(meta: Any, path: Path) -> None:
    if not isinstance(meta, dict):
        raise ArtifactError(f"artifact {path} has metadata that is not a JSON object; {REBUILD}")
    for table, where in ((REQUIRED_META, meta), (REQUIRED_MODEL_META, meta.get("model", {}))):
        for name, typ in table.items():
            label = name if table is REQUIRED_META else f"model.{name}"
            if name not in where:
                raise ArtifactError(f"artifact {path} lacks the metadata field {label!r}; {REBUILD}")
            value = where[name]
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise ArtifactError(f"artifact {path} has a mistyped metadata field {label!r} (a {type(value).__name__}, "
                                    f"expected {typ.__name__}); {REBUILD}")
    if not meta["sparsities"] or not all(isinstance(k, (int, float)) for k in meta["sparsities"]):
        raise ArtifactError(f"artifact {path} has a malformed metadata field 'sparsities'; {REBUILD}")


def _not_safetensors(path: Path) -> str | None:
    """What ``path`` is when it is no safetensors file at all (a text file passed by mistake), or None when it starts
    like one (8 bytes of header length, then a JSON object): a damaged safetensors file is "corrupt", another file
    "not an artifact"."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(4096)
    if len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") < 100 * 2 ** 20:
        return None
    if not head:
        return "an empty file"
    try:
        head.decode("utf-8")
        return f"a text file of {size} bytes, not a safetensors file"
    except UnicodeDecodeError as error:
        return f"a text file of {size} bytes, not a safetensors file" if error.start > len(head) - 4 else \
            f"a file of {size} bytes that is not a safetensors file"


def load_artifacts(path: str | os.PathLike) -> Artifacts:
    """Read an artifact file written by :meth:`Artifacts.save`, verifying metadata and checksum."""
    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"{path} is a folder, not an artifact file: give the .safetensors file (a folder saved by "
                            "countdown.save keeps it as countdown_artifacts.safetensors)")
    kind = entry_kind(path)
    if kind is not None:  # a FIFO is never opened: that would block
        raise ArtifactError(f"{path} is {kind}, not an artifact file: give the .safetensors file written by "
                            "`countdown calibrate` / `countdown train` (Artifacts.save)")
    if not path.is_file():
        raise ArtifactError(f"no artifact file at {path}: build one with countdown.prepare and save it "
                            "(`countdown calibrate` / `countdown train`)")
    what = _not_safetensors(path)
    if what is not None:
        raise ArtifactError(f"{path} is not a countdown artifact ({what}): give the .safetensors file written by "
                            "`countdown calibrate` / `countdown train` (Artifacts.save)")
    try:
        header, tensors = read_safetensors(path)  # one open file: never one write's header with another's tensors
    except Exception as err:  # safetensors raises its own error types for truncated headers/data
        raise ArtifactError(f"artifact {path} is corrupt or truncated ({err}); {REBUILD}") from None
    if "countdown" not in header:
        raise ArtifactError(f"{path} is a safetensors file but not a countdown artifact (no 'countdown' "
                            "metadata); pass a file written by Artifacts.save")
    try:
        meta = json.loads(header["countdown"])
    except json.JSONDecodeError as err:
        raise ArtifactError(f"artifact {path} has corrupt metadata ({err}); {REBUILD}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a countdown artifact (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    version = meta.get("format_version", 0)
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ArtifactError(f"{path} was written by a newer countdown (artifact format "
                            f"{version} > {FORMAT_VERSION}); upgrade countdown or rebuild it")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path} uses artifact format {version!r}, whose checksum did not cover the metadata; "
                            f"this countdown reads format {FORMAT_VERSION} only: {REBUILD}")
    _check_meta(meta, path)  # first: a deleted or mistyped field is named, not only "edited"
    if header.get("countdown_sha256") != artifact_checksum(meta, tensors):
        raise ArtifactError(f"artifact {path} is corrupt or was edited: its metadata or tensors do not match the "
                            f"checksum written with them; {REBUILD}")
    return Artifacts(meta, tensors)


def new_meta(method: Method, kind: str, sparsities: list[float], mlps: list[GatedMLP], *,
             selection: str, data: dict, **extra: Any) -> dict:
    """Metadata common to every artifact (the kinds add their own options as ``extra``)."""
    from .. import __version__

    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": method.name,
        "kind": kind,
        "sparsities": [float(k) for k in sparsities],
        "selection": selection,
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
        raise method_mismatch(artifacts.method, m.name)
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
    why = other_weights(want, mlps)  # the same model in fp32, bf16 or fp16 fits
    if why is not None:
        raise ArtifactMismatchError(why)
    return index


def method_mismatch(have: str, want: str) -> ArtifactMismatchError:
    """The error for an artifact of method ``have`` given where method ``want`` runs."""
    return ArtifactMismatchError(f"these artifacts were made for method {have!r}, not {want!r}: build {want} "
                                 f"artifacts for this model (countdown.prepare with method={want!r}), or sparsify "
                                 f"with method={have!r}")


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
