"""Triton kernel: the kept rows of a 4-bit Gated-MLP for one token (sparse rows on 4-bit weights).

On a 4-bit model (``countdown.int4``), for one token x whose indicator GEMV has already run (``kernels/_int4.py``,
fp32 partial sums over slices of K):

    "abs"     (mono)  ind = u = x W_up~^T      keep |u| > t          g of the kept rows from their W_gate~ rows
    "abs_act" (cats)  ind = g = x W_gate~^T    keep |act(g)| > t     u of the kept rows from their W_up~ rows
    "dual"    (dual)  ind = (g, u), both       keep |act(g) u| > t   (nothing more to compute)
    s[i] = u[i] act(g[i])                      kept rows only
    P[p] = sum over the kept rows program p owns of s[i] Wd~t[i]      fp32 partials [n_progs, d_model]

and y = P.sum(0) is left to the caller (a decode step adds it to the residual in one launch:
``decode_add_partials``). Wd~t is W_down^T in the 4-bit format, ``[d_inter, d_model]`` with groups along d_model: a
kept row is one contiguous run of d_model / 2 bytes and d_model / G scales and offsets, so a skipped row is bytes not
read. (In W_down's own layout, groups along d_inter, a row of W_down^T is one nibble of every word: nothing could be
skipped; docs/int4.md measures what the transposed grouping costs in quality.) The other GEMV's kept rows (W_gate~
for mono, W_up~ for cats) are rows of the format as it is. Bytes a token: the indicator's matrix in full (both for
dual), then for each kept row one row of the other matrix (not for dual) and one row of Wd~t.

A persistent program walks chunks of CHUNK rows (c = p, p + n_progs, ...): it sums the chunk's indicator partials,
compacts the kept rows in registers (prefix sum, one-hot select), then takes them BM at a time: the other matrix's
rows (the dot products of kernels/_int4.py: x paired once per program, the shadow GEMV's dequantization) and Wd~t's
rows, all loads of a tile before its arithmetic. Wd~t's words are added into eight fp32 accumulators, one per nibble
of a word (value 8 w + j of the row is nibble j of word w), plus one per group for the offsets' term; the partials
are written whole (deterministic: no atomics but the Sparsity-Real count, ``_count.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._count import add_count
from ._gemv import _word_dot, _xload
from ._glu import _act, _pow2
from ._int4 import _paired_x, _tile

MODES = {"abs": 0, "abs_act": 1, "dual": 2}
# ROWWISE: W~d^T's kept rows added one at a time (every thread its own words) rather than a tile's rows summed
# across the tile: an open question for the next sweep on a GPU (benchmarks/int4_rows.py); the loser goes.
CONFIG = dict(CHUNK=64, BM=8, PER_SM=1, num_warps=8, ROWWISE=False)
INTERPRETER_PROGS = 3


@triton.jit
def _nibble_sum(acc, wd, a, J: tl.constexpr):
    """acc [SG, WPG] + the sum over the tile's rows of nibble J of each word times its row's s * scale ``a``."""
    return acc + tl.sum(((wd >> (4 * J)) & 15).to(tl.float32) * a[:, :, None], axis=0)


@triton.jit
def _add_rows(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, wd, sa):
    """The eight nibble accumulators plus rows ``wd`` [rows, SG, WPG] times their s * scale ``sa`` [rows, SG]."""
    return (_nibble_sum(acc0, wd, sa, 0), _nibble_sum(acc1, wd, sa, 1), _nibble_sum(acc2, wd, sa, 2),
            _nibble_sum(acc3, wd, sa, 3), _nibble_sum(acc4, wd, sa, 4), _nibble_sum(acc5, wd, sa, 5),
            _nibble_sum(acc6, wd, sa, 6), _nibble_sum(acc7, wd, sa, 7))


@triton.jit
def _store_nibble(P, base, wcol, wm, acc, boff, J: tl.constexpr):
    tl.store(P + base + wcol * 8 + J, acc + boff[:, None], mask=wm)


@triton.jit
def _int4_rows_kernel(IND, X, WO, SCO, OFO, WD, SCD, OFD, THR, P, KEPT, ROWS,
                      d_inter, n_words, n_groups, n_chunks, n_progs, ind_stride,
                      MODE: tl.constexpr, ACT: tl.constexpr, S: tl.constexpr, CHUNK: tl.constexpr,
                      BM: tl.constexpr, SG: tl.constexpr, WPG: tl.constexpr, ASM: tl.constexpr,
                      BIG: tl.constexpr, COUNT: tl.constexpr, ROWWISE: tl.constexpr = False):
    pid = tl.program_id(0)
    gl = tl.arange(0, SG)
    gm = gl < n_groups
    wcol = gl[:, None] * WPG + tl.arange(0, WPG)[None, :]              # [SG, WPG] word index in a row
    wm = gm[:, None] & (tl.arange(0, WPG) < WPG)[None, :]
    if MODE != 2:  # the other GEMV's kept rows need x, paired as kernels/_int4.py pairs it
        xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3 = _paired_x(
            _xload(X, wcol, wm, 0, 8), _xload(X, wcol, wm, 1, 8), _xload(X, wcol, wm, 2, 8),
            _xload(X, wcol, wm, 3, 8), _xload(X, wcol, wm, 4, 8), _xload(X, wcol, wm, 5, 8),
            _xload(X, wcol, wm, 6, 8), _xload(X, wcol, wm, 7, 8))
    thr = tl.load(THR).to(tl.float32)
    acc0 = tl.zeros([SG, WPG], dtype=tl.float32)
    acc1 = tl.zeros([SG, WPG], dtype=tl.float32)
    acc2 = tl.zeros([SG, WPG], dtype=tl.float32)
    acc3 = tl.zeros([SG, WPG], dtype=tl.float32)
    acc4 = tl.zeros([SG, WPG], dtype=tl.float32)
    acc5 = tl.zeros([SG, WPG], dtype=tl.float32)
    acc6 = tl.zeros([SG, WPG], dtype=tl.float32)
    acc7 = tl.zeros([SG, WPG], dtype=tl.float32)
    boff = tl.zeros([SG], dtype=tl.float32)
    cr = tl.arange(0, CHUNK)
    n_kept = tl.zeros([], dtype=tl.int32)
    for c in range(pid, n_chunks, n_progs):
        r = c * CHUNK + cr
        rm = r < d_inter
        a = tl.zeros([CHUNK], dtype=tl.float32)
        b = tl.zeros([CHUNK], dtype=tl.float32)
        for i in tl.static_range(S):  # the indicator GEMV's partial sums over its slices of K
            a += tl.load(IND + i * ind_stride + r, mask=rm, other=0.0)
            if MODE == 2:
                b += tl.load(IND + i * ind_stride + d_inter + r, mask=rm, other=0.0)
        if MODE == 0:
            ind = a                      # u
        elif MODE == 1:
            ind = _act(a, ACT)           # act(g)
        else:
            ind = _act(a, ACT) * b       # s = act(g) u
        keep = ((tl.abs(ind) > thr) & rm).to(tl.int32)
        pos = tl.where(keep > 0, tl.cumsum(keep, axis=0) - 1, -1)
        cnt = tl.sum(keep, axis=0)
        n_kept += cnt
        for t in range(0, cnt, BM):
            m = t + tl.arange(0, BM)
            valid = m < cnt
            sel = pos[None, :] == m[:, None]                            # [BM, CHUNK] one-hot: slot -> chunk row
            rows = tl.where(valid, tl.sum(tl.where(sel, r[None, :], 0), axis=1), d_inter)  # past the end: masked
            if MODE == 2:
                sv = tl.sum(tl.where(sel, ind[None, :], 0.0), axis=1)
            else:
                av = tl.sum(tl.where(sel, a[None, :], 0.0), axis=1)    # u (mono) or g (cats) of the slots
                w, sc, of = _tile(WO, SCO, OFO, rows, d_inter, n_words, n_groups, wcol, gl, gm, BIG)
                if not ROWWISE:
                    wd, scd, ofd = _tile(WD, SCD, OFD, rows, d_inter, n_words, n_groups, wcol, gl, gm, BIG)
                d = _word_dot(w, h0[None], h1[None], h2[None], h3[None], h4[None], h5[None], h6[None], h7[None],
                              e0, e1, e2, e3, 4, ASM)
                o = tl.sum(tl.sum(d, axis=2) * sc, axis=1) * down + tl.sum((of + 8.0 * sc) * xs[None, :], axis=1)
                if MODE == 0:
                    sv = av * _act(o, ACT)
                else:
                    sv = o * _act(av, ACT)
            sv = tl.where(valid, sv, 0.0)
            if ROWWISE:  # one W~d^T row at a time: no sum across the tile's rows, every thread adds its own words
                for j in tl.static_range(BM):
                    slot = tl.arange(0, BM) == j
                    rj = tl.sum(tl.where(slot, rows, 0), axis=0) + tl.zeros([1], dtype=tl.int32)  # [1]
                    sj = tl.sum(tl.where(slot, sv, 0.0), axis=0)
                    wd, scd, ofd = _tile(WD, SCD, OFD, rj, d_inter, n_words, n_groups, wcol, gl, gm, BIG)
                    sa = sj * scd                                           # [1, SG]: a sum over one row
                    boff += tl.sum(sj * ofd, axis=0)
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _add_rows(
                        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, wd, sa)
            else:  # the tile's rows together, summed across them
                if MODE == 2:
                    wd, scd, ofd = _tile(WD, SCD, OFD, rows, d_inter, n_words, n_groups, wcol, gl, gm, BIG)
                sa = sv[:, None] * scd                                      # [BM, SG]: s * scale
                boff += tl.sum(sv[:, None] * ofd, axis=0)
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _add_rows(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, wd, sa)
    if COUNT:
        add_count(KEPT, ROWS, n_kept, d_inter, pid == 0)
    if BIG:
        base = pid.to(tl.int64) * n_words * 8
    else:
        base = pid * n_words * 8
    _store_nibble(P, base, wcol, wm, acc0, boff, 0)
    _store_nibble(P, base, wcol, wm, acc1, boff, 1)
    _store_nibble(P, base, wcol, wm, acc2, boff, 2)
    _store_nibble(P, base, wcol, wm, acc3, boff, 3)
    _store_nibble(P, base, wcol, wm, acc4, boff, 4)
    _store_nibble(P, base, wcol, wm, acc5, boff, 5)
    _store_nibble(P, base, wcol, wm, acc6, boff, 6)
    _store_nibble(P, base, wcol, wm, acc7, boff, 7)


def _words(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int32 words [N, K / 8], scale, offset) of an Int4Weight-like object (qweight, scale, offset)."""
    return weight.qweight.view(torch.int32), weight.scale, weight.offset


