"""A model's Gated-MLPs in the nested 8-bit format (``nested.py``), in place: the conversion, which planes the model
reads, and the record that saving and loading use.

``to_nested(model, group=64)`` replaces each Gated-MLP's ``gate`` / ``up`` / ``down`` Linear by a
:class:`~countdown.int4.nested_linear.NestedLinear` (8-bit RTN of its weight, groups of ``group`` input columns); W_down
holds its low plane transposed, so that a kept row of d_inter (a column of W_down) has its low codes in one row. The
other Linears stay as they are. The model then computes with the 8-bit weights (both planes); ``read_planes(model,
"high")`` makes it read the high planes alone (a 4-bit MLP), ``read_planes(model, "both")`` the 8-bit weights again.
No float copy is kept: memory is 8 bits a weight plus the planes' scales (``nested.py``).

Where nothing divides: a Linear whose input width is not a multiple of ``group`` is refused (naming the widths and
the groups that fit), as is a fused gate_up projection, a tensor-parallel shard, a sparsified model and one whose MLP
weights are 4-bit already (``countdown.quantize``): a nested weight rounds float weights.

The record ``model.config.countdown_nested`` names the converted modules, the group, the scale dtype and the modules
whose low plane is transposed; a save writes it as the ``nested`` field of config.json's ``quantization_config``, from
which countdown's transformers quantizer rebuilds the modules before their planes load (``int4/loading.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..data.texts import log
from .format import GROUPS, SCALE_DTYPES
from .nested import NestedWeight
from .nested_linear import BUFFERS, READS, NestedLinear

FORMAT = "countdown-nested8"
CONFIG_ATTR = "countdown_nested"  # the record's place in model.config (and so in config.json)
DEFAULT_GROUP = 64  # divides d_model and d_inter of every real model here (SmolLM2's d_model 576 has no 128)


def nested_config(model: nn.Module) -> dict | None:
    """What :func:`to_nested` recorded on ``model`` (None: no nested MLP)."""
    return getattr(getattr(model, "config", None), CONFIG_ATTR, None)


def nested_modules(model: nn.Module) -> dict[str, NestedLinear]:
    """Every :class:`NestedLinear` of ``model`` by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, NestedLinear)}


def _mlp_linears(model: nn.Module, mlps) -> list[tuple[str, str, nn.Module]]:
    """(qualified name, role, module) of the gate / up / down Linears of each Gated-MLP, checked convertible."""
    from ..patch.state import is_sparsified

    if is_sparsified(model):
        raise ValueError("convert the model's MLPs to the nested format before sparsifying it "
                         "(countdown.unsparsify first)")
    out = []
    for mlp in mlps:
        if mlp.fused is not None:
            raise ValueError(f"{mlp.name}: a fused gate_up projection cannot be held in the nested format (its gate "
                             "and up rows would share one module): not supported")
        if mlp.tp is not None:
            raise ValueError("a tensor-parallel model cannot be converted in place: convert it before sharding")
        for role in ("gate", "up", "down"):
            attr = getattr(mlp, role)
            out.append((f"{mlp.name}.{attr}" if mlp.name else attr, role, getattr(mlp.module, attr)))
    return out


def check_convertible(model: nn.Module, mlps, group: int, scale_dtype: torch.dtype) -> list:
    """The Linears :func:`convert` would replace (``[]``: every one is nested already with this group and scale
    dtype), after every check, before any change."""
    from .linear import Int4Linear

    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be torch.float16 or torch.float32, got {scale_dtype}")
    linears = _mlp_linears(model, mlps)
    nested = [m for _, _, m in linears if isinstance(m, NestedLinear)]
    if nested:
        if len(nested) != len(linears) or any(m.group != group or m.high_scale.dtype != scale_dtype for m in nested):
            have = sorted({(m.group, str(m.high_scale.dtype)) for m in nested})
            raise ValueError(f"the model's MLPs are nested already (group, scale dtype {have}), not all in groups of "
                             f"{group} with {scale_dtype} scales: load the model again to convert it otherwise")
        if any(m.read != "both" for m in nested):
            raise ValueError("the model reads its nested MLPs at the high plane alone: call "
                             "countdown.int4.nested_model.read_planes(model, 'both') first")
        return []
    if any(isinstance(m, Int4Linear) for _, _, m in linears):
        raise ValueError("the model's MLP weights are 4-bit already (countdown.quantize): the nested format rounds "
                         "float weights to 8 bits; load the model again and convert it before quantizing")
    bad = sorted({m.in_features for _, _, m in linears if m.in_features % group})
    if bad:
        fits = [g for g in GROUPS if not any(w % g for w in {m.in_features for _, _, m in linears})]
        raise ValueError(f"group={group} does not divide the MLP input widths {bad}: choose a group that divides "
                         f"them ({', '.join(map(str, fits)) or 'none of ' + str(GROUPS) + ' does'})")
    return linears


