"""The one-token split-KV attention (kernels/_attention.py) and its transformers registration.

Kernel: against float64 softmax attention with repeated KV heads, for grouped heads, ragged valid
lengths per batch row, a length that is not a multiple of the chunk, several chunk sizes and an
additive (float) mask. Integration: a tiny Llama and Qwen2 model decode the same greedy tokens
with the kernel as with SDPA (static cache), and the logits agree to float32 rounding.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from countdown import attention  # noqa: E402
from countdown.kernels import _attention, _common  # noqa: E402
from conftest import tiny_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)


def _ref(q, k, v, bias, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale + bias.double()[:, None, None, :]
    return torch.softmax(s, -1) @ vv


@pytest.mark.parametrize("B,H,KVH,T,D,valid,config", [
    (2, 8, 2, 70, 64, [50, 70], dict(CHUNK=32, BLOCK_T=32)),
    (1, 4, 4, 33, 32, [1], dict(CHUNK=16, BLOCK_T=16)),        # one key only; no grouping
    (3, 6, 2, 129, 80, [129, 64, 7], dict(CHUNK=64, BLOCK_T=32)),  # D not a power of two; 3 heads a group
    (1, 8, 1, 300, 16, [300], dict(CHUNK=16, BLOCK_T=16)),      # 19 chunks: the combine loops twice
], ids=["gqa4", "one-key", "odd", "many-chunks"])
def test_kernel_against_float64(B, H, KVH, T, D, valid, config):
    torch.manual_seed(T)
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KVH, T, D), torch.randn(B, KVH, T, D)
    bias = torch.where(torch.arange(T)[None, :] < torch.tensor(valid)[:, None], 0.0, float("-inf"))
    scale = 1 / math.sqrt(D)
    out = _attention.decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), bias.to(DEV), scale, config).cpu()
    assert out.shape == (B, H, 1, D) and out.dtype == torch.float32
    assert torch.allclose(out.double(), _ref(q, k, v, bias, scale), atol=2e-6, rtol=1e-5)


def test_kernel_bf16_strided_cache_and_additive_mask():
    """A static cache viewed through a slice (strided), bf16, and a float mask with finite values."""
    torch.manual_seed(1)
    B, H, KVH, T, D = 2, 4, 2, 48, 32
    big_k, big_v = torch.randn(B, KVH, T + 16, D).bfloat16(), torch.randn(B, KVH, T + 16, D).bfloat16()
    k, v = big_k[:, :, :T], big_v[:, :, :T]
    q = torch.randn(B, H, 1, D).bfloat16()
    bias = torch.randn(B, T) * 2
    bias[1, 40:] = float("-inf")
    out = _attention.decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), bias.to(DEV), 0.3).cpu()
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), _ref(q, k, v, bias, 0.3), atol=1e-2, rtol=1e-2)


def test_kernel_bad_input():
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="one query token|q \\[B, H, 1, D\\]"):
        _attention.decode_attention(q, k, k, torch.zeros(1, 8), 1.0)
    with pytest.raises(ValueError, match="bias must be float32"):
        _attention.decode_attention(q[:, :, :1], k, k, torch.zeros(1, 7), 1.0)


def test_mask_bias():
    m = torch.tensor([[[[True, True, False]]]])
    assert torch.equal(attention.mask_bias(m, 2, 3), torch.tensor([[0.0, 0.0, float("-inf")]] * 2))
    assert attention.mask_bias(m.expand(1, 2, 1, 3), 1, 3) is None  # differs per head: not taken
    assert attention.mask_bias(m, 1, 4) is None  # does not cover the keys


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_decodes_the_same_with_the_kernel(arch, monkeypatch):
    from countdown.decode import generate_fast

    model = tiny_model(arch).to(DEV)
    calls = []
    real = _attention.decode_attention
    monkeypatch.setattr(_attention, "decode_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    prompt = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEV)
    before = model.config._attn_implementation
    ref, _ = generate_fast(model, prompt, 6, compile=False)
    attention.use_decode_attention(model)
    assert model.config._attn_implementation == attention.NAME
    out, _ = generate_fast(model, prompt, 6, compile=False)
    n_layers = model.config.num_hidden_layers
    assert len(calls) == 5 * n_layers  # every decode step of every layer (the prefill stays on SDPA)
    calls.clear()
    assert torch.equal(out, ref)
    # under torch.compile (fullgraph, the op opaque to Dynamo: its fake gives the shape)
    if arch == "llama":  # one architecture is enough for the compile path (CI time)
        compiled, _ = generate_fast(model, prompt, 6, compile=True, compile_options={"backend": "aot_eager"})
        assert torch.equal(compiled, ref)
    with torch.no_grad():  # one decode step's logits, kernel against SDPA on the same cache contents
        from transformers import StaticCache
        logits = {}
        for impl in (attention.NAME, before):
            model.set_attn_implementation(impl)
            cache = StaticCache(config=model.config, max_cache_len=32)
            model(prompt, past_key_values=cache, use_cache=True)
            step = model(prompt[:, -1:], past_key_values=cache, use_cache=True,
                         cache_position=torch.tensor([prompt.shape[1]], device=DEV))
            logits[impl] = step.logits.float().cpu()
        assert torch.allclose(logits[attention.NAME], logits[before], atol=1e-4, rtol=1e-4)
    attention.use_decode_attention(model, False)
    assert model.config._attn_implementation == before
