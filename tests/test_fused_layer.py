"""fold_norms (countdown/decode/layer.py): each layer's RMSNorms on kernels/decode_step/rmsnorm.py, the attention's
residual add into the output projection and the MLP's on that file's decode_add, for batch-1 decode steps; and
the norm kernel itself against transformers' module and float64.

Against the same model with the attention fused and the QKV GEMV routed but nothing folded (itself
tested against transformers in test_fused_attention.py): the same greedy tokens, eager and compiled
through Dynamo, one decode step's logits and the static cache equal to float32 rounding; the folded
GEMV called once per layer per batch-1 decode step and never for the prompt or batch 2; a sparsified
model decodes as before; the prerequisites are named; unfolding, un-routing or unfusing restores the
layer's own forward.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.decode import attention as fused_attention  # noqa: E402
from countdown.decode import layer as fused_layer
from countdown.decode.generate import generate_fast  # noqa: E402
from countdown.decode.linears import route_linears  # noqa: E402
from conftest import assert_same_logits, captured_logits, tiny_model  # noqa: E402
from test_fused_attention import _step_logits_and_cache  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Greedy tokens generated per comparison: two decode steps, the second reading the cache the first wrote (each
# step runs every layer's kernels in the interpreter).
NEW = 3
# The tiny model narrower (d_model 32, two query heads sharing one KV head): the folds do not depend on the
# shapes, and the fused attention and the GEMV, whose programs the interpreter runs one by one, are tested at the
# tiny models' own shapes in test_fused_attention.py and test_linear.py.
NARROW = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
_PROMPT_SEED = 8


def _model_and_prompt(arch):
    model = tiny_model(arch, **NARROW).to(DEV)  # seeded: the same weights at every call
    prompt = torch.randint(3, model.config.vocab_size, (1, 9),
                           generator=torch.Generator().manual_seed(_PROMPT_SEED)).to(DEV)
    return model, prompt


@functools.lru_cache(maxsize=None)
def _unfolded_references(arch):
    """The unfolded decodes the folded ones are compared with, once per architecture (shared by the cases of
    one architecture: nothing folded yet): the attention fused and the
    QKV GEMV routed, dense and then sparsified (mono, 0.5); the greedy tokens, each step's logits, and
    _step_logits_and_cache's logits and cache. Read only by the tests."""
    from countdown import sparsify, unsparsify

    model, prompt = _model_and_prompt(arch)
    fused_attention.fuse_attention(model)
    route_linears(model, ("qkv",))
    with captured_logits(model) as ref_steps:
        ref_tokens, _ = generate_fast(model, prompt, NEW, compile=False)
    ref_logits, ref_cache = _step_logits_and_cache(model, prompt)
    sparsify(model, "mono", 0.5)
    with captured_logits(model) as ref_sparse_steps:
        ref_sparse, _ = generate_fast(model, prompt, NEW, compile=False)
    unsparsify(model)
    return ref_tokens, ref_steps, ref_logits, ref_cache, ref_sparse, ref_sparse_steps


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_folded_layers_decode_as_the_unfolded_ones(arch):
    from countdown import sparsify, unsparsify

    ref_tokens, ref_steps, ref_logits, ref_cache, ref_sparse, ref_sparse_steps = _unfolded_references(arch)
    adds, hits = [], []

    def spy(name, *a):  # the decode_add launches (the MLP's residual) and the norm kernel's (a row each)
        if name == "decode_add":
            adds.append(a[0].shape)
        elif name == "rms_norm":
            hits.append(a[0].shape[0])

    counting = lambda: K.overrides(on_launch=spy)  # noqa: E731
    per_layer = 2  # the two norms
    model, prompt = _model_and_prompt(arch)
    n_layers = model.config.num_hidden_layers
    fused_attention.fuse_attention(model)
    with pytest.raises(ValueError, match="route 'qkv' too"):
        route_linears(model, ("norm",))
    route_linears(model, ("qkv",))
    sparsify(model, "mono", 0.5)  # sparsified and back before the fold, as the references' model was
    unsparsify(model)

    assert route_linears(model, ("norm",)) == n_layers
    assert route_linears(model, ("qkv", "norm")) == 0  # already folded
    with captured_logits(model) as steps, counting():
        out, _ = generate_fast(model, prompt, NEW, compile=False)
    assert torch.equal(out, ref_tokens)
    assert_same_logits(steps, ref_steps)
    assert hits == [1] * ((NEW - 1) * n_layers * per_layer)  # NEW - 1 decode steps; none for the prompt
    assert len(adds) == (NEW - 1) * n_layers  # the MLP's residual on our add
    logits, cache = _step_logits_and_cache(model, prompt)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for (k, v, n), (k0, v0, n0) in zip(cache, ref_cache):
        assert n == n0
        torch.testing.assert_close(k, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v0, atol=1e-5, rtol=1e-5)
    hits.clear()
    with counting():
        generate_fast(model, torch.cat([prompt, prompt]), 2, compile=False)
    assert hits == []  # batch 2: the layer's own forward
    sparsify(model, "mono", 0.5)
    with captured_logits(model) as sparse_steps:
        out_sparse, _ = generate_fast(model, prompt, NEW, compile=False)
    unsparsify(model)
    assert torch.equal(out_sparse, ref_sparse)
    assert_same_logits(sparse_steps, ref_sparse_steps)
    if arch == "llama":  # Dynamo takes the folded forward and our add
        # (its logits not captured: Dynamo would guard on the list they go to, recompiling each step)
        compiled, _ = generate_fast(model, prompt, NEW, compile=True, compile_options={"backend": "aot_eager"})
        assert torch.equal(compiled, ref_tokens)
    hits.clear()
    with counting():
        generate_fast(model, prompt, 2, compile=False)
    assert hits == [1] * (n_layers * per_layer)  # still folded after the compile

    assert route_linears(model, (), on=False) == 2 * n_layers  # the folds and the QKV routes
    assert not any(fused_layer.is_folded(m) for m in model.modules())
    hits.clear()
    with captured_logits(model) as steps, counting():
        out, _ = generate_fast(model, prompt, NEW, compile=False)
    assert hits == [] and torch.equal(out, ref_tokens)
    assert_same_logits(steps, ref_steps)


