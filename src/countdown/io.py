"""Files that no concurrent run, kill or bad path can lose: atomic replace and advisory locks.

Every writer in countdown (artifacts, sweep tables and reports, training checkpoints, the model
cache, benchmark results) goes through this module:

* :func:`atomic_path` / :func:`atomic_write`: the new content goes to a temporary file in the same
  folder, is flushed and fsync'ed, then renamed over the target (``os.replace`` is atomic on POSIX),
  and the folder is fsync'ed so the rename itself survives a crash. A reader sees the old file or
  the new one, never a mix; a process killed half-way leaves the old file intact and no temporary
  file behind once the next writer of that path runs (:func:`atomic_path` removes stale ones).
* :func:`file_lock`: an advisory ``fcntl`` lock on ``.<name>.lock`` beside the output, held for a whole run. A second
  run on the same output stops at once (or waits, if asked) with a message naming the lock file and
  the process that holds it, so two runs never both print "wrote".
* :func:`read_safetensors`: read a safetensors file through one open file, so a writer replacing
  it at the same moment cannot pair one file's header with another's tensors (safetensors' own
  ``safe_open`` opens the path a second time for the tensors).
* :func:`check_writable`: create the target's folder and a probe file in it *before* any work
  starts, so an unwritable ``--out`` fails in a second, not after an hour of calibration.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

try:  # POSIX only; elsewhere locks degrade to no-ops (said in LockedError's absence)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

TMP_MARK = ".countdown-tmp-"
_HELD: set[tuple[int, str]] = set()  # (pid, lock file) of the locks this process holds now


class LockedError(RuntimeError):
    """Another process holds the lock on an output that this run wants to write."""


class UnwritableError(OSError):
    """An output path cannot be written (missing permission, a file where a folder should be)."""


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _clean_stale(path: Path) -> None:
    """Remove temporary files a killed writer of ``path`` left behind (their pid is gone)."""
    prefix = path.name + TMP_MARK
    if not path.parent.is_dir():
        return
    for stale in path.parent.glob(prefix + "*"):
        pid = stale.name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            stale.unlink()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _default_mode(path: Path) -> int:
    """The existing file's permissions, or what ``open(path, "w")`` would create (0666 less the umask)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        pass
    try:  # Linux says the umask without changing it (os.umask would, for every thread, for a moment)
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it replaces ``path`` atomically.

    Write the new content to the yielded path (any library that takes a file name works). On an
    exception the temporary file is removed and ``path`` is untouched. ``suffix`` keeps an extension
    on the temporary name for writers that insist on one (matplotlib picks the format from it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}{TMP_MARK}{os.getpid()}.", suffix=suffix, dir=path.parent)
    try:  # mkstemp makes the file private (0600): give the result the mode a plain open() would
        os.fchmod(fd, _default_mode(path))
    finally:
        os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Replace ``path`` with ``data`` (str is written as UTF-8) atomically; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def write_json(path: str | os.PathLike, data) -> Path:
    """Atomically write ``data`` as indented, key-sorted JSON."""
    return atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def check_writable(path: str | os.PathLike, option: str = "--out") -> Path:
    """Make sure ``path`` can be written, before any work: creates its folder and a probe file.

    Raises :class:`UnwritableError` naming the path, the reason and ``option`` (the command-line
    option that gave the path, default ``--out``); returns ``Path(path)``. A directory at ``path``
    itself is refused too (a file was asked for).
    """
    path = Path(path)
    if path.is_dir():
        raise UnwritableError(f"cannot write {path}: it is a folder; give a file name inside it")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UnwritableError(f"cannot write {path}: {blocker} is a file, not a folder; choose another path ({option})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f"{path.name}{TMP_MARK}{os.getpid()}.", suffix=".probe",
                                     dir=path.parent)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise UnwritableError(f"cannot write {path} ({err.strerror or err}): choose a path in a folder you can "
                              f"write to ({option})") from None
    return path


def check_writable_dir(folder: str | os.PathLike, option: str = "--out") -> Path:
    """:func:`check_writable` for an output folder: create it and a probe file inside it."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UnwritableError(f"cannot use {folder} as an output folder: it is a file; choose another path ({option})")
    check_writable(folder / ".countdown-write-probe", option)
    return folder


def _holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text() or "{}")
    except (OSError, ValueError):
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {since} ({info.get('command', '?')})"


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, wait: float = 0.0, what: str = "output") -> Iterator[Path]:
    """Hold an exclusive advisory lock on ``path`` (the lock file is ``.<name>.lock`` beside it) for the block.

    ``wait``: seconds to wait for another holder (0: fail at once). Raises :class:`LockedError`
    naming the lock file and the holder. The lock is re-entrant within one process: a nested
    ``file_lock`` of a path this process already holds (the CLI locks a checkpoint folder before the
    model load, then the training locks it again) passes through, and only the outermost block
    releases it. The lock file stays (removing it would race with a waiter); it holds only who
    locked it last. A killed holder's lock is released by the kernel with its descriptors.
    """
    path = Path(path)
    lock_path = path.with_name(f".{path.name}.lock")
    key = (os.getpid(), os.path.realpath(lock_path))  # the pid: a forked child holds nothing of its parent's
    if key in _HELD:
        yield lock_path
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + max(0.0, wait)
    try:
        if fcntl is not None:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockedError(
                            f"{what} {path} is being written by {_holder(lock_path)}: wait for it to finish "
                            f"or choose another path (lock file {lock_path})") from None
                    time.sleep(0.2)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _HELD.add(key)
        try:
            yield lock_path
        finally:
            _HELD.discard(key)
    finally:
        os.close(fd)  # closing the descriptor releases the flock


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
