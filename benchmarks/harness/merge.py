"""Operating points: the quality of each configuration on a real model joined with its speed at a
paper-scale shape, one table, plot and recommendation per model.

Quality comes from the CPU grid (:mod:`harness.qualitygrid`, ``<quality>/<model>.csv``), speed
from the one-compile decode benchmark (:mod:`harness.onecompile`, ``decode.csv``: Llama-3.1-8B
shape, random weights, batch 1); speed is decode tokens/s (steps/s, the prefill left out), tokens/s
columns too. A row's speed is read off its method's 8B-shape curve at the
Sparsity-Real the method reached ON THE REAL MODEL (linear interpolation between the kept fractions
timed; ``speed_sparsity_real`` says where, ``speed_note`` how): batch-1 speed depends on how many rows
are read, not on which (the benchmark's mask replay checks that). Out of the timed range by more than
:data:`EXTRAPOLATE` the speed is left empty. Decode speed-ups are against the fastest compiled dense
decoder of the speed run. Task scores come from the lm-eval sweep (``<sweep>/<model>.csv``) where it
has the cell: the mean score over the tasks that dense has at the sweep's most complete setting.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Callable, Sequence

EXTRAPOLATE = 0.02
SPEED_HARNESSES = ("one-compile", "one-compile-eager")  # the one-compile benchmark's rows (the second: its fallback)
OP_COLUMNS = ["model", "method", "sparsity", "sparsity_real", "ppl_increase", "kl", "decode_speedup", "device", "date",
              "kernel_us", "mlp_speedup", "task_score", "task_score_dense", "tasks", "top1", "ppl", "dense_ppl",
              "tokens_per_s", "dense_tokens_per_s", "speed_sparsity_real", "speed_note", "speed_run", "speed_config",
              "quality_date", "artifacts"]


def _float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def speed_curves(rows: list[dict], harnesses: Sequence[str] = SPEED_HARNESSES) -> dict[str, dict]:
    """Per method label: its rows of ``harnesses`` at batch 1 as points ``(sparsity_real, row)`` sorted,
    from the last run that has the method."""
    curves: dict[str, dict] = {}
    for r in rows:
        if r.get("harness") not in harnesses or str(r.get("batch")) != "1" or r["method"] == "dense":
            continue
        curve = curves.setdefault(r["method"], {"run": r["run"], "points": []})
        if curve["run"] != r["run"]:  # a later run of the same method replaces the earlier one
            curve.update(run=r["run"], points=[])
        curve["points"].append((float(r["sparsity_real"]), r))
    for curve in curves.values():
        curve["points"].sort(key=lambda p: p[0])
    return curves


def _interp(points: list[tuple[float, dict]], x: float, key: str):
    pts = [(s, _float(r.get(key))) for s, r in points if _float(r.get(key)) is not None]
    if not pts:
        return None
    if x <= pts[0][0]:
        return pts[0][1] if pts[0][0] - x <= EXTRAPOLATE else None
    if x >= pts[-1][0]:
        return pts[-1][1] if x - pts[-1][0] <= EXTRAPOLATE else None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def sweep_label(method_label: str) -> str:
    """The sweep's name of a bench spec: the plain method where the spec is its default kind
    (:func:`countdown.eval.sweep.cells.column_label`); a label that is no spec stays as it is."""
    from countdown.eval.sweep.cells import column_label

    try:
        return column_label(method_label)
    except ValueError:
        return method_label


def task_scores(path: Path) -> tuple[dict, float | None, list[str], dict]:
    """``({(sweep method, k): mean score}, dense mean, tasks, {sweep method: SP-Prac kind})`` from a
    sweep CSV (and the kinds from its ``.meta.json``), at its lm-eval setting with the most rows, over
    the tasks dense has there."""
    import json

    from countdown.eval.sweep.cells import AGREEMENT_TASK, PPL_TASKS
    from countdown.eval.sweep.tables import average_scores

    if not path.exists():
        return {}, None, [], {}
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["task"] not in PPL_TASKS and r["task"] != AGREEMENT_TASK]
    meta_path = path.with_name(path.stem + ".meta.json")
    kinds = {}
    if meta_path.exists():
        kinds = {label: a.get("kind") for label, a in (json.loads(meta_path.read_text()).get("artifacts") or {}).items()}
    settings: dict[str, int] = {}
    for r in rows:
        settings[r["setting"]] = settings.get(r["setting"], 0) + 1
    if not settings:
        return {}, None, [], kinds
    setting = max(settings, key=settings.get)
    rows = [r for r in rows if r["setting"] == setting]
    tasks = sorted({r["task"] for r in rows if r["method"] == "dense"})
    scores = average_scores(rows, tasks) if tasks else {}
    dense = scores.get(("dense", "", None))
    out = {(m, k): v for (m, mode, k), v in scores.items() if mode == "prac"}
    return out, dense, [f"{t} ({setting})" for t in tasks], kinds


def sweep_cell(method_label: str, kinds: dict) -> str | None:
    """The sweep's method whose SP-Prac artifacts were of the same method and kind as ``method_label``
    (its own spelling first: the sweep's plain ``dual`` was the hybrid kind before shadow became the
    default), or None."""
    from countdown.spec import parse_spec

    try:
        spec = parse_spec(method_label).resolved()
    except ValueError:
        return None
    own = sweep_label(method_label)
    candidates = [own] + [label for label in kinds if label.split("[")[0] == spec.method and label != own]
    return next((label for label in candidates if kinds.get(label) == spec.kind), None)


def merge_model(quality_rows: list[dict], curves: dict, runs: dict, scores=({}, None, [], {})) -> list[dict]:
    """The operating-point rows of one model (:data:`OP_COLUMNS`); ``runs``: :func:`run_metas`."""
    by_k, dense_score, tasks, kinds = scores
    out = []
    last = runs[max(runs)] if runs else {}
    for q in quality_rows:
        method = q["method"]
        speed_meta = runs.get(curves[method]["run"], last) if method in curves else last
        real = float(q["sparsity_real"] or 0)
        row = {"model": q["model"], "method": method, "sparsity": float(q["sparsity"] or 0), "sparsity_real": real,
               "ppl_increase": float(q["ppl_increase"]), "kl": float(q["kl"]), "top1": _float(q.get("top1")),
               "ppl": float(q["ppl"]), "dense_ppl": float(q["dense_ppl"]), "quality_date": q.get("date"),
               "artifacts": _short(q.get("artifacts", "")), "device": speed_meta.get("device", ""),
               "date": speed_meta.get("date", ""), "speed_run": speed_meta.get("run", ""),
               "speed_config": speed_meta.get("config", ""), "task_score_dense": dense_score,
               "tasks": "; ".join(tasks)}
        if method == "dense":
            row.update(decode_speedup=1.0, mlp_speedup=1.0 if speed_meta.get("dense_kernel_us") else None,
                       kernel_us=speed_meta.get("dense_kernel_us"),
                       tokens_per_s=speed_meta.get("dense_tokens_per_s"),
                       dense_tokens_per_s=speed_meta.get("dense_tokens_per_s"), task_score=dense_score,
                       speed_note="the reference: the fastest compiled dense decoder of the speed run")
        else:
            curve = curves.get(method)
            cell = sweep_cell(method, kinds)
            row["task_score"] = by_k.get((cell, row["sparsity"])) if cell else None
            if curve is None:
                row["speed_note"] = "no speed row for this method"
            else:
                pts = curve["points"]
                row.update(decode_speedup=_interp(pts, real, "decode_speedup_vs_compiled"),
                           kernel_us=_interp(pts, real, "kernel_us"), mlp_speedup=_interp(pts, real, "mlp_speedup"),
                           tokens_per_s=_interp(pts, real, "decode_tokens_per_s"),
                           dense_tokens_per_s=speed_meta.get("dense_tokens_per_s"), speed_sparsity_real=real)
                span = f"{pts[0][0]:.3f}-{pts[-1][0]:.3f}"
                row["speed_note"] = (f"interpolated at Sparsity-Real {real:.3f} between the kept fractions timed ({span})"
                                     if row["decode_speedup"] is not None else
                                     f"Sparsity-Real {real:.3f} outside the timed range {span}")
        out.append(row)
    return out


def run_metas(rows: list[dict], metas: list[dict]) -> dict[str, dict]:
    """Per run id: its metadata with the dense reference (the fastest compiled dense decoder's decode
    steps/s) and the dense MLP's time."""
    from .report import COMPILED_HARNESSES

    out = {}
    for meta in metas:
        run = meta.get("run")
        dense = [r for r in rows if r["run"] == run and r["method"] == "dense" and str(r.get("batch")) == "1"
                 and r.get("harness") in COMPILED_HARNESSES and _float(r.get("decode_tokens_per_s"))]
        kernel = [r for r in rows if r["run"] == run and r["method"] == "dense" and _float(r.get("kernel_us"))]
        out[run] = {**meta, "dense_tokens_per_s": max((float(r["decode_tokens_per_s"]) for r in dense), default=None),
                    "dense_kernel_us": float(kernel[0]["kernel_us"]) if kernel else None}
    return out