def test_unfusing_under_a_fold_falls_back_and_other_layers_are_named():
    model = tiny_model("llama").to(DEV)
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2)).to(DEV)
    ref, _ = generate_fast(model, prompt, 4, compile=False)
    skipped = fused_layer.fold_norms(model)
    assert len(skipped) == model.config.num_hidden_layers and "not fused" in skipped[0]
    fused_attention.fuse_attention(model)
    assert "not routed" in fused_layer.fold_norms(model)[0]
    route_linears(model, ("qkv", "norm"))
    fused_attention.fuse_attention(model, False)  # the fold stays, the attention is transformers' again
    out, _ = generate_fast(model, prompt, 4, compile=False)
    assert torch.equal(out, ref)
    fused_layer.fold_norms(model, False)
    assert not any(fused_layer.is_folded(m) for m in model.modules())
    gemma = tiny_model("gemma3").to(DEV)
    assert "Gemma3DecoderLayer is not one of" in fused_layer.fold_norms(gemma)[0]


@pytest.mark.parametrize("t,d,dtype", [(1, 4096, torch.bfloat16), (3, 700, torch.float16), (8, 96, torch.float32)])
def test_rms_norm_kernel_matches_transformers(t, d, dtype):
    """kernels/decode_step/rmsnorm.py against transformers' LlamaRMSNorm on the same input (its two roundings
    included: at most one ulp of bf16 / fp16 apart, from the order of the fp32 sum of squares; in fp32
    a few ulps, rsqrt against 1 / sqrt) and against float64
    (within the two roundings); rows of very different scale; bad shapes named."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from countdown.kernels.decode_step import rmsnorm as _rmsnorm

    x = (torch.randn(t, d) * torch.logspace(-2, 1.5, t)[:, None]).to(dtype).to(DEV)
    module = LlamaRMSNorm(d, eps=1e-5).to(DEV).to(dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(d))
    y = _rmsnorm.rms_norm(x, module.weight.detach(), 1e-5)
    with torch.no_grad():
        want = module(x)
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[dtype]
    assert y.shape == x.shape and y.dtype == dtype
    ulps = 8 if dtype == torch.float32 else 1
    assert ((y.double() - want.double()).abs() <= ulps * ulp * want.double().abs() + 1e-30).all()
    xd = x.double()
    exact = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * module.weight.double()
    assert ((y.double() - exact).abs() <= (ulps + 1) * ulp * exact.abs() + 1e-6).all()
    assert torch.equal(torch.ops.countdown.decode_rms_norm(x, module.weight.detach(), 1e-5), y)
    with pytest.raises(ValueError, match="weight must be"):
        _rmsnorm.rms_norm(x, module.weight.detach()[:-1], 1e-5)
    with pytest.raises(ValueError, match="tokens"):
        _rmsnorm.rms_norm(x.reshape(-1), module.weight.detach(), 1e-5)


@pytest.mark.parametrize("shape,dtype", [((1, 4096), torch.bfloat16), ((3, 1, 700), torch.float16), ((2, 96), torch.float32)])
def test_decode_add_rounds_once_as_pytorch_adds(shape, dtype):
    """kernels/decode_step/rmsnorm.py's decode_add: h + m in fp32 rounded once to the dtype, which is what PyTorch's
    add of two tensors of that dtype gives (bit for bit), and within half an ulp of the float64 sum; a
    mismatch of shapes or dtypes named."""
    from countdown.kernels.decode_step import rmsnorm as _rmsnorm

    g = torch.Generator().manual_seed(5)
    h = (torch.randn(shape, generator=g) * 10).to(dtype).to(DEV)
    m = (torch.randn(shape, generator=g) * 0.1).to(dtype).to(DEV)
    y = _rmsnorm.decode_add(h, m)
    assert y.shape == h.shape and y.dtype == dtype and torch.equal(y, h + m)
    exact = h.double() + m.double()
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]  # half an ulp
    assert ((y.double() - exact).abs() <= ulp * exact.abs() * 1.0001 + 1e-30).all()
    assert torch.equal(torch.ops.countdown.decode_add(h, m), y)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        _rmsnorm.decode_add(h, m[..., :-1])
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        _rmsnorm.decode_add(h, m.double())
