"""The chain (more than 8 tokens, and the masked op): the gate / up kernel of kept rows, then the masked down
projection (down.py). This file: the gate / up kernel, its launcher, the chain and its op.

For every token b and row i of d_inter:

    s[b, i] = up[b, i] * act(gate[b, i])   if keep[b, i]   else 0

gate and up are computed here for kept rows only (``gate = x W_gate^T``, ``up = x W_up^T``, fp32
accumulation) or, for the one that is the indicator, read from ``ind`` (mono: ind = u, cats: ind = g).
keep[b, i] comes from the indicator by the keep rule (jit_helpers.KEEP_RULES): mask (ind != 0, dual with
its mask given), gt (ind > thr: a predictor's scores and a cut), abs (|ind| > thr: mono), abs_act
(|act(ind)| > thr: cats). The indicator is a tensor written before the launch (the chain op computes it:
PyTorch's dense GEMV for u or g, the predictor's scores, or the mask).

One program owns CHUNK consecutive rows. It takes the union of their kept rows over its token group,
compacts them in registers (prefix sum, then a [BLOCK_M, CHUNK] one-hot select) and runs GEMVs over
tiles of BLOCK_M *kept* rows, so every weight byte it loads is a kept row (the paper's kernel loads
masked [BLOCK_M, BLOCK_N] tiles of all rows: at k = 0.9, 90% of each tile's registers sit idle and
the kernel is latency-bound). BLOCK_K >= d_model loads whole rows in one go: one DRAM round trip per
tile. Rows no token keeps get s = 0: every element of s is written exactly once.

Tokens go in groups of BP (grid axis 1): BP >= n_tok loads the union of the batch's rows once and
applies each token's mask in the epilogue; BP = 1 ("per token") loads each token's own rows.

With ZERO the programs also clear the down projection's fp32 accumulator (down.py), which saves a
memset launch in the chain. With COUNT each program adds the rows its tokens keep to the caller's
Sparsity-Real counters (jit_helpers.add_count).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import act_code, counters, interpreting, new_output, op_count, pow2
from ..config import launch_config, launching
from ..jit_helpers import KEEP_RULES, act, add_count, keep
from .reference import dual_scores


@triton.jit
def _gemv_rows(V, stride_v, tok0, n_tok, WA, WB, roff, valid, K,
               TWO: tl.constexpr, BP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_K: tl.constexpr):
    """acc_a[b, m] = sum_k v[tok0 + b, k] WA[row m, k] (and acc_b with WB when TWO), fp32.

    Rows are at offsets ``roff`` (elements); each K step issues every load (v, WA, WB) before any
    arithmetic, so the two matrices of D-CountDown cost one round trip, not two."""
    acc_a = tl.zeros([BP, BLOCK_M], dtype=tl.float32)
    acc_b = tl.zeros([BP, BLOCK_M], dtype=tl.float32)
    b = tok0 + tl.arange(0, BP)
    bi = tl.arange(0, BP)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            wmask = valid[:, None]
            vmask = (b < n_tok)[:, None]
        else:
            wmask = valid[:, None] & (kk < K)[None, :]
            vmask = (b < n_tok)[:, None] & (kk < K)[None, :]
        vt = tl.load(V + b[:, None] * stride_v + kk[None, :], mask=vmask, other=0.0)
        wa = tl.load(WA + roff[:, None] + kk[None, :], mask=wmask, other=0.0)
        if TWO:
            wb = tl.load(WB + roff[:, None] + kk[None, :], mask=wmask, other=0.0)
        if USE_DOT:
            if DOT_PREC == "ieee":  # fp32 inputs, or bf16 under the interpreter (its bf16 dot is wrong)
                acc_a += tl.dot(vt.to(tl.float32), tl.trans(wa.to(tl.float32)), input_precision="ieee")
                if TWO:
                    acc_b += tl.dot(vt.to(tl.float32), tl.trans(wb.to(tl.float32)), input_precision="ieee")
            else:
                acc_a += tl.dot(vt, tl.trans(wa))
                if TWO:
                    acc_b += tl.dot(vt, tl.trans(wb))
        else:
            vf = vt.to(tl.float32)
            for j in tl.static_range(BP):
                if BP == 1:
                    vj = vf
                else:
                    vj = tl.sum(tl.where(bi[:, None] == j, vf, 0.0), axis=0)[None, :]
                pa = tl.sum(wa.to(tl.float32) * vj, axis=1)
                if BP == 1:
                    acc_a += pa[None, :]
                else:
                    acc_a = tl.where(bi[:, None] == j, acc_a + pa[None, :], acc_a)
                if TWO:
                    pb = tl.sum(wb.to(tl.float32) * vj, axis=1)
                    if BP == 1:
                        acc_b += pb[None, :]
                    else:
                        acc_b = tl.where(bi[:, None] == j, acc_b + pb[None, :], acc_b)
    return acc_a, acc_b


@triton.jit
def gate_up_kernel(
    X, WG, WU, IND, THR, S, YACC, KEPT, ROWS,
    thr_f, n_tok, d_model, d_inter, n_y,
    stride_x, stride_ind, stride_s,
    MODE: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr,
    THR_PTR: tl.constexpr, THR_VEC: tl.constexpr, BP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_K: tl.constexpr,
    BIG: tl.constexpr, ZERO: tl.constexpr, ZBLK: tl.constexpr, COUNT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    tok0 = tl.program_id(1) * BP
    if ZERO:  # clear the down projection's accumulator (it runs after this kernel)
        if tl.program_id(1) == 0:
            z = pid * ZBLK + tl.arange(0, ZBLK)
            tl.store(YACC + z, tl.zeros([ZBLK], dtype=tl.float32), mask=z < n_y)
    b = tok0 + tl.arange(0, BP)
    bmask = b < n_tok
    r = pid * CHUNK + tl.arange(0, CHUNK)
    rmask = r < d_inter
    if THR_VEC:  # one threshold per row, [1, CHUNK]
        thr = tl.load(THR + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    elif THR_PTR:
        thr = tl.load(THR).to(tl.float32)
    else:
        thr = thr_f

    m2 = bmask[:, None] & rmask[None, :]
    ind = tl.load(IND + b[:, None] * stride_ind + r[None, :], mask=m2, other=0)
    kp = keep(ind, thr, MODE, ACT) & m2
    if COUNT:  # each token's own kept rows; the rows of the whole call once
        add_count(KEPT, ROWS, tl.sum(tl.sum(kp.to(tl.int32), axis=1), axis=0), n_tok * d_inter,
                  (pid == 0) & (tl.program_id(1) == 0))
    anyk = tl.max(kp.to(tl.int32), axis=0)  # union over the token group, [CHUNK]
    cnt = tl.sum(anyk, axis=0)
    pos = tl.where(anyk > 0, tl.cumsum(anyk, axis=0) - 1, -1)

    zero = tl.zeros([BP, CHUNK], dtype=S.dtype.element_ty)
    tl.store(S + b[:, None] * stride_s + r[None, :], zero, mask=m2 & (anyk == 0)[None, :])

    for t in range(0, cnt, BLOCK_M):
        m = t + tl.arange(0, BLOCK_M)
        valid = m < cnt
        rows = tl.sum(tl.where(pos[None, :] == m[:, None], r[None, :], 0), axis=1)  # kept rows, [BLOCK_M]
        if BIG:
            roff = rows.to(tl.int64) * d_model
        else:
            roff = rows * d_model
        mt = bmask[:, None] & valid[None, :]
        it = tl.load(IND + b[:, None] * stride_ind + rows[None, :], mask=mt, other=0)
        if GATE and UP:
            g, u = _gemv_rows(X, stride_x, tok0, n_tok, WG, WU, roff, valid, d_model,
                              True, BP, BLOCK_M, BLOCK_K, USE_DOT, DOT_PREC, EVEN_K)
        elif GATE:
            g, _unused = _gemv_rows(X, stride_x, tok0, n_tok, WG, WG, roff, valid, d_model,
                                    False, BP, BLOCK_M, BLOCK_K, USE_DOT, DOT_PREC, EVEN_K)
            u = it.to(tl.float32)
        else:
            u, _unused = _gemv_rows(X, stride_x, tok0, n_tok, WU, WU, roff, valid, d_model,
                                    False, BP, BLOCK_M, BLOCK_K, USE_DOT, DOT_PREC, EVEN_K)
            g = it.to(tl.float32)
        if THR_VEC:
            thr_m = tl.load(THR + rows, mask=valid, other=0.0).to(tl.float32)[None, :]
        else:
            thr_m = thr
        kt = keep(it, thr_m, MODE, ACT) & mt
        s = tl.where(kt, u * act(g, ACT), 0.0)
        tl.store(S + b[:, None] * stride_s + rows[None, :], s.to(S.dtype.element_ty), mask=mt)


def gate_up(x, w_gate, w_up, ind, thr_t, thr_f, mode: str, activation: str,
            gate: bool, up: bool, per_token: bool = False, config: dict | None = None, zero=None, count=None):
    """s [n_tok, d_inter] in x's dtype from x [n_tok, d_model] and the indicator ``ind`` [n_tok, d_inter] (``mode``:
    the keep rule). ``zero`` (the down projection's fp32 accumulator) is cleared on the way (see down.py); the
    kept rows are added to ``count`` = (kept, rows) if given. Launch configuration by token bucket (1 token;
    2-16), config.LAUNCH["chain_gate_up"] (BLOCK_K = 0: whole rows in one step). (Spy hook:
    ``on_launch("chain_gate_up", x, mode)``.)"""
    n_tok, d_model = x.shape
    d_inter = w_up.shape[0]
    cfg = launch_config("chain_gate_up", x.device, 1 if n_tok == 1 else 16, config)
    x = x.contiguous()
    ind = ind.contiguous()
    if ind.dtype == torch.bool:
        ind = ind.view(torch.uint8)
    w_gate = w_gate.contiguous()
    w_up = w_up.contiguous()
    # The interpreter truncates fp32 -> bf16 (real GPUs round to nearest even): there, write fp32
    # and let PyTorch round, so CPU tests see the GPU's rounding.
    cpu_bf16 = x.device.type == "cpu" and x.dtype == torch.bfloat16 and interpreting()
    s_dtype = torch.float32 if cpu_bf16 else x.dtype
    s = new_output((n_tok, d_inter), s_dtype, x.device)
    use_dot = bool(cfg["USE_DOT"]) and not per_token
    if per_token:
        bp = 1
    elif use_dot:
        bp = max(16, pow2(min(n_tok, 16)))
    else:
        bp = pow2(min(n_tok, 16))
    chunk = cfg["CHUNK"]
    block_m = cfg["BLOCK_M"] if not use_dot else max(16, cfg["BLOCK_M"])
    if cfg["BLOCK_K"]:
        block_k = min(cfg["BLOCK_K"], max(16, pow2(d_model)))
    else:  # whole rows in one step; fewer rows per tile beyond 4096 columns (registers)
        block_k = max(16, pow2(d_model))
        if not use_dot:
            block_m = max(1, min(block_m, block_m * 4096 // block_k))
    grid = (triton.cdiv(d_inter, chunk), triton.cdiv(n_tok, bp))
    yacc = zero if zero is not None else s
    n_y = zero.numel() if zero is not None else 0
    thr_arg = thr_t if thr_t is not None else s  # any pointer; unused when THR_PTR is False
    thr_vec = thr_t is not None and thr_t.dim() == 1
    if thr_vec and thr_t.numel() != d_inter:
        raise ValueError(f"a per-row threshold needs d_inter={d_inter} values, got {thr_t.numel()}")
    kept, rows = counters(count, x.device)
    launching("chain_gate_up", x, mode)
    gate_up_kernel[grid](
        x, w_gate, w_up, ind, thr_arg, s, yacc, kept if kept is not None else s, rows if rows is not None else s,
        float(thr_f), n_tok, d_model, d_inter, n_y,
        x.stride(0), ind.stride(0), s.stride(0),
        MODE=KEEP_RULES[mode], GATE=gate, UP=up, ACT=act_code(activation),
        THR_PTR=thr_t is not None, THR_VEC=thr_vec, BP=bp, CHUNK=chunk, BLOCK_M=block_m, BLOCK_K=block_k,
        USE_DOT=use_dot, DOT_PREC="ieee" if s_dtype == torch.float32 else "default",
        EVEN_K=d_model % block_k == 0, BIG=d_inter * d_model >= 2**31,
        ZERO=zero is not None, ZBLK=pow2(max(1, triton.cdiv(n_y, grid[0]))), COUNT=kept is not None,
        # fp32 tiles are twice the bytes: half the pipeline depth keeps them within shared memory
        # (4 stages of fp32 [32, 256] tiles need 240 KB, over Hopper's 227 KB).
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"] if x.element_size() <= 2 else max(1, cfg["num_stages"] // 2),
    )
    return s.to(x.dtype)


def chain_mlp(x, w_gate, w_up, w_down_t, *, ind, thr_t=None, thr_f=0.0, mode: str, activation: str, gate: bool,
              up: bool, per_token: bool = False, count=None):
    """The gate / up kernel followed by the masked down projection: the gate / up kernel, the down kernel (fp32
    atomics), a cast to x's dtype. The gate / up kernel clears the down projection's fp32 accumulator on its way,
    so the chain needs no memset, and adds the kept rows to ``count`` = (kept, rows) if given."""
    from .down import DownPlan, sparse_down

    n_tok, d_model = x.shape
    plan = DownPlan(n_tok, w_down_t.shape[0], d_model, per_token, device=x.device)
    work = plan.workspace(x.device, zeroed=False)
    s = gate_up(x, w_gate, w_up, ind, thr_t, thr_f, mode, activation, gate=gate, up=up, per_token=per_token,
                zero=work, count=count)
    return sparse_down(s, None, w_down_t, per_token=per_token, plan=plan, workspace=work)


# (the keep rule is ``rule``, not ``mode``: torch.compile's handling of an op that mutates an argument passes a
# ``mode`` of its own, and an argument of that name collides with it)
@torch.library.custom_op("countdown::sparse_mlp_chain", mutates_args=("kept", "rows"))
def _chain_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
              keep: Optional[torch.Tensor], pred_a: Optional[torch.Tensor], pred_b: Optional[torch.Tensor],
              thr_t: Optional[torch.Tensor], thr_f: float, rule: str, activation: str, per_token: bool,
              kept: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The chain of any number of tokens, its indicator computed here by the keep rule: abs (mono: u = x W_up^T),
    abs_act (cats: g = x W_gate^T), gt (dual: the predictor's scores (x A) B), mask (``keep`` given)."""
    if rule == "mask":
        ind, gate, up = keep, True, True
    elif rule == "gt":
        ind, gate, up = dual_scores(x, pred_a, pred_b), True, True
    else:
        mono = rule == "abs"
        ind, gate, up = x @ (w_up if mono else w_gate).t(), mono, not mono
    return chain_mlp(x, w_gate, w_up, w_down_t, ind=ind, thr_t=thr_t, thr_f=thr_f, mode=rule, activation=activation,
                     gate=gate, up=up, per_token=per_token, count=op_count(kept, rows))


@_chain_op.register_fake
def _(x, w_gate, w_up, w_down_t, keep, pred_a, pred_b, thr_t, thr_f, rule, activation, per_token, kept=None,
      rows=None):
    return torch.empty_like(x)
