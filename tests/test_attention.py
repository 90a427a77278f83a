"""The one-token split-KV attention (kernels/decode_step/attention.py) and its transformers registration.

Kernel: against float64 softmax attention with repeated KV heads, for grouped heads, ragged valid
lengths per batch row, boolean and additive masks, many splits, a split length that does not divide
the cache, one split (no merge), and the split planner's arithmetic. Integration: a tiny Llama and Qwen2 model decode the same greedy tokens
with the kernel as with SDPA (static cache), and the logits agree to float32 rounding.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from countdown.decode import hf_attention as attention  # noqa: E402
import countdown.kernels as K  # noqa: E402
from countdown.kernels.decode_step import attention as _attention  # noqa: E402
from conftest import assert_same_logits, captured_logits, tiny_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison():
    with K.overrides(poison_outputs=True):
        yield


def _ref(q, k, v, bias, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale + bias.double()[:, None, None, :]
    return torch.softmax(s, -1) @ vv


@pytest.mark.parametrize("B,H,KVH,T,D,valid,config", [
    (2, 8, 2, 70, 64, [50, 70], dict(BLOCK_N=32, SPLITS=3)),          # 3 splits of 32 keys, the last 6
    (1, 4, 4, 33, 32, [1], dict(BLOCK_N=16)),                         # one key only; no grouping
    (3, 6, 2, 129, 80, [129, 64, 7], dict(BLOCK_N=32, SPLITS=2)),     # D not a power of two; 3 heads a group
    (1, 8, 1, 300, 16, [300], dict(BLOCK_N=16, SPLITS=19)),          # 19 splits of one block each
    (1, 8, 2, 300, 32, [290], dict(BLOCK_N=16, SPLITS=7)),           # 3 blocks a split; 300 = 6 x 48 + 12
    (2, 4, 2, 100, 32, [100, 3], dict(BLOCK_N=16, SPLITS=1)),        # one split: writes the output itself
    (1, 16, 2, 90, 32, [90], dict(BLOCK_N=16)),                      # the planner's own choice (8 programs)
    (3, 6, 2, 129, 80, [129, 64, 7], dict(BLOCK_N=16, SPLITS=5, SKIP_MASKED=False)),  # masked keys read
    (1, 8, 2, 300, 32, [290], dict(BLOCK_N=16, SPLITS=1, SKIP_MASKED=False)),
], ids=["gqa4", "one-key", "odd", "many-splits", "ragged-split", "one-split", "planned", "read-masked",
        "read-masked-one-split"])
def test_kernel_against_float64(B, H, KVH, T, D, valid, config):
    torch.manual_seed(T)
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KVH, T, D), torch.randn(B, KVH, T, D)
    keep = torch.arange(T)[None, :] < torch.tensor(valid)[:, None]
    bias = torch.where(keep, 0.0, float("-inf"))
    scale = 1 / math.sqrt(D)
    ref = _ref(q, k, v, bias, scale)
    for b, n in enumerate(valid):  # masked keys skipped or read (SKIP_MASKED=False): NaN there must not leak
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    for mask in (keep, bias):  # boolean and additive forms of the same mask
        out = _attention.decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV), scale, config).cpu()
        assert out.shape == (B, H, 1, D) and out.dtype == torch.float32
        assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("B,KVH,T,config,expect", [
    (1, 8, 8192, dict(BLOCK_N=64, PER_SM=2, MAX_SPLITS=64), (256, 32)),   # H200 (132 SMs): 264 programs wanted, 256 run
    (1, 8, 640, dict(BLOCK_N=64, PER_SM=2, MAX_SPLITS=64), (64, 10)),     # short cache: one block a split
    (4, 8, 4096, dict(BLOCK_N=64, PER_SM=2, MAX_SPLITS=64), (512, 8)),
    (1, 8, 100000, dict(BLOCK_N=64, PER_SM=2, MAX_SPLITS=64), (3072, 33)),  # long cache: 48 blocks a split
    (1, 1, 100000, dict(BLOCK_N=64, PER_SM=2, MAX_SPLITS=64), (1600, 63)),  # 264 wanted, capped by MAX_SPLITS = 64
    (1, 8, 50, dict(BLOCK_N=64, PER_SM=2, MAX_SPLITS=64), (64, 1)),
])
def test_plan_splits(B, KVH, T, config, expect):
    with K.overrides(sm_count=132):  # an H200's SMs
        split_len, n_splits = _attention.plan_splits(B, KVH, T, "cuda", config)
    assert (split_len, n_splits) == expect
    assert split_len % config["BLOCK_N"] == 0 and (n_splits - 1) * split_len < T <= n_splits * split_len


def test_kernel_bf16_strided_cache_and_additive_mask():
    """A static cache viewed through a slice (strided), bf16, a float mask with finite values, and a
    boolean mask broadcast over the batch (stride 0), as transformers passes it."""
    torch.manual_seed(1)
    B, H, KVH, T, D = 2, 4, 2, 48, 32
    big_k, big_v = torch.randn(B, KVH, T + 16, D).bfloat16(), torch.randn(B, KVH, T + 16, D).bfloat16()
    k, v = big_k[:, :, :T], big_v[:, :, :T]
    q = torch.randn(B, H, 1, D).bfloat16()
    bias = torch.randn(B, T) * 2
    bias[1, 40:] = float("-inf")
    for config in (dict(BLOCK_N=16, SPLITS=2), dict(BLOCK_N=16, SPLITS=1)):
        out = _attention.decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), bias.to(DEV), 0.3, config).cpu()
        assert out.dtype == torch.bfloat16
        assert torch.allclose(out.double(), _ref(q, k, v, bias, 0.3), atol=1e-2, rtol=1e-2)
        keep = (torch.arange(T) < 30)[None, None, None, :].expand(B, 1, 1, T)
        row = attention.mask_row(keep, B, T)
        assert row.stride(0) == 0
        out = _attention.decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), row.to(DEV), 0.3, config).cpu()
        ref = _ref(q, k, v, torch.where(keep[:, 0, 0], 0.0, float("-inf")), 0.3)
        assert torch.allclose(out.double(), ref, atol=1e-2, rtol=1e-2)


def test_kernel_bad_input():
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="q \\[B, H, 1, D\\]"):
        _attention.decode_attention(q, k, k, torch.zeros(1, 8), 1.0)
    with pytest.raises(ValueError, match="mask must be bool or float"):
        _attention.decode_attention(q[:, :, :1], k, k, torch.zeros(1, 7), 1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        _attention.decode_attention(q[:, :, :1], k.bfloat16(), k, torch.zeros(1, 8), 1.0)


def test_mask_row():
    m = torch.tensor([[[[True, True, False]]]])
    assert torch.equal(attention.mask_row(m, 2, 3), torch.tensor([[True, True, False]] * 2))
    assert attention.mask_row(m.expand(1, 2, 1, 3), 1, 3) is None  # differs per head: not taken
    assert attention.mask_row(m, 1, 4) is None  # does not cover the keys
    assert attention.mask_row(m.int(), 1, 3) is None  # neither boolean nor additive


NEW = 3  # greedy tokens a decode below generates: two decode steps, the second reading the cache the first wrote


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_decodes_the_same_with_the_kernel(arch):
    model = tiny_model(arch).to(DEV)
    calls = []
    with K.overrides(on_launch=lambda name, *a: calls.append(a[0].shape) if name == "attention" else None):
        _decodes_the_same(arch, model, calls)


def _decodes_the_same(arch, model, calls):
    from countdown.decode.generate import generate_fast

    prompt = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEV)
    before = model.config._attn_implementation
    with captured_logits(model) as ref_steps:
        ref, _ = generate_fast(model, prompt, NEW, compile=False)
    attention.use_decode_attention(model)
    assert model.config._attn_implementation == attention.NAME
    with captured_logits(model) as steps:
        out, _ = generate_fast(model, prompt, NEW, compile=False)
    n_layers = model.config.num_hidden_layers
    assert len(calls) == (NEW - 1) * n_layers  # every decode step of every layer (the prefill stays on SDPA)
    calls.clear()
    assert torch.equal(out, ref)
    assert_same_logits(steps, ref_steps)
    # under torch.compile (fullgraph, the op opaque to Dynamo: its fake gives the shape)
    if arch == "llama":  # one architecture is enough for the compile path (CI time)
        # (its logits not captured: Dynamo would guard on the list they go to, recompiling each step)
        compiled, _ = generate_fast(model, prompt, NEW, compile=True, compile_options={"backend": "aot_eager"})
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