def merge_operating_points(speed_dirs: Sequence[str], quality_dir: str = "results/operating_points/quality",
                           out_dir: str = "results/operating_points", sweep_dir: str | None = "results/quality",
                           models: Sequence[str] | None = None, max_ppl_increase: float = 0.05,
                           harnesses: Sequence[str] = SPEED_HARNESSES, note: str = "",
                           log: Callable[[str], None] = print) -> dict[str, dict]:
    """Write ``<out>/<model>.csv`` / ``.md`` / ``.png`` for each model with a quality table; returns
    ``{model: paths and recommendation}``. ``harnesses``: whose rows make the speed curves (default the
    one-compile benchmark's; ``("compile-cdt",)`` reads the earlier per-compile runs); ``note``: a first
    line for the Markdown and the plot's title (e.g. that the speed is a trial's)."""
    from countdown.bench.opreport import write_operating_points
    from .qualitygrid import read_rows
    from .report import fill_references, read_runs

    rows, metas = read_runs(list(speed_dirs))
    fill_references(rows)
    curves = speed_curves(rows, harnesses)
    runs = run_metas(rows, metas)
    used = sorted({c["run"] for c in curves.values()})
    speed_meta = runs[used[-1]] if used else (runs[max(runs)] if runs else {})
    if models is None:
        models = sorted(p[:-4] for p in os.listdir(quality_dir) if p.endswith(".csv"))
    written = {}
    for model in models:
        quality = read_rows(Path(quality_dir) / f"{model}.csv")
        if not quality:
            log(f"{model}: no quality rows in {quality_dir}; skipped")
            continue
        scores = task_scores(Path(sweep_dir) / f"{model}.csv") if sweep_dir else ({}, None, [], {})
        merged = merge_model(quality, curves, runs, scores)
        merged.sort(key=lambda r: (_order(r["method"]), r["method"], r["sparsity"]))
        where = f" at the {speed_meta.get('config', '?')} decode speed on {speed_meta.get('device', '?')}"
        meta = {"model": model, "max_ppl_increase": max_ppl_increase, "where": where,
                "title": (f"{note.split(':')[0]}: " if note else "") + f"{model}: quality (CPU, XSum) vs decode speed\n"
                         f"({speed_meta.get('config')}, {speed_meta.get('device')}, batch 1)",
                "speed_label": "decode speed-up over the compiled dense decoder",
                "notes": ([f"**{note}**"] if note else []) + [f"quality: {model}, decode-style perplexity increase over dense and KL(dense || sparse) on "
                          "2,048 held-out XSum tokens (windows of 512, first half a dense prompt); SP-Prac artifacts "
                          "calibrated / trained on Wikipedia passages; CPU, fp32, "
                          f"{quality[0].get('date', '?')} (`benchmarks/operating_points.py quality`)",
                          f"speed: {speed_meta.get('config')} with random weights, bf16, batch 1, "
                          f"{speed_meta.get('device')}, {speed_meta.get('date')}; each row read off its method's "
                          "curve at the Sparsity-Real measured on the real model, in decode steps/s against the "
                          "fastest compiled dense decoder of the same run"] +
                         [f"speed run {run} ({', '.join(sorted(m for m, c in curves.items() if c['run'] == run))}; "
                          f"dense {_fmt(runs[run].get('dense_tokens_per_s'))} steps/s): `{runs[run].get('command', '')}`"
                          for run in used] +
                         [
                          "task score: mean lm-eval score over the sweep's tasks (results/quality), where the sweep "
                          "has the cell with the same method and SP-Prac kind"]}
        written[model] = write_operating_points(merged, out_dir, meta, max_ppl_increase, columns=OP_COLUMNS)
        log(f"{model}: {written[model]['recommendation']}")
    return written


ORDER = ("dense", "mono", "cats", "dual[shadow", "dual[hybrid", "dual[lowrank", "dejavu", "teal")


def _order(method: str) -> int:
    return next((i for i, prefix in enumerate(ORDER) if method.startswith(prefix)), len(ORDER))


def _short(artifacts: str) -> str:
    """``"shadow, 8192 tokens of countdown.data.texts... (Wikipedia passages)"`` -> ``"shadow, 8192 calibration tokens"``."""
    return artifacts.split(" tokens of ")[0] + " calibration tokens" if " tokens of " in artifacts else artifacts


def _fmt(value) -> str:
    return "-" if value is None else f"{float(value):.1f}"
