"""fuse_attention (countdown/fused_attention.py): one QKV GEMV + the fused rope/cache/attention kernel.

Against transformers' own forward on the same model: the same greedy tokens from generate_fast
(eager, with each step's logits, and compiled through Dynamo with the op opaque), one decode step's logits and the whole
static cache after it equal to float32 rounding, the kernel called once per layer per decode step
(never for the prompt); the weights are shared, not copied (parameter bytes unchanged, the same
state-dict keys and values) and unfusing gives each projection its own storage back. Modules of
other layouts are left alone with the reason.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from countdown.decode import hf_attention as attention  # noqa: E402
from countdown.decode import attention as fused_attention
import countdown.kernels as K  # noqa: E402
from conftest import assert_same_logits, captured_logits, tiny_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Greedy tokens generated per decode compared below: two decode steps, the second reading the cache the first
# wrote (each step runs every layer's kernels in the interpreter), their logits compared step by step; the
# three steps of _step_logits_and_cache add the cache's contents.
NEW = 3


def _step_logits_and_cache(model, prompt):
    from transformers import StaticCache

    from countdown.decode.cache import cache_kwargs

    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=32)
        model(prompt, **cache_kwargs(cache), use_cache=True)
        out = None
        for i in range(3):  # three decode steps: positions 9, 10, 11
            pos = prompt.shape[1] + i
            out = model(prompt[:, -1 - i:prompt.shape[1] - i], **cache_kwargs(cache), use_cache=True,
                        cache_position=torch.tensor([pos], device=DEV))
        return out.logits.float().cpu(), [(layer.keys.cpu(), layer.values.cpu(), int(layer.cumulative_length))
                                          for layer in cache.layers]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_model_decodes_as_transformers(arch):
    from countdown.decode.generate import generate_fast

    model = tiny_model(arch).to(DEV)
    prompt = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEV)
    with captured_logits(model) as ref_steps:
        ref_tokens, _ = generate_fast(model, prompt, NEW, compile=False)
    ref_logits, ref_cache = _step_logits_and_cache(model, prompt)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    from harness.weightbytes import model_bytes  # the decode benchmark's count of the bytes a model holds
    model_bytes_before = model_bytes(model)

    assert fused_attention.fuse_attention(model) == []
    assert model.config._attn_implementation == attention.NAME
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == n_param_bytes
    assert model_bytes(model) == model_bytes_before  # q/k/v views and their buffer: one storage, counted once
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())

    calls = []
    with captured_logits(model) as steps, \
            K.overrides(on_launch=lambda name, *a: calls.append(a[0].shape) if name == "rope_attention" else None):
        out, _ = generate_fast(model, prompt, NEW, compile=False)
    assert torch.equal(out, ref_tokens)
    assert_same_logits(steps, ref_steps)
    assert len(calls) == (NEW - 1) * model.config.num_hidden_layers  # each decode step, each layer; the prompt not
    logits, cache = _step_logits_and_cache(model, prompt)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for (k, v, n), (k_ref, v_ref, n_ref) in zip(cache, ref_cache):
        assert n == n_ref == 12
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
    if arch == "llama":  # the compiled step: the op opaque to Dynamo, its mutations functionalised
        # (its logits not captured: Dynamo would guard on the list they go to, recompiling each step)
        compiled, _ = generate_fast(model, prompt, NEW, compile=True, compile_options={"backend": "aot_eager"})
        assert torch.equal(compiled, ref_tokens)

    fused_attention.fuse_attention(model, False)
    assert model.config._attn_implementation != attention.NAME
    assert not fused_attention.is_fused(attn)
    assert attn.k_proj.weight.untyped_storage().data_ptr() != attn.q_proj.weight.untyped_storage().data_ptr()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with captured_logits(model) as steps:
        again, _ = generate_fast(model, prompt, NEW, compile=False)
    assert torch.equal(again, ref_tokens)
    assert_same_logits(steps, ref_steps)


def test_other_layouts_are_left_alone_with_the_reason():
    model = tiny_model("gemma3")
    skipped = fused_attention.fuse_attention(model)
    assert len(skipped) == model.config.num_hidden_layers and "Gemma3Attention is not one of" in skipped[0]
    assert not any(fused_attention.is_fused(layer.self_attn) for layer in model.model.layers)
    with pytest.raises(TypeError, match="fuse_attention takes a transformers decoder"):
        fused_attention.fuse_attention(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_qkv_on_the_fixed_gemv(arch):
    """route_linears(model, ("qkv",)): the fused attention's QKV GEMV (with Qwen2's bias) on
    kernels/decode_step/linear.py for the decode steps: the same greedy tokens and step logits as the fused
    path on F.linear, one call per layer per batch-1 decode step (batch 2 keeps F.linear); it needs
    fuse_attention first (named), and un-routing or unfusing drops it."""
    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import route_linears

    model = tiny_model(arch).to(DEV)
    prompt = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5)).to(DEV)
    with pytest.raises(ValueError, match="fuse_attention"):
        route_linears(model, ("qkv",))
    fused_attention.fuse_attention(model)
    with captured_logits(model) as ref_steps:
        ref_tokens, _ = generate_fast(model, prompt, NEW, compile=False)
    n_layers = model.config.num_hidden_layers
    assert route_linears(model, ("qkv",)) == n_layers
    calls = []
    spy = lambda: K.overrides(on_launch=lambda name, *a: calls.append((a[0].shape[0], a[2] is not None))  # noqa: E731
                              if name == "linear" else None)
    with captured_logits(model) as steps, spy():
        out, _ = generate_fast(model, prompt, NEW, compile=False)
    assert torch.equal(out, ref_tokens)
    assert_same_logits(steps, ref_steps)  # the prompt's logits, then each decode step's
    assert calls == [(1, arch == "qwen2")] * ((NEW - 1) * n_layers)
    calls.clear()
    with spy():
        generate_fast(model, torch.cat([prompt, prompt]), 2, compile=False)  # one decode step
    assert calls == []  # batch 2 keeps F.linear (the routes serve one row)
    assert route_linears(model, (), on=False) == n_layers
    calls.clear()
    with spy():
        generate_fast(model, prompt, 2, compile=False)
    assert calls == []
    route_linears(model, ("qkv",))
    fused_attention.fuse_attention(model, False)  # unfusing drops the route with the fused forward
    assert not any(hasattr(m, fused_attention.QKV_FIXED) for m in model.modules())
