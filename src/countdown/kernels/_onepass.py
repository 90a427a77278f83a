"""Triton kernel: a whole sparse Gated-MLP for one token in one launch (the decode step's case).

For the token x [d_model] and its indicator ind [d_inter] (u for mono, g for cats, the predictor's
scores x A B for dual), either given (``IND="torch"``: computed before the op, on kernels/_linear.py's
fixed GEMV by default, see IND_GEMV; measured faster than this kernel's own) or computed here from
the indicator's input v (x for mono / cats, the latent x A for dual):

    ind[i]  = v . W_ind[i]                  W_ind = W_up (mono), W_gate (cats), B^T (dual)
    keep[i] = |ind| > t, |act(ind)| > t or ind > t[i]       (the MODEs of _glu.py)
    s[i]    = u[i] * act(g[i])              for kept rows; the GEMV that is not the indicator is
                                            computed for kept rows only
    P[p]    = sum over the rows program p owns of s[i] * w_down_t[i]          (fp32 partials)

and y = P.sum(0), in x's dtype, is left to the caller (``onepass_mlp``): under torch.compile that
sum and cast fuse into the residual add that follows, so a decode step's sparse MLP is one launch
of ours instead of three (GLU kernel, down kernel, cast; see _chain.py).

The grid is persistent: PROGS programs (a few per SM) walk the row chunks c = p, p + PROGS, ...
Per chunk a program reads the chunk's indicators (or computes them from the chunk's W_ind rows: loaded
whole, one DRAM round trip; or RB rows a step, pipelined; or as a product over K, IND_DOT columns a step,
on the tensor cores or, IND_FMA, the CUDA cores: _indicator.py), compacts the kept
rows in registers (prefix sum + one-hot select, as _glu.py), then loads BLOCK_M kept rows of every
matrix it still needs, all loads issued before any arithmetic (one more round trip), and adds
s W_down rows into its fp32 accumulator [d_model]. With PREFETCH the next chunk's indicator rows
are requested before the current chunk's kept rows, so the two round trips overlap. Partials are
written whole (no atomics, no zeroed workspace): the reduction is deterministic.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _balanced, _common, _linear, _overlap, _pdl, _psum, _split  # _balanced, _linear, _split: their ops
from ._common import act_code
from ._chunk import _add_kept_rows, _kept_places, _row_thresholds
from ._glu import MODES, _load_vec, _pow2, _round_to, _store_partial
from ._indicator import _dot_indicator, _rows, _step_rows, _stepped_indicator, _tma_indicator
from ._pdl import gdc_launch_dependents, gdc_wait
from ._psum import _sum_tail
from ._rmsnorm import _normed

# One token only (n_tok == 1), on CUDA; elsewhere (the CPU interpreter) only where a test asks for
# it, since the in-kernel indicator may differ from torch's in the last bit at a threshold tie.
ONEPASS = True
ONEPASS_OFF_CUDA = False

# Launch configurations by indicator kind (mono: u, cats: g, dual: the predictor's scores). IND: where
# the indicator is computed, "torch" (before the op) or "kernel" (from W_ind rows; PREFETCH applies to
# it only). Defaults: the fastest of `benchmarks/onepass.py --sweep` on an H200, 2026-11-21, Llama-3.1-8B
# shape, k = 0.9 (benchmarks/results/onepass/): with IND="torch" mono 49.4 us, dual 36.4 us under
# torch.compile; KERNEL_IND_CONFIGS, the best with IND="kernel", 51.2 us and 36.4 us.
# "gt" (dual: the predictor's or the shadows' scores) since 2026-11-23: BLOCK_M 2 with the tile loop
# software-pipelined 3 deep (STAGES, tl.range's num_stages): x + mlp(x) compiled 46.98 / 38.50 / 29.39 us at
# k = 0.7 / 0.8 / 0.9 against 49.21 / 40.52 / 30.75 (benchmarks/balanced.py --onepass-only, H200,
# benchmarks/results/balanced/stages/); mono gains nothing from it (21.4 -> 21.6-27.0 us alone).
# "abs" (mono) since 2026-11-25 (session 19): u = x W_up^T streamed inside this kernel (IND "kernel"), each
# program one chunk of about 56 rows (ROWS "auto"), RB 2 rows a step pipelined 3 deep (ISTAGES), the first
# step's rows loaded before the PDL wait (W_EARLY): no GEMV launch before it and no indicator round trip. Its
# u phase is slower than the fixed GEMV (35.6-35.9 us against 27.2-27.5) but the kept rows cost 8 us on top
# of it instead of 17: one mono MLP alone 43.8-44.2 us against 44.3-44.7 for the fixed GEMV + this kernel,
# in the decode step 41.2 / 41.8 us against 41.9 / 42.3 (benchmarks/ind_kernel.py and benchmarks/fused_ab.sh,
# H200, benchmarks/results/ind_kernel/). The indicator as a tensor-core product (IND_DOT) was slower (38.7-61 us
# for the u phase alone), and so was dual[lowrank] with its scores in the kernel (29.2 us against 26.2 in the step);
# session 20: its K walk on the CUDA cores (IND_FMA) and more programs an SM were slower in all (45.4-103 us).
# session 21: its tiles by TMA through shared memory (IND_TMA) 46.6-94 us; BLOCK_M 2 with STAGES 3 42.4 us alone
# against 43.8 but slower in the step (351.4 against 355.2-356.4 tokens/s): benchmarks/results/ind_kernel/.
# COUNTDOWN_ONEPASS_CONFIGS='{"abs": {...}}' (JSON) overrides entries, for tuning runs.
CONFIGS = {
    "abs": dict(IND="kernel", ROWS="auto", RB=2, ISTAGES=3, W_EARLY=True, CHUNK=64, BLOCK_M=4, num_warps=4,
                PER_SM=2, PREFETCH=False),
    "abs_act": dict(IND="torch", CHUNK=64, BLOCK_M=4, num_warps=4, PER_SM=4, PREFETCH=False),
    "gt": dict(IND="torch", CHUNK=64, BLOCK_M=2, num_warps=4, PER_SM=4, PREFETCH=False, STAGES=3),
}
KERNEL_IND_CONFIGS = {
    "abs": dict(IND="kernel", CHUNK=8, BLOCK_M=2, num_warps=8, PER_SM=2, PREFETCH=False),
    "gt": dict(IND="kernel", CHUNK=32, BLOCK_M=2, num_warps=4, PER_SM=2, PREFETCH=False),
}


_common.env_configs("COUNTDOWN_ONEPASS_CONFIGS", CONFIGS, '{"abs": {"CHUNK": 16}}')
INTERPRETER_PROGS = 3  # programs under the interpreter: small, so each walks several chunks

# Where a one-token indicator computed before the op runs (mono's u, cats' g, the low-rank predictor's
# x A and (x A) B): "fixed" = kernels/_linear.py's GEMV, an opaque op with one launch configuration
# per shape; "inductor" = x @ W^T, which torch.compile fuses with the RMSNorm before it and tunes per
# compile (mono's norm + W_up kernel took 27 us a layer in one compile of the 8B decode step, 39 us in
# another, where the GEMV alone takes 28: docs/decode.md). COUNTDOWN_IND_GEMV overrides the default.
IND_GEMV = os.environ.get("COUNTDOWN_IND_GEMV", "fixed")
IND_GEMV_OFF_CUDA = False  # the fixed route under the CPU interpreter too (tests only)
if IND_GEMV not in ("fixed", "inductor"):
    raise ValueError(f"COUNTDOWN_IND_GEMV must be 'fixed' or 'inductor', got {IND_GEMV!r}")

# The sparse phase when the indicator is given: "onepass" (this file's kernel: each program finds the
# kept rows of its own chunks), "balanced" (_balanced.py: every program ranks all kept rows and takes
# an equal share) or "split" (_split.py: the kept rows' coefficients, then the down projection split by
# output columns; no partial sums) or "overlap" (_overlap.py: the indicator's GEMV in the same grid, each
# chunk's kept rows loaded as soon as its indicators exist). COUNTDOWN_SPARSE_KERNEL overrides the default.
SPARSE_KERNELS = ("onepass", "balanced", "split", "overlap")
SPARSE_KERNEL = os.environ.get("COUNTDOWN_SPARSE_KERNEL", "onepass")
if SPARSE_KERNEL not in SPARSE_KERNELS:
    raise ValueError(f"COUNTDOWN_SPARSE_KERNEL must be one of {SPARSE_KERNELS}, got {SPARSE_KERNEL!r}")


def ind_linear(x2: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """x2 [1, K] @ w_rows [N, K]^T in x2's dtype: on the fixed GEMV (IND_GEMV "fixed", CUDA, one row as
    the routes serve, a contiguous w_rows of x2's dtype), else a plain matrix product (w_rows may then be
    any view)."""
    if IND_GEMV == "fixed" and (x2.is_cuda or IND_GEMV_OFF_CUDA) and w_rows.is_contiguous() \
            and x2.dtype == w_rows.dtype and 1 <= x2.shape[0] <= _common.DECODE_GEMV_ROUTE_TOKENS:
        return torch.ops.countdown.decode_linear(x2, w_rows, None, None)
    return x2 @ w_rows.t()


@triton.jit
def _onepass_kernel(
    X, V, WI, WI_DESC, IND, WG, WU, WD, THR, P, Y, T, NW,
    thr_f, norm_eps, d_model, d_inter, k_ind, n_chunks, n_progs, rows_per_chunk,
    MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr,
    THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr, EVEN_D: tl.constexpr, EVEN_I: tl.constexpr,
    BIG: tl.constexpr, PREFETCH: tl.constexpr, SPARSE: tl.constexpr, DENSE: tl.constexpr,
    PDL: tl.constexpr = 0, STAGES: tl.constexpr = 1,
    REDUCERS: tl.constexpr = 0, BC: tl.constexpr = 16, BR: tl.constexpr = 16,
    RB: tl.constexpr = 0, ISTAGES: tl.constexpr = 1, W_EARLY: tl.constexpr = False, V_IS_X: tl.constexpr = False,
    IND_BK: tl.constexpr = 0, DOT_F32: tl.constexpr = False, FMA: tl.constexpr = False, IND_TMA: tl.constexpr = 0,
    NORM: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if PDL == 1:  # launched early (_pdl.py); the partials' sum may launch now, it waits for this grid
        gdc_launch_dependents()
    kd = tl.arange(0, BLOCK_D)
    ki = tl.arange(0, BLOCK_I)
    w0 = 0.0
    if W_EARLY:  # the first step's indicator rows: weights, so before the wait for the previous kernel
        w0 = _step_rows(WI, pid * rows_per_chunk, 0, rows_per_chunk, ki, k_ind, d_inter, RB, BIG, EVEN_I)
    if PDL:  # nothing of the previous kernel's output is read before this
        gdc_wait()
    if NORM:  # X is the residual stream h and x = RMSNorm(h) (weight NW), computed by every program
        xv = _normed(X, NW, norm_eps, kd, d_model, EVEN_D, X.dtype.element_ty)
    else:
        xv = _load_vec(X, kd, d_model, EVEN_D)
    if DENSE:
        if V_IS_X:  # mono / cats: the indicator's input is x itself (one fp32 [d_model] in registers, not two)
            vv = xv
        elif EVEN_I:
            vv = tl.load(V + ki).to(tl.float32)
        else:
            vv = tl.load(V + ki, mask=ki < k_ind, other=0.0).to(tl.float32)
    if THR_PTR:
        thr_s = tl.load(THR).to(tl.float32)
    else:
        thr_s = thr_f
    yacc = tl.zeros([BLOCK_D], dtype=tl.float32)
    cr = tl.arange(0, CHUNK)

    if PREFETCH and DENSE:  # the first chunk's indicator rows
        wi_n = _rows(WI, pid * CHUNK + cr, ki, k_ind, d_inter, BIG, EVEN_I)

    for c in range(pid, n_chunks, n_progs):
        r = c * rows_per_chunk + cr  # rows_per_chunk <= CHUNK rows (ROWS "auto": not a power of two)
        rmask = (cr < rows_per_chunk) & (r < d_inter)
        if not DENSE:  # the indicator was computed before the launch
            ind = tl.load(IND + r, mask=rmask, other=0.0).to(tl.float32)
        elif IND_BK > 0:  # a matrix product over K, BK columns a step, pipelined through shared memory
            ind = _dot_indicator(WI, V, c * rows_per_chunk, rows_per_chunk, cr, k_ind, d_inter, CHUNK, IND_BK,
                                 ISTAGES, BIG, V.dtype.element_ty, DOT_F32, FMA)
        elif IND_TMA > 0:  # [RB, IND_TMA] tiles through shared memory (Hopper's TMA), ISTAGES in flight
            ind = _tma_indicator(WI_DESC, V, c * rows_per_chunk, rows_per_chunk, cr, k_ind, RB, IND_TMA, ISTAGES,
                                 V.dtype.element_ty)
        elif RB > 0:  # RB rows a step, the steps software-pipelined ISTAGES deep (a streaming GEMV)
            ind = _stepped_indicator(WI, vv, c * rows_per_chunk, rows_per_chunk, cr, ki, k_ind, d_inter, w0,
                                     c == pid, RB, ISTAGES, W_EARLY, BIG, EVEN_I, V.dtype.element_ty)
        elif PREFETCH:  # this chunk's rows arrived during the last one; request the next chunk's
            wi = wi_n  # (beyond the last chunk every row is masked: nothing is read)
            wi_n = _rows(WI, (c + n_progs) * CHUNK + cr, ki, k_ind, d_inter, BIG, EVEN_I)
        else:
            wi = _rows(WI, r, ki, k_ind, d_inter, BIG, EVEN_I)
        if DENSE and RB == 0 and IND_BK == 0:  # the indicator from whole rows, rounded as a dense GEMV returns it
            ind = _round_to(tl.sum(wi.to(tl.float32) * vv[None, :], axis=1), V.dtype.element_ty)
        pos, cnt = _kept_places(ind, _row_thresholds(THR, r, rmask, thr_s, THR_VEC), rmask, MODE, ACT)
        if not SPARSE:  # timing experiment only (benchmarks/onepass.py --stages): the indicator phase
            yacc += tl.sum(tl.where(pos >= 0, ind, 0.0), axis=0)  # alone; keeps its loads alive
            cnt = 0
        yacc = _add_kept_rows(yacc, pos, cnt, r, ind, xv, kd, WG, WU, WD, d_model, GATE, UP, ACT, BLOCK_M, STAGES,
                              BIG, EVEN_D, X.dtype.element_ty)

    if PDL == 2:
        gdc_launch_dependents()
    _store_partial(P, pid, yacc, kd, d_model, BIG, EVEN_D)
    if REDUCERS > 0:  # _psum.py's tail route: the last programs to finish sum the partials into Y
        _sum_tail(P, Y, T, n_progs, d_model, REDUCERS, BC, BR)


def _tma_block(cfg: dict, w_ind: torch.Tensor, rb: int) -> int:
    """IND_TMA: the indicator's K columns a TMA tile (RB rows), or 0 for the register route: no RB, or rows the
    accelerator cannot address (a row or the base not on 16 bytes)."""
    bk = int(cfg.get("IND_TMA", 0))
    if not bk or not rb:
        return 0
    if bk & (bk - 1) or not 16 <= bk <= 256:
        raise ValueError(f"IND_TMA (indicator columns a TMA tile) must be a power of two in [16, 256], got {bk}")
    if (w_ind.shape[1] * w_ind.element_size()) % 16 or w_ind.data_ptr() % 16:
        return 0
    return bk


def _tma_descriptor(w_ind: torch.Tensor, rb: int, bk: int):
    """A host-side TensorDescriptor of W_ind with block [rb, bk] (bk > 0), else W_ind itself (never read)."""
    if not bk:
        return w_ind
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w_ind, [rb, bk])


def _chunking(device: torch.device, d_inter: int, cfg: dict) -> tuple[int, int, int]:
    """(rows per chunk, CHUNK = the power of two that holds them, programs). ROWS "auto": one chunk per
    program, d_inter split evenly over PER_SM programs per SM (in whole RB steps)."""
    most = _common.persistent_programs(device, cfg["PER_SM"], INTERPRETER_PROGS)
    if cfg.get("ROWS") == "auto":
        step = max(1, cfg.get("RB", 0))  # whole indicator steps a program (no row of the next one read)
        rows = triton.cdiv(triton.cdiv(d_inter, most), step) * step
        chunk = max(16, _pow2(rows))
    else:
        rows = chunk = cfg["CHUNK"]
    return rows, chunk, max(1, min(triton.cdiv(d_inter, rows), most))


def n_programs(device: torch.device, d_inter: int, mode: str, config: dict | None = None) -> int:
    """How many partial sums the kernel writes for this device, shape and mode (the op's output rows)."""
    return _chunking(device, d_inter, {**CONFIGS[mode], **(config or {})})[2]


def applies(x2: torch.Tensor) -> bool:
    """Whether the one-launch kernel serves this [n_tok, d_model] input."""
    return ONEPASS and x2.shape[0] == 1 and (x2.is_cuda or ONEPASS_OFF_CUDA)


LAST_KERNEL = None


def onepass_partials(x, v, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str,
                     gate: bool, up: bool, config: dict | None = None, ind=None, tail: bool = False,
                     norm: tuple | None = None) -> torch.Tensor:
    """The fp32 partial sums P [n_programs, d_model] for x [1, d_model]; y = P.sum(0). The indicator
    is ``ind`` [1, d_inter] if given, else computed in the kernel as v [1, k] . w_ind [d_inter, k] rows.
    With ``tail`` the kernel sums them itself (_psum.py's tail) and y [1, d_model] in x's dtype is returned
    (the partials and their sum' launch where no counters can be had: inside a first CUDA-graph capture).
    With ``norm`` = (weight [d_model], eps) ``x`` is the residual stream h and the MLP's input is RMSNorm(h),
    computed in the kernel (kernels/_block.py); the indicator is then ``ind`` or computed here from x's own
    rows in registers (v = x; not IND_DOT / IND_TMA, which read v from memory)."""
    global LAST_KERNEL
    cfg = {**CONFIGS[mode], **(config or {})}
    n_tok, d_model = x.shape
    if n_tok != 1:
        raise ValueError(f"the one-launch kernel takes one token, got {n_tok}")
    d_inter = w_gate.shape[0]
    if ind is not None:
        if ind.shape != (1, d_inter):
            raise ValueError(f"indicator must be [1, {d_inter}], got {tuple(ind.shape)}")
        ind = ind.contiguous()
        v, w_ind = x, w_gate  # placeholders, never read
    elif w_ind.shape[0] != d_inter or v.shape != (1, w_ind.shape[1]):
        raise ValueError(f"indicator input must be v [1, k] and w_ind [{d_inter}, k], got "
                         f"{tuple(v.shape)} and {tuple(w_ind.shape)}")
    k_ind = w_ind.shape[1]
    x, v, w_ind = x.contiguous(), v.contiguous(), w_ind.contiguous()
    w_gate, w_up, w_down_t = w_gate.contiguous(), w_up.contiguous(), w_down_t.contiguous()
    thr_vec = thr_t is not None and thr_t.dim() == 1
    if thr_vec and thr_t.numel() != d_inter:
        raise ValueError(f"a per-row threshold needs d_inter={d_inter} values, got {thr_t.numel()}")
    rows, chunk, progs = _chunking(x.device, d_inter, cfg)
    rb = int(cfg.get("RB", 0)) if ind is None else 0
    if rb and (rb & (rb - 1) or rb > chunk):
        raise ValueError(f"RB (indicator rows a step) must be a power of two <= CHUNK {chunk}, got {rb}")
    fma = bool(cfg.get("IND_FMA", False))  # IND_DOT's K walk on the CUDA cores
    ind_bk = int(cfg.get("IND_DOT", 0)) if ind is None and (fma or w_ind.dtype != torch.float32) else 0
    if ind_bk:  # (fp32 rows as a product: the register route instead, the tensor cores would round them)
        if ind_bk & (ind_bk - 1) or ind_bk < 16 or chunk < 16:
            raise ValueError(f"IND_DOT (indicator columns a step) must be a power of two >= 16, got {ind_bk}")
        rb = 0
    tma_bk = _tma_block(cfg, w_ind, rb) if ind is None else 0
    v_is_x = ind is None and v.data_ptr() == x.data_ptr() and v.shape == x.shape and v.dtype == x.dtype
    if norm is not None:
        norm_w = norm[0]
        if ind is None and (not v_is_x or ind_bk or tma_bk):
            raise ValueError("norm (RMSNorm in the kernel) needs the indicator given (ind) or computed here from x "
                             "itself in registers: v = x, no IND_DOT / IND_TMA (mono or cats with IND 'kernel')")
        if norm_w.shape != (d_model,) or norm_w.dtype != x.dtype or norm_w.device != x.device:
            raise ValueError(f"the norm's weight must be [{d_model}] of x's dtype and device ({x.dtype}, "
                             f"{x.device}), got {tuple(norm_w.shape)} {norm_w.dtype} {norm_w.device}")
        norm_w = norm_w.contiguous()
    if ind is None and cfg["PREFETCH"] and (rb or ind_bk or rows != chunk):
        raise ValueError("PREFETCH (the next chunk's indicator rows loaded whole) takes RB=0 and no ROWS='auto'")
    block_d, block_i = max(16, _pow2(d_model)), max(16, _pow2(k_ind))
    p = _common.new_output((progs, d_model), torch.float32, x.device)
    counter = _psum.counters(x.device) if tail else None
    reducers, bc, br = _psum.tail_shape(x.device, progs, d_model) if counter is not None else (0, 16, 16)
    y = _common.new_output((1, d_model), x.dtype, x.device) if counter is not None else p
    pdl = _pdl.mode(x, "onepass")
    LAST_KERNEL = _onepass_kernel[(progs,)](
        x, v, w_ind, _tma_descriptor(w_ind, rb, tma_bk), ind if ind is not None else p, w_gate, w_up, w_down_t,
        thr_t if thr_t is not None else p, p, y, counter if counter is not None else p,
        norm_w if norm is not None else p, float(thr_f), float(norm[1]) if norm is not None else 0.0, d_model,
        d_inter, k_ind, triton.cdiv(d_inter, rows), progs, rows,
        MODE=MODES[mode], GATE=gate, UP=up, ACT=act_code(activation),
        THR_PTR=thr_t is not None, THR_VEC=thr_vec, CHUNK=chunk, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_D=block_d, BLOCK_I=block_i, EVEN_D=block_d == d_model, EVEN_I=block_i == k_ind,
        BIG=d_inter * max(d_model, k_ind) >= 2**31, PREFETCH=bool(cfg["PREFETCH"]) and ind is None,
        SPARSE=bool(cfg.get("SPARSE", True)), DENSE=ind is None, PDL=pdl, STAGES=int(cfg.get("STAGES", 1)),
        REDUCERS=reducers, BC=bc, BR=br, RB=rb, ISTAGES=int(cfg.get("ISTAGES", 1)),
        W_EARLY=bool(rb and not tma_bk and cfg.get("W_EARLY", False)), IND_BK=ind_bk, IND_TMA=tma_bk,
        DOT_F32=_common.interpreting(), FMA=bool(ind_bk) and fma,
        V_IS_X=v_is_x, NORM=norm is not None,
        num_warps=cfg["num_warps"], num_stages=1, **_pdl.launch_kwargs(pdl),
    )
    if tail:
        return y if counter is not None else _psum.sum_partials(p, x.dtype)
    return p


@torch.library.custom_op("countdown::gated_onepass", mutates_args=())
def _onepass_op(x: torch.Tensor, v: Optional[torch.Tensor], w_ind: Optional[torch.Tensor],
                ind: Optional[torch.Tensor], w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
                thr_t: Optional[torch.Tensor], thr_f: float, mode: str, activation: str, gate: bool,
                up: bool) -> torch.Tensor:
    return onepass_partials(x, v, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up,
                            ind=ind)


@_onepass_op.register_fake
def _(x, v, w_ind, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up):
    return x.new_empty((n_programs(x.device, w_gate.shape[0], mode), x.shape[1]), dtype=torch.float32)


@torch.library.custom_op("countdown::gated_onepass_sum", mutates_args=())
def _onepass_sum_op(x: torch.Tensor, v: Optional[torch.Tensor], w_ind: Optional[torch.Tensor],
                    ind: Optional[torch.Tensor], w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
                    thr_t: Optional[torch.Tensor], thr_f: float, mode: str, activation: str, gate: bool,
                    up: bool) -> torch.Tensor:
    return onepass_partials(x, v, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up,
                            ind=ind, tail=True)


@_onepass_sum_op.register_fake
def _(x, v, w_ind, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up):
    return torch.empty_like(x)


def indicator_outside(mode: str) -> bool:
    """Whether the ops compute the indicator in PyTorch before the launch (CONFIGS[mode]["IND"]; never for
    the "overlap" sparse kernel, which computes it in its own grid)."""
    if SPARSE_KERNEL in ("split", "balanced"):  # their kernels take the indicator given
        return True
    return SPARSE_KERNEL != "overlap" and CONFIGS[mode].get("IND", "torch") == "torch"


def threshold_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str,
                  residual=None) -> torch.Tensor:
    """mono (mode "abs": keep |u| > t) or cats ("abs_act": keep |act(g)| > t) for one token."""
    w_ind = w_up if mode == "abs" else w_gate
    src = dict(ind=ind_linear(x2, w_ind)) if indicator_outside(mode) else dict(v=x2, w_ind=w_ind)
    return onepass_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation,
                       gate=mode == "abs", up=mode != "abs", residual=residual, **src)


