"""CSV tables that several runs add rows to: read back checked, written whole and atomically under the table's
lock (:func:`read_table`, :func:`adding_rows`).

A run that writes into a folder other runs also write into (``countdown bench --out``) adds its rows to the
table that is there, each row marked with its run (:func:`run_id`), instead of replacing it: two runs at once,
or one after the other, keep every row. Only the merge holds the table's lock (re-read, add, replace: the time
it takes to write this run's files), so runs proceed in parallel and only their merges take turns.
"""

from __future__ import annotations

import contextlib
import csv
import io as _stdio
import os
import secrets
import time
from pathlib import Path
from typing import Iterator, Sequence

from .files import files_into, refuse_special
from .locks import file_lock

RUN = "run"  # the column that says which run a row came from
MERGE_WAIT_S = 600.0  # a merge waits this long for another run's merge (each holds the lock for milliseconds)


def run_id() -> str:
    """A name for this run's rows: the local time, the process id and a random part (two runs of one process in
    one second differ), ``2026-11-29T10:04:05-12345-9f3a``."""
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S')}-{os.getpid()}-{secrets.token_hex(2)}"


def read_table(path: str | os.PathLike, columns: Sequence[str], what: str = "table",
               optional: Sequence[str] = ()) -> list[dict]:
    """The rows of a CSV table (``[]`` where there is none), as dicts of strings over ``columns`` (and
    :data:`RUN`, "" in a table written before rows were marked). A file whose header lacks ``columns`` (another
    file, a damaged one) is a ValueError naming it, and what is no regular file (a FIFO would block the open)
    is refused: before the work, a run calls this on the table it will add to. ``optional``: columns of
    ``columns`` that a table of an earlier release may lack ("" in its rows)."""
    path = Path(path)
    refuse_special(path)
    if not path.exists():
        return []
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            missing = [c for c in columns if c not in header and c not in optional]
            rows = [] if missing else [{c: row.get(c) or "" for c in [*columns, RUN]} for row in reader]
    except (UnicodeDecodeError, csv.Error) as error:
        raise ValueError(f"{path} is not a readable {what} ({type(error).__name__}): move it aside or choose "
                         "another folder") from None
    if missing:
        raise ValueError(f"{path} exists and is not a {what} of this countdown (no column {missing[0]!r}): move it "
                         "aside or choose another folder; its rows would be lost")
    return rows


def table_text(rows: Sequence[dict], columns: Sequence[str]) -> str:
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    writer.writerows({c: row.get(c, "") for c in columns} for row in rows)
    return buf.getvalue()


@contextlib.contextmanager
def adding_rows(table: str | os.PathLike, columns: Sequence[str], what: str = "table", option: str | None = None,
                wait: float = MERGE_WAIT_S, optional: Sequence[str] = ()) -> Iterator[tuple[Path, list]]:
    """Hold the lock of the CSV ``table`` and yield ``(work, added)``: write this run's files into the folder
    ``work`` (a report, a plot, the run's own version of the table: any file of the table's folder) and put
    this run's rows in the list ``added``. On a clean exit the table becomes the rows of earlier runs (read now,
    under the lock) plus ``added``, marked with :func:`run_id`, and every file written in ``work`` replaces its
    namesake in the table's folder atomically (:func:`countdown.io.files_into`): a run killed at any moment
    leaves the earlier rows in the table, never a table without them. ``optional``: as :func:`read_table`'s."""
    table = Path(table)
    run = run_id()
    with file_lock(table, wait=wait, what=what):
        earlier = read_table(table, columns, what, optional)
        with files_into(table.parent, what=what, option=option) as work:
            added: list = []
            yield work, added
            text = table_text([*earlier, *({**r, RUN: run} for r in added)], [*columns, RUN])
            with open(work / table.name, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)
