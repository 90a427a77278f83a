"""Tiny randomly initialised models of every supported architecture, built offline."""

import os

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. Triton reads this
# when a kernel module is first imported, so it is set before any test imports one.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

# d_inter = 97 is odd and prime on purpose: no method may assume divisibility.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=97, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(**_COMMON, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**_COMMON),
}

ARCHS = list(TINY_CONFIGS)


def tiny_model(arch: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch]())
    # Random init leaves some norms at exactly 1 and biases at 0: perturb every parameter so that
    # gate and up, and every layer, differ and no computation is accidentally trivial.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.to(dtype).eval()


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param
