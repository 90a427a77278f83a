"""Method specs: one string names a method and its SP-Prac kind, parsed in one place.

    dense                 no sparsity (the reference)
    mono, cats            calibrated thresholds
    dual[lowrank]         D-CountDown with the paper's low-rank predictor   (dual[lowrank256]: rank 256)
    dual[hybrid]          dense u + a low-rank gate estimate                (dual[hybrid128])
    dual[ternary]         the paper's ternary predictor
    dual[shadow4]         4-bit shadows of W_gate and W_up                  (dual[shadow3g64]: 3 bits, groups of 64)
    dejavu[lowrank]       Deja Vu with a low-rank predictor
    teal                  input sparsity by magnitude (TEAL): thresholds on x and s, greedy per-layer allocation
    dual                  the library's default kind for dual

A spec whose method or kind this version of the library does not have is not an error here:
:func:`availability` says why it cannot run, and the benchmarks skip it with that reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SPEC = re.compile(r"^\s*([A-Za-z][\w-]*)\s*(?:\[\s*([A-Za-z]+)(\d+)?(?:g(\d+))?\s*\])?\s*$")


@dataclass(frozen=True)
class Spec:
    """One benchmark configuration: ``method`` (a registry name), ``kind`` (the SP-Prac kind:
    ``"threshold"``, ``"lowrank"``, ``"hybrid"``, ``"ternary"``, ``"shadow"``, ... or None for the
    method's own) and ``options`` (``d_rank``, ``bits``, ``group``). ``label`` is the spec as written
    in result tables, e.g. ``dual[shadow4]``."""

    label: str
    method: str
    kind: str | None = None
    options: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_dense(self) -> bool:
        return self.method == "dense"

    @property
    def roofline_kind(self) -> str:
        """The ``countdown.eval.cost.mlp_weight_bytes`` kind of this spec."""
        if self.is_dense or self.method in ("mono", "cats", "teal"):
            return self.method
        return self.kind or "lowrank"


def parse_spec(text: str) -> Spec:
    """``"dual[shadow4]"`` -> ``Spec("dual[shadow4]", "dual", "shadow", {"bits": 4})``; see the
    module docstring for the grammar. Method aliases (``m-countdown``) resolve to registry names when
    the method exists; an unknown name is kept as written (:func:`availability` reports it)."""
    match = _SPEC.match(text or "")
    if not match:
        raise ValueError(f"cannot read the method spec {text!r}: write e.g. mono, cats, dual[lowrank], "
                         "dual[hybrid], dual[shadow4], teal")
    name, kind, number, group = match.groups()
    name = _canonical(name.lower())
    options: dict = {}
    if kind is not None:
        kind = kind.lower()
        if kind == "shadow":
            options["bits"] = int(number) if number else 4
            if group:
                options["group"] = int(group)
        elif number:
            if kind not in ("lowrank", "hybrid"):
                raise ValueError(f"{text!r}: only lowrank<rank>, hybrid<rank> and shadow<bits>[g<group>] take a number")
            options["d_rank"] = int(number)
        elif group:
            raise ValueError(f"{text!r}: g<group> applies to shadow kinds only")
    if name in ("mono", "cats") and kind not in (None, "threshold"):
        raise ValueError(f"{text!r}: {name} uses calibrated thresholds; write {name!r} alone")
    if name in ("mono", "cats"):
        kind = "threshold"
    label = name if kind in (None, "threshold") else f"{name}[{kind}{_suffix(options)}]"
    return Spec(label, name, kind, options)


def parse_specs(text: str | list[str]) -> list[Spec]:
    """A comma-separated list (or a list) of specs, duplicates dropped, order kept."""
    parts = text if isinstance(text, list) else [p for p in re.split(r",(?![^\[]*\])", text) if p.strip()]
    specs: list[Spec] = []
    for part in parts:
        spec = parse_spec(part)
        if spec not in specs:
            specs.append(spec)
    if not specs:
        raise ValueError("give at least one method spec, e.g. --methods mono,dual[lowrank]")
    return specs


def _suffix(options: dict) -> str:
    if "bits" in options:
        return f"{options['bits']}" + (f"g{options['group']}" if "group" in options else "")
    return str(options["d_rank"]) if "d_rank" in options else ""


def _canonical(name: str) -> str:
    from ..registry import get_method

    try:
        return get_method(name).name
    except ValueError:
        return name


def library_kinds() -> tuple[str, ...]:
    """The SP-Prac kinds this version of the library can build and run (``countdown.prac``'s registry)."""
    from ..prac.kinds import KINDS

    return tuple(KINDS)


def availability(spec: Spec) -> str | None:
    """None when ``spec`` can run in this library, else the reason it cannot (printed when skipped)."""
    from ..registry import get_method, methods

    try:
        method = get_method(spec.method)
    except ValueError:
        return f"{spec.label}: method {spec.method!r} is not in this library yet (countdown.methods(): {', '.join(methods())})"
    if method.is_dense:
        return None
    if spec.kind is not None and spec.kind != "threshold" and spec.kind not in library_kinds():
        return (f"{spec.label}: SP-Prac kind {spec.kind!r} is not in this library yet (kinds: "
                f"{', '.join(library_kinds())})")
    if spec.kind == "threshold" and method.prac != "threshold":
        return f"{spec.label}: {spec.method} does not use thresholds"
    if spec.kind not in (None, "threshold") and method.prac == "threshold":
        return f"{spec.label}: {spec.method} uses thresholds, not a {spec.kind} predictor"
    return None


def resolve_kind(spec: Spec) -> Spec:
    """``spec`` with its kind filled in where it was left to the library (``dual`` -> ``dual[shadow4]``)."""
    if spec.kind is not None or spec.is_dense:
        return spec
    from ..registry import get_method

    try:
        method = get_method(spec.method)
    except ValueError:
        return spec
    if method.prac == "threshold":
        from ..prac.prepare import default_kind

        return Spec(spec.label, spec.method, default_kind(method), spec.options)  # teal: its own kind
    if method.prac == "predictor":
        from ..prac.prepare import default_kind

        kind = default_kind(method)
        options = dict(spec.options)
        if kind == "shadow":
            from ..prac.shadow import DEFAULT_BITS

            options.setdefault("bits", DEFAULT_BITS)  # named in full: dual -> dual[shadow4]
        return Spec(f"{spec.method}[{kind}{_suffix(options)}]", spec.method, kind, options)
    return spec
