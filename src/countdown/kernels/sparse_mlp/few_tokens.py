"""Triton kernel: a whole sparse Gated-MLP for a few tokens (2-8, a batched decode step) in one launch.

For tokens x [T, d_model] and their indicators ind [T, d_inter] (u for mono, g for cats, the
predictor's or the shadows' scores for dual), each program owns CHUNK consecutive rows r and computes

    keep[t, i] = |ind| > thr, |act(ind)| > thr or ind > thr          (jit_helpers.KEEP_RULES)
    union[i]   = any_t keep[t, i]                                    (rows the batch reads)
    g, u       = x W_gate[r]^T, x W_up[r]^T                          (the one that is not the
                                                                      indicator; union rows only)
    s[t, i]    = u[t, i] * act(g[t, i]) if keep[t, i] else 0          (each token its own rows,
                                                                      rounded to x's dtype)
    P[c, t, :] = s[t, r] @ w_down_t[r, :]                            (fp32 partial of chunk c)

and y = P.sum(0) in x's dtype is left to the caller (torch.compile fuses it into the residual add).

Unlike the chain (chain.py, then down.py with fp32 atomics and a cast: three launches and s written and
read back), one launch does it all. A program compacts its chunk's union rows (prefix
sum, one-hot select) into tiles of TILE kept rows; per tile, phase A runs [16 tokens, BK] @ [BK, TILE]
tensor-core products over d_model and phase B [16, TILE] @ [TILE, BN] over the columns, both K / N
loops software-pipelined by Triton (STAGES deep, cp.async into shared memory). A second tile of the
same program adds to the partial the first one stored (its own row of P: no atomics), so the result
does not depend on timing.

Why tiles of kept rows: every tile walks d_model in dependent pipelined steps whose latency, more than
their bytes, sets the time, so a tile holds kept rows only (compacted), never the whole chunk masked.
With COUNT each program adds its tokens' kept rows to the caller's Sparsity-Real counters (jit_helpers.add_count).
Launch configuration: config.LAUNCH["few_tokens"] (the fastest of benchmarks/few.py's sweep).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import act_code, counters, interpreting, new_output, op_count, op_counters, pow2
from ..config import launch_config, launching, persistent_programs
from ..jit_helpers import KEEP_RULES, act, add_count, keep, round_to
from ..route import FEW_TOKENS
from .partial_sums import reduce


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32: tensor cores on the inputs' dtype, or exact fp32 products (IEEE)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile(X, IND, WG, WU, WD, THR, P, thr, cnt, pos, r, t, tmask, pbase, d_model, stride_x, stride_ind,
          MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr, THR_VEC: tl.constexpr,
          TP: tl.constexpr, TILE: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, EVEN_D: tl.constexpr,
          BIG: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr):
    """Every kept row of the program (cnt <= TILE of them, compacted to the tile's first slots): phase A,
    s, phase B into the program's partial."""
    m = tl.arange(0, TILE)
    sel = pos[None, :] == m[:, None]                             # [TILE, CHUNK] one-hot: slot -> row
    valid = m < cnt
    tr = tl.sum(tl.where(sel, r[None, :], 0), axis=1)           # the tile's rows (0 where not valid)
    if BIG:
        tbase = tr.to(tl.int64) * d_model
    else:
        tbase = tr * d_model
    # phase A: the GEMV(s) that are not the indicator, [TP, BK] @ [BK, TILE] per K block
    acc_g = tl.zeros([TP, TILE], dtype=tl.float32)
    acc_u = tl.zeros([TP, TILE], dtype=tl.float32)
    for k0 in tl.range(0, d_model, BK, num_stages=STAGES):
        kk = k0 + tl.arange(0, BK)
        if EVEN_D:
            xm = tmask[:, None]
            wm = valid[:, None]
        else:
            xm = tmask[:, None] & (kk < d_model)[None, :]
            wm = valid[:, None] & (kk < d_model)[None, :]
        xk = tl.load(X + t[:, None] * stride_x + kk[None, :], mask=xm, other=0.0)
        if GATE:
            wg = tl.load(WG + tbase[:, None] + kk[None, :], mask=wm, other=0.0)
            acc_g += _dot(xk, tl.trans(wg), IEEE)
        if UP:
            wu = tl.load(WU + tbase[:, None] + kk[None, :], mask=wm, other=0.0)
            acc_u += _dot(xk, tl.trans(wu), IEEE)
    # the tile's indicators and each token's keep, read again at the tile's rows (L2: just read)
    tm = tmask[:, None] & valid[None, :]
    ti = tl.load(IND + t[:, None] * stride_ind + tr[None, :], mask=tm, other=0.0).to(tl.float32)
    if THR_VEC:
        tthr = tl.load(THR + tr, mask=valid, other=0.0).to(tl.float32)[None, :]
    else:
        tthr = thr
    tk = keep(ti, tthr, MODE, ACT) & tm                         # [TP, TILE]
    if GATE:
        g = acc_g
    else:  # the indicator is g itself (cats)
        g = ti
    if UP:
        u = acc_u
    else:  # the indicator is u itself (mono)
        u = ti
    sv = tl.where(tk, u * act(g, ACT), 0.0)
    sv = round_to(sv, X.dtype.element_ty)  # s in the model's dtype, as the chained kernels write it
    if not IEEE:
        sv = sv.to(X.dtype.element_ty)
    # phase B: the down projection of the kept rows, [TP, TILE] @ [TILE, BN] per column block
    for n0 in tl.range(0, d_model, BN, num_stages=STAGES):
        nn = n0 + tl.arange(0, BN)
        if EVEN_D:
            dm = valid[:, None]
            pm = tmask[:, None]
        else:
            dm = valid[:, None] & (nn < d_model)[None, :]
            pm = tmask[:, None] & (nn < d_model)[None, :]
        wd = tl.load(WD + tbase[:, None] + nn[None, :], mask=dm, other=0.0)
        tl.store(P + pbase[:, None] + nn[None, :], _dot(sv, wd, IEEE), mask=pm)


@triton.jit
def few_tokens_kernel(
    X, IND, WG, WU, WD, THR, P, KEPT, ROWS,
    thr_f, n_tok, d_model, d_inter, rows, stride_x, stride_ind,
    MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr,
    THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, TP: tl.constexpr, CHUNK: tl.constexpr,
    TILE: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
    WIDE_BK: tl.constexpr, WIDE_BN: tl.constexpr, WIDE_STAGES: tl.constexpr,
    EVEN_D: tl.constexpr, BIG: tl.constexpr, IEEE: tl.constexpr, COUNT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    t = tl.arange(0, TP)
    tmask = t < n_tok
    cr = tl.arange(0, CHUNK)
    r = pid * rows + cr  # this program's rows (rows <= CHUNK: ROWS "auto" splits d_inter evenly)
    rmask = (cr < rows) & (r < d_inter)
    m2 = tmask[:, None] & rmask[None, :]
    ind = tl.load(IND + t[:, None] * stride_ind + r[None, :], mask=m2, other=0.0).to(tl.float32)
    if THR_VEC:
        thr = tl.load(THR + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    elif THR_PTR:
        thr = tl.load(THR).to(tl.float32)
    else:
        thr = thr_f
    kp = keep(ind, thr, MODE, ACT) & m2                         # [TP, CHUNK]: each token's own rows
    if COUNT:
        add_count(KEPT, ROWS, tl.sum(tl.sum(kp.to(tl.int32), axis=1), axis=0), n_tok * d_inter, pid == 0)
    union = tl.max(kp.to(tl.int32), axis=0)                   # [CHUNK]: the rows anybody reads
    cnt = tl.sum(union, axis=0)
    pos = tl.where(union > 0, tl.cumsum(union, axis=0) - 1, -1)  # rank of a kept row among them
    if BIG:
        pbase = (pid.to(tl.int64) * n_tok + t) * d_model
    else:
        pbase = (pid * n_tok + t) * d_model
    if THR_VEC:  # _tile reads the per-row thresholds again at its rows
        thr = thr_f
    if cnt <= TILE:  # the kept rows fit one small tile: every step moves kept rows only
        _tile(X, IND, WG, WU, WD, THR, P, thr, cnt, pos, r, t, tmask, pbase, d_model, stride_x, stride_ind,
              MODE, GATE, UP, ACT, THR_VEC, TP, TILE, BK, BN, EVEN_D, BIG, IEEE, STAGES)
    else:  # one tile of the whole chunk: never a second pass over d_model (each pass costs its steps)
        _tile(X, IND, WG, WU, WD, THR, P, thr, cnt, pos, r, t, tmask, pbase, d_model, stride_x, stride_ind,
              MODE, GATE, UP, ACT, THR_VEC, TP, CHUNK, WIDE_BK, WIDE_BN, EVEN_D, BIG, IEEE, WIDE_STAGES)


def _split(device, d_inter: int, cfg: dict) -> tuple[int, int, int]:
    """(rows per program, CHUNK = the power of two that holds them, programs)."""
    if cfg.get("ROWS", "chunk") == "auto":
        progs = persistent_programs(device, int(cfg.get("PER_SM", 1)), cfg.get("PROGRAMS", 0))
        rows = triton.cdiv(d_inter, max(1, min(progs, d_inter)))
        chunk = max(16, pow2(rows))
    else:
        rows = chunk = max(16, pow2(cfg["CHUNK"]))
    return rows, chunk, triton.cdiv(d_inter, rows)


def n_chunks(device, d_inter: int, config: dict | None = None) -> int:
    """How many partial sums per token the kernel writes (the op's first output dimension)."""
    return _split(device, d_inter, launch_config("few_tokens", device, extra=config))[2]


def few_tokens_partials(x, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str,
                 gate: bool, up: bool, config: dict | None = None, count=None) -> torch.Tensor:
    """The fp32 partial sums P [n_chunks, n_tok, d_model] for x [n_tok, d_model] (2-8 tokens) and its
    indicator ind [n_tok, d_inter] (``mode``: the keep rule); y = P.sum(0). The kept rows are added to ``count`` =
    (kept, rows) if given. (Spy hook: ``on_launch("few_tokens", x, mode)``.)"""
    cfg = launch_config("few_tokens", x.device, extra=config)
    n_tok, d_model = x.shape
    d_inter = w_gate.shape[0]
    if not 1 <= n_tok <= FEW_TOKENS:
        raise ValueError(f"the few-token kernel takes 1 to {FEW_TOKENS} tokens, got {n_tok}")
    if ind.shape != (n_tok, d_inter):
        raise ValueError(f"indicator must be [{n_tok}, {d_inter}], got {tuple(ind.shape)}")
    thr_vec = thr_t is not None and thr_t.dim() == 1
    if thr_vec and thr_t.numel() != d_inter:
        raise ValueError(f"a per-row threshold needs d_inter={d_inter} values, got {thr_t.numel()}")
    x, ind = x.contiguous(), ind.contiguous()
    w_gate, w_up, w_down_t = w_gate.contiguous(), w_up.contiguous(), w_down_t.contiguous()
    rows, chunk, grid = _split(x.device, d_inter, cfg)
    blocks = {b: max(16, min(pow2(cfg[b]), pow2(d_model))) for b in ("BK", "BN", "WIDE_BK", "WIDE_BN")}
    p = new_output((grid, n_tok, d_model), torch.float32, x.device)
    kept, n_rows = counters(count, x.device)
    # fp32 models, and bf16 under the interpreter (its bf16 dot is wrong): fp32 products, exact
    ieee = x.dtype == torch.float32 or (not x.is_cuda and interpreting())
    launching("few_tokens", x, mode)
    few_tokens_kernel[(grid,)](
        x, ind, w_gate, w_up, w_down_t, thr_t if thr_t is not None else p, p, kept if kept is not None else p,
        n_rows if n_rows is not None else p, float(thr_f), n_tok, d_model, d_inter, rows, x.stride(0), ind.stride(0),
        MODE=KEEP_RULES[mode], GATE=gate, UP=up, ACT=act_code(activation),
        THR_PTR=thr_t is not None, THR_VEC=thr_vec, TP=max(16, pow2(n_tok)), CHUNK=chunk,
        TILE=max(16, min(pow2(cfg["TILE"]), chunk)), **blocks, WIDE_STAGES=int(cfg["WIDE_STAGES"]),
        EVEN_D=all(d_model % b == 0 for b in blocks.values()),
        BIG=(grid * rows + chunk) * max(d_model, n_tok) >= 2**31, IEEE=ieee,
        STAGES=int(cfg["STAGES"]), COUNT=kept is not None, num_warps=int(cfg["num_warps"]),
    )
    return p


@torch.library.custom_op("countdown::sparse_mlp_few_tokens", mutates_args=("kept", "rows"))
def _few_op(x: torch.Tensor, ind: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down_t: torch.Tensor, thr_t: Optional[torch.Tensor], thr_f: float, rule: str, activation: str,
            gate: bool, up: bool, kept: Optional[torch.Tensor] = None,
            rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    # (``rule``, the keep rule, not ``mode``: see chain.py's op)
    return few_tokens_partials(x, ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, gate, up,
                               count=op_count(kept, rows))


@_few_op.register_fake
def _(x, ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, gate, up, kept=None, rows=None):
    return x.new_empty((n_chunks(x.device, w_gate.shape[0]), x.shape[0], x.shape[1]), dtype=torch.float32)


def few_tokens_mlp(x2, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode: str, activation: str,
                   gate: bool, up: bool, count=None) -> torch.Tensor:
    """y [n_tok, d_model] in x's dtype: the op's partials summed and cast outside it (partial_sums.reduce:
    PyTorch's sum under torch.compile, which fuses it with the residual add; run eagerly, its op).
    The kept rows are added to ``count`` = (kept, rows) if given."""
    kept, rows = op_counters(count, x2.device)
    p = torch.ops.countdown.sparse_mlp_few_tokens(x2, ind, w_gate, w_up, w_down_t, thr_t, thr_f, mode, activation,
                                                  gate, up, kept, rows)
    return reduce(p, x2)
