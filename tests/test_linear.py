"""The decode GEMV (kernels/decode_step/linear.py) against float64 references, under Triton's interpreter on CPU (on a GPU at the Llama-3.1-8B shapes with
COUNTDOWN_KERNEL_TEST_SHAPES=real). Every output buffer is poisoned with NaN first."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

import countdown.kernels as K  # noqa: E402
from countdown.kernels.decode_step import linear as _linear  # noqa: E402
from countdown.kernels.decode_step.reference import decode_linear_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REAL = os.environ.get("COUNTDOWN_KERNEL_TEST_SHAPES", "") == "real"
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.fixture(autouse=True)
def _poison():
    with K.overrides(poison_outputs=True):
        torch.manual_seed(0)
        yield


SHAPES = [(4096, 4096), (4096, 14336), (6144, 4096)] if REAL else [(40, 96), (33, 700), (64, 512), (19, 1000)]
CASES = [(t, n, k, dt, bias, res) for (n, k) in SHAPES for t, dt, bias, res in
         [(1, torch.bfloat16, False, False), (3, torch.float16, True, True), (8, torch.float32, False, True),
          (2, torch.bfloat16, True, False)]]


@pytest.mark.parametrize("t,n,k,dtype,bias,res", CASES,
                         ids=[f"t{t}-{n}x{k}-{str(d)[6:]}{'-bias' if b else ''}{'-res' if r else ''}"
                              for t, n, k, d, b, r in CASES])
def test_decode_linear_matches_float64(t, n, k, dtype, bias, res):
    """y = residual + x W^T + b within one rounding of the float64 value (fp32 accumulation only
    adds ~K * 2^-24 relative error, far below one ulp of the output dtype) for partial row blocks,
    K not a multiple of the block, 1-8 tokens."""
    x = torch.randn(t, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    r = torch.randn(t, n, device=DEVICE).to(dtype) if res else None
    for config in ({}, dict(BN=8, BK=128, num_stages=1)):
        y = _linear.decode_linear(x, w, b, r, config=config)
        exact = decode_linear_ref(x, w, b, r).double()  # rounded once
        ref64 = x.double() @ w.double().t() + (b.double() if bias else 0) + (r.double() if res else 0)
        assert y.shape == (t, n) and y.dtype == dtype and torch.isfinite(y).all()
        # at most one ulp of the output from the exact value (the rounded reference is within half)
        tol = ULP[dtype] * ref64.abs().clamp_min(1.0) + 1e-6
        assert ((y.double() - ref64).abs() <= tol).all(), (y.double() - ref64).abs().max()
        assert (y.double() - exact).abs().max() <= 2 * tol.max()


NORM_CASES = [(1, 40, 96, torch.bfloat16, False), (3, 33, 700, torch.float16, True), (8, 19, 1000, torch.float32, False)]


@pytest.mark.parametrize("t,n,k,dtype,bias", NORM_CASES, ids=[f"t{c[0]}-{c[1]}x{c[2]}" for c in NORM_CASES])
def test_decode_linear_folds_the_rmsnorm(t, n, k, dtype, bias):
    """y = RMSNorm(x) W^T (+ b), RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g, against float64 (hand-written
    here, not the module's reference): one ulp of the output plus fp32 accumulation; the tokens' norms
    differ (rows scaled by 0.01 to 30), K not a multiple of the block, both the default and a small
    configuration; the op gives the same and names a wrong norm weight."""
    scale = torch.logspace(-2, 1.5, t, device=DEVICE)[:, None]
    x = (torch.randn(t, k, device=DEVICE) * scale).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    g = (1 + 0.5 * torch.randn(k, device=DEVICE)).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    eps = 1e-5
    xd = x.double()
    normed = xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) / k + eps) * g.double()
    ref64 = normed @ w.double().t() + (b.double() if bias else 0)
    for config in ({}, dict(BN=8, BK=128, num_stages=1)):
        y = _linear.decode_linear(x, w, b, None, config=config, norm_weight=g, eps=eps)
        assert y.shape == (t, n) and y.dtype == dtype and torch.isfinite(y).all()
        tol = ULP[dtype] * ref64.abs().clamp_min(1.0) + 1e-5
        assert ((y.double() - ref64).abs() <= tol).all(), (y.double() - ref64).abs().max()
    torch.testing.assert_close(decode_linear_ref(x, w, b, None, g, eps).double(), ref64, rtol=ULP[dtype],
                               atol=1e-5)
    if not bias:  # the op the routes call: the same GEMV, and x = RMSNorm(x) written beside it
        y, xn = torch.ops.countdown.decode_norm_linear_x(x, g, eps, w)
        assert torch.equal(y, _linear.decode_linear(x, w, None, None, norm_weight=g, eps=eps))
        assert xn.shape == x.shape and torch.isfinite(xn).all()
    with pytest.raises(ValueError, match="norm_weight must be"):
        _linear.decode_linear(x, w, b, None, norm_weight=g[:-1])


def test_decode_linear_op_compiles_and_names_bad_input():
    x = torch.randn(1, 96, device=DEVICE)
    w = torch.randn(40, 96, device=DEVICE)
    fn = torch.compile(lambda a, b: torch.ops.countdown.decode_linear(a, b, None, None), backend="aot_eager",
                       fullgraph=True)
    torch.testing.assert_close(fn(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        _linear.decode_linear(torch.randn(9, 96, device=DEVICE), w)
    with pytest.raises(ValueError, match="features"):
        _linear.decode_linear(torch.randn(1, 95, device=DEVICE), w)
    with pytest.raises(ValueError, match="residual"):
        _linear.decode_linear(x, w, residual=torch.randn(1, 41, device=DEVICE))


NEW = 3  # greedy tokens a decode below generates: two decode steps, the second reading the cache the first wrote


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_routed_model_decodes_as_before(arch):
    """route_linears: a tiny model with its down, gate, up and o_proj projections on the fixed GEMV decodes
    the same greedy tokens as before, eager and compiled (the op opaque to Dynamo), with one-step
    logits within float32 rounding; the kernel serves batch-1 decode steps only (batch 2, the prompt
    and gradient-wanting calls keep F.linear); the state dict is untouched and un-routing restores it."""
    from conftest import assert_same_logits, captured_logits, tiny_model

    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import is_routed, route_linears

    model = tiny_model(arch).to(DEVICE)
    prompt = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ref, _ = generate_fast(model, prompt, NEW, compile=False)
    with captured_logits(model) as ref1_steps:
        ref1, _ = generate_fast(model, prompt[:1], NEW, compile=False)
    with torch.no_grad():
        ref_logits = model(prompt).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n_layers = model.config.num_hidden_layers
    assert route_linears(model, ("down", "o_proj", "gate_up")) == 4 * n_layers
    assert route_linears(model, ("down",)) == 0  # already routed
    calls = []
    with K.overrides(on_launch=lambda name, *a: calls.append(a[0].shape[0]) if name == "linear" else None):
        _routed_decodes(arch, model, prompt, ref, ref1, ref1_steps, ref_logits, state, n_layers, calls)


def _routed_decodes(arch, model, prompt, ref, ref1, ref1_steps, ref_logits, state, n_layers, calls):
    from conftest import assert_same_logits, captured_logits

    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import is_routed, route_linears

    out, _ = generate_fast(model, prompt, NEW, compile=False)
    assert torch.equal(out, ref) and calls == []  # batch 2: F.linear (the routes serve one row)
    with captured_logits(model) as steps1:
        out1, _ = generate_fast(model, prompt[:1], NEW, compile=False)
    assert torch.equal(out1, ref1)
    assert_same_logits(steps1, ref1_steps)  # each decode step's, the kernel's GEMVs against F.linear
    assert set(calls) == {1} and len(calls) == 4 * (NEW - 1) * n_layers  # NEW - 1 decode steps, batch 1
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, ref_logits)  # 18 rows: F.linear, bit for bit
    prompt_grad = model(prompt[:1, :2]).logits.sum()  # gradients wanted: F.linear
    prompt_grad.backward()
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)
    if arch == "llama":
        compiled, _ = generate_fast(model, prompt, NEW, compile=True, compile_options={"backend": "aot_eager"})
        assert torch.equal(compiled, ref)
    assert model.state_dict().keys() == state.keys()
    assert route_linears(model, (), on=False) == 4 * n_layers
    assert not any(is_routed(m) for m in model.modules())
    calls.clear()
    again, _ = generate_fast(model, prompt[:1], NEW, compile=False)
    assert torch.equal(again, ref1) and calls == []
    with pytest.raises(ValueError, match="unknown target"):
        route_linears(model, ("gate",))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fastest_step_applies_and_undoes(arch):
    """decode_gemv.fastest_step: fused attention where fusable (Llama; Gemma-3 is left alone and named),
    down / gate_up / o_proj on the fixed GEMV, and qkv only where fused; greedy batch-1 decoding gives
    the same tokens as the plain model, sparsified too; on=False restores every module; and countdown
    bench's wrapper applies it around the timings only when asked."""
    from conftest import assert_same_logits, captured_logits, tiny_model

    from countdown import sparsify, unsparsify
    from countdown.bench.operating import _fast_step
    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import fastest_step, is_routed
    from countdown.decode.attention import QKV_FIXED, is_fused
    from countdown.decode.layer import is_folded

    model = tiny_model(arch).to(DEVICE)
    n_layers = model.config.num_hidden_layers
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with captured_logits(model) as ref_steps:
        ref, _ = generate_fast(model, prompt, NEW, compile=False)
    sparsify(model, "mono", 0.5)
    with captured_logits(model) as ref_sparse_steps:
        ref_sparse, _ = generate_fast(model, prompt, NEW, compile=False)
    unsparsify(model)
    skipped = fastest_step(model)
    fused = sum(is_fused(m) for m in model.modules())
    assert (fused, len(skipped)) == ((n_layers, 0) if arch == "llama" else (0, n_layers))
    assert sum(is_routed(m) for m in model.modules()) == 4 * n_layers
    assert sum(bool(getattr(m, QKV_FIXED, False)) for m in model.modules()) == fused
    assert sum(is_folded(m) for m in model.modules()) == fused  # each fused layer folded (fused_layer)
    from countdown.kernels.config import FOLDED, pdl_wanted

    assert sum(m in FOLDED for m in model.modules()) == fused
    if fused:
        assert pdl_wanted()  # PDL on while layers are folded
    calls = []
    with captured_logits(model) as steps, \
            K.overrides(on_launch=lambda name, *a: calls.append(a[0].shape[0]) if name == "linear" else None):
        out, _ = generate_fast(model, prompt, NEW, compile=False)
    assert torch.equal(out, ref) and calls
    assert_same_logits(steps, ref_steps)
    sparsify(model, "mono", 0.5)
    with captured_logits(model) as sparse_steps:
        out_sparse, _ = generate_fast(model, prompt, NEW, compile=False)
    unsparsify(model)
    assert torch.equal(out_sparse, ref_sparse)
    assert_same_logits(sparse_steps, ref_sparse_steps)
    assert fastest_step(model, on=False) == []
    assert not any(is_routed(m) or is_fused(m) or is_folded(m) or getattr(m, QKV_FIXED, False)
                   for m in model.modules())
    assert not any(m in FOLDED for m in model.modules())  # PDL no longer counts this model
    with _fast_step(model, True):
        assert sum(is_routed(m) for m in model.modules()) == 4 * n_layers
    with _fast_step(model, False):
        assert not any(is_routed(m) for m in model.modules())
    assert not any(is_routed(m) or is_fused(m) for m in model.modules())


def test_fastest_step_leaves_unfoldable_layers_alone():
    """A fused model whose layers cannot be folded (here every post-attention norm is a subclass of
    LlamaRMSNorm, which the fold does not take) still gets the fastest step: no error, no layer folded,
    the same tokens; route_linears(model, ("norm",)) asked for explicitly names the reason instead."""
    from conftest import assert_same_logits, captured_logits, tiny_model
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import fastest_step, route_linears
    from countdown.decode.layer import is_folded

    class OtherNorm(LlamaRMSNorm):
        pass

    model = tiny_model("llama").to(DEVICE)
    for layer in model.model.layers:
        old = layer.post_attention_layernorm
        new = OtherNorm(old.weight.shape[0], eps=old.variance_epsilon).to(old.weight.device, old.weight.dtype)
        new.load_state_dict(old.state_dict())
        layer.post_attention_layernorm = new
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with captured_logits(model) as ref_steps:
        ref, _ = generate_fast(model, prompt, NEW, compile=False)
    assert fastest_step(model) == []
    assert not any(is_folded(m) for m in model.modules())
    with captured_logits(model) as steps:
        out, _ = generate_fast(model, prompt, NEW, compile=False)
    assert torch.equal(out, ref)
    assert_same_logits(steps, ref_steps)
    with pytest.raises(ValueError, match="OtherNorm"):
        route_linears(model, ("norm",))
    fastest_step(model, on=False)


def test_pdl_is_on_while_layers_are_folded_and_never_under_the_interpreter():
    import weakref

    from countdown.kernels.config import pdl_wanted
    from countdown.kernels.config import launch_kwargs, pdl_active, pdl_mode

    x = torch.zeros(1, 8, device=DEVICE)
    folded = weakref.WeakSet()  # a registry of its own (config.FOLDED may hold another test's folded layers)
    assert not pdl_wanted(folded) and not pdl_active(x, folded)
    with K.overrides(pdl=False):
        assert pdl_mode(x) == 0
    assert launch_kwargs(False) == {} and launch_kwargs(True) == {"launch_pdl": True}
    layer = torch.nn.Linear(1, 1)
    folded.add(layer)
    assert pdl_wanted(folded)
    if not torch.cuda.is_available():  # CPU / TRITON_INTERPRET: the grid-dependency ops do not exist there
        assert not pdl_active(x, folded)
        with K.overrides(pdl=True):  # wanted, and still off under the interpreter
            assert pdl_wanted() and pdl_mode(x) == 0
    elif torch.cuda.get_device_capability()[0] >= 9:
        assert pdl_active(x, folded)
        with K.overrides(pdl=True):
            assert pdl_mode(x) == 1  # every program signals at its start


def test_weights_early_only_for_grids_that_fit_at_once():
    """The fixed GEMV loads its first weight tile before the wait only when all its programs are resident at
    once: 132 SMs x min(32, 64 // warps) programs (8 warps: 1056; 1 warp: 4224)."""
    from types import SimpleNamespace

    from countdown.kernels.config import weights_early

    t = SimpleNamespace(device=torch.device("cuda", 0))
    with K.overrides(sm_count=132):  # an H100 / H200
        assert weights_early(t, 1056, 8) and not weights_early(t, 1057, 8)
        assert weights_early(t, 4224, 1) and not weights_early(t, 4225, 1)
        assert not weights_early(t, 6144, 8)  # Llama-3.1-8B's QKV GEMV: many waves
        assert weights_early(t, 512, 8) and weights_early(t, 3584, 1)  # the predictor's x A, (x A) B
