"""Route chosen linear layers of a decode step through a fixed GEMV (kernels/decode_step/linear.py).

    from countdown.decode.linears import route_linears
    route_linears(model, ("down",))           # every Gated-MLP's down projection
    route_linears(model, ("down", "o_proj"))  # and the attention blocks' output projections
    route_linears(model, ("gate_up",))        # the Gated-MLPs' gate and up projections (dense layers)
    route_linears(model, ("qkv",))            # fused attention's QKV GEMV (after fuse_attention(model))
    route_linears(model, ("qkv", "norm"))     # and each decoder layer folded: its norms and adds ours (fused_layer.py)
    route_linears(model, (), on=False)        # back to nn.Linear's forward (and F.linear for QKV)
    fastest_step(model)                       # fuse_attention + every target that applies; on=False undoes

Why (docs/decode.md, "A fixed GEMV for W_down"): under torch.compile with coordinate-descent tuning,
Inductor fuses act(g) * u into the down projection's reduction, and that kernel re-reads g and u for
every block of output rows it tunes, and what it reaches changes from compile to compile, where the
fixed GEMV alone reads W_down near the copy bandwidth (docs/decode.md, benchmarks/linear.py).
A routed layer calls ``torch.ops.countdown.decode_linear``, opaque to Inductor, whenever its route
(kernels/route.py's "linear": one row, batch-1 decode steps) takes it and no gradient is wanted;
every other call (batch > 1, the prompt, training) is the layer's own ``F.linear``. The weights and the state dict are untouched: only the forward
method of each routed ``nn.Linear`` instance is replaced.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.route import decode_gemv_serves

TARGETS = ("down", "gate_up", "o_proj", "qkv", "norm")
_ROUTED = "_countdown_decode_gemv"


def step_targets(fused: bool) -> tuple[str, ...]:
    """The targets the fastest decode step routes: qkv and norm (the layer folded, countdown.decode.layer)
    only when the attention is fused. The fold with its MLP residual on our add makes each layer a chain of
    our kernels, and programmatic dependent launch (on while layers are folded) then overlaps each kernel
    with the one before; the fold alone was not faster (docs/decode.md)."""
    return tuple(t for t in TARGETS if fused or t not in ("qkv", "norm"))


def _decode_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if decode_gemv_serves(x, self.weight):
        y = torch.ops.countdown.decode_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias, None)
        return y.view(*x.shape[:-1], self.out_features)
    return F.linear(x, self.weight, self.bias)


def _layers(model: nn.Module, target: str) -> list[nn.Linear]:
    from ..model.gated_mlp import require_gated_mlps

    if target == "down":
        found = [getattr(g.module, g.down) for g in require_gated_mlps(model) if g.tp is None]
    elif target == "gate_up":
        found = [getattr(g.module, name) for g in require_gated_mlps(model) if g.tp is None
                 for name in ((g.fused,) if g.fused else (g.gate, g.up))]
    elif target == "o_proj":
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None) or []
        found = [getattr(layer.self_attn, "o_proj", None) for layer in layers if hasattr(layer, "self_attn")]
    else:
        raise ValueError(f"unknown target {target!r}: choose from {TARGETS}")
    return [lin for lin in found if type(lin) is nn.Linear]


def is_routed(layer: nn.Module) -> bool:
    return getattr(layer, _ROUTED, False)


def route_linears(model: nn.Module, targets=("down",), on: bool = True) -> int:
    """Route the ``targets`` layers of ``model`` through the fixed GEMV (``on=False``: un-route every
    routed layer, whatever ``targets`` says). Returns how many layers changed."""
    from .attention import QKV_FIXED, is_fused
    from .layer import fold_norms, is_folded

    if not on:
        changed = sum(is_folded(m) for m in model.modules())
        if changed:
            fold_norms(model, False)
        for module in model.modules():
            if is_routed(module):
                del module.forward
                delattr(module, _ROUTED)
                changed += 1
            if getattr(module, QKV_FIXED, False):
                delattr(module, QKV_FIXED)
                changed += 1
        return changed
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"unknown target(s) {bad}: choose from {TARGETS}")
    from ..kernels.decode_step import linear  # noqa: F401  (registers countdown::decode_linear; needs Triton)

    changed = 0
    if "qkv" in targets:  # not an nn.Linear: the fused attention module's concatenated weight
        fused = [m for m in model.modules() if is_fused(m)]
        if not fused:
            raise ValueError("route_linears(model, ('qkv',)) routes fused attention's QKV GEMV: call "
                             "countdown.decode.attention.fuse_attention(model) first")
        for attn in fused:
            if not getattr(attn, QKV_FIXED, False):
                setattr(attn, QKV_FIXED, True)
                changed += 1
    if "norm" in targets:  # after qkv: the fold needs the routed QKV GEMV
        before = sum(is_folded(m) for m in model.modules())
        skipped = fold_norms(model)
        after = sum(is_folded(m) for m in model.modules())
        if after == 0:
            raise ValueError("route_linears(model, ('norm',)) folds each layer's input RMSNorm into the routed QKV "
                             f"GEMV (route 'qkv' too) and no layer could be folded: "
                             f"{skipped[0] if skipped else 'the model has no decoder layers'}")
        changed += after - before
    for target in (t for t in targets if t not in ("qkv", "norm")):
        for lin in _layers(model, target):
            if not is_routed(lin):
                lin.forward = types.MethodType(_decode_forward, lin)
                setattr(lin, _ROUTED, True)
                changed += 1
    return changed


def fastest_step(model: nn.Module, on: bool = True) -> list[str]:
    """The fastest batch-1 decode step the library has (what ``benchmarks/decode.py`` runs by default):
    the attention blocks fused (:func:`countdown.decode.attention.fuse_attention`, where fusable) and
    every projection on the fixed GEMV and the decoder layers folded (countdown.decode.layer: norms and
    residual adds on our kernels; qkv and the fold only where fused). ``on=False`` undoes all. Returns the
    reasons the attention modules left alone were left alone. Call it after ``sparsify`` or before:
    the sparse MLPs read the weights directly and ignore a routed layer's forward. ``countdown.generate`` calls it
    through :class:`countdown.decode.prepared.PreparedStep`, which keys the step on the model and undoes it."""
    from .attention import fuse_attention, is_fused

    if not on:
        from .int4_step import int4_step

        route_linears(model, (), on=False)
        int4_step(model, False)
        fuse_attention(model, False)
        return []
    from .layer import fold_norms

    skipped = fuse_attention(model)
    from .int4_step import has_int4, int4_step

    if has_int4(model):  # 4-bit Linears: q/k/v and gate/up stacked, each MLP two GEMVs (the rest routes as usual)
        int4_step(model)
    targets = step_targets(any(is_fused(m) for m in model.modules()))
    route_linears(model, tuple(t for t in targets if t != "norm"))
    if "norm" in targets:
        fold_norms(model)  # where a layer cannot be folded it keeps its own forward (no error, unlike route "norm")
    return skipped
