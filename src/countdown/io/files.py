"""Files and folders replaced atomically: temporary names beside the target, modes kept, links written through,
fsync, rename (:func:`atomic_path`, :func:`atomic_write`, :func:`atomic_folder`, :func:`files_into`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import NAME_MAX, REPLACED, TMP_MARK, UnwritableError, _error, _name_max, writing

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
    """A file nobody may write (mode 0444; for root too) or this user may not is not replaced; on a file system
    mounted read-only the message says so (no chmod can fix that)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if os.path.isdir(path):
        return
    if st.st_mode & 0o222 and os.access(path, os.W_OK):
        return
    where = f" ({option})" if option else ""
    if read_only_mount(path):
        raise _error(UnwritableError, f"cannot replace {path}: the file system it is on is mounted read-only; "
                     f"choose a path on a writable disk{where}", errno.EROFS, path)
    if not st.st_mode & 0o222:
        raise _error(UnwritableError, f"cannot replace {path}: it is read-only (mode {st.st_mode & 0o777:04o}); "
                     f"make it writable (chmod u+w {path}) or choose another path{where}", errno.EACCES, path)
    raise _error(UnwritableError, f"cannot replace {path}: you may not write it (mode {st.st_mode & 0o777:04o}, "
                 f"owner uid {st.st_uid}); choose another path or ask its owner{where}", errno.EACCES, path)


def read_only_mount(path: str | os.PathLike) -> bool:
    """Whether the file system holding ``path`` (or its nearest existing folder) is mounted read-only."""
    for place in (Path(path), *Path(path).parents):
        try:
            return bool(os.statvfs(place).f_flag & os.ST_RDONLY)
        except (OSError, AttributeError):
            continue
    return False


_SPECIAL = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def entry_kind(path: str | os.PathLike) -> str | None:
    """What is at ``path`` (a symbolic link followed) when it is not a regular file: ``"a folder"``,
    ``"a FIFO (named pipe)"``, ``"a character device"``, ...; None for a regular file or nothing there. Only
    ``stat``: a FIFO is never opened (that would block)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    return next((name for test, name in _SPECIAL if test(mode)), "not a regular file")


def refuse_special(path: str | os.PathLike, option: str | None = None, folder: bool = False) -> None:
    """Refuse, before any work, an output path that holds something countdown must not write over, whatever
    ``force`` says: a FIFO, a device, a socket (and a folder where a file is written, or a file where a folder
    is). An empty path is refused too. Writing through a FIFO blocks in ``open()``; replacing a device node
    replaces it by a regular file."""
    where = f" ({option})" if option else ""
    if isinstance(path, (str, bytes)) and not path.strip():
        raise _error(UnwritableError, f"cannot write {path!r}: the path is empty; give a "
                     f"{'folder' if folder else 'file'} path{where}", errno.ENOENT, None)
    kind = entry_kind(path)
    if folder:
        if kind == "a folder" or not os.path.lexists(path):
            return
        kind = kind or "a file"
        raise _error(UnwritableError, f"cannot use {path} as an output folder: it is {kind}, not a folder; "
                     f"choose another path{where}", errno.ENOTDIR, path)
    if kind == "a folder":
        raise _error(UnwritableError, f"cannot write {path}: it is a folder; give a file name inside it{where}",
                     errno.EISDIR, path)
    if kind is not None:
        raise _error(UnwritableError, f"cannot write {path}: it is {kind}, not a regular file; countdown writes "
                     f"only regular files: give a file path{where}", errno.EINVAL, path)


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
    refuse_special(path, option)
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
    with atomic_path(path, what=what, option=option) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, data.encode() if isinstance(data, str) else data)
        finally:
            os.close(fd)
    return Path(path)


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
    refuse_special(folder, option, folder=True)
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
    refuse_special(folder, option, folder=True)
    folder = resolve_link(folder)
    with writing(folder, what, option, hint):
        folder.mkdir(parents=True, exist_ok=True)
        work = _make_work_dir(folder / "new")
        try:
            yield work
            for entry in work.iterdir():  # a FIFO or device where a file goes is refused before any replace
                refuse_special(folder / entry.name, option, folder=entry.is_dir())
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
