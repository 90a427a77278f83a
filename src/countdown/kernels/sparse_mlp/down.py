"""Triton kernel: the down projection over kept rows only.

    y[b, :] = sum_{i : keep[b, i]} s[b, i] * w_down_t[i, :]        (fp32 accumulation, y in s's dtype)

w_down_t is W_down transposed ([d_inter, d_model], contiguous), so a kept row is one contiguous
d_model-long run. keep is given as a mask, or taken as s != 0 (what the gate / up kernel writes).

Grid (chunk of CHUNK rows, column block of BLOCK_N, token group of BP). A program compacts the kept
rows of its chunk (union over its tokens) like the gate / up kernel (chain.py), runs [BLOCK_M, BLOCK_N] tiles
of kept rows and reduces over chunks with fp32 atomics into an accumulator [n_tok, d_model] that the gate / up
kernel just before cleared (or torch.zeros for the op alone), then a cast to s's dtype (summation order varies).

The cast is a launch of its own on purpose. A single-launch version (the last program of a column block to
bump an arrival counter writes y) was measured and raced on the GPU: bar.sync plus one thread's acq_rel
atomic does not order the other threads' in-flight atomics and stores before the counter, so the last
program could read an incomplete sum.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import interpreting, new_output, pow2
from ..config import launch_config, launching


@triton.jit
def down_kernel(
    S, KEEP, W, P,
    n_tok, d_inter, d_model,
    stride_s, stride_keep,
    HAS_KEEP: tl.constexpr, BP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_N: tl.constexpr,
    BIG: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2)
    tok0 = pid_b * BP
    b = tok0 + tl.arange(0, BP)
    bmask = b < n_tok
    bi = tl.arange(0, BP)
    r = pid_c * CHUNK + tl.arange(0, CHUNK)
    m2 = bmask[:, None] & (r < d_inter)[None, :]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < d_model

    if HAS_KEEP:
        keep = tl.load(KEEP + b[:, None] * stride_keep + r[None, :], mask=m2, other=0) != 0
    else:
        keep = tl.load(S + b[:, None] * stride_s + r[None, :], mask=m2, other=0.0) != 0.0
    anyk = tl.max((keep & m2).to(tl.int32), axis=0)
    cnt = tl.sum(anyk, axis=0)
    pos = tl.where(anyk > 0, tl.cumsum(anyk, axis=0) - 1, -1)

    acc = tl.zeros([BP, BLOCK_N], dtype=tl.float32)
    for t in range(0, cnt, BLOCK_M):
        m = t + tl.arange(0, BLOCK_M)
        valid = m < cnt
        rows = tl.sum(tl.where(pos[None, :] == m[:, None], r[None, :], 0), axis=1)
        if BIG:
            roff = rows.to(tl.int64) * d_model
        else:
            roff = rows * d_model
        if EVEN_N:
            wmask = valid[:, None]
        else:
            wmask = valid[:, None] & nmask[None, :]
        mt = bmask[:, None] & valid[None, :]
        st = tl.load(S + b[:, None] * stride_s + rows[None, :], mask=mt, other=0.0)  # [BP, BLOCK_M]
        if HAS_KEEP:
            kt = tl.load(KEEP + b[:, None] * stride_keep + rows[None, :], mask=mt, other=0)
        w = tl.load(W + roff[:, None] + n[None, :], mask=wmask, other=0.0)
        if HAS_KEEP:
            st = tl.where(kt != 0, st, 0.0)
        if USE_DOT:
            if DOT_PREC == "ieee":  # fp32 inputs, or bf16 under the interpreter (its bf16 dot is wrong)
                acc += tl.dot(st.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(st, w)
        else:
            wf = w.to(tl.float32)
            sf = st.to(tl.float32)
            for j in tl.static_range(BP):
                if BP == 1:
                    sj = tl.trans(sf)  # [BLOCK_M, 1]
                else:
                    sj = tl.sum(tl.where(bi[:, None] == j, sf, 0.0), axis=0)[:, None]
                part = tl.sum(wf * sj, axis=0)
                if BP == 1:
                    acc += part[None, :]
                else:
                    acc = tl.where(bi[:, None] == j, acc + part[None, :], acc)

    bn = bmask[:, None] & nmask[None, :]
    if cnt > 0:
        tl.atomic_add(P + b[:, None] * d_model + n[None, :], acc, mask=bn, sem="relaxed")


class DownPlan:
    """Launch geometry of one down projection, known before the gate / up kernel runs so that it can clear
    the accumulator (``workspace``) for it. Launch configuration by token bucket (1 token; 2-16),
    config.LAUNCH["chain_down"]."""

    def __init__(self, n_tok, d_inter, d_model, per_token=False, config=None, device=None):
        cfg = launch_config("chain_down", device, 1 if n_tok == 1 else 16, config)
        self.cfg = cfg
        self.use_dot = bool(cfg["USE_DOT"]) and not per_token
        if per_token:
            self.bp = 1
        elif self.use_dot:
            self.bp = max(16, pow2(min(n_tok, 16)))
        else:
            self.bp = pow2(min(n_tok, 16))
        self.block_m = cfg["BLOCK_M"] if not self.use_dot else max(16, cfg["BLOCK_M"])
        self.block_n = min(cfg["BLOCK_N"], max(16, pow2(d_model)))
        self.chunk = min(cfg["CHUNK"], max(16, pow2(d_inter)))
        self.n_chunks = triton.cdiv(d_inter, self.chunk)
        self.grid = (self.n_chunks, triton.cdiv(d_model, self.block_n), triton.cdiv(n_tok, self.bp))
        self.n_tok, self.d_inter, self.d_model = n_tok, d_inter, d_model

    def workspace(self, device, zeroed: bool) -> torch.Tensor:
        """The fp32 accumulator [n_tok, d_model]: zeroed here, or left for the gate / up kernel that runs just
        before to clear (poisoned in tests, to prove it does)."""
        if zeroed:
            return torch.zeros((self.n_tok, self.d_model), dtype=torch.float32, device=device)
        return new_output((self.n_tok, self.d_model), torch.float32, device)


def sparse_down(s, keep, w_down_t, per_token: bool = False, config: dict | None = None,
                plan: DownPlan | None = None, workspace=None):
    """y [n_tok, d_model] in s's dtype. ``workspace`` (from ``plan.workspace``) must be zeroed: by the gate / up
    kernel that ran before (its ZERO), else it is made here with torch.zeros. (Spy hook: ``on_launch("chain_down",
    s)``.)"""
    n_tok, d_inter = s.shape
    d_model = w_down_t.shape[1]
    if plan is None:
        plan = DownPlan(n_tok, d_inter, d_model, per_token, config, s.device)
    s = s.contiguous()
    w_down_t = w_down_t.contiguous()
    if keep is not None:
        keep = keep.contiguous()
        if keep.dtype == torch.bool:
            keep = keep.view(torch.uint8)
    part = workspace if workspace is not None else plan.workspace(s.device, zeroed=True)
    # The interpreter truncates fp32 -> bf16: there, reduce in fp32 and let PyTorch round (see chain.py).
    cpu_bf16 = s.device.type == "cpu" and s.dtype == torch.bfloat16 and interpreting()
    launching("chain_down", s)
    down_kernel[plan.grid](
        s, keep if keep is not None else s, w_down_t, part,
        n_tok, d_inter, d_model,
        s.stride(0), keep.stride(0) if keep is not None else 0,
        HAS_KEEP=keep is not None, BP=plan.bp, CHUNK=plan.chunk, BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, USE_DOT=plan.use_dot,
        DOT_PREC="ieee" if (s.dtype == torch.float32 or cpu_bf16) else "default",
        EVEN_N=d_model % plan.block_n == 0, BIG=d_inter * d_model >= 2**31,
        num_warps=plan.cfg["num_warps"], num_stages=plan.cfg["num_stages"],
    )
    return part.to(s.dtype)


@torch.library.custom_op("countdown::sparse_down_proj", mutates_args=())
def _sparse_down_proj_op(s: torch.Tensor, keep: Optional[torch.Tensor], w_down_t: torch.Tensor,
                         per_token: bool) -> torch.Tensor:
    return sparse_down(s, keep, w_down_t, per_token=per_token)


@_sparse_down_proj_op.register_fake
def _(s, keep, w_down_t, per_token):
    return s.new_empty((s.shape[0], w_down_t.shape[1]))
