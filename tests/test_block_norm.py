"""A folded decode layer's MLP half, h + mlp(RMSNorm(h)), with no norm kernel, for the two dual SP-Prac methods:
kernels/_shadow_block.py (dual[shadow]: the norm inside the shadow GEMV's x-prep launch) and kernels/dual.py's
dual_block with X_FROM_PREDICTOR (dual[lowrank]: the norm folded into the predictor's first GEMV, which also writes
x = RMSNorm(h) for the sparse kernel: kernels/_linear.py x_out).

Against float64 (h's norm as transformers rounds it, the rows kept by the float64 shadow indicator, the kept rows'
MLP, the add); bit for bit under the interpreter against the five-launch chain it replaces (the norm kernel, the
x-prep, the GEMV, the sparse kernel, the partials' sum with the add); x and its int8 words against the norm kernel
and _xprep_kernel; the routes it does not serve answered None; in a folded tiny Llama with dual[shadow4], the
decode with the route gives the tokens of the decode without it, one launch of it per layer per step.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _gemv_i8, _linear, _onepass, _psum, _rmsnorm, _shadow_block, dual, shadow  # noqa: E402
from countdown.kernels.quant import shadow_score  # noqa: E402

from _onetoken import gap_threshold, onepass_on  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = DEVICE == "cpu"  # the interpreter sums h's squares in the same order in both kernels
D_MODEL, D_INTER, GROUP, EPS = 256, 96, 32, 1e-5
# The folded Llama's decodes: greedy tokens (two decode steps, the second reading the cache the first wrote) and
# d_inter (odd and prime as the tiny models' 97, smaller: the interpreter walks the shadow GEMV's and the sparse
# kernel's rows a few at a time; the kernels' shapes are the tests above, there the route is tested).
NEW, MODEL_D_INTER = 3, 37


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    onepass_on(monkeypatch)
    monkeypatch.setattr(_psum, "OFF_CUDA", True)  # the chain's sum on the same kernel (off CUDA too)
    monkeypatch.setattr(_shadow_block, "ENABLED", True)
    torch.manual_seed(0)


def _layer(dtype):
    h = (torch.randn(1, D_MODEL, device=DEVICE) * 3).to(dtype)
    norm_w = (1 + 0.5 * torch.randn(D_MODEL, device=DEVICE)).to(dtype)
    wg, wu = ((torch.randn(D_INTER, D_MODEL, device=DEVICE) / D_MODEL**0.5).to(dtype) for _ in range(2))
    wdt = (torch.randn(D_INTER, D_MODEL, device=DEVICE) / D_INTER**0.5).to(dtype)
    qg, sg = K.quantize_rtn(wg.cpu(), 4, GROUP)
    qu, su = K.quantize_rtn(wu.cpu(), 4, GROUP)
    prep = {k: v.to(DEVICE) for k, v in K.prepare_shadow(qg, sg, qu, su, 4).items()}
    return h, norm_w, wg, wu, wdt, prep


def _indicator64(x, prep, act):
    """|u~ act(g~)| in float64 from the dequantized shadows (x as the MLP sees it)."""
    qg, sg, qu, su = K.unpack_prepared(prep, D_MODEL)
    xd = x.double()
    u = xd @ K.dequantize(qu, su).double().to(xd.device).t()
    g = xd @ K.dequantize(qg, sg).double().to(xd.device).t()
    return shadow_score(u, g, act).abs()[0]


@pytest.mark.parametrize("dtype,act", [(torch.bfloat16, "silu"), (torch.float16, "gelu_tanh")])
def test_shadow_block_is_the_norm_the_mlp_and_the_add(dtype, act):
    h, norm_w, wg, wu, wdt, prep = _layer(dtype)
    x = _rmsnorm.rms_norm_ref(h, norm_w, EPS)  # the MLP's input as transformers rounds it
    cut = gap_threshold(_indicator64(x, prep, act), 0.7, gap=0.05)  # wide: x's int8 rounding moves the scores
    keep = (_indicator64(x, prep, act) > cut)[None, :]
    assert 0 < int(keep.sum()) < D_INTER
    cut_t = torch.tensor(cut, dtype=torch.float32, device=DEVICE)
    got = K.shadow_dual_block(h, norm_w, EPS, prep, cut_t, wg, wu, wdt, act)
    assert got is not None and got.shape == h.shape and got.dtype == dtype and not torch.isnan(got).any()
    exact = h.double() + K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, act)
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    xd = x.double()
    u, g = xd @ wu.double().t(), xd @ wg.double().t()
    terms = (xd.abs() @ wu.double().abs().t()) * (xd.abs() @ wg.double().abs().t()) + (u * g).abs()
    # the roundings: the kept rows' u and g as GEMVs return them, s, the partials, the add (a few ulps of each term)
    bound = 8 * ulp * (h.double().abs() + (terms * keep) @ wdt.double().abs())
    assert ((got.double() - exact).abs() <= bound).all(), float((got.double() - exact).abs().max())
    chain = K.shadow_dual_gated_mlp(_rmsnorm.rms_norm(h, norm_w, EPS), prep, cut_t, wg, wu, wdt, act, residual=h)
    if EXACT:
        assert torch.equal(got, chain)
    else:
        assert torch.allclose(got.float(), chain.float(), rtol=0, atol=float(bound.max()))


def test_norm_prepare_gives_the_norm_and_the_xprep_words():
    h, norm_w, *_, prep = _layer(torch.bfloat16)
    q, scale = prep["q"], prep["scale"]
    n_words, n_groups = q.shape[2], scale.shape[2]
    for gb in (1, 2, 8):  # programs of one, two and eight groups (the last one covers them all)
        x, (xa, xb, xs, xsum) = _shadow_block.norm_prepare(h, norm_w, EPS, n_words, n_groups, 4, gb=gb)
        want = _rmsnorm.rms_norm(h, norm_w, EPS)
        assert torch.equal(x, want) if EXACT else torch.allclose(x.float(), want.float(), rtol=2**-7, atol=0)
        # _xprep_kernel's words of the same x: launch the GEMV both ways, the indicator equal bit for bit
        a = _gemv_i8.launch(x, q, scale, "silu", prep=(xa, xb, xs, xsum))
        b = _gemv_i8.launch(x, q, scale, "silu", {"XPRE": True})
        assert torch.equal(a, b)
        amax = x.float().view(-1, GROUP).abs().amax(1)  # the groups' scales, as _gemv_i8.py defines them
        assert torch.allclose(xs, amax / 127.0, rtol=1e-6, atol=0)


def test_the_route_serves_only_one_token_on_its_kernels(monkeypatch):
    h, norm_w, wg, wu, wdt, prep = _layer(torch.bfloat16)
    cut = torch.tensor(0.1, device=DEVICE)
    assert K.shadow_dual_block(h, norm_w, EPS, prep, cut, wg, wu, wdt) is not None
    assert K.shadow_dual_block(h.expand(2, -1).contiguous(), norm_w, EPS, prep, cut, wg, wu, wdt) is None
    assert K.shadow_dual_block(h, norm_w.float(), EPS, prep, cut, wg, wu, wdt) is None
    monkeypatch.setattr(shadow, "ONE_TOKEN_GEMV", "fp16x2")
    assert K.shadow_dual_block(h, norm_w, EPS, prep, cut, wg, wu, wdt) is None
    monkeypatch.setattr(shadow, "ONE_TOKEN_GEMV", "int8")
    monkeypatch.setattr(_shadow_block, "ENABLED", False)
    assert K.shadow_dual_block(h, norm_w, EPS, prep, cut, wg, wu, wdt) is None
    monkeypatch.setattr(_shadow_block, "ENABLED", True)
    with pytest.raises(ValueError, match="norm weight"):
        _shadow_block.norm_prepare(h, norm_w[:-1], EPS, prep["q"].shape[2], prep["scale"].shape[2], 4)


def test_a_folded_llama_decodes_the_same_tokens_with_the_route(monkeypatch):
    import countdown
    from countdown.decode import attention as fused_attention
    from countdown.decode import layer as fused_layer
    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import route_linears
    from countdown.prac.shadow import ShadowSelector
    from countdown.state import state_of
    from conftest import assert_same_logits, captured_logits, tiny_model

    model = tiny_model("llama", intermediate_size=MODEL_D_INTER).to(DEVICE)
    n_layers = model.config.num_hidden_layers
    prompt = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    fused_attention.fuse_attention(model)
    route_linears(model, ("qkv", "norm"))
    countdown.sparsify(model, "dual", 0.5, path="kernel")
    for layer in state_of(model).layers:  # 4-bit shadows of the layer's own weights, a cut that skips about half
        mlp, bits, group = layer.mlp, 4, 32
        tensors = {}
        for name, w in (("gate", mlp.w_gate), ("up", mlp.w_up)):
            q, s = K.quantize_rtn(w.detach().float().cpu(), bits, group)
            tensors[f"{name}_q"], tensors[f"{name}_scale"] = K.pack_bits(q, bits), s
        tensors["cut"] = torch.tensor(0.01)
        layer.selector = ShadowSelector(tensors, mlp.d_model, bits, mlp.act, "cut", mlp.d_inter // 2).to(DEVICE)
    monkeypatch.setattr(fused_layer, "OWN_ADD", True)
    monkeypatch.setattr(fused_layer, "FOLD_MLP", True)
    monkeypatch.setattr(_shadow_block, "ENABLED", False)  # the norm on its kernel, the add in the partials' sum
    with captured_logits(model) as ref_logits:
        ref, _ = generate_fast(model, prompt, NEW, compile=False)
    monkeypatch.setattr(_shadow_block, "ENABLED", True)
    hits = []
    real = torch.ops.countdown.shadow_norm_gemv_i8
    monkeypatch.setattr(torch.ops.countdown, "shadow_norm_gemv_i8", lambda *a: hits.append(1) or real(*a))
    with captured_logits(model) as logits:
        out, _ = generate_fast(model, prompt, NEW, compile=False)
    assert torch.equal(out, ref)
    assert_same_logits(logits, ref_logits)
    assert len(hits) == (NEW - 1) * n_layers  # NEW - 1 decode steps, none for the prompt
    countdown.unsparsify(model)


@pytest.mark.parametrize("dtype,n_tok,rows", [(torch.bfloat16, 1, 5), (torch.float16, 3, 64), (torch.float32, 2, 1)])
def test_the_norm_folded_gemv_writes_the_norm(dtype, n_tok, rows):
    """x_out: RMSNorm(x) as transformers rounds it, from GEMVs of 5, 64 and 1 rows (one to many programs a column
    block); the GEMV's own output unchanged by it."""
    x = (torch.randn(n_tok, D_MODEL, device=DEVICE) * 3).to(dtype)
    g = (1 + 0.5 * torch.randn(D_MODEL, device=DEVICE)).to(dtype)
    w = (torch.randn(rows, D_MODEL, device=DEVICE) / D_MODEL**0.5).to(dtype)
    xn = torch.full_like(x, float("nan"))
    y = _linear.decode_linear(x, w, norm_weight=g, eps=EPS, x_out=xn, config={"BN": 1})
    want = _rmsnorm.rms_norm_ref(x, g, EPS)
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
def test_dual_block_with_x_from_the_predictor_is_the_chain(dtype, act, monkeypatch):
    monkeypatch.setattr(_onepass, "IND_GEMV_OFF_CUDA", True)
    monkeypatch.setattr(dual, "NORM_IN_PREDICTOR", False)
    monkeypatch.setattr(dual, "X_FROM_PREDICTOR", True)
    h, norm_w, wg, wu, wdt, _ = _layer(dtype)
    pa, pb = _predictor(dtype)
    x = _rmsnorm.rms_norm_ref(h, norm_w, EPS)
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
    chain = K.dual_gated_mlp(_rmsnorm.rms_norm(h, norm_w, EPS), wg, wu, wdt, pa, pb, cut, act, residual=h)
    if EXACT:
        assert torch.equal(got, chain)
    else:
        assert torch.allclose(got.float(), chain.float(), rtol=0, atol=float(bound.max()))
    monkeypatch.setattr(dual, "X_FROM_PREDICTOR", False)
    assert K.dual_block(h, norm_w, EPS, wg, wu, wdt, pa, pb, cut, act) is None


