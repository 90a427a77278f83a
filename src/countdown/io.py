"""Files that no concurrent run, kill, full disk or bad path can lose: one checked path for every write.

Every writer in countdown (artifacts, sweep tables and reports, training checkpoints, saved models, the
model and data caches, benchmark results) goes through this module:

* :func:`atomic_path` / :func:`atomic_write`: the new content goes to a private temporary folder beside
  the target (``<name>.countdown-tmp-<pid>.<random>/``; a library that itself writes through a temporary
  file, as safetensors does, writes it in there too), is fsync'ed, given the mode the target had (or the
  umask's, as ``open()`` would), then renamed over the target (``os.replace`` is atomic on POSIX), and
  the folder is fsync'ed so the rename itself survives a crash. A reader sees the old file or the new one,
  never a mix; a process killed half-way (kill -9, SIGTERM) leaves the old file intact and its temporary
  folder is removed by the next writer of that path. A symbolic link at the target is written through:
  its target file is replaced, the link stays. A target without any write permission (mode 0444) is
  refused, not replaced.
* :func:`atomic_folder` / :func:`files_into`: the same for a folder written whole (a saved model) or for
  files added to an existing folder (``save_pretrained`` into a folder that keeps its other files).
* :func:`writing`: every OS error of a write (disk full, read-only file system, permission, a name too
  long, an I/O error), raised by Python or by safetensors' Rust writer, becomes one
  :class:`WriteError`: one line naming what could not be written, where, why, and the fix, and saying
  that the previous file is unchanged.
* :func:`file_lock`: an advisory ``fcntl`` lock on ``.<name>.lock`` beside the output, held for a whole
  run. A second run on the same output stops at once (or waits, if asked) with a message naming the lock
  file and the process that holds it, so two runs never both print "wrote".
* :func:`check_writable` / :func:`check_writable_dir`: create the target's folder and a probe file in it
  *before* any work starts, so an unwritable ``--out`` fails in a second, not after an hour of
  calibration; :func:`claim_output` checks and locks in one step (what every command does with each
  output before it loads the model).
* :func:`read_safetensors`: read a safetensors file through one open file, so a writer replacing it at
  the same moment cannot pair one file's header with another's tensors (safetensors' own ``safe_open``
  opens the path a second time for the tensors).
* :func:`describe_os_error`: the one line the command line prints for any OS error.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
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
REPLACED = ".replaced"  # the old folder, moved aside while a new one takes its place
NAME_MAX = 255  # bytes per file name on every file system countdown is used on (os.pathconf says where it can)
_HELD: set[tuple[int, str]] = set()  # (pid, lock file) of the locks this process holds now


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


# --------------------------------------------------------------------------------------------
# Names, modes, links
# --------------------------------------------------------------------------------------------


def _fit(name: str, room: int) -> str:
    """``name``, shortened (with a hash of the whole, so two long names stay apart) so that ``room`` more
    bytes still fit in one file name."""
    if len(os.fsencode(name)) + room <= NAME_MAX:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    keep = name
    while len(os.fsencode(keep)) + room + 13 > NAME_MAX:
        keep = keep[:-1]
    return f"{keep}~{digest}"


def _tmp_prefix(path: Path) -> str:
    """Temporary names of a writer of ``path`` start with this (room left for the pid, a random part and a suffix)."""
    return _fit(path.name, len(TMP_MARK) + 40) + TMP_MARK


def lock_file_of(path: str | os.PathLike) -> Path:
    """The lock file of ``path``: ``.<name>.lock`` beside it (the link's target for a symbolic link)."""
    path = resolve_link(path)
    return path.with_name(f".{_fit(path.name, 6)}.lock")


def resolve_link(path: str | os.PathLike) -> Path:
    """``path``, or the file a symbolic link there points to (writers write through links: the link stays)."""
    path = Path(path)
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


def _umask() -> int:
    try:  # Linux says the umask without changing it (os.umask would, for every thread, for a moment)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _default_mode(path: Path, folder: bool = False) -> int:
    """The existing file's (folder's) permissions, or what ``open(path, "w")`` (``mkdir``) would create:
    0666 (0777) less the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        pass
    return (0o777 if folder else 0o666) & ~_umask()


def _refuse_read_only(path: Path, option: str | None) -> None:
    """A file nobody may write (mode 0444; for root too) or this user may not is not replaced."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if os.path.isdir(path):
        return
    if not st.st_mode & 0o222 or not os.access(path, os.W_OK):
        raise _error(UnwritableError, f"cannot replace {path}: it is read-only (mode {st.st_mode & 0o777:04o}); "
                     f"make it writable (chmod u+w {path}) or choose another path"
                     + (f" ({option})" if option else ""), errno.EACCES, path)


def _opt(option: str | None) -> str:
    return f" ({option})" if option else ""


def _check_name(path: Path, option: str | None) -> None:
    """Every part of ``path`` still to be created fits in a file name here."""
    if os.path.lexists(path):
        return
    existing = next((p for p in (path.parent, *path.parent.parents) if os.path.exists(p)), Path("/"))
    limit = _name_max(existing)
    for part in [path, *path.parents]:
        if part == existing:
            break
        size = len(os.fsencode(part.name))
        if size > limit:
            raise _error(UnwritableError, f"cannot write {path}: the name {part.name[:40]}... is {size} bytes long; "
                         f"this file system allows {limit} per name: choose a shorter name"
                         + (f" ({option})" if option else ""), errno.ENAMETOOLONG, path)


# --------------------------------------------------------------------------------------------
# Atomic replace
# --------------------------------------------------------------------------------------------


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


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _clean_stale(path: Path) -> None:
    """Remove temporary files and folders a killed writer of ``path`` left behind (their pid is gone)."""
    prefix = _tmp_prefix(path)
    if not os.path.isdir(path.parent):
        return
    with contextlib.suppress(OSError):
        for stale in path.parent.glob(glob_escape(prefix) + "*"):
            pid = stale.name[len(prefix):].split(".", 1)[0]
            if pid.isdigit() and _alive(int(pid)):
                continue
            if stale.name.endswith(REPLACED) and not os.path.lexists(path):
                # a writer killed between moving the old folder aside and putting the new one in: put it back
                with contextlib.suppress(OSError):
                    os.replace(stale, path)
                    continue
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    stale.unlink()


def recover(path: str | os.PathLike) -> None:
    """Clean up after a writer of ``path`` that was killed: its temporary files and folders go, and a folder it
    had moved aside to put a new one in its place is put back if the new one never arrived."""
    _clean_stale(resolve_link(path))


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


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


def _make_work_dir(path: Path) -> Path:
    """A private temporary folder beside ``path`` (same file system: the final rename is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(path)
    return Path(tempfile.mkdtemp(prefix=f"{_tmp_prefix(path)}{os.getpid()}.", dir=path.parent))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "", what: str = "", option: str | None = None,
                hint: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it replaces ``path`` atomically.

    Write the new content to the yielded path (any library that takes a file name works; ``suffix`` keeps
    an extension on it for writers that insist on one: matplotlib picks the format from it). On an
    exception nothing is left behind and ``path`` is untouched; an OS error (disk full, read-only, ...)
    comes out as one :class:`WriteError` naming ``what`` and ``path``, the fix (with ``option``, ``hint``)
    and that the previous file is unchanged. The new file gets the old one's mode, or the umask's. A
    symbolic link at ``path`` is written through (its target is replaced, the link stays)."""
    path = resolve_link(path)
    with writing(path, what, option, hint):
        _refuse_read_only(path, option)
        mode = _default_mode(path)
        work = _make_work_dir(path)
        tmp_path = work / (_fit(path.stem, len(suffix) + 1) + suffix if suffix else path.name)
        try:
            yield tmp_path
            os.chmod(tmp_path, mode)
            _fsync_file(tmp_path)
            os.replace(tmp_path, path)
            _fsync_dir(path.parent)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[:1 << 24])
        view = view[written:]


