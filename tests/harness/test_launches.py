"""harness.launches: every kernel its table names is a Triton kernel where the table says, named as its launcher names
it (the launch tables' op, the on_launch spy's name); a recorded launch is counted, its output unchanged, the compiled
kernel kept (on a GPU: its registers), and the library's function back after."""

import importlib

import pytest
import torch
from triton.runtime.jit import KernelInterface

import countdown.kernels as K
from countdown.kernels.config import LAUNCH
from countdown.kernels.sparse_mlp import chain
from harness.launches import KERNELS, recorded, stand_in

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gate_up_call():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 32, generator=g).to(DEV)
    w_gate, w_up = (torch.randn(40, 32, generator=g).to(DEV) for _ in range(2))
    ind = (x @ w_up.t()).abs()
    return lambda: chain.gate_up(x, w_gate, w_up, ind, None, float(ind.median()), "abs", "silu", True, False)


def test_every_kernel_of_the_table_is_a_triton_kernel_where_it_says():
    for name, (module, attr) in KERNELS.items():
        assert isinstance(getattr(importlib.import_module(module), attr), KernelInterface), name
        assert name in LAUNCH, name  # the op whose launch table configures it


def test_a_recorded_launch_is_counted_and_computes_the_same():
    call = _gate_up_call()
    want = call()
    library = chain.gate_up_kernel
    spied = []
    with recorded("chain_gate_up", "chain_down") as launches, K.overrides(on_launch=lambda name, *a: spied.append(name)):
        assert chain.gate_up_kernel is not library
        got = call()
        got_again = call()
    assert chain.gate_up_kernel is library
    assert torch.equal(got, want) and torch.equal(got_again, want)
    assert launches.count == {"chain_gate_up": 2, "chain_down": 0} and launches.last["chain_down"] is None
    assert spied == ["chain_gate_up"] * 2  # the launcher's own name for the kernel
    if DEV == "cuda":  # the CompiledKernel the launch returned
        assert launches.last["chain_gate_up"].n_regs > 0 and launches.info("chain_gate_up").startswith("regs ")
    else:  # Triton's interpreter returns nothing to record
        assert launches.last["chain_gate_up"] is None and launches.info("chain_gate_up") == ""
    assert call() is not None and launches.count["chain_gate_up"] == 2  # nothing recorded after the block


def test_stand_in_restores_the_kernels_when_the_block_fails_and_names_unknown_ones():
    library = chain.gate_up_kernel
    with pytest.raises(RuntimeError, match="inside"):
        with stand_in(["chain_gate_up"], lambda name, jit: (name, jit)):
            assert chain.gate_up_kernel == ("chain_gate_up", library)
            raise RuntimeError("inside")
    assert chain.gate_up_kernel is library
    with pytest.raises(ValueError, match=r"unknown kernel\(s\) \['nosuch'\]: harness.launches.KERNELS names"):
        with recorded("chain_gate_up", "nosuch"):
            pass
    assert chain.gate_up_kernel is library
