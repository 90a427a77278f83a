"""GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) as the 4-bit format of ``format.py``, exactly.

The raw blocks of one tensor ``[N, K]`` are ``N x (K / block)`` blocks of ``size`` bytes (what ``GGUFReader``
gives as ``tensor.data``, uint8 ``[N, K / block * size]``), little-endian:

    Q4_0  (32 values, 18 B):  d fp16 | 16 B nibbles               w = d (n - 8)
    Q4_1  (32 values, 20 B):  d fp16 | m fp16 | 16 B nibbles      w = d n + m
    Q4_K  (256 values, 144 B): d fp16 | dmin fp16 | 12 B: eight 6-bit sub-scales sc_j and mins m_j | 128 B
                               nibbles;  w = (d sc_j) n - (dmin m_j) in sub-block j of 32 values

Within a Q4_0 / Q4_1 block byte i holds value i in its low nibble and value i + 16 in its high one; within a
Q4_K block, byte 32c + i holds value i of sub-block 2c (low) and of sub-block 2c + 1 (high). The format packs
plain column pairs instead, so the codes are re-ordered here; the values are not touched.

Exactness: gguf-py's ``dequantize`` (what transformers calls when it loads a GGUF file) computes in float32
``d * (n - 8)``, ``d * n + m`` and ``(d * sc) * n - dmin * m``. Every product there is exact in float32 (an
fp16 factor times an integer below 2**6, times a nibble: at most 21 significant bits), so each value is
rounded once, in the final add or subtract, which is the format's ``fl(fl(scale * q) + offset)`` with
``scale = d`` / ``offset = -8 d`` (Q4_0), ``scale = d`` / ``offset = m`` (Q4_1), ``scale = d sc_j`` /
``offset = -(dmin m_j)`` (Q4_K; ``a - b`` is ``a + (-b)`` in IEEE arithmetic, signed zeros included). One
difference: where Q4_0 gives ``d * 0`` with a negative d, GGUF has -0.0 and the format +0.0 (equal numbers).
Scales and offsets are stored as float16 where every value of the tensor is exactly a float16 (Q4_0 / Q4_1),
else float32 (Q4_K: 8 bytes per 32 weights, 0.75 B a weight against GGUF's 0.5625).
"""

from __future__ import annotations

import numpy as np
import torch

from .format import Int4Weight, narrowest_exact, pack

# GGML type number -> (name, values per block, bytes per block); numbers as in gguf.GGMLQuantizationType
Q4_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 12: ("Q4_K", 256, 144)}
GROUP = 32  # every GGUF 4-bit type has one scale and offset per 32 values


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes [..., 2] -> their float16 value as float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _halves(qs: torch.Tensor) -> torch.Tensor:
    """Block nibbles [..., B] -> codes [..., 2 B]: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q4_0(b: torch.Tensor):
    d = _fp16(b[..., 0:2])
    return _halves(b[..., 2:18]), d, -8 * d


def _q4_1(b: torch.Tensor):
    return _halves(b[..., 4:20]), _fp16(b[..., 0:2]), _fp16(b[..., 2:4])


def _q4_k(b: torch.Tensor):
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
    s = b[..., 4:16].to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 2) & 48)], dim=-1).float()  # [..., 8]
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], dim=-1).float()
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32)  # sub-block 2c, then 2c + 1
    return q, d[..., None] * sc, -(dmin[..., None] * mn)


_DECODE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def from_blocks(data, type_number: int, n: int, k: int) -> Int4Weight:
    """The raw blocks of an ``[n, k]`` tensor of GGML type ``type_number`` (Q4_0 / Q4_1 / Q4_K), a uint8 numpy
    array or tensor of ``n * k / block * size`` bytes, as an :class:`Int4Weight` with groups of 32."""
    if type_number not in Q4_TYPES:
        names = ", ".join(v[0] for v in Q4_TYPES.values())
        raise ValueError(f"GGML type {type_number} is not a 4-bit block type ({names})")
    name, block, size = Q4_TYPES[type_number]
    if k % block:
        raise ValueError(f"{name} needs a row length that is a multiple of {block}, got K={k}")
    raw = torch.from_numpy(np.array(data, dtype=np.uint8)) if isinstance(data, np.ndarray) else data  # a copy
    if raw.dtype != torch.uint8 or raw.numel() != n * (k // block) * size:
        raise ValueError(f"{name} [{n}, {k}] has {n * (k // block) * size} bytes of blocks, got {raw.dtype} "
                         f"with {raw.numel()} elements")
    q, scale, offset = _DECODE[name](raw.reshape(n, k // block, size))
    scale, offset = scale.reshape(n, k // GROUP), offset.reshape(n, k // GROUP)
    dtype = narrowest_exact(scale, offset)
    return Int4Weight(pack(q.reshape(n, k)), scale.to(dtype), offset.to(dtype))
