"""kernels.threshold_block: a folded decode layer's MLP half, out = h + mlp(RMSNorm(h)), in two launches (the norm
computed inside the one-token kernel, countdown::sparse_mlp_block, the residual added by the partials' sum); the
public ops' ``residual``; the folded layers' routes (kernels.dual_block itself: tests/test_block_norm.py).

Against float64 (h's norm as transformers rounds it, the kept rows' MLP, the add) and, bit for bit under the
interpreter, against the three ops it replaces (the norm kernel, mono's one-launch MLP, decode_add); the
partials' sum with a residual against decode_add of the plain sum; the routes it does not serve answered
None and bad inputs named; in a folded tiny Llama, the decode with the block route gives the tokens and
logits of the decode without it, one block launch per layer per step (eager and through Dynamo).
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels import common  # noqa: E402
from countdown.kernels.decode_step import reference, rmsnorm  # noqa: E402
from countdown.kernels.route import ROUTES  # noqa: E402
from countdown.kernels.sparse_mlp import one_token, partial_sums  # noqa: E402
from countdown.kernels.sparse_mlp.reference import block_ref  # noqa: E402

from _onetoken import gap_threshold, one_token_on  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = DEVICE == "cpu"  # the interpreter sums h's squares in the same order in both kernels
D_MODEL, D_INTER, EPS = 67, 131, 1e-5
# Greedy tokens a folded-model decode generates: two decode steps, the second reading the cache the first wrote
# (each step costs every layer's kernels a run in the interpreter).
NEW = 3
# The folded models' d_inter: odd and prime as the tiny models' 97, smaller because mono's one-launch kernel walks
# its rows a few at a time in the interpreter (the kernels' shapes are the tests above; here the route is tested).
MODEL_D_INTER = 37


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


@pytest.mark.parametrize("dtype,act", [(torch.bfloat16, "silu"), (torch.float16, "gelu_tanh"),
                                       (torch.float32, "silu")])
def test_block_is_the_norm_the_mlp_and_the_add(dtype, act):
    h, norm_w, wg, wu, wdt = _layer(dtype)
    x = reference.rms_norm_ref(h, norm_w, EPS)  # the MLP's input as transformers rounds it
    values = (x @ wu.t()).float().abs()[0]
    thr = gap_threshold(values, 0.7, gap=0.02)  # wide: on a GPU the kernel's x may be an ulp off in places
    keep = (values > thr)[None, :]
    assert 0 < int(keep.sum()) < D_INTER
    got = K.threshold_block(h, norm_w, EPS, wg, wu, wdt, thr, "mono", act)
    assert got is not None and got.shape == h.shape and got.dtype == dtype and not torch.isnan(got).any()
    mlp64 = K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, act)
    exact = h.double() + mlp64
    chain = rmsnorm.decode_add(h, K.mono_gated_mlp(rmsnorm.rms_norm(h, norm_w, EPS), wg, wu, wdt, thr, act))
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}[dtype]
    # the MLP's roundings (u rounded to the dtype, as a GEMV returns it: up to an ulp of each of its terms) and the
    # add's (half an ulp): measured against the size of the terms summed, since they may cancel
    x64 = x.double()
    s64 = torch.where(keep, (x64 @ wu.double().t()) * common.act_torch(x64 @ wg.double().t(), act), 0.0)
    scale = h.double().abs() + s64.abs() @ wdt.double().abs()
    assert ((got.double() - exact).abs() <= ulp * scale + 1e-5).all()
    if EXACT:
        assert torch.equal(got, chain)
    else:
        assert ((got.double() - chain.double()).abs() <= ulp * scale + 1e-5).all()
    no_count = common.op_counters(None, h.device)  # the op's count arguments given, as its callers give them
    assert torch.equal(torch.ops.countdown.sparse_mlp_block(h, norm_w, EPS, wg, wu, wdt, None, thr, "abs", act,
                                                            *no_count), got)
    ref = block_ref(h, norm_w, EPS, wg, wu, wdt, thr, "abs", act)
    assert ((ref.double() - exact).abs() <= 2 * ulp * scale + 1e-5).all()


def test_the_block_serves_only_its_route():
    h, norm_w, wg, wu, wdt = _layer(torch.bfloat16)
    assert K.threshold_block(h, norm_w, EPS, wg, wu, wdt, 0.1, "mono", "silu") is not None
    assert K.threshold_block(torch.cat([h, h]), norm_w, EPS, wg, wu, wdt, 0.1, "mono", "silu") is None  # 2 tokens
    assert K.threshold_block(h, norm_w, EPS, wg, wu, wdt, 0.1, "cats", "silu") is None  # cats: indicator outside
    outside = {("mono_indicator", dev): ROUTES[("cats_indicator", dev)] for dev in ("cuda", "interpreter")}
    with K.overrides(routes=outside):  # mono's indicator computed before the kernel: no block
        assert K.threshold_block(h, norm_w, EPS, wg, wu, wdt, 0.1, "mono", "silu") is None
    with pytest.raises(ValueError, match="'mono' or 'cats'"):
        K.threshold_block(h, norm_w, EPS, wg, wu, wdt, 0.1, "dual", "silu")


def test_bad_norm_inputs_are_named():
    h, norm_w, wg, wu, wdt = _layer(torch.bfloat16)
    with pytest.raises(ValueError, match="norm's weight must be"):
        one_token.one_token_partials(h, wu, wg, wu, wdt, None, 0.1, "abs", "silu", True, False,
                                     norm=(norm_w[:-1], EPS))
    with pytest.raises(ValueError, match="indicator's rows must be"):  # rows that do not read x
        one_token.one_token_partials(h, wu[:, :-1], wg, wu, wdt, None, 0.1, "abs", "silu", True, False,
                                     norm=(norm_w, EPS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_partials_sum_with_a_residual_is_decode_add_of_the_sum(dtype):
    p = torch.randn(7, D_MODEL, device=DEVICE)
    h = (torch.randn(1, D_MODEL, device=DEVICE) * 4).to(dtype)
    got = partial_sums.sum_partials(p, dtype, residual=h)
    assert torch.equal(got, rmsnorm.decode_add(h, partial_sums.sum_partials(p, dtype)))
    total = p.double().sum(0, keepdim=True)
    exact = h.double() + total
    ulp = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-22}[dtype]  # two roundings of half an ulp each
    assert ((got.double() - exact).abs() <= ulp * (h.double().abs() + total.abs()) + 1e-5).all()
    with pytest.raises(ValueError, match="residual must hold"):
        partial_sums.sum_partials(p, dtype, residual=h[:, :-1])


@pytest.mark.parametrize("op", ["mono", "cats", "dual", "shadow"])
@pytest.mark.parametrize("n_tok", [1, 3])
def test_the_residual_is_added_as_decode_add_adds_it(op, n_tok):
    """The public ops' ``residual``: the same bits as decode_add(h, the op without it), on the one-token route
    (the add inside the partials' sum) and on the few-token route (a launch of its own)."""
    d_model, d_inter = (64, 96) if op == "shadow" else (D_MODEL, D_INTER)
    g = torch.Generator().manual_seed(3)
    x, h = ((torch.randn(n_tok, d_model, generator=g) * s).to(torch.bfloat16).to(DEVICE) for s in (1, 3))
    wg, wu, wdt = ((torch.randn(d_inter, d_model, generator=g) * d_model**-0.5).to(torch.bfloat16).to(DEVICE)
                   for _ in range(3))
    if op in ("mono", "cats"):
        run = lambda **kw: getattr(K, f"{op}_gated_mlp")(x, wg, wu, wdt, 0.4, "silu", **kw)  # noqa: E731
    elif op == "dual":
        pa = (torch.randn(d_model, 16, generator=g) / d_model**0.5).to(torch.bfloat16).to(DEVICE)
        pb = (torch.randn(d_inter, 16, generator=g) / 4).to(torch.bfloat16).to(DEVICE).t()
        run = lambda **kw: K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, 0.3, "silu", **kw)  # noqa: E731
    else:
        qg, sg = K.quantize_rtn(wg.float().cpu(), 4, 32)
        qu, su = K.quantize_rtn(wu.float().cpu(), 4, 32)
        prep = {k: v.to(DEVICE) for k, v in K.prepare_shadow(qg, sg, qu, su, 4).items()}
        run = lambda **kw: K.shadow_dual_gated_mlp(x, prep, 0.2, wg, wu, wdt, "silu", **kw)  # noqa: E731
    y = run()
    assert 0 < float(y.abs().sum()) and y.shape == x.shape
    got = run(residual=h)
    assert got.shape == h.shape and torch.equal(got, rmsnorm.decode_add(h, y))