def convert(model: nn.Module, mlps, group: int = DEFAULT_GROUP, scale_dtype: torch.dtype = torch.float16
            ) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace the Gated-MLPs' Linears by nested ones in place (nothing where they are nested already, as asked);
    returns ``(parent, attribute, replaced module)`` of each change, for :func:`restore`."""
    linears = check_convertible(model, mlps, group, scale_dtype)
    if not linears:
        return []
    replaced = []
    with torch.no_grad():
        for mlp in mlps:
            for role in ("gate", "up", "down"):
                attr = getattr(mlp, role)
                old = getattr(mlp.module, attr)
                new = NestedLinear.from_linear(old, group, scale_dtype, low_transposed=role == "down")
                setattr(mlp.module, attr, new)
                replaced.append((mlp.module, attr, old))
    names = [name for name, _, _ in linears]
    setattr(model.config, CONFIG_ATTR, {
        "format": FORMAT, "version": 1, "group": group, "scale_dtype": str(scale_dtype).removeprefix("torch."),
        "modules": names, "low_transposed": [name for name, role, _ in linears if role == "down"]})
    n = sum(m.in_features * m.out_features for _, _, m in linears)
    log(f"nested: {len(names)} MLP Linear layers held as nested 8-bit weights (groups of {group}, "
        f"{str(scale_dtype).removeprefix('torch.')} scales; {n / 1e6:.3g} M weights, "
        f"{8 + 4 * 8 * torch.empty((), dtype=scale_dtype).element_size() / group:g} bits a weight); other Linears as "
        "they were")
    return replaced


def restore(model: nn.Module, replaced: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Undo :func:`convert` (the replaced modules put back, the record removed)."""
    for parent, attr, old in replaced:
        setattr(parent, attr, old)
    if replaced and hasattr(model.config, CONFIG_ATTR):
        delattr(model.config, CONFIG_ATTR)


def to_nested(model: nn.Module, group: int = DEFAULT_GROUP, scale_dtype: torch.dtype = torch.float16) -> nn.Module:
    """Every Gated-MLP's Linears of ``model`` as nested 8-bit weights, in place (the module docstring); returns
    ``model``. A model converted already with the same group and scale dtype is returned as it is."""
    from ..model.gated_mlp import require_gated_mlps

    convert(model, require_gated_mlps(model), group, scale_dtype)
    return model


def read_planes(model: nn.Module, planes: str) -> nn.Module:
    """Make every nested Linear of ``model`` compute with ``planes``: ``"both"`` (8 bits) or ``"high"`` (the high
    plane alone, 4 bits); returns ``model``."""
    if planes not in READS:
        raise ValueError(f"planes must be one of {READS}, got {planes!r}")
    modules = nested_modules(model)
    if not modules:
        raise ValueError("the model holds no nested weights: convert its MLPs first "
                         "(countdown.int4.nested_model.to_nested)")
    for m in modules.values():
        m.read = planes
    return model


def from_saved(parts: dict[str, torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype,
               low_transposed: bool) -> NestedLinear:
    """A :class:`NestedLinear` from its saved buffers (``parts``: the six of :data:`BUFFERS`)."""
    from .format import Int4Weight

    missing = sorted(set(BUFFERS) - set(parts))
    if missing:
        raise ValueError(f"a saved nested Linear lacks {', '.join(missing)}")
    high = Int4Weight(parts["high_qweight"], parts["high_scale"], parts["high_offset"])
    weight = NestedWeight(high, parts["low_qweight"], parts["low_scale"], parts["low_offset"], low_transposed)
    return NestedLinear(weight, bias, dtype)


def check_nested_record(record, where: str) -> None:
    """A nested record (:func:`convert`'s) this release can rebuild, else a ValueError saying what to do."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{where}: the nested 8-bit record is not a {FORMAT} record "
                         f"({record.get('format') if isinstance(record, dict) else record!r}); save the model again "
                         "with countdown.save")
