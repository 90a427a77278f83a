"""A result that is not a number is an error, never a result: :class:`NonFiniteError` and the checks that raise it.

A perplexity, a loss, a log-likelihood or a decode step's logits that is NaN or infinite means the model computed
garbage: most often weights damaged on disk (a model cache entry whose tensors were hit after it was written: its
sizes and header are intact, so only ``COUNTDOWN_VERIFY_CACHE=sha256`` finds it), else an overflow of fp16. Every
function that returns such a figure checks it here; the message names what was not finite and the likely cause.
The checks read the host once per call (a figure already on the host, or one reduction of a tensor at the end of
the work), never per step.

This module imports nothing from countdown (every layer may use it).
"""

from __future__ import annotations

import math
from typing import Any

CAUSE = ("the model's weights are likely damaged (a model cache entry damaged after it was written keeps its sizes: "
         "run with COUNTDOWN_VERIFY_CACHE=sha256 to check every cached file and rebuild a damaged one), or an fp16 "
         "model overflowed (load it in bf16 or fp32)")


class NonFiniteError(ValueError):
    """A perplexity, loss, log-likelihood or logits that is NaN or infinite: the message says what and the likely
    cause (:data:`CAUSE`)."""


def finite_exp(x: float) -> float:
    """``exp(x)``, inf where the float overflows (``math.exp`` raises OverflowError above about 709)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def check_finite(value: float, what: str, cause: str = CAUSE) -> float:
    """``value`` itself when it is a finite number; else :class:`NonFiniteError` naming ``what`` ("perplexity")."""
    if not math.isfinite(value):
        raise NonFiniteError(f"{what} is {value}, not a number a model gives: {cause}")
    return value


def check_finite_values(values: Any, what: str, cause: str = CAUSE) -> None:
    """Every number of ``values`` (floats, or pairs whose first item is one, as lm-eval's ``(log p, greedy)``)
    is finite; else :class:`NonFiniteError` saying how many were not."""
    bad = [v for v in values if v is not None and not math.isfinite(v[0] if isinstance(v, tuple) else v)]
    if bad:
        raise NonFiniteError(f"{what}: {len(bad)} of {len(values)} are not finite ({bad[0]!r} ...): {cause}")


def check_finite_logits(logits: Any, what: str = "generate", cause: str = CAUSE) -> None:
    """The logits tensor ``logits`` (any shape; None: nothing to check) holds only finite numbers: one reduction
    and one host read, meant for the end of a call (a decode loop keeps the prompt's logits and calls this once
    after its last step), never inside a step."""
    if logits is None:
        return
    import torch

    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteError(f"{what}: the model's logits are not finite (NaN or inf), so its tokens are "
                             f"meaningless: {cause}")
