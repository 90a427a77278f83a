"""The registry of sparsification methods.

A Gated-MLP computes ``y = (u * act(g)) @ W_down^T`` with ``u = x W_up^T`` and ``g = x W_gate^T``.
Writing ``s = u * act(g)``, the output is ``y = sum_i s[i] * W_down[:, i]``: row ``i`` of W_up and
W_gate and column ``i`` of W_down share one index, so one keep decision per row skips all three.

A method is nothing more than its *indicator*: a score per row, higher meaning "keep". The rest
(exact per-token top-k in SP-Ideal, a calibrated threshold or a trained predictor in SP-Prac,
masked or gathered computation, kernels) is shared machinery in :mod:`countdown.patch.sparsify`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Indicator = Callable[[torch.Tensor | None, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class Method:
    """One row-selection rule.

    ``needs_up`` / ``needs_gate`` say which dense projections the indicator reads, which is what
    decides its run-time cost: mono needs only ``u``, cats only ``g``, dual needs both.
    ``indicator(u, h)`` receives ``u`` and ``h = act(g)`` (None where not needed).
    ``prac`` names how SP-Prac picks rows without the full indicator: ``"threshold"`` (a calibrated
    per-layer cut on the indicator itself) or ``"predictor"`` (a trained predictor from ``x``).
    ``structure`` says what one keep decision skips: ``"rows"`` (one index of d_inter: a row of W_gate
    and W_up and a column of W_down) or ``"inputs"`` (TEAL, :mod:`countdown.sparse_methods.teal`: an entry of the
    input x skips that column of W_gate and W_up, an entry of s = u * act(g) that column of W_down;
    its indicator is not a per-row score and is never called).
    """

    name: str
    description: str
    needs_up: bool
    needs_gate: bool
    indicator: Indicator | None
    prac: str | None
    aliases: tuple[str, ...] = ()
    structure: str = "rows"

    @property
    def is_dense(self) -> bool:
        return self.indicator is None


def _abs_h(u, h):
    return h.abs()


def _abs_u(u, h):
    return u.abs()


def _abs_s(u, h):
    return (u * h).abs()


def _signed_h(u, h):
    return h


def _inputs_not_rows(u, h):
    raise TypeError("teal keeps entries of the inputs x and s = u * act(g), not rows of d_inter: it has no "
                    "per-row indicator (countdown.sparse_methods.teal computes its masks)")


_REGISTRY: dict[str, Method] = {}
_ALIASES: dict[str, str] = {}


def register(method: Method) -> Method:
    """Add a method to the registry (its name and aliases must be new)."""
    for key in (method.name, *method.aliases):
        if key in _REGISTRY or key in _ALIASES:
            raise ValueError(f"method name {key!r} is already registered")
    _REGISTRY[method.name] = method
    for alias in method.aliases:
        _ALIASES[alias] = method.name
    return method


register(Method("dense", "nothing skipped", False, False, None, None))
register(Method("cats", "CATS: keep the largest |act(g)|", False, True, _abs_h, "threshold"))
register(Method("mono", "M-CountDown: keep the largest |u|", True, False, _abs_u, "threshold",
                aliases=("m-countdown", "mcountdown")))
register(Method("dual", "D-CountDown: keep the largest |u * act(g)|", True, True, _abs_s, "predictor",
                aliases=("d-countdown", "dcountdown")))
register(Method("dejavu", "Deja Vu: keep the largest act(g) (signed, 'active' neurons)", False, True,
                _signed_h, "predictor", aliases=("deja-vu",)))
register(Method("teal", "TEAL: keep the largest |x| (inputs of gate/up) and |u * act(g)| (input of down)",
                False, False, _inputs_not_rows, "threshold", structure="inputs"))


def methods() -> list[str]:
    """Names of every registered method, in registry order."""
    return list(_REGISTRY)


def get_method(name: str | Method) -> Method:
    """Look a method up by name or alias (case-insensitive)."""
    if isinstance(name, Method):
        return name
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        valid = ", ".join(methods())
        aliases = ", ".join(sorted(_ALIASES))
        raise ValueError(f"unknown method {name!r}: choose one of {valid} (aliases: {aliases})")
    return _REGISTRY[key]


def check_sparsity(sparsity: float) -> float:
    """Validate ``k``, the fraction of rows skipped per token: a real number strictly in (0, 1).

    Strings (``"0.8"``), booleans and NaN are refused with a TypeError / ValueError: the API takes
    numbers (the command line parses its strings itself), so a typo never runs silently.
    """
    import numbers

    from ..options import RANGES, real, shown

    if isinstance(sparsity, (str, bytes)) or isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        hint = " (parse it first: float(text))" if isinstance(sparsity, (str, bytes)) else ""
        raise TypeError(f"sparsity must be a real number in (0, 1), got {type(sparsity).__name__} {shown(sparsity)}{hint}")
    k = real(sparsity)  # 10**400 is inf here (float() would raise OverflowError), then refused below
    if math.isnan(k) or not RANGES["sparsity"].holds(k):
        raise ValueError(f"sparsity must be {RANGES['sparsity'].text}, strictly between 0 and 1 (the fraction of rows "
                         f"skipped), got {shown(sparsity)}; use method='dense' for no sparsity")
    return k


def sparsity_list(sparsity) -> list[float]:
    """One k or a list/tuple of them, each checked by :func:`check_sparsity`, distinct, in the given order."""
    if isinstance(sparsity, (list, tuple)):
        ks = list(sparsity)
    elif hasattr(sparsity, "tolist") and not isinstance(sparsity, (str, bytes)):
        ks = list(sparsity.tolist()) if getattr(sparsity, "ndim", 0) else [sparsity.item()]
    else:
        ks = [sparsity]
    if not ks:
        raise ValueError("give at least one sparsity")
    ks = [check_sparsity(k) for k in ks]
    if len({round(k, 6) for k in ks}) != len(ks):
        raise ValueError(f"sparsities must be distinct, got {ks}")
    return ks


def kept_rows(d_inter: int, sparsity: float) -> int:
    """Rows kept per token at sparsity ``k``: ``int(d_inter * (1 - k))``, at least one.

    The small epsilon keeps e.g. ``1000 * (1 - 0.7)`` = 299.99999999999994 from rounding down to 299.
    """
    k = check_sparsity(sparsity)
    return max(1, int(d_inter * (1.0 - k) + 1e-9))
