"""The kernels' configuration in one place: the user's choices, every launch table, and the overrides tests use.

* :class:`KernelOptions`: what is a user's to choose, a frozen object a sparsified model holds
  (``countdown.sparsify(..., kernel_options=KernelOptions(...))``), as torchao's kernel preference is a field of its
  configuration.
* :data:`LAUNCH`: every kernel's launch configuration, keyed by op (and, where an op has several, its bucket: a
  token count, a keep rule, a shape), tuned on an H200 (sm_90) and used on every CUDA device; :data:`INTERPRETER`:
  what changes under Triton's CPU interpreter (``TRITON_INTERPRET=1``), whose cost is per operation, not per
  value: fewer, larger programs. :func:`launch_config` reads them.
* the device's SMs (:func:`persistent_programs`), which the persistent kernels' grids follow.
* :data:`FOLDED`: the decoder layers whose folded decode step is a chain of our kernels (countdown.decode.layer
  keeps it); programmatic dependent launch (jit_helpers.py) is on while it holds one (:func:`pdl_mode`).
* :func:`overrides`: the one context in which tests (and benchmarks' sweeps) change a route, a launch
  configuration or a debug setting, or watch the launches (``on_launch``, the documented spy hook).

Nothing here imports Triton.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import weakref
from typing import Any, Callable, Mapping

import torch

# ----------------------------------------------------------------------------------------- the user's choices


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """The kernel route's choices that are a user's to make (``countdown.sparsify(..., kernel_options=...)``).

    eager_graphs: an eager call of a patched MLP's kernel route on CUDA (transformers' own ``generate``) replays a
        CUDA graph captured on the layer's first call of that shape (True, default: at batch 1 launching the
        route's few kernels from Python costs more than running them). False: launch by launch (to profile the
        launches, or where a graph's memory is not wanted). Under torch.compile or inside a capture the kernels
        are always called directly.
    """

    eager_graphs: bool = True


# --------------------------------------------------------------------------------------------- launch tables
# Knob names are the launchers' (``BLOCK_M``, ``num_warps``, ...); ``PER_SM`` persistent programs per SM and
# ``PROGRAMS`` (interpreter only) the persistent programs in all. The sweeps that chose them: docs/kernels.md.
LAUNCH: dict[str, dict] = {
    # sparse_mlp/chain.py, more than 8 tokens: by token bucket (1 token; 2-16), benchmarks/mlp_kernels.py --sweep.
    # BLOCK_K = 0: whole rows (the next power of two >= d_model) in one step.
    "chain_gate_up": {
        1: dict(CHUNK=8, BLOCK_M=2, BLOCK_K=0, USE_DOT=False, num_warps=4, num_stages=1),
        16: dict(CHUNK=32, BLOCK_M=32, BLOCK_K=256, USE_DOT=True, num_warps=4, num_stages=4),
    },
    "chain_down": {  # sparse_mlp/down.py
        1: dict(CHUNK=128, BLOCK_M=16, BLOCK_N=512, USE_DOT=False, num_warps=4, num_stages=1),
        16: dict(CHUNK=256, BLOCK_M=16, BLOCK_N=256, USE_DOT=True, num_warps=4, num_stages=3),
    },
    # sparse_mlp/one_token.py, by keep rule (mono: u, cats: g, gt: a predictor's or the shadows' scores), the
    # fastest of the sweeps at the Llama-3.1-8B shape. ROWS "auto": one chunk per program, d_inter split evenly
    # over PER_SM programs per SM; RB: indicator rows a step where the kernel computes it (route.py), ISTAGES
    # deep, the first step's rows loaded before the PDL wait (W_EARLY); STAGES: the kept rows' tile loop pipelined.
    "one_token": {
        "abs": dict(ROWS="auto", RB=2, ISTAGES=3, W_EARLY=True, CHUNK=64, BLOCK_M=4, num_warps=4, PER_SM=2),
        "abs_act": dict(CHUNK=64, BLOCK_M=4, num_warps=4, PER_SM=4),
        "gt": dict(CHUNK=64, BLOCK_M=2, num_warps=4, PER_SM=4, STAGES=3),
    },
    # sparse_mlp/few_tokens.py: the fastest of benchmarks/few.py's sweep (four tokens: dual and mono at k = 0.9,
    # dual at k = 0.7). ROWS: rows per program, CHUNK or "auto" (d_inter split evenly over PER_SM programs per SM);
    # TILE kept rows a tile; BK, BN the two phases' K and N blocks, STAGES deep; WIDE_*: a chunk keeping more.
    "few_tokens": dict(ROWS="auto", PER_SM=1, CHUNK=128, TILE=64, BK=128, BN=256, STAGES=3, num_warps=4,
                       WIDE_BK=64, WIDE_BN=128, WIDE_STAGES=4),
    # sparse_mlp/select.py, by (kind, one token or several), benchmarks/shadow.py --sweep. ROWS rows a block,
    # TILE_W shadow words a row and tile, PER_SM 0: one program a block; NEXT: the next block's words first.
    "select": {
        ("shadow", 1): dict(ROWS=2, TILE_W=512, BLOCK_M=1, num_warps=4, PER_SM=4, NEXT=True),
        ("shadow", 8): dict(ROWS=16, TILE_W=64, BLOCK_M=2, num_warps=4, PER_SM=0, NEXT=False),
        ("hybrid", 1): dict(ROWS=64, TILE_W=64, BLOCK_M=2, num_warps=8, PER_SM=2, NEXT=False),
        ("hybrid", 8): dict(ROWS=32, TILE_W=64, BLOCK_M=2, num_warps=4, PER_SM=0, NEXT=False),
        ("scores", 8): dict(ROWS=4, TILE_W=512, BLOCK_M=1, num_warps=4, PER_SM=3, NEXT=True),
    },
    # shadow/gemv.py, one token, benchmarks/shadow_dp4a.py's sweep with PDL on. R rows a block; XPRE: x rounded by
    # a small kernel first (XPRE_GB groups on XPRE_WARPS warps a program); STAGES > 1 without PREFETCH: Triton's
    # pipeliner.
    "shadow_gemv": dict(R=8, num_warps=4, PER_SM=2, PREFETCH=True, ASM=True, XPRE=True, XPRE_GB=4, XPRE_WARPS=1,
                        STAGES=1),
    # sparse_mlp/partial_sums.py: BD columns a program; MAX_ELEMS the most values one program loads at once.
    "partial_sums": dict(BD=16, MAX_ELEMS=8192),
    # teal/kernels.py, by token bucket (1; 2-16): gate/up (KS input channels a split, BN columns, BM kept rows a
    # tile), down (BN2 columns, BM2 rows a tile; FUSE: the finish step in each down program). FB intermediate
    # channels a block fixes the op's output shape (shared); MAX_GROUP tokens a launch group. Batch 1 swept.
    "teal": {
        "default": dict(FB=512, MAX_GROUP=16),
        1: dict(KS=1024, BN=64, BM=32, warps=4, stages=1, BN2=256, BM2=32, warps2=4, stages2=1, FUSE=True),
        16: dict(KS=512, BN=128, BM=16, warps=4, stages=2, BN2=128, BM2=16, warps2=4, stages2=2, FUSE=False),
    },
    # decode_step/attention.py (and rope_attention.py): BLOCK_N keys a step, PER_SM programs an SM aimed for,
    # MAX_SPLITS partials at most, SPLITS a forced count; SKIP_MASKED: K/V loads wait for the mask.
    "attention": dict(BLOCK_N=64, PER_SM=4, MAX_SPLITS=128, SPLITS=None, SKIP_MASKED=True, num_warps=4,
                      num_stages=2),
    # decode_step/linear.py, by the reduction length K (narrow: K <= 1024, short: <= 8192, long), one token;
    # NORM_BN: rows a program with the RMSNorm folded in.
    "linear": {
        "narrow": dict(BN=4, BK=1024, num_warps=1, num_stages=1, NORM_BN=2),
        "short": dict(BN=1, BK=4096, num_warps=8, num_stages=1, NORM_BN=2),
        "long": dict(BN=1, BK=2048, num_warps=4, num_stages=1, NORM_BN=2),
    },
    "decode_add": dict(BLOCK=1024),  # decode_step/rmsnorm.py's residual adds
    # int4/gemv.py: R rows a block, MAX_COLS the most columns of x a program holds, AHEAD blocks requested ahead.
    # By (N, K): the fastest of benchmarks/int4_decode.py's sweep at the Llama-3.1-8B shapes (H200).
    "int4_gemv": {
        "default": dict(R=8, num_warps=4, PER_SM=3, MAX_COLS=4096, PREFETCH=True, AHEAD=1, ASM=True),
        (6144, 4096): dict(R=8, PER_SM=2, MAX_COLS=4096, AHEAD=2),     # q/k/v stacked
        (4096, 4096): dict(R=16, PER_SM=3, MAX_COLS=1024, AHEAD=2),    # o_proj
        (28672, 4096): dict(R=16, PER_SM=4, MAX_COLS=1024, AHEAD=1),   # gate/up stacked
        (14336, 4096): dict(R=16, PER_SM=4, MAX_COLS=1024, AHEAD=1),   # up or gate alone (the rows' indicator)
        (4096, 14336): dict(R=16, PER_SM=3, MAX_COLS=1024, AHEAD=1),   # down (act(g) * u input)
        (128256, 4096): dict(R=16, PER_SM=4, MAX_COLS=1024, AHEAD=1),  # lm_head
    },
    # int4/rows*.py (docs/int4.md): select SET rows a program, CHUNK at a time, A_WARPS; other O_SUB sets a program,
    # O_R rows a tile, O_COLS columns a slice, O_WARPS; down SUB sets a program, SLICE words a column slice, NW
    # warps, UR rows a stream, AHEAD tiles in flight; EARLY: down reads the lists before its PDL wait.
    "int4_rows": dict(CHUNK=64, SET=128, A_WARPS=4, O_SUB=1, O_R=16, O_COLS=1024, O_WARPS=4, SUB=4, SLICE=16, UR=32,
                      NW=1, AHEAD=2, EARLY=1),
    "int4_dequant": dict(BN=8, BB=256),  # int4/dequant.py: rows and packed bytes a program
    # int4/nested_rows.py (the mixed Gated-MLP's kept rows; the select's sets are int4_rows' SET): the low planes of
    # W_gate / W_up, L_SUB sets a program, L_R rows a tile, L_COLS columns of x a slice, L_WARPS; W_down's transposed
    # low plane (int4/nested_down.py), D_SUB sets a program, D_T rows a tile, D_CB packed bytes (2 D_CB columns) a
    # column slice, D_WARPS, D_AHEAD tiles' loads in flight (1 or 2), D_EARLY: its walk before its PDL wait (the down
    # GEMV then signals after its own wait); Q_PER_SM: the down GEMV's PER_SM in the mixed MLP (None: int4_gemv's;
    # fewer leave SM room for low_down's early programs).
    "int4_nested": dict(L_SUB=1, L_R=16, L_COLS=1024, L_WARPS=4, D_SUB=4, D_T=8, D_CB=64, D_WARPS=4, D_AHEAD=2,
                        D_EARLY=1, Q_PER_SM=None),
}

# What changes under the interpreter, by op: PROGRAMS persistent programs in all; MIN_R / MIN_BN the least rows a
# block / a program (one launch configuration's worth of work a program: the interpreter pays per operation).
INTERPRETER: dict[str, dict] = {
    "one_token": dict(PROGRAMS=3),
    "few_tokens": dict(PROGRAMS=3),
    "select": dict(PROGRAMS=3),
    "shadow_gemv": dict(PROGRAMS=3),
    "attention": dict(PROGRAMS=8),
    "linear": dict(MIN_BN=16),
    "int4_gemv": dict(PROGRAMS=3, MIN_R=32),
}


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_kind(device) -> str:
    """"cuda" for a CUDA device the kernels compile for, "interpreter" for everything else (the CPU under
    ``TRITON_INTERPRET=1``): the device key of :data:`LAUNCH` / :data:`INTERPRETER` and of route.py's table."""
    return "cuda" if torch.device(device).type == "cuda" and not interpreting() else "interpreter"


