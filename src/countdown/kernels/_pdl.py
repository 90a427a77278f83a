"""Programmatic dependent launch (Hopper and later) between consecutive kernels of a decode step.

First between the shadow GEMV and the sparse kernel (below); since session 13 also the fixed GEMV
(kernels/_linear.py: it loads its first weight tile before the wait, weights never being the previous
kernel's output), the fused attention's two kernels and the partials' sum: each lets the next grid
launch at its start and waits for the previous grid before it reads that grid's output.

With PDL the sparse kernel (_onepass.py or _stream.py) is launched while the shadow GEMV (_gemv.py)
still runs: the GEMV's programs signal at their start that the next grid may launch
(``gdc_launch_dependents``), the sparse kernel's programs load x and set up, then wait for the
GEMV's grid to finish and its writes to be visible (``gdc_wait``) before reading the indicator or
the kept-row lists. The wait makes it correct wherever the signal is placed; what it can save is
the launch gap and the sparse kernel's prologue, part of the 9-11 us per MLP that the sparse phase
costs with nothing kept (docs/kernels_shadow.md). Off by default until measured:
``COUNTDOWN_PDL=1`` or ``_pdl.ENABLED = True`` turns it on (benchmarks/stream.py --pdl times both).
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("COUNTDOWN_PDL", "0") not in ("", "0")

try:  # Triton >= 3.3 (the device image has 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False


def active(t: torch.Tensor) -> bool:
    """Whether launches on ``t``'s device use PDL now: switched on, a CUDA device of compute
    capability 9.0 or more, Triton with grid-dependency control, not the interpreter."""
    from ._common import interpreting

    if not (ENABLED and HAVE_GDC and t.is_cuda) or interpreting():
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def launch_kwargs(on: bool) -> dict:
    """Extra keyword arguments of a dependent kernel's launch."""
    return {"launch_pdl": True} if on else {}
