"""kernels/_psum.py's tail route: the one-token sparse kernel (_onepass.py) sums its own fp32 partials.

Under the CPU interpreter programs run one after another, so one reducer (the last program) sums every
partial; on a GPU the last REDUCERS programs split the columns (the waiting and the column split are
checked on the H200 by benchmarks/psum_tail.py against the partials' route, bit for bit where the sum order
agrees). Here: the MLP against float64 for mono, cats and dual, the counters left at zero, the same bits on
a second call, the route switch, and the launch shape's invariants.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _common, _onepass, _psum  # noqa: E402

from _onetoken import indicator_values, onepass_on  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D_MODEL, D_INTER = 67, 131


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    onepass_on(monkeypatch)
    monkeypatch.setattr(_psum, "OFF_CUDA", True)
    if DEVICE == "cuda":  # the tail's counters are made once per device, before any capture
        _psum.prepare_tail(torch.device(DEVICE))
    torch.manual_seed(0)


def _mlp(dtype):
    x = torch.randn(1, D_MODEL, device=DEVICE).to(dtype)
    wg, wu = ((torch.randn(D_INTER, D_MODEL, device=DEVICE) / D_MODEL**0.5).to(dtype) for _ in range(2))
    wdt = (torch.randn(D_INTER, D_MODEL, device=DEVICE) / D_INTER**0.5).to(dtype)
    return x, wg, wu, wdt


def _run(op, x, wg, wu, wdt, thr, act, pa=None, pb=None):
    if op == "mono":
        return K.mono_gated_mlp(x, wg, wu, wdt, thr, act)
    if op == "cats":
        return K.cats_gated_mlp(x, wg, wu, wdt, thr, act)
    return K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, thr, act)


@pytest.mark.parametrize("op,dtype,act", [("mono", torch.bfloat16, "silu"), ("cats", torch.float16, "gelu_tanh"),
                                          ("dual", torch.bfloat16, "silu"), ("dual", torch.float32, "gelu_tanh")])
def test_tail_sums_the_partials(op, dtype, act, monkeypatch):
    """The MLP with the kernel's own sum matches float64 as closely as the partials' route does, leaves the
    counters at zero, and gives the same bits twice."""
    x, wg, wu, wdt = _mlp(dtype)
    pa = (torch.randn(D_MODEL, 16, device=DEVICE) / D_MODEL**0.5).to(dtype)
    pb = (torch.randn(D_INTER, 16, device=DEVICE) / 4).to(dtype).t()
    values = indicator_values(op, x, wg, wu, act, pa, pb)
    thr = torch.quantile(values.double(), 0.7).item()
    keep = (values > thr)[None, :]
    assert 0 < int(keep.sum()) < D_INTER
    ref = K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, act)
    monkeypatch.setattr(_psum, "ROUTE", "kernel")
    via_partials = _run(op, x, wg, wu, wdt, thr, act, pa, pb)
    monkeypatch.setattr(_psum, "ROUTE", "tail")
    launched = []
    real = _onepass.onepass_partials
    monkeypatch.setattr(_onepass, "onepass_partials", lambda *a, **k: launched.append(k.get("tail")) or real(*a, **k))
    got = _run(op, x, wg, wu, wdt, thr, act, pa, pb)
    assert launched == [True], "the tail route must launch the kernel once, summing its own partials"
    assert got.dtype == dtype and got.shape == (1, D_MODEL) and not torch.isnan(got).any()
    assert torch.equal(_psum.counters(x.device).cpu(), torch.zeros(2, dtype=torch.int32)), "counters not reset"
    # both round the same fp32 column sums once: at most one unit in the last place apart, and as close to
    # float64 as the partials' route (fp32 sums of a few hundred terms)
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}[dtype]
    assert ((got.double() - via_partials.double()).abs() <= ulp * via_partials.double().abs() + 1e-6).all()
    err, base = (got.double() - ref).abs(), (via_partials.double() - ref).abs()
    assert (err <= base + ulp * ref.abs() + 1e-6).all()
    assert torch.equal(_run(op, x, wg, wu, wdt, thr, act, pa, pb), got), "a second call gave other bits"


def test_tail_only_on_its_route(monkeypatch):
    """"tail" is opt-in: the other routes launch the partials' kernel and sum outside it."""
    x = torch.randn(1, 8, device=DEVICE)
    for route, want in [("tail", True), ("auto", False), ("kernel", False), ("inductor", False)]:
        monkeypatch.setattr(_psum, "ROUTE", route)
        assert _psum.use_tail(x) == want
    monkeypatch.setattr(_psum, "ROUTE", "tail")
    monkeypatch.setattr(_psum, "OFF_CUDA", False)
    assert _psum.use_tail(x) == x.is_cuda


@pytest.mark.parametrize("sms,rows,d", [(132, 224, 4096), (132, 528, 576), (8, 12, 4096), (132, 3, 131), (2, 5, 67)])
def test_tail_shape(sms, rows, d, monkeypatch):
    """On a GPU: fewer reducers than half the SMs (waiting programs can never hold every SM) and than the
    programs, their columns covering d exactly once; under the interpreter one reducer."""
    monkeypatch.setattr(_common, "persistent_programs", lambda dev, per_sm, interp: sms * per_sm)
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    reducers, bc, br = _psum.tail_shape(torch.device("cuda", 0), rows, d)
    assert 1 <= reducers <= max(1, min(_psum.TAIL_REDUCERS, rows, sms // 2))
    assert bc & (bc - 1) == 0 and (reducers - 1) * bc < d <= reducers * bc
    assert br & (br - 1) == 0 and br * bc <= _psum.MAX_ELEMS
    monkeypatch.setattr(_common, "interpreting", lambda: True)
    assert _psum.tail_shape(torch.device("cuda", 0), rows, d)[0] == 1
    assert _psum.tail_shape(torch.device("cpu"), rows, d)[0] == 1


def test_cuda_counters_only_when_prepared(monkeypatch):
    """On CUDA the counters are never made on first use (inside a compiled step's CUDA-graph pool that is an
    allocation torch.compile rejects): before prepare_tail the kernel keeps its partials' route."""
    monkeypatch.setattr(_psum, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _psum.counters(torch.device("cuda", 0)) is None
    made = torch.zeros(2, dtype=torch.int32)
    _psum._COUNTERS[("cuda", 0)] = made  # what prepare_tail(cuda:0) would keep
    assert _psum.counters(torch.device("cuda", 0)) is made and _psum.counters("cuda") is made
    assert _psum.counters("cpu") is _psum.counters("cpu")  # off CUDA: made once on first use
