"""What a failed write means to the user: OS errors (Python's or safetensors' Rust writer's) as one line naming
what, where, why and the fix (:func:`writing`, :class:`WriteError`, :func:`describe_os_error`)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

TMP_MARK = ".countdown-tmp-"
REPLACED = ".replaced"  # the old folder, moved aside while a new one takes its place
NAME_MAX = 255  # bytes per file name on every file system countdown is used on (os.pathconf says where it can)


class LockedError(RuntimeError):
    """Another process holds the lock on an output that this run wants to write."""


class UnwritableError(OSError):
    """An output path cannot be written (missing permission, a file where a folder should be, a name too long).

    ``str(error)`` is the whole one-line message; ``errno`` and ``filename`` are set where known."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class WriteError(UnwritableError):
    """A write failed part-way (disk full, read-only file system, permission, I/O error): the message names
    what, where, why and the fix; the file or folder that was there before is unchanged."""


def _error(cls, message: str, code: int | None = None, filename=None):
    err = cls(" ".join(message.split()))  # one line
    err.errno, err.filename = code, None if filename is None else os.fspath(filename)
    return err


# --------------------------------------------------------------------------------------------
# What an OS error means, and what to do about it
# --------------------------------------------------------------------------------------------

# errno values a failed write raises; an error with one of these inside a write is the write's failure
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG,
                 errno.EIO, errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.ELOOP, errno.EMFILE, errno.ENFILE,
                 errno.EXDEV, errno.ETXTBSY, errno.EBUSY, errno.ENOTEMPTY, errno.EEXIST, errno.EMLINK}
_ALWAYS_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # only a write raises these
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # safetensors: "I/O error: No space left on device (os error 28)"


def os_error_of(exc: BaseException) -> OSError | None:
    """The OS error behind ``exc``: itself, an I/O error safetensors' Rust writer reported (a
    ``SafetensorError`` whose message ends in ``(os error N)``), or such an error that another library
    raised ``exc`` from; None when ``exc`` is something else."""
    seen = 0
    while exc is not None and seen < 6:
        if isinstance(exc, OSError):
            return exc
        found = _RUST_OS_ERROR.search(str(exc)) if type(exc).__name__ == "SafetensorError" else None
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
        exc, seen = exc.__cause__, seen + 1
    return None


def _free(folder: Path) -> str:
    for place in (folder, *folder.parents):
        try:
            free = shutil.disk_usage(place).free
        except OSError:
            continue
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if free >= size:
                return f", {free / size:.1f} {unit} free there"
        return f", {free} bytes free there"
    return ""


def _name_max(folder: Path) -> int:
    for place in (folder, *folder.parents):
        try:
            return os.pathconf(place, "PC_NAME_MAX")
        except (OSError, ValueError):
            continue
    return NAME_MAX


def explain(err: OSError, path: str | os.PathLike | None = None, write: bool = True) -> tuple[str, str]:
    """``(why, fix)`` of an OS error met while writing ``path`` (``write=False``: while using it in some way
    not known), in words a user can act on."""
    code = err.errno
    if not write and code in (errno.EACCES, errno.EPERM):
        return "permission denied", "check the permissions of that path, or use another one"
    if not write and code == errno.ENOENT:
        return "no such file or folder", "check the path"
    where = Path(path if path is not None else (err.filename or ".")).parent
    if code == errno.ENOSPC:
        return f"the disk is full (no space left on the device{_free(where)})", \
            "free space on that disk or choose a path on another one"
    if code == errno.EDQUOT:
        return "your disk quota is used up", "free space under your quota or choose a path on another disk"
    if code == errno.EFBIG:
        return "the file is larger than this file system allows", "choose a path on another file system"
    if code == errno.EROFS:
        return "the file system is read-only", "choose a path on a writable disk"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied", "choose a folder you can write to, or change its permissions"
    if code == errno.ENAMETOOLONG:
        name = Path(path or err.filename or "").name
        limit = _name_max(where)
        size = len(os.fsencode(name))
        detail = f" ({size} bytes; at most {limit} per name here)" if size > limit else ""
        return f"the name is too long{detail}", "choose a shorter name"
    if code == errno.EIO:
        return "an input/output error (the disk or the network file system failed)", \
            "check the disk (dmesg), then run again"
    if code == errno.ENOTDIR:
        return "a part of the path is a file, not a folder", "choose another path"
    if code == errno.EISDIR:
        return "it is a folder", "give a file name"
    if code == errno.ENOENT:
        if os.path.isdir(where):
            return "files cannot be created in that folder", "choose a path in another folder"
        return "a folder on the way does not exist", "create it or choose another path"
    if code in (errno.EMFILE, errno.ENFILE):
        return "too many open files", "raise the limit (ulimit -n) and run again"
    why = err.strerror or str(err) or type(err).__name__
    return why[:1].lower() + why[1:], "check the path and run again"


