"""Triton kernel: a dense linear layer for a few tokens (decode), y = x W^T (+ bias) (+ residual),
optionally with the RMSNorm before it folded in: y = RMSNorm(x) W^T.

Why: under torch.compile with coordinate-descent tuning, Inductor turns each one-token matrix product
into a Triton reduction, fuses it with its neighbours and tunes it per compile. In the decode step the
wide-and-short products (W_o fused with the residual add, W_down fused with act(g) * u) came out well below
the copy bandwidth each GEMV reaches alone, and differently from compile to compile. This kernel has a fixed
launch configuration per shape and is an opaque custom op to Inductor, so what it reaches does not depend on a
compile's tuning (countdown.decode.linears routes layers to it).

Layout: W row-major [N, K] (nn.Linear's weight), x [T, K] with T <= 8 tokens. Program p owns BN
output rows and walks K in BK steps, loading a [BN, BK] tile of W and the [T, BK] tile of x, so each
weight byte is read once for all T tokens; fp32 accumulation, one store per output. With a residual r
[T, N] the op returns r + x W^T, the sum done in fp32 and rounded once.

The RMSNorm fold (``norm_weight`` g and ``eps`` given): RMSNorm(x) W^T = rsqrt(mean(x^2) + eps) (x * g) W^T,
so each program multiplies its x tile by g's, accumulates sum(x^2) over the same K loop it already walks,
and scales its dot products once at the end: the norm costs no launch and no pass of its own. Everything in
fp32 and rounded once, where transformers' eager RMSNorm rounds x / rms and g * that to the model's dtype first
(torch.compile keeps them in fp32 too). With ``x_out`` the programs also write RMSNorm(x) itself, rounded as
transformers rounds it, for the kernels after the GEMV that read x (dual[lowrank]'s sparse kernel).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import new_output, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode, weights_early
from ..jit_helpers import gdc_launch_dependents, gdc_wait, round_to

MAX_TOKENS = 8  # the most rows the kernel takes (its routes send one: route.py)


def config_for(k: int, config: dict | None = None, norm: bool = False, device=None) -> dict:
    """The launch configuration of a GEMV of reduction length ``k`` (config.LAUNCH["linear"], the fastest of
    benchmarks/linear.py's sweep, one token: one row a program for the wide projections, x re-read per row from L2;
    "narrow", K <= 1024, the low-rank predictor's B^T [d_inter, r], several rows a program; the norm fold reads g
    with x in every program, so it takes NORM_BN rows a program), then ``config``."""
    name = "narrow" if k <= 1024 else "short" if k <= 8192 else "long"
    cfg = launch_config("linear", device, name)
    if norm:
        cfg["BN"] = cfg["NORM_BN"]
    return {**cfg, **(config or {})}


@triton.jit
def _w_tile(W, wrow, kk, K, EVEN_K: tl.constexpr):
    """The [BN, BK] weight tile at columns kk (past K: zeros)."""
    if EVEN_K:
        return tl.load(W + wrow + kk[None, :])
    return tl.load(W + wrow + kk[None, :], mask=(kk < K)[None, :], other=0.0)


@triton.jit
def linear_kernel(X, W, BIAS, RES, Y, G, eps, n_tok, N, K, stride_x, stride_r, stride_y,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, EVEN_K: tl.constexpr, BIG: tl.constexpr, NUM_STAGES: tl.constexpr,
                   PDL: tl.constexpr = 0, W_EARLY: tl.constexpr = True, XN=None, XN_CH: tl.constexpr = 0):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    rows_c = tl.where(rmask, rows, 0)  # clamped: every load of a partial last block is in bounds
    t = tl.arange(0, BT)
    tmask = t < n_tok
    if BIG:
        wrow = rows_c.to(tl.int64)[:, None] * K
    else:
        wrow = rows_c[:, None] * K
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    ssq = tl.zeros([BT], dtype=tl.float32)  # sum(x^2) per token, for the norm fold
    if PDL:  # launched early (PDL: jit_helpers.py), the next grid may launch now
        gdc_launch_dependents()
    if PDL:  # the weights do not depend on the previous kernel (W_EARLY: first tile before the wait), x may
        if W_EARLY:
            w_first = _w_tile(W, wrow, tl.arange(0, BK), K, EVEN_K)
        gdc_wait()
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        kk = k0 + tl.arange(0, BK)
        if PDL and W_EARLY:
            if k0 == 0:
                w = w_first
            else:
                w = _w_tile(W, wrow, kk, K, EVEN_K)
        else:
            w = _w_tile(W, wrow, kk, K, EVEN_K)
        if EVEN_K:
            xt = tl.load(X + t[:, None] * stride_x + kk[None, :], mask=tmask[:, None], other=0.0)
        else:
            xt = tl.load(X + t[:, None] * stride_x + kk[None, :], mask=tmask[:, None] & (kk < K)[None, :],
                         other=0.0)
        wf = w.to(tl.float32)
        xf = xt.to(tl.float32)
        if NORM:
            ssq += tl.sum(xf * xf, axis=1)
            if EVEN_K:
                g = tl.load(G + kk)
            else:
                g = tl.load(G + kk, mask=kk < K, other=0.0)
            xf = xf * g.to(tl.float32)[None, :]
        for j in tl.static_range(BT):
            if BT == 1:
                acc += tl.sum(wf * xf, axis=1)[None, :]
            else:
                xj = tl.sum(tl.where(t[:, None] == j, xf, 0.0), axis=0)
                acc = tl.where(t[:, None] == j, acc + tl.sum(wf * xj[None, :], axis=1)[None, :], acc)
    if NORM:
        rstd = 1.0 / tl.sqrt(ssq / K + eps)
        acc = acc * rstd[:, None]
        if XN_CH > 0:  # the normalised x itself, XN_CH columns a program, rounded as transformers rounds it
            c = pid * XN_CH + tl.arange(0, XN_CH)
            cm = tmask[:, None] & (c < K)[None, :]
            xv = tl.load(X + t[:, None] * stride_x + c[None, :], mask=cm, other=0.0).to(tl.float32)
            gv = tl.load(G + c, mask=c < K, other=0.0).to(tl.float32)
            DT: tl.constexpr = XN.dtype.element_ty
            xn = round_to(gv[None, :] * round_to(xv * rstd[:, None], DT), DT)
            tl.store(XN + t[:, None] * K + c[None, :], xn.to(DT), mask=cm)
    if HAS_BIAS:
        acc += tl.load(BIAS + rows_c).to(tl.float32)[None, :]
    omask = tmask[:, None] & rmask[None, :]
    if HAS_RES:
        acc += tl.load(RES + t[:, None] * stride_r + rows_c[None, :], mask=omask, other=0.0).to(tl.float32)
    acc = round_to(acc, Y.dtype.element_ty)  # round to nearest (the interpreter's cast truncates)
    tl.store(Y + t[:, None] * stride_y + rows[None, :], acc.to(Y.dtype.element_ty), mask=omask)


def check(x: torch.Tensor, weight: torch.Tensor, bias, residual, norm_weight=None) -> None:
    """Named errors for arguments the kernel cannot take."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"decode_linear takes x [tokens, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {weight.shape[1]}")
    if not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"decode_linear serves 1 to {MAX_TOKENS} tokens, got {x.shape[0]}: use F.linear")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) must match")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if residual is not None and residual.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(f"residual must be [{x.shape[0]}, {weight.shape[0]}], got {tuple(residual.shape)}")
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or norm_weight.device != x.device):
        raise ValueError(f"norm_weight must be [{x.shape[1]}] on {x.device} (the RMSNorm's weight before the "
                         f"layer), got {tuple(norm_weight.shape)} on {norm_weight.device}")


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, config: dict | None = None,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  x_out: torch.Tensor | None = None) -> torch.Tensor:
    """(residual +) x W^T (+ bias) for x [T <= 8, K], W [N, K]: y [T, N] in x's dtype. With
    ``norm_weight`` g [K]: RMSNorm(x) W^T (+ bias) (+ residual), RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g; and
    with ``x_out`` (contiguous [T, K] of x's dtype) RMSNorm(x) itself written there, rounded as transformers'
    RMSNorm rounds it (rmsnorm.py), a few columns by each program: no norm launch for its other readers. (Spy hook:
    ``on_launch("linear", x, weight, bias, norm_weight)``.)"""
    check(x, weight, bias, residual, norm_weight)
    n_tok, k = x.shape
    n = weight.shape[0]
    cfg = config_for(k, config, norm=norm_weight is not None, device=x.device)
    if not config:  # the CPU interpreter pays per program: fewer, larger blocks (MIN_BN, there only)
        cfg["BN"] = max(cfg["BN"], cfg.get("MIN_BN", 1))
    x = x.contiguous() if x.stride(-1) != 1 else x
    weight = weight.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    y = new_output((n_tok, n), x.dtype, x.device)
    bk = min(cfg["BK"], max(16, pow2(k)))
    bn = cfg["BN"]
    pdl = pdl_mode(x)
    grid = triton.cdiv(n, bn)
    xn_ch = 0
    if x_out is not None:
        if norm_weight is None or x_out.shape != x.shape or x_out.dtype != x.dtype or not x_out.is_contiguous():
            raise ValueError(f"x_out takes RMSNorm(x): a contiguous {tuple(x.shape)} {x.dtype} tensor, with "
                             f"norm_weight given; got {tuple(x_out.shape)} {x_out.dtype}")
        xn_ch = max(16, pow2(triton.cdiv(k, grid)))
        if triton.cdiv(k, xn_ch) > grid:
            raise ValueError(f"x_out needs at least {triton.cdiv(k, xn_ch)} programs, the GEMV has {grid}")
    launching("linear", x, weight, bias, norm_weight)
    linear_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, residual if residual is not None else y, y,
        norm_weight if norm_weight is not None else weight, float(eps),
        n_tok, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, NORM=norm_weight is not None, BT=max(1, pow2(n_tok)), BN=bn, BK=bk,
        EVEN_K=k % bk == 0, BIG=n * k >= 2**31, NUM_STAGES=cfg["num_stages"], PDL=pdl,
        W_EARLY=bool(pdl) and weights_early(x, grid, cfg["num_warps"]), XN=x_out, XN_CH=xn_ch,
        num_warps=cfg["num_warps"], **launch_kwargs(pdl))
    return y


@torch.library.custom_op("countdown::decode_linear", mutates_args=())
def _decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      residual: Optional[torch.Tensor]) -> torch.Tensor:
    return decode_linear(x, weight, bias, residual)


@_decode_linear_op.register_fake
def _(x, weight, bias, residual):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("countdown::decode_norm_linear_x", mutates_args=())
def _decode_norm_linear_x_op(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x) W^T, RMSNorm(x)): the GEMV with the norm folded in, and the norm's output as a by-product."""
    xn = new_output(tuple(x.shape), x.dtype, x.device)
    return decode_linear(x, weight, None, None, norm_weight=norm_weight, eps=eps, x_out=xn), xn


@_decode_norm_linear_x_op.register_fake
def _(x, norm_weight, eps, weight):
    return x.new_empty((x.shape[0], weight.shape[0])), torch.empty_like(x)
