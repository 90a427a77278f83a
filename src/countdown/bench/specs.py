"""Compatibility only: method specs are :mod:`countdown.spec`, the one grammar (issue 42). This module keeps
``benchmarks/decode.py`` running (it imports ``Spec, parse_specs`` from here and builds a spec positionally);
delete it once that script imports :mod:`countdown.spec`."""

from __future__ import annotations

from ..spec import Spec as _Spec
from ..spec import parse_spec, parse_specs  # noqa: F401


def Spec(label: str, method: str, kind: str | None = None, options: dict | None = None) -> _Spec:  # noqa: N802
    """The old positional order (label first) of :class:`countdown.spec.Spec`."""
    return _Spec(method, kind, dict(options or {}), label)