def onepass_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str, gate: bool, up: bool,
                *, ind=None, v=None, w_ind=None, residual=None) -> torch.Tensor:
    """y [1, d_model] in x's dtype from the indicator ``ind`` [1, d_inter] or its input ``v`` and rows
    ``w_ind``: the op's partials summed and cast outside it (_psum.reduce: PyTorch's sum while
    torch.compile traces it, which fuses it with its neighbours; run eagerly, _psum.py's op). With
    ``residual`` (a folded layer's h, in residual's shape) residual + y, the add in the partials' sum where
    the route leaves partials (_psum.reduce), else on a launch of its own."""
    if ind is None and SPARSE_KERNEL == "overlap":  # the indicator's GEMV and the sparse rows in one grid
        if _overlap.counters(x2.device) is not None:
            p = torch.ops.countdown.gated_overlap(x2, v, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode,
                                                  activation, gate, up)
            return _psum.reduce(p, x2, residual)
        ind = ind_linear(v, w_ind)  # its counters not made (_overlap.prepare): the default route
    if ind is not None and SPARSE_KERNEL == "split":  # two launches, y itself: nothing to sum
        return _psum.add_residual(torch.ops.countdown.gated_split(x2, ind, w_gate, w_up, w_down_t, thr_t, thr_f,
                                                                  mode, activation, gate, up), residual)
    if ind is not None and SPARSE_KERNEL == "balanced":  # its own op: another output shape, another graph
        p = torch.ops.countdown.gated_balanced(x2, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation,
                                               gate, up)
    elif _psum.use_tail(x2):  # the kernel sums its own partials: no launch for the sum
        return _psum.add_residual(torch.ops.countdown.gated_onepass_sum(
            x2, v, w_ind, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation, gate, up), residual)
    else:
        p = torch.ops.countdown.gated_onepass(x2, v, w_ind, ind, w_gate, w_up, w_down_t, thr_t, thr_f,
                                              mode, activation, gate, up)
    return _psum.reduce(p, x2, residual)
