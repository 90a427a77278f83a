"""Triton kernels: attention of one query token over a (static) KV cache, split along the keys.

Why: in the compiled dense decode step of a Llama-3.1-8B-shaped model on an H200 (run K,
``decode_meta.json`` profiles) attention took 0.41 ms a step, 12.9 us a layer, for 2.6 MB of keys
and values: the library kernel parallelises over (batch, head) only, 32 programs for one token.
Here the keys are split into chunks of ``CHUNK`` positions ("flash decoding") and every program
takes one (batch, KV head, chunk) with the G = heads / KV heads query heads that share it, so the
cache is read once, by B x KVH x chunks programs::

    s[g, t]   = scale * q[g] . k[t] + bias[t]              (bias: 0 where the mask allows t, -inf elsewhere)
    m[g]      = max_t s[g, t],   l[g] = sum_t exp(s - m),   o[g] = sum_t exp(s - m) v[t]     per chunk

then ``_combine_kernel`` merges the chunks of every (batch, head) with the usual rescaling
(o = sum_c exp(m_c - m) o_c / sum_c exp(m_c - m) l_c) and writes the output in q's dtype. A query
whose every key is masked gives 0 (PyTorch's SDPA gives NaN there; no decode step has one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common

CONFIG = dict(CHUNK=32, BLOCK_T=32, num_warps=4)  # not yet tuned on a GPU


@triton.jit
def _split_kernel(Q, K, V, BIAS, O, M, L, scale, T, n_chunks, G,
                  sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sb_b,
                  D: tl.constexpr, GP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
                  EVEN_D: tl.constexpr, BD: tl.constexpr):
    hk = tl.program_id(0)  # KV head
    c = tl.program_id(1)   # chunk of keys
    b = tl.program_id(2)   # batch row
    n_kv = tl.num_programs(0)
    gi = tl.arange(0, GP)
    di = tl.arange(0, BD)
    gm = gi < G
    dm = di < D
    q = tl.load(Q + b * sq_b + (hk * G + gi)[:, None] * sq_h + di[None, :], mask=gm[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, BD], dtype=tl.float32)
    start = c * CHUNK
    for t0 in range(start, start + CHUNK, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = (t < T) & (t < start + CHUNK)
        kv_m = tm[:, None] & dm[None, :]
        k = tl.load(K + b * sk_b + hk * sk_h + t[:, None] * sk_t + di[None, :], mask=kv_m, other=0.0).to(tl.float32)
        v = tl.load(V + b * sv_b + hk * sv_h + t[:, None] * sv_t + di[None, :], mask=kv_m, other=0.0).to(tl.float32)
        bias = tl.load(BIAS + b * sb_b + t, mask=tm, other=float("-inf"))
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale + bias[None, :]        # [GP, BLOCK_T]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far: no NaN from -inf - -inf
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m - m_ref)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    h = hk * G + gi
    row = (b * (n_kv * G) + h) * n_chunks + c  # [GP] rows of M, L; O rows hold BD values
    tl.store(M + row, m, mask=gm)
    tl.store(L + row, lsum, mask=gm)
    tl.store(O + row[:, None] * BD + di[None, :], acc, mask=gm[:, None])


@triton.jit
def _combine_kernel(O, M, L, OUT, n_chunks, so_b, so_h, H, D: tl.constexpr, BD: tl.constexpr, CB: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh - b * H
    di = tl.arange(0, BD)
    mx = tl.full([CB], float("-inf"), tl.float32)
    for c0 in range(0, n_chunks, CB):  # pass 1: the largest chunk maximum
        ci = c0 + tl.arange(0, CB)
        mx = tl.maximum(mx, tl.load(M + bh * n_chunks + ci, mask=ci < n_chunks, other=float("-inf")))
    mref = tl.max(mx, axis=0)
    mref = tl.where(mref == float("-inf"), 0.0, mref)
    num = tl.zeros([BD], dtype=tl.float32)
    den = tl.zeros([CB], dtype=tl.float32)
    for c0 in range(0, n_chunks, CB):  # pass 2: the chunks rescaled to it
        ci = c0 + tl.arange(0, CB)
        cm = ci < n_chunks
        m = tl.load(M + bh * n_chunks + ci, mask=cm, other=float("-inf"))
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - mref))
        den += w * tl.load(L + bh * n_chunks + ci, mask=cm, other=0.0)
        o = tl.load(O + (bh * n_chunks + ci)[:, None] * BD + di[None, :], mask=cm[:, None], other=0.0)
        num += tl.sum(w[:, None] * o, axis=0)
    total = tl.sum(den, axis=0)
    out = tl.where(total > 0, num / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(OUT + b * so_b + h * so_h + di, out.to(OUT.dtype.element_ty), mask=di < D)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                     config: dict | None = None) -> torch.Tensor:
    """q [B, H, 1, D]; k, v [B, KVH, T, D] (any strides, unit last stride); bias fp32 [B, T] (0 or -inf,
    or any additive mask); H a multiple of KVH. Returns [B, H, 1, D] in q's dtype."""
    cfg = {**CONFIG, **(config or {})}
    B, H, n_q, D = q.shape
    _, KVH, T, Dk = k.shape
    if n_q != 1 or Dk != D or v.shape != k.shape or k.shape[0] != B or H % KVH:
        raise ValueError(f"decode attention takes q [B, H, 1, D] and k, v [B, KVH, T, D] with KVH dividing H; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if bias.shape != (B, T) or bias.dtype != torch.float32:
        raise ValueError(f"bias must be float32 [B, T] = [{B}, {T}], got {bias.dtype} {tuple(bias.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    bias = bias.contiguous()
    G = H // KVH
    chunk = max(cfg["BLOCK_T"], cfg["CHUNK"])
    n_chunks = triton.cdiv(T, chunk)
    BD = max(16, _pow2(D))
    o = _common.new_output((B * H * n_chunks, BD), torch.float32, q.device)
    m = _common.new_output((B * H * n_chunks,), torch.float32, q.device)
    lsum = _common.new_output((B * H * n_chunks,), torch.float32, q.device)
    _split_kernel[(KVH, n_chunks, B)](
        q, k, v, bias, o, m, lsum, float(scale), T, n_chunks, G,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        bias.stride(0), D=D, GP=max(2, _pow2(G)), CHUNK=chunk, BLOCK_T=cfg["BLOCK_T"], EVEN_D=BD == D, BD=BD,
        num_warps=cfg["num_warps"])
    out = _common.new_output((B, H, 1, D), q.dtype, q.device)
    _combine_kernel[(B * H,)](o, m, lsum, out, n_chunks, out.stride(0), out.stride(1), H, D=D, BD=BD,
                              CB=min(32, max(2, _pow2(n_chunks))), num_warps=4)
    return out
