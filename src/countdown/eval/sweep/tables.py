"""Numbers out of the sweep rows: task scores, averages, standard errors, the Table 1 layout."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .cells import AGREEMENT_TASK, MODE_LABEL, MODES, PPL_TASKS, format_k

SCORE_PREFERENCE = ("acc_norm", "acc", "exact_match,flexible-extract", "exact_match,strict-match", "exact_match")
TABLE_ORDER = ("dejavu", "cats", "mono", "dual")  # the paper's Table 1 row order

Config = tuple  # (method, mode, k): ("dense", "", None) or ("mono", "ideal", 0.8)


def config_of(row: dict) -> Config:
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
        by_cell.setdefault((config_of(r), r["task"]), {})[r["metric"]] = float(r["value"])
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
        if config_of(r) == config and r["task"] in tasks:
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
    return {config_of(r): float(r["value"]) for r in rows if r["task"] == task and r["metric"] == metric}


def mean_sparsity_real(rows: Sequence[dict], tasks: Sequence[str] | None = None) -> dict[Config, float]:
    """Mean Sparsity-Real per configuration over its lm-eval cells (one value per cell)."""
    per_cell: dict[tuple[Config, str], float] = {}
    for r in rows:
        if r["sparsity_real"] and r["task"] not in PPL_TASKS and r["task"] != AGREEMENT_TASK \
                and (tasks is None or r["task"] in tasks):
            per_cell[(config_of(r), r["task"])] = float(r["sparsity_real"])
    sums: dict[Config, list[float]] = {}
    for (config, _), value in per_cell.items():
        sums.setdefault(config, []).append(value)
    return {config: sum(v) / len(v) for config, v in sums.items()}


def ks_of(values: dict[Config, float]) -> list[float]:
    return sorted({c[2] for c in values if c[2] is not None})


def methods_in_order(values: dict[Config, float]) -> list[str]:
    present = {c[0] for c in values if c[1]}  # dense and dense@weights (mode "") are reference rows
    return [m for m in TABLE_ORDER if m in present] + sorted(present - set(TABLE_ORDER))


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def table1_markdown(values: dict[Config, float], higher_is_better: bool = True, digits: int = 3,
                    sparsity_real: dict[Config, float] | None = None,
                    stderr: dict[Config, float] | None = None,
                    significant: Callable[[Config, Config], bool | None] | None = None) -> str:
    """The paper's Table 1 layout for one quantity: a dense reference row, then per mode (SP-Ideal,
    SP-Prac) one row per method (dejavu, cats, mono, dual, then other specs), one column per k.

    The best method of each mode and k is in bold; with ``significant(best, other)`` given (a paired
    test), only where it is significantly better than every other method of its mode and k.
    ``stderr`` adds ``± se`` and ``sparsity_real`` the Sparsity-Real in brackets.
    """
    ks = ks_of(values)
    columns = [f"k={format_k(k)}" for k in ks] or ["value"]
    lines = ["| mode | method | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]

    def text_of(config, v):
        text = fmt(v, digits)
        if stderr and stderr.get(config) is not None:
            text += f" ± {stderr[config]:.{digits}f}"
        return text

    dense = values.get(("dense", "", None))
    if dense is not None:
        lines.append("| Dense | full | " + " | ".join(text_of(("dense", "", None), dense) for _ in columns) + " |")
    for config in sorted(c for c in values if not c[1] and c[0] != "dense"):  # dense on other weights: dense@mlp4g64
        lines.append(f"| Dense | {config[0]} | " + " | ".join(text_of(config, values[config]) for _ in columns) + " |")
    pick = max if higher_is_better else min
    for mode in MODES:
        methods = [m for m in methods_in_order(values) if any(c[:2] == (m, mode) for c in values)]
        best = {}
        for k in ks:
            measured = [(m, mode, k) for m in methods if (m, mode, k) in values]
            top = pick(measured, key=values.get, default=None)
            if top is None or len(measured) < 2:
                continue
            if significant is not None and not all(significant(top, other) for other in measured if other != top):
                continue
            best[k] = top
        for method in methods:
            cells = []
            for k in ks:
                config = (method, mode, k)
                v = values.get(config)
                text = text_of(config, v)
                if v is not None and best.get(k) is not None and values[best[k]] == v:
                    text = f"**{text}**"
                real = (sparsity_real or {}).get(config)
                if v is not None and real is not None:
                    text += f" ({real:.3f})"
                cells.append(text)
            lines.append(f"| {MODE_LABEL[mode]} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
