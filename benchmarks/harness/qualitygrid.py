"""The quality half of the operating-point tables: every configuration x k on one real model (CPU).

Per model: the dense model's answer on held-out XSum once (:func:`countdown.bench.quality.held_out`),
then for each method spec its SP-Prac artifacts for every k at once through
:func:`countdown.artifacts.prepare.prepare` with ``cache_dir`` (cached and shared with the lm-eval sweep: an option at its
kind's default keys the same file as leaving it out, so ``dual[shadow4]`` here is the sweep's ``dual``), and per
k one decode-style pass (perplexity increase, KL, top-1 agreement, Sparsity-Real). Each finished cell
is merged into ``<out>/<model>.csv`` at once (atomically, under a lock), so a killed run resumes where
it stopped; a cell is redone only when its artifact changed (``artifact_tag``) or its text settings did.
A spec this library cannot run is refused when parsed (:func:`countdown.spec.parse_specs`, listing the
valid ones); one whose artifacts cannot be built on this model is skipped with the reason.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import io
import json
import re
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from countdown.sparse_methods.registry import get_method
from countdown.patch.sparsify import with_mode
from countdown.spec import parse_specs

QUALITY_COLUMNS = ["model", "method", "sparsity", "sparsity_real", "ppl", "dense_ppl", "ppl_increase", "kl", "top1",
                   "tokens", "window", "text", "artifacts", "artifact_tag", "seconds", "date", "device", "threads",
                   "torch"]
KEY = ("model", "method", "sparsity", "window", "text", "artifact_tag")
DEFAULT_SPECS = "mono,cats,dual,dual[hybrid],dual[lowrank],dejavu,teal"
DEFAULT_KS = (0.5, 0.6, 0.7, 0.8, 0.9)
MASK_K = 0.8  # masks recorded for the replay check (harness.maskreplay) at this k


def artifact_tag(art) -> str:
    """A short hash of an artifact's metadata: a rebuilt artifact gets another tag, so its cells are redone."""
    return hashlib.sha256(json.dumps(art.meta, sort_keys=True, default=str).encode()).hexdigest()[:10]


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _key(row: dict) -> tuple:
    return tuple(str(row[k]) if k != "sparsity" else f"{float(row[k] or 0):g}" for k in KEY)


def merge_rows(path: Path, new: list[dict]) -> None:
    """Merge ``new`` into the CSV at ``path`` (a row with the same key is replaced), atomically."""
    from countdown.io import atomic_write

    rows = {_key(r): r for r in read_rows(path)}
    for r in new:
        rows[_key(r)] = r
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=QUALITY_COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(sorted(rows.values(), key=lambda r: (r["method"] != "dense", r["method"], float(r["sparsity"] or 0))))
    atomic_write(path, buf.getvalue())


def _save_masks(path: Path, masks: torch.Tensor, meta: dict) -> None:
    import numpy as np

    from countdown.io import atomic_path

    packed = torch.from_numpy(np.packbits(masks.numpy().astype(bool), axis=-1))
    with atomic_path(path, suffix=".pt") as tmp:
        torch.save({"packed": packed, "shape": list(masks.shape), **meta}, tmp)


