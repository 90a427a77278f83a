"""harness.launches: every kernel its table names is a Triton kernel where the table says; a recorded launch is counted,
its output unchanged, the compiled kernel kept (on a GPU: its registers), and the library's function back after."""

import importlib

import pytest
import torch
from triton.runtime.jit import KernelInterface

from countdown.kernels import _glu
from harness.launches import KERNELS, recorded, stand_in

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _glu_call():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 32, generator=g).to(DEV)
    w_gate, w_up = (torch.randn(40, 32, generator=g).to(DEV) for _ in range(2))
    ind = (x @ w_up.t()).abs()
    return lambda: _glu.sparse_glu(x, w_gate, w_up, ind, None, float(ind.median()), "abs", "silu", True, False)


def test_every_kernel_of_the_table_is_a_triton_kernel_where_it_says():
    for name, (module, attr) in KERNELS.items():
        assert isinstance(getattr(importlib.import_module(module), attr), KernelInterface), name


def test_a_recorded_launch_is_counted_and_computes_the_same():
    call = _glu_call()
    want = call()
    library = _glu._sparse_glu_kernel
    with recorded("glu", "down") as launches:
        assert _glu._sparse_glu_kernel is not library
        got = call()
        got_again = call()
    assert _glu._sparse_glu_kernel is library
    assert torch.equal(got, want) and torch.equal(got_again, want)
    assert launches.count == {"glu": 2, "down": 0} and launches.last["down"] is None
    if DEV == "cuda":  # the CompiledKernel the launch returned
        assert launches.last["glu"].n_regs > 0 and launches.info("glu").startswith("regs ")
    else:  # Triton's interpreter returns nothing to record
        assert launches.last["glu"] is None and launches.info("glu") == ""
    assert call() is not None and launches.count["glu"] == 2  # nothing recorded after the block


def test_stand_in_restores_the_kernels_when_the_block_fails_and_names_unknown_ones():
    library = _glu._sparse_glu_kernel
    with pytest.raises(RuntimeError, match="inside"):
        with stand_in(["glu"], lambda name, jit: (name, jit)):
            assert _glu._sparse_glu_kernel == ("glu", library)
            raise RuntimeError("inside")
    assert _glu._sparse_glu_kernel is library
    with pytest.raises(ValueError, match=r"unknown kernel\(s\) \['nosuch'\]: harness.launches.KERNELS names"):
        with recorded("glu", "nosuch"):
            pass
    assert _glu._sparse_glu_kernel is library