@pytest.mark.parametrize("kind,compiled", [("mono", False), ("mono", True), ("lowrank", False),
                                           ("lowrank-xn", False)])
def test_folded_layers_take_the_block_route(kind, compiled, monkeypatch):
    import countdown
    from countdown.decode import attention as fused_attention
    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import route_linears
    from countdown.patch.patched_mlp import PatchedMLP
    from countdown.selectors.lowrank import LowRankSelector
    from countdown.selectors.threshold import ThresholdSelector
    from countdown.patch.state import state_of
    from conftest import assert_same_logits, captured_logits, tiny_model

    model = tiny_model("llama", intermediate_size=MODEL_D_INTER).to(DEVICE)
    n_layers = model.config.num_hidden_layers
    prompt = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    fused_attention.fuse_attention(model)
    route_linears(model, ("qkv", "norm"))
    countdown.sparsify(model, "mono" if kind == "mono" else "dual", 0.5, path="kernel")
    g = torch.Generator().manual_seed(4)
    for layer in state_of(model).layers:
        if kind == "mono":
            layer.selector = ThresholdSelector(countdown.get_method("mono"), 0.05).to(DEVICE)
        else:  # a stand-in predictor: random factors, a cut that keeps some rows and skips others
            d_model, d_inter = layer.mlp.d_model, layer.mlp.d_inter
            tensors = {"A": torch.randn(d_model, 8, generator=g), "B": torch.randn(8, d_inter, generator=g),
                       "bias": torch.zeros(d_inter), "cut": torch.tensor(0.5)}
            layer.selector = LowRankSelector(tensors, "cut", d_inter // 2).to(DEVICE)
    with monkeypatch.context() as m, captured_logits(model) as ref_logits:  # no block route: the norm kernel,
        m.setattr(PatchedMLP, "block_forward", lambda self, *a: None)  # the module, decode_add
        ref, _ = generate_fast(model, prompt, NEW, compile=False)
    hits = []
    # mono: the norm, the MLP and the add in two launches (the one-token kernel with the norm); dual off the fixed
    # GEMV: the add in the partials' sum; dual_block (the predictor's first GEMV with the norm folded in, which also
    # writes x): no norm kernel
    counted = {"mono": lambda name, *a: name == "one_token" and a[2] is not None,
               "lowrank": lambda name, *a: name == "partial_sums" and a[1] is not None,
               "lowrank-xn": lambda name, *a: name == "linear" and a[3] is not None}[kind]
    more = ("linear",) if kind == "lowrank-xn" else ()
    # (a compiled decode's logits are not captured: Dynamo would guard on the list they go to, recompiling a step)
    with contextlib.nullcontext([]) if compiled else captured_logits(model) as logits, \
            one_token_on("partial_sums", "residual_add", *more), \
            K.overrides(on_launch=lambda *a: hits.append(1) if counted(*a) else None):
        out, _ = generate_fast(model, prompt, NEW, compile=compiled,
                               compile_options={"backend": "aot_eager"} if compiled else None)
    assert torch.equal(out, ref)
    if not compiled:
        assert_same_logits(logits, ref_logits)
        assert len(logits) == NEW  # the prompt's, then one a decode step
        assert len(hits) == (NEW - 1) * n_layers  # NEW - 1 decode steps, none for the prompt
    countdown.unsparsify(model)
    assert not hasattr(model.model.layers[0].mlp, "countdown_sparse")