def run_quality_grid(model_name: str, specs: str | Sequence[str] = DEFAULT_SPECS, ks: Sequence[float] = DEFAULT_KS,
                     out_dir: str | Path = "results/operating_points/quality", max_tokens: int = 2048,
                     window: int = 512, artifacts_dir: str | Path | None = None, masks: bool = True,
                     model=None, tokenizer=None, texts: Sequence[str] | None = None, calib: dict | None = None,
                     log: Callable[[str], None] = print) -> Path:
    """Measure (or resume) every spec x k on ``model_name``; returns the CSV path. ``masks``: also
    save the keep masks of each spec at k = 0.8 under ``<out>/masks/`` for the replay check.
    ``model`` / ``tokenizer``: an already loaded model (else ``load_model(model_name)``); ``texts``:
    held-out text (default XSum); ``calib``: extra ``prepare`` options (calibration ``texts``,
    ``num_tokens``; they key another cached file)."""
    from countdown import load_model
    from countdown.io import file_lock
    from countdown.artifacts.prepare import prepare
    from countdown.patch.sparsify import sparsify, unsparsify
    from countdown.bench.quality import decode_quality, held_out

    from .maskreplay import record_masks

    out = Path(out_dir)
    label = model_name.replace("/", "_")
    path = out / f"{label}.csv"
    parsed = parse_specs(specs) if isinstance(specs, str) else parse_specs(list(specs))
    ks = sorted({round(float(k), 6) for k in ks})
    if artifacts_dir is None:
        from countdown.data.texts import cache_root

        artifacts_dir = cache_root() / "artifacts"
    with file_lock(path, what="quality table"):
        if model is None:
            model, tokenizer = load_model(model_name)
        model.eval()
        base = {"model": model_name, "window": window, "text": "xsum" if texts is None else "given", "date": datetime.date.today().isoformat(),
                "device": str(next(model.parameters()).device), "threads": torch.get_num_threads(),
                "torch": torch.__version__}
        start = time.perf_counter()
        held = held_out(model, tokenizer, texts=texts, max_tokens=max_tokens, window=window,
                        text_name="xsum" if texts is None else "given")
        log(f"{model_name}: dense decode-style perplexity {held.dense_ppl:.3f} on {held.scored} scored tokens "
            f"({time.perf_counter() - start:.0f} s)")
        merge_rows(path, [{**base, "method": "dense", "sparsity": 0.0, "sparsity_real": 0.0, "ppl": held.dense_ppl,
                           "dense_ppl": held.dense_ppl, "ppl_increase": 0.0, "kl": 0.0, "top1": 1.0,
                           "tokens": held.scored, "artifacts": "", "artifact_tag": "",
                           "seconds": round(time.perf_counter() - start, 1)}])
        for spec in parsed:
            if spec.is_dense:
                continue
            spec = spec.resolved()
            start = time.perf_counter()
            try:  # the spec's kind and options key the cached file (shared with the sweep's)
                art = prepare(model, tokenizer, spec, list(ks), cache_dir=artifacts_dir, progress=False,
                              **(calib or {}))
            except (TypeError, ValueError, NotImplementedError) as error:
                log(f"skipping {spec.label}: the library could not build its artifacts ({type(error).__name__}: "
                    f"{str(error)[:200]})")
                continue
            tag = artifact_tag(art)
            built = time.perf_counter() - start
            log(f"{model_name} {spec.label}: artifacts ready in {built:.0f} s ({art.kind}, "
                f"{art.meta['data'].get('num_tokens')} tokens of {art.meta['data'].get('name')}, tag {tag})")
            have = {_key(r) for r in read_rows(path)}
            for k in ks:
                row_key = _key({**base, "method": spec.label, "sparsity": k, "artifact_tag": tag})
                mask_path = out / "masks" / f"{label}-{re.sub(r'[^A-Za-z0-9._-]', '_', spec.label)}-k{k:g}.pt"
                # masks are row masks (d_inter per token): teal's input masks have another shape, not replayed
                want_masks = (masks and abs(k - MASK_K) < 1e-6 and not mask_path.exists()
                              and get_method(spec.method).structure == "rows")
                if row_key in have and not want_masks:
                    continue
                start = time.perf_counter()
                sparsify(model, with_mode(spec, "prac", art), k, artifacts=art, path="masked")
                try:
                    if want_masks:
                        _save_masks(mask_path, record_masks(model, held),
                                    {"model": model_name, "method": spec.label, "sparsity": k})
                    if row_key in have:
                        continue
                    q = decode_quality(model, held)
                finally:
                    unsparsify(model)
                row = {**base, "method": spec.label, "sparsity": k, "sparsity_real": round(q["sparsity_real"], 5),
                       "ppl": q["ppl"], "dense_ppl": held.dense_ppl, "ppl_increase": q["ppl_increase"], "kl": q["kl"],
                       "top1": q["top1"], "tokens": q["tokens"],
                       "artifacts": f"{art.kind}, {art.meta['data'].get('num_tokens')} tokens of "
                                    f"{art.meta['data'].get('name')}", "artifact_tag": tag,
                       "seconds": round(time.perf_counter() - start, 1)}
                merge_rows(path, [row])
                log(f"  {spec.label:16s} k={k:g}: ppl {q['ppl']:.3f} ({100 * q['ppl_increase']:+.1f} %), KL "
                    f"{q['kl']:.4f}, top-1 {q['top1']:.3f}, Sparsity-Real {q['sparsity_real']:.3f} ({row['seconds']:.0f} s)")
    return path
