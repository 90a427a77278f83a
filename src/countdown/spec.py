"""Method specs and the configuration object: one string names a method configuration; parsed here, accepted
wherever a method is named; a :class:`Spec` carries it from the API to the saved file.

    spec := METHOD                                   dense, cats, mono, dual, dejavu, teal, or an alias (m-countdown)
          | METHOD "[" KIND [N] {L N} {"," KEY "=" VALUE} "]"

Every spec says by itself whether it is SP-Ideal or SP-Prac (:attr:`Spec.mode`): a plain METHOD is SP-Ideal
(the exact per-token top-k), brackets name an SP-Prac *kind* and its options. The kinds a method takes are those
of the kind registry that serve it (:func:`countdown.selectors.base.kinds_for`); each kind says how its options are
written (:class:`countdown.selectors.base.SelectorKind`: ``spec_number``, ``spec_letters``), any option of it
(``get_kind(kind).defaults``) may be written ``KEY=VALUE``, so a new kind needs no edit here::

    dual[shadow4]       4-bit shadows of W_gate and W_up  (dual[shadow3g32]: 3 bits, groups of 32)
    dual[hybrid]        dense u + a low-rank gate estimate (dual[hybrid64]: rank 64)
    dual[lowrank]       the paper's low-rank predictor     (dual[lowrank256]; dejavu[lowrank])
    dual[ternary]       the paper's ternary predictor
    mono[threshold]     the calibrated threshold            (mono[rule=pooled]: the method's only kind, implied)
    dual[shadow4,cut_rule=pooled]   teal[allocation=uniform]

Labels (:attr:`Spec.label`) print one way per configuration: the registry's method name; the kind, always, for
SP-Prac (``mono[rule=pooled]`` prints ``mono[threshold,rule=pooled]``); the kind's number when given (shadow's
bits always: ``dual[shadow]`` prints ``dual[shadow4]``); other options only where they differ from the kind's
defaults, letters first, then ``key=value`` sorted. :meth:`Spec.resolved` names the default kind of a plain
method (``dual`` -> ``dual[shadow4]``, ``dejavu`` -> ``dejavu[lowrank]``). Labels of earlier result files still
parse (:data:`LEGACY`), and so does the ``mode=`` of earlier releases (:func:`with_mode`, deprecated).

Beside the method part, a :class:`Spec` may carry the sparsity ``k``, the ``scope`` and the weight format ``weights``
(:class:`WeightFormat`, what :func:`countdown.quantize` made): ``Spec.of(model)`` is the whole configuration of a
model, the object :func:`countdown.save` writes into config.json (:mod:`countdown.model.saving`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from .artifacts.store import ArtifactMismatchError, Artifacts
from .selectors.base import KINDS, default_kind, get_kind, kinds_for
from .sparse_methods.registry import Method, check_sparsity, get_method, methods
from .patch.state import STATE_ATTR

MODES = ("ideal", "prac")
SCOPES = ("decode", "all")
DEFAULT_SCOPE = "decode"

# Labels in committed result files (benchmarks/prac_quality.py's table) -> the spec they meant.
LEGACY = {
    "dual[shadow4-g32]": "dual[shadow4g32]",
    "dual[shadow4-pooled]": "dual[shadow4,cut_rule=pooled]",
    "teal[greedy]": "teal[teal]",  # TEAL's greedy allocation: the teal kind's default
    "teal[uniform]": "teal[allocation=uniform]",
}
# Labels of result files that are no library configuration, and why.
NOT_SPECS = {
    "dual[shadow4-s]": "an experiment of benchmarks/prac_quality.py (the kept rows' coefficients taken from the "
                       "shadows), not a library configuration; the library's is dual[shadow4]",
}
_SPEC = re.compile(r"^([a-z][\w-]*)(?:\[(.*)\])?$")
_TERM = re.compile(r"^(\d+)?((?:[a-z]\d+)*)$")


@dataclass(frozen=True)
class WeightFormat:
    """The weight format :func:`countdown.quantize` made: ``bits`` per weight in groups of ``group`` columns with a
    scale and an offset each (``scale_dtype``), from ``source`` ("rtn": rounded to nearest; "gguf": the GGUF file's
    own blocks), the output projection too where ``lm_head``.
    ``record`` is :func:`countdown.quantize`'s own record (``model.config.countdown_int4``: which modules, how
    many), kept as it is for the file (not compared)."""

    bits: int = 4
    group: int = 128
    source: str = "rtn"
    scale_dtype: str = "float16"
    lm_head: bool = False
    record: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def from_record(cls, record: dict | None) -> WeightFormat | None:
        """The format of a ``countdown_int4`` record (None: not quantized)."""
        if not record:
            return None
        return cls(bits=4, group=int(record.get("rtn_group", 128)), source=record.get("source", "rtn"),
                   scale_dtype=record.get("rtn_scale_dtype", "float16"), lm_head=bool(record.get("lm_head", False)),
                   record=dict(record))

    def __str__(self) -> str:
        how = f"groups of {self.group}" if self.source == "rtn" else f"{self.source} blocks"
        return f"int{self.bits} ({how}, {self.scale_dtype} scales{', lm_head' if self.lm_head else ''})"


@dataclass(frozen=True)
class Spec:
    """One configuration. The method part: ``method`` (a registry name), ``kind`` (an SP-Prac kind, or None: SP-Ideal),
    ``options`` (the kind's options the spec writes; read-only) and ``label`` (their canonical text, see the module
    docstring); where set, ``k`` (the fraction of rows skipped), ``scope`` ("decode": the prompt dense; "all") and
    ``weights`` (the :class:`WeightFormat` of a quantized model). Make one with :func:`parse_spec`; ``str()`` is the
    label, :attr:`mode` says SP-Ideal or SP-Prac, ``Spec.of(model)`` is a model's."""

    method: str
    kind: str | None = None
    options: dict = field(default_factory=dict, compare=False, hash=False)
    label: str = ""
    k: float | None = None
    scope: str | None = None
    weights: WeightFormat | None = None

    def __post_init__(self):
        if not self.label:
            object.__setattr__(self, "label", _label(self.method, self.kind, self.options))

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        rest = [f"{name}={getattr(self, name)!r}" for name in ("k", "scope") if getattr(self, name) is not None]
        if self.weights is not None:
            rest.append(f"weights={str(self.weights)!r}")
        return f"Spec({', '.join([repr(self.label), *rest])})"

    @property
    def mode(self) -> str:
        """``"prac"`` where the spec names an SP-Prac kind, else ``"ideal"`` (dense too)."""
        return "ideal" if self.kind is None else "prac"

    @property
    def is_dense(self) -> bool:
        return self.method == "dense"

    @property
    def slug(self) -> str:
        """The label as a file-name part: ``dual[shadow4]`` -> ``dual-shadow4``."""
        return re.sub(r"[^a-z0-9._=-]+", "-", self.label).strip("-")

    @property
    def roofline_kind(self) -> str:
        """The ``countdown.eval.cost.mlp_weight_bytes`` kind of this spec."""
        if self.is_dense or self.method in ("mono", "cats", "teal"):
            return self.method
        return self.kind or "lowrank"

    @classmethod
    def of(cls, model) -> Spec:
        """The whole configuration of ``model``: its sparsity (the spec :func:`countdown.sparsify` was given, with
        its k and scope; ``dense`` where it is not sparsified) and its weight format (:func:`countdown.quantize`)."""
        state = getattr(model, STATE_ATTR, None)
        spec = Spec("dense") if state is None else \
            replace(state.spec, k=state.sparsity, scope=state.scope if not state.method.is_dense else None)
        record = getattr(getattr(model, "config", None), "countdown_int4", None)
        return replace(spec, weights=WeightFormat.from_record(record))

    def at(self, k: float | None = None, scope: str | None = None, weights: WeightFormat | None = None) -> Spec:
        """This spec with ``k``, ``scope`` and ``weights`` set where given (checked: k in (0, 1), scope of
        :data:`SCOPES`)."""
        changes: dict[str, Any] = {}
        if k is not None:
            changes["k"] = check_sparsity(k)
        if scope is not None:
            if scope not in SCOPES:
                raise ValueError(f"unknown scope {scope!r}: choose one of {', '.join(SCOPES)}")
            changes["scope"] = scope
        if weights is not None:
            changes["weights"] = weights
        return replace(self, **changes) if changes else self

    def resolved(self) -> Spec:
        """This spec with the method's default kind named where it names none (``dual`` -> ``dual[shadow4]``)."""
        if self.kind is not None or get_method(self.method).prac is None:
            return self
        return self._keep(_make(self.method, default_kind(self.method), dict(self.options), self.label))

    def with_options(self, **options: Any) -> Spec:
        """The same kind (the default one for a plain method) with ``options`` added or replaced."""
        spec = self.resolved()
        return self._keep(_make(spec.method, spec.kind, {**spec.options, **options}, spec.label))

    def _keep(self, other: Spec) -> Spec:
        """``other``'s method part with this spec's k, scope and weights."""
        return replace(other, k=self.k, scope=self.scope, weights=self.weights)


