"""One-token attention for Hugging Face models: countdown's split-KV kernel behind transformers' interface.

    from countdown.decode.hf_attention import use_decode_attention
    use_decode_attention(model)          # decode steps use kernels/decode_step/attention.py from now on
    use_decode_attention(model, False)   # back to the implementation the model had

The model stays a transformers model: the kernel is registered under the name ``"countdown_decode"``
in ``transformers.AttentionInterface`` (with SDPA's mask function in ``AttentionMaskInterface``), and
the model is switched with ``set_attn_implementation``. A decode step (one query token, a boolean or
additive mask shared by the heads, no dropout, no soft-capping, CUDA or the Triton interpreter) goes
to ``torch.ops.countdown.decode_attention`` (the mask's last row passed as a view: no kernel builds a
bias first); everything else, the prefill included, to transformers'
own SDPA function, unchanged. Why a kernel of its own: see kernels/decode_step/attention.py (the library kernel
runs one program per head for a single token).
"""

from __future__ import annotations

import torch

from ..kernels.common import available
from ..kernels.route import KERNEL_DTYPES

NAME = "countdown_decode"
_PREVIOUS = "_countdown_attn_before"


@torch.library.custom_op("countdown::decode_attention", mutates_args=())
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    from ..kernels.decode_step import attention

    return attention.decode_attention(q, k, v, mask, scale)


@_decode_op.register_fake
def _(q, k, v, mask, scale):
    return q.new_empty(q.shape)  # the kernel's output is contiguous


def mask_row(mask: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    """The mask of the (last) query row as a [batch, length] view (no copy: bool, True = attend, or
    an additive float mask, as given), or None when the mask differs between heads or does not
    cover ``length`` keys."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != length or mask.shape[0] not in (1, batch):
        return None
    if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        return None
    return mask[:, 0, -1, :].expand(batch, length)


def decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             **kwargs):
    """transformers' attention-function signature: ``(attn_output [B, q, H, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, n_q, D = query.shape
    row = None
    if (n_q == 1 and attention_mask is not None and not dropout and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions") and kwargs.get("position_bias") is None
            and available(query) and key.shape[1] > 0 and H % key.shape[1] == 0
            and query.dtype == key.dtype == value.dtype and query.dtype in KERNEL_DTYPES):  # float64: SDPA
        row = mask_row(attention_mask, B, key.shape[2])
    if row is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = float(scaling) if scaling is not None else D ** -0.5
    out = torch.ops.countdown.decode_attention(query, key, value, row, scale)
    return out.transpose(1, 2).contiguous(), None  # [B, H, 1, D] -> [B, 1, H, D]: a view, no copy


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
