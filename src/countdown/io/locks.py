"""Outputs checked before the work and locked for the run (:func:`check_writable`, :func:`file_lock`,
:func:`claim_output`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

try:  # POSIX only; elsewhere locks degrade to no-ops
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from .errors import LockedError, UnwritableError, _error, explain, writing
from .files import _check_name, _opt, _refuse_read_only, _tmp_prefix, lock_file_of, refuse_special, resolve_link

_HELD: set[tuple[int, str]] = set()  # (pid, lock file) of the locks this process holds now

# --------------------------------------------------------------------------------------------
# Checks before the work, locks
# --------------------------------------------------------------------------------------------


def check_writable(path: str | os.PathLike, option: str | None = "--out") -> Path:
    """Make sure ``path`` can be written, before any work: creates its folder and a probe file.

    Raises :class:`UnwritableError` naming the path, the reason and ``option`` (the command-line
    option that gave the path, default ``--out``); returns ``Path(path)``. Refused too: an empty path, a
    folder at ``path`` (a file was asked for), a FIFO, a device or a socket there (only regular files are
    written, whatever ``force`` says), a name longer than the file system allows, a file that is read-only
    and a file system mounted read-only. A symbolic link is checked at its target.
    """
    refuse_special(path, option)
    path = Path(path)
    _check_name(path, option)
    target = resolve_link(path)
    blocker = next((p for p in target.parents if os.path.exists(p) and not os.path.isdir(p)), None)
    if blocker is not None:
        raise _error(UnwritableError, f"cannot write {path}: {blocker} is a file, not a folder; choose another "
                     f"path {_opt(option)}", errno.ENOTDIR, path)
    _refuse_read_only(target, option)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f"{_tmp_prefix(target)}{os.getpid()}.", suffix=".probe",
                                     dir=target.parent)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        why, fix = explain(err, target)
        raise _error(UnwritableError, f"cannot write {path}: {why}; {fix} {_opt(option)}", err.errno, path) from None
    return path


def check_writable_dir(folder: str | os.PathLike, option: str | None = "--out") -> Path:
    """:func:`check_writable` for an output folder: create it and a probe file inside it (a file, FIFO or
    device at ``folder`` is refused)."""
    refuse_special(folder, option, folder=True)
    folder = Path(folder)
    _check_name(folder, option)
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
    releases it. A killed holder's lock is released by the kernel with its descriptors. A symbolic
    link is locked at its target (a run through the link and a run on the target exclude each other).

    The lock file is removed when the block ends, so no ``.<name>.lock`` stays beside an output. Exclusion
    survives that: the file is unlinked only by its holder, while it holds the lock, and a process that
    acquires a lock checks that the file it locked is still the one at the path (a waiter may have opened
    the file just before the holder unlinked it); if not, it lets go and locks the path's file again. A lock
    file left by a killed holder is taken over and removed by the next run.
    """
    path = resolve_link(path)
    lock_path = lock_file_of(path)
    key = (os.getpid(), os.path.realpath(lock_path))  # the pid: a forked child holds nothing of its parent's
    if key in _HELD:
        yield lock_path
        return
    deadline = time.monotonic() + max(0.0, wait)
    fd = _acquire(lock_path, path, what, deadline)
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "command": " ".join(sys.argv)[:300]}
        with contextlib.suppress(OSError):  # who holds it is information only: a full disk must not stop the run
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        _HELD.add(key)
        try:
            yield lock_path
        finally:
            _HELD.discard(key)
            if fcntl is not None and _same_file(fd, lock_path):
                with contextlib.suppress(OSError):  # still holding it: no other process can have it now
                    os.unlink(lock_path)
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` now (not unlinked or replaced since it was opened)."""
    try:
        held, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino) and held.st_nlink > 0


def _acquire(lock_path: Path, path: Path, what: str, deadline: float) -> int:
    """An open descriptor of ``lock_path`` holding its exclusive lock, the file still at that path."""
    while True:
        with writing(lock_path, f"the lock file of {what}", kept=False):
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            return fd
        try:
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
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, lock_path):
            return fd
        os.close(fd)  # the holder removed this file as it let go: lock the one at the path now


@contextlib.contextmanager
def claim_output(path: str | os.PathLike, option: str = "--out", what: str = "output",
                 folder: bool = False, lock_name: str | None = None) -> Iterator[Path]:
    """Check an output before the work and hold its lock for the block: what every command does with each
    path it will write, before it loads the model. ``folder``: ``path`` is an output folder (checked as one;
    the lock is on ``lock_name`` inside it, default the folder itself). Yields the path."""
    path = Path(path)
    if folder:
        check_writable_dir(path, option)
        target = path / lock_name if lock_name else path
    else:
        check_writable(path, option)
        target = path
    with file_lock(target, what=what):
        yield path
