"""A decode step's decoder layer with its input RMSNorm folded into the QKV GEMV and the attention's
residual add folded into the output projection.

    from countdown.fused_layer import fold_norms
    fold_norms(model)          # after fuse_attention(model) and route_linears(model, ("qkv",))
    fold_norms(model, False)   # back to transformers' layer forward

Why (docs/decode.md, "The norms folded"): in a compiled batch-1 decode step each layer's two RMSNorms
are Inductor reductions of their own, fused with the residual adds before them: 3.5-4.3 us each on an
H200 for 16 KB of data, about 0.45 ms of a 2.5-4.3 ms step (`benchmarks/decode.py --profile`,
2026-11-25), while the GEMV that follows each one reads its whole input anyway. Here a decode step
of a folded layer (one token per row, the fused attention path available, the fixed GEMV serving) is

    qkv = RMSNorm_in(h) W_qkv^T            one launch: kernels/_linear.py with the norm folded in
    a   = attention(qkv)                   kernels/_rope_attention.py (rotary, cache write, attention)
    h'  = h + a W_o^T                      one launch: the fixed GEMV with the residual
    out = h' + mlp(RMSNorm_post(h'))       as transformers computes it (Inductor: the norm, the add)

so the input norm has no kernel of its own and the attention's residual add none either. Every other
call (the prompt, a dynamic cache, training, batch > DECODE_GEMV_ROUTE_TOKENS) runs the layer's own
forward. Only transformers' Llama-style layers are folded (:data:`FOLDABLE`): the norm before the
attention must be the weight-times-normalised RMSNorm and nothing else may run between it and the
attention; :func:`why_not_foldable` names what stops a layer.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .fused_attention import QKV_FIXED, attend, decode_layer, is_fused, qkv_weights
from .kernels import _common

FOLDABLE = {"LlamaDecoderLayer": "LlamaRMSNorm", "Qwen2DecoderLayer": "Qwen2RMSNorm",
            "MistralDecoderLayer": "MistralRMSNorm"}
_BEFORE = "_countdown_layer_forward_before"


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"fold_norms takes a transformers decoder (model.model.layers), got {type(model).__name__}")
    return list(layers)


def why_not_foldable(layer: nn.Module) -> str | None:
    """None if ``layer`` can be folded now, else the reason in a few words."""
    name = type(layer).__name__
    if name not in FOLDABLE:
        return f"{name} is not one of {tuple(FOLDABLE)}"
    attn = getattr(layer, "self_attn", None)
    if attn is None or not is_fused(attn):
        return f"{name}'s attention is not fused (countdown.fused_attention.fuse_attention first)"
    if not getattr(attn, QKV_FIXED, False):
        return f"{name}'s QKV GEMV is not routed (countdown.decode_gemv.route_linears(model, ('qkv',)) first)"
    norm = getattr(layer, "input_layernorm", None)
    if type(norm).__name__ != FOLDABLE[name] or not hasattr(norm, "variance_epsilon"):
        return f"{name}.input_layernorm is {type(norm).__name__}, not {FOLDABLE[name]}"
    weight, _ = qkv_weights(attn)
    if norm.weight.shape != (weight.shape[1],) or norm.weight.device != weight.device:
        return f"{name}.input_layernorm's weight does not match the QKV weight's input"
    if type(attn.o_proj) is not nn.Linear:
        return f"{name}.self_attn.o_proj is not a plain nn.Linear"
    return None


def is_folded(layer: nn.Module) -> bool:
    return hasattr(layer, _BEFORE)


def fold_norms(model: nn.Module, on: bool = True) -> list[str]:
    """Fold (or, ``on=False``, unfold) every foldable decoder layer of ``model``; returns the reasons the
    layers left alone were left alone (empty when every layer is folded)."""
    skipped = []
    for i, layer in enumerate(_layers(model)):
        if not on:
            if is_folded(layer):
                layer.forward = getattr(layer, _BEFORE)
                delattr(layer, _BEFORE)
            continue
        if is_folded(layer):
            continue
        reason = why_not_foldable(layer)
        if reason is not None:
            skipped.append(f"layer {i}: {reason}")
            continue
        setattr(layer, _BEFORE, layer.forward)
        layer.forward = types.MethodType(_folded_forward, layer)
    return skipped


def _folded_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
    attn = self.self_attn
    routed = is_fused(attn) and getattr(attn, QKV_FIXED, False)  # unfused or un-routed since: the layer's own
    weight, bias = qkv_weights(attn) if routed else (None, None)
    found = decode_layer(attn, hidden_states, attention_mask, past_key_values, kwargs) if routed else None
    if found is None or position_embeddings is None or not _common.decode_gemv_serves(hidden_states, weight):
        return getattr(self, _BEFORE)(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=past_key_values, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    layer, row = found
    B = hidden_states.shape[0]
    h = hidden_states.reshape(B, -1)
    norm = self.input_layernorm
    qkv = torch.ops.countdown.decode_norm_linear(h, norm.weight, float(norm.variance_epsilon), weight, bias)
    a = attend(attn, qkv, layer, row, position_embeddings)
    o = attn.o_proj
    h = torch.ops.countdown.decode_linear(a.reshape(B, -1), o.weight, o.bias, h).view_as(hidden_states)
    return h + self.mlp(self.post_attention_layernorm(h))