def parse_spec(text: str | Spec | Method, k: float | None = None, scope: str | None = None) -> Spec:
    """``"dual[shadow4]"`` -> ``Spec("dual", "shadow", {"bits": 4}, "dual[shadow4]")`` (module docstring: the
    grammar); ``k`` and ``scope`` set where given (:meth:`Spec.at`). A :class:`Spec` is returned as it is, a
    :class:`~countdown.sparse_methods.registry.Method` as its plain spec. What the library cannot run is a ValueError that lists
    the valid specs."""
    if k is not None or scope is not None:
        return parse_spec(text).at(k, scope)
    if isinstance(text, Spec):
        return text
    if isinstance(text, Method):
        return Spec(text.name)
    if not isinstance(text, str):
        raise TypeError(f"a method spec is a string such as 'mono' or 'dual[shadow4]', got {type(text).__name__}")
    written = re.sub(r"\s*([\[\],=])\s*", r"\1", text.strip()).lower()  # spaces around [ ] , = go
    if written in NOT_SPECS:
        raise ValueError(f"{text!r} is {NOT_SPECS[written]}")
    written = LEGACY.get(written, written)
    match = _SPEC.match(written)
    if not match:
        raise ValueError(f"cannot read the method spec {text!r}: write a method or a method and an SP-Prac kind "
                         f"in brackets; {_valid()}")
    name, body = match.groups()
    try:
        method = get_method(name)
    except ValueError:
        raise ValueError(f"unknown method {name!r} in {text!r}; {_valid()}") from None
    if body is None:
        return Spec(method.name)
    if method.prac is None:
        raise ValueError(f"{text!r}: {method.name} has no SP-Prac kinds (it skips nothing); write {method.name}")
    return _parse_body(text, method.name, body)


