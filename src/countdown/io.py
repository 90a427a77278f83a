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


def check_writable(path: str | os.PathLike) -> Path:
    """Make sure ``path`` can be written, before any work: creates its folder and a probe file.

    Raises :class:`UnwritableError` naming the path and the reason; returns ``Path(path)``.
    A directory at ``path`` itself is refused too (a file was asked for).
    """
    path = Path(path)
    if path.is_dir():
        raise UnwritableError(f"cannot write {path}: it is a folder; give a file name inside it")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UnwritableError(f"cannot write {path}: {blocker} is a file, not a folder; choose another path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f"{path.name}{TMP_MARK}{os.getpid()}.", suffix=".probe",
                                     dir=path.parent)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise UnwritableError(f"cannot write {path} ({err.strerror or err}): choose a path in a folder you can "
                              "write to (--out)") from None
    return path


def check_writable_dir(folder: str | os.PathLike) -> Path:
    """:func:`check_writable` for an output folder: create it and a probe file inside it."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UnwritableError(f"cannot use {folder} as an output folder: it is a file")
    check_writable(folder / ".countdown-write-probe")
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
    naming the lock file and the holder. Locks are per open file description, so the same process
    taking the same lock twice (nested) also fails: take each lock once per run. The lock file stays
    (removing it would race with a waiter); it holds only who locked it last.
    """
    path = Path(path)
    lock_path = path.with_name(f".{path.name}.lock")
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
        yield lock_path
    finally:
        os.close(fd)  # closing the descriptor releases the flock
