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
costs with nothing kept (docs/kernels_shadow.md).

When it is on (ENABLED, ``COUNTDOWN_PDL``): "auto" (the default) while some model's decoder layers are
folded (countdown.decode.layer.fold_norms, part of decode_gemv.fastest_step since session 14), where each
layer's decode step is a chain of our kernels only; "1" always; "0" never. Measured on an H200, 2026-11-25
(benchmarks/results/decode_runs/SESSION14.md): with the layers folded, PDL on made the compiled dense step
4 % faster and the sparse ones 4-7 % (runs AS-AU, means of 4-5 runs); without the fold (each MLP's first kernel
behind an Inductor kernel that never signals) it gained nothing beyond the spread and made teal 4-9 %
slower (runs AO-AQ).

Where a grid signals (TRIGGER, ``COUNTDOWN_PDL_TRIGGER``): "start" (each program at its start, as first
built) or "end" (each program after its main loop, before its epilogue). The next grid launches once every
program of this one has signalled or exited, so with "start" a grid of many waves lets its dependents
launch when its last wave begins; their programs then hold SM slots while they wait.
W_EARLY (``COUNTDOWN_PDL_W_EARLY``: "auto", "1" or "0"; the fixed GEMV only): load the first weight tile
before the wait; "auto" does it for grids that fit in one wave of the device (the predictor's GEMVs), not
for the step's big projections. Measured (benchmarks/pdl.py, H200, 2026-11-25, us a layer, PDL off -> on):
the first tile early in every grid made the projections 10 % slower (108.5 -> 119.7; run AM's 6-9 % slower
dense step), after the wait 2 % faster (106.3); dual's MLP chain 28.6 -> 25.2 with it early, 27.8 without
(session 15's rerun, the chains keeping 10 % of their rows; session 14's 16.2 -> 13.7 kept 2-3 %). Where the
signal sits mattered less, and "end" lost dual's gain (29.0): TRIGGER stays "start".
"""

from __future__ import annotations

import os
import weakref

import torch


def _auto_switch(var: str) -> bool | str:
    """An environment switch of "auto" (the default), "1" or "0" ("" reads as "0")."""
    value = os.environ.get(var, "auto")
    if value not in ("auto", "1", "0", ""):
        raise ValueError(f"{var} must be 'auto', '1' or '0', got {value!r}")
    return "auto" if value == "auto" else value == "1"


ENABLED = _auto_switch("COUNTDOWN_PDL")
folded = weakref.WeakSet()  # decoder layers folded now (countdown.decode.layer keeps it): "auto" reads it
TRIGGER = os.environ.get("COUNTDOWN_PDL_TRIGGER", "start")
if TRIGGER not in ("start", "end"):
    raise ValueError(f"COUNTDOWN_PDL_TRIGGER must be 'start' or 'end', got {TRIGGER!r}")
W_EARLY = _auto_switch("COUNTDOWN_PDL_W_EARLY")
# Which of our kernels launch with PDL when it is on (COUNTDOWN_PDL_KERNELS, comma-separated): for A/B runs.
KERNEL_NAMES = ("linear", "attention", "onepass", "psum", "teal", "gemv", "stream", "balanced", "norm", "split")
KERNELS = frozenset(k for k in os.environ.get("COUNTDOWN_PDL_KERNELS", ",".join(KERNEL_NAMES)).split(",") if k)
if not KERNELS <= set(KERNEL_NAMES):
    raise ValueError(f"COUNTDOWN_PDL_KERNELS names kernels of {KERNEL_NAMES}, got {sorted(KERNELS)}")
MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 64, 32  # Hopper's limits per SM

try:  # Triton >= 3.3 (the device image has 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False


def switched_on() -> bool:
    """ENABLED as it stands now: True, False, or "auto" with at least one folded layer."""
    if ENABLED == "auto":
        return len(folded) > 0
    return bool(ENABLED)


def active(t: torch.Tensor) -> bool:
    """Whether launches on ``t``'s device use PDL now: switched on, a CUDA device of compute
    capability 9.0 or more, Triton with grid-dependency control, not the interpreter."""
    from ._common import interpreting

    if not (HAVE_GDC and t.is_cuda and switched_on()) or interpreting():
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def mode(t: torch.Tensor, kernel: str) -> int:
    """The PDL constexpr of ``kernel`` (one of KERNEL_NAMES): 0 off, 1 on with the signal at each program's
    start, 2 at its end."""
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}: one of {KERNEL_NAMES}")
    if not active(t) or kernel not in KERNELS:
        return 0
    if TRIGGER not in ("start", "end"):
        raise ValueError(f"_pdl.TRIGGER must be 'start' or 'end', got {TRIGGER!r}")
    return 1 if TRIGGER == "start" else 2


def weights_early(t: torch.Tensor, programs: int, num_warps: int) -> bool:
    """Whether a PDL launch of the fixed GEMV loads its first weight tile before it waits (W_EARLY): "auto"
    when its ``programs`` of ``num_warps`` warps fit on the device's SMs at once (by warps and programs per
    SM; registers may allow fewer)."""
    if W_EARLY != "auto":
        return bool(W_EARLY)
    from ._common import persistent_programs

    per_sm = min(MAX_PROGRAMS_PER_SM, MAX_WARPS_PER_SM // max(1, num_warps))
    return programs <= persistent_programs(t.device, per_sm, 0)


def launch_kwargs(on) -> dict:
    """Extra keyword arguments of a dependent kernel's launch."""
    return {"launch_pdl": True} if on else {}
