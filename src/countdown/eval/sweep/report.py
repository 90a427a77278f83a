"""The sweep's report: ``<model>.md`` (Table 1 layout, standard errors, tested orderings, perplexity,
agreement) and ``<model>.png`` (score against k), both written atomically."""

from __future__ import annotations

import datetime as _dt
import math
import os
from pathlib import Path
from typing import Sequence

from ...io import atomic_path, atomic_write
from .cells import AGREEMENT_METRICS, AGREEMENT_TASK, MODE_LABEL, MODES, PPL_TASKS, format_k, parse_methods, row_key
from .orderings import orderings, orderings_markdown
from .stats import PairedTests, doc_outcomes
from .tables import (TABLE_ORDER, Config, average_scores, config_of, fmt, mean_sparsity_real, methods_in_order,
                     metric_values, score_metric, table1_markdown, task_scores)
from .weights import weights_key

DENSE = ("dense", "", None)


def _ppl_cells(rows: Sequence[dict]):
    """Perplexity rows as demo.Cell objects, so demo's perplexity table and plot serve here too."""
    from ..grid import Cell

    cells = []
    for r in rows:
        if r["task"] in PPL_TASKS and r["metric"] == "perplexity":
            method, mode, k = config_of(r)
            cells.append(Cell(r["model"], method, mode or "—", k if k is not None else 0.0, PPL_TASKS[r["task"]],
                              float(r["value"]), float(r["sparsity_real"] or 0.0), int(r["n"] or 0),
                              float(r["seconds"] or 0.0)))
    return cells


def agreement_markdown(rows: Sequence[dict]) -> str:
    values: dict[Config, dict[str, float]] = {}
    for r in rows:
        if r["task"] == AGREEMENT_TASK:
            values.setdefault(config_of(r), {})[r["metric"]] = float(r["value"])
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
                     + " | ".join(fmt(v.get(m)) for m in AGREEMENT_METRICS) + " |")
    return "\n".join(lines)


def versus_dense_markdown(averages: dict[Config, float], tests: PairedTests, dense: Config = DENSE) -> str:
    """Each configuration's average minus ``dense``'s (dense, or dense on other weights: ``dense@mlp4g64``), with
    the paired 95 % interval; * = significant."""
    if dense not in averages or not tests:
        return ""
    lines = [f"| mode | method | k | score − {dense[0]} | 95 % CI | significant |", "|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(methods_in_order(averages))}
    for config in sorted((c for c in averages if c != dense),
                         key=lambda c: (MODES.index(c[1]) if c[1] in MODES else -1, order.get(c[0], 99), c[2] or 0,
                                        c[0])):
        res = tests.test(config, dense)
        if res is None:
            continue
        sig = res["lo"] > 0 or res["hi"] < 0
        mode = MODE_LABEL.get(config[1], "Dense")
        lines.append(f"| {mode} | {config[0]} | {format_k(config[2])} | {res['diff']:+.3f} | "
                     f"[{res['lo']:+.3f}, {res['hi']:+.3f}] | {'yes' if sig else 'no'} |")
    return "\n".join(lines) if len(lines) > 2 else ""


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
        dense = values.get(DENSE)
        if dense is not None:
            ax.axhline(dense, color="black", linestyle=":", label=f"dense ({dense:.3f})")
        for config in sorted(c for c in values if not c[1] and c != DENSE):  # dense on other weights
            ax.axhline(values[config], color="gray", linestyle="-.", label=f"{config[0]} ({values[config]:.3f})")
        for mode in MODES:
            for method in methods_in_order(values):
                pts = sorted((c[2], v) for c, v in values.items() if c[:2] == (method, mode))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            linestyle="-" if mode == "ideal" else "--", label=f"{method} ({MODE_LABEL[mode]})")
        ax.set_title(name)
        ax.set_xlabel("sparsity k")
        ax.set_ylabel("score")
        ax.grid(True, alpha=0.3)
    handles, _ = axes.flat[0].get_legend_handles_labels()
    if handles:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return Path(path)


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


