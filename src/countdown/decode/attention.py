"""The attention block of a decode step in three launches: one QKV GEMV, rotary + cache write + attention, merge.

    from countdown.decode.attention import fuse_attention
    fuse_attention(model)            # Llama / Qwen2 / Mistral attention: decode steps take the fused path
    fuse_attention(model, False)     # back to transformers' forward and separate q/k/v weights

What changes, per attention module (the model stays a transformers model, its cache a
``StaticCache``): q_proj, k_proj and v_proj keep their parameters, but as views into one
concatenated weight [(H + 2 KVH) D, d_model] (a non-persistent buffer: no extra memory, nothing
new in the state dict), and the module's forward becomes :func:`_fused_forward`. A decode step (one
token, a ``StaticCache`` layer already filled by the prompt, a mask shared by the heads, CUDA or the
Triton interpreter) computes ``qkv = x W_qkv^T`` in one GEMV (Inductor fuses the RMSNorm before it)
and hands it to ``torch.ops.countdown.rope_decode_attention`` (kernels/decode_step/rope_attention.py): the
rotary embedding, the cache write at the layer's ``cumulative_length`` (incremented, as transformers'
``StaticLayer.update`` does) and the split-KV attention in two kernels. Everything else (the prompt,
a dynamic cache, training) runs the module's own forward, unchanged.

Against transformers' path under torch.compile this removes, per layer and step, two GEMVs (k and v
have their own), the rotary and cache-write kernels and the length increment: see docs/decode.md.
Only modules whose forward is known to be transformers' Llama one are fused (:data:`FUSABLE`); the
others are left alone and named by :func:`fuse_attention`'s return value.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import StaticLayer

from .hf_attention import NAME, mask_row, use_decode_attention
from ..kernels.common import available
from ..kernels.route import KERNEL_DTYPES, decode_gemv_serves

FUSABLE = ("LlamaAttention", "Qwen2Attention", "MistralAttention")  # rotate_half rotary, q/k/v/o Linear
_BEFORE = "_countdown_forward_before"
_WEIGHT, _BIAS = "_countdown_wqkv", "_countdown_bqkv"
_SWITCHED = "_countdown_fused_switched_attention"
_QKV4 = "_countdown_qkv4"  # a 4-bit attention's stacked QKV Int4Linear (in __dict__: not a submodule)
_PART = "_countdown_qkv_part"  # on q_proj / k_proj / v_proj while their weights are views of the stacked one
QKV_FIXED = "_countdown_qkv_fixed"  # set by countdown.decode.linears.route_linears(model, ("qkv",))


@torch.library.custom_op("countdown::rope_decode_attention", mutates_args=("k_cache", "v_cache", "pos"))
def _rope_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             pos: torch.Tensor, mask: torch.Tensor, scale: float, n_heads: int) -> torch.Tensor:
    from ..kernels.decode_step import rope_attention

    return rope_attention.rope_decode_attention(qkv, cos, sin, k_cache, v_cache, pos, mask, scale, n_heads)


@_rope_op.register_fake
def _(qkv, cos, sin, k_cache, v_cache, pos, mask, scale, n_heads):
    return k_cache.new_empty((k_cache.shape[0], n_heads, k_cache.shape[-1]))


def why_not_fusable(module: nn.Module) -> str | None:
    """None if ``module`` can be fused, else the reason in a few words."""
    name = type(module).__name__
    if name not in FUSABLE:
        return f"{name} is not one of {FUSABLE}"
    kinds = {proj: _kind(getattr(module, proj, None)) for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for proj, kind in kinds.items():
        if kind is None:
            return f"{name}.{proj} is neither a plain nn.Linear nor a 4-bit Int4Linear (sharded?)"
    if len({kinds["q_proj"], kinds["k_proj"], kinds["v_proj"]}) > 1:
        return f"{name}: some of q/k/v are 4-bit and some are not"
    if kinds["q_proj"] == "int4":
        q, k, v = module.q_proj, module.k_proj, module.v_proj
        if len({(m.group, m.scale.dtype, m.qweight.device, m.compute_dtype, m.bias is None) for m in (q, k, v)}) > 1:
            return f"{name}'s 4-bit q/k/v differ in group, scale dtype, device, dtype or bias"
        return None
    if getattr(module, "sliding_window", None):
        return f"{name} uses a sliding window"
    q, k, v = module.q_proj, module.k_proj, module.v_proj
    if not (q.weight.device == k.weight.device == v.weight.device and q.weight.dtype == k.weight.dtype == v.weight.dtype):
        return f"{name}'s q/k/v weights differ in device or dtype"
    if (q.bias is None) != (k.bias is None) or (q.bias is None) != (v.bias is None):
        return f"{name}: some of q/k/v have a bias and some do not"
    return None


def _kind(linear) -> str | None:
    """"linear" for a plain nn.Linear, "int4" for a 4-bit one (countdown.int4), else None."""
    from ..int4 import Int4Linear

    if type(linear) is nn.Linear:
        return "linear"
    return "int4" if isinstance(linear, Int4Linear) else None


def decoder_layers(model: nn.Module, caller: str) -> list[nn.Module]:
    """``model.model.layers`` of a transformers decoder; a TypeError naming ``caller`` for anything else."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{caller} takes a transformers decoder (model.model.layers), got {type(model).__name__}")
    return list(layers)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in decoder_layers(model, "fuse_attention") if hasattr(layer, "self_attn")]


