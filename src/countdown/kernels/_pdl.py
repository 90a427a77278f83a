"""Programmatic dependent launch (Hopper and later) between consecutive kernels of a decode step.

PDL overlaps each launch with the previous grid's tail: every program of a kernel of ours signals at its
start that the next grid may launch (``gdc_launch_dependents``), and the next grid's programs do what
depends on no earlier output (load x's pointers, set up, the fixed GEMV its first weight tile) before they
wait for the previous grid to finish and its writes to be visible (``gdc_wait``). The wait makes it correct
wherever the signal is placed; what it saves is the launch gap and each kernel's prologue.

It is on while some model's decoder layers are folded (countdown.decode.layer.fold_norms, part of
countdown.decode.linears.fastest_step): each layer's decode step is then a chain of our kernels only. Behind
a kernel that never signals (an Inductor kernel of an unfolded layer) it has nothing to overlap and only
holds SM slots while it waits.

W_EARLY (the fixed GEMV only): its first weight tile is loaded before the wait for grids that fit in one
wave of the device (the predictors' GEMVs), not for the step's big projections, whose early programs
would hold SM slots that the previous grid's tail still needs.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

folded = weakref.WeakSet()  # decoder layers folded now (countdown.decode.layer keeps it)
MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 64, 32  # Hopper's limits per SM

try:  # Triton >= 3.3 (the device image has 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False


def switched_on() -> bool:
    """Whether PDL is wanted now: while at least one decoder layer is folded."""
    return len(folded) > 0


def active(t: torch.Tensor) -> bool:
    """Whether launches on ``t``'s device use PDL now: switched on, a CUDA device of compute
    capability 9.0 or more, Triton with grid-dependency control, not the interpreter."""
    from ._common import interpreting

    if not (HAVE_GDC and t.is_cuda and switched_on()) or interpreting():
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def mode(t: torch.Tensor) -> int:
    """The PDL constexpr of a kernel launched on ``t``'s device: 0 off, 1 on (each program signals at its
    start)."""
    return 1 if active(t) else 0


def weights_early(t: torch.Tensor, programs: int, num_warps: int) -> bool:
    """Whether a PDL launch of the fixed GEMV loads its first weight tile before it waits: when its
    ``programs`` of ``num_warps`` warps fit on the device's SMs at once (by warps and programs per SM;
    registers may allow fewer)."""
    from ._common import persistent_programs

    per_sm = min(MAX_PROGRAMS_PER_SM, MAX_WARPS_PER_SM // max(1, num_warps))
    return programs <= persistent_programs(t.device, per_sm, 0)


@triton.jit
def gdc_enter(LATE: tl.constexpr):
    """A PDL-launched program's start: signal that the next grid may launch, then wait for the previous one; LATE:
    wait first, so the next grid launches only once every program here is past its wait (the kernels before this
    one have then finished, and the next grid may read their outputs before its own wait)."""
    if LATE:
        gdc_wait()
        gdc_launch_dependents()
    else:
        gdc_launch_dependents()
        gdc_wait()


def launch_kwargs(on) -> dict:
    """Extra keyword arguments of a dependent kernel's launch."""
    return {"launch_pdl": True} if on else {}
