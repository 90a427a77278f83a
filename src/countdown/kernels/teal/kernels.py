"""Triton kernels of TEAL's Gated-MLP: two or three launches, no atomics, every weight read a kept row.

Weights come transposed (``[d_model, d_inter]`` for gate and up, unit inner stride, any row stride;
``[d_inter, d_model]`` for down), so a kept input channel is one contiguous row and a GEMV over the
kept channels reads only their rows. For a group of BP tokens (the union of their kept entries is
read once; each token's output uses only its own masks):

1. ``teal_gate_up_kernel``, grid (column block of BN, split of KS input channels). A program loads
   its split's x, compacts the kept channels (union over its tokens: a prefix sum, then a scatter of
   the channel numbers and each token's masked x into this program's own slice of a scratch buffer,
   read back after a CTA barrier), then walks the compacted list in tiles of BM kept rows: one round
   trip loads the tile's rows of W_gate^T and W_up^T ([BM, BN] each, 2 BN contiguous bytes a row).
   Batch 1 accumulates ``w * x`` elementwise in a [BM, BN] fp32 register tile and reduces it over
   rows once at the end (a cross-thread reduction per tile costs more than the tile's loads); a
   group of tokens uses ``tl.dot``. The program writes its fp32 partial of g and u to P1[split]
   (no atomics, no zeroed buffer: deterministic).
2. ``teal_finish_kernel``, grid (block of FB intermediate channels): g and u summed over the
   splits in order, ``s = u * act(g)`` rounded to x's dtype, kept where ``|s| > tau_s``; the kept
   channels of the block are compacted (union over the tokens) into SIDX / SVAL / SCNT. With FUSE
   (the batch-1 default) each down program does this itself for its block, into its own scratch
   slice (read back after a CTA barrier): one launch less, the block's s computed once per column block.
3. ``teal_down_kernel``, grid (column block of BN2 of d_model, block of FB): the block's compacted
   kept rows of W_down^T, in tiles of BM2 rows, times their s; fp32 partial [BP, BN2] into P2[block].

``y = P2.sum(0)`` in x's dtype is left to the caller: under torch.compile that sum and cast fuse
into the residual add that follows (as sparse_mlp/one_token.py's partials do).

COUNT: the caller's Sparsity-Real counters (``jit_helpers.add_count``) get each token's kept share of the weights, 2 / (3
d_model) per kept x entry (added by the first column block's gate/up programs, one per split) and 1 / (3 d_inter)
per kept s entry (the finish programs, or the first column block's fused down programs), and 1 per token.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import act_code, counters, interpreting, new_output, op_count, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode
from ..jit_helpers import act, add_count, gdc_launch_dependents, gdc_wait, round_to


@triton.jit
def _tile_rows(rows, valid, nmask, BIG: tl.constexpr, EVEN_N: tl.constexpr):
    """A tile's row offsets (int64 where the weight is too big for int32 offsets) and its load mask."""
    if BIG:
        rr = rows.to(tl.int64)
    else:
        rr = rows
    if EVEN_N:
        wmask = valid[:, None]
    else:
        wmask = valid[:, None] & nmask[None, :]
    return rr, wmask


