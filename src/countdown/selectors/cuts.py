"""Per-layer cuts on a score, estimated from calibration tokens, and their refit on the sparse model.

Every SP-Prac kind keeps a row when its score exceeds a per-layer cut (the threshold kinds' score is
the method's indicator itself; the predictors' a predicted logit; the shadow's ``|u~ act(g~)|``).
Two rules estimate the cut for a target k from the calibration tokens' scores:

* ``"mean-quantile"`` (the paper's tau-hat): the mean over tokens of the per-token cut that exactly
  ``kept_rows(d_inter, k)`` scores exceed;
* ``"pooled"``: the cut that a fraction ``n_keep / d_inter`` of all the tokens' scores together
  exceed (from a uniform sample of ``POOLED_SAMPLES`` of them per layer), so that the kept fraction
  over the calibration tokens is the target even when tokens' score scales differ.

:func:`refine_cuts` re-estimates every layer's cut with the model sparsified by the current cuts
(every position sparse), so each layer sees the inputs that sparse upstream layers produce, as at
run time. Dense-only cuts skip less than k once upstream layers are sparse (docs/prac.md).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..artifacts.store import Artifacts
from ..model.gated_mlp import GatedMLP
from ..sparse_methods.registry import Method, kept_rows
from ..patch.sparsify import sparsify, unsparsify, with_mode
from .stream import POOLED_SAMPLES, pooled_sample, stream_mlp_inputs, token_quantiles
from .base import get_kind, selectors_for

CUT_RULES = ("mean-quantile", "pooled")


def check_cut_rule(rule: str) -> str:
    if rule not in CUT_RULES:
        raise ValueError(f"unknown cut_rule {rule!r}: choose one of {', '.join(CUT_RULES)}")
    return rule


def pooled_cut(sample: torch.Tensor, skip: float) -> torch.Tensor:
    """The value that a fraction ``1 - skip`` of ``sample`` exceeds (-inf when nothing is skipped)."""
    if skip <= 0:
        return torch.tensor(-math.inf)
    return torch.quantile(sample.double(), skip, interpolation="linear").float()


class CutEstimator:
    """Streams scores of many layers and sparsities into cuts by one rule.

    ``n_keeps[i]``: rows kept per token at each k for layer ``i``; ``n_tokens``: the tokens the pass
    will see (it sizes the pooled sample); ``skips[i]``: the fraction of all values the pooled cut
    skips at each k (default ``1 - n_keep / d_inter``, the SP-Ideal fraction; the threshold kind
    uses k itself, the paper's definition). The pooled sample draws from one generator seeded 0,
    so the same pass gives the same cuts.
    """

    def __init__(self, n_keeps: list[list[int]], rule: str, n_tokens: int,
                 skips: list[list[float]] | None = None):
        self.n_keeps, self.rule, self.n_tokens, self.skips = n_keeps, check_cut_rule(rule), n_tokens, skips
        n_k = len(n_keeps[0]) if n_keeps else 0
        self.sums = torch.zeros(n_k, len(n_keeps), dtype=torch.float64)
        self.counts = torch.zeros(len(n_keeps), dtype=torch.float64)
        self.samples: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(n_keeps))}
        self.width: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(0)

    def add(self, layer: int, score: torch.Tensor) -> None:
        """Scores ``[tokens, d_inter]`` (float32) of one layer."""
        if self.rule == "mean-quantile":
            self.sums[:, layer] += token_quantiles(score, self.n_keeps[layer]).double().sum(dim=1).cpu()
        else:
            self.samples[layer].append(pooled_sample(score, self.n_tokens, self.gen))
        self.width[layer] = score.shape[-1]
        self.counts[layer] += score.shape[0]

    def cuts(self, layer: int) -> list[torch.Tensor]:
        """One 0-dim float32 cut per k for ``layer``."""
        if self.rule == "mean-quantile":
            return [(self.sums[j, layer] / self.counts[layer].clamp_min(1)).float()
                    for j in range(self.sums.shape[0])]
        sample = torch.cat(self.samples[layer])
        skips = (self.skips[layer] if self.skips is not None
                 else [1.0 - n / self.width[layer] for n in self.n_keeps[layer]])
        return [pooled_cut(sample, skip) for skip in skips]


def calibrated_cuts(score_rows: Callable[[int, int], torch.Tensor], n_rows: int, n_keeps: list[int],
                    chunk: int = 4096, rule: str = "mean-quantile") -> list[torch.Tensor]:
    """Cuts from captured tokens: ``score_rows(start, stop)`` gives the scores of tokens
    ``start:stop`` (chunked to bound RAM); one cut per ``n_keep``."""
    est = CutEstimator([n_keeps], rule, n_rows)
    for start in range(0, n_rows, chunk):
        est.add(0, score_rows(start, min(start + chunk, n_rows)))
    return est.cuts(0)


def refine_cuts(model: nn.Module, mlps: list[GatedMLP], method: Method, artifacts: Artifacts,
                windows: list[torch.Tensor], progress: bool = False, rule: str = "mean-quantile",
                batch_size: int = 4) -> None:
    """Re-estimate, in place, every layer's cut at every k of ``artifacts`` on the model sparsified
    with the current cuts (every position sparse), by ``rule``; only the cuts change."""
    kind = get_kind(artifacts.kind)
    by_cut = artifacts.with_selection(kind.cut_selection)
    n_tokens = sum(w.numel() for w in windows)
    for k in artifacts.sparsities:
        selectors = selectors_for(by_cut, mlps, method, k)
        for sel, mlp in zip(selectors, mlps):
            sel.to_model_dtype(mlp.w_down.dtype)
        est = CutEstimator([[kept_rows(mlp.d_inter, k)] for mlp in mlps], rule, n_tokens,
                           skips=[[k]] * len(mlps) if kind.pooled_at_k else None)
        sparsify(model, with_mode(method, "prac", by_cut), k, artifacts=by_cut, scope="all")
        try:
            with torch.no_grad():
                stream_mlp_inputs(model, mlps, windows, lambda i, x: est.add(i, selectors[i].score(x, mlps[i])),
                                  batch_size=batch_size, progress=progress, desc=f"refining cuts k={k:g}",
                                  allow_patched=True)
        finally:
            unsparsify(model)
        kind.set_cuts(artifacts, k, [est.cuts(i)[0] for i in range(len(mlps))])