def _knobs(op: str) -> set:
    table = LAUNCH[op]
    names = set(INTERPRETER.get(op, {}))
    if all(isinstance(v, dict) for v in table.values()):
        for entry in table.values():
            names |= set(entry)
    else:
        names |= set(table)
    return names


def launch_config(op: str, device=None, bucket: Any = None, extra: Mapping | None = None) -> dict:
    """A fresh copy of ``op``'s launch configuration on ``device`` (None: no device's changes), for ``bucket`` where
    the op's table has buckets (its ``"default"`` entry under it); then the overrides context's entries for the op
    and for (op, bucket), then ``extra`` (a launcher's ``config`` argument)."""
    table = LAUNCH[op]
    if bucket is None:
        cfg = dict(table)
    else:
        cfg = {**table.get("default", {}), **table.get(bucket, {})} if "default" in table else dict(table[bucket])
    if device is not None and device_kind(device) == "interpreter":
        cfg.update(INTERPRETER.get(op, {}))
    changes = active().launch
    cfg.update(changes.get(op, {}))
    if bucket is not None:
        cfg.update(changes.get((op, bucket), {}))
    cfg.update(extra or {})
    return cfg


def check_launch(changes: Mapping) -> None:
    """A ValueError naming an op or a knob the tables do not have (the overrides' ``launch``), before any change."""
    for key, entry in changes.items():
        op = key[0] if isinstance(key, tuple) else key
        if op not in LAUNCH:
            raise ValueError(f"unknown kernel op {op!r} in launch overrides; the ops are {sorted(LAUNCH)}")
        unknown = set(entry) - _knobs(op)
        if unknown:
            raise ValueError(f"unknown launch configuration keys {sorted(unknown)} for {op!r}; give some of "
                             f"{sorted(_knobs(op))}")


