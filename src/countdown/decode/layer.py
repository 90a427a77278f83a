"""A decode step's decoder layer with its RMSNorms on a fixed kernel and the attention's residual add
folded into the output projection.

    from countdown.decode.layer import fold_norms
    fold_norms(model)          # after fuse_attention(model) and route_linears(model, ("qkv",))
    fold_norms(model, False)   # back to transformers' layer forward

Why: in a compiled batch-1 decode step each layer's two RMSNorms are Inductor reductions of their own,
fused with the residual adds before them and tuned per compile, and each breaks the chain of programmatic
dependent launches. A decode step of a folded layer (one token per row, the fused attention path
available, the fixed GEMV serving) is

    x   = RMSNorm_in(h)                    kernels/decode_step/rmsnorm.py
    qkv = x W_qkv^T                        kernels/decode_step/linear.py
    a   = attention(qkv)                   kernels/decode_step/rope_attention.py (rotary, cache write, attention)
    h'  = h + a W_o^T                      kernels/decode_step/linear.py with the residual: no add of its own
    out = h' + mlp(RMSNorm_post(h'))       by the sparse MLP's kernels where its route takes the norm and the
                                           add (:func:`mlp_half`), else the norm on decode_step/rmsnorm.py and
                                           the add on its decode_add

Every other call (the prompt, a dynamic cache, training, batch > 1: kernels/route.py's "linear") runs the
layer's own forward. Only transformers' Llama-style layers are folded (:data:`FOLDABLE`): both norms
must be the weight-times-normalised RMSNorm; :func:`why_not_foldable` names what stops a layer.

So every kernel of a folded layer's step is ours, and programmatic dependent launch (kernels/jit_helpers.py, on
while layers are folded: kernels.config.FOLDED) overlaps each with the one before; that is why the fold is part of
``countdown.decode.linears.fastest_step``. The input norm stays a kernel of its own: folded into the QKV
GEMV (the sum of squares in the GEMV's K loop) it made that GEMV slower than the norm it saved.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .attention import (QKV_FIXED, attend, cache_of, decode_layer, decoder_layers, fused_current, is_fused,
                        qkv_weights, restore_forward)
from ..kernels import config as kernel_config
from ..kernels.route import decode_gemv_serves

FOLDABLE = {"LlamaDecoderLayer": "LlamaRMSNorm", "Qwen2DecoderLayer": "Qwen2RMSNorm",
            "MistralDecoderLayer": "MistralRMSNorm"}
_BEFORE = "_countdown_layer_forward_before"


def why_not_foldable(layer: nn.Module) -> str | None:
    """None if ``layer`` can be folded now, else the reason in a few words."""
    name = type(layer).__name__
    if name not in FOLDABLE:
        return f"{name} is not one of {tuple(FOLDABLE)}"
    attn = getattr(layer, "self_attn", None)
    if attn is None or not is_fused(attn):
        return f"{name}'s attention is not fused (countdown.decode.attention.fuse_attention first)"
    if not getattr(attn, QKV_FIXED, False):
        return f"{name}'s QKV GEMV is not routed (countdown.decode.linears.route_linears(model, ('qkv',)) first)"
    if type(attn.o_proj) is not nn.Linear:
        return f"{name}.self_attn.o_proj is not a plain nn.Linear"
    weight, _ = qkv_weights(attn)
    for which in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, which, None)
        if type(norm).__name__ != FOLDABLE[name] or not hasattr(norm, "variance_epsilon"):
            return f"{name}.{which} is {type(norm).__name__}, not {FOLDABLE[name]}"
        if norm.weight.shape != (weight.shape[1],) or norm.weight.dtype != weight.dtype \
                or norm.weight.device != weight.device:
            return f"{name}.{which}'s weight does not match the QKV weight's input, dtype or device"
    return None


def is_folded(layer: nn.Module) -> bool:
    return hasattr(layer, _BEFORE)


def fold_norms(model: nn.Module, on: bool = True) -> list[str]:
    """Fold (or, ``on=False``, unfold) every foldable decoder layer of ``model``; returns the reasons the
    layers left alone were left alone (empty when every layer is folded)."""
    if on:
        from ..kernels.decode_step import linear, rmsnorm  # noqa: F401  (register the ops the folded forward calls; Triton)
    skipped = []
    for i, layer in enumerate(decoder_layers(model, "fold_norms")):
        if not on:
            if is_folded(layer):
                restore_forward(layer, getattr(layer, _BEFORE))
                delattr(layer, _BEFORE)
                kernel_config.FOLDED.discard(layer)
            continue
        if is_folded(layer):
            continue
        reason = why_not_foldable(layer)
        if reason is not None:
            skipped.append(f"layer {i}: {reason}")
            continue
        setattr(layer, _BEFORE, layer.forward)
        layer.forward = types.MethodType(_folded_forward, layer)
        kernel_config.FOLDED.add(layer)
    return skipped


def fold_layer(layer: nn.Module, forward) -> None:
    """Give ``layer`` another folded ``forward`` (the 4-bit one of countdown.decode.int4_step): PDL on while it is
    folded, undone by ``fold_norms(model, False)`` like the layers folded here."""
    setattr(layer, _BEFORE, layer.forward)
    layer.forward = types.MethodType(forward, layer)
    kernel_config.FOLDED.add(layer)


def _folded_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
    attn = self.self_attn
    routed = fused_current(attn) and getattr(attn, QKV_FIXED, False)  # unfused, replaced or un-routed since: its own
    weight, bias = qkv_weights(attn) if routed else (None, None)
    cache = cache_of(past_key_values, kwargs)
    found = decode_layer(attn, hidden_states, attention_mask, cache, kwargs) if routed else None
    if found is None or position_embeddings is None or not decode_gemv_serves(hidden_states, weight):
        if past_key_values is not None:  # handed on under the name it came with (transformers 5.24: cache)
            kwargs["past_key_values"] = past_key_values
        return getattr(self, _BEFORE)(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                      use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    layer, row = found
    B = hidden_states.shape[0]
    h = hidden_states.reshape(B, -1)
    norm, post = self.input_layernorm, self.post_attention_layernorm
    x = torch.ops.countdown.decode_rms_norm(h, norm.weight, float(norm.variance_epsilon))
    qkv = torch.ops.countdown.decode_linear(x, weight, bias, None)
    a = attend(attn, qkv, layer, row, position_embeddings)
    o = attn.o_proj
    h = torch.ops.countdown.decode_linear(a.reshape(B, -1), o.weight, o.bias, h)
    h = h.view_as(hidden_states)
    return mlp_half(self.mlp, h, post.weight, float(post.variance_epsilon))


def mlp_half(mlp: nn.Module, h: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """A folded layer's ``h + mlp(RMSNorm(h))`` for one decode step's h [B, 1, d_model]: by a sparsified MLP's
    block route where it serves (the norm, the sparse MLP and the add in its own launches: fewer launches than
    three separate steps), else the norm kernel, the module and the add on kernels/decode_step/rmsnorm.py's decode_add
    (a kernel of ours, so the chain of dependent launches reaches across the whole layer)."""
    sparse = getattr(mlp, "countdown_sparse", None)
    if sparse is not None:
        out = sparse.block_forward(h, norm_w, eps)
        if out is not None:
            return out
    x = torch.ops.countdown.decode_rms_norm(h.reshape(h.shape[0], -1), norm_w, eps)
    m = mlp(x.view_as(h))
    if m.dtype == h.dtype:
        return torch.ops.countdown.decode_add(h, m)
    return h + m
