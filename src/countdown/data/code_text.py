"""Python source text for a code perplexity, available offline: the standard library's own modules.

``load_texts("python")`` returns the top-level functions and classes (with their decorators) of a
fixed list of pure-Python standard-library modules, read from the running interpreter's
``sysconfig.get_paths()["stdlib"]``. Modules are taken in the fixed order of :data:`MODULES` and
their definitions interleaved round-robin (the first definition of every module, then the second of
every module, ...), so that the first few thousand tokens already mix many modules instead of being
the beginning of one.

The text is the same on every machine *with the same Python version*: the standard library changes
between releases (3.11 and 3.12 differ). :func:`python_text_version` gives the version to record
next to any number measured on this text.
"""

from __future__ import annotations

import ast
import functools
import platform
import sysconfig
from itertools import zip_longest
from pathlib import Path

# Pure-Python modules present as source in CPython 3.9 to 3.13, none a thin wrapper over a C or
# _py* implementation (datetime and decimal are, from 3.12). Fixed order: it fixes the text.
MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "gzip", "heapq",
    "inspect", "ipaddress", "json", "numbers", "pprint", "queue", "random", "shlex", "shutil",
    "statistics", "string", "tempfile", "textwrap", "tokenize", "typing", "uuid", "weakref",
)


def python_text_version() -> str:
    """The Python version whose standard library the ``"python"`` text comes from, e.g. ``"3.11.7"``."""
    return platform.python_version()


def module_path(name: str) -> Path:
    """The source file of a standard-library module (``<stdlib>/name.py`` or ``name/__init__.py``)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in (stdlib / f"{name}.py", stdlib / name / "__init__.py"):
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the standard-library source of {name!r} is not under {stdlib}: this Python installation ships "
        f"without .py sources (some minimal or frozen builds do); use a full CPython installation")


def top_level_definitions(source: str) -> list[str]:
    """The source of each top-level ``def``/``async def``/``class`` in ``source`` (decorators
    included), in file order."""
    lines = source.splitlines()
    blocks = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            blocks.append("\n".join(lines[first - 1: node.end_lineno]))
    return blocks


def python_texts() -> list[str]:
    """Top-level definitions of :data:`MODULES`, interleaved round-robin across the modules."""
    return list(_python_blocks())


@functools.lru_cache(maxsize=1)
def _python_blocks() -> tuple[str, ...]:  # parsing the 35 files takes ~1 s: once per process
    per_module = [top_level_definitions(module_path(name).read_text(encoding="utf-8")) for name in MODULES]
    return tuple(block for round_ in zip_longest(*per_module) for block in round_ if block is not None)
