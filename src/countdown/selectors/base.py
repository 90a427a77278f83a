"""What every SP-Prac selector kind provides, and the registry that finds a kind by name.

A *kind* is one way of picking rows at run time without the method's exact indicator: a calibrated
threshold on the indicator itself (``threshold``), a trained or fitted predictor from ``x``
(``lowrank``, ``ternary``), a dense ``u`` plus a predicted gate (``hybrid``), a low-bit copy of the
weights (``shadow``). Each kind lives in one file of this package and owns four things:

* how it is built from the calibration text (:meth:`SelectorKind.fit`), which tensors that gives
  and which of them a loaded artifact must hold (:meth:`SelectorKind.check`);
* the run-time rule: a :class:`RowSelector` per layer (:meth:`SelectorKind.selectors`), whose
  ``score`` is what the per-layer cut applies to and whose ``kernel_forward`` is the GPU path;
* where its per-layer cuts live, so one refit routine serves every kind (:meth:`SelectorKind.set_cuts`;
  a kind with other cuts, teal's two per layer, refits them itself in :meth:`SelectorKind.refine`);
* the bytes a decode step reads through it (:meth:`SelectorKind.weight_bytes`), for rooflines.

The model code never asks which kind it runs (as torchao's quantize handlers or gpt-fast's
quant handlers): :func:`countdown.sparsify` calls ``kernel_forward`` or ``forward`` on whatever
selector the kind built. Adding a kind is one new file that calls :func:`register_kind`, and one
import line in ``countdown/selectors/__init__.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..artifacts.store import ArtifactError, Artifacts, check_artifacts, load_artifacts
from ..model.gated_mlp import GatedMLP
from ..options import check
from ..sparse_methods.registry import Method, get_method

# The kinds' numeric options and their ranges in countdown.options.RANGES (the same as the command line's)
KIND_OPTION_RANGES = {"d_rank": "d_rank", "epochs": "epochs", "pos_weight": "pos_weight", "bits": "bits",
                      "group": "group", "seed": "seed", "lr": "lr", "weight_decay": "weight_decay",
                      "batch_size": "batch_size", "max_activation_gb": "max_activation_gb",
                      "greedy_tokens": "refine_tokens", "step": "teal_step"}


class RowSelector(nn.Module):
    """One layer's run-time rule: ``forward(x, u, h)`` -> keep mask ``[tokens, d_inter]`` (bool).

    ``needs_up`` / ``needs_gate`` name the dense projections the rule reads (``u = x W_up^T``,
    ``h = act(x W_gate^T)``); the sparse forward computes exactly those densely and everything else
    only for kept rows.
    """

    needs_up: bool = False
    needs_gate: bool = False

    def forward(self, x: torch.Tensor, u: torch.Tensor | None, h: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def score(self, x: torch.Tensor, mlp: GatedMLP) -> torch.Tensor:
        """The float32 score ``[tokens, d_inter]`` that the layer's cut is compared against (for
        calibration and refits; higher means keep). Kinds without a cut raise."""
        raise NotImplementedError(f"{type(self).__name__} has no score with a cut")

    def to_model_dtype(self, dtype: torch.dtype) -> None:
        """Hold what the selector reads per token in the model's ``dtype`` where that helps."""

    def kernel_forward(self, x2: torch.Tensor, mlp: GatedMLP, w_down_t: torch.Tensor,
                       count: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The sparse MLP of ``x2 [tokens <= 8, d_model]`` through the Triton kernels.

        Default: the dense projections the rule needs, the keep mask in PyTorch, then the masked
        kernel (kept rows of W_gate / W_up / W_down only). Kinds with a fused kernel override it.
        ``w_down_t`` is ``W_down^T`` contiguous ``[d_inter, d_model]``. ``count`` = (kept, rows), the
        layer's Sparsity-Real counters: the kernel that keeps the rows adds them (kernels/jit_helpers.py add_count).
        """
        u = F.linear(x2, mlp.w_up) if self.needs_up else None
        h = mlp.act(F.linear(x2, mlp.w_gate)) if self.needs_gate else None
        keep = self(x2, u, h)
        return kernels.masked_gated_mlp(x2, mlp.w_gate, mlp.w_up, w_down_t, keep, mlp.act_name, count=count)

    def kernel_block(self, h2: torch.Tensor, mlp: GatedMLP, w_down_t: torch.Tensor, norm_w: torch.Tensor,
                     eps: float, count: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """``h2 + mlp(RMSNorm(h2))`` (the norm's weight and eps) by a kernel route that computes the norm and
        the residual add too (a folded decode layer, countdown.decode.layer.mlp_half), or None: the caller
        then runs the norm, :meth:`kernel_forward` and the add. Default None; the threshold kinds have one.
        ``count`` as :meth:`kernel_forward` takes it (added to only where the route runs)."""
        return None


def select(score: torch.Tensor, selection: str, cut: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Keep mask from a score ``[N, d_inter]`` by ``"logit"`` (> 0), ``"cut"`` (> cut) or ``"topk"``."""
    if selection == "logit":
        return score > 0
    if selection == "cut":
        return score > cut.to(score.dtype)
    idx = score.topk(n_keep, dim=-1, sorted=False).indices
    return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)


@dataclass
class FitContext:
    """Everything a kind's :meth:`SelectorKind.fit` may use.

    ``windows``: calibration token windows ``[1, <= window]``; ``opts``: the kind's resolved
    options (recorded in the artifact); ``checkpoint``: a folder for resumable per-layer fits or None.
    """

    model: nn.Module
    kind: str
    mlps: list[GatedMLP]
    method: Method
    ks: list[float]
    windows: list[torch.Tensor]
    opts: dict[str, Any]
    progress: bool = True
    checkpoint: Any = None
    extra_meta: dict[str, Any] = field(default_factory=dict)


class SelectorKind:
    """Base of the kinds. Subclasses set the class attributes and implement the methods."""

    name: str = ""
    methods: tuple[str, ...] = ()          # methods this kind serves
    selections: tuple[str, ...] = ()       # run-time rules it supports
    default_selection: str = ""
    cut_selection: str = "cut"             # the selection under which the stored cuts apply
    pooled_at_k: bool = False              # pooled cuts skip exactly k (else 1 - kept_rows / d_inter)
    default_tokens: int = 8192             # calibration tokens when the caller gives none
    defaults: dict[str, Any] = {}          # options and their defaults (what `prepare` accepts)
    # How a method spec (countdown.spec) writes the kind's options in brackets, besides ``key=value``:
    spec_number: str | None = None         # the option written as a number after the name (dual[shadow3]: bits)
    spec_number_shown: bool = False        # the label shows it at its default too (dual[shadow4])
    spec_letters: dict[str, str] = {}      # <letter><number> after that, per option (shadow: g64 -> group)
    choices: dict[str, tuple] = {}         # values an option may take, where the list is fixed (checked when parsed)

    def resolve_options(self, method: Method, mlps: list[GatedMLP], given: dict[str, Any]) -> dict[str, Any]:
        """The options this run uses: ``defaults`` updated by ``given``; unknown names are an error."""
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise TypeError(f"kind {self.name!r} takes no option(s) {', '.join(unknown)}; its options are "
                            f"{', '.join(sorted(self.defaults)) or 'none'}")
        opts = {**self.defaults, **given}
        for key, value in opts.items():  # the numbers of countdown.options' table, before any work
            if key in KIND_OPTION_RANGES and value is not None:
                opts[key] = check(KIND_OPTION_RANGES[key], value, key)
        return opts

    def fit(self, ctx: FitContext) -> dict[str, torch.Tensor]:
        """Every tensor of the artifact (all layers, all k), from the calibration text."""
        raise NotImplementedError

    def prepare_model(self, model: nn.Module, mlps: list[GatedMLP], options: dict[str, Any]):
        """Make the weights this kind runs on, in place, before an artifact (whose metadata ``options`` are) is
        checked against the model (:func:`countdown.sparsify` calls it; the mixed kind holds the MLPs in its nested
        format); returns a callable that undoes it (called where the patch then fails), or None: nothing changed
        (the default)."""
        return None

    def refine_rule(self, opts: dict[str, Any]) -> str:
        """The cut rule that refits use (see :mod:`countdown.selectors.cuts`)."""
        return opts["cut_rule"]

    def refine(self, model: nn.Module, mlps: list[GatedMLP], method: Method, artifacts: Artifacts,
               windows: list[torch.Tensor], progress: bool, opts: dict[str, Any]) -> bool:
        """Re-estimate the artifact's cuts on the sparsified model the kind's own way, in place, and return
        True; False (the default) leaves it to :func:`countdown.selectors.cuts.refine_cuts`, which refits the
        one per-row cut per layer that row kinds keep."""
        return False

    def meta(self, opts: dict[str, Any]) -> dict[str, Any]:
        """What the artifact's metadata records of this run's options (besides the common fields)."""
        return {"options": dict(opts)}

    def check(self, artifacts: Artifacts) -> None:
        """Raise :class:`~countdown.artifacts.store.ArtifactError` naming what a loaded artifact lacks."""

    def selectors(self, artifacts: Artifacts, mlps: list[GatedMLP], method: Method, k: float) -> list[RowSelector]:
        raise NotImplementedError

    def set_cuts(self, artifacts: Artifacts, k: float, cuts: list[torch.Tensor]) -> None:
        """Replace the per-layer cuts at sparsity ``k`` in place (refits)."""
        for i, cut in enumerate(cuts):
            artifacts.tensors[f"{artifacts.key(k)}/layer{i}/cut"] = cut.reshape(()).float().cpu()

    def weight_bytes(self, d_model: int, d_inter: int, kept: float, elem_bytes: int, meta: dict) -> float:
        """Bytes one token's decode step reads through this kind, per Gated-MLP, at kept fraction ``kept``."""
        raise NotImplementedError


KINDS: dict[str, SelectorKind] = {}

# The kind each method gets when none is named. dual's is the most accurate practical kind measured
# (results/prac_quality: 4-bit shadows within 3 % of dual SP-Ideal on SmolLM2-135M at k = 0.7 / 0.8, where
# the hybrid kind was 19 % / 18 % above it) that also reads fewer bytes than mono; dejavu has no u to use.
DEFAULT_KIND = {"cats": "threshold", "mono": "threshold", "dual": "shadow", "dejavu": "lowrank", "teal": "teal"}


def register_kind(kind: SelectorKind) -> SelectorKind:
    """Add a kind to the registry (its name must be new); returns it."""
    if kind.name in KINDS:
        raise ValueError(f"selector kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> SelectorKind:
    if name not in KINDS:
        raise ArtifactError(f"unknown selector kind {name!r} (known: {', '.join(KINDS)}); an artifact of another "
                            "countdown version? rebuild it with this one")
    return KINDS[name]


def kinds_for(method: str | Method) -> list[str]:
    """Names of the kinds that serve ``method``, in registry order."""
    m = get_method(method)
    return [name for name, kind in KINDS.items() if m.name in kind.methods]


def default_kind(method: str | Method) -> str:
    """The SP-Prac kind ``method`` gets when none is named (:data:`DEFAULT_KIND`)."""
    m = get_method(method)
    if m.prac is None:
        raise ValueError(f"method {m.name!r} has no SP-Prac artifacts (it skips nothing)")
    return DEFAULT_KIND[m.name]


def check_selection(kind: str, selection: str) -> str:
    """``selection`` if ``kind`` supports it, else a ValueError listing the ones it does."""
    allowed = get_kind(kind).selections
    if selection not in allowed:
        raise ValueError(f"selection {selection!r} does not apply to {kind} artifacts: choose one of "
                         f"{', '.join(allowed)}")
    return selection


def selectors_for(artifacts: Artifacts | str | os.PathLike, mlps: list[GatedMLP], method: str | Method,
                  k: float) -> list[RowSelector]:
    """One SP-Prac row selector per Gated-MLP (``find_gated_mlps`` order), after checking that the
    artifact (an :class:`~countdown.artifacts.store.Artifacts` or a path to one) fits this model, method
    and k; each on its layer's device."""
    if not isinstance(artifacts, Artifacts):
        artifacts = load_artifacts(artifacts)
    m = get_method(method)
    check_artifacts(artifacts, mlps, m, k)
    kind = get_kind(artifacts.kind)
    check_selection(kind.name, artifacts.selection)
    kind.check(artifacts)
    selectors = kind.selectors(artifacts, mlps, m, k)
    for sel, mlp in zip(selectors, mlps):
        sel.to(mlp.w_down.device)
    return selectors