def _fuse(attn: nn.Module) -> None:
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    for proj in (q, k, v):
        proj.__dict__[_PART] = True
    if _kind(q) == "int4":  # one stacked 4-bit Linear whose buffers q, k and v view
        from ..int4 import stack

        attn.__dict__[_QKV4] = stack([q, k, v])
    else:
        with torch.no_grad():
            weight = torch.cat([q.weight, k.weight, v.weight], 0)
            bias = torch.cat([q.bias, k.bias, v.bias], 0) if q.bias is not None else None
        attn.register_buffer(_WEIGHT, weight, persistent=False)
        attn.register_buffer(_BIAS, bias, persistent=False)
        rows = [q.out_features, k.out_features, v.out_features]
        for proj, w in zip((q, k, v), weight.split(rows, 0)):
            proj.weight = nn.Parameter(w, requires_grad=proj.weight.requires_grad)
        if bias is not None:
            for proj, b in zip((q, k, v), bias.split(rows, 0)):
                proj.bias = nn.Parameter(b, requires_grad=proj.bias.requires_grad)
    setattr(attn, _BEFORE, attn.forward)
    attn.forward = types.MethodType(_fused_forward, attn)


def _unfuse(attn: nn.Module) -> None:
    """Undo :func:`_fuse`; a projection replaced since (``countdown.quantize``) holds nothing of ours and is left as
    it is."""
    parts = [proj for proj in (attn.q_proj, attn.k_proj, attn.v_proj) if proj.__dict__.pop(_PART, False)]
    if attn.__dict__.pop(_QKV4, None) is not None:
        for proj in parts:  # own storage again
            for name, buf in list(proj._buffers.items()):
                proj._buffers[name] = buf.clone()
    else:
        for proj in parts:  # own storage again
            proj.weight = nn.Parameter(proj.weight.detach().clone(), requires_grad=proj.weight.requires_grad)
            if proj.bias is not None:
                proj.bias = nn.Parameter(proj.bias.detach().clone(), requires_grad=proj.bias.requires_grad)
        attn._buffers.pop(_WEIGHT, None)
        attn._buffers.pop(_BIAS, None)
    restore_forward(attn, getattr(attn, _BEFORE))
    delattr(attn, _BEFORE)
    if hasattr(attn, QKV_FIXED):
        delattr(attn, QKV_FIXED)


def restore_forward(module: nn.Module, saved) -> None:
    """Give ``module`` back the forward saved before a swap: its class's (no instance attribute left behind) or the
    instance's own where it had one."""
    if getattr(saved, "__self__", None) is module and getattr(saved, "__func__", None) is type(module).forward:
        module.__dict__.pop("forward", None)
    else:
        module.forward = saved


def fused_current(attn: nn.Module) -> bool:
    """Whether ``attn`` is fused and its q/k/v are still the projections fused (one replaced since, by
    ``countdown.quantize``, makes the stacked weight stale: the module's own forward runs instead)."""
    return is_fused(attn) and all(proj.__dict__.get(_PART, False) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))


def is_fused(module: nn.Module) -> bool:
    return hasattr(module, _BEFORE)


