"""A folded decode layer's MLP half, h + mlp(RMSNorm(h)), with no norm kernel for dual[lowrank]: kernels.dual_block
(the norm folded into the predictor's first GEMV, which also writes x = RMSNorm(h) for the sparse kernel:
kernels/decode_step/linear.py x_out).

Against float64 (h's norm as transformers rounds it, the rows kept by the float64 scores, the kept rows' MLP, the
add); bit for bit under the interpreter against the chain it replaces (the norm kernel, the predictor's GEMVs, the
sparse kernel, the partials' sum with the add); x_out against the norm's reference; the calls it does not serve
answered None.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels.decode_step import linear as _linear, reference, rmsnorm  # noqa: E402

from _onetoken import gap_threshold, one_token_on  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = DEVICE == "cpu"  # the interpreter sums h's squares in the same order in both kernels
D_MODEL, D_INTER, EPS = 256, 96, 1e-5


@pytest.fixture(autouse=True)
def _setup():
    with one_token_on("partial_sums", "residual_add"):  # the chain's sum and add on the same kernels (off CUDA too)
        torch.manual_seed(0)
        yield


def _layer(dtype):
    h = (torch.randn(1, D_MODEL, device=DEVICE) * 3).to(dtype)
    norm_w = (1 + 0.5 * torch.randn(D_MODEL, device=DEVICE)).to(dtype)
    wg, wu = ((torch.randn(D_INTER, D_MODEL, device=DEVICE) / D_MODEL**0.5).to(dtype) for _ in range(2))
    wdt = (torch.randn(D_INTER, D_MODEL, device=DEVICE) / D_INTER**0.5).to(dtype)
    return h, norm_w, wg, wu, wdt


@pytest.mark.parametrize("dtype,n_tok,rows", [(torch.bfloat16, 1, 5), (torch.float16, 3, 64), (torch.float32, 2, 1)])
def test_the_norm_folded_gemv_writes_the_norm(dtype, n_tok, rows):
    """x_out: RMSNorm(x) as transformers rounds it, from GEMVs of 5, 64 and 1 rows (one to many programs a column
    block); the GEMV's own output unchanged by it."""
    x = (torch.randn(n_tok, D_MODEL, device=DEVICE) * 3).to(dtype)
    g = (1 + 0.5 * torch.randn(D_MODEL, device=DEVICE)).to(dtype)
    w = (torch.randn(rows, D_MODEL, device=DEVICE) / D_MODEL**0.5).to(dtype)
    xn = torch.full_like(x, float("nan"))
    y = _linear.decode_linear(x, w, norm_weight=g, eps=EPS, x_out=xn, config={"BN": 1})
    want = reference.rms_norm_ref(x, g, EPS)
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}[dtype]
    assert not torch.isnan(xn).any()
    assert ((xn.double() - want.double()).abs() <= 2 * ulp * want.double().abs()).all()
    assert torch.equal(y, _linear.decode_linear(x, w, norm_weight=g, eps=EPS, config={"BN": 1}))
    with pytest.raises(ValueError, match="x_out"):
        _linear.decode_linear(x, w, x_out=xn)  # no norm: nothing to write


def _predictor(dtype, rank=8):
    a = (torch.randn(rank, D_MODEL, device=DEVICE) / D_MODEL**0.5).to(dtype).t()  # views of contiguous A^T, B^T
    b = (torch.randn(D_INTER, rank, device=DEVICE) / rank**0.5).to(dtype).t()
    return a, b


@pytest.mark.parametrize("dtype,act", [(torch.bfloat16, "silu"), (torch.float16, "gelu_tanh")])
def test_dual_block_with_x_from_the_predictor_is_the_chain(dtype, act):
    with one_token_on("partial_sums", "residual_add", "linear"):  # the predictor's GEMVs on the fixed GEMV
        _dual_block_case(dtype, act)


def _dual_block_case(dtype, act):
    h, norm_w, wg, wu, wdt = _layer(dtype)
    pa, pb = _predictor(dtype)
    x = reference.rms_norm_ref(h, norm_w, EPS)
    scores = ((x.double() @ pa.double()) @ pb.double())[0]
    cut = gap_threshold(scores, 0.7, gap=0.05)  # wide: the latent is rounded to the dtype between the GEMVs
    keep = (scores > cut)[None, :]
    assert 0 < int(keep.sum()) < D_INTER
    got = K.dual_block(h, norm_w, EPS, wg, wu, wdt, pa, pb, cut, act)
    assert got is not None and got.shape == h.shape and got.dtype == dtype
    exact = h.double() + K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, act)
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    xd = x.double()
    terms = (xd.abs() @ wu.double().abs().t()) * (xd.abs() @ wg.double().abs().t())
    bound = 8 * ulp * (h.double().abs() + (terms * keep) @ wdt.double().abs())
    assert ((got.double() - exact).abs() <= bound).all(), float((got.double() - exact).abs().max())
    # the chain it replaces: the norm kernel, the predictor's GEMVs, the sparse kernel, the sum with the add
    chain = K.dual_gated_mlp(rmsnorm.rms_norm(h, norm_w, EPS), wg, wu, wdt, pa, pb, cut, act, residual=h)
    if EXACT:
        assert torch.equal(got, chain)
    else:
        assert torch.allclose(got.float(), chain.float(), rtol=0, atol=float(bound.max()))
    # a cut that keeps nothing: h itself, rounded through the add of a zero MLP
    assert torch.equal(K.dual_block(h, norm_w, EPS, wg, wu, wdt, pa, pb, 1e9, act), h)


def test_dual_block_serves_only_its_route():
    h, norm_w, wg, wu, wdt = _layer(torch.bfloat16)
    pa, pb = _predictor(torch.bfloat16)
    run = lambda h, pa, pb: K.dual_block(h, norm_w, EPS, wg, wu, wdt, pa, pb, 0.3, "silu")  # noqa: E731
    if not torch.cuda.is_available():
        assert run(h, pa, pb) is None  # off CUDA only where the fixed GEMV serves there too (tests)
    with one_token_on("partial_sums", "residual_add", "linear"):
        assert run(h, pa, pb) is not None
        assert run(torch.cat([h, h]), pa, pb) is None  # two tokens
        assert run(h, pa.float(), pb.float()) is None  # the predictor in another dtype than h
        assert run(h, pa.contiguous(), pb) is None  # A^T not contiguous
        assert K.dual_block(h, norm_w.float(), EPS, wg, wu, wdt, pa, pb, 0.3, "silu") is None  # the norm's dtype
        with pytest.raises(ValueError, match="predictor must be"):
            run(h, pa[:, :-1], pb)
