"""Tensor parallelism: sparse Gated-MLPs on a model sharded by Hugging Face's tensor-parallel plan.

``AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto")`` under ``torchrun`` (or
``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` for gate/up and
``RowwiseParallel`` for down: the same layout) leaves every Gated-MLP with

* ``W_gate``, ``W_up`` as DTensors ``Shard(0)`` ("colwise"): rank ``r`` holds rows ``[start, stop)``;
* ``W_down`` as a DTensor ``Shard(1)`` ("rowwise"): rank ``r`` holds the same columns;
* a module that takes and returns ordinary, replicated tensors.

The rows of a Gated-MLP are independent until the down projection, so each rank runs the sparse MLP
(selectors, masked / gather paths, Triton kernels) on its LOCAL rows, on plain local tensors, and the
partial down projections are summed across ranks once (:func:`reduce_partial`: one all-reduce per
MLP, the down bias added once, after it). :class:`countdown.model.gated_mlp.GatedMLP` carries a :class:`ShardSpec`
in ``.tp`` and hands out local weights; ``countdown.sparsify`` slices each SP-Prac selector's per-row
tensors to the rank's rows (:func:`shard_selector`), so an artifact made on one process serves any
number of ranks. SP-Ideal's per-token top-k is a global choice: ``tp_topk="exact"`` (default) makes
it exactly (:func:`exact_topk_keep`: one all-gather of each rank's local candidates per MLP),
``"shard"`` keeps ``n_keep / world`` rows per shard (no communication, another mask;
:func:`topk_gap` measures how far apart the two are).

This module imports nothing of countdown but the registry, so ``mlp`` and ``sparse`` can call it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..sparse_methods.registry import kept_rows

TOPK_MODES = ("exact", "shard")
# Per-row tensors of the SP-Prac selectors, by buffer name -> the dimension that runs over d_inter.
# shard_selector slices these to the rank's rows; a selector buffer with a d_inter-sized dimension
# not named here is refused rather than silently left global.
PER_ROW_BUFFERS = {"Bt": 0, "bias": 0, "row_cut": 0, "scale": 0, "ternary": 1,
                   "q_gate": 0, "q_up": 0, "s_gate": 0, "s_up": 0}


class ShardingError(ValueError):
    """A tensor-parallel layout countdown cannot run sparse (or an operation that needs one process)."""


@dataclass(frozen=True)
class ShardSpec:
    """Where one Gated-MLP's rows live: this ``rank`` of ``world`` holds rows ``[start, stop)`` of
    ``d_inter`` (W_gate / W_up rows, W_down columns); ``group`` is the process group to reduce over."""

    rank: int
    world: int
    start: int
    stop: int
    d_inter: int
    group: Any = None

    @property
    def d_local(self) -> int:
        return self.stop - self.start

    @property
    def max_local(self) -> int:
        """Rows on the largest shard (torch.chunk split: ``ceil(d_inter / world)``)."""
        return math.ceil(self.d_inter / self.world)


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor") and hasattr(t, "placements")


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor as the plain tensor it is stored in (same storage: an in-place
    change of its layout, as ``sparsify`` makes to W_down, changes the model's own weight); plain
    tensors pass through."""
    if t is None or not is_dtensor(t):
        return t
    return t._local_tensor


def _placement(t: torch.Tensor) -> tuple[str, int | None]:
    placements = tuple(t.placements)
    if len(placements) != 1:
        return ("mesh", len(placements))
    p = placements[0]
    if p.is_shard():
        return ("shard", p.dim)
    if p.is_replicate():
        return ("replicate", None)
    return (type(p).__name__, None)


def chunk_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of rank ``rank`` when ``n`` rows are split as ``torch.chunk`` does."""
    size = math.ceil(n / world)
    start = min(n, rank * size)
    return start, min(n, start + size)


def shard_spec(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` of a Gated-MLP from its weights (global-shaped DTensors), or None when
    none is a DTensor. Raises :class:`ShardingError` for any layout other than gate/up ``Shard(0)``,
    down ``Shard(1)`` on one 1-D mesh."""
    weights = {"gate": gate, "up": up, "down": down}
    if not any(is_dtensor(w) for w in weights.values()):
        return None
    found = {name: _placement(w) if is_dtensor(w) else ("plain", None) for name, w in weights.items()}
    want = {"gate": ("shard", 0), "up": ("shard", 0), "down": ("shard", 1)}
    if found != want:
        raise ShardingError(
            f"this Gated-MLP is sharded as {found}; countdown runs sparse only on the colwise/rowwise "
            "layout (gate and up Shard(0), down Shard(1), one 1-D mesh): Hugging Face's tp_plan='auto' "
            "for Llama-style models, or parallelize_module with ColwiseParallel on gate/up and "
            "RowwiseParallel on down. Fused gate_up projections and other plans are not supported")
    mesh = down.device_mesh
    if gate.device_mesh != mesh or up.device_mesh != mesh:
        raise ShardingError("gate, up and down of one Gated-MLP are sharded over different device meshes")
    group = mesh.get_group()
    world, rank = mesh.size(), mesh.get_local_rank()
    d_inter = down.shape[1]
    start, stop = chunk_range(d_inter, world, rank)
    sizes = (local_tensor(gate).shape[0], local_tensor(up).shape[0], local_tensor(down).shape[1])
    if any(s != stop - start for s in sizes):
        raise ShardingError(f"rank {rank} holds {sizes} rows of gate/up/down, not the {stop - start} of an "
                            f"even torch.chunk split of {d_inter} rows over {world} ranks")
    return ShardSpec(rank, world, start, stop, d_inter, group)


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


