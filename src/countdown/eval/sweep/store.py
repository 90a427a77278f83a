"""A sweep's files, written so that no concurrent run, kill or Ctrl-C loses a row.

Every write is a merge under a lock: :meth:`SweepStore.add` takes ``file_lock`` on ``<model>.csv``
(only for the merge, milliseconds), re-reads the CSV as it is now, adds or replaces this run's rows
by key, and replaces the file atomically (:mod:`countdown.io`). Two sweeps started together into
one folder (say one for dense, one for mono) therefore both proceed and both keep all their rows;
a run killed at any moment leaves the previous file intact. The per-document side file and the
meta file are merged the same way under the same lock.
"""

from __future__ import annotations

import contextlib
import csv
import io as _stdio
import json
import os
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ...io import atomic_write, file_lock, refuse_special, write_json
from .cells import CSV_FIELDS, KEY_FIELDS, row_key

DOC_FIELDS = [*KEY_FIELDS, "metric", "n", "doc_ids", "values"]
DEFAULT_WAIT = 60.0  # seconds a write waits for another run's merge (each merge holds the lock briefly)


def read_rows(path: str | os.PathLike, fields: Sequence[str] = CSV_FIELDS) -> list[dict]:
    """The rows of a sweep CSV as dicts of strings (``[]`` when the file does not exist)."""
    path = Path(path)
    refuse_special(path)  # a FIFO there would block the open below
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [f for f in fields if f not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} is not a sweep file of this version (missing columns {', '.join(missing)}): "
                             "move it aside or pass another out_dir")
        return [{f: row[f] for f in fields} for row in reader]


def csv_text(rows: Sequence[dict], fields: Sequence[str] = CSV_FIELDS) -> str:
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(fields), lineterminator="\r\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({f: row.get(f, "") for f in fields})
    return buf.getvalue()


def write_rows_atomic(path: str | os.PathLike, rows: Sequence[dict], fields: Sequence[str] = CSV_FIELDS) -> None:
    """Replace ``path`` with ``rows`` atomically (:func:`countdown.io.atomic_write`): a crash at any moment
    leaves the old file or the new one, never a torn one. Callers that share a folder merge first
    (:meth:`SweepStore.add`)."""
    atomic_write(path, csv_text(rows, fields))


def merge(old: Sequence[dict], new: Sequence[dict]) -> list[dict]:
    """``old`` with every row of ``new`` added, a row of the same (cell key, metric) replaced in place."""
    def key(r):
        return (*row_key(r), r["metric"])

    fresh = {key(r): r for r in new}
    out = [fresh.get(key(r), r) for r in old]
    replaced = {key(r) for r in old}
    return out + [r for k, r in fresh.items() if k not in replaced]


def encode_outcomes(samples: Sequence[tuple[int, float]]) -> tuple[str, str]:
    """``(doc_ids, values)`` cells of the side file: ids as ``"0-499"`` when contiguous, values with
    ``%.9g`` separated by spaces (``0``/``1`` for accuracies)."""
    ids = [int(i) for i, _ in samples]
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        id_text = f"{ids[0]}-{ids[-1]}"
    else:
        id_text = " ".join(map(str, ids))
    return id_text, " ".join(f"{float(v):.9g}" for _, v in samples)


def decode_outcomes(row: dict) -> tuple[list[int], list[float]]:
    """The inverse of :func:`encode_outcomes` for one side-file row."""
    text = row["doc_ids"].strip()
    if "-" in text and " " not in text:
        a, b = text.split("-")
        ids = list(range(int(a), int(b) + 1))
    else:
        ids = [int(t) for t in text.split()]
    values = [float(v) for v in row["values"].split()]
    if len(ids) != len(values):
        raise ValueError(f"per-document row {row_key(row)} {row['metric']}: {len(ids)} ids but {len(values)} values")
    return ids, values


class SweepStore:
    """The files of one model's sweep in ``out_dir``: ``<label>.csv`` (results), ``.docs.csv``
    (per-document outcomes of the lm-eval cells), ``.meta.json``, ``.md`` / ``.png`` (report).

    wait: seconds a write waits for the lock held by another run's merge (default 60).
    """

    def __init__(self, out_dir: str | os.PathLike, label: str, wait: float = DEFAULT_WAIT):
        self.dir = Path(out_dir)
        self.label = label
        self.wait = wait
        self.csv = self.dir / f"{label}.csv"
        self.docs = self.dir / f"{label}.docs.csv"
        self.meta_path = self.dir / f"{label}.meta.json"
        self.md = self.dir / f"{label}.md"
        self.png = self.dir / f"{label}.png"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with file_lock(self.csv, wait=self.wait, what="sweep table"):
            yield

    def rows(self) -> list[dict]:
        return read_rows(self.csv)

    def doc_rows(self) -> list[dict]:
        return read_rows(self.docs, DOC_FIELDS)

    def meta(self) -> dict:
        meta = {"runs": [], "artifacts": {}, "splits": {}}
        refuse_special(self.meta_path)
        if self.meta_path.exists():
            try:
                found = json.loads(self.meta_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                found = error
            if not isinstance(found, dict):  # never dropped in silence: the next write would lose what it held
                raise ValueError(f"{self.meta_path} is damaged (not a JSON object: {found}); move it aside (the "
                                 f"runs, artifacts and splits it lists are then not carried on) or restore it")
            meta.update(found)
        return meta

    def add(self, rows: Sequence[dict] = (), docs: Sequence[dict] = (),
            meta_update: Callable[[dict], None] | None = None) -> list[dict]:
        """Merge ``rows`` (and per-document ``docs``) into the files under the lock; returns all rows.
        ``meta_update(meta)`` edits the meta dict read under the same lock."""
        with self.locked():
            merged = merge(read_rows(self.csv), rows)
            if rows:
                write_rows_atomic(self.csv, merged)
            if docs:
                write_rows_atomic(self.docs, merge(read_rows(self.docs, DOC_FIELDS), docs), DOC_FIELDS)
            if meta_update is not None:
                meta = self.meta()
                meta_update(meta)
                write_json(self.meta_path, meta)
        return merged
