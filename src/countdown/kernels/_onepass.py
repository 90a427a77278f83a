"""Triton kernel: a whole sparse Gated-MLP for one token in one launch (the decode step's case).

For the token x [d_model] and its indicator ind [d_inter] (u for mono, g for cats, the predictor's or the
shadows' scores for dual), either given (``IND="torch"``: computed before the op, on kernels/_linear.py's
fixed GEMV, see :func:`ind_linear`) or computed here from x and the indicator's rows (``IND="kernel"``,
mono's default):

    ind[i]  = x . W_ind[i]                  W_ind = W_up (mono), W_gate (cats)
    keep[i] = |ind| > t, |act(ind)| > t or ind > t[i]       (the MODEs of _glu.py)
    s[i]    = u[i] * act(g[i])              for kept rows; the GEMV that is not the indicator is
                                            computed for kept rows only
    P[p]    = sum over the rows program p owns of s[i] * w_down_t[i]          (fp32 partials)

and y = P.sum(0), in x's dtype, is left to the caller (``onepass_mlp``, through _psum.reduce): under
torch.compile that sum and cast fuse into the residual add that follows, so a decode step's sparse MLP is
one launch of ours instead of three (GLU kernel, down kernel, cast; see masked.gated_chain).

The grid is persistent: PROGS programs (a few per SM) walk the row chunks c = p, p + PROGS, ... Per chunk a
program reads the chunk's indicators (or streams the chunk's W_ind rows, RB rows a step, the steps
software-pipelined ISTAGES deep: no GEMV launch before the kernel and no round trip for the indicator),
compacts the kept rows in registers (prefix sum + one-hot select, as _glu.py), then loads BLOCK_M kept rows
of every matrix it still needs, all loads issued before any arithmetic (one more round trip), and adds
s W_down rows into its fp32 accumulator [d_model]. Partials are written whole (no atomics, no zeroed
workspace): the reduction is deterministic.

With NORM (kernels/_block.py) X is the residual stream h and every program computes x = RMSNorm(h) itself,
so a folded layer's MLP half needs no norm launch. With COUNT every program adds the rows it kept (its chunks'
counts, one atomic) to the caller's Sparsity-Real counters (_count.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common, _linear, _pdl, _psum  # _linear: registers the fixed GEMV's op
from ._common import act_code
from ._count import add_count
from ._glu import MODES, _accumulate_rows, _keep, _load_vec, _pow2, _round_to, _row_tiles, _store_partial
from ._pdl import gdc_launch_dependents, gdc_wait
from ._rmsnorm import _normed

# One token only (n_tok == 1), on CUDA; elsewhere (the CPU interpreter) only where a test asks for
# it, since the in-kernel indicator may differ from torch's in the last bit at a threshold tie.
ONEPASS = True
ONEPASS_OFF_CUDA = False

# Launch configurations by indicator kind (mono: u, cats: g, dual: the predictor's or the shadows' scores),
# the fastest of the sweeps at the Llama-3.1-8B shape. IND: where the indicator is computed, "torch" (before
# the op) or "kernel" (from W_ind rows, RB rows a step pipelined ISTAGES deep; the first step's rows loaded
# before the PDL wait, W_EARLY: weights are no grid's output). ROWS "auto": one chunk per program, d_inter
# split evenly over PER_SM programs per SM. STAGES: the kept rows' tile loop software-pipelined
# (tl.range's num_stages). mono streams its u inside the kernel: the kept rows then follow the indicator's
# rows with no launch between them, which costs less than the fixed GEMV plus a kernel that reads u back.
CONFIGS = {
    "abs": dict(IND="kernel", ROWS="auto", RB=2, ISTAGES=3, W_EARLY=True, CHUNK=64, BLOCK_M=4, num_warps=4,
                PER_SM=2),
    "abs_act": dict(IND="torch", CHUNK=64, BLOCK_M=4, num_warps=4, PER_SM=4),
    "gt": dict(IND="torch", CHUNK=64, BLOCK_M=2, num_warps=4, PER_SM=4, STAGES=3),
}
INTERPRETER_PROGS = 3  # programs under the interpreter: small, so each walks several chunks

# The fixed GEMV under the CPU interpreter too (tests only; on CUDA it always serves the one-token indicator).
IND_GEMV_OFF_CUDA = False


def ind_linear(x2: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """x2 [1, K] @ w_rows [N, K]^T in x2's dtype: on the fixed GEMV (CUDA, one row as the routes serve, a
    contiguous w_rows of x2's dtype): an opaque op with one launch configuration per shape, which torch.compile
    cannot fuse with the norm before it and re-tune per compile; else a plain matrix product (w_rows may then
    be any view)."""
    if (x2.is_cuda or IND_GEMV_OFF_CUDA) and w_rows.is_contiguous() \
            and x2.dtype == w_rows.dtype and 1 <= x2.shape[0] <= _common.DECODE_GEMV_ROUTE_TOKENS:
        return torch.ops.countdown.decode_linear(x2, w_rows, None, None)
    return x2 @ w_rows.t()


# --- Triton helpers: one chunk of rows, from its indicators to its kept rows' sum ----------------------


@triton.jit
def _row_thresholds(THR, r, rmask, thr_s, THR_VEC: tl.constexpr):
    """Rows ``r``'s thresholds: their own (THR_VEC: THR holds one per row, fp32) or ``thr_s`` for all."""
    if THR_VEC:  # (if / else, one return each: a return after a constexpr if fails to compile for the GPU)
        return tl.load(THR + r, mask=rmask, other=0.0).to(tl.float32)
    else:
        return thr_s