def fuse_attention(model: nn.Module, on: bool = True) -> list[str]:
    """Fuse (or, ``on=False``, unfuse) every fusable attention module of ``model``; switches the model to
    countdown's decode attention (:func:`countdown.decode.hf_attention.use_decode_attention`, whose mask the
    fused path reads) and back. Returns the reasons the modules left alone were left alone (empty when
    every module is fused). Call it after moving the model to its device: ``model.to`` would give the
    q/k/v parameters their own storage again (still correct, but the memory is doubled)."""
    modules = _attention_modules(model)
    if not on:
        for attn in modules:
            if is_fused(attn):
                _unfuse(attn)
        if getattr(model, _SWITCHED, False):
            use_decode_attention(model, False)
            setattr(model, _SWITCHED, False)
        return []
    skipped = []
    for i, attn in enumerate(modules):
        reason = why_not_fusable(attn)
        if reason is not None:
            skipped.append(f"layer {i}: {reason}")
        elif not is_fused(attn):
            _fuse(attn)
    if len(skipped) < len(modules):
        if getattr(model.config, "_attn_implementation", None) != NAME:
            use_decode_attention(model)
            setattr(model, _SWITCHED, True)
    return skipped


def decode_layer(attn, hidden_states, attention_mask, past_key_values, kwargs):
    """The cache layer and mask row when this call can take the fused path, else None."""
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1 or attention_mask is None or attn.training:
        return None
    if kwargs.get("output_attentions") or not available(hidden_states) or hidden_states.dtype not in KERNEL_DTYPES:
        return None
    layers = getattr(past_key_values, "layers", None)
    if layers is None or attn.layer_idx >= len(layers):
        return None
    layer = layers[attn.layer_idx]
    if type(layer) is not StaticLayer or not layer.is_initialized or layer.keys.dtype != hidden_states.dtype:
        return None
    row = mask_row(attention_mask, hidden_states.shape[0], layer.max_cache_len)
    return None if row is None else (layer, row)


def cache_of(past_key_values, kwargs):
    """The step's KV cache whichever name the caller gave it: ``past_key_values`` (transformers < 5.24) or
    ``cache`` (5.24 renamed it; the old name stays accepted until 5.40)."""
    return past_key_values if past_key_values is not None else kwargs.get("cache")


def _fused_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                   past_key_values=None, **kwargs):
    found = decode_layer(self, hidden_states, attention_mask, cache_of(past_key_values, kwargs), kwargs) \
        if fused_current(self) else None
    if found is None or position_embeddings is None:
        if past_key_values is not None:  # handed on under the name it came with
            kwargs["past_key_values"] = past_key_values
        return getattr(self, _BEFORE)(hidden_states, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, **kwargs)
    layer, row = found
    B = hidden_states.shape[0]
    qkv4 = self.__dict__.get(_QKV4)
    if qkv4 is not None:
        return self.o_proj(attend(self, qkv4(hidden_states).view(B, -1), layer, row,
                                  position_embeddings).reshape(B, 1, -1)), None
    weight, bias = getattr(self, _WEIGHT), getattr(self, _BIAS)
    if getattr(self, QKV_FIXED, False) and decode_gemv_serves(hidden_states, weight):
        qkv = torch.ops.countdown.decode_linear(hidden_states.reshape(B, -1), weight, bias, None)
    else:
        qkv = F.linear(hidden_states, weight, bias).view(B, -1)
    return self.o_proj(attend(self, qkv, layer, row, position_embeddings).reshape(B, 1, -1)), None


def qkv_weights(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A fused attention module's concatenated QKV weight [(H + 2 KVH) D, d_model] and bias (or None)."""
    return getattr(attn, _WEIGHT), getattr(attn, _BIAS)


def attend(attn: nn.Module, qkv: torch.Tensor, layer, row: torch.Tensor, position_embeddings) -> torch.Tensor:
    """The fused decode attention of ``attn`` (rotary embedding, cache write, attention) on the step's
    QKV projection [B, (H + 2 KVH) D]: [B, H, D]. ``layer`` and ``row`` as :func:`decode_layer` gives them."""
    cos, sin = position_embeddings
    n_heads = attn.q_proj.out_features // attn.head_dim
    return torch.ops.countdown.rope_decode_attention(qkv, cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]),
                                                     layer.keys, layer.values, layer.cumulative_length, row,
                                                     float(attn.scaling), n_heads)
