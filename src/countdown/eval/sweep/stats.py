"""Paired significance over per-document outcomes: standard errors and a paired bootstrap.

Every lm-eval cell of a sweep keeps its per-document scores (1/0 for a multiple-choice item,
``acc_norm`` where that is the task score) in ``<model>.docs.csv``. Two configurations were scored
on the same documents, so their difference is tested paired: the bootstrap resamples documents
(with replacement, within each task, the same draw for both configurations) and recomputes the
difference of the average over tasks. A claim "A > B" is significant at 95 % when the whole
two-sided 95 % percentile interval of ``A - B`` lies above the claim's margin (0 for a plain
ordering). Resampling uses a fixed seed, so a report is reproducible.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .store import decode_outcomes
from .tables import Config, config_of, score_metric

BOOTSTRAP_ITERS = 2000
LEVEL = 0.95
SEED = 0

Outcomes = dict  # {config: {task: {doc_id: score}}}


def doc_outcomes(doc_rows: Sequence[dict], rows: Sequence[dict], tasks: Sequence[str]) -> Outcomes:
    """Per-document task scores by configuration, for the task score metric each task reports in ``rows``."""
    metric_of = {}
    for task in tasks:
        metric_of[task] = score_metric({r["metric"] for r in rows if r["task"] == task})
    out: Outcomes = {}
    for r in doc_rows:
        if r["task"] in metric_of and r["metric"] == metric_of[r["task"]]:
            ids, values = decode_outcomes(r)
            out.setdefault(config_of(r), {})[r["task"]] = dict(zip(ids, values))
    return out


def stderr(outcomes: Outcomes, config: Config, tasks: Sequence[str]) -> float | None:
    """Standard error of a configuration's average over ``tasks``: sqrt(sum_t se_t^2) / T with
    se_t = sample std / sqrt(n_t) (tasks scored on independent documents); None if a task is missing."""
    per = outcomes.get(config, {})
    if not tasks or any(t not in per or len(per[t]) < 2 for t in tasks):
        return None
    ses = [np.std(list(per[t].values()), ddof=1) / math.sqrt(len(per[t])) for t in tasks]
    return float(math.sqrt(sum(s * s for s in ses)) / len(tasks))


def paired_bootstrap(outcomes: Outcomes, a: Config, b: Config, tasks: Sequence[str],
                     iters: int = BOOTSTRAP_ITERS, seed: int = SEED) -> dict | None:
    """Paired bootstrap of ``average(a) - average(b)`` over ``tasks`` on the documents both scored.

    Returns ``{"diff", "lo", "hi", "p", "n"}`` (the observed difference, the 95 % percentile interval,
    a two-sided bootstrap p-value for "no difference", the documents paired) or None when either
    configuration lacks per-document scores for a task.
    """
    pa, pb = outcomes.get(a, {}), outcomes.get(b, {})
    if not tasks or any(t not in pa or t not in pb for t in tasks):
        return None
    rng = np.random.default_rng(seed)
    diff, boot, n = 0.0, np.zeros(iters), 0
    for task in tasks:
        ids = sorted(set(pa[task]) & set(pb[task]))
        if not ids:
            return None
        d = np.array([pa[task][i] - pb[task][i] for i in ids])
        n += len(ids)
        diff += d.mean() / len(tasks)
        boot += d[rng.integers(0, len(d), size=(iters, len(d)))].mean(axis=1) / len(tasks)
    alpha = (1 - LEVEL) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    p = min(1.0, 2 * min(float(np.mean(boot <= 0)), float(np.mean(boot >= 0))))
    return {"diff": float(diff), "lo": float(lo), "hi": float(hi), "p": p, "n": n}


class PairedTests:
    """Cached :func:`paired_bootstrap` over one report's outcomes and tasks.

    ``test(a, b)`` -> the bootstrap dict or None; ``better(a, b, margin=0)`` -> True when
    ``a - b > margin`` is significant, False when it is not, None when it cannot be tested.
    """

    def __init__(self, outcomes: Outcomes, tasks: Sequence[str]):
        self.outcomes, self.tasks = outcomes, list(tasks)
        self._cache: dict = {}

    def __bool__(self) -> bool:
        return bool(self.outcomes)

    def test(self, a: Config, b: Config) -> dict | None:
        if (a, b) not in self._cache:
            self._cache[(a, b)] = paired_bootstrap(self.outcomes, a, b, self.tasks)
        return self._cache[(a, b)]

    def better(self, a: Config, b: Config, margin: float = 0.0) -> bool | None:
        res = self.test(a, b)
        return None if res is None else res["lo"] > margin

    def stderr(self, config: Config) -> float | None:
        return stderr(self.outcomes, config, self.tasks)


def describe(res: dict | None) -> str:
    """``"Δ +0.021, 95 % CI [+0.004, +0.038], p 0.01"`` for a bootstrap result."""
    if res is None:
        return "no per-document scores to test"
    return f"Δ {res['diff']:+.3f}, 95 % CI [{res['lo']:+.3f}, {res['hi']:+.3f}], p {res['p']:.3g}"
