"""The batch-1 decode step of a Gated-MLP held in the nested 8-bit format (``int4/nested.py``), inside the 4-bit step
(``int4_step.py``): a mixed MLP (``dual[mixed]``) or the 8-bit MLP read whole.

``int4_step`` takes a Gated-MLP whose gate / up / down are :class:`~countdown.int4.nested_linear.NestedLinear` (W_down's
low plane transposed, as ``to_nested`` makes it) as it takes a 4-bit one: its high planes are 4-bit Linears
(:func:`high_parts`: views of the nested modules' buffers, W_gate's and W_up's stacked, no memory added), and its
low planes are kept beside them (``_NESTED``). A one-token call then runs ``kernels/int4/nested_rows.py``'s five
launches, the residual add in the last one, with the rows over a cut refined to 8 bits:

    the mixed patch (countdown.sparsify, dual[mixed] with calibrated cuts on the nested planes): its layer's cut,
        its Sparsity-Real counters (the share of rows left at 4 bits)
    no patch, the modules reading both planes: every row refined (cut -inf): the 8-bit MLP
    no patch, the modules reading the high plane: no row refined (cut +inf): the 4-bit MLP

Any other patch (``rank=exact`` or ``error``, top-k selection, ``kept=float``) runs its own forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ..int4 import Int4Linear, stack
from ..int4.nested_linear import NestedLinear

_GU = "_countdown_int4_mlp"   # the 4-bit step's entry in an MLP's __dict__ (int4_step.py: stacked gate/up, down, act)
_NESTED = "_countdown_nested_mlp"  # (gate low, up low, down low^T triples, state) in the MLP module's __dict__
_HIGH = ("high_qweight", "high_scale", "high_offset")


def nested_parts(parts) -> bool:
    """Whether gate / up / down are nested Linears the mixed kernels read: one group and scale dtype, W_gate's and
    W_up's low planes as their high ones, W_down's transposed, no bias."""
    gate, up, down = parts
    if not all(isinstance(p, NestedLinear) for p in parts):
        return False
    return (not gate.low_transposed and not up.low_transposed and down.low_transposed
            and len({p.group for p in parts}) == 1 and len({p.high_scale.dtype for p in parts}) == 1
            and all(p.bias is None for p in parts))


def high_parts(parts) -> tuple[Int4Linear, Int4Linear]:
    """(the stacked high planes of W_gate and W_up, W_down's high plane) as 4-bit Linears whose buffers the nested
    modules' high-plane buffers then view: one copy of each plane in memory."""
    gate, up, down = parts
    linears = [Int4Linear(p.high, None, p.compute_dtype, "nested") for p in parts]
    gate_up = stack(linears[:2])
    for nested, four in zip((gate, up), linears[:2]):
        for name, buf in zip(_HIGH, ("qweight", "scale", "offset")):
            nested._buffers[name] = four._buffers[buf]
    return gate_up, linears[2]


def nested_entry(module: nn.Module, parts) -> None:
    """Put the parts and the read-whole state (cuts, Sparsity-Real counters) in ``module``'s ``_NESTED``."""
    gate, up, down = parts
    device = gate.high_qweight.device
    state = nn.Module()
    state.register_buffer("both", torch.full((1,), float("-inf"), device=device))  # every row refined: 8 bits
    state.register_buffer("high", torch.full((1,), float("inf"), device=device))   # none: the high planes, 4 bits
    state.register_buffer("kept", torch.zeros(1, dtype=torch.float64, device=device))
    state.register_buffer("rows", torch.zeros((), dtype=torch.int64, device=device))
    module.__dict__[_NESTED] = (parts, state)


def _low(p: NestedLinear) -> tuple[torch.Tensor, ...]:
    return p.low_qweight.view(torch.int32), p.low_scale, p.low_offset


def _words(m: Int4Linear) -> tuple[torch.Tensor, ...]:
    return m.qweight.view(torch.int32), m.scale, m.offset


def _served_patch(patch) -> bool:
    """Whether ``patch`` is a mixed patch the kernels serve (it says so: MixedGatedMLP.kernels_serve)."""
    says = getattr(patch, "kernels_serve", None)
    return says is not None and says()


def mixed_step(module: nn.Module, h: torch.Tensor, x: torch.Tensor, gate_up: Int4Linear, down: Int4Linear,
               act_name: str, patch=None) -> torch.Tensor | None:
    """``h + MLP(x)`` for one token (``h``, ``x`` [1, d_model]) of a nested MLP on the mixed kernels, or None where
    ``patch`` (the MLP's sparse patch in force, or None) is one they do not serve."""
    entry = module.__dict__.get(_NESTED)
    if entry is None:
        return None
    parts, state = entry
    if patch is not None:
        if not _served_patch(patch):
            return None
        cut, kept, rows = patch.selector.cut.reshape(1), patch.kept_total, patch.rows_total
        consts = patch.selector.consts if patch.selector.rank == "error" else None
    else:
        cut = state.both if parts[0].read == "both" else state.high
        kept, rows, consts = state.kept, state.rows, None
    gate, up, nd = parts
    return torch.ops.countdown.int4_nested_mixed_mlp(
        x, *_words(gate_up), *_low(gate), *_low(up), *_words(down), nd.low_qweight, nd.low_scale, nd.low_offset,
        cut, act_name, kept, rows, h, None, consts)


def is_nested(module: nn.Module) -> bool:
    return _NESTED in module.__dict__


def drop(module: nn.Module) -> None:
    module.__dict__.pop(_NESTED, None)



def serves(patch) -> bool:
    """Whether the mixed kernels serve ``patch``'s one-token calls outside a folded layer: a patch they serve, on an
    MLP that ``int4_step`` has taken (its high planes stacked)."""
    return _GU in patch.mlp.module.__dict__ and is_nested(patch.mlp.module) and _served_patch(patch)


def patch_kernel(patch, x2: torch.Tensor) -> torch.Tensor:
    """The mixed patch's output for one token ``x2`` [1, d_model] on the mixed kernels (:func:`serves` first)."""
    module = patch.mlp.module
    gate_up, down, act_name, _ = module.__dict__[_GU]
    return mixed_step(module, x2.new_zeros(x2.shape), x2, gate_up, down, act_name, patch)