def atomic_write(path: str | os.PathLike, data: bytes | str, what: str = "", option: str | None = None) -> Path:
    """Replace ``path`` with ``data`` (str is written as UTF-8) atomically (see :func:`atomic_path`); returns
    the path."""
    path = Path(path)
    with atomic_path(path, what=what, option=option) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, data.encode() if isinstance(data, str) else data)
        finally:
            os.close(fd)
    return path


def write_json(path: str | os.PathLike, data, what: str = "") -> Path:
    """Atomically write ``data`` as indented, key-sorted JSON."""
    return atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n", what=what)


def fix_modes(folder: str | os.PathLike, like: str | os.PathLike | None = None) -> None:
    """Give every file and folder under ``folder`` the mode ``open()`` / ``mkdir`` would (the umask's), or
    the mode of the entry of the same name under ``like`` where there is one (some writers, safetensors
    among them, make private 0600 files)."""
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        for name, is_dir in [*((d, True) for d in dirs), *((f, False) for f in files)]:
            entry = Path(root) / name
            if entry.is_symlink():
                continue
            model = Path(like) / rel / name if like is not None else None
            mode = _default_mode(model, is_dir) if model is not None and model.exists() else \
                (0o777 if is_dir else 0o666) & ~_umask()
            os.chmod(entry, mode)


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike, what: str = "folder", option: str | None = None,
                  hint: str | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``folder``; on a clean exit it takes ``folder``'s place in one
    rename (an existing folder is moved aside first and deleted only once the new one is in; if the new one
    cannot be put in place, the old one is put back). Modes: the old folder's, else the umask's; each file
    keeps the mode of the file of the same name it replaces. A symbolic link at ``folder`` is written
    through. OS errors come out as :class:`WriteError` (see :func:`atomic_path`)."""
    folder = resolve_link(folder)
    with writing(folder, what, option, hint):
        work = _make_work_dir(folder)
        try:
            yield work
            old = folder if folder.is_dir() else None
            fix_modes(work, like=old)
            os.chmod(work, _default_mode(folder, folder=True))
            _fsync_tree(work)
            if old is None:
                os.replace(work, folder)
            else:
                aside = folder.with_name(f"{_tmp_prefix(folder)}{os.getpid()}{REPLACED}")
                os.replace(folder, aside)
                try:
                    os.replace(work, folder)
                except BaseException:
                    os.replace(aside, folder)
                    raise
                shutil.rmtree(aside, ignore_errors=True)
            _fsync_dir(folder.parent)
        finally:
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def files_into(folder: str | os.PathLike, what: str = "folder", option: str | None = None,
               hint: str | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder inside ``folder`` (created if missing); on a clean exit each file
    written there replaces the file of the same name in ``folder`` atomically (keeping its mode; a new file
    gets the umask's), and the folder's other files stay. On an error ``folder`` is as it was. OS errors
    come out as :class:`WriteError`."""
    folder = resolve_link(folder)
    with writing(folder, what, option, hint):
        folder.mkdir(parents=True, exist_ok=True)
        work = _make_work_dir(folder / "new")
        try:
            yield work
            fix_modes(work, like=folder)
            _fsync_tree(work)
            for entry in sorted(work.iterdir()):
                target = folder / entry.name
                if entry.is_dir() and target.is_dir():
                    shutil.rmtree(target)
                os.replace(entry, target)
            _fsync_dir(folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync_file(Path(root) / name)
        _fsync_dir(Path(root))


# --------------------------------------------------------------------------------------------
# Checks before the work, locks
# --------------------------------------------------------------------------------------------


def check_writable(path: str | os.PathLike, option: str | None = "--out") -> Path:
    """Make sure ``path`` can be written, before any work: creates its folder and a probe file.

    Raises :class:`UnwritableError` naming the path, the reason and ``option`` (the command-line
    option that gave the path, default ``--out``); returns ``Path(path)``. A directory at ``path``
    itself is refused too (a file was asked for), and so are a name longer than the file system allows and
    a file that is read-only. A symbolic link is checked at its target.
    """
    path = Path(path)
    _check_name(path, option)
    target = resolve_link(path)
    if os.path.isdir(target):
        raise _error(UnwritableError, f"cannot write {path}: it is a folder; give a file name inside it {_opt(option)}",
                     errno.EISDIR, path)
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
    """:func:`check_writable` for an output folder: create it and a probe file inside it."""
    folder = Path(folder)
    _check_name(folder, option)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise _error(UnwritableError, f"cannot use {folder} as an output folder: it is a file; choose another "
                     f"path {_opt(option)}", errno.ENOTDIR, folder)
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
    locked it last. A killed holder's lock is released by the kernel with its descriptors. A symbolic
    link is locked at its target (a run through the link and a run on the target exclude each other).
    """
    path = resolve_link(path)
    lock_path = lock_file_of(path)
    key = (os.getpid(), os.path.realpath(lock_path))  # the pid: a forked child holds nothing of its parent's
    if key in _HELD:
        yield lock_path
        return
    with writing(lock_path, f"the lock file of {what}", kept=False):
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
        with contextlib.suppress(OSError):  # who holds it is information only: a full disk must not stop the run
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        _HELD.add(key)
        try:
            yield lock_path
        finally:
            _HELD.discard(key)
    finally:
        os.close(fd)  # closing the descriptor releases the flock


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