def write_error(err: OSError, path: str | os.PathLike, what: str = "", option: str | None = None,
                hint: str | None = None, kept: bool = False) -> WriteError:
    """The :class:`WriteError` for ``err`` met while writing ``path`` (``what``: "artifact", "sweep table", ...;
    ``option``: the command-line option or variable that named the path; ``hint``: more of the fix; ``kept``:
    say that the file that was there is unchanged)."""
    why, fix = explain(err, path)
    label = f"{what} {path}" if what else str(path)
    text = f"cannot write {label}: {why}; {fix}" + (f" ({option})" if option else "") + (f"; {hint}" if hint else "")
    if kept:
        text += f"; the previous {Path(path).name} is unchanged"
    return _error(WriteError, text, err.errno, path)


def describe_os_error(err: BaseException) -> str:
    """The one line the command line prints for an OS error (``err`` or the OS error behind it): countdown's
    own errors as they are, any other with the path, the reason and the fix."""
    os_err = os_error_of(err)
    if os_err is None or isinstance(os_err, UnwritableError) or os_err.errno is None:
        return " ".join(str(os_err if os_err is not None else err).split())
    path = os_err.filename
    why, fix = explain(os_err, path, write=False)
    where = f"{path}: " if path else ""
    if getattr(os_err, "filename2", None):
        where = f"{path} -> {os_err.filename2}: "
    wrapped = "" if os_err is err or type(err).__name__ == "SafetensorError" else \
        f"{(str(err).splitlines() or [type(err).__name__])[0][:300]} ("
    return " ".join(f"{wrapped}{where}{why}; {fix}{')' if wrapped else ''}".split())


def _related(name, path: Path) -> bool:
    """Whether the file ``name`` an error names is ``path``, beside it, inside it or one of its folders."""
    name = os.path.abspath(os.fspath(name)).rstrip(os.sep) or os.sep
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    return name == folder or name.startswith(folder + os.sep) or (target + os.sep).startswith(name + os.sep) \
        or name == os.sep


def _concerns(err: OSError, path: Path) -> bool:
    """Whether ``err``, raised inside a write of ``path``, is that write's failure (not, say, a missing input)."""
    if err.errno in _ALWAYS_WRITE:
        return True
    if err.errno not in _WRITE_ERRNOS:
        return False
    names = [n for n in (err.filename, getattr(err, "filename2", None)) if n is not None]
    return not names or any(_related(n, path) for n in names)


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str = "", option: str | None = None, hint: str | None = None,
            kept: bool | None = None) -> Iterator[None]:
    """Turn the OS error of a write of ``path`` inside the block (or safetensors' report of one) into one
    :class:`WriteError` (see :func:`write_error`; ``kept`` defaults to whether ``path`` existed before).
    Other exceptions pass through unchanged."""
    path = Path(path)
    if kept is None:
        kept = os.path.lexists(path)
    try:
        yield
    except UnwritableError:
        raise
    except Exception as exc:
        os_err = os_error_of(exc)
        if os_err is None or not _concerns(os_err, path):
            raise
        raise write_error(os_err, path, what, option, hint, kept) from exc
