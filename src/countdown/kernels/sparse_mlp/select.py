"""Triton kernel: a Gated-MLP that scores its own rows, keeps those over a cut, and computes only them.

Two scoring kinds (KIND), both for tokens x [T, d_model], T <= 8:

    shadow (0)  u~ = x Q_up^T, g~ = x Q_gate^T from 4- or 8-bit shadows (shadow/format.py), fp32;
                keep[b, i] = |u~ * act(g~)| > cut
    hybrid (1)  u = x W_up^T given (computed before), g^ = round(latent . Bt[i]) + bias[i];
                keep[b, i] = |u| * |act(g^)| > cut

then, for the union of the batch's kept rows (a token's unkept rows contribute 0 to it):

    s[b, i] = u[b, i] * act(x W_gate[i]^T)    u exact (shadow: from W_up rows; hybrid: the given u)
    y[b]    = sum_i s[b, i] * w_down_t[i]

A program owns blocks of ROWS consecutive rows (blocks p, p + PROGS, ...). Per block, phase 1 streams
the shadow words of its rows in tiles [ROWS, GPT groups, WPG words of a group], gate and up of a row
side by side in memory (NEXT: with one tile a block, the next block's requested before this block's work);
phase 2 compacts the block's kept rows in registers (prefix sum + one-hot select, as chain.py) and
loads BLOCK_M kept rows of every full-precision matrix at once. Phase 1's dequantization without conversions
(exact fp32 products): shadow/dequant.py.

FUSE_DOWN (one token): the down projection is added into a per-program fp32 accumulator and each
program writes its partial sum P[p] (y = P.sum(0), left to the caller so torch.compile fuses it into
the residual add). Otherwise (2-8 tokens) the kernel writes s [T, d_inter] (0 where not kept) and the
masked down projection of down.py runs after. SCORES writes (u~, g~) and stops (shadow only). COUNT: each
program adds its tokens' kept rows to the caller's Sparsity-Real counters (jit_helpers.add_count).

The ops: ``countdown::select_one_token`` (fp32 partials of one token), ``countdown::select_few_tokens`` (s, then
down.py) and ``countdown::shadow_scores`` ((u~, g~) alone).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import act_code, counters, interpreting, new_output, op_count, pow2
from ..config import launch_config, launching, persistent_programs
from ..jit_helpers import act, add_count, load_vec, round_to, store_partial
from ..route import FEW_TOKENS
from ..shadow.dequant import bases, fp32_scores, load_tile, tile_scores, x_scaled


@triton.jit
def _hybrid_score(U, LAT, BTM, BIAS, rows, rmask, m2, tok0, n_tok, r_lat, stride_u, stride_lat,
                  ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_R: tl.constexpr, BIG: tl.constexpr):
    """|u| * |act(g^)| [BT, ROWS], g^ = latent . Bt[row] rounded to latent's dtype, plus the bias."""
    bi = tl.arange(0, BT)
    kr = tl.arange(0, BLOCK_R)
    if BIG:
        boff = rows.to(tl.int64)[:, None] * r_lat + kr[None, :]
    else:
        boff = rows[:, None] * r_lat + kr[None, :]
    btile = tl.load(BTM + boff, mask=rmask[:, None] & (kr < r_lat)[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + rows, mask=rmask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([ROWS], dtype=tl.float32)
    ghat = tl.zeros([BT, ROWS], dtype=tl.float32)
    for b in tl.static_range(BT):
        lat = tl.load(LAT + (tok0 + b) * stride_lat + kr, mask=(kr < r_lat) & (kr * 0 + tok0 + b < n_tok),
                      other=0.0).to(tl.float32)
        gb = round_to(tl.sum(btile * lat[None, :], axis=1), LAT.dtype.element_ty) + bias
        ghat = tl.where(bi[:, None] == b, gb[None, :], ghat)
    ublk = tl.load(U + (tok0 + bi)[:, None] * stride_u + rows[None, :], mask=m2, other=0.0)
    return tl.abs(ublk.to(tl.float32)) * tl.abs(act(ghat, ACT))


@triton.jit
def _kept_rows(X, U, WG, WU, WD, OUT, yacc, xv, keep, rows, kd, dmask, tok0, n_tok, d_model, d_inter,
               stride_x, stride_u, KIND: tl.constexpr, ACT: tl.constexpr, BT: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, BIG: tl.constexpr,
               FUSE_DOWN: tl.constexpr, OUT_F32: tl.constexpr):
    """Phase 2 for one block: the exact GEMVs of the kept rows (the batch's union), BLOCK_M rows at a
    time with every load issued before any arithmetic; returns yacc plus their down projection
    (FUSE_DOWN) or stores s (0 for the block's rows no token keeps)."""
    bi = tl.arange(0, BT)
    bmask = tok0 + bi < n_tok
    anyk = tl.max(keep.to(tl.int32), axis=0)                   # the batch's union, [ROWS]
    cnt = tl.sum(anyk, axis=0)
    pos = tl.where(anyk > 0, tl.cumsum(anyk, axis=0) - 1, -1)
    if not FUSE_DOWN:
        zero = tl.zeros([BT, ROWS], dtype=OUT.dtype.element_ty)
        tl.store(OUT + (tok0 + bi)[:, None] * d_inter + rows[None, :], zero,
                 mask=bmask[:, None] & (rows < d_inter)[None, :] & (anyk == 0)[None, :])
    for t in range(0, cnt, BLOCK_M):
        m = t + tl.arange(0, BLOCK_M)
        valid = m < cnt
        sel = pos[None, :] == m[:, None]                       # [BLOCK_M, ROWS] one-hot
        kr_rows = tl.sum(tl.where(sel, rows[None, :], 0), axis=1)
        if BIG:
            roff = kr_rows.to(tl.int64)[:, None] * d_model + kd[None, :]
        else:
            roff = kr_rows[:, None] * d_model + kd[None, :]
        if EVEN_D:
            wmask = valid[:, None]
        else:
            wmask = valid[:, None] & dmask[None, :]
        wg = tl.load(WG + roff, mask=wmask, other=0.0)
        if KIND == 0:
            wu = tl.load(WU + roff, mask=wmask, other=0.0)
        if FUSE_DOWN:
            wd = tl.load(WD + roff, mask=wmask, other=0.0)
        ktile = tl.sum(tl.where(sel[None, :, :], keep[:, None, :].to(tl.int32), 0), axis=2)  # [BT, BLOCK_M]
        for b in tl.static_range(BT):
            if FUSE_DOWN:
                xb = xv
            else:
                xb = tl.load(X + (tok0 + b) * stride_x + kd, mask=dmask & (kd * 0 + tok0 + b < n_tok),
                             other=0.0).to(tl.float32)
            g = tl.sum(wg.to(tl.float32) * xb[None, :], axis=1)
            if KIND == 0:
                u = tl.sum(wu.to(tl.float32) * xb[None, :], axis=1)
            else:
                u = tl.load(U + (tok0 + b) * stride_u + kr_rows, mask=valid & (m * 0 + tok0 + b < n_tok),
                            other=0.0).to(tl.float32)
            kb = tl.sum(tl.where(bi[:, None] == b, ktile, 0), axis=0) > 0
            s = round_to(tl.where(valid & kb, u * act(g, ACT), 0.0), X.dtype.element_ty)
            if FUSE_DOWN:
                yacc += tl.sum(wd.to(tl.float32) * s[:, None], axis=0)
            elif OUT_F32:
                tl.store(OUT + (tok0 + b) * d_inter + kr_rows, s, mask=valid & (m * 0 + tok0 + b < n_tok))
            else:
                tl.store(OUT + (tok0 + b) * d_inter + kr_rows, s.to(OUT.dtype.element_ty),
                         mask=valid & (m * 0 + tok0 + b < n_tok))
    return yacc


@triton.jit
def select_kernel(
    X, XS, Q, SC, U, LAT, BTM, BIAS, WG, WU, WD, CUT, OUT, KEPT, ROWS_N,
    cut_f, n_tok, d_model, d_inter, n_words, n_groups, r_lat, n_blocks, n_progs,
    stride_x, stride_u, stride_lat,
    KIND: tl.constexpr, BITS: tl.constexpr, ACT: tl.constexpr, CUT_PTR: tl.constexpr, HAS_BIAS: tl.constexpr,
    BT: tl.constexpr, ROWS: tl.constexpr, GPT: tl.constexpr, WPG: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_D: tl.constexpr, BIG: tl.constexpr,
    NEXT: tl.constexpr, FUSE_DOWN: tl.constexpr, SCORES: tl.constexpr,
    OUT_F32: tl.constexpr, COUNT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    tok0 = tl.program_id(1) * BT
    bi = tl.arange(0, BT)
    bmask = tok0 + bi < n_tok
    kd = tl.arange(0, BLOCK_D)
    dmask = kd < d_model
    if CUT_PTR:
        cut = tl.load(CUT).to(tl.float32)
    else:
        cut = cut_f
    if FUSE_DOWN:  # one token: x stays in registers, and so does its output accumulator
        xv = load_vec(X, kd, d_model, EVEN_D)
        yacc = tl.zeros([BLOCK_D], dtype=tl.float32)
    cr = tl.arange(0, ROWS)
    n_kept = tl.zeros([], dtype=tl.int32)  # the entries this program keeps (COUNT)
    if NEXT:  # one tile holds whole shadow rows: the first block's, requested before anything else
        qb, sb = bases(pid * ROWS + cr, n_words, n_groups, BIG)
        twg, twu, tsg, tsu = load_tile(Q, SC, qb, sb, 0, pid * ROWS + cr < d_inter, n_words, n_groups, GPT, WPG)

    for blk in range(pid, n_blocks, n_progs):
        rows = blk * ROWS + cr
        rmask = rows < d_inter
        m2 = bmask[:, None] & rmask[None, :]
        # ---- phase 1: the score of every row of the block
        if KIND == 0:
            if NEXT:  # the whole rows of this block arrived during the last one; request the next block's
                wg_c, wu_c, sg_c, su_c = twg, twu, tsg, tsu
                rows_n = (blk + n_progs) * ROWS + cr
                qb, sb = bases(rows_n, n_words, n_groups, BIG)
                twg, twu, tsg, tsu = load_tile(Q, SC, qb, sb, 0, rows_n < d_inter, n_words, n_groups, GPT, WPG)
                u_s, g_s = tile_scores(wg_c, wu_c, sg_c, su_c, XS, 0, tok0, n_tok, n_words, n_groups,
                                       BITS, BT, ROWS, GPT, WPG)
            else:
                u_s, g_s = fp32_scores(XS, Q, SC, rows, rmask, tok0, n_tok, n_words, n_groups,
                                       BITS, BT, ROWS, GPT, WPG, BIG)
        if SCORES:
            off = (tok0 + bi)[:, None] * d_inter + rows[None, :]
            tl.store(OUT + off, u_s, mask=m2)
            tl.store(OUT + n_tok * d_inter + off, g_s, mask=m2)
        else:
            if KIND == 0:
                score = tl.abs(u_s * act(g_s, ACT))
            else:
                score = _hybrid_score(U, LAT, BTM, BIAS, rows, rmask, m2, tok0, n_tok, r_lat, stride_u,
                                      stride_lat, ACT, HAS_BIAS, BT, ROWS, BLOCK_R, BIG)
            keep = (score > cut) & m2                                  # [BT, ROWS]
            n_kept += tl.sum(tl.sum(keep.to(tl.int32), axis=1), axis=0)
            if FUSE_DOWN:
                yacc = _kept_rows(X, U, WG, WU, WD, OUT, yacc, xv, keep, rows, kd, dmask, tok0, n_tok,
                                  d_model, d_inter, stride_x, stride_u, KIND, ACT, BT, ROWS, BLOCK_M,
                                  EVEN_D, BIG, FUSE_DOWN, OUT_F32)
            else:
                _kept_rows(X, U, WG, WU, WD, OUT, kd, kd, keep, rows, kd, dmask, tok0, n_tok,
                           d_model, d_inter, stride_x, stride_u, KIND, ACT, BT, ROWS, BLOCK_M,
                           EVEN_D, BIG, FUSE_DOWN, OUT_F32)

    if FUSE_DOWN:
        store_partial(OUT, pid, yacc, kd, d_model, BIG, EVEN_D)
    if COUNT:
        add_count(KEPT, ROWS_N, n_kept, n_tok * d_inter, (pid == 0) & (tl.program_id(1) == 0))


def config(kind: str, n_tok: int, device=None, extra: dict | None = None) -> dict:
    """The launch configuration (config.LAUNCH["select"], by kind and one token or several: ROWS rows a block,
    TILE_W shadow words a row and tile, PER_SM persistent programs per SM, 0 for one program a block; NEXT: with
    TILE_W covering whole shadow rows, the next block's rows requested before this block's work)."""
    return launch_config("select", device, (kind, 1 if n_tok == 1 and kind != "scores" else 8), extra)


def n_programs(device, d_inter: int, cfg: dict) -> int:
    n_blocks = -(-d_inter // cfg["ROWS"])
    if not cfg["PER_SM"]:
        return n_blocks
    return max(1, min(n_blocks, persistent_programs(device, cfg["PER_SM"], cfg.get("PROGRAMS", 0))))


def shadow_layout(d_model: int, q: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int]:
    """(bits, group, words per group) of a prepared shadow q int32 [N, 2, W], scale fp16 [N, 2, G]."""
    n_words, n_groups = q.shape[2], scale.shape[2]
    bits = 32 * n_words // d_model
    group = d_model // n_groups
    return bits, group, group * bits // 32


def launch(x, kind: str, out: str, cut_t, cut_f: float, activation: str, *, q=None, scale=None, u=None,
           latent=None, bt=None, bias=None, w_gate=None, w_up=None, w_down_t=None,
           extra: dict | None = None, count=None) -> torch.Tensor:
    """One launch. ``out``: "partials" (one token: P [programs, d_model] fp32, y = P.sum(0)),
    "s" (s [T, d_inter], 0 where no token keeps) or "scores" ([2, T, d_inter] fp32: u~, g~). The kept
    entries are added to ``count`` = (kept, rows) if given. (Spy hook: ``on_launch("select", x, kind, out)``.)"""
    n_tok, d_model = x.shape
    cfg = config("scores" if out == "scores" else kind, n_tok, x.device, extra)
    x = x.contiguous()
    dummy = x
    if kind == "shadow":
        d_inter = q.shape[0]
        bits, group, wpg = shadow_layout(d_model, q, scale)
        n_words, n_groups = q.shape[2], scale.shape[2]
        gpt = pow2(max(1, cfg["TILE_W"] // wpg))
        gpt = min(gpt, pow2(n_groups))
        r_lat, block_r = 0, 16
        q, scale = q.contiguous(), scale.contiguous()
        xs = x_scaled(x, bits)
    else:
        d_inter = bt.shape[0]
        bits, wpg, gpt, n_words, n_groups = 4, 1, 1, 0, 0
        r_lat = bt.shape[1]
        block_r = max(16, pow2(r_lat))
        u, latent, bt = u.contiguous(), latent.contiguous(), bt.contiguous()
        xs = x
        if bias is not None:
            bias = bias.contiguous()
    bt_tok = pow2(min(n_tok, FEW_TOKENS))  # tokens per program (grid axis 1 splits more, for the scores only)
    if out == "partials" and n_tok != 1:
        raise ValueError(f"partial sums are for one token, got {n_tok}")
    if out != "scores" and n_tok > FEW_TOKENS:
        raise ValueError(f"the fused kernel takes at most {FEW_TOKENS} tokens, got {n_tok}")
    progs = n_programs(x.device, d_inter, cfg)
    block_d = max(16, pow2(d_model))
    cpu_bf16 = x.device.type == "cpu" and x.dtype == torch.bfloat16 and interpreting()
    if out == "partials":
        o = new_output((progs, d_model), torch.float32, x.device)
    elif out == "s":
        o = new_output((n_tok, d_inter), torch.float32 if cpu_bf16 else x.dtype, x.device)
    else:
        o = new_output((2, n_tok, d_inter), torch.float32, x.device)
    big = d_inter * max(d_model, 2 * n_words, r_lat) >= 2**31
    kept, rows = counters(count if out != "scores" else None, x.device)
    launching("select", x, kind, out)
    select_kernel[(progs, -(-n_tok // bt_tok))](
        x, xs, q if q is not None else dummy, scale if scale is not None else dummy,
        u if u is not None else dummy, latent if latent is not None else dummy,
        bt if bt is not None else dummy, bias if bias is not None else dummy,
        w_gate if w_gate is not None else dummy, w_up if w_up is not None else dummy,
        w_down_t if w_down_t is not None else dummy, cut_t if cut_t is not None else o, o,
        kept if kept is not None else o, rows if rows is not None else o,
        float(cut_f), n_tok, d_model, d_inter, n_words, n_groups, r_lat, -(-d_inter // cfg["ROWS"]), progs,
        x.stride(0), u.stride(0) if u is not None else 0, latent.stride(0) if latent is not None else 0,
        KIND=0 if kind == "shadow" else 1, BITS=bits, ACT=act_code(activation), CUT_PTR=cut_t is not None,
        HAS_BIAS=bias is not None, BT=bt_tok, ROWS=cfg["ROWS"], GPT=gpt, WPG=wpg, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_D=block_d, BLOCK_R=block_r, EVEN_D=block_d == d_model, BIG=big,
        NEXT=bool(cfg.get("NEXT")) and kind == "shadow" and gpt >= n_groups,
        FUSE_DOWN=out == "partials", SCORES=out == "scores",
        OUT_F32=cpu_bf16, COUNT=kept is not None,
        num_warps=cfg["num_warps"], num_stages=1,
    )
    return o


def _kind_args(q, scale, u, latent, bt, bias, w_gate, w_up, w_down_t):
    kind = "shadow" if q is not None else "hybrid"
    return kind, dict(q=q, scale=scale, u=u, latent=latent, bt=bt, bias=bias, w_gate=w_gate, w_up=w_up,
                      w_down_t=w_down_t)


@torch.library.custom_op("countdown::select_one_token", mutates_args=("kept", "rows"))
def _one_token_op(x: torch.Tensor, q: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                  u: Optional[torch.Tensor], latent: Optional[torch.Tensor], bt: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], cut_t: Optional[torch.Tensor], cut_f: float,
                  w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down_t: torch.Tensor,
                  activation: str, kept: Optional[torch.Tensor] = None,
                  rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token: fp32 partial sums P [programs, d_model] of the shadow (q given) or hybrid MLP."""
    kind, args = _kind_args(q, scale, u, latent, bt, bias, w_gate, w_up, w_down_t)
    return launch(x, kind, "partials", cut_t, cut_f, activation, count=op_count(kept, rows), **args)


@_one_token_op.register_fake
def _(x, q, scale, u, latent, bt, bias, cut_t, cut_f, w_gate, w_up, w_down_t, activation, kept=None, rows=None):
    kind = "shadow" if q is not None else "hybrid"
    progs = n_programs(x.device, w_gate.shape[0], config(kind, 1, x.device))
    return x.new_empty((progs, x.shape[1]), dtype=torch.float32)


@torch.library.custom_op("countdown::select_few_tokens", mutates_args=("kept", "rows"))
def _few_tokens_op(x: torch.Tensor, q: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                   u: Optional[torch.Tensor], latent: Optional[torch.Tensor], bt: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], cut_t: Optional[torch.Tensor], cut_f: float,
                   w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down_t: torch.Tensor,
                   activation: str, kept: Optional[torch.Tensor] = None,
                   rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """2-8 tokens: s of the batch's kept rows (this kernel), then the masked down projection (down.py)."""
    from .down import sparse_down

    kind, args = _kind_args(q, scale, u, latent, bt, bias, w_gate, w_up, w_down_t)
    s = launch(x, kind, "s", cut_t, cut_f, activation, count=op_count(kept, rows), **args).to(x.dtype)
    return sparse_down(s, None, w_down_t)


@_few_tokens_op.register_fake
def _(x, q, scale, u, latent, bt, bias, cut_t, cut_f, w_gate, w_up, w_down_t, activation, kept=None, rows=None):
    return torch.empty_like(x)


@torch.library.custom_op("countdown::shadow_scores", mutates_args=())
def _scores_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(u~, g~) as [2, T, d_inter] fp32 from the shadows' fp32 products (any number of tokens)."""
    return launch(x, "shadow", "scores", None, 0.0, "silu", q=q, scale=scale)


@_scores_op.register_fake
def _(x, q, scale):
    return x.new_empty((2, x.shape[0], q.shape[0]), dtype=torch.float32)
