"""What a cache folder held when it was written: ``countdown_manifest.json`` with the size and sha256 of every
file, written beside them and checked when the folder is read again (:func:`write_manifest`,
:func:`manifest_problem`).

Sizes are checked on every read (milliseconds; catches a truncated or half-written file, a file missing); the
sha256 of every file only with ``COUNTDOWN_VERIFY_CACHE=sha256`` in the environment (bit rot inside a file keeps
its size: seconds per gigabyte, so not the default). The model cache (:mod:`countdown.data.model_cache`) and the
text cache (:mod:`countdown.data.texts`) use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "countdown_manifest.json"
VERIFY_ENV = "COUNTDOWN_VERIFY_CACHE"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def full_check_wanted() -> bool:
    """Whether ``COUNTDOWN_VERIFY_CACHE=sha256`` asks for every file's sha256 to be compared on each read."""
    return os.environ.get(VERIFY_ENV, "").strip().lower() in ("sha256", "1", "full")


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> dict:
    """Record the size and sha256 of every file under ``folder`` (names relative to it) in its manifest."""
    from ..io import write_json

    folder = Path(folder)
    manifest = {"files": {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
                          for p in _files(folder)}}
    write_json(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder: Path) -> dict | None | str:
    """The manifest's files, None where there is none (a folder an older countdown wrote), or why it is unreadable."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"


def manifest_problem(folder: Path, full: bool | None = None) -> str | None:
    """Why the files of ``folder`` are not the ones its manifest records (one missing, another size, with ``full``
    (default: :func:`full_check_wanted`) another sha256), or None; None too where there is no manifest."""
    full = full_check_wanted() if full is None else full
    manifest = read_manifest(folder)
    if manifest is None or isinstance(manifest, str):
        return manifest
    for name, want in manifest.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["size"]:
            return f"{name}: {path.stat().st_size:,} bytes instead of {want['size']:,}"
        if full and file_sha256(path) != want["sha256"]:
            return f"{name}: sha256 differs from the one recorded when it was written"
    return None
