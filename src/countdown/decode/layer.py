"""A decode step's decoder layer with its RMSNorms on a fixed kernel and the attention's residual add
folded into the output projection.

    from countdown.decode.layer import fold_norms
    fold_norms(model)          # after fuse_attention(model) and route_linears(model, ("qkv",))
    fold_norms(model, False)   # back to transformers' layer forward

Why (docs/decode.md, session 13): in a compiled batch-1 decode step each layer's two RMSNorms are
Inductor reductions of their own, fused with the residual adds before them and tuned per compile: 1.9
to 5.5 us a call on an H200 for 16 KB of data, about 0.4 ms of a 2.4-4.3 ms step (`benchmarks/decode.py
--profile`, 2026-11-25). A decode step of a folded layer (one token per row, the fused attention path
available, the fixed GEMV serving) is

    x   = RMSNorm_in(h)                    kernels/_rmsnorm.py (or, FOLD_QKV, folded into the next GEMV)
    qkv = x W_qkv^T                        kernels/_linear.py
    a   = attention(qkv)                   kernels/_rope_attention.py (rotary, cache write, attention)
    h'  = h + a W_o^T                      kernels/_linear.py with the residual: no add of its own
    out = h' + mlp(RMSNorm_post(h'))       the norm on kernels/_rmsnorm.py, the add its decode_add (OWN_ADD);
                                           or all three by the sparse MLP's kernels (FOLD_MLP, kernels/_block.py)

Every other call (the prompt, a dynamic cache, training, batch > DECODE_GEMV_ROUTE_TOKENS) runs the
layer's own forward. Only transformers' Llama-style layers are folded (:data:`FOLDABLE`): both norms
must be the weight-times-normalised RMSNorm; :func:`why_not_foldable` names what stops a layer.

Measured (H200, 2026-11-25): alone, no faster than Inductor's own norms (session 13: dual[lowrank]'s kernels
2.287 against 2.244 ms a step; Inductor's norm kernels 1.9-5.5 us across compiles). With the MLP's residual
add on our kernel too (OWN_ADD), every kernel of a folded layer's step is ours, and programmatic dependent
launch (kernels/_pdl.py, on while layers are folded) overlaps each with the one before: the compiled dense
step 4 % faster, the sparse ones 4-7 % (means of 4-5 runs each; session 14, runs AS-AU,
benchmarks/results/decode_runs/SESSION14.md). So the fold is part of ``decode_gemv.fastest_step`` since.

FOLD_QKV folds the input norm into the QKV GEMV instead (kernels/_linear.py's norm_weight: the sum of
squares in the GEMV's own K loop): measured slower on an H200 (the QKV GEMV 15.4-16.1 us against 15.8 for
a norm kernel plus the plain GEMV; in the step +96-114 us of GEMV for -54 us of norms), so off.
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from .attention import QKV_FIXED, attend, cache_of, decode_layer, decoder_layers, is_fused, qkv_weights
from ..kernels import _common

FOLDABLE = {"LlamaDecoderLayer": "LlamaRMSNorm", "Qwen2DecoderLayer": "Qwen2RMSNorm",
            "MistralDecoderLayer": "MistralRMSNorm"}
_BEFORE = "_countdown_layer_forward_before"
FOLD_QKV = False
# The MLP's residual add on kernels/_rmsnorm.py's decode_add instead of Inductor's (COUNTDOWN_FOLD_ADD=0:
# Inductor's): every kernel of a folded layer's step is then ours, so programmatic dependent launch
# (kernels/_pdl.py, on while layers are folded) reaches across the whole layer (docs/decode.md, session 14).
OWN_ADD = os.environ.get("COUNTDOWN_FOLD_ADD", "1") not in ("", "0")
# A sparsified MLP whose kernel route can take the post-attention norm and the residual add with it gets h and
# returns h + mlp(RMSNorm(h)) (PatchedMLP.block_forward; COUNTDOWN_FOLD_MLP=0: the norm, the MLP and the add as
# before). mono, one token: two launches (kernels/_block.py: the norm inside its sparse kernel, the add in the
# partials' sum) instead of four or five; dual (low-rank, shadow) and cats: the add in the partials' sum. Needs
# OWN_ADD. Measured on an H200 (per-compile mono k = 0.9: 355.5-361.9 against 340.6-350.2 tokens/s; docs/decode.md
# session 22).
FOLD_MLP = os.environ.get("COUNTDOWN_FOLD_MLP", "1") not in ("", "0")


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
    weight, _ = qkv_weights(attn)
    for which in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, which, None)
        if type(norm).__name__ != FOLDABLE[name] or not hasattr(norm, "variance_epsilon"):
            return f"{name}.{which} is {type(norm).__name__}, not {FOLDABLE[name]}"
        if norm.weight.shape != (weight.shape[1],) or norm.weight.dtype != weight.dtype \
                or norm.weight.device != weight.device:
            return f"{name}.{which}'s weight does not match the QKV weight's input, dtype or device"
    if type(attn.o_proj) is not nn.Linear:
        return f"{name}.self_attn.o_proj is not a plain nn.Linear"
    return None


def is_folded(layer: nn.Module) -> bool:
    return hasattr(layer, _BEFORE)


def fold_norms(model: nn.Module, on: bool = True) -> list[str]:
    """Fold (or, ``on=False``, unfold) every foldable decoder layer of ``model``; returns the reasons the
    layers left alone were left alone (empty when every layer is folded)."""
    from ..kernels import _pdl

    if on:
        from ..kernels import _linear, _rmsnorm  # noqa: F401  (register the ops the folded forward calls; Triton)
    skipped = []
    for i, layer in enumerate(decoder_layers(model, "fold_norms")):
        if not on:
            if is_folded(layer):
                layer.forward = getattr(layer, _BEFORE)
                delattr(layer, _BEFORE)
                _pdl.folded.discard(layer)
            continue
        if is_folded(layer):
            continue
        reason = why_not_foldable(layer)
        if reason is not None:
            skipped.append(f"layer {i}: {reason}")
            continue
        setattr(layer, _BEFORE, layer.forward)
        layer.forward = types.MethodType(_folded_forward, layer)
        _pdl.folded.add(layer)
    return skipped


def _folded_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
    attn = self.self_attn
    routed = is_fused(attn) and getattr(attn, QKV_FIXED, False)  # unfused or un-routed since: the layer's own
    weight, bias = qkv_weights(attn) if routed else (None, None)
    cache = cache_of(past_key_values, kwargs)
    found = decode_layer(attn, hidden_states, attention_mask, cache, kwargs) if routed else None
    if found is None or position_embeddings is None or not _common.decode_gemv_serves(hidden_states, weight):
        if past_key_values is not None:  # handed on under the name it came with (transformers 5.24: cache)
            kwargs["past_key_values"] = past_key_values
        return getattr(self, _BEFORE)(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                      use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    layer, row = found
    B = hidden_states.shape[0]
    h = hidden_states.reshape(B, -1)
    norm, post = self.input_layernorm, self.post_attention_layernorm
    if FOLD_QKV:
        qkv = torch.ops.countdown.decode_norm_linear(h, norm.weight, float(norm.variance_epsilon), weight, bias)
    else:
        x = torch.ops.countdown.decode_rms_norm(h, norm.weight, float(norm.variance_epsilon))
        qkv = torch.ops.countdown.decode_linear(x, weight, bias, None)
    a = attend(attn, qkv, layer, row, position_embeddings)
    o = attn.o_proj
    h = torch.ops.countdown.decode_linear(a.reshape(B, -1), o.weight, o.bias, h)
    h = h.view_as(hidden_states)
    slot = getattr(self.mlp, "folded_half", None)  # an opaque slot's (countdown.bench.slots): mlp_half inside
    if slot is not None:
        return slot(h, post.weight, float(post.variance_epsilon))
    return mlp_half(self.mlp, h, post.weight, float(post.variance_epsilon))


def mlp_half(mlp: nn.Module, h: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """A folded layer's ``h + mlp(RMSNorm(h))`` for one decode step's h [B, 1, d_model]: by a sparsified MLP's
    block route where it serves (FOLD_MLP), else the norm kernel, the module and the add (OWN_ADD: decode_add)."""
    sparse = getattr(mlp, "countdown_sparse", None) if FOLD_MLP and OWN_ADD else None
    if sparse is not None:  # the norm, a sparse MLP and the add in two or three launches, where its route serves
        out = sparse.block_forward(h, norm_w, eps)
        if out is not None:
            return out
    x = torch.ops.countdown.decode_rms_norm(h.reshape(h.shape[0], -1), norm_w, eps)
    m = mlp(x.view_as(h))
    if OWN_ADD and m.dtype == h.dtype:
        return torch.ops.countdown.decode_add(h, m)
    return h + m