def reduce_partial(y: torch.Tensor, spec: ShardSpec, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the ranks' partial down projections ``y [..., d_model]`` (one all-reduce), then add the
    down bias once. ``y`` is reduced in place and returned."""
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=spec.group)
    if bias is not None:
        y = y + local_tensor(bias).to(y.dtype)
    return y


def global_rows(w: torch.Tensor, rows: list[int], spec: ShardSpec) -> torch.Tensor:
    """Rows ``rows`` of the GLOBAL weight ``w`` (a Shard(0) or Shard(1) DTensor), on every rank, in
    float32 (exact for fp32/bf16/fp16 weights): each rank writes its part into zeros and one
    all-reduce sums them. Reads ``len(rows)`` rows, never the whole matrix."""
    loc = local_tensor(w)
    kind, dim = _placement(w)
    out = torch.zeros(len(rows), w.shape[1], dtype=torch.float32, device=loc.device)
    if dim == 1:
        out[:, spec.start:spec.stop] = loc[rows].float()
    else:
        for i, r in enumerate(rows):
            if spec.start <= r < spec.stop:
                out[i] = loc[r - spec.start].float()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=spec.group)
    return out


def refuse_sharded(mlps: list, what: str) -> None:
    """Raise for operations that read whole layers (calibration, predictor training, cut refits)."""
    if any(getattr(m, "tp", None) is not None for m in mlps):
        raise ShardingError(
            f"{what} runs on the unsharded model (one process): per-token quantiles and predictor fits "
            "need every row of a layer, which a tensor-parallel rank does not hold. Build the artifact "
            "once on one process (any device that holds the model) and pass it to countdown.sparsify on "
            "every rank: it is sliced to each rank's rows at load")


# --------------------------------------------------------------------------------------------
# Top-k across shards
# --------------------------------------------------------------------------------------------


def exact_topk_keep(score: torch.Tensor, n_keep: int, spec: ShardSpec) -> torch.Tensor:
    """Keep mask ``[N, d_local]`` of this rank's rows: exactly the rows of the global per-token top
    ``n_keep`` of ``score`` (the rank's columns ``[N, d_local]`` of a global ``[N, d_inter]``).

    Each rank sends its ``min(n_keep, ceil(d_inter / world))`` largest values per token (one
    all-gather); the global ``n_keep``-th largest value ``v`` follows, rows above ``v`` are kept and
    ties at ``v`` go to the lowest global row indices first, so every rank agrees and exactly
    ``n_keep`` rows are kept per token. Compared in float32."""
    s = score.float()
    n_tok = s.shape[0]
    c = min(n_keep, spec.max_local)
    vals = s.topk(min(c, s.shape[1]), dim=-1).values
    if vals.shape[1] < c:  # a short last shard: pad so that every rank sends the same shape
        vals = torch.cat([vals, vals.new_full((n_tok, c - vals.shape[1]), -math.inf)], dim=1)
    parts = [torch.empty_like(vals) for _ in range(spec.world)]
    dist.all_gather(parts, vals.contiguous(), group=spec.group)
    every = torch.stack(parts)  # [world, N, c]
    v = every.permute(1, 0, 2).reshape(n_tok, -1).topk(n_keep, dim=-1).values[:, -1:]  # [N, 1]
    greater = (every > v[None]).sum(dim=(0, 2))  # [N]
    ties = (every == v[None]).sum(dim=2)  # [world, N], rank order = global row order
    before = ties[:spec.rank].sum(dim=0)
    quota = (n_keep - greater - before).clamp_min(0)[:, None]
    at_v = s == v
    return (s > v) | (at_v & (at_v.cumsum(dim=-1) <= quota))


def shard_topk_keep(score: torch.Tensor, n_keep: int, spec: ShardSpec) -> torch.Tensor:
    """The cheap alternative: the ``round(n_keep * d_local / d_inter)`` largest of this shard's rows
    per token (no communication; each shard keeps its share, whatever the other shards hold)."""
    n = min(score.shape[1], int(round(n_keep * spec.d_local / spec.d_inter)))
    idx = score.topk(n, dim=-1, sorted=False).indices
    return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)


def topk_keep(score: torch.Tensor, n_keep: int, spec: ShardSpec, mode: str = "exact") -> torch.Tensor:
    return exact_topk_keep(score, n_keep, spec) if mode == "exact" else shard_topk_keep(score, n_keep, spec)


def check_topk_mode(mode: str) -> str:
    if mode not in TOPK_MODES:
        raise ValueError(f"unknown tp_topk {mode!r}: choose one of {', '.join(TOPK_MODES)}")
    return mode


# --------------------------------------------------------------------------------------------
# Selectors on a rank
# --------------------------------------------------------------------------------------------


def _is_topk(selector) -> bool:
    """SP-Ideal top-k selectors and predictors with selection="topk" (both carry n_keep)."""
    return hasattr(selector, "n_keep") and getattr(selector, "selection", "topk") == "topk"


def shard_selector(selector, mlp, spec: ShardSpec, topk: str = "exact") -> None:
    """Make a selector built for the whole layer (from a one-process artifact, or SP-Ideal) select
    among this rank's rows of Gated-MLP ``mlp`` (a :class:`countdown.model.gated_mlp.GatedMLP`), in place: its per-row tensors (:data:`PER_ROW_BUFFERS`) are cut to rows
    ``[start, stop)`` (scalar thresholds and cuts and the low-rank ``A`` are shared by all rows and
    stay); a top-k selector's forward is replaced by the cross-shard top-k of ``topk`` mode."""
    if selector is None:
        return
    check_topk_mode(topk)
    for name, buf in list(selector.named_buffers(recurse=False)):
        dim = PER_ROW_BUFFERS.get(name)
        if dim is not None and buf.dim() > dim and buf.shape[dim] == spec.d_inter:
            setattr(selector, name, buf.narrow(dim, spec.start, spec.d_local).contiguous())
        elif dim is None and spec.d_inter in buf.shape:
            raise ShardingError(f"{type(selector).__name__} holds a per-row tensor {name!r} that countdown.model.tensor_parallel does "
                                "not know how to shard: add it to countdown.model.tensor_parallel.PER_ROW_BUFFERS")
    if _is_topk(selector):
        n_keep = int(selector.n_keep)
        ideal = hasattr(selector, "method")  # SP-Ideal scores by the method's indicator, SP-Prac by its kind

        def forward(x, u, h):
            score = selector.method.indicator(u, h) if ideal else selector.score(x, mlp)
            return topk_keep(score, n_keep, spec, topk)

        selector.forward = forward  # an instance attribute: the class, and isinstance checks, stay
    selector.tp = spec
    selector.tp_topk = topk


def shard_selectors(mlps: list, selectors: list, topk: str = "exact") -> None:
    """:func:`shard_selector` for every selector whose Gated-MLP is sharded (``mlp.tp`` set); checks
    ``topk`` on any model."""
    check_topk_mode(topk)
    for mlp, selector in zip(mlps, selectors):
        if mlp.tp is not None:
            shard_selector(selector, mlp, mlp.tp, topk)


# --------------------------------------------------------------------------------------------
# How far the per-shard top-k is from the exact one (on one process)
# --------------------------------------------------------------------------------------------


def topk_gap(mlp, method, x: torch.Tensor, sparsity: float, world: int) -> dict:
    """Exact global top-k against per-shard top-k on one UNSHARDED Gated-MLP, ``world`` shards
    simulated on one process (the masks depend only on the rows, not on where they run).

    mlp: a :class:`countdown.model.gated_mlp.GatedMLP`; method: a :class:`countdown.sparse_methods.registry.Method`;
    x ``[N, d_model]``. Returns ``{"mask_differs": fraction of (token, row) entries whose keep bit
    differs, "recall": fraction of the exact mask's rows the per-shard mask keeps, "output_rel_err":
    ||y_shard - y_exact|| / ||y_exact||, "dense_rel_err": ||y_exact - y_dense|| / ||y_dense|| (for
    scale)}``."""
    n_keep = kept_rows(mlp.d_inter, sparsity)
    with torch.no_grad():
        u, g = mlp.parts(x)
        h = mlp.act(g)
        score = method.indicator(u, h).float()
        exact = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(n_keep, dim=-1).indices, True)
        shard = torch.zeros_like(exact)
        for r in range(world):
            start, stop = chunk_range(mlp.d_inter, world, r)
            spec = ShardSpec(r, world, start, stop, mlp.d_inter)
            shard[:, start:stop] = shard_topk_keep(score[:, start:stop], n_keep, spec)
        zero = torch.zeros((), dtype=u.dtype, device=u.device)

        def out(keep):
            return F.linear(torch.where(keep, u * h, zero), mlp.w_down, mlp.b_down).double()

        y_exact, y_shard, y_dense = out(exact), out(shard), out(torch.ones_like(exact))
    return {
        "mask_differs": float((exact != shard).float().mean()),
        "recall": float((exact & shard).sum() / exact.sum()),
        "output_rel_err": float((y_shard - y_exact).norm() / y_exact.norm()),
        "dense_rel_err": float((y_exact - y_dense).norm() / y_dense.norm()),
    }
