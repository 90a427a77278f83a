"""A saved model folder read as one save, even while another process saves over it (:func:`one_save`).

``countdown.save`` replaces a folder in one rename (:func:`countdown.io.atomic_folder`) and ``save_pretrained``
of a countdown model replaces its files one by one, each atomically; but a load opens the folder's files one
after another (config.json, the weights, countdown.json, the artifact), so a load running while a save lands can
pair one save's weights with the other's artifact and fail with a misleading "made for a model with other
weights". Here the folder's state (its inode and every file's inode, size and mtime) is taken before and after
the load: if it changed, the load is done again, once, and a line on stderr says so; if it changed again, the
error says that another process is saving into the folder. What failed while the folder was unchanged is raised
as it was.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable

from .texts import log


class FolderReplacedError(ValueError):
    """A model folder changed under two loads in a row: another process keeps saving into it."""


def folder_state(folder: str | os.PathLike) -> tuple:
    """What changes when a save lands in ``folder``: the folder's own inode (``atomic_folder`` puts a new one in its
    place) and each entry's name, inode, size and mtime (``save_pretrained`` replaces files in place)."""
    folder = Path(folder)
    try:
        own = os.stat(folder)
        entries = []
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            st = entry.stat(follow_symlinks=True)
            entries.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
    except OSError:
        return ("missing",)
    return (own.st_dev, own.st_ino, tuple(entries))


def read_as_one_save(folder: str | os.PathLike, read: Callable, what: str = "load_model"):
    """``read()``, done again once if ``folder`` changed while it ran (see the module docstring)."""
    for attempt in (1, 2):
        before = folder_state(folder)
        try:
            result, failure = read(), None
        except Exception as error:  # noqa: BLE001 - judged below: raised as it was if the folder did not change
            result, failure = None, error
        if folder_state(folder) == before:
            if failure is not None:
                raise failure
            return result
        if attempt == 1:
            log(f"{folder} changed while {what} read it (another process saved into it): reading it again")
    raise FolderReplacedError(f"{folder} changed twice while {what} read it: another process is saving into it; "
                              "wait for that save to finish, then load it again") from failure


def one_save(load: Callable) -> Callable:
    """Decorate ``load(name_or_path, ...)`` (``countdown.load_model``) so that a saved folder is read as one save
    (:func:`read_as_one_save`); a catalogue name, a file or a hub id is loaded as it is."""

    @functools.wraps(load)
    def loading(*args, **kwargs):
        from .models import model_source

        name = args[0] if args else kwargs.get("name_or_path")
        try:
            kind, where = model_source(name) if name is not None else (None, None)
        except (ValueError, FileNotFoundError, TypeError):
            kind = where = None  # load() itself says what is wrong with the name
        if kind != "folder" or kwargs.get("random_weights"):
            return load(*args, **kwargs)
        return read_as_one_save(where, lambda: load(*args, **kwargs))

    return loading