# ------------------------------------------------------------------------------------- the device's SMs


@functools.lru_cache(maxsize=None)
def _device_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """The SMs of CUDA ``device`` (``overrides(sm_count=...)``: that number, on any device)."""
    forced = active().sm_count
    if forced is not None:
        return forced
    device = torch.device(device)
    return _device_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def persistent_programs(device, per_sm: int, interpreter_progs: int) -> int:
    """Programs of a persistent kernel on ``device``: ``per_sm`` per SM on CUDA, ``interpreter_progs``
    elsewhere (the interpreter: small, so each program walks several blocks; its number is the launch table's
    ``PROGRAMS``). Callers cap it by their number of blocks. ``overrides(sm_count=n)``: n SMs on any device."""
    device = torch.device(device)
    if device.type == "cuda" or active().sm_count is not None:
        return sm_count(device) * per_sm
    return interpreter_progs


# ------------------------------------------------------------------------- programmatic dependent launch (PDL)
# The decoder layers folded now (countdown.decode.layer.fold_norms adds and removes them): each one's decode step is
# a chain of our kernels only, which PDL overlaps launch by launch; behind an Inductor kernel (an unfolded layer)
# it would only hold SM slots while it waits. pdl_mode reads it.
FOLDED: "weakref.WeakSet" = weakref.WeakSet()


MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 64, 32  # Hopper's limits per SM


def pdl_wanted(folded=None) -> bool:
    """Whether launches use PDL now (where the device has it): ``overrides(pdl=...)`` if set, else while at least
    one decoder layer is folded (``folded``: that registry instead of :data:`FOLDED`)."""
    forced = active().pdl
    if forced is not None:
        return forced
    return len(FOLDED if folded is None else folded) > 0


@functools.lru_cache(maxsize=None)
def _gdc_here() -> bool:
    """Whether Triton has grid-dependency control (>= 3.3; jit_helpers imports it)."""
    from . import jit_helpers

    return jit_helpers.HAVE_GDC


def pdl_active(t, folded=None) -> bool:
    """Whether launches on tensor ``t``'s device use PDL now: wanted (:func:`pdl_wanted`: a layer folded, or
    ``overrides(pdl=True)``), a CUDA device of compute capability 9.0 or more, Triton with grid-dependency control,
    not the interpreter."""
    if not (t.is_cuda and pdl_wanted(folded)) or interpreting() or not _gdc_here():
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def pdl_mode(t) -> int:
    """The PDL constexpr of a kernel launched on ``t``'s device: 0 off, 1 on (each program signals at its start)."""
    return 1 if pdl_active(t) else 0


def launch_kwargs(on) -> dict:
    """Extra keyword arguments of a dependent kernel's launch."""
    return {"launch_pdl": True} if on else {}


