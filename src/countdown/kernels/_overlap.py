"""Triton kernels: one token's sparse Gated-MLP whose sparse rows load while the indicator's GEMV still streams.

In a decode step the indicator (mono's u = x W_up^T, cats' g, dual's scores (x A) B) is a dense GEMV and
the sparse phase (_onepass.py) starts only when that whole grid has finished: its per-chunk chain
(indicators, compaction, kept rows, partial) then runs alone, 13-15 us a layer for 5-8 us of bytes on an
H200 (docs/kernels.md, item 6). Here two grids run at once:

* ``_produce_kernel``, PROD programs per SM (one wave, persistent): sweeps the indicator's rows in order, RB
  rows a step (program p takes rows [(i PROGS + p) RB, + RB) at step i), stores ind = v . W_ind[row]
  (rounded to v's dtype) and adds the rows done to their chunk's counter (an atomic, release semantics);
* ``_consume_kernel``, CONS programs per SM: takes chunks c = q, q + CONS_PROGS, ... of CHUNK rows; for
  each waits until its counter holds all its rows (acquire), sets it back to zero and runs _onepass.py's
  chunk: keep, compact, load the kept rows of W_gate / W_up / W_down^T, add s W_down rows into its partial.

The consumer grid is launched with programmatic dependent launch (_pdl.py) and never waits for the producer
grid to finish, only for its counters: every producer program signals at its start, and a dependent grid
launches only once every program of the grid before it has signalled, so every producer is already running
when a consumer starts waiting (no deadlock, whatever the SMs hold). Without PDL (off, or the interpreter)
the consumers simply run after the producers. The partials P [consumers, d_model] are written whole and
summed by the caller, as _onepass.py's (deterministic: each chunk is summed by one program, in order). The
counters live in one buffer per device, zero between launches (each consumer resets its own); like _psum.py's
tail, one such MLP at a time per device (a decode step's layers run in order), and on CUDA the buffer is
made eagerly by :func:`prepare` before a step is compiled or captured.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common, _pdl
from ._common import act_code
from ._chunk import _add_kept_rows, _kept_places, _row_thresholds
from ._glu import MODES, _load_vec, _pow2, _round_to, _store_partial
from ._pdl import gdc_launch_dependents, gdc_wait

# PROD producer programs per SM of P_WARPS warps, RB indicator rows a step (PSTAGES deep); CONS consumer
# programs per SM of C_WARPS warps, CHUNK rows a chunk (a multiple of RB), BLOCK_M kept rows a step (STAGES).
# PUBLISH: "step" (every producer step counted as it is stored) or "chunk" (producers take whole chunks and
# count each once, one release fence a chunk instead of a step); EVERY ("step"): steps stored before their
# counts are published together (one barrier for EVERY steps). Default: mono's fastest in `benchmarks/overlap.py`
# (H200, 2026-11-25, PDL on, benchmarks/results/overlap/); dual's was PUBLISH "chunk", PROD 2 of 8 warps, RB 8,
# CHUNK 32, CONS 2 of 4 warps. Measured there (whole MLPs, k = 0.9): mono 51.7 us against the default route's
# 49.8, dual 37.3 against 31.5; the kept rows cost less on top of the GEMV (mono +5.8 us from k = 1 to 0.9,
# against +10.5) but the producer side is 6.4 us slower than the fixed GEMV with nothing kept (45.8 against 39.4):
# the release fence per published step. Opt-in (COUNTDOWN_SPARSE_KERNEL=overlap; needs prepare(device) on CUDA).
CONFIG = dict(PROD=4, P_WARPS=4, RB=4, PSTAGES=2, CONS=1, C_WARPS=8, CHUNK=16, BLOCK_M=4, STAGES=1, PUBLISH="step",
              EVERY=1)
INTERPRETER_PROGS = (2, 3)  # producers, consumers under the interpreter
MAX_CHUNKS = 1 << 16
_COUNTERS: dict = {}
LAST_KERNELS: tuple = ()


@triton.jit
def _produce_kernel(V, WI, IND, CNT, d_inter, k_ind, n_prod, CHUNK: tl.constexpr, BLOCK_I: tl.constexpr,
                    EVEN_I: tl.constexpr, BIG: tl.constexpr, RB: tl.constexpr, PSTAGES: tl.constexpr,
                    BY_CHUNK: tl.constexpr = False, COUNT: tl.constexpr = True, EVERY: tl.constexpr = 1,
                    PDL: tl.constexpr = 0):
    pid = tl.program_id(0)
    if PDL:  # the consumers may launch now (they wait on the counters only); v is the last grid's output
        gdc_launch_dependents()
        gdc_wait()
    ki = tl.arange(0, BLOCK_I)
    if EVEN_I:
        vv = tl.load(V + ki).to(tl.float32)
    else:
        vv = tl.load(V + ki, mask=ki < k_ind, other=0.0).to(tl.float32)
    rb = tl.arange(0, RB)
    if BY_CHUNK:  # whole chunks in order (c = pid, pid + n_prod, ...), published once each
        for c in range(pid, tl.cdiv(d_inter, CHUNK), n_prod):
            for r0 in tl.range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, d_inter), RB, num_stages=PSTAGES):
                _produce_rows(V, WI, IND, vv, r0 + rb, ki, d_inter, k_ind, EVEN_I, BIG)
            if COUNT:  # (False: timing the GEMV alone, benchmarks/overlap.py)
                tl.debug_barrier()  # every thread's stores of this chunk before the count that publishes them
                tl.atomic_add(CNT + c, tl.minimum(d_inter - c * CHUNK, CHUNK), sem="release", scope="gpu")
    else:  # RB rows a step, all producers sweeping the rows in order, EVERY steps published at once
        stride = n_prod * RB
        for g0 in tl.range(pid * RB, d_inter, stride * EVERY, num_stages=PSTAGES):
            for j in tl.static_range(EVERY):
                _produce_rows(V, WI, IND, vv, g0 + j * stride + rb, ki, d_inter, k_ind, EVEN_I, BIG)
            if COUNT:
                tl.debug_barrier()  # every thread's stores of these steps before the counts that publish them
                for j in tl.static_range(EVERY):
                    r = g0 + j * stride + rb
                    done = tl.sum((r < d_inter).to(tl.int32), axis=0)
                    if done > 0:
                        tl.atomic_add(CNT + (g0 + j * stride) // CHUNK, done, sem="release", scope="gpu")


@triton.jit
def _produce_rows(V, WI, IND, vv, r, ki, d_inter, k_ind, EVEN_I: tl.constexpr, BIG: tl.constexpr):
    """ind[r] = v . W_ind[r] for the rows ``r`` [RB], rounded to v's dtype and stored."""
    rmask = r < d_inter
    if BIG:
        off = r.to(tl.int64)[:, None] * k_ind + ki[None, :]
    else:
        off = r[:, None] * k_ind + ki[None, :]
    if EVEN_I:
        w = tl.load(WI + off, mask=rmask[:, None], other=0.0)
    else:
        w = tl.load(WI + off, mask=rmask[:, None] & (ki < k_ind)[None, :], other=0.0)
    ind = _round_to(tl.sum(w.to(tl.float32) * vv[None, :], axis=1), V.dtype.element_ty)
    tl.store(IND + r, ind.to(IND.dtype.element_ty), mask=rmask)