def spec_parts(text: str | Spec | list) -> list:
    """The entries of a comma-separated list (commas inside brackets belong to their spec) or of a list of specs,
    unparsed; none is a ValueError."""
    if isinstance(text, str):
        parts = [p for p in re.split(r",(?![^\[]*\])", text) if p.strip()]
    else:
        parts = [text] if isinstance(text, Spec) else list(text)
    if not parts:
        raise ValueError("give at least one method spec, e.g. mono,dual[shadow4]")
    return parts


def parse_specs(text: str | Spec | list) -> list[Spec]:
    """A comma-separated list (commas inside brackets belong to their spec) or a list of specs; duplicates
    dropped, order kept."""
    specs: list[Spec] = []
    for part in spec_parts(text):
        spec = parse_spec(part)
        if spec not in specs:
            specs.append(spec)
    return specs


def spec_forms(method: str | None = None) -> list[str]:
    """The forms of the valid specs (of ``method``, else of every method): ``dual``, ``dual[shadow<bits>]``..."""
    forms = []
    for name in [get_method(method).name] if method else methods():
        forms.append(name)
        kinds = kinds_for(name) if get_method(name).prac else []
        for kind_name in kinds:
            kind = get_kind(kind_name)
            number = f"<{kind.spec_number}>" if kind.spec_number else ""
            if len(kinds) > 1 or number:
                forms.append(f"{name}[{kind_name}{number}]")
    return forms