def _own_weights(label: str, mode: str) -> bool:
    """Does the configuration run on weights of its own (``dense@mlp4g64``, ``dual[mixed]``)?"""
    try:
        return bool(weights_key(parse_methods([label])[0], mode))
    except ValueError:  # a label of an earlier file that no longer parses: as loaded
        return False


def _header(rows, model_name, tasks, info) -> list[str]:
    metrics_used = sorted({score_metric({r["metric"] for r in rows if r["task"] == t}) or "?" for t in tasks})
    limit = info.get("limit")
    md = [f"# Quality sweep: {model_name}", ""]
    if info.get("partial"):
        md += [f"**Partial report**: {info.get('measured_cells')} of {info.get('total_cells')} cells measured so far; "
               "configurations missing a task have no average. The sweep resumes with the command below.", ""]
    md += [f"- Date: {info.get('date', _dt.date.today().isoformat())}; device: {info.get('device', '?')}",
           f"- Command: `{info.get('command', '?')}`",
           f"- lm-eval tasks: {', '.join(tasks) or 'none'}; "
           f"{'all documents' if limit is None else f'first {limit} documents of each'}; "
           f"score = {' / '.join(metrics_used)} (acc_norm where lm-eval reports it, else acc); prompt dense, "
           "continuation sparse (countdown.eval.lmeval; all configurations of a task share each prompt's dense pass, "
           "countdown.eval.shared_prompt)"]
    own = sorted({r["method"] for r in rows if r["task"] in tasks and _own_weights(r["method"], r["mode"])})
    if own:
        md.append(f"- On weights of their own (countdown.eval.sweep.weights; each in a pass of its own, its prompts on "
                  f"those weights): {', '.join(own)}")
    splits = info.get("splits") or {}
    if tasks:
        md.append("- Data splits: " + "; ".join(f"{t}: {splits.get(t, '?')}" for t in tasks))
    if info.get("ppl_setting"):
        md.append(f"- Perplexity: {info['ppl_setting']} (XSum test articles unless named otherwise)")
    if info.get("agreement_setting"):
        md.append(f"- Agreement with dense: {info['agreement_setting']} (countdown.eval.agreement)")
    md += _calibration_lines(info.get("artifacts") or {})
    measured = sum(float(s) for s in {row_key(r): r["seconds"] for r in rows if r["seconds"]}.values())
    offline = "scored on" in str(info.get("device", ""))
    lm_cell = ("the GPU time of its configuration's continuation passes plus an even share of its task's dense "
               "prompt pass (transfers, model loading and the CPU's lm-eval replay excluded)"
               if offline else "its share of its task's shared pass")
    md.append(f"- Time: {measured:.0f} s measuring the {len({row_key(r) for r in rows})} cells of this report "
              f"(sum of the CSV's seconds, model loading excluded; an lm-eval cell's seconds are {lm_cell})")
    if offline:
        on_gpu = sum(float(s) for s in {row_key(r): r["seconds"] for r in rows
                                        if r["seconds"] and r["task"] in tasks}.values())
        md.append(f"  - of which lm-eval cells (GPU): {on_gpu:.0f} s; perplexity and agreement cells (CPU): "
                  f"{measured - on_gpu:.0f} s")
    if info.get("report_only") and info.get("measured_cells", 0) < info.get("total_cells", 0):
        md.append(f"- **Partial**: {info.get('measured_cells')} of {info.get('total_cells')} cells measured so "
                  "far (report written with --report-only; configurations missing a task have no average)")
    elif info.get("report_only"):
        md.append(f"- Report rewritten from the CSV (--report-only); all {info.get('total_cells')} cells measured")
    elif "run_seconds" in info:
        md.append(f"- Last run: {info.get('computed')} of {info.get('total_cells')} cells computed, "
                  f"{info['run_seconds']:.0f} s in all (cells already in the CSV are skipped)")
    return md


SIGNIFICANCE_NOTE = ("Significance: paired bootstrap over documents (2,000 resamples within each task, the same "
                     "documents for both configurations), 95 % percentile interval of the difference of the "
                     "averages; bold marks the best method of its mode and k only where it is significantly "
                     "better than every other method there. ± is the standard error of the average "
                     "(per-task sample standard errors, tasks independent).")


