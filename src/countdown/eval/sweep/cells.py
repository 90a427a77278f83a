"""The grid of a sweep: its method specs (:mod:`countdown.spec`) as CSV labels, configurations, cells and their keys."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from ...spec import Spec, parse_spec, spec_parts
from .weights import check_weighted, split_weights

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
MODE_LABEL = {"ideal": "SP-Ideal", "prac": "SP-Prac"}


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


def column_label(spec: str | Spec) -> str:
    """What the CSV's method column holds for ``spec``'s SP-Prac configuration: the plain method where the
    spec is the method's default kind with default options (``dual[shadow4]`` -> ``dual``, as sweeps have
    always written it), the default kind's options without the kind (``teal[allocation=uniform]``), else the
    canonical label (``dual[hybrid]``, ``dual[shadow3]``)."""
    spec = parse_spec(spec)
    if spec.weights is not None:  # dense@mlp4g64 (countdown.eval.sweep.weights)
        return f"{column_label(replace(spec, weights=None))}@{spec.weights.label}"
    default = parse_spec(spec.method).resolved()
    if spec.is_dense or spec.resolved() == default:
        return spec.method
    label = spec.resolved().label
    if spec.resolved().kind == default.kind:  # the default kind with other options: written without the kind
        label = label.replace(f"[{default.kind},", "[", 1)
    return label


def parse_methods(methods: Sequence[str | Spec] | str) -> list[Spec]:
    """Every spec of ``methods`` (:func:`countdown.spec.parse_specs`), one per CSV label, order kept. An entry
    ``dense@mlp4g64`` is dense on other weights (:mod:`countdown.eval.sweep.weights`, in the spec's ``weights``)."""
    specs = []
    for entry in spec_parts(methods):
        text, weights = split_weights(entry) if isinstance(entry, str) else (entry, None)
        spec = parse_spec(text)
        if weights is not None:
            spec = replace(spec, weights=weights)
        check_weighted(spec)
        specs.append(spec)
    first: dict[str, Spec] = {}
    for spec in specs:
        first.setdefault(column_label(spec), spec)
    return list(first.values())


@dataclass(frozen=True)
class CellSpec:
    """One cell to measure. ``kind`` is ``"lmeval"``, ``"ppl"`` or ``"agreement"``; ``method`` is
    the CSV's label of the spec (:func:`column_label`: ``"dual[lowrank]"``)."""

    method: str
    mode: str  # "" for dense
    sparsity: float | None
    task: str
    kind: str
    setting: str
    artifacts: str = ""

    def key(self, model: str) -> tuple:
        return (model, self.method, self.mode, format_k(self.sparsity), self.task, self.setting, self.artifacts)

    def config(self) -> tuple:
        return (self.method, self.mode, self.sparsity)

    def label(self) -> str:
        if not self.mode:
            return f"{self.method} {self.task}"
        return f"{self.method} {self.mode} k={format_k(self.sparsity)} {self.task}"


def row_key(row: dict) -> tuple:
    return tuple(row[f] for f in KEY_FIELDS)


def short_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:10]


def lmeval_setting(limit, num_fewshot) -> str:
    text = f"limit={'all' if limit is None else limit}"
    return text if num_fewshot is None else f"{text};fewshot={num_fewshot}"


def ppl_setting(tokens: int, window: int, texts) -> str:
    source = "xsum" if texts is None else f"texts-{short_hash(list(texts))}"
    return f"tokens={tokens};window={window};text={source}"


def agreement_setting(prompts: list[str] | None, n_default: int, max_new_tokens: int) -> str:
    if prompts is None:
        return f"prompts={n_default};new_tokens={max_new_tokens}"
    return f"prompts={len(prompts)}-{short_hash(prompts)};new_tokens={max_new_tokens}"


def configurations(specs: Sequence[Spec], modes: Sequence[str],
                   sparsities: Sequence[float]) -> list[tuple[str, str, float | None]]:
    """``(label, mode, k)`` of every configuration, dense first (``label``: :func:`column_label`). SP-Ideal
    has no kinds: a kinded spec adds only SP-Prac configurations (its SP-Ideal is the plain method's)."""
    configs: list[tuple[str, str, float | None]] = []
    for label in dict.fromkeys(column_label(s) for s in specs if s.is_dense):  # dense, then dense@weights
        configs.append((label, "", None))
    for mode in modes:
        names = [column_label(s) if mode == "prac" else s.method for s in specs if not s.is_dense]
        for name in dict.fromkeys(names):
            configs.extend((name, mode, k) for k in sparsities)
    return configs


def plan_cells(methods: Sequence[str | Spec], modes: Sequence[str], sparsities: Sequence[float],
               tasks: Sequence[str], lmeval: str, ppl: str | None, agreement: str | None,
               artifacts_tag: str = "") -> list[CellSpec]:
    """Every cell of the sweep, configuration by configuration (dense first).

    Per configuration: each lm-eval task, then perplexity in both styles (if ``ppl``), then
    agreement (if ``agreement``; not for dense, whose agreement with itself is 1 by definition).
    """
    specs = parse_methods(methods)
    cells = []
    for method, mode, k in configurations(specs, modes, sparsities):
        tag = artifacts_tag if mode == "prac" else ""
        cells += [CellSpec(method, mode, k, task, "lmeval", lmeval, tag) for task in tasks]
        if ppl is not None:
            cells += [CellSpec(method, mode, k, task, "ppl", ppl, tag) for task in PPL_TASKS]
        if agreement is not None and mode:  # dense and dense@weights have no mode
            cells.append(CellSpec(method, mode, k, AGREEMENT_TASK, "agreement", agreement, tag))
    return cells
