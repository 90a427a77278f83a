"""The batch-1 decode step of a 4-bit model (``countdown.quantize``): two GEMVs per Gated-MLP, one per attention.

    from countdown.decode.int4_step import int4_step
    int4_step(model)             # attention fused (q/k/v one stacked 4-bit GEMV), each MLP's gate/up stacked
    int4_step(model, on=False)   # back to the modules' own forwards

``countdown.decode.linears.fastest_step`` calls it for a model with 4-bit Linears, so ``countdown.generate``
takes it with no extra call. Per Gated-MLP whose gate, up and down are :class:`countdown.int4.Int4Linear`:
gate and up become one stacked 4-bit Linear (``countdown.int4.stack``: the parts view its buffers, no memory
added), and a one-token call computes

    gu = [g; u]  = the stacked GEMV (kernels/int4/gemv.py), fp32 partial sums over slices of K
    y  = W_down (act(g) * u)   the down GEMV summing them and forming act(g) * u as it loads (no kernel between)

with our backend (``countdown.int4.use_backend``), and each Llama-style decoder layer is folded as the bf16 step's
layers are (countdown.decode.layer): its norms and residual adds on our kernels, the GEMVs' partial sums over
slices of K added by the residual add (:func:`_layer_forward`), so a layer's step is a chain of our kernels that
programmatic dependent launch overlaps. With a baseline backend the same stacked GEMV, act(g) * u in
PyTorch, then the down GEMV through that backend (only the GEMVs differ between the backends). A sparsified 4-bit
MLP runs its patch's own forward in the folded layer (no 4-bit kernel skips rows: docs/experiments.md#4-bit-weights);
a nested 8-bit one (dual[mixed]) runs the mixed kernels (nested_step.py). Anything else (the prompt, batch > 1) runs
the module's own forward.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..int4 import Int4Linear, stack
from ..int4.backends import backend_of, finish, gemv_final, gemv_partials, one_token, prepare_model
from .attention import _QKV4, attend, cache_of, decode_layer
from .layer import _BEFORE as LAYER_BEFORE
from .nested_step import _GU, drop as drop_nested, high_parts, is_nested, mixed_step, nested_entry, nested_parts

# _GU (nested_step.py): (stacked gate/up, down, activation name, activation) in the MLP's __dict__
_BEFORE = "_countdown_int4_mlp_before"


def has_int4(model: nn.Module) -> bool:
    """Whether the model has 4-bit Linears or nested 8-bit ones (whose high planes are 4-bit: nested_step.py)."""
    from ..int4.nested_linear import NestedLinear

    return any(isinstance(m, (Int4Linear, NestedLinear)) for m in model.modules())


def _mlp_forward(self, x):
    entry = self.__dict__.get(_GU)
    if entry is None:  # undone while a sparse patch sat on top (unsparsify put this method back): the class's forward
        return type(self).forward(self, x)
    gate_up, down, act_name, act = entry
    if one_token(x) and backend_of(gate_up) == backend_of(down) == "countdown":
        from ..kernels.common import available

        if is_nested(self):  # nested 8-bit: the mixed kernels, every row refined (or none: read="high")
            if available(x):
                zero = x.new_zeros((1, x.shape[-1]))
                return mixed_step(self, zero, x.reshape(1, -1), gate_up, down, act_name).view(x.shape)
            return getattr(self, _BEFORE)(x)
        if available(x):
            gu = gemv_partials(x.reshape(1, -1), gate_up)  # [S, 2 I]: the down GEMV sums the partials as it loads
            return finish(gemv_partials(gu.view(gu.shape[0], 2, -1), down, act_name), down, x.shape, x.dtype)
    if one_token(x) and not is_nested(self):
        g, u = gate_up(x).split(down.in_features, -1)
        return down(act(g) * u)
    return getattr(self, _BEFORE)(x)


def _layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                   use_cache=False, position_embeddings=None, **kwargs):
    """A 4-bit decoder layer's decode step as a chain of our kernels (PDL on while folded):

        qkv = RMSNorm_in(h) W_qkv^T + b              the 4-bit GEMV, K in one slice (the norm on its input), bf16
        a   = attention(qkv)                         kernels/decode_step/rope_attention.py
        h', x = h + sum(partials of a W_o^T),        the 4-bit GEMV's partials; decode_add_norm: the add and
                RMSNorm_post(h')                     the norm in one launch
        gu  = x [W_gate; W_up]^T                     the stacked 4-bit GEMV (partials)
        out = h' + sum(partials of W_down (act(g) u)) the down GEMV reading gu's partials, decode_add_partials
    """
    attn, mlp = self.self_attn, self.mlp
    qkv4, entry = attn.__dict__.get(_QKV4), mlp.__dict__.get(_GU)
    found = None
    if qkv4 is not None and entry is not None and one_token(hidden_states) and position_embeddings is not None \
            and backend_of(qkv4) == backend_of(attn.o_proj) == backend_of(entry[0]) == backend_of(entry[1]) \
            == "countdown":
        found = decode_layer(attn, hidden_states, attention_mask, cache_of(past_key_values, kwargs), kwargs)
    if found is None:
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        return getattr(self, LAYER_BEFORE)(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                           use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    layer, row = found
    gate_up, down, act_name, _ = entry
    norm, post, o = self.input_layernorm, self.post_attention_layernorm, attn.o_proj
    h = hidden_states.reshape(1, -1)
    a = attend(attn, gemv_final(h, qkv4, norm), layer, row, position_embeddings)
    h, x = torch.ops.countdown.decode_add_norm(h, gemv_partials(a.reshape(1, -1), o), o.bias, post.weight,
                                               float(post.variance_epsilon))
    patch = _patch_of(mlp, x)
    if is_nested(mlp):  # nested 8-bit: the mixed kernels (a mixed patch's cut, or the MLP read whole)
        out = mixed_step(mlp, h, x, gate_up, down, act_name, patch) if patch is not _MASKED else None
        if out is None:
            out = h + mlp(x.view_as(hidden_states)).reshape(1, -1)
        return out.view_as(hidden_states)
    if patch is not None:  # sparsified (countdown.sparsify), before or after this step was set up: the patch's own
        return (h + mlp(x.view_as(hidden_states)).reshape(1, -1)).view_as(hidden_states)  # forward
    gu = gemv_partials(x, gate_up)
    out = torch.ops.countdown.decode_add_partials(h, gemv_partials(gu.view(gu.shape[0], 2, -1), down, act_name),
                                                  down.bias)
    return out.view_as(hidden_states)


def _patch_of(mlp: nn.Module, x: torch.Tensor):
    """The sparse patch (countdown.patch.patched_mlp.PatchedMLP) in force on ``mlp`` for this one-token step, or None (not
    patched, a dense selector, or this position dense by the patch's scope: the dense route serves it)."""
    from ..patch.patched_mlp import PatchedMLP

    # the patch as a submodule (countdown.sparsify registers it as ``countdown_sparse``): torch.compile traces this
    # lookup, where the bound ``forward`` in the instance dict gave None (the compiled step decoded dense)
    patch = getattr(mlp, "countdown_sparse", None)
    if not isinstance(patch, PatchedMLP) or patch.selector is None:
        return None
    sparse = patch.state.sparse_positions(x)
    if sparse is False:
        return None
    return patch if sparse is True else _MASKED  # a per-position mask: the patch's own forward decides


_MASKED = object()


def _foldable(layer: nn.Module) -> bool:
    from .layer import FOLDABLE, is_folded

    name = type(layer).__name__
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if name not in FOLDABLE or is_folded(layer) or attn is None or mlp is None:
        return False
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return (_QKV4 in attn.__dict__ and _GU in mlp.__dict__ and isinstance(attn.o_proj, Int4Linear)
            and all(type(n).__name__ == FOLDABLE[name] and hasattr(n, "variance_epsilon") for n in norms))


def _mlps(model: nn.Module):
    from ..model.gated_mlp import find_gated_mlps

    for g in find_gated_mlps(model):
        parts = [getattr(g.module, n) if n else None for n in (g.gate, g.up, g.down)]
        if g.tp is None and g.fused is None and g.act_name in ("silu", "gelu_tanh") \
                and (all(isinstance(p, Int4Linear) and not p.transposed for p in parts) or nested_parts(parts)):
            yield g, parts


def int4_step(model: nn.Module, on: bool = True) -> int:
    """Stack and route the 4-bit attention and Gated-MLPs of ``model`` (``on=False``: undo). Returns how many
    MLPs changed. A sparsified MLP keeps its patch's forward: the folded layer asks the patch at each step (a
    dual[mixed] patch on nested MLPs runs the mixed kernels, any other patch its own forward), whether
    ``countdown.sparsify`` came before or after this."""
    from .attention import fuse_attention

    changed = 0
    if not on:
        from .layer import fold_norms

        fold_norms(model, False)
        for module in model.modules():
            drop_nested(module)
            if module.__dict__.pop(_GU, None) is not None:
                if module.__dict__.pop(_BEFORE, None) is not None \
                        and getattr(module.__dict__.get("forward"), "__func__", None) is _mlp_forward:
                    del module.forward  # back to the class's forward (a sparse patch's forward stays)
                changed += 1
        fuse_attention(model, False)
        return changed
    fuse_attention(model)
    from ..kernels.int4 import nested_rows  # noqa: F401  (registers countdown::int4_nested_mixed_mlp: Triton)

    for g, (gate, up, down) in _mlps(model):
        module = g.module
        if _GU in module.__dict__:
            continue
        if nested_parts((gate, up, down)):  # the high planes as 4-bit Linears, the low planes beside them
            nested_entry(module, (gate, up, down))
            gate_up, down = high_parts((gate, up, down))
        else:
            try:
                gate_up = stack([gate, up])
            except ValueError:
                continue
        module.__dict__[_GU] = (gate_up, down, g.act_name, g.act)
        if "forward" not in module.__dict__:  # a sparsified MLP keeps its patch's forward (the folded layer asks it)
            setattr(module, _BEFORE, module.forward)
            module.forward = types.MethodType(_mlp_forward, module)
        changed += 1
    from ..kernels.decode_step import rmsnorm  # noqa: F401  (registers the norm and add ops the folded layers call; Triton)
    from .attention import decoder_layers
    from .layer import fold_layer

    for layer in decoder_layers(model, "int4_step"):
        if _foldable(layer):
            fold_layer(layer, _layer_forward)
    prepare_model(model)  # a baseline backend's layouts of the stacked modules, before any compile
    return changed