def _valid() -> str:
    return (f"valid specs: {', '.join(spec_forms())} (and KEY=VALUE options of the kind in the brackets, "
            "e.g. dual[shadow4,cut_rule=pooled]; `countdown methods` lists them)")


def _kind_forms(method: str) -> str:
    """``dual[shadow<bits>], dual[hybrid<d_rank>], ...``: every kind of ``method``, named."""
    forms = []
    for kind_name in kinds_for(method):
        number = get_kind(kind_name).spec_number
        forms.append(f"{method}[{kind_name}{f'<{number}>' if number else ''}]")
    return ", ".join(forms)


def _parse_body(text: str, method: str, body: str) -> Spec:
    items = body.split(",")
    if any(not item for item in items):
        raise ValueError(f"cannot read the method spec {text!r}: an empty item in the brackets; {_valid()}")
    choices = kinds_for(method)
    options: dict[str, Any] = {}
    if "=" in items[0]:  # no kind written: the method's only one
        if len(choices) != 1:
            raise ValueError(f"{text!r}: name the SP-Prac kind first, e.g. {method}[{choices[0]},{items[0]}]; "
                             f"{method} takes {_kind_forms(method)}")
        kind = choices[0]
    else:
        term = items.pop(0)
        kind = next((c for c in sorted(choices, key=len, reverse=True) if term.startswith(c)), None)
        match = _TERM.match(term[len(kind):]) if kind else None
        if kind is None or match is None:
            known = [c for c in KINDS if term.startswith(c)]
            why = (f"kind {known[0]!r} serves {' and '.join(get_kind(known[0]).methods)} only" if known and not kind
                   else f"no SP-Prac kind {term!r}")
            raise ValueError(f"{text!r}: {why}; {method} takes {_kind_forms(method)}")
        number, letters = match.groups()
        spec_kind = get_kind(kind)
        if number is not None:
            if not spec_kind.spec_number:
                raise ValueError(f"{text!r}: kind {kind} takes no number; write {method}[{kind}]")
            options[spec_kind.spec_number] = int(number)
        for letter, value in re.findall(r"([a-z])(\d+)", letters or ""):
            if letter not in spec_kind.spec_letters:
                allowed = ", ".join(f"{k}<{v}>" for k, v in spec_kind.spec_letters.items()) or "none"
                raise ValueError(f"{text!r}: kind {kind} takes no {letter}<number> (its letters: {allowed})")
            options[spec_kind.spec_letters[letter]] = int(value)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{text!r}: {item!r} is no KEY=VALUE option (e.g. {method}[{kind},cut_rule=pooled])")
        if key in options:
            raise ValueError(f"{text!r}: option {key} is given twice")
        options[key] = _value(value, get_kind(kind).defaults.get(key))
    return _make(method, kind, options, text)