@triton.jit
def _kept_places(ind, thr, rmask, MODE: tl.constexpr, ACT: tl.constexpr):
    """(pos, cnt): each row's place among the chunk's kept rows in row order (-1 where not kept, or past
    ``rmask``) and how many are kept (the MODEs of _glu._keep)."""
    keep = (_keep(ind, thr, MODE, ACT) & rmask).to(tl.int32)
    return tl.where(keep > 0, tl.cumsum(keep, axis=0) - 1, -1), tl.sum(keep, axis=0)


@triton.jit
def _add_kept_rows(yacc, pos, cnt, r, ind, xv, kd, WG, WU, WD, d_model, GATE: tl.constexpr, UP: tl.constexpr,
                   ACT: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr, BIG: tl.constexpr,
                   EVEN_D: tl.constexpr, DT: tl.constexpr):
    """yacc plus the s W_down rows of the chunk's kept rows (rows ``r``, indicator ``ind``, places ``pos``),
    BLOCK_M at a time: a one-hot select puts them in a tile's slots and every load of the tile (gate / up rows
    where GATE / UP, W_down^T rows) is issued before any arithmetic (one round trip a tile)."""
    for t in tl.range(0, cnt, BLOCK_M, num_stages=STAGES):
        m = t + tl.arange(0, BLOCK_M)
        valid = m < cnt
        sel = pos[None, :] == m[:, None]  # [BLOCK_M, CHUNK] one-hot: tile slot -> chunk row
        rows = tl.sum(tl.where(sel, r[None, :], 0), axis=1)
        it = tl.sum(tl.where(sel, ind[None, :], 0.0), axis=1)
        roff, wmask = _row_tiles(rows, valid, kd, d_model, BIG, EVEN_D)
        if GATE:
            wg = tl.load(WG + roff, mask=wmask, other=0.0)
        else:  # the indicator is g itself (cats)
            wg = it
        if UP:
            wu = tl.load(WU + roff, mask=wmask, other=0.0)
        else:  # the indicator is u itself (mono)
            wu = it
        wd = tl.load(WD + roff, mask=wmask, other=0.0)
        yacc = _accumulate_rows(yacc, wg, wu, wd, xv, valid, GATE, UP, ACT, DT)
    return yacc


@triton.jit
def _step_rows(WI, r0, j, n_rows, ki, k_ind, d_inter, RB: tl.constexpr, BIG: tl.constexpr, EVEN_I: tl.constexpr):
    """Rows r0 + j .. r0 + j + RB - 1 of W_ind [d_inter, k_ind] (zero from row n_rows of the chunk on)."""
    rb = tl.arange(0, RB)
    rows = r0 + j + rb
    rmask = (j + rb < n_rows) & (rows < d_inter)
    if BIG:
        off = rows.to(tl.int64)[:, None] * k_ind + ki[None, :]
    else:
        off = rows[:, None] * k_ind + ki[None, :]
    if EVEN_I:
        return tl.load(WI + off, mask=rmask[:, None], other=0.0)
    else:
        return tl.load(WI + off, mask=rmask[:, None] & (ki < k_ind)[None, :], other=0.0)


@triton.jit
def _stepped_indicator(WI, vv, r0, n_rows, cr, ki, k_ind, d_inter, w0, first, RB: tl.constexpr,
                       ISTAGES: tl.constexpr, W_EARLY: tl.constexpr, BIG: tl.constexpr, EVEN_I: tl.constexpr,
                       DT: tl.constexpr):
    """ind [CHUNK] (fp32 holding DT values) = v . W_ind rows r0 .. r0 + n_rows - 1 (zero past them), RB rows
    of W_ind a step: each step's dot products go into their slots of the chunk's vector (one-hot), so
    the chunk's rows stream through registers RB at a time instead of being loaded whole. W_EARLY: in the
    program's ``first`` chunk the first step's rows are ``w0``, loaded at the program's start."""
    rb = tl.arange(0, RB)
    ind = tl.zeros(cr.shape, dtype=tl.float32)
    start = 0
    if W_EARLY:
        if first:
            d0 = tl.sum(w0.to(tl.float32) * vv[None, :], axis=1)
            ind += tl.sum(tl.where(cr[:, None] == rb[None, :], d0[None, :], 0.0), axis=1)
            start = RB
    for j in tl.range(start, n_rows, RB, num_stages=ISTAGES):
        w = _step_rows(WI, r0, j, n_rows, ki, k_ind, d_inter, RB, BIG, EVEN_I)
        d = tl.sum(w.to(tl.float32) * vv[None, :], axis=1)
        ind += tl.sum(tl.where(cr[:, None] == (j + rb)[None, :], d[None, :], 0.0), axis=1)
    return _round_to(ind, DT)  # as a dense GEMV would return it


