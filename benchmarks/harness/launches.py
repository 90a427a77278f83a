"""The library's Triton kernels seen from the harness: the compiled kernel of each launch, or a stand-in.

``kernel[grid](...)`` returns the ``CompiledKernel`` it ran (on a GPU; Triton's interpreter returns None). The
library's launchers do not hand it on, so :func:`recorded` puts a recording proxy where the launcher looks its
``@triton.jit`` function up (a global of the kernel's module) while the block runs (the sweeps' registers / spills /
shared-memory columns); :func:`stand_in` puts any other stand-in there (``harness.sm90.Compile``: compiled for sm_90
without a GPU). Both put the function back on exit. :data:`KERNELS` is the one place that says which module holds
which kernel.
"""

from __future__ import annotations

import contextlib
import importlib

# name (the op's name in countdown.kernels.config.LAUNCH) -> (module, @triton.jit function) of every kernel whose
# compiled form a sweep reports or the sm_90 check compiles
KERNELS = {
    "chain_gate_up": ("countdown.kernels.sparse_mlp.chain", "gate_up_kernel"),
    "chain_down": ("countdown.kernels.sparse_mlp.down", "down_kernel"),
    "few_tokens": ("countdown.kernels.sparse_mlp.few_tokens", "few_tokens_kernel"),
    "select": ("countdown.kernels.sparse_mlp.select", "select_kernel"),
    "int4_gemv": ("countdown.kernels.int4.gemv", "int4_gemv_kernel"),
    "int4_nested": ("countdown.kernels.int4.nested_down", "low_down_kernel"),  # the mixed MLP's low_down
}


class Launches:
    """What :func:`recorded` saw: per kernel name, how many launches and the last compiled kernel (None before the
    first launch, and under Triton's interpreter)."""

    def __init__(self, names):
        self.count = {name: 0 for name in names}
        self.last = {name: None for name in names}

    def info(self, name: str) -> str:
        """``"regs R spills S smem B"`` of the last compiled kernel of ``name``, or ``""`` where there is none."""
        kernel = self.last[name]
        try:
            return f"regs {kernel.n_regs} spills {kernel.n_spills} smem {kernel.metadata.shared}"
        except AttributeError:
            return ""


class _Recording:
    """Stands where a kernel module's ``@triton.jit`` function stood: ``proxy[grid](...)`` launches the function and
    records what the launch returned; any other attribute is the function's."""

    def __init__(self, name: str, jit, launches: Launches):
        self._name, self._jit, self._launches = name, jit, launches

    def __getitem__(self, grid):
        launch = self._jit[grid]

        def run(*args, **kwargs):
            compiled = launch(*args, **kwargs)
            self._launches.count[self._name] += 1
            self._launches.last[self._name] = compiled
            return compiled

        return run

    def __getattr__(self, attr):
        return getattr(self._jit, attr)


@contextlib.contextmanager
def stand_in(names, make):
    """Inside: each kernel of ``names`` (keys of :data:`KERNELS`) is ``make(name, its @triton.jit function)`` where
    its launcher looks it up; the modules get their own functions back on exit."""
    unknown = [name for name in names if name not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}: harness.launches.KERNELS names {sorted(KERNELS)}")
    swapped = []
    try:
        for name in names:
            module_name, attr = KERNELS[name]
            module = importlib.import_module(module_name)
            jit = getattr(module, attr)
            setattr(module, attr, make(name, jit))
            swapped.append((module, attr, jit))
        yield
    finally:
        for module, attr, jit in reversed(swapped):
            setattr(module, attr, jit)


@contextlib.contextmanager
def recorded(*names: str):
    """Inside: every launch of the kernels ``names`` (keys of :data:`KERNELS`) is recorded in the yielded
    :class:`Launches`."""
    launches = Launches(names)
    with stand_in(names, lambda name, jit: _Recording(name, jit, launches)):
        yield launches
