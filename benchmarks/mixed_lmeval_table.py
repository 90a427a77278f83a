"""The lm-eval table of dual[mixed] against dense and dense 4-bit MLPs (issue 58, item 4), from a sweep's files.

    PYTHONPATH=src python benchmarks/mixed_lmeval_table.py --out results/mixed/lmeval \\
        --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b [--limit 500]

Reads ``<out>/<model>.csv`` and ``.docs.csv`` of ``countdown sweep --methods 'dense,dense@mlp4g64,dual[mixed]'``
(docs/sweep.md) and prints, per model, one row per finished task and one for the mean over the finished tasks: each
configuration's score (acc_norm where lm-eval reports it, else acc) ± its standard error (sample standard deviation
of the per-document scores / sqrt(n)), and the paired differences dual[mixed] - dense and dual[mixed] - dense@mlp4g64
with their 95 % paired-bootstrap intervals (countdown.eval.sweep.stats: 2,000 resamples of the documents, within each
task, fixed seed). Then the two targets, read on the mean, each as measured and as tested: dual[mixed] within 1 point
of dense (shown at 95 % where the interval's lower end is above -1 point) and ahead of dense@mlp4g64 (significant
where the interval's lower end is above 0). A task is finished when all three
configurations have it; the mean is over those tasks only, and says how many.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from countdown.eval.sweep import read_rows
from countdown.eval.sweep.cells import lmeval_setting
from countdown.eval.sweep.stats import PairedTests, doc_outcomes
from countdown.eval.sweep.store import DOC_FIELDS
from countdown.eval.sweep.tables import task_scores

TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbookqa", "boolq", "lambada_openai")
DENSE, INT4, MIXED = ("dense", "", None), ("dense@mlp4g64", "", None), ("dual[mixed]", "prac", 0.9)
CONFIGS = (DENSE, INT4, MIXED)
MARGIN = 0.01  # "within 1 point of dense"


def _pm(value: float, se: float | None) -> str:
    return f"{100 * value:.1f} ± {100 * se:.1f}" if se is not None else f"{100 * value:.1f}"


def _diff(res: dict | None) -> str:
    if res is None:
        return "—"
    return f"{100 * res['diff']:+.1f} [{100 * res['lo']:+.1f}, {100 * res['hi']:+.1f}]"


def model_table(out: Path, model: str, limit: int | None) -> str:
    setting = lmeval_setting(limit, None)
    rows = [r for r in read_rows(out / f"{model}.csv") if r["setting"] == setting]
    docs = [r for r in read_rows(out / f"{model}.docs.csv", DOC_FIELDS) if r["setting"] == setting] \
        if (out / f"{model}.docs.csv").exists() else []
    scores = task_scores(rows)
    done = [t for t in TASKS if all(t in scores.get(c, {}) for c in CONFIGS)]
    left = [t for t in TASKS if t not in done]
    lines = [f"### {model}", ""]
    if not done:
        return "\n".join(lines + [f"Not finished yet: {', '.join(left)}.", ""])
    outcomes = doc_outcomes(docs, rows, done)
    head = ("| task | n | dense | dense@mlp4g64 | dual[mixed] k = 0.9 | dual[mixed] − dense [95 % CI] | "
            "dual[mixed] − dense@mlp4g64 [95 % CI] |")
    lines += [head, "|---|---|---|---|---|---|---|"]
    for task in done:
        tests = PairedTests(outcomes, [task])
        n = len(outcomes.get(DENSE, {}).get(task, {}))
        cells = [_pm(scores[c][task], tests.stderr(c)) for c in CONFIGS]
        lines.append(f"| {task} | {n} | " + " | ".join(cells) + f" | {_diff(tests.test(MIXED, DENSE))} | "
                     f"{_diff(tests.test(MIXED, INT4))} |")
    tests = PairedTests(outcomes, done)
    means = [sum(scores[c][t] for t in done) / len(done) for c in CONFIGS]
    label = "mean" if not left else f"mean of these {len(done)}"
    lines.append(f"| **{label}** | | " + " | ".join(_pm(m, tests.stderr(c)) for m, c in zip(means, CONFIGS))
                 + f" | {_diff(tests.test(MIXED, DENSE))} | {_diff(tests.test(MIXED, INT4))} |")
    lines.append("")
    vs_dense, vs_int4 = tests.test(MIXED, DENSE), tests.test(MIXED, INT4)
    if vs_dense is not None and vs_int4 is not None:
        lines.append(
            f"Targets on the mean of {len(done)} task(s). Within 1 point of dense: the difference is "
            f"{100 * vs_dense['diff']:+.1f} points ({'within' if vs_dense['diff'] > -MARGIN else 'not within'} 1 point "
            f"as measured); shown at 95 % only where the paired interval's lower end is above -1.0: "
            f"{100 * vs_dense['lo']:+.1f}, **{'shown' if vs_dense['lo'] > -MARGIN else 'not shown'}**. Ahead of "
            f"dense@mlp4g64: {100 * vs_int4['diff']:+.1f} points ({'ahead' if vs_int4['diff'] > 0 else 'not ahead'} "
            f"as measured); significant at 95 % only where the lower end is above 0: {100 * vs_int4['lo']:+.1f}, "
            f"**{'significant' if vs_int4['lo'] > 0 else 'not significant'}**.")
    if left:
        lines.append(f"Not finished yet: {', '.join(left)}.")
    return "\n".join(lines + [""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/mixed/lmeval")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    ap.add_argument("--limit", type=int, default=500)
    args = ap.parse_args()
    for model in args.models.split(","):
        if (Path(args.out) / f"{model}.csv").exists():
            print(model_table(Path(args.out), model, args.limit))
        else:
            print(f"### {model}\n\nNot started.\n")


if __name__ == "__main__":
    main()