def weights_early(t, programs: int, num_warps: int) -> bool:
    """Whether a PDL launch of the fixed GEMV loads its first weight tile before it waits: when its ``programs`` of
    ``num_warps`` warps fit on the device's SMs at once (by warps and programs per SM; registers may allow fewer):
    the predictors' GEMVs, not the step's big projections, whose early programs would hold SM slots that the
    previous grid's tail still needs."""
    per_sm = min(MAX_PROGRAMS_PER_SM, MAX_WARPS_PER_SM // max(1, num_warps))
    return programs <= persistent_programs(t.device, per_sm, 0)


# ------------------------------------------------------------------------------------------------ overrides


@dataclasses.dataclass(frozen=True)
class Overrides:
    """What :func:`overrides` may change (tests, and benchmarks' sweeps; nothing a user needs).

    poison_outputs: every output buffer filled with NaN (integers: -1) before a kernel writes it.
    cuda_routes: kernels (names of route.py's table) that take their CUDA route under the CPU interpreter too
        (True: all of them), as on a GPU.
    off: kernels no route takes: a route naming one takes the interpreter's route of its bucket instead.
    routes: route.py entries replaced, ``{(kind, device): (one token, 2-8 tokens, more)}``.
    launch: launch configurations changed, ``{op: knobs}`` (every bucket) or ``{(op, bucket): knobs}``.
    triton: False: as if Triton were not installed (every op runs its PyTorch reference).
    sm_count: the SMs the launch geometry assumes, on any device (a GPU's geometry on the CPU).
    pdl: programmatic dependent launch forced on (True) or off (False); None: while a layer is folded.
    on_launch: called as ``on_launch(kernel, *args)`` before each launch (the spy hook: count the launches or see
        their arguments); the launchers name their kernels and arguments in their docstrings.
    """

    poison_outputs: bool = False
    cuda_routes: bool | tuple[str, ...] = ()
    off: tuple[str, ...] = ()
    routes: Mapping = dataclasses.field(default_factory=dict)
    launch: Mapping = dataclasses.field(default_factory=dict)
    triton: bool = True
    sm_count: int | None = None
    pdl: bool | None = None
    on_launch: Callable | None = None


_ACTIVE = [Overrides()]  # the overrides in force: _ACTIVE[0] (replaced, never mutated, by overrides())


def active() -> Overrides:
    """The overrides in force (the defaults outside any :func:`overrides` context)."""
    return _ACTIVE[0]


@contextlib.contextmanager
def overrides(**changes):
    """Change the fields of :class:`Overrides` for the duration of a ``with`` block; nested blocks add to the outer
    one (``routes`` and ``launch`` merged entry by entry). Unknown fields, ops or knobs are named before anything
    changes. Set them before a step compiles: a compiled graph keeps the routes it was traced with."""
    fields = {f.name for f in dataclasses.fields(Overrides)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"overrides takes no {', '.join(unknown)}; it takes {', '.join(sorted(fields))}")
    check_launch(changes.get("launch", {}))
    outer = active()
    for name in ("routes", "launch"):
        if name in changes:
            changes[name] = {**getattr(outer, name), **changes[name]}
    for name in ("cuda_routes", "off"):
        if isinstance(changes.get(name), (list, set, frozenset)):
            changes[name] = tuple(changes[name])
    _ACTIVE[0] = dataclasses.replace(outer, **changes)
    try:
        yield _ACTIVE[0]
    finally:
        _ACTIVE[0] = outer


def launching(kernel: str, *args) -> None:
    """Tell the overrides' ``on_launch`` spy (if any) that ``kernel`` launches with ``args``: every launcher calls
    it once per launch, before it."""
    spy = _ACTIVE[0].on_launch
    if spy is not None:
        spy(kernel, *args)
