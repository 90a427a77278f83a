"""Triton kernels: attention of one query token over a (static) KV cache, split along the keys.

Why: one query token gives one row per head, too little work per head to fill the GPU, so a decode
step's attention is latency-bound far from its bytes; the keys are therefore split ("flash decoding").
Each program of ``split_kernel`` takes one (batch row, KV head, split of the keys) and the G = heads /
KV heads query heads that share that KV head, padded to 16 rows so that both products are tensor-core
``tl.dot`` s; the split's keys and values are read once, BLOCK_N positions at a time, with an online
softmax in fp32 (base 2)::

    s[g, t] = scale * q[g] . k[t] + bias[t]       (bias: 0 / -inf from a boolean mask, or additive)
    m[g] = max_t s[g, t],   l[g] = sum_t exp(s - m),   o[g] = sum_t exp(s - m) v[t]     per split

With SKIP_MASKED, keys whose mask is False (or whose bias is -inf) are not read at all: with a
static cache only the valid prefix costs bandwidth; without it the K/V loads need not wait for the
mask (one memory latency less a block) and masked keys are read but not counted. The number of splits follows from the cache length and the SM count
(about PER_SM programs per SM, splits a multiple of BLOCK_N keys). One split writes the output
directly; several write fp32 partials that ``combine_kernel`` merges per (batch, head)::

    o = sum_c exp(m_c - m) o_c / sum_c exp(m_c - m) l_c,      m = max_c m_c

A query whose every key is masked gives 0 (PyTorch's SDPA gives NaN there; no decode step has one).
No host synchronisation: the launch depends on shapes only (CUDA-graph and torch.compile safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import interpreting, new_output, pow2
from ..config import launch_config, launching, persistent_programs

# Launch configuration: config.LAUNCH["attention"] (BLOCK_N keys per step; PER_SM programs per SM aimed for;
# MAX_SPLITS caps the partials, the combine loads them all at once; SPLITS forces a number of splits; SKIP_MASKED:
# K/V loads wait for the mask and skip masked keys, False: they read every key of the split without waiting).
LOG2E = 1.4426950408889634


@triton.jit
def split_kernel(Q, K, V, MASK, OUT, P, qk_scale, T, split_len,
                  sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sm_b, sm_t, so_b, so_h,
                  G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr,
                  BOOL_MASK: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr, NUM_STAGES: tl.constexpr,
                  SKIP_MASKED: tl.constexpr):
    sp = tl.program_id(0)  # split of the keys
    hk = tl.program_id(1)  # KV head
    b = tl.program_id(2)   # batch row
    n_splits = tl.num_programs(0)
    H = tl.num_programs(1) * G
    gi = tl.arange(0, GP)
    di = tl.arange(0, BD)
    gm = gi < G
    dm = di < D
    h = hk * G + gi
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + di[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    m, lsum, acc = attend_split(q, K, V, MASK, b, hk, sp, split_len, T, -1, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                                sm_b, sm_t, qk_scale, di, dm, GP, BD, BLOCK_N, BOOL_MASK, IEEE, NUM_STAGES, SKIP_MASKED)
    if DIRECT:  # one split: this is the answer
        out = tl.where(lsum[:, None] > 0, acc / tl.where(lsum > 0, lsum, 1.0)[:, None], 0.0)
        tl.store(OUT + b * so_b + h[:, None] * so_h + di[None, :], out.to(OUT.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])
    else:
        store_partials(P, acc, m, lsum, b, h, gm, sp, n_splits, H, di, BD)


@triton.jit
def store_partials(P, acc, m, lsum, b, h, gm, sp, n_splits, H, di, BD: tl.constexpr):
    """One split's softmax state of its query rows ``h`` into the partials buffer; shared with
    rope_attention.py."""
    row = (b * H + h) * n_splits + sp  # [GP] partial rows, (batch, head, split) order
    n_rows = tl.num_programs(2) * H * n_splits  # P: o [n_rows, BD], then m [n_rows], then l [n_rows]
    tl.store(P + row[:, None] * BD + di[None, :], acc, mask=gm[:, None])
    tl.store(P + n_rows * BD + row, m, mask=gm)
    tl.store(P + n_rows * (BD + 1) + row, lsum, mask=gm)


@triton.jit
def attend_split(q, K, V, MASK, b, hk, sp, split_len, T, skip, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sm_b, sm_t,
                 qk_scale, di, dm, GP: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BOOL_MASK: tl.constexpr, IEEE: tl.constexpr, NUM_STAGES: tl.constexpr, SKIP_MASKED: tl.constexpr):
    """The softmax state (m, lsum, acc) of the GP query rows ``q`` over split ``sp`` of batch row ``b``'s
    keys of KV head ``hk`` (every key but ``t == skip``); shared with rope_attention.py."""
    k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
    v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
    m_base = MASK + b.to(tl.int64) * sm_b
    start = sp * split_len
    end = tl.minimum(start + split_len, T)
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, BD], dtype=tl.float32)
    for t0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        t = t0 + tl.arange(0, BLOCK_N)
        tm = t < end
        if BOOL_MASK:
            keep = tl.load(m_base + t * sm_t, mask=tm, other=0) != 0
        else:
            bias = tl.load(m_base + t * sm_t, mask=tm, other=float("-inf")).to(tl.float32) * 1.4426950408889634
            keep = bias != float("-inf")
        keep = keep & (t != skip)
        if BOOL_MASK:
            bias = tl.where(keep, 0.0, float("-inf"))
        else:
            bias = tl.where(keep, bias, float("-inf"))
        if SKIP_MASKED:
            kv_m = keep[:, None] & dm[None, :]
        else:
            kv_m = tm[:, None] & dm[None, :]
        tt = t.to(tl.int64)
        k = tl.load(k_base + tt[:, None] * sk_t + di[None, :], mask=kv_m, other=0.0)
        v = tl.load(v_base + tt[:, None] * sv_t + di[None, :], mask=kv_m, other=0.0)
        if IEEE:  # float32 inputs, or the interpreter (whose bf16 tl.dot is wrong): products in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale + bias[None, :]                                   # [GP, BLOCK_N], base 2
        if not SKIP_MASKED:  # masked keys were read: whatever they hold (NaN too) must not count
            s = tl.where(keep[None, :], s, float("-inf"))
            v = tl.where(keep[:, None], v, 0.0)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN from -inf - -inf
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, lsum, acc


@triton.jit
def combine_kernel(P, OUT, n_splits, so_b, so_h, H, n_rows, D: tl.constexpr, BD: tl.constexpr, CB: tl.constexpr):
    combine_partials(P, OUT, tl.program_id(0), n_splits, so_b, so_h, H, n_rows, D, BD, CB)


@triton.jit
def combine_partials(P, OUT, bh, n_splits, so_b, so_h, H, n_rows, D: tl.constexpr, BD: tl.constexpr,
                     CB: tl.constexpr):
    """The merge of one (batch row, head) ``bh``'s n_splits partials, shared with rope_attention.py."""
    b = bh // H
    di = tl.arange(0, BD)
    ci = tl.arange(0, CB)
    cm = ci < n_splits
    rows = bh * n_splits + ci
    m = tl.load(P + n_rows * BD + rows, mask=cm, other=float("-inf"))
    lsum = tl.load(P + n_rows * (BD + 1) + rows, mask=cm, other=0.0)
    o = tl.load(P + rows[:, None] * BD + di[None, :], mask=cm[:, None], other=0.0)
    mref = tl.max(m, axis=0)
    mref = tl.where(mref == float("-inf"), 0.0, mref)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mref))
    total = tl.sum(w * lsum, axis=0)
    num = tl.sum(w[:, None] * o, axis=0)
    out = tl.where(total > 0, num / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(OUT + b * so_b + (bh - b * H) * so_h + di, out.to(OUT.dtype.element_ty), mask=di < D)


def plan_splits(B: int, KVH: int, T: int, device, config: dict | None = None) -> tuple[int, int]:
    """``(split_len, n_splits)``: keys per split (a multiple of BLOCK_N) and splits, so that the
    B x KVH x n_splits programs come to about PER_SM per SM (8 in all under the interpreter), each
    split holding at least BLOCK_N keys and at most MAX_SPLITS splits; every split is non-empty."""
    cfg = launch_config("attention", device, extra=config)
    block = cfg["BLOCK_N"]
    n_blocks = triton.cdiv(max(T, 1), block)
    want = cfg["SPLITS"] or triton.cdiv(persistent_programs(device, cfg["PER_SM"], cfg.get("PROGRAMS", 0)), B * KVH)
    want = max(1, min(want, n_blocks, cfg["MAX_SPLITS"]))
    split_len = triton.cdiv(n_blocks, want) * block
    return split_len, triton.cdiv(max(T, 1), split_len)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     config: dict | None = None) -> torch.Tensor:
    """q [B, H, 1, D]; k, v [B, KVH, T, D] (any strides, unit last stride); mask [B, T], any strides:
    bool (True: attend) or an additive float mask (0 / -inf, or any values); H a multiple of KVH.
    Returns [B, H, 1, D] in q's dtype, contiguous. (Spy hook: ``on_launch("attention", q, k, v, mask)``.)"""
    cfg = launch_config("attention", q.device, extra=config)
    B, H, n_q, D = q.shape
    _, KVH, T, Dk = k.shape
    if n_q != 1 or Dk != D or v.shape != k.shape or k.shape[0] != B or KVH == 0 or H % KVH:
        raise ValueError(f"decode attention takes q [B, H, 1, D] and k, v [B, KVH, T, D] with KVH dividing H; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if mask.shape != (B, T) or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        raise ValueError(f"mask must be bool or float [B, T] = [{B}, {T}], got {mask.dtype} {tuple(mask.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    G = H // KVH
    BD = max(16, pow2(D))
    split_len, n_splits = plan_splits(B, KVH, T, q.device, config)
    out = new_output((B, H, 1, D), q.dtype, q.device)
    n_rows = B * H * n_splits
    part = new_output((n_rows * (BD + 2),), torch.float32, q.device) if n_splits > 1 else out
    launching("attention", q, k, v, mask)
    split_kernel[(n_splits, KVH, B)](
        q, k, v, mask, out, part, float(scale) * LOG2E, T, split_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), mask.stride(1), out.stride(0), out.stride(1),
        G=G, D=D, BD=BD, GP=max(16, pow2(G)), BLOCK_N=cfg["BLOCK_N"], BOOL_MASK=mask.dtype == torch.uint8,
        IEEE=q.dtype == torch.float32 or interpreting(), DIRECT=n_splits == 1, NUM_STAGES=cfg["num_stages"],
        SKIP_MASKED=bool(cfg["SKIP_MASKED"]), num_warps=cfg["num_warps"])
    if n_splits > 1:
        cb = max(2, pow2(n_splits))
        combine_kernel[(B * H,)](part, out, n_splits, out.stride(0), out.stride(1), H, n_rows, D=D, BD=BD, CB=cb,
                                  num_warps=4 if cb <= 32 else 8)
    return out
