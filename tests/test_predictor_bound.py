"""benchmarks/predictor_bound.py's stand-in for kernels.dual_block (a speed-only bound: the predictor's launches out
of the MLP's chain). What the bound's numbers rest on: its first call per layer is the real MLP half (h + the
masked MLP of RMSNorm(h) with the real predictor's mask), every later call keeps that first call's scores (the
mask does not follow the token), the cut is applied in the kernel, and the kept fraction is recorded. Against
float64."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _onepass, _psum, _rmsnorm  # noqa: E402

from _onetoken import gap_threshold, onepass_on  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D_MODEL, D_INTER, RANK, EPS = 48, 61, 8, 1e-5


def _load_bound():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "predictor_bound.py"
    spec = importlib.util.spec_from_file_location("predictor_bound_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected(h, norm_w, wg, wu, wdt, keep):
    """float64: h + the MLP of RMSNorm(h) (as transformers rounds it) over the kept rows."""
    x = _rmsnorm.rms_norm_ref(h, norm_w, EPS)
    return h.double() + K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, "silu")


def test_first_call_is_the_real_mlp_half_and_later_calls_keep_its_mask(monkeypatch):
    onepass_on(monkeypatch)
    monkeypatch.setattr(_onepass, "IND_GEMV_OFF_CUDA", True)  # the fixed GEMV route under the interpreter too
    monkeypatch.setattr(_psum, "OFF_CUDA", True)
    bound = _load_bound()
    gen = torch.Generator().manual_seed(7)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)

    h1, h2 = rand(1, D_MODEL), rand(1, D_MODEL)
    norm_w = (torch.rand(D_MODEL, generator=gen) + 0.5).to(DEVICE)
    wg, wu, wdt = rand(D_INTER, D_MODEL, scale=0.2), rand(D_INTER, D_MODEL, scale=0.2), rand(D_INTER, D_MODEL, scale=0.2)
    at, bt = rand(RANK, D_MODEL, scale=D_MODEL**-0.5), rand(D_INTER, RANK, scale=RANK**-0.5)
    pa, pb = at.t(), bt.t()  # views of contiguous A^T and B^T, as countdown.prac holds them

    def scores(h):
        x = _rmsnorm.rms_norm_ref(h, norm_w, EPS).double()
        return (x @ pa.double()) @ pb.double()

    s1 = scores(h1)
    cut = gap_threshold(s1[0].float(), 0.7, gap=0.05)  # wide: the latent is rounded on its way
    keep1, keep2 = s1 > cut, scores(h2) > cut
    assert 0 < int(keep1.sum()) < D_INTER and not torch.equal(keep1, keep2)  # the second token's own mask differs

    block = bound.bounded_dual_block()
    first = block(h1, norm_w, EPS, wg, wu, wdt, pa, pb, cut, "silu")
    second = block(h2, norm_w, EPS, wg, wu, wdt, pa, pb, cut, "silu")
    for got, h in ((first, h1), (second, h2)):
        exact = _expected(h, norm_w, wg, wu, wdt, keep1)  # both with the first call's mask
        err = (got.double() - exact).abs().max().item()
        assert err <= 1e-4 * (1 + exact.abs().max().item()), err
    assert (second.double() - _expected(h2, norm_w, wg, wu, wdt, keep2)).abs().max() > 1e-3  # not the real mask
    assert len(bound.CALLS) == 2
    assert bound.KEPT == pytest.approx([keep1.float().mean().item()] * 2)
    # a cut that keeps nothing: h itself (the kernel applies the cut to the kept scores)
    assert torch.allclose(block(h2, norm_w, EPS, wg, wu, wdt, pa, pb, 1e9, "silu"), h2)
    assert bound.KEPT[-1] == 0.0
    # another layer (another B) gets its own scores, not the first layer's
    third = block(h2, norm_w, EPS, wg, wu, wdt, pa, pb.clone(), cut, "silu")
    assert torch.allclose(third.double(), _expected(h2, norm_w, wg, wu, wdt, keep2), atol=1e-4, rtol=1e-4)
