"""A safetensors file read through one open file, so a writer replacing it at the same moment cannot pair one
file's header with another's tensors (:func:`read_safetensors`)."""

from __future__ import annotations

import json
import os
import sys

_PROC_FD = sys.platform.startswith("linux")  # tests switch it off to exercise the portable path


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, str], dict]:
    """``(metadata, tensors)`` of a safetensors file, both from the same version of the file.

    ``safetensors.safe_open(..., framework="pt")`` reads the header from one open of the path and
    maps the tensors from a second one (``torch.UntypedStorage.from_file(name)``); if another
    process replaces the file in between (every countdown writer does so atomically), the metadata
    of one write comes back with the tensors of another. Here the file is opened once: on Linux
    safetensors reads it through ``/proc/self/fd`` (memory-mapped, as before); elsewhere it is read
    into memory once and parsed from the bytes. Errors are safetensors' own (a truncated file, a
    bad header) or ``OSError``.
    """
    from safetensors import safe_open

    fd = os.open(path, os.O_RDONLY)
    try:
        proc = f"/proc/self/fd/{fd}"
        if _PROC_FD and os.path.exists(proc):
            with safe_open(proc, framework="pt") as f:
                return dict(f.metadata() or {}), {name: f.get_tensor(name) for name in f.keys()}
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    finally:
        os.close(fd)
    return _parse_safetensors(data)



def _parse_safetensors(data: bytes) -> tuple[dict[str, str], dict]:
    from safetensors.torch import load

    if len(data) < 8:
        raise ValueError(f"not a safetensors file: {len(data)} bytes, shorter than its 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError(f"not a safetensors file: header length {n} exceeds the file ({len(data)} bytes)")
    header = json.loads(data[8:8 + n])
    return dict(header.get("__metadata__") or {}), load(data)
