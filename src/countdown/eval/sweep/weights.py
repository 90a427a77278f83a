"""The weights a sweep configuration runs on, where they are not the model's as loaded.

Two kinds of configuration change the model's weights, prompt included, not only which rows the continuation
computes:

* a dense configuration with 4-bit MLP weights, written ``dense@mlp4g64`` (:class:`MlpWeights`): every Gated-MLP
  Linear (gate, up, down) replaced by an :class:`~countdown.int4.linear.Int4Linear` of its round-to-nearest 4-bit
  weight in groups of ``G`` columns, float16 scales and offsets (:func:`countdown.int4.format.quantize_rtn`, the
  format :func:`countdown.quantize` makes with ``group=G``); every other Linear stays as loaded;
* an SP-Prac kind whose :meth:`~countdown.selectors.base.SelectorKind.prepare_model` makes weights of its own
  (``dual[mixed]``: the MLPs in the nested 8-bit format, so its dense prompt is the 8-bit model's).

Such configurations cannot share a prompt pass with the model as loaded: the sweep measures each weight group in a
pass of its own (:func:`weights_key`), inside :func:`model_weights`, which puts the MLP Linears as loaded back
afterwards (the nested record on ``model.config`` removed), whatever happened inside.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from torch import nn

from ...spec import Spec

_MLP_WEIGHTS = re.compile(r"^mlp(\d+)g(\d+)$")


@dataclass(frozen=True)
class MlpWeights:
    """The Gated-MLPs' Linears at ``bits``-bit round-to-nearest weights, groups of ``group`` columns (float16 scales
    and offsets); the other Linears as loaded. ``label``: ``mlp4g64``."""

    bits: int = 4
    group: int = 64

    @property
    def label(self) -> str:
        return f"mlp{self.bits}g{self.group}"

    def __str__(self) -> str:
        return f"MLP int{self.bits} (RTN, groups of {self.group}, float16 scales; other Linears as loaded)"


def parse_weights(text: str) -> MlpWeights:
    """``"mlp4g64"`` -> :class:`MlpWeights`; anything else is a ValueError naming the form."""
    from ...int4.format import GROUPS

    match = _MLP_WEIGHTS.match(text.strip().lower())
    if not match:
        raise ValueError(f"unknown weights {text!r} after '@': write mlp4g<group> (the MLP Linears 4-bit RTN in "
                         f"groups of <group>, one of {', '.join(map(str, GROUPS))}), e.g. dense@mlp4g64")
    bits, group = int(match.group(1)), int(match.group(2))
    if bits != 4:
        raise ValueError(f"weights {text!r}: only 4-bit MLP weights exist (mlp4g<group>), not {bits}-bit")
    if group not in GROUPS:
        raise ValueError(f"weights {text!r}: the group must be one of {', '.join(map(str, GROUPS))}")
    return MlpWeights(bits, group)


def split_weights(text: str) -> tuple[str, MlpWeights | None]:
    """``"dense@mlp4g64"`` -> ``("dense", MlpWeights(4, 64))``; ``"mono"`` -> ``("mono", None)``."""
    spec, sep, weights = text.partition("@")
    if not sep:
        return text, None
    if not weights.strip():
        raise ValueError(f"{text!r}: nothing after '@'; write e.g. dense@mlp4g64")
    return spec, parse_weights(weights)


def check_weighted(spec: Spec) -> None:
    """Only dense takes ``@weights``: a sparse method's artifacts are built on the weights as loaded."""
    if spec.weights is not None and not spec.is_dense:
        raise ValueError(f"{spec.label}@{spec.weights.label}: only dense takes @weights (dense@mlp4g64); sparse "
                         "configurations run on the weights as loaded, or on their kind's own (dual[mixed])")


def prepares_weights(spec: Spec) -> bool:
    """Does ``spec``'s SP-Prac kind make weights of its own (``dual[mixed]``, not ``dual[mixed,kept=float]``)?"""
    from ...selectors.base import SelectorKind, get_kind

    spec = spec.resolved()
    if spec.kind is None:
        return False
    kind = get_kind(spec.kind)
    if type(kind).prepare_model is SelectorKind.prepare_model:
        return False
    return spec.options.get("kept", kind.defaults.get("kept")) != "float"


def weights_key(spec: Spec, mode: str) -> str:
    """The weight group of a configuration: ``""`` (as loaded), ``"@mlp4g64"``, or the SP-Prac label whose kind
    makes its own weights (``"dual[mixed]"``); configurations of one group share a prompt pass."""
    if spec.weights is not None:
        return "@" + spec.weights.label
    if mode == "prac" and prepares_weights(spec):
        return spec.resolved().label
    return ""


@contextlib.contextmanager
def model_weights(model: nn.Module, weights: MlpWeights | None = None) -> Iterator[list]:
    """Inside: ``model``'s Gated-MLP Linears as ``weights`` says (None: as they are, for a kind that converts them
    itself); after: the Linears as they were before, the ``countdown_nested`` record as it was. Yields the
    :class:`~countdown.model.gated_mlp.GatedMLP` views."""
    from ...int4.format import quantize_rtn
    from ...int4.linear import Int4Linear
    from ...int4.nested_model import CONFIG_ATTR
    from ...model.gated_mlp import require_gated_mlps

    mlps = require_gated_mlps(model)
    if any(mlp.fused is not None for mlp in mlps):
        raise ValueError("a fused gate_up projection is not supported by the sweep's weight groups")
    saved = [(mlp.module, attr, getattr(mlp.module, attr)) for mlp in mlps for attr in (mlp.gate, mlp.up, mlp.down)]
    had = getattr(model.config, CONFIG_ATTR, None)
    try:
        if weights is not None:
            for parent, attr, linear in saved:
                if type(linear) is not nn.Linear:
                    raise ValueError(f"{attr}: the MLP Linears are {type(linear).__name__} already; {weights.label} "
                                     "rounds the weights as loaded")
                setattr(parent, attr, Int4Linear.from_linear(linear, quantize_rtn(linear.weight, weights.group),
                                                             source="rtn"))
        yield mlps
    finally:
        for parent, attr, linear in saved:
            setattr(parent, attr, linear)
        if had is None and hasattr(model.config, CONFIG_ATTR):
            delattr(model.config, CONFIG_ATTR)


@contextlib.contextmanager
def group_weights(model: nn.Module, weights: MlpWeights | None, build_artifacts: Callable[[], dict]) -> Iterator[dict]:
    """The model on one weight group's weights (:func:`model_weights`), yielding ``build_artifacts()`` (label ->
    SP-Prac artifacts, built or loaded inside, so that a kind that converts the model while it builds converts it
    here) after each artifact's kind has made its weights (a cached or already loaded artifact converts nothing by
    itself: ``dual[mixed]``'s nested MLPs are made now, before any prompt runs)."""
    from ...selectors.base import get_kind

    with model_weights(model, weights) as mlps:
        arts = build_artifacts()
        for art in arts.values():
            get_kind(art.kind).prepare_model(model, mlps, art.meta)
        yield arts


def weight_groups(cells, specs: dict) -> list[tuple[str, list]]:
    """``cells`` split by :func:`weights_key` (``specs``: CSV label -> spec), groups in order of first appearance
    (the weights as loaded first where the first cell is dense)."""
    groups: dict[str, list] = {}
    for cell in cells:
        spec = specs.get(cell.method)
        groups.setdefault("" if spec is None else weights_key(spec, cell.mode), []).append(cell)
    return list(groups.items())