@triton.jit
def _acc_tile(acc, xt, w, BP: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc [BP', N] += xt [BP', M] @ w [M, N]: elementwise FMA into a [M, N] tile for one token,
    tl.dot for a group."""
    if BP == 1:
        return acc + w.to(tl.float32) * tl.trans(xt)  # [M, N] * [M, 1]
    if DOT_PREC == "ieee":  # fp32 inputs, or bf16 under the interpreter (its bf16 dot is wrong)
        return acc + tl.dot(xt, w.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(xt.to(w.dtype), w)


@triton.jit
def _list_tile(IDX, VAL, base, m, cnt, b, BPD: tl.constexpr):
    """Entries ``m`` of a compacted list: channel numbers [BM] and per-token values [BPD, BM] (0 past cnt)."""
    valid = m < cnt
    rows = tl.load(IDX + base + m, mask=valid, other=0)
    vals = tl.load(VAL + (base + m)[None, :] * BPD + b[:, None], mask=valid[None, :] & (b < BPD)[:, None],
                   other=0.0)
    return rows, vals


@triton.jit
def teal_gate_up_kernel(
    X, WG, WU, THR, SCRI, SCRX, P1, KEPT, ROWS,
    thr_f, n_tok, d_model, d_inter, stride_x, stride_wg, stride_wu,
    THR_PTR: tl.constexpr, BP: tl.constexpr, BPD: tl.constexpr, KS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_N: tl.constexpr, BIG: tl.constexpr, PDL: tl.constexpr,
    COUNT: tl.constexpr = False,
):
    if PDL:  # x may come from the kernel before
        gdc_wait()
    if PDL:  # the (small) finish kernel may launch now
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    prog = pid_k * tl.num_programs(0) + pid_n
    b = tl.arange(0, BPD)
    bmask = b < n_tok
    r = pid_k * KS + tl.arange(0, KS)
    m2 = bmask[:, None] & (r < d_model)[None, :]
    if THR_PTR:
        thr = tl.load(THR).to(tl.float32)
    else:
        thr = thr_f
    xv = tl.load(X + b[:, None] * stride_x + r[None, :], mask=m2, other=0.0).to(tl.float32)
    keep = (tl.abs(xv) > thr) & m2
    if COUNT:
        if pid_n == 0:  # each token's kept x entries of this split: 2 / (3 d_model) of the weights each
            n_x = tl.sum(tl.sum(keep.to(tl.int32), axis=1), axis=0)
            add_count(KEPT, ROWS, tl.cast(2 * n_x, tl.float64) / tl.cast(3 * d_model, tl.float64), n_tok,
                      pid_k == 0)
    anyk = tl.max(keep.to(tl.int32), axis=0)
    cnt = tl.sum(anyk, axis=0)
    pos = tl.cumsum(anyk, axis=0) - 1
    # compaction through this program's own scratch slice (written and read by this CTA only)
    sbase = prog.to(tl.int64) * KS
    tl.store(SCRI + sbase + pos, r, mask=anyk > 0)
    tl.store(SCRX + (sbase + pos)[None, :] * BPD + b[:, None], tl.where(keep, xv, 0.0),
             mask=(anyk > 0)[None, :] & (b < BPD)[:, None])
    tl.debug_barrier()

    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < d_inter
    if BP == 1:
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BPD, BN], dtype=tl.float32)
        acc_u = tl.zeros([BPD, BN], dtype=tl.float32)
    # the list entries of tile t + 1 are requested with tile t's weights: one round trip a tile
    m = tl.arange(0, BM)
    rows, xt = _list_tile(SCRI, SCRX, sbase, m, cnt, b, BPD)
    for t in range(0, cnt, BM):
        rr, wmask = _tile_rows(rows, m < cnt, nmask, BIG, EVEN_N)
        wg = tl.load(WG + rr[:, None] * stride_wg + n[None, :], mask=wmask, other=0.0)
        wu = tl.load(WU + rr[:, None] * stride_wu + n[None, :], mask=wmask, other=0.0)
        m += BM
        rows_n, xt_n = _list_tile(SCRI, SCRX, sbase, m, cnt, b, BPD)
        acc_g = _acc_tile(acc_g, xt, wg, BP, DOT_PREC)
        acc_u = _acc_tile(acc_u, xt, wu, BP, DOT_PREC)
        rows, xt = rows_n, xt_n
    if BP == 1:
        g = tl.sum(acc_g, axis=0)[None, :]
        u = tl.sum(acc_u, axis=0)[None, :]
    else:
        g = acc_g
        u = acc_u
    off = ((pid_k * n_tok + b[:, None]).to(tl.int64) * 2) * d_inter + n[None, :]
    bn = bmask[:, None] & nmask[None, :]
    tl.store(P1 + off, g, mask=bn)
    tl.store(P1 + off + d_inter, u, mask=bn)


@triton.jit
def _s_compact(P1, THR, X, IDX, VAL, base, blk, thr_f, n_tok, d_inter, n_splits, ACT: tl.constexpr,
               THR_PTR: tl.constexpr, BPD: tl.constexpr, FB: tl.constexpr, NSPL: tl.constexpr):
    """s of block ``blk`` (g and u summed over the splits in order), its kept channels (union over the
    tokens) compacted into IDX / VAL from ``base``; returns their count and the tokens' kept entries."""
    b = tl.arange(0, BPD)
    i = blk * FB + tl.arange(0, FB)
    m2 = (b < n_tok)[:, None] & (i < d_inter)[None, :]
    if BPD == 1:  # every split's partial in one load: one round trip
        k = tl.arange(0, NSPL)
        off = (k.to(tl.int64) * 2 * n_tok)[:, None] * d_inter + i[None, :]
        km = (k < n_splits)[:, None] & (i < d_inter)[None, :]
        g = tl.sum(tl.load(P1 + off, mask=km, other=0.0), axis=0)[None, :]
        u = tl.sum(tl.load(P1 + off + d_inter, mask=km, other=0.0), axis=0)[None, :]
    else:
        g = tl.zeros([BPD, FB], dtype=tl.float32)
        u = tl.zeros([BPD, FB], dtype=tl.float32)
        for k in range(0, n_splits):  # in split order: deterministic
            off = ((k * n_tok + b[:, None]).to(tl.int64) * 2) * d_inter + i[None, :]
            g += tl.load(P1 + off, mask=m2, other=0.0)
            u += tl.load(P1 + off + d_inter, mask=m2, other=0.0)
    if THR_PTR:
        thr = tl.load(THR).to(tl.float32)
    else:
        thr = thr_f
    s = round_to(u * act(g, ACT), X.dtype.element_ty)  # s in the model's dtype, as PyTorch computes it
    keep = (tl.abs(s) > thr) & m2
    anyk = tl.max(keep.to(tl.int32), axis=0)
    pos = tl.cumsum(anyk, axis=0) - 1
    tl.store(IDX + base + pos, i, mask=anyk > 0)
    tl.store(VAL + (base + pos)[None, :] * BPD + b[:, None], tl.where(keep, s, 0.0),
             mask=(anyk > 0)[None, :] & (b < BPD)[:, None])
    return tl.sum(anyk, axis=0), tl.sum(tl.sum(keep.to(tl.int32), axis=1), axis=0)


@triton.jit
def _count_s(KEPT, ROWS, n_s, d_inter):
    """The tokens' kept s entries to the counters: 1 / (3 d_inter) of the weights each."""
    add_count(KEPT, ROWS, tl.cast(n_s, tl.float64) / tl.cast(3 * d_inter, tl.float64), 0, False)


@triton.jit
def teal_finish_kernel(P1, THR, X, SIDX, SVAL, SCNT, KEPT, ROWS, thr_f, n_tok, d_inter, n_splits,
                        ACT: tl.constexpr, THR_PTR: tl.constexpr, BPD: tl.constexpr, FB: tl.constexpr,
                        NSPL: tl.constexpr, PDL: tl.constexpr, COUNT: tl.constexpr = False):
    if PDL:
        gdc_wait()
    blk = tl.program_id(0)
    cnt, n_s = _s_compact(P1, THR, X, SIDX, SVAL, blk.to(tl.int64) * FB, blk, thr_f, n_tok, d_inter, n_splits,
                          ACT, THR_PTR, BPD, FB, NSPL)
    if COUNT:
        _count_s(KEPT, ROWS, n_s, d_inter)
    tl.store(SCNT + blk, cnt)
    if PDL:  # the down kernel may launch (its gdc_wait still waits for this grid to finish)
        gdc_launch_dependents()


@triton.jit
def teal_down_kernel(SIDX, SVAL, SCNT, WD, P2, P1, THR, X, KEPT, ROWS, thr_f, n_tok, d_inter, d_model, n_splits,
                      BP: tl.constexpr, BPD: tl.constexpr, FB: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_N: tl.constexpr, BIG: tl.constexpr,
                      PDL: tl.constexpr, FUSE: tl.constexpr, ACT: tl.constexpr, THR_PTR: tl.constexpr,
                      NSPL: tl.constexpr, COUNT: tl.constexpr = False):
    if PDL:
        gdc_wait()
    pid_n = tl.program_id(0)
    blk = tl.program_id(1)
    b = tl.arange(0, BPD)
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < d_model
    if FUSE:  # the finish step here, into this program's own scratch slice (read back after a barrier)
        base = (blk * tl.num_programs(0) + pid_n).to(tl.int64) * FB
        cnt, n_s = _s_compact(P1, THR, X, SIDX, SVAL, base, blk, thr_f, n_tok, d_inter, n_splits,
                              ACT, THR_PTR, BPD, FB, NSPL)
        if COUNT:
            if pid_n == 0:  # every column block computes the block's s: one of them counts it
                _count_s(KEPT, ROWS, n_s, d_inter)
        tl.debug_barrier()
    else:
        cnt = tl.load(SCNT + blk)
        base = blk.to(tl.int64) * FB
    if BP == 1:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    else:
        acc = tl.zeros([BPD, BN], dtype=tl.float32)
    m = tl.arange(0, BM)
    rows, st = _list_tile(SIDX, SVAL, base, m, cnt, b, BPD)
    for t in range(0, cnt, BM):
        rr, wmask = _tile_rows(rows, m < cnt, nmask, BIG, EVEN_N)
        w = tl.load(WD + rr[:, None] * d_model + n[None, :], mask=wmask, other=0.0)
        m += BM
        rows_n, st_n = _list_tile(SIDX, SVAL, base, m, cnt, b, BPD)
        acc = _acc_tile(acc, st, w, BP, DOT_PREC)
        rows, st = rows_n, st_n
    if BP == 1:
        part = tl.sum(acc, axis=0)[None, :]
    else:
        part = acc
    off = (blk * n_tok + b[:, None]).to(tl.int64) * d_model + n[None, :]
    tl.store(P2 + off, part, mask=(b < n_tok)[:, None] & nmask[None, :])


def n_parts(d_inter: int, device=None) -> int:
    """Rows of the op's partial sums P2 (blocks of FB intermediate channels, config.LAUNCH["teal"])."""
    return triton.cdiv(d_inter, launch_config("teal", device, 1)["FB"])


def teal_partials(x, w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f, thr_s_t, thr_s_f, activation: str,
                  config: dict | None = None, count=None) -> torch.Tensor:
    """fp32 partial sums P2 ``[n_parts(d_inter), n_tok, d_model]`` of y for x ``[n_tok, d_model]``;
    ``y = P2.sum(0)``. Tokens beyond MAX_GROUP (config.LAUNCH["teal"]) are run in groups of MAX_GROUP. The tokens'
    kept shares of the weights are added to ``count`` = (kept, rows) if given (see the module docstring). Launch
    configuration by token bucket (1; 2-16), config.LAUNCH["teal"]: gate/up (KS input channels per split, BN
    columns, BM kept rows a tile) and down (FB intermediate channels a block, BN2 columns, BM2 rows a tile; FUSE:
    the finish step inside each down program instead of its own launch). (Spy hook: ``on_launch("teal", x)``, once a
    group.)"""
    n_tok = x.shape[0]
    group = launch_config("teal", x.device, 16)["MAX_GROUP"]
    if n_tok > group:
        return torch.cat([teal_partials(x[i:i + group], w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f,
                                        thr_s_t, thr_s_f, activation, config, count)
                          for i in range(0, n_tok, group)], dim=1)
    return _group(x.contiguous(), w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f, thr_s_t, thr_s_f,
                  activation, config, count)


def _group(x, w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f, thr_s_t, thr_s_f, activation, config, count):
    n_tok, d_model = x.shape
    d_inter = w_gate_t.shape[1]
    dev = x.device
    cfg = launch_config("teal", dev, 1 if n_tok == 1 else 16, config)
    bp = 1 if n_tok == 1 else 16  # tl.dot needs 16 rows
    bpd = 1 if n_tok == 1 else max(16, pow2(n_tok))
    bm = cfg["BM"] if bp == 1 else max(16, cfg["BM"])
    bm2 = cfg["BM2"] if bp == 1 else max(16, cfg["BM2"])
    bn = min(cfg["BN"], max(16, pow2(d_inter)))
    bn2 = min(cfg["BN2"], max(16, pow2(d_model)))
    ks = min(cfg["KS"], max(16, pow2(d_model)))
    fb = min(cfg["FB"], max(16, pow2(d_inter)))  # (a ``config`` FB: tuning runs only, the op's fake keeps the table's)
    splits = triton.cdiv(d_model, ks)
    nb = triton.cdiv(d_inter, fb)
    cpu_bf16 = dev.type == "cpu" and x.dtype != torch.float32 and interpreting()
    prec = "ieee" if (x.dtype == torch.float32 or cpu_bf16) else "default"
    pdl = pdl_mode(x)  # each launch overlaps the previous kernel's tail
    grid1 = (triton.cdiv(d_inter, bn), splits)
    scr_i = torch.empty((grid1[0] * splits * ks,), dtype=torch.int32, device=dev)
    scr_x = torch.empty((grid1[0] * splits * ks * bpd,), dtype=torch.float32, device=dev)
    p1 = new_output((splits, n_tok, 2, d_inter), torch.float32, dev)
    kept, rows = counters(count, dev)
    kept, rows = (kept, rows) if kept is not None else (p1, p1)
    launching("teal", x)
    teal_gate_up_kernel[grid1](
        x, w_gate_t, w_up_t, thr_x_t if thr_x_t is not None else p1, scr_i, scr_x, p1, kept, rows,
        float(thr_x_f), n_tok, d_model, d_inter, x.stride(0), w_gate_t.stride(0), w_up_t.stride(0),
        THR_PTR=thr_x_t is not None, BP=bp, BPD=bpd, KS=ks, BM=bm, BN=bn, DOT_PREC=prec,
        EVEN_N=d_inter % bn == 0, BIG=d_model * max(w_gate_t.stride(0), w_up_t.stride(0)) >= 2**31,
        PDL=pdl, COUNT=count is not None, num_warps=cfg["warps"], num_stages=cfg["stages"],
        **launch_kwargs(pdl),
    )
    fuse = bool(cfg.get("FUSE", False))
    grid3 = (triton.cdiv(d_model, bn2), nb)
    n_lists = grid3[0] * nb if fuse else nb  # fused: a scratch slice per down program
    sidx = torch.empty((n_lists * fb,), dtype=torch.int32, device=dev)
    sval = torch.empty((n_lists * fb * bpd,), dtype=torch.float32, device=dev)
    scnt = torch.empty((nb,), dtype=torch.int32, device=dev)
    thr_s = thr_s_t if thr_s_t is not None else p1
    common = dict(ACT=act_code(activation), THR_PTR=thr_s_t is not None, BPD=bpd, FB=fb, NSPL=pow2(splits),
                  PDL=pdl, COUNT=count is not None)
    if not fuse:
        teal_finish_kernel[(nb,)](
            p1, thr_s, x, sidx, sval, scnt, kept, rows, float(thr_s_f), n_tok, d_inter, splits,
            num_warps=4, **common, **launch_kwargs(pdl))
    p2 = new_output((nb, n_tok, d_model), torch.float32, dev)
    teal_down_kernel[grid3](
        sidx, sval, scnt, w_down_t, p2, p1, thr_s, x, kept, rows, float(thr_s_f), n_tok, d_inter, d_model, splits,
        BP=bp, BM=bm2, BN=bn2, DOT_PREC=prec, EVEN_N=d_model % bn2 == 0, BIG=d_inter * d_model >= 2**31,
        FUSE=fuse, num_warps=cfg["warps2"], num_stages=cfg["stages2"], **common, **launch_kwargs(pdl),
    )
    return p2


def teal_mlp(x, w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f, thr_s_t, thr_s_f, activation: str,
             config: dict | None = None) -> torch.Tensor:
    """y ``[n_tok, d_model]`` in x's dtype (the partials summed here: for direct calls and tests)."""
    p = teal_partials(x, w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f, thr_s_t, thr_s_f, activation, config)
    return p.sum(0).to(x.dtype)


@torch.library.custom_op("countdown::teal_partials", mutates_args=("kept", "rows"))
def _teal_op(x: torch.Tensor, w_gate_t: torch.Tensor, w_up_t: torch.Tensor, w_down_t: torch.Tensor,
             thr_x_t: Optional[torch.Tensor], thr_x_f: float, thr_s_t: Optional[torch.Tensor], thr_s_f: float,
             activation: str, kept: Optional[torch.Tensor] = None,
             rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 partial sums ``[n_parts, n_tok, d_model]`` of TEAL's y (:func:`teal_partials`)."""
    return teal_partials(x, w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f, thr_s_t, thr_s_f, activation,
                         count=op_count(kept, rows))


@_teal_op.register_fake
def _(x, w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f, thr_s_t, thr_s_f, activation, kept=None, rows=None):
    return x.new_empty((n_parts(w_gate_t.shape[1], x.device), x.shape[0], x.shape[1]), dtype=torch.float32)