@triton.jit
def _wait_chunk(CNT, c, d_inter, CHUNK: tl.constexpr):
    need = tl.minimum(d_inter - c * CHUNK, CHUNK)
    while tl.atomic_add(CNT + c, 0, sem="acquire", scope="gpu") < need:
        pass


@triton.jit
def _consume_kernel(
    X, IND, CNT, WG, WU, WD, THR, P, thr_f, d_model, d_inter, n_chunks, n_cons,
    MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr, THR_PTR: tl.constexpr,
    THR_VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, BIG: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = 0,
):
    q = tl.program_id(0)
    if PDL:  # the partials' sum may launch now (it waits for this grid); no wait for the producers' grid
        gdc_launch_dependents()
    kd = tl.arange(0, BLOCK_D)
    if q < n_chunks:  # x was written before the producers passed their own wait, so after any count
        _wait_chunk(CNT, q, d_inter, CHUNK)
    xv = _load_vec(X, kd, d_model, EVEN_D)
    if THR_PTR:
        thr_s = tl.load(THR).to(tl.float32)
    else:
        thr_s = thr_f
    yacc = tl.zeros([BLOCK_D], dtype=tl.float32)
    cr = tl.arange(0, CHUNK)
    for c in range(q, n_chunks, n_cons):
        r = c * CHUNK + cr
        rmask = r < d_inter
        _wait_chunk(CNT, c, d_inter, CHUNK)
        tl.atomic_xchg(CNT + c, 0, sem="relaxed", scope="gpu")  # zero for the next launch: only we read it
        ind = tl.load(IND + r, mask=rmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        pos, cnt = _kept_places(ind, _row_thresholds(THR, r, rmask, thr_s, THR_VEC), rmask, MODE, ACT)
        yacc = _add_kept_rows(yacc, pos, cnt, r, ind, xv, kd, WG, WU, WD, d_model, GATE, UP, ACT, BLOCK_M, STAGES,
                              BIG, EVEN_D, X.dtype.element_ty)
    _store_partial(P, q, yacc, kd, d_model, BIG, EVEN_D)


def _key(device: torch.device) -> tuple:
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    return device.type, index


def prepare(device) -> torch.Tensor:
    """The chunk counters on ``device`` (int32, zeroed once, then kept at zero by the kernel). On CUDA call it
    once, eagerly, before a step is compiled or captured (an allocation inside a compiled step's CUDA-graph
    pool is one torch.compile rejects)."""
    device = torch.device(device)
    found = _COUNTERS.get(_key(device))
    if found is None:
        found = _COUNTERS[_key(device)] = torch.zeros(MAX_CHUNKS, dtype=torch.int32, device=device)
    return found


def counters(device) -> torch.Tensor | None:
    """The counters on ``device``: made on first use off CUDA, on CUDA only by :func:`prepare` (else None)."""
    device = torch.device(device)
    if device.type != "cuda":
        return prepare(device)
    return _COUNTERS.get(_key(device))


def programs(device, config: dict | None = None) -> tuple[int, int]:
    """(producers, consumers) on ``device``; the consumers are the partials' rows."""
    cfg = {**CONFIG, **(config or {})}
    if torch.device(device).type != "cuda" or _common.interpreting():
        return INTERPRETER_PROGS
    return (_common.persistent_programs(device, cfg["PROD"], 1), _common.persistent_programs(device, cfg["CONS"], 1))


def overlap_partials(x, v, w_ind, w_gate, w_up, w_down_t, thr_t: Optional[torch.Tensor], thr_f: float, mode: str,
                     activation: str, gate: bool, up: bool, config: dict | None = None) -> torch.Tensor:
    """fp32 partials P [consumers, d_model] for x [1, d_model] (y = P.sum(0)), the indicator computed here as
    v [1, k] . w_ind [d_inter, k] rows (mono: x, W_up; cats: x, W_gate; dual: x A, B^T)."""
    global LAST_KERNELS
    cfg = {**CONFIG, **(config or {})}
    n_tok, d_model = x.shape
    d_inter = w_gate.shape[0]
    if n_tok != 1:
        raise ValueError(f"the overlapped kernel takes one token, got {n_tok}")
    if w_ind.shape[0] != d_inter or v.shape != (1, w_ind.shape[1]):
        raise ValueError(f"indicator input must be v [1, k] and w_ind [{d_inter}, k], got {tuple(v.shape)} and "
                         f"{tuple(w_ind.shape)}")
    if cfg["CHUNK"] % cfg["RB"] or cfg["CHUNK"] & (cfg["CHUNK"] - 1):
        raise ValueError(f"CHUNK must be a power of two and a multiple of RB, got {cfg}")
    if cfg["PUBLISH"] not in ("step", "chunk"):
        raise ValueError(f"PUBLISH must be 'step' or 'chunk', got {cfg['PUBLISH']!r}")
    n_chunks = triton.cdiv(d_inter, cfg["CHUNK"])
    cnt = counters(x.device)
    if cnt is None:
        raise RuntimeError("the overlapped kernel's counters are not made on this device: call "
                           "countdown.kernels._overlap.prepare(device) once before compiling or capturing")
    if n_chunks > cnt.numel():
        raise ValueError(f"{n_chunks} chunks: more than the {cnt.numel()} counters; raise CHUNK")
    thr_vec = thr_t is not None and thr_t.dim() == 1
    if thr_vec and thr_t.numel() != d_inter:
        raise ValueError(f"a per-row threshold needs d_inter={d_inter} values, got {thr_t.numel()}")
    x, v, w_ind = x.contiguous(), v.contiguous(), w_ind.contiguous()
    w_gate, w_up, w_down_t = w_gate.contiguous(), w_up.contiguous(), w_down_t.contiguous()
    k_ind = w_ind.shape[1]
    n_prod, n_cons = programs(x.device, cfg)
    block_d = max(16, _pow2(d_model))
    ind = torch.empty(d_inter, dtype=v.dtype, device=x.device)
    p = _common.new_output((n_cons, d_model), torch.float32, x.device)
    pdl = _pdl.mode(x, "onepass")
    big = d_inter * max(d_model, k_ind) >= 2**31
    prod = produce(v, w_ind, ind, cnt, cfg, pdl)
    cons = _consume_kernel[(n_cons,)](
        x, ind, cnt, w_gate, w_up, w_down_t, thr_t if thr_t is not None else p, p, float(thr_f), d_model, d_inter,
        n_chunks, n_cons, MODE=MODES[mode], GATE=gate, UP=up, ACT=act_code(activation), THR_PTR=thr_t is not None,
        THR_VEC=thr_vec, CHUNK=cfg["CHUNK"], BLOCK_M=cfg["BLOCK_M"], BLOCK_D=block_d, EVEN_D=block_d == d_model,
        BIG=big, STAGES=cfg["STAGES"], PDL=pdl, num_warps=cfg["C_WARPS"], num_stages=1, **_pdl.launch_kwargs(pdl))
    LAST_KERNELS = (prod, cons)
    return p


def produce(v, w_ind, ind, cnt, cfg: dict, pdl: int = 0, count: bool = True):
    """Launch the producers: ind [d_inter] = v [1, k] . w_ind rows, each chunk counted into ``cnt`` (``count``
    False: not counted, for timing the GEMV alone; no consumer may then wait on ``cnt``)."""
    d_inter, k_ind = w_ind.shape
    block_i = max(16, _pow2(k_ind))
    n_prod = programs(v.device, cfg)[0]
    return _produce_kernel[(n_prod,)](
        v, w_ind, ind, cnt, d_inter, k_ind, n_prod, CHUNK=cfg["CHUNK"], BLOCK_I=block_i, EVEN_I=block_i == k_ind,
        BIG=d_inter * k_ind >= 2**31, RB=cfg["RB"], PSTAGES=cfg["PSTAGES"], BY_CHUNK=cfg["PUBLISH"] == "chunk",
        COUNT=count, EVERY=cfg["EVERY"], PDL=pdl, num_warps=cfg["P_WARPS"], num_stages=1, **_pdl.launch_kwargs(pdl))


@torch.library.custom_op("countdown::gated_overlap", mutates_args=())
def _overlap_op(x: torch.Tensor, v: torch.Tensor, w_ind: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, mode: str, activation: str,
                gate: bool, up: bool) -> torch.Tensor:
    return overlap_partials(x, v, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up)


@_overlap_op.register_fake
def _(x, v, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up):
    return x.new_empty((programs(x.device)[1], x.shape[1]), dtype=torch.float32)