@triton.jit
def _onepass_kernel(
    X, WI, IND, WG, WU, WD, THR, P, NW, KEPT, ROWS,
    thr_f, norm_eps, d_model, d_inter, k_ind, n_chunks, n_progs, rows_per_chunk,
    MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr,
    THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr, EVEN_D: tl.constexpr, EVEN_I: tl.constexpr,
    BIG: tl.constexpr, DENSE: tl.constexpr, PDL: tl.constexpr = 0, STAGES: tl.constexpr = 1,
    RB: tl.constexpr = 0, ISTAGES: tl.constexpr = 1, W_EARLY: tl.constexpr = False, NORM: tl.constexpr = False,
    COUNT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if PDL:  # launched early (_pdl.py); the partials' sum may launch now, it waits for this grid
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
    if THR_PTR:
        thr_s = tl.load(THR).to(tl.float32)
    else:
        thr_s = thr_f
    yacc = tl.zeros([BLOCK_D], dtype=tl.float32)
    cr = tl.arange(0, CHUNK)
    n_kept = tl.zeros([], dtype=tl.int32)  # the rows this program keeps (COUNT)

    for c in range(pid, n_chunks, n_progs):
        r = c * rows_per_chunk + cr  # rows_per_chunk <= CHUNK rows (ROWS "auto": not a power of two)
        rmask = (cr < rows_per_chunk) & (r < d_inter)
        if DENSE:  # the indicator from x and W_ind's rows, RB rows a step (a streaming GEMV)
            ind = _stepped_indicator(WI, xv, c * rows_per_chunk, rows_per_chunk, cr, ki, k_ind, d_inter, w0,
                                     c == pid, RB, ISTAGES, W_EARLY, BIG, EVEN_I, X.dtype.element_ty)
        else:  # the indicator was computed before the launch
            ind = tl.load(IND + r, mask=rmask, other=0.0).to(tl.float32)
        pos, cnt = _kept_places(ind, _row_thresholds(THR, r, rmask, thr_s, THR_VEC), rmask, MODE, ACT)
        n_kept += cnt
        yacc = _add_kept_rows(yacc, pos, cnt, r, ind, xv, kd, WG, WU, WD, d_model, GATE, UP, ACT, BLOCK_M, STAGES,
                              BIG, EVEN_D, X.dtype.element_ty)

    _store_partial(P, pid, yacc, kd, d_model, BIG, EVEN_D)
    if COUNT:
        add_count(KEPT, ROWS, n_kept, d_inter, pid == 0)


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


def onepass_partials(x, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str,
                     gate: bool, up: bool, config: dict | None = None, ind=None,
                     norm: tuple | None = None, count=None) -> torch.Tensor:
    """The fp32 partial sums P [n_programs, d_model] for x [1, d_model]; y = P.sum(0). The indicator is
    ``ind`` [1, d_inter] if given, else computed in the kernel as x . w_ind [d_inter, d_model] rows (RB rows a
    step). With ``norm`` = (weight [d_model], eps) ``x`` is the residual stream h and the MLP's input is
    RMSNorm(h), computed in the kernel (kernels/_block.py); an indicator computed here then reads it too. The
    kept rows are added to ``count`` = (kept, rows) if given (_count.py)."""
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
        w_ind = w_gate  # a placeholder, never read
    elif w_ind is None or w_ind.shape != (d_inter, d_model):
        raise ValueError(f"the indicator's rows must be w_ind [{d_inter}, {d_model}] (read against x), got "
                         f"{None if w_ind is None else tuple(w_ind.shape)}")
    k_ind = w_ind.shape[1]
    x, w_ind = x.contiguous(), w_ind.contiguous()
    w_gate, w_up, w_down_t = w_gate.contiguous(), w_up.contiguous(), w_down_t.contiguous()
    thr_vec = thr_t is not None and thr_t.dim() == 1
    if thr_vec and thr_t.numel() != d_inter:
        raise ValueError(f"a per-row threshold needs d_inter={d_inter} values, got {thr_t.numel()}")
    rows, chunk, progs = _chunking(x.device, d_inter, cfg)
    rb = int(cfg.get("RB", 0)) if ind is None else 0
    if ind is None and (rb < 1 or rb & (rb - 1) or rb > chunk):
        raise ValueError(f"RB (indicator rows a step) must be a power of two <= CHUNK {chunk}, got {rb}")
    if norm is not None:
        norm_w = norm[0]
        if norm_w.shape != (d_model,) or norm_w.dtype != x.dtype or norm_w.device != x.device:
            raise ValueError(f"the norm's weight must be [{d_model}] of x's dtype and device ({x.dtype}, "
                             f"{x.device}), got {tuple(norm_w.shape)} {norm_w.dtype} {norm_w.device}")
        norm_w = norm_w.contiguous()
    block_d, block_i = max(16, _pow2(d_model)), max(16, _pow2(k_ind))
    p = _common.new_output((progs, d_model), torch.float32, x.device)
    kept, n_rows = _common.counters(count, x.device)
    pdl = _pdl.mode(x)
    LAST_KERNEL = _onepass_kernel[(progs,)](
        x, w_ind, ind if ind is not None else p, w_gate, w_up, w_down_t, thr_t if thr_t is not None else p, p,
        norm_w if norm is not None else p, kept if kept is not None else p, n_rows if n_rows is not None else p,
        float(thr_f), float(norm[1]) if norm is not None else 0.0, d_model,
        d_inter, k_ind, triton.cdiv(d_inter, rows), progs, rows,
        MODE=MODES[mode], GATE=gate, UP=up, ACT=act_code(activation),
        THR_PTR=thr_t is not None, THR_VEC=thr_vec, CHUNK=chunk, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_D=block_d, BLOCK_I=block_i, EVEN_D=block_d == d_model, EVEN_I=block_i == k_ind,
        BIG=d_inter * max(d_model, k_ind) >= 2**31, DENSE=ind is None, PDL=pdl, STAGES=int(cfg.get("STAGES", 1)),
        RB=rb, ISTAGES=int(cfg.get("ISTAGES", 1)), W_EARLY=bool(rb and cfg.get("W_EARLY", False)),
        NORM=norm is not None, COUNT=kept is not None,
        num_warps=cfg["num_warps"], num_stages=1, **_pdl.launch_kwargs(pdl),
    )
    return p


# (the keep rule is ``rule``, not ``mode``: torch.compile's handling of an op that mutates an argument passes a
# ``mode`` of its own, and an argument of that name collides with it)
@torch.library.custom_op("countdown::gated_onepass", mutates_args=("kept", "rows"))
def _onepass_op(x: torch.Tensor, w_ind: Optional[torch.Tensor], ind: Optional[torch.Tensor], w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, rule: str,
                activation: str, gate: bool, up: bool, kept: Optional[torch.Tensor] = None,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    return onepass_partials(x, w_ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, gate, up, ind=ind,
                            count=_common.op_count(kept, rows))


@_onepass_op.register_fake
def _(x, w_ind, ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, gate, up, kept=None, rows=None):
    return x.new_empty((n_programs(x.device, w_gate.shape[0], rule), x.shape[1]), dtype=torch.float32)


def indicator_outside(mode: str) -> bool:
    """Whether the ops compute the indicator in PyTorch before the launch (CONFIGS[mode]["IND"])."""
    return CONFIGS[mode].get("IND", "torch") == "torch"


def threshold_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str,
                  residual=None, count=None) -> torch.Tensor:
    """mono (mode "abs": keep |u| > t) or cats ("abs_act": keep |act(g)| > t) for one token."""
    w_ind = w_up if mode == "abs" else w_gate
    src = dict(ind=ind_linear(x2, w_ind)) if indicator_outside(mode) else dict(w_ind=w_ind)
    return onepass_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation,
                       gate=mode == "abs", up=mode != "abs", residual=residual, count=count, **src)


def onepass_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str, gate: bool, up: bool,
                *, ind=None, w_ind=None, residual=None, count=None) -> torch.Tensor:
    """y [1, d_model] in x's dtype from the indicator ``ind`` [1, d_inter] or its rows ``w_ind`` (read against
    x in the kernel): the op's partials summed and cast outside it (_psum.reduce: PyTorch's sum while
    torch.compile traces it, which fuses it with its neighbours; run eagerly, _psum.py's op). With
    ``residual`` (a folded layer's h, in residual's shape) residual + y, the add in the partials' sum; with
    ``count`` = (kept, rows) the kept rows added to a patched layer's Sparsity-Real counters."""
    kept, rows = _common.op_counters(count, x2.device)
    p = torch.ops.countdown.gated_onepass(x2, w_ind, ind, w_gate, w_up, w_down_t, thr_t, thr_f,
                                          mode, activation, gate, up, kept, rows)
    return _psum.reduce(p, x2, residual)
