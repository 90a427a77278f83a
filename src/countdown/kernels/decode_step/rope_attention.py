"""Triton kernels: one decode step's rotary embedding, KV-cache write and attention, in two launches.

Why: in a compiled Hugging Face decode step the attention block of one layer is, after the QKV
projection, a chain of small kernels (rotary embedding of q and k, two cache writes, the cache
length's increment, the attention's split and merge), each a few microseconds of launch and ramp for
a few kilobytes of work. Here one layer's block after the (fused) QKV projection is two launches:

1. ``rope_split_kernel``, one program per (split of the keys, KV head, batch row), as
   attention.py's split kernel, but fed the projection's raw output ``qkv`` [B, (H + 2 KVH) D]:
   it applies the rotary embedding (``x cos + rotate_half(x) sin``, Hugging Face's convention: the
   two halves of each head rotate together) to its G query heads and to the new key, in fp32, and
   folds the cache's keys ``t < T, t != pos`` into the running softmax. The new token (position
   ``pos``) is never read from the cache: split 0 adds it from registers (its key rounded to the
   cache's dtype first, as a cache read would give it) and writes the new key and value into the
   cache at ``pos``. No program reads what another writes, so one launch is race-free.
2. ``rope_combine_kernel``: the merge of the splits' partials (attention.py's, shared), and
   ``pos += 1`` by its first program: ``pos`` is transformers' ``StaticLayer.cumulative_length``
   (the write position of the next step), read by every split program before, so it can only move
   once they are all done.

``pos`` is a device tensor: no host synchronisation, the launch depends on shapes only (CUDA graphs,
torch.compile through the custom op in countdown/decode/attention.py). A ``pos`` outside the cache
writes nothing (transformers would raise there; the caller sizes the cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import interpreting, new_output, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode
from ..jit_helpers import gdc_launch_dependents, gdc_wait
from .attention import LOG2E, attend_split, combine_partials, plan_splits, store_partials


@triton.jit
def _rope(X, di, pd, sign, c, s, mask):
    """Rotary embedding of the rows at X (one head each): x cos + rotate_half(x) sin, in fp32."""
    x = tl.load(X + di, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(X + pd, mask=mask, other=0.0).to(tl.float32)
    return x * c + sign * xp * s


@triton.jit
def rope_split_kernel(QKV, COS, SIN, K, V, POS, MASK, P, qk_scale, T, split_len,
                       s_qkv, s_cos, s_sin, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sm_b, sm_t,
                       G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, GP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BOOL_MASK: tl.constexpr, IEEE: tl.constexpr,
                       NUM_STAGES: tl.constexpr, SKIP_MASKED: tl.constexpr, PDL: tl.constexpr = 0):
    if PDL:  # launched early (jit_helpers.py: PDL); the combine may launch now
        gdc_launch_dependents()
    if PDL:  # qkv is the previous kernel's output
        gdc_wait()
    sp = tl.program_id(0)  # split of the keys
    hk = tl.program_id(1)  # KV head
    b = tl.program_id(2)   # batch row
    n_splits = tl.num_programs(0)
    KVH = tl.num_programs(1)
    H = KVH * G
    gi = tl.arange(0, GP)
    di = tl.arange(0, BD)
    gm = gi < G
    dm = di < D
    HALF: tl.constexpr = D // 2
    pd = tl.where(di < HALF, di + HALF, di - HALF)        # rotate_half's partner of each lane
    sign = tl.where(di < HALF, -1.0, 1.0)
    c = tl.load(COS + b * s_cos + di, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(SIN + b * s_sin + di, mask=dm, other=0.0).to(tl.float32)
    pos = tl.load(POS)
    row = QKV + b.to(tl.int64) * s_qkv
    h = hk * G + gi
    qm = gm[:, None] & dm[None, :]
    q = _rope(row + h[:, None] * D, di[None, :], pd[None, :], sign[None, :], c[None, :], s[None, :], qm)
    q = q.to(K.dtype.element_ty)
    m, lsum, acc = attend_split(q, K, V, MASK, b, hk, sp, split_len, T, pos, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                                sm_b, sm_t, qk_scale, di, dm, GP, BD, BLOCK_N, BOOL_MASK, IEEE, NUM_STAGES, SKIP_MASKED)
    if sp == 0:  # the new token: from registers, then into the cache
        k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        m_base = MASK + b.to(tl.int64) * sm_b
        k_new = _rope(row + (H + hk) * D, di, pd, sign, c, s, dm).to(K.dtype.element_ty)
        v_new = tl.load(row + (H + KVH + hk) * D + di, mask=dm, other=0.0).to(V.dtype.element_ty)
        inside = pos < T
        if BOOL_MASK:
            keep = tl.load(m_base + pos * sm_t, mask=inside, other=0) != 0
            bias = tl.where(keep, 0.0, float("-inf"))
        else:
            bias = tl.load(m_base + pos * sm_t, mask=inside, other=float("-inf")).to(tl.float32) * 1.4426950408889634  # log2(e)
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale + bias   # [GP]
        m_new = tl.maximum(m, score)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(score - m_ref)
        alpha = tl.exp2(m - m_ref)
        lsum = lsum * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new
        wm = dm & ((pos + di * 0) < T)  # a vector compare (the interpreter rejects scalar & vector masks)
        tl.store(k_base + pos * sk_t + di, k_new, mask=wm)
        tl.store(v_base + pos * sv_t + di, v_new, mask=wm)
    store_partials(P, acc, m, lsum, b, h, gm, sp, n_splits, H, di, BD)


@triton.jit
def rope_combine_kernel(P, OUT, POS, n_splits, so_b, so_h, H, n_rows, D: tl.constexpr, BD: tl.constexpr,
                         CB: tl.constexpr, PDL: tl.constexpr = 0):
    if PDL:  # launched early (jit_helpers.py: PDL); the next grid may launch now
        gdc_launch_dependents()
    if PDL:  # the partials are the previous kernel's output
        gdc_wait()
    combine_partials(P, OUT, tl.program_id(0), n_splits, so_b, so_h, H, n_rows, D, BD, CB)
    if tl.program_id(0) == 0:
        tl.store(POS, tl.load(POS) + 1)


def check(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          pos: torch.Tensor, mask: torch.Tensor, n_heads: int) -> None:
    """Raise ValueError naming what does not fit the kernel's layout (see :func:`rope_decode_attention`)."""
    B, KVH, T, D = k_cache.shape
    if v_cache.shape != k_cache.shape or KVH == 0 or n_heads % KVH:
        raise ValueError(f"k_cache and v_cache must be [B, KVH, T, D] alike with KVH dividing n_heads = {n_heads}; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if D % 2:
        raise ValueError(f"the rotary embedding needs an even head dimension, got {D}")
    if qkv.dim() != 2 or qkv.shape != (B, (n_heads + 2 * KVH) * D) or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [B, (H + 2 KVH) D] = [{B}, {(n_heads + 2 * KVH) * D}] with unit last stride, "
                         f"got {tuple(qkv.shape)} strides {qkv.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[-1] != D or t.shape[0] not in (1, B) or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [B or 1, D = {D}] with unit last stride, got {tuple(t.shape)}")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pos must be one int32/int64 element (the cache's write position), got {pos.dtype} "
                         f"{tuple(pos.shape)}")
    if mask.shape != (B, T) or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        raise ValueError(f"mask must be bool or float [B, T] = [{B}, {T}], got {mask.dtype} {tuple(mask.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches need a unit last stride (transformers' StaticCache has one)")


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, scale: float, n_heads: int,
                          config: dict | None = None) -> torch.Tensor:
    """One decode step of attention, its rotary embedding and cache write included.

    qkv [B, (H + 2 KVH) D]: the QKV projection of the step's token, heads in order (q heads, then k,
    then v), before the rotary embedding; cos, sin [B or 1, D] at the token's position; k_cache,
    v_cache [B, KVH, T, D]: written at ``pos`` (one int element on the device, incremented by one);
    mask [B, T] over the cache after the write (bool, True = attend, or additive). Returns
    [B, H, D] in the caches' dtype, contiguous. (Spy hook: ``on_launch("rope_attention", qkv, k_cache, v_cache)``.)"""
    check(qkv, cos, sin, k_cache, v_cache, pos, mask, n_heads)
    cfg = launch_config("attention", qkv.device, extra=config)
    B, KVH, T, D = k_cache.shape
    H = n_heads
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    if cos.shape[0] == 1:
        s_cos, s_sin = 0, 0
    else:
        s_cos, s_sin = cos.stride(0), sin.stride(0)
    G = H // KVH
    BD = max(16, pow2(D))
    split_len, n_splits = plan_splits(B, KVH, T, qkv.device, config)
    out = new_output((B, H, D), k_cache.dtype, qkv.device)
    n_rows = B * H * n_splits
    part = new_output((n_rows * (BD + 2),), torch.float32, qkv.device)
    pdl = pdl_mode(qkv)
    cb = max(2, pow2(n_splits))
    launching("rope_attention", qkv, k_cache, v_cache)
    rope_split_kernel[(n_splits, KVH, B)](
        qkv, cos, sin, k_cache, v_cache, pos, mask, part, float(scale) * LOG2E, T, split_len,
        qkv.stride(0), s_cos, s_sin, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), mask.stride(0), mask.stride(1),
        G=G, D=D, BD=BD, GP=max(16, pow2(G)), BLOCK_N=cfg["BLOCK_N"],
        BOOL_MASK=mask.dtype == torch.uint8, IEEE=k_cache.dtype == torch.float32 or interpreting(),
        NUM_STAGES=cfg["num_stages"], SKIP_MASKED=bool(cfg["SKIP_MASKED"]), PDL=pdl, num_warps=cfg["num_warps"],
        **launch_kwargs(pdl))
    rope_combine_kernel[(B * H,)](part, out, pos, n_splits, out.stride(0), out.stride(1), H, n_rows, D=D, BD=BD,
                                   CB=cb, PDL=pdl, num_warps=4 if cb <= 32 else 8, **launch_kwargs(pdl))
    return out
