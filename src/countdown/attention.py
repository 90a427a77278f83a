"""One-token attention for Hugging Face models: countdown's split-KV kernel behind transformers' interface.

    from countdown.attention import use_decode_attention
    use_decode_attention(model)          # decode steps use kernels/_attention.py from now on
    use_decode_attention(model, False)   # back to the implementation the model had

The model stays a transformers model: the kernel is registered under the name ``"countdown_decode"``
in ``transformers.AttentionInterface`` (with SDPA's mask function in ``AttentionMaskInterface``), and
the model is switched with ``set_attn_implementation``. A decode step (one query token, a boolean or
additive mask shared by the heads, no dropout, no soft-capping, CUDA or the Triton interpreter) goes
to ``torch.ops.countdown.decode_attention``; everything else, the prefill included, to transformers'
own SDPA function, unchanged. Why a kernel of its own: see kernels/_attention.py (the library kernel
runs one program per head for a single token).
"""

from __future__ import annotations

import torch

from .kernels import _common

NAME = "countdown_decode"
_PREVIOUS = "_countdown_attn_before"


@torch.library.custom_op("countdown::decode_attention", mutates_args=())
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    from .kernels import _attention

    return _attention.decode_attention(q, k, v, bias, scale)


@_decode_op.register_fake
def _(q, k, v, bias, scale):
    return torch.empty_like(q)


def mask_bias(mask: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    """The mask of the (last) query row as a float32 additive bias [batch, length], or None when
    the mask differs between heads or does not cover ``length`` keys."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != length or mask.shape[0] not in (1, batch):
        return None
    row = mask[:, 0, -1, :]
    if row.dtype == torch.bool:
        bias = torch.zeros(row.shape, dtype=torch.float32, device=row.device).masked_fill(~row, float("-inf"))
    else:
        bias = row.float()
    return bias.expand(batch, length)


def decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             **kwargs):
    """transformers' attention-function signature: ``(attn_output [B, q, H, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, n_q, D = query.shape
    bias = None
    if (n_q == 1 and attention_mask is not None and not dropout and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions") and _common.available(query)
            and key.shape[1] > 0 and H % key.shape[1] == 0):
        bias = mask_bias(attention_mask, B, key.shape[2])
    if bias is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = float(scaling) if scaling is not None else D ** -0.5
    out = torch.ops.countdown.decode_attention(query, key, value, bias, scale)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``"countdown_decode"`` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_decode_attention(model, on: bool = True):
    """Switch ``model`` (a transformers model) to the one-token kernel, or back (``on=False``) to the
    attention implementation it had before; returns the model."""
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"use_decode_attention takes a transformers model, got {type(model).__name__}")
    current = getattr(model.config, "_attn_implementation", None)
    if on:
        register()
        if current != NAME:
            setattr(model, _PREVIOUS, current or "sdpa")
            model.set_attn_implementation(NAME)
    elif current == NAME:
        model.set_attn_implementation(getattr(model, _PREVIOUS, "sdpa"))
    return model
