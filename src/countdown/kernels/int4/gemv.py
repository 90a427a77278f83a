"""Triton kernel: one token through a 4-bit Linear (``countdown.int4``'s format), near the bandwidth limit.

For ``W~[n, k] = scale[n, g] * c[n, k] + offset[n, g]`` (codes c in 0..15, groups g of G columns, the format of
``int4/format.py``: ``qweight`` uint8 [N, K / 2], byte b holding column 2b in its low nibble) and one input row x:

    y[n] = sum_g scale[n, g] * sum_{k in g} (c[n, k] - 8) x[k]  +  sum_g (offset[n, g] + 8 scale[n, g]) xs[g]

with ``xs[g]`` the sum of x over group g. The first sum is the signed-nibble dot product of words.py: ``qweight``
viewed as int32 words is word c holding columns 8c .. 8c + 7 at bits 4j, exactly the words its ``lop3``
dequantization reads (one integer operation per two values, no weight permuted; x is paired to match once per
program: ``word_dot``, fp16x2 products summed over four values, lanes and words in fp32, the group's scale, then
2**-e). The second
sum is the asymmetric part, one fp32 multiply-add per group. The format's own bytes are the layout: nothing is
re-packed (``Int4Linear`` hands ``qweight.view(int32)`` over as it is).

Split K: x of a slice of ``SLICE`` groups is held in registers by each program (a persistent program walks
blocks of R rows), so a long K (W_down's 14,336) is cut into S slices of at most ``MAX_COLS`` columns; the
kernel writes fp32 partial sums ``[S, N]`` and the caller adds them (``int4/backends.py`` leaves the sum to the
surrounding code, where torch.compile fuses it with what follows). A slice count that divides the number of
groups is chosen (:func:`split_for`).

GLU input (``GLU=True``): x is ``act(g) * u`` of a fp32 ``[S_in, 2, K]`` input (the stacked gate/up GEMV's partial
sums), summed and formed as x is loaded: the down projection of a 4-bit Gated-MLP reads its input straight from the
gate/up GEMV, no kernel between them.

Error: as words.py's (fp16x2 lanes of four products of exact q - 8 and x' = x 2**e rounded to fp16): about
5 * 2**-11 of sum |scale (c - 8) x| per row at worst, plus fp32 sums; the asymmetric term is fp32. The tests
(tests/test_int4_gemv.py) bound the kernel against float64 with this arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import act_code, interpreting, new_output, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode, persistent_programs
from ..jit_helpers import act, gdc_launch_dependents, gdc_wait, round_to
from .words import pack2, word_dot, xload


def config_for(n: int, k: int, config: dict | None = None, device=None) -> dict:
    """The launch configuration of an [N, K] weight (config.LAUNCH["int4_gemv"]: R rows a block, PER_SM persistent
    programs an SM over all slices, MAX_COLS the most columns of x a program holds, ASM the inline-asm dequantization
    on CUDA, PREFETCH / AHEAD blocks of words requested ahead): the default, the shape's entry (the fastest of
    benchmarks/int4_decode.py's sweep at the Llama-3.1-8B shapes; q/k/v's K in one slice, its output feeding the
    attention kernel directly), ``device``'s changes, then ``config``. ``config.overrides(launch={("int4_gemv", (n,
    k)): ...})`` changes a shape's entry: set it before a step compiles, which keeps the slice counts it was traced
    with."""
    return launch_config("int4_gemv", device, (n, k), config)


def splits(n: int, k: int, group: int, config: dict | None = None) -> int:
    """How many slices of K (partial sums) the kernel writes for an [N, K] weight."""
    return split_for(k // group, group, config_for(n, k, config)["MAX_COLS"])


def split_for(n_groups: int, group: int, max_cols: int) -> int:
    """Slices of K: the fewest that divide the groups and hold at most ``max_cols`` columns each."""
    most = max(1, max_cols // group)
    return next(s for s in range(1, n_groups + 1) if n_groups % s == 0 and n_groups // s <= most)


@triton.jit
def _xglu(X, col, cm, J: tl.constexpr, K, ACT: tl.constexpr, XS: tl.constexpr):
    """x at columns 8 col + J as act(g) * u from the fp32 [XS, 2, K] input (XS partial sums of [g; u])."""
    g = tl.load(X + col * 8 + J, mask=cm, other=0.0).to(tl.float32)
    u = tl.load(X + K + col * 8 + J, mask=cm, other=0.0).to(tl.float32)
    for i in tl.static_range(1, XS):
        g += tl.load(X + i * 2 * K + col * 8 + J, mask=cm, other=0.0).to(tl.float32)
        u += tl.load(X + i * 2 * K + K + col * 8 + J, mask=cm, other=0.0).to(tl.float32)
    return act(g, ACT) * u


@triton.jit
def _xval(X, col, cm, J: tl.constexpr, K, GLU: tl.constexpr, ACT: tl.constexpr, XS: tl.constexpr):
    if GLU:
        return _xglu(X, col, cm, J, K, ACT, XS)
    else:
        return xload(X, col, cm, J, 8)


@triton.jit
def _tile(Wq, SC, OF, rows, n_rows, n_words, n_groups, wcol, gcol, gm, BIG: tl.constexpr):
    """Words [R, S_G, WPG], scales and offsets [R, S_G] (fp32) of the rows (0 past the end)."""
    rm = rows < n_rows
    if BIG:
        r64 = rows.to(tl.int64)
        qb = r64 * n_words
        sb = r64 * n_groups
    else:
        qb = rows * n_words
        sb = rows * n_groups
    m3 = rm[:, None, None] & gm[None, :, None]
    w = tl.load(Wq + qb[:, None, None] + wcol[None, :, :], mask=m3, other=0)
    m2 = rm[:, None] & gm[None, :]
    soff = sb[:, None] + gcol[None, :]
    sc = tl.load(SC + soff, mask=m2, other=0.0).to(tl.float32)
    of = tl.load(OF + soff, mask=m2, other=0.0).to(tl.float32)
    return w, sc, of


@triton.jit
def _paired_x(x0, x1, x2, x3, x4, x5, x6, x7):
    """x's values j = 0..7 of each word ([SG, WPG], fp32) as the dot products take them: (xs, down, h0..h7, e0..e3):
    x summed per group, 2**-e, x' = x 2**e in fp16 (portable path) and the asm path's fp16x2 pairs."""
    xs = tl.sum(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), axis=1)        # [SG]: x summed per group
    amax = tl.maximum(tl.maximum(tl.maximum(tl.max(tl.abs(x0)), tl.max(tl.abs(x1))),
                                 tl.maximum(tl.max(tl.abs(x2)), tl.max(tl.abs(x3)))),
                      tl.maximum(tl.maximum(tl.max(tl.abs(x4)), tl.max(tl.abs(x5))),
                                 tl.maximum(tl.max(tl.abs(x6)), tl.max(tl.abs(x7)))))
    # x' = x 2**e with max|x'| in [512, 1024): |q - 8| <= 8, so a lane of four products stays under 2**15
    ebits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(136 - ebits, -126), 126)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    h0 = (x0 * up).to(tl.float16)
    h1 = (x1 * up).to(tl.float16)
    h2 = (x2 * up).to(tl.float16)
    h3 = (x3 * up).to(tl.float16)
    h4 = (x4 * up).to(tl.float16)
    h5 = (x5 * up).to(tl.float16)
    h6 = (x6 * up).to(tl.float16)
    h7 = (x7 * up).to(tl.float16)
    e0 = pack2(h0, h4)[None]
    e1 = pack2((x1 * (up * 0.0625)).to(tl.float16), (x5 * (up * 0.0625)).to(tl.float16))[None]
    e2 = pack2(h2, h6)[None]
    e3 = pack2((x3 * (up * 0.0625)).to(tl.float16), (x7 * (up * 0.0625)).to(tl.float16))[None]
    return xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3


@triton.jit
def _slice_grid(s, SLICE: tl.constexpr, SG: tl.constexpr, WPG: tl.constexpr):
    """Slice s of a row's groups (SLICE of them, SG a power of two >= SLICE): group ids [SG], their mask, the word
    index [SG, WPG] and its mask."""
    gl = tl.arange(0, SG)
    gi = s * SLICE + gl
    gm = gl < SLICE
    return gi, gm, gi[:, None] * WPG + tl.arange(0, WPG)[None, :], gm[:, None] & (tl.arange(0, WPG) < WPG)[None, :]


@triton.jit
def int4_gemv_kernel(X, Wq, SC, OF, B, NW, eps, OUT, n_rows, K, n_words, n_groups, n_blocks, n_progs,
                      SLICE: tl.constexpr, SG: tl.constexpr, WPG: tl.constexpr, R: tl.constexpr,
                      ASM: tl.constexpr, PREFETCH: tl.constexpr, AHEAD: tl.constexpr, BIG: tl.constexpr,
                      GLU: tl.constexpr, ACT: tl.constexpr, XS: tl.constexpr, HAS_B: tl.constexpr,
                      NORM: tl.constexpr = 0, PDL: tl.constexpr = 0):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    if PDL == 1:  # launched early (PDL): the next grid may launch now; x is read only after the wait below
        gdc_launch_dependents()
    gi, gm, wcol, wm = _slice_grid(s, SLICE, SG, WPG)
    ri = tl.arange(0, R)
    if PREFETCH:  # the first block's words (AHEAD 2: two blocks'), requested before x is prepared
        nw, nsc, nof = _tile(Wq, SC, OF, pid * R + ri, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
        if AHEAD == 2:
            mw, msc, mof = _tile(Wq, SC, OF, (pid + n_progs) * R + ri, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
    if PDL:  # the weights above depend on no earlier kernel; x is the previous kernel's output
        gdc_wait()
        if PDL == 2:  # late: the next grid launches once every program is past its wait (may read x's producers)
            gdc_launch_dependents()
    x0 = _xval(X, wcol, wm, 0, K, GLU, ACT, XS)
    x1 = _xval(X, wcol, wm, 1, K, GLU, ACT, XS)
    x2 = _xval(X, wcol, wm, 2, K, GLU, ACT, XS)
    x3 = _xval(X, wcol, wm, 3, K, GLU, ACT, XS)
    x4 = _xval(X, wcol, wm, 4, K, GLU, ACT, XS)
    x5 = _xval(X, wcol, wm, 5, K, GLU, ACT, XS)
    x6 = _xval(X, wcol, wm, 6, K, GLU, ACT, XS)
    x7 = _xval(X, wcol, wm, 7, K, GLU, ACT, XS)
    if NORM:  # x is h, K in one slice: transformers' RMSNorm of it first, rounded as the module rounds
        sq = ((x0 * x0 + x1 * x1) + (x2 * x2 + x3 * x3)) + ((x4 * x4 + x5 * x5) + (x6 * x6 + x7 * x7))
        ss = tl.sum(tl.sum(sq, axis=1), axis=0)
        r = 1.0 / tl.sqrt(ss / K + eps)
        DT: tl.constexpr = X.dtype.element_ty
        x0 = round_to(xload(NW, wcol, wm, 0, 8) * round_to(x0 * r, DT), DT)
        x1 = round_to(xload(NW, wcol, wm, 1, 8) * round_to(x1 * r, DT), DT)
        x2 = round_to(xload(NW, wcol, wm, 2, 8) * round_to(x2 * r, DT), DT)
        x3 = round_to(xload(NW, wcol, wm, 3, 8) * round_to(x3 * r, DT), DT)
        x4 = round_to(xload(NW, wcol, wm, 4, 8) * round_to(x4 * r, DT), DT)
        x5 = round_to(xload(NW, wcol, wm, 5, 8) * round_to(x5 * r, DT), DT)
        x6 = round_to(xload(NW, wcol, wm, 6, 8) * round_to(x6 * r, DT), DT)
        x7 = round_to(xload(NW, wcol, wm, 7, 8) * round_to(x7 * r, DT), DT)
    xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3 = _paired_x(x0, x1, x2, x3, x4, x5, x6, x7)
    for blk in range(pid, n_blocks, n_progs):
        rows = blk * R + ri
        if PREFETCH:
            w, sc, of = nw, nsc, nof
            if AHEAD == 2:
                nw, nsc, nof = mw, msc, mof
                mw, msc, mof = _tile(Wq, SC, OF, rows + 2 * n_progs * R, n_rows, n_words, n_groups, wcol, gi, gm,
                                     BIG)
            else:
                nw, nsc, nof = _tile(Wq, SC, OF, rows + n_progs * R, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
        else:
            w, sc, of = _tile(Wq, SC, OF, rows, n_rows, n_words, n_groups, wcol, gi, gm, BIG)
        d = word_dot(w, h0[None], h1[None], h2[None], h3[None], h4[None], h5[None], h6[None], h7[None],
                     e0, e1, e2, e3, ASM)
        y = tl.sum(tl.sum(d, axis=2) * sc, axis=1) * down + tl.sum((of + 8.0 * sc) * xs[None, :], axis=1)
        if HAS_B:  # one slice only (launch checks): the finished output
            y += tl.load(B + rows, mask=rows < n_rows, other=0.0).to(tl.float32)
        if BIG:
            dst = OUT + s.to(tl.int64) * n_rows + rows
        else:
            dst = OUT + s * n_rows + rows
        tl.store(dst, round_to(y, OUT.dtype.element_ty).to(OUT.dtype.element_ty), mask=rows < n_rows)


def check(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, glu: bool) -> tuple:
    """(N, K, group) of a one-token 4-bit GEMV, or a ValueError naming what the kernel takes."""
    n, n_words = words.shape
    k = 8 * n_words
    ok_x = (x.numel() % (2 * k) == 0 and x.numel() > 0) if glu else x.numel() == k
    if (words.dtype != torch.int32 or scale.shape != offset.shape or scale.dim() != 2 or scale.shape[0] != n
            or k % scale.shape[1] or not ok_x or (k // scale.shape[1]) % 8
            or (k // scale.shape[1] // 8) & (k // scale.shape[1] // 8 - 1)):
        raise ValueError(f"the 4-bit GEMV takes one token x ({'[S, 2, K] gate and up' if glu else '[1, K]'}), int32 "
                         f"words [N, K / 8] and scale / offset [N, K / G] with G a power of two of at least 8 "
                         f"columns; got x {tuple(x.shape)}, words {words.dtype} {tuple(words.shape)}, scale "
                         f"{tuple(scale.shape)}, offset {tuple(offset.shape)}")
    return n, k, k // scale.shape[1]


def launch(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
           activation: str | None = None, config: dict | None = None, final: bool = False,
           bias: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
           late: bool = False) -> torch.Tensor:
    """fp32 partial sums ``[S, N]`` (their sum over S is ``x W~^T``) of one token ``x`` (any float dtype;
    with ``activation``, fp32 gate/up partial sums ``[S_in, 2, K]`` whose ``act(g) * u`` of their sum is the input)
    through the 4-bit
    weight ``words`` (``qweight.view(torch.int32)``), ``scale``, ``offset``. ``final``: K in one slice and the output
    ``[1, N]`` itself, in x's dtype, plus ``bias`` if given (what a layer hands on, no sum after it). ``norm``
    (weight, eps), with ``final``: x is h and the GEMV's input is transformers' RMSNorm of it (the layer's input norm
    folded into the q/k/v GEMV: each program holds all of h). ``late`` (PDL): each program signals the next grid
    after its wait, not at its start, so the next grid may read what the kernels before this one wrote before its
    own wait (``nested_down.py``'s D_EARLY). (Spy hook: ``on_launch("int4_gemv", x, words)``.)"""
    glu = activation is not None
    n, k, group = check(x, words, scale, offset, glu)
    cfg = config_for(n, k, config, x.device)
    if final:
        cfg["MAX_COLS"] = max(cfg["MAX_COLS"], k)
    n_groups = k // group
    n_splits = split_for(n_groups, group, cfg["MAX_COLS"])
    interp = x.device.type != "cuda" or interpreting()
    R = max(cfg["R"], cfg.get("MIN_R", 0))  # the interpreter: few, large blocks
    n_blocks = -(-n // R)
    progs = max(1, min(n_blocks, -(-persistent_programs(x.device, cfg["PER_SM"], cfg.get("PROGRAMS", 0)) // n_splits)))
    asm = bool(cfg["ASM"]) and not interp
    if norm is not None and (not final or glu or norm[0].shape != (k,) or norm[0].dtype != x.dtype):
        raise ValueError(f"a folded norm takes a final GEMV of x [1, K] and a weight [{k}] of x's dtype, got "
                         f"{tuple(norm[0].shape)} {norm[0].dtype}")
    if bias is not None and (not final or bias.shape != (n,)):
        raise ValueError(f"a bias is added to a final output only, and has N = {n} values; got {tuple(bias.shape)}")
    out = new_output((n_splits, n), x.dtype if final else torch.float32, x.device)
    pdl = pdl_mode(x) * (2 if late else 1)
    launching("int4_gemv", x, words)
    int4_gemv_kernel[(progs, n_splits)](
        x.contiguous(), words.contiguous(), scale.contiguous(), offset.contiguous(),
        out if bias is None else bias.contiguous(), out if norm is None else norm[0].contiguous(),
        0.0 if norm is None else float(norm[1]), out, n, k, k // 8, n_groups,
        n_blocks, progs, SLICE=n_groups // n_splits, SG=pow2(n_groups // n_splits), WPG=group // 8, R=R, ASM=asm,
        PREFETCH=bool(cfg["PREFETCH"]), AHEAD=int(cfg["AHEAD"]), BIG=n * (k // 8) >= 2**31 or n_splits * n >= 2**31,
        GLU=glu, ACT=act_code(activation or "silu"), XS=x.numel() // (2 * k) if glu else 1,
        HAS_B=bias is not None, NORM=norm is not None, PDL=pdl, num_warps=cfg["num_warps"], num_stages=1,
        **launch_kwargs(pdl))
    return out
