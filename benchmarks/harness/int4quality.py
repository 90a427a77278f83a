"""Sparse rows on 4-bit weights, for quality studies on the CPU (``benchmarks/int4_quality.py``).

* :func:`float_twin`: a 4-bit model's float twin, every :class:`~countdown.int4.Int4Linear` replaced by an
  ``nn.Linear`` holding its de-quantized weight. ``Int4Linear``'s reference forward is ``F.linear`` on that
  same weight, so the twin computes the 4-bit model's numbers (logits, masks, artifacts: the fingerprint reads
  the same weights), in about half the CPU time: the 4-bit module de-quantizes its whole weight on each read.
* :func:`down_transposed`: each Gated-MLP's W_down replaced by what a 4-bit *W_down^T* would hold (round to
  nearest, groups along d_model). The format groups every Linear along its input, as GGUF's blocks do: a
  kept row of d_inter is then a column of W_down, one nibble inside a group of every row, and skipping it
  saves no bytes. Grouped along d_model, W_down's kept columns are contiguous rows of W_down^T.
* :func:`mlp_bytes_fraction`: the weight bytes a decode token reads per Gated-MLP over the same weights' dense
  MLP, counting only the skips a layout (:data:`LAYOUTS`) makes pay.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from countdown.eval.cost import mlp_weight_bytes
from countdown.int4 import Int4Linear, quantize_rtn
from countdown.model.gated_mlp import find_gated_mlps

LAYOUTS = {
    "any": "no groups (bf16): every skip pays; the sparse kernels read W_down^T, a transposed copy of the same "
           "weights",
    "native": "4-bit, every Linear grouped along its input (the format, GGUF): rows of W_gate / W_up skip; W_down's "
              "kept columns and the columns of W_gate / W_up for x's kept entries are nibbles inside groups of "
              "every row, read in full",
    "downT": "4-bit, W_down grouped along d_model (stored as W_down^T), the rest native: W_down's kept columns "
             "skip too; x's kept columns of W_gate / W_up do not",
}


def float_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each Int4Linear replaced by an ``nn.Linear`` (same device, the compute dtype)
    holding its de-quantized weight and its bias; ``model`` is left as it is."""
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, Int4Linear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device=module.qweight.device, dtype=module.compute_dtype)
            linear.weight = nn.Parameter(module.weight.detach(), requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
            twin.set_submodule(name, linear)
    return twin


def down_transposed(model: nn.Module, group: int = 128, scale_dtype: torch.dtype = torch.float16) -> int:
    """Replace, in place, each Gated-MLP's float W_down [d_model, d_inter] by ``dequantize(quantize_rtn(W_down^T,
    g))^T``: min-max round to nearest in groups of ``g`` consecutive d_model entries (``g`` = ``group``, or the
    largest of 64 / 32 dividing d_model). Returns ``g``. An Int4Linear down projection is refused (take the
    :func:`float_twin` first): no module holds this layout yet."""
    used = 0
    with torch.no_grad():
        for mlp in find_gated_mlps(model):
            linear = getattr(mlp.module, mlp.down)
            if isinstance(linear, Int4Linear):
                raise TypeError(f"{mlp.name}.{mlp.down} is an Int4Linear: pass the model's float_twin")
            d_model = linear.out_features
            used = next((g for g in (128, 64, 32) if g <= group and d_model % g == 0), 0)
            if not used:
                raise ValueError(f"d_model {d_model} is not a multiple of 32: W_down^T cannot be grouped along it")
            w_t = quantize_rtn(linear.weight.detach().t().contiguous(), used, scale_dtype).dequantize()
            linear.weight.copy_(w_t.t().to(linear.weight.dtype))
    return used


def mlp_bytes_per_weight(model: nn.Module, down_group: int | None = None) -> float:
    """Bytes per weight of the model's Gated-MLPs as held: an Int4Linear's codes, scales and offsets; a float
    Linear as bf16 (2, what a GPU holds); with ``down_group``, W_down as 4-bit W_down^T in groups of it (fp16
    scales and offsets)."""
    held = count = 0
    for mlp in find_gated_mlps(model):
        for attr in (a for a in (mlp.gate, mlp.up, mlp.fused, mlp.down) if a):
            linear = getattr(mlp.module, attr)
            n = linear.in_features * linear.out_features
            count += n
            if attr == mlp.down and down_group:
                held += n // 2 + 4 * (n // down_group)
            else:
                held += linear.int4.nbytes if isinstance(linear, Int4Linear) else 2 * n
    return held / count


def mlp_bytes_fraction(spec, ideal: bool, kept: float, elem_bytes: float, d_model: int, d_inter: int,
                       layout: str) -> float:
    """Weight bytes one decode token reads from a Gated-MLP, over the same weights' dense MLP (``3 d_model d_inter
    elem_bytes``), with ``kept = 1 - Sparsity-Real`` and the skips ``layout`` makes pay (:data:`LAYOUTS`).

    ``spec`` (a :class:`countdown.spec.Spec`) in SP-Prac, or with ``ideal`` in SP-Ideal (dual only: W_gate and
    W_up read in full, they are the indicator, then W_down's kept columns). SP-Prac: mono / cats read their
    indicator's matrix in full and the other's kept rows; the shadow kind its two shadows (their own bits and
    group) and the kept rows of all three; teal the kept columns of all three (``any`` only: NaN in ``downT``,
    1 in ``native``). W_down's kept columns count as kept in ``any`` / ``downT``, in full in ``native``. In
    ``any``, the SP-Prac kinds count as :func:`countdown.eval.cost.mlp_weight_bytes` does. NaN: not defined."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if spec.is_dense:
        return 1.0
    if ideal and spec.method != "dual":
        return float("nan")
    options = {k: v for k, v in spec.options.items() if k in ("bits", "group", "d_rank")}
    dense = mlp_weight_bytes("dense", d_model, d_inter, 1.0, elem_bytes=elem_bytes)
    down = 1.0 if layout == "native" else kept
    if ideal:
        return (2 + down) / 3
    if layout == "any":
        return mlp_weight_bytes(spec.roofline_kind, d_model, d_inter, kept, elem_bytes=elem_bytes, **options) / dense
    if spec.method == "teal":
        return 1.0 if layout == "native" else float("nan")
    if spec.method in ("mono", "cats"):
        return (1 + kept + down) / 3
    if spec.kind == "shadow":
        shadows = mlp_weight_bytes("shadow", d_model, d_inter, 0.0, elem_bytes=elem_bytes, **options)
        return shadows / dense + (2 * kept + down) / 3
    return float("nan")
