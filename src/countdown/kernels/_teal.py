"""Triton kernels of TEAL's Gated-MLP: gate and up GEMVs over the kept input entries, then s.

Stage 1, input-sparse GEMVs of W_gate^T and W_up^T ([d_model, d_inter], unit inner stride, any row
stride: a kept input channel j is one contiguous row of each)::

    acc[b, i]           += sum_{j : |x[b, j]| > tau_x} x[b, j] W_gate^T[j, i]      (gate, fp32)
    acc[b, d_inter + i] += sum_{j : |x[b, j]| > tau_x} x[b, j] W_up^T[j, i]        (up, fp32)

Grid (chunk of CHUNK input channels, column block of BLOCK_N, token group of BP). A program compacts
the kept channels of its chunk (union over its tokens: a prefix sum, then a [BLOCK_M, CHUNK] one-hot
select), loads [BLOCK_M, BLOCK_N] tiles of *kept* rows of both matrices (one round trip for the
two), multiplies them by each token's own masked x, and adds its partial sums to the zeroed fp32
accumulator with relaxed atomics (the chunks' order of summation varies, as in ``_down.py``).

Stage 2 (``_teal_finish_kernel``): ``s = up * act(gate)`` in fp32, ``s`` kept where ``|s| > tau_s``
(else 0) and written in x's dtype; on the way it clears the down projection's fp32 accumulator. The
down projection over the kept s entries is then ``_down.sparse_down`` (s != 0 is its keep mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import act_code
from ._down import DownPlan, sparse_down
from ._glu import _act


@triton.jit
def _teal_gateup_kernel(
    X, WG, WU, THR, ACC,
    thr_f, n_tok, d_model, d_inter, stride_x, stride_wg, stride_wu,
    THR_PTR: tl.constexpr, BP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_N: tl.constexpr,
    BIG: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2) * BP + tl.arange(0, BP)
    bmask = b < n_tok
    bi = tl.arange(0, BP)
    r = pid_c * CHUNK + tl.arange(0, CHUNK)  # input channels of this chunk
    m2 = bmask[:, None] & (r < d_model)[None, :]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < d_inter
    if THR_PTR:
        thr = tl.load(THR).to(tl.float32)
    else:
        thr = thr_f

    xv = tl.load(X + b[:, None] * stride_x + r[None, :], mask=m2, other=0.0).to(tl.float32)
    keep = (tl.abs(xv) > thr) & m2
    anyk = tl.max(keep.to(tl.int32), axis=0)
    cnt = tl.sum(anyk, axis=0)
    pos = tl.where(anyk > 0, tl.cumsum(anyk, axis=0) - 1, -1)

    acc_g = tl.zeros([BP, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BP, BLOCK_N], dtype=tl.float32)
    for t in range(0, cnt, BLOCK_M):
        m = t + tl.arange(0, BLOCK_M)
        valid = m < cnt
        rows = tl.sum(tl.where(pos[None, :] == m[:, None], r[None, :], 0), axis=1)  # kept channels [BLOCK_M]
        if BIG:
            rows = rows.to(tl.int64)
        if EVEN_N:
            wmask = valid[:, None]
        else:
            wmask = valid[:, None] & nmask[None, :]
        mt = bmask[:, None] & valid[None, :]
        xt = tl.load(X + b[:, None] * stride_x + rows[None, :], mask=mt, other=0.0)  # [BP, BLOCK_M]
        wg = tl.load(WG + rows[:, None] * stride_wg + n[None, :], mask=wmask, other=0.0)
        wu = tl.load(WU + rows[:, None] * stride_wu + n[None, :], mask=wmask, other=0.0)
        # each token's own mask: a channel another token of the group keeps adds nothing here
        xt = tl.where(tl.abs(xt.to(tl.float32)) > thr, xt, 0.0)
        if USE_DOT:
            if DOT_PREC == "ieee":  # fp32 inputs, or bf16 under the interpreter (its bf16 dot is wrong)
                acc_g += tl.dot(xt.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
                acc_u += tl.dot(xt.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
            else:
                acc_g += tl.dot(xt.to(wg.dtype), wg)
                acc_u += tl.dot(xt.to(wu.dtype), wu)
        else:
            xf = xt.to(tl.float32)
            wgf = wg.to(tl.float32)
            wuf = wu.to(tl.float32)
            for j in tl.static_range(BP):
                if BP == 1:
                    xj = tl.trans(xf)  # [BLOCK_M, 1]
                else:
                    xj = tl.sum(tl.where(bi[:, None] == j, xf, 0.0), axis=0)[:, None]
                pg = tl.sum(wgf * xj, axis=0)
                pu = tl.sum(wuf * xj, axis=0)
                if BP == 1:
                    acc_g += pg[None, :]
                    acc_u += pu[None, :]
                else:
                    acc_g = tl.where(bi[:, None] == j, acc_g + pg[None, :], acc_g)
                    acc_u = tl.where(bi[:, None] == j, acc_u + pu[None, :], acc_u)
    if cnt > 0:
        bn = bmask[:, None] & nmask[None, :]
        off = b[:, None] * (2 * d_inter) + n[None, :]
        tl.atomic_add(ACC + off, acc_g, mask=bn, sem="relaxed")
        tl.atomic_add(ACC + off + d_inter, acc_u, mask=bn, sem="relaxed")


@triton.jit
def _teal_finish_kernel(ACC, THR, S, YACC, thr_f, n_tok, d_inter, n_y,
                        ACT: tl.constexpr, THR_PTR: tl.constexpr, BLOCK: tl.constexpr, ZERO: tl.constexpr,
                        ZBLK: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    if ZERO:  # clear the down projection's accumulator (it runs after this kernel)
        if b == 0:
            z = pid * ZBLK + tl.arange(0, ZBLK)
            tl.store(YACC + z, tl.zeros([ZBLK], dtype=tl.float32), mask=z < n_y)
    if THR_PTR:
        thr = tl.load(THR).to(tl.float32)
    else:
        thr = thr_f
    i = pid * BLOCK + tl.arange(0, BLOCK)
    imask = i < d_inter
    g = tl.load(ACC + b * (2 * d_inter) + i, mask=imask, other=0.0)
    u = tl.load(ACC + b * (2 * d_inter) + d_inter + i, mask=imask, other=0.0)
    s = u * _act(g, ACT)
    s = tl.where(tl.abs(s) > thr, s, 0.0)
    tl.store(S + b * d_inter + i, s.to(S.dtype.element_ty), mask=imask)


# By batch bucket (1 token; 2-16 tokens). Not yet swept on the device: starting points from _down.py's
# measured configurations with half the columns (two matrices per tile).
TEAL_CONFIGS = {
    1: dict(CHUNK=128, BLOCK_M=16, BLOCK_N=256, USE_DOT=False, num_warps=4, num_stages=1),
    16: dict(CHUNK=256, BLOCK_M=16, BLOCK_N=128, USE_DOT=True, num_warps=4, num_stages=3),
}
FINISH_BLOCK = 1024


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


LAST_KERNEL = None


def teal_gateup(x, w_gate_t, w_up_t, thr_t, thr_f, config: dict | None = None) -> torch.Tensor:
    """Stage 1: the fp32 accumulator ``[n_tok, 2 d_inter]`` (gate, then up) of the kept x entries."""
    global LAST_KERNEL
    n_tok, d_model = x.shape
    d_inter = w_gate_t.shape[1]
    cfg = {**TEAL_CONFIGS[1 if n_tok == 1 else 16], **(config or {})}
    use_dot = bool(cfg["USE_DOT"])
    bp = max(16, _pow2(min(n_tok, 16))) if use_dot else _pow2(min(n_tok, 16))
    block_m = max(16, cfg["BLOCK_M"]) if use_dot else cfg["BLOCK_M"]
    block_n = min(cfg["BLOCK_N"], max(16, _pow2(d_inter)))
    chunk = min(cfg["CHUNK"], max(16, _pow2(d_model)))
    acc = torch.zeros((n_tok, 2 * d_inter), dtype=torch.float32, device=x.device)
    thr_arg = thr_t if thr_t is not None else acc
    cpu_bf16 = x.device.type == "cpu" and x.dtype == torch.bfloat16 and _common.interpreting()
    grid = (triton.cdiv(d_model, chunk), triton.cdiv(d_inter, block_n), triton.cdiv(n_tok, bp))
    LAST_KERNEL = _teal_gateup_kernel[grid](
        x, w_gate_t, w_up_t, thr_arg, acc,
        float(thr_f), n_tok, d_model, d_inter, x.stride(0), w_gate_t.stride(0), w_up_t.stride(0),
        THR_PTR=thr_t is not None, BP=bp, CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=block_n, USE_DOT=use_dot,
        DOT_PREC="ieee" if (x.dtype == torch.float32 or cpu_bf16) else "default",
        EVEN_N=d_inter % block_n == 0,
        BIG=d_model * max(w_gate_t.stride(0), w_up_t.stride(0)) >= 2**31,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return acc


def teal_mlp(x, w_gate_t, w_up_t, w_down_t, thr_x_t, thr_x_f, thr_s_t, thr_s_f, activation: str,
             config: dict | None = None) -> torch.Tensor:
    """y ``[n_tok, d_model]`` in x's dtype: stage 1, stage 2, then the sparse down projection."""
    n_tok, d_model = x.shape
    d_inter = w_gate_t.shape[1]
    x = x.contiguous()
    acc = teal_gateup(x, w_gate_t, w_up_t, thr_x_t, thr_x_f, config)
    plan = DownPlan(n_tok, d_inter, d_model)
    work = plan.workspace(x.device, zeroed=False) if plan.atomic else None
    # The interpreter truncates fp32 -> bf16 (GPUs round): there s is kept in fp32 and PyTorch rounds it.
    cpu_bf16 = x.device.type == "cpu" and x.dtype == torch.bfloat16 and _common.interpreting()
    s = _common.new_output((n_tok, d_inter), torch.float32 if cpu_bf16 else x.dtype, x.device)
    block = min(FINISH_BLOCK, max(16, _pow2(d_inter)))
    grid = (triton.cdiv(d_inter, block), n_tok)
    n_y = work.numel() if work is not None else 0
    _teal_finish_kernel[grid](
        acc, thr_s_t if thr_s_t is not None else acc, s, work if work is not None else acc,
        float(thr_s_f), n_tok, d_inter, n_y,
        ACT=act_code(activation), THR_PTR=thr_s_t is not None, BLOCK=block, ZERO=work is not None,
        ZBLK=_pow2(max(1, triton.cdiv(max(n_y, 1), grid[0]))), num_warps=4,
    )
    return sparse_down(s.to(x.dtype), None, w_down_t, plan=plan, workspace=work)