def programs(d_inter: int, device, config: dict | None = None) -> int:
    """How many partials [P, d_model] the kernel writes for ``d_inter`` rows on ``device``."""
    from ._common import persistent_programs

    cfg = {**CONFIG, **(config or {})}
    return max(1, min(-(-d_inter // cfg["CHUNK"]), persistent_programs(device, cfg["PER_SM"], INTERPRETER_PROGS)))


def kept_rows(ind: torch.Tensor, x: torch.Tensor, other, down_t, threshold: torch.Tensor, mode: str,
              activation: str = "silu", count: tuple[torch.Tensor, torch.Tensor] | None = None,
              config: dict | None = None) -> torch.Tensor:
    """fp32 partials ``[P, d_model]`` whose sum over P is the sparse MLP's output for one token ``x [1, d_model]``.

    ``ind``: the indicator GEMV's fp32 partial sums, ``[S, d_inter]`` (u for mode "abs", g for "abs_act") or
    ``[S, 2, d_inter]`` (g and u, mode "dual"); ``other``: the 4-bit weight (``qweight``, ``scale``, ``offset``) whose
    kept rows are computed (W_gate for "abs", W_up for "abs_act"; None for "dual"); ``down_t``: W_down^T in the
    format, ``[d_inter, d_model]``; ``threshold``: a one-value fp32 tensor; ``count`` = (kept, rows): the kept rows
    added to a patched layer's Sparsity-Real counters."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    words_d, sc_d, of_d = _words(down_t)
    words_o, sc_o, of_o = _words(other) if other is not None else (None, None, None)
    return launch(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, mode, activation, count, config)


def launch(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, mode, activation="silu", count=None,
           config=None) -> torch.Tensor:
    """:func:`kept_rows` on the weights' tensors (words int32 [d_inter, d_model / 8], scales, offsets; the other
    weight's None for mode "dual")."""
    from ._common import act_code, interpreting, new_output

    d_inter, n_words = words_d.shape
    d_model, n_groups = 8 * n_words, sc_d.shape[1]
    group = d_model // n_groups
    dual = mode == "dual"
    want = (2 * d_inter) if dual else d_inter
    if ind.dtype != torch.float32 or ind.numel() % want or x.numel() != d_model or (words_o is None) != dual:
        raise ValueError(f"kept_rows takes fp32 indicator partials [S, {'2, ' if dual else ''}{d_inter}], one token x "
                         f"[1, {d_model}] and {'no other weight' if dual else 'the other weight'} for mode {mode!r}; "
                         f"got ind {ind.dtype} {tuple(ind.shape)}, x {tuple(x.shape)}")
    if words_o is not None:
        if words_o.shape != words_d.shape or sc_o.shape != sc_d.shape:
            raise ValueError(f"the other weight's rows must match W_down^T's: words {tuple(words_o.shape)} vs "
                             f"{tuple(words_d.shape)}, scales {tuple(sc_o.shape)} vs {tuple(sc_d.shape)}")
    else:
        words_o, sc_o, of_o = words_d, sc_d, of_d  # not read
    cfg = {**CONFIG, **(config or {})}
    chunk = cfg["CHUNK"]
    n_chunks = -(-d_inter // chunk)
    progs = programs(d_inter, x.device, config)
    interp = x.device.type != "cuda" or interpreting()
    out = new_output((progs, d_model), torch.float32, x.device)
    kept, rows = count if count is not None else (out, out)
    thr = threshold.reshape(1).to(device=x.device, dtype=torch.float32)
    _int4_rows_kernel[(progs,)](
        ind.contiguous(), x.contiguous(), words_o.contiguous(), sc_o.contiguous(), of_o.contiguous(),
        words_d.contiguous(), sc_d.contiguous(), of_d.contiguous(), thr, out, kept, rows, d_inter, n_words, n_groups,
        n_chunks, progs, want, MODE=MODES[mode], ACT=act_code(activation), S=ind.numel() // want, CHUNK=chunk,
        BM=cfg["BM"], SG=_pow2(n_groups), WPG=group // 8, ASM=not interp,
        BIG=d_inter * n_words >= 2**31 or progs * d_model >= 2**31, COUNT=count is not None,
        ROWWISE=bool(cfg["ROWWISE"]), num_warps=cfg["num_warps"], num_stages=1)
    return out


@torch.library.custom_op("countdown::int4_kept_rows", mutates_args=("kept", "rows"))
def _kept_rows_op(ind: torch.Tensor, x: torch.Tensor, words_o: torch.Tensor, sc_o: torch.Tensor, of_o: torch.Tensor,
                  words_d: torch.Tensor, sc_d: torch.Tensor, of_d: torch.Tensor, threshold: torch.Tensor,
                  keep_rule: str, activation: str, kept: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # (the rule is not called "mode": torch.compile's functionalization of a mutating op takes a "mode" of its own)
    from ._common import op_count

    other = (None, None, None) if keep_rule == "dual" else (words_o, sc_o, of_o)
    return launch(ind, x, *other, words_d, sc_d, of_d, threshold, keep_rule, activation, op_count(kept, rows))


@_kept_rows_op.register_fake
def _(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, keep_rule, activation, kept, rows):
    return x.new_empty((programs(words_d.shape[0], x.device), 8 * words_d.shape[1]), dtype=torch.float32)


def kept_rows_ref(x: torch.Tensor, gate, up, down_t, threshold: float, mode: str, activation: str = "silu",
                  ind: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [d_model], keep [d_inter]) in float64 from the de-quantized weights (``Int4Weight``-like objects with
    ``dequantize``): what :func:`kept_rows` computes, with every product and sum exact to float64. ``ind``: the
    indicator GEMV's partials as the kernel takes them; the rows kept are then decided on their float32 sum, as the
    kernel decides them (the float64 indicator otherwise)."""
    from ._common import act_torch

    x64 = x.reshape(-1).double()
    g = gate.dequantize(torch.float64) @ x64
    u = up.dequantize(torch.float64) @ x64
    h = act_torch(g, activation)
    if ind is None:
        decide = {"abs": u, "abs_act": h, "dual": h * u}[mode]
    else:
        total = ind.float().sum(0).cpu()
        decide = {"abs": lambda: total, "abs_act": lambda: act_torch(total, activation),
                  "dual": lambda: act_torch(total[0], activation) * total[1]}[mode]()
    keep = decide.abs() > threshold
    s = torch.where(keep, u * h, torch.zeros((), dtype=torch.float64))
    return down_t.dequantize(torch.float64).t() @ s, keep
