"""Injected OS errors for the fault tests: a folder that refuses writes (for root too), a disk that fills up.

The tests run as root on CI, where permissions do not bind, and no small tmpfs is available: so the errors a
read-only folder or a full disk raise are injected at the calls that meet them (``os.open`` for writing,
``os.mkdir``, ``os.replace``, ``os.write``, safetensors' and transformers' writers), with the errno, message and
file name the kernel would give. Everything else runs for real.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _inside(path, folder: str) -> bool:
    try:
        name = os.path.abspath(os.fsdecode(path))
    except TypeError:  # a file descriptor
        return False
    return name.startswith(folder + os.sep)


def read_only(monkeypatch, folder: str | os.PathLike, code: int = errno.EACCES) -> Path:
    """Make ``folder`` refuse every change inside it (create, write, rename, remove, mkdir) with ``code``
    (EACCES: a folder without write permission; EROFS: a read-only file system), as the kernel would for a
    normal user; its mode is set to 0555 too. Reads still work. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    root = os.path.abspath(folder)
    message = os.strerror(code)

    def refuse(path):
        raise OSError(code, message, os.fsdecode(path))

    real_open, real_mkdir, real_replace, real_rename = os.open, os.mkdir, os.replace, os.rename
    real_unlink, real_rmdir, real_io_open, real_chmod = os.unlink, os.rmdir, io.open, os.chmod

    def fake_open(path, flags, *args, **kwargs):
        if flags & WRITE_FLAGS and _inside(path, root) and kwargs.get("dir_fd") is None:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if _inside(path, root):
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_move(real):
        def move(src, dst, *args, **kwargs):
            for name in (src, dst):
                if _inside(name, root):
                    raise OSError(code, message, os.fsdecode(src), None, os.fsdecode(dst))
            return real(src, dst, *args, **kwargs)
        return move

    def fake_remove(real):
        def remove(path, *args, **kwargs):
            if _inside(path, root):
                refuse(path)
            return real(path, *args, **kwargs)
        return remove

    def fake_io_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and _inside(file, root):
            refuse(file)
        return real_io_open(file, mode, *args, **kwargs)

    def fake_chmod(path, *args, **kwargs):
        if _inside(path, root):
            refuse(path)
        return real_chmod(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "replace", fake_move(real_replace))
    monkeypatch.setattr(os, "rename", fake_move(real_rename))
    monkeypatch.setattr(os, "unlink", fake_remove(real_unlink))
    monkeypatch.setattr(os, "remove", fake_remove(real_unlink))
    monkeypatch.setattr(os, "rmdir", fake_remove(real_rmdir))
    monkeypatch.setattr(os, "chmod", fake_chmod)
    monkeypatch.setattr(io, "open", fake_io_open)
    monkeypatch.setattr(builtins, "open", fake_io_open)
    return folder


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def disk_full(monkeypatch, after: int = 0, where: str | os.PathLike | None = None) -> dict:
    """Fill the disk: ``os.write`` to a file under ``where`` (default: any file countdown writes through a
    temporary name) writes ``after`` more bytes in all, then fails with ENOSPC, as a full disk does (a short
    write, then the error). Returns a dict counting the bytes written and the failures."""
    from countdown.io import TMP_MARK

    state = {"written": 0, "failures": 0}
    real_write = os.write
    root = os.path.abspath(where) if where is not None else None

    def write(fd, data):
        path = _fd_path(fd)
        if (root is not None and path.startswith(root + os.sep)) or (root is None and TMP_MARK in path):
            room = after - state["written"]
            if room <= 0:
                state["failures"] += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = real_write(fd, bytes(memoryview(data)[:room]))
            state["written"] += n
            return n
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    return state


def safetensors_disk_full(monkeypatch, targets=("safetensors.torch",)) -> list:
    """safetensors' Rust writer on a full disk: half of the file is written, then its own error (a
    ``SafetensorError``, not an OSError: "I/O error: No space left on device (os error 28)"). Patched where
    the writers look it up (``targets``: modules whose ``save_file`` / ``safe_save_file`` is replaced).
    Returns the list of paths it failed on."""
    import importlib

    from safetensors import SafetensorError
    from safetensors.torch import save as to_bytes

    failed = []

    def save_file(tensors, filename, metadata=None):
        data = to_bytes(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
        failed.append(str(filename))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    for name in targets:
        module = importlib.import_module(name)
        for attr in ("save_file", "safe_save_file"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, save_file)
    return failed