@pytest.mark.parametrize("n_tok,rows,norm", [(1, 40, False), (3, 64, True), (1, 7, True)])
def test_int8_rows_gemv_against_float64(n_tok, rows, norm):
    """decode_linear with int8 rows and their scales (a predictor's factors at half the bytes): x (s q)^T, with the
    norm folded in and its x_out too, against float64 of the dequantized weight."""
    from countdown.kernels.quant import quantize_rows_int8

    x = (torch.randn(n_tok, D_MODEL, device=DEVICE) * 2).to(torch.bfloat16)
    w = torch.randn(rows, D_MODEL, device=DEVICE) / D_MODEL**0.5
    w[rows // 2] = 0.0  # an all-zero row: scale 1, q 0
    q, sc = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and float(sc[rows // 2]) == 1.0
    deq = q.double() * sc.double()[:, None]
    assert ((deq - w.double()).abs() <= sc.double()[:, None] / 2 + 1e-7).all()  # round to nearest
    g = (1 + 0.5 * torch.randn(D_MODEL, device=DEVICE)).to(torch.bfloat16) if norm else None
    xn = torch.empty_like(x) if norm else None
    y = _linear.decode_linear(x, q, norm_weight=g, eps=EPS, x_out=xn, w_scale=sc)
    xd = x.double()
    if norm:  # the GEMV normalises in fp32 without the rounding transformers applies to x: compare with that x
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * g.double()
        if EXACT:
            assert torch.equal(xn, _rmsnorm.rms_norm(x, g, EPS))
    want = xd @ deq.t()
    tol = 2.0**-7 * (xd.abs() @ deq.abs().t()) + 1e-6  # bf16 output rounding, fp32 sums
    assert ((y.double() - want).abs() <= tol).all(), float((y.double() - want).abs().max())
    with pytest.raises(ValueError, match="int8 rows"):
        _linear.decode_linear(x, q, w_scale=sc.double())


def test_dual_block_with_int8_factors_is_the_route_on_dequantized_factors(monkeypatch):
    """kernels.dual_block_int8: the same MLP half as dual_block's x-from-predictor route run on the dequantized
    factors (the rows kept are the int8 predictor's: a cut in a gap of its scores)."""
    from countdown.kernels.quant import quantize_rows_int8

    monkeypatch.setattr(_onepass, "IND_GEMV_OFF_CUDA", True)
    monkeypatch.setattr(dual, "NORM_IN_PREDICTOR", False)
    monkeypatch.setattr(dual, "X_FROM_PREDICTOR", True)
    h, norm_w, wg, wu, wdt, _ = _layer(torch.bfloat16)
    pa, pb = _predictor(torch.bfloat16)
    (aq, as_), (bq, bs) = quantize_rows_int8(pa.t()), quantize_rows_int8(pb.t())
    x = _rmsnorm.rms_norm_ref(h, norm_w, EPS)
    scores = ((x.double() @ (aq.double() * as_.double()[:, None]).t()) @ (bq.double() * bs.double()[:, None]).t())[0]
    cut = gap_threshold(scores, 0.7, gap=0.05)
    keep = (scores > cut)[None, :]
    assert 0 < int(keep.sum()) < D_INTER
    got = K.dual_block_int8(h, norm_w, EPS, wg, wu, wdt, aq, as_, bq, bs, cut, "silu")
    assert got is not None and got.shape == h.shape
    exact = h.double() + K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, "silu")
    xd = x.double()
    terms = (xd.abs() @ wu.double().abs().t()) * (xd.abs() @ wg.double().abs().t())
    bound = 8 * 2.0**-7 * (h.double().abs() + (terms * keep) @ wdt.double().abs())
    assert ((got.double() - exact).abs() <= bound).all(), float((got.double() - exact).abs().max())
    monkeypatch.setattr(dual, "X_FROM_PREDICTOR", False)
    assert K.dual_block_int8(h, norm_w, EPS, wg, wu, wdt, aq, as_, bq, bs, cut, "silu") is None