def write_report(rows: Sequence[dict], md_path: str | os.PathLike, png_path: str | os.PathLike,
                 model_name: str, tasks: Sequence[str] | None = None, info: dict | None = None,
                 doc_rows: Sequence[dict] | None = None) -> str:
    """Write the Markdown report and the score plot from sweep rows; returns the Markdown.

    doc_rows: the per-document side file's rows (:meth:`SweepStore.doc_rows`); with them the
    report gives standard errors, differences from dense and the paired tests of every ordering.
    """
    from ..grid import markdown_table as ppl_table
    from ..grid import plot as ppl_plot

    info = info or {}
    if tasks is None:
        tasks = list(dict.fromkeys(r["task"] for r in rows if r["task"] not in PPL_TASKS
                                   and r["task"] != AGREEMENT_TASK))
    scores = task_scores(rows)
    averages = average_scores(rows, tasks)
    real = mean_sparsity_real(rows, tasks)
    tests = PairedTests(doc_outcomes(doc_rows or [], rows, tasks), tasks)
    md = _header(rows, model_name, tasks, info)
    md += ["", "Sparsity-Real (fraction of rows actually skipped, mean over the tasks) in brackets.", ""]
    md += ["## Average score over tasks (the paper's Table 1 layout)", ""]
    se = {c: tests.stderr(c) for c in averages} if tests else None
    md += [table1_markdown(averages, sparsity_real=real, stderr=se,
                           significant=tests.better if tests else None), ""]
    if tests:
        md += [SIGNIFICANCE_NOTE, ""]
        vs = versus_dense_markdown(averages, tests)
        if vs:
            md += ["### Difference from dense (paired, same documents)", "", vs, ""]
        for other in sorted(c for c in averages if not c[1] and c != DENSE):  # dense on other weights
            vs = versus_dense_markdown(averages, tests, other)
            if vs:
                md += [f"### Difference from {other[0]} (paired, same documents)", "", vs, ""]
    else:
        md += ["No per-document scores for these cells: no standard errors or significance tests (bold = best "
               "point estimate only).", ""]
    md += ["### Orderings (computed from the averages above, each comparison tested where possible)", "",
           orderings_markdown(orderings(averages, tests=tests or None)), ""]
    for task in tasks:
        values = {c: per[task] for c, per in scores.items() if task in per}
        one = PairedTests(tests.outcomes, [task]) if tests else None
        md += [f"## {task}", "", table1_markdown(values, stderr={c: one.stderr(c) for c in values} if one else None,
                                                significant=one.better if one else None), ""]
        ppl = metric_values([r for r in rows if r["task"] == task], task, "perplexity")
        if ppl:
            md += [f"{task} perplexity of the target word (lm-eval's, lower is better):", "",
                   table1_markdown(ppl, higher_is_better=False, digits=2), ""]

    ppl_cells = _ppl_cells(rows)
    for task, style in PPL_TASKS.items():
        if any(c.style == style for c in ppl_cells):
            heading = ("every position sparse" if style == "all"
                       else "decode-style: first half of each window a dense prompt, loss on the sparse rest")
            values = metric_values(rows, task, "perplexity")
            md += [f"## Perplexity, {heading}", "", ppl_table(ppl_cells, style), "",
                   "Orderings (lower is better; one number per configuration, not tested):", "",
                   orderings_markdown(orderings(values, higher_is_better=False, beyond_paper=False)), ""]
    agree = agreement_markdown(rows)
    if agree:
        md += ["## Agreement with the dense model", "",
               "Greedy continuations of the dense and the sparse model (exact / prefix / token match), and "
               "teacher-forced KL(dense || sparse) in nats and top-1 agreement on the sparse positions.", "",
               agree, ""]
    text = "\n".join(md)
    atomic_write(md_path, text)
    plot_scores(rows, png_path, tasks, f"{model_name}: score against sparsity")
    if ppl_cells:
        png = Path(png_path)
        with atomic_path(png.with_name(f"{png.stem}-ppl.png"), suffix=".png") as tmp:
            ppl_plot(ppl_cells, tmp, f"{model_name}: perplexity against sparsity")
    return text