def _value(text: str, default: Any) -> Any:
    if text == "none":
        return None
    if text in ("true", "false"):
        return text == "true"
    try:
        number = float(text) if isinstance(default, float) else int(text)
        return number
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _fmt(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _make(method: str, kind: str, options: dict, written: str) -> Spec:
    """The canonical spec of ``kind`` of ``method`` with ``options``: names and values checked, defaults
    left out (the kind's number kept when given, filled in where the label always shows it)."""
    spec_kind = get_kind(kind)
    unknown = sorted(set(options) - set(spec_kind.defaults))
    if unknown:
        raise ValueError(f"{written!r}: kind {kind} takes no option {', '.join(unknown)}; its options are "
                         f"{', '.join(sorted(spec_kind.defaults)) or 'none'}")
    for key, value in options.items():
        allowed = spec_kind.choices.get(key)
        if allowed is not None and value not in allowed:
            raise ValueError(f"{written!r}: {key}={_fmt(value)} is not one of {', '.join(map(_fmt, allowed))}")
    number = spec_kind.spec_number
    kept = {key: value for key, value in options.items()
            if key == number or value != spec_kind.defaults.get(key)}
    if number and spec_kind.spec_number_shown:
        kept.setdefault(number, spec_kind.defaults[number])
    return Spec(method, kind, kept)


def _label(method: str, kind: str | None, options: dict) -> str:
    if kind is None:
        return method
    spec_kind = get_kind(kind)
    rest = dict(options)
    term = kind
    if spec_kind.spec_number and spec_kind.spec_number in rest:
        term += _fmt(rest.pop(spec_kind.spec_number))
    for letter, name in spec_kind.spec_letters.items():
        if name in rest:
            term += letter + _fmt(rest.pop(name))
    items = [f"{key}={_fmt(value)}" for key, value in sorted(rest.items())]
    return f"{method}[{','.join([term, *items])}]"


# --------------------------------------------------------------------------------------------
# What the entry points do with a spec: the mode, build options, and an artifact's fit
# --------------------------------------------------------------------------------------------


def resolve_mode(spec: str | Spec | Method, mode: str | None) -> str:
    """The mode to run ``spec`` in: ``mode`` as given, else the spec's own (:attr:`Spec.mode`). ``mode="ideal"``
    with a kind is refused (SP-Ideal has no kinds)."""
    spec = parse_spec(spec)
    if mode is None:
        return spec.mode
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "ideal" and spec.kind is not None:
        raise ValueError(f"{spec.label!r} names an SP-Prac kind ({spec.kind}), which implies mode='prac'; SP-Ideal "
                         f"(the exact per-token top-k) has no kinds: write {spec.method!r} for SP-Ideal, or drop "
                         "mode='ideal' (--mode ideal)")
    return mode


def build_options(spec: str | Spec | Method, kind: str | None, options: dict) -> tuple[str, str | None, dict]:
    """``(method, kind, options)`` to build ``spec``'s artifact: the kind and options in its brackets, with an
    explicit ``kind`` / option that agrees; one that disagrees is refused naming both."""
    spec = parse_spec(spec)
    if kind is not None and spec.kind is not None and kind != spec.kind:
        raise ValueError(f"{spec.label!r} names SP-Prac kind {spec.kind!r} but kind={kind!r} was given: drop kind= "
                         f"(--kind), or write {spec.method}[{kind}]")
    out = dict(options)
    for key, value in spec.options.items():
        if key in out and out[key] != value:
            raise ValueError(f"{spec.label!r} says {key}={_fmt(value)} but {key}={out[key]!r} was given: drop one")
        out[key] = value
    return spec.method, kind if kind is not None else spec.kind, out


def _recorded(meta: dict, kind) -> dict:
    """The kind's options an artifact's metadata records (kinds keep them at the top, under ``training``
    or under ``options``)."""
    found = {**(meta.get("options") or {}), **(meta.get("training") or {})}
    found.update({key: meta[key] for key in kind.defaults if key in meta})
    return {key: value for key, value in found.items() if key in kind.defaults and value is not None}


def artifact_spec(artifacts: Artifacts | dict) -> Spec:
    """The spec an artifact was built for, from its metadata (an :class:`Artifacts` or its ``meta``):
    ``dual[shadow4]``, ``dual[lowrank8,epochs=1]``, ``mono[threshold]``."""
    meta = artifacts.meta if isinstance(artifacts, Artifacts) else artifacts
    kind = get_kind(meta["kind"])
    return _make(meta["method"], kind.name, _recorded(meta, kind), meta["kind"])


def check_artifact(spec: str | Spec | Method, artifacts: Artifacts) -> None:
    """Refuse ``artifacts`` of another kind than ``spec`` names, or with an option the spec writes otherwise,
    naming both (the method itself is checked with the model)."""
    spec = parse_spec(spec)
    if spec.kind is None or artifacts.method != spec.method:
        return
    kind = get_kind(artifacts.kind)
    recorded = _recorded(artifacts.meta, kind)
    differs = artifacts.kind != spec.kind or any(recorded.get(k, v) != v for k, v in spec.options.items())
    if differs:
        have = artifact_spec(artifacts).label
        raise ArtifactMismatchError(
            f"the method spec is {spec.label!r} but the artifact holds {have!r} (kind {artifacts.kind}): pass "
            f"{have!r}, or build {spec.label} artifacts with countdown.prepare(model, tokenizer, {spec.label!r}, k)")
