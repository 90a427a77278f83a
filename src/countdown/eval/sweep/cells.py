"""The grid of a sweep: method specs, configurations, cells and their CSV keys."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ...prac import kinds as _registered_kinds  # noqa: F401  (importing it fills the kind registry)
from ...prac.base import get_kind, kinds_for
from ...prac.prepare import DEFAULT_KIND
from ...registry import get_method

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

# A method's SP-Prac kinds come from countdown.prac's registry (kinds_for); a kind with a ``bits``
# option takes its bit width as a suffix (``dual[shadow4]``; no suffix: the kind's default).


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
class MethodSpec:
    """A method as the sweep names it: ``"mono"`` or ``"dual[lowrank]"``.

    ``method``: the registry name; ``label``: what the CSV's method column holds (the kind in
    brackets when it is not the method's default SP-Prac kind); ``options``: what the kind adds to
    the SP-Prac artifact options (``{"kind": "shadow", "bits": 4}``).
    """

    method: str
    label: str
    options: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def kinded(self) -> bool:
        return self.label != self.method


_SPEC = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*(?:\[\s*([A-Za-z]+)(\d*)\s*\])?\s*$")


def parse_method_spec(text: str) -> MethodSpec:
    """``"dual"``, ``"dual[hybrid]"``, ``"dual[lowrank]"``, ``"dual[shadow4]"`` -> :class:`MethodSpec`.

    The kinds a method takes are those of :mod:`countdown.prac`'s registry that serve it. A kind
    equal to the method's default (``dual[shadow]`` / ``dual[shadow4]``, ``mono[threshold]``) is the plain method.
    Unknown methods and kinds, a kind on dense, and bits on a kind without a ``bits`` option are
    ValueErrors naming the spec and the choices.
    """
    match = _SPEC.match(str(text))
    if not match:
        raise ValueError(f"cannot read the method spec {text!r}: write a method (mono) or a method and an "
                         "SP-Prac kind (dual[lowrank], dual[shadow4])")
    name, kind, bits = match.groups()
    method = get_method(name).name  # unknown method: the registry's error lists the methods
    if kind is None:
        return MethodSpec(method, method)
    kind = kind.lower()
    if get_method(method).prac is None:
        raise ValueError(f"{text!r}: {method} has no SP-Prac kinds (it skips nothing); write {method}")
    choices = kinds_for(method)
    if kind not in choices:
        shown = ", ".join(f"{c}<bits>" if "bits" in get_kind(c).defaults else c for c in choices)
        raise ValueError(f"unknown SP-Prac kind {kind!r} in {text!r}: {method} takes {shown} "
                         f"(e.g. {method}[{choices[-1]}])")
    defaults = get_kind(kind).defaults
    if bits and "bits" not in defaults:
        raise ValueError(f"{text!r}: only a kind with a bit width (shadow) takes a number; write {method}[{kind}]")
    if kind == DEFAULT_KIND.get(method) and (not bits or int(bits) == defaults.get("bits")):
        return MethodSpec(method, method)
    if "bits" in defaults:
        n_bits = int(bits) if bits else int(defaults["bits"])
        return MethodSpec(method, f"{method}[{kind}{n_bits}]", {"kind": kind, "bits": n_bits})
    return MethodSpec(method, f"{method}[{kind}]", {"kind": kind})


def parse_methods(methods: Sequence[str]) -> list[MethodSpec]:
    """Every spec of ``methods`` parsed, duplicates dropped, order kept."""
    specs = [parse_method_spec(m) for m in methods]
    return list({s.label: s for s in reversed(specs)}.values())[::-1]


@dataclass(frozen=True)
class CellSpec:
    """One cell to measure. ``kind`` is ``"lmeval"``, ``"ppl"`` or ``"agreement"``; ``method`` is
    the spec's label (``"dual[lowrank]"``)."""

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
        if self.method == "dense":
            return f"dense {self.task}"
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


def configurations(specs: Sequence[MethodSpec], modes: Sequence[str],
                   sparsities: Sequence[float]) -> list[tuple[str, str, float | None]]:
    """``(label, mode, k)`` of every configuration, dense first. SP-Ideal has no kinds: a kinded spec
    adds only SP-Prac configurations (its SP-Ideal is the plain method's)."""
    labels = [s.label for s in specs]
    configs: list[tuple[str, str, float | None]] = []
    if "dense" in labels:
        configs.append(("dense", "", None))
    for mode in modes:
        names = [s.label if mode == "prac" else s.method for s in specs if s.method != "dense"]
        for name in dict.fromkeys(names):
            configs.extend((name, mode, k) for k in sparsities)
    return configs


def plan_cells(methods: Sequence[str | MethodSpec], modes: Sequence[str], sparsities: Sequence[float],
               tasks: Sequence[str], lmeval: str, ppl: str | None, agreement: str | None,
               artifacts_tag: str = "") -> list[CellSpec]:
    """Every cell of the sweep, configuration by configuration (dense first).

    Per configuration: each lm-eval task, then perplexity in both styles (if ``ppl``), then
    agreement (if ``agreement``; not for dense, whose agreement with itself is 1 by definition).
    """
    specs = [m if isinstance(m, MethodSpec) else parse_method_spec(m) for m in methods]
    cells = []
    for method, mode, k in configurations(specs, modes, sparsities):
        tag = artifacts_tag if mode == "prac" else ""
        cells += [CellSpec(method, mode, k, task, "lmeval", lmeval, tag) for task in tasks]
        if ppl is not None:
            cells += [CellSpec(method, mode, k, task, "ppl", ppl, tag) for task in PPL_TASKS]
        if agreement is not None and method != "dense":
            cells.append(CellSpec(method, mode, k, AGREEMENT_TASK, "agreement", agreement, tag))
    return cells
