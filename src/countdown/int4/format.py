"""The 4-bit weight format of every quantized Linear, and its plain-PyTorch reference maths.

A Linear weight ``W [N, K]`` (``nn.Linear`` layout: N outputs, K inputs), in groups of ``G`` consecutive
columns (G = 32, 64 or 128; K a multiple of G), is held as

    q        codes 0..15, uint8                          [N, K]      (packed: ``qweight`` [N, K / 2])
    scale    one per group, float16 or float32           [N, K / G]
    offset   one per group, the dtype of scale           [N, K / G]

    W~[n, k] = fl32( fl32(scale[n, g] * q[n, k]) + offset[n, g] ),   g = k // G            (``dequantize``)

in float32, a multiply then an add, each rounded (eager PyTorch runs them as two operations: no fused
multiply-add), then cast to the compute dtype. This is the arithmetic of GGUF's own de-quantization, so the
GGUF 4-bit blocks map onto the format exactly (``gguf_blocks.py``): Q4_0 is ``offset = -8 scale``, Q4_1
``offset = min``, Q4_K the per-32 effective ``scale = d * sc`` and ``offset = -dmin * m`` (float32: the
products of an fp16 factor and a 6-bit integer need up to 17 bits of mantissa).

Packing (``pack``): byte b of row n holds column 2b in its low nibble and column 2b + 1 in its high nibble.
That is the 4-bit layout of the shadows (``kernels/shadow/format.py``) byte for byte, so a little-endian int32 word c
holds columns 8c .. 8c + 7 at bits 4j, as ``kernels/int4/words.py`` reads them. torch's
``_convert_weight_to_int4pack`` wants the even column in the high nibble and a Marlin-style kernel its own
permutation: a kernel derives its layout from these tensors when it prepares a module, the format stays.

Round-to-nearest from float weights (``quantize_rtn``), min-max per group, in float32 (bf16 and fp16
weights convert exactly):

    lo, hi  = min and max of the group
    scale   = store((hi - lo) / 15)         (a group whose scale stores as 0: scale 1)
    offset  = store(lo)
    q       = clamp(round((w - offset) / scale), 0, 15)       (round half to even)

``store`` rounds to the scale dtype (float16 by default). Since q is computed from the stored scale and
offset, the error against the exact weight is at most

    |W~ - w| <= scale / 2 + |offset - lo| + 15 |scale - (hi - lo) / 15| + float32 roundings

(the second and third terms only where the clamp bites: the group's ends). tests/test_int4.py checks it
against float64.

Bytes (``nbytes``): ``N K / 2`` for the codes plus ``2 N K / G`` scale-and-offset values, so per weight
``1/2 + 2 s / G`` bytes with s the scale dtype's size: float16 0.625 / 0.5625 / 0.53125 B at G = 32 / 64 /
128 (5 / 4.5 / 4.25 bits); float32 at G = 32 (GGUF Q4_K exact) 0.75 B (6 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = (32, 64, 128)
SCALE_DTYPES = (torch.float16, torch.float32)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [N, K] (0..15, K even) -> qweight uint8 [N, K / 2]: column 2b in the low nibble of byte b."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"codes must be a matrix [N, K] with K even, got shape {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack``: uint8 [N, K / 2] -> codes uint8 [N, K]."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be uint8 [N, K / 2], got {qweight.dtype} {tuple(qweight.shape)}")
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def _check(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> int:
    """The group size, after checking the three tensors fit together."""
    n, half = qweight.shape
    if qweight.dtype != torch.uint8 or scale.dim() != 2 or scale.shape[0] != n or scale.shape != offset.shape \
            or (2 * half) % scale.shape[1] or scale.dtype != offset.dtype or scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"a 4-bit weight is qweight uint8 [N, K / 2] with scale and offset [N, K / G] of one dtype "
                         f"(float16 or float32); got qweight {qweight.dtype} {tuple(qweight.shape)}, scale "
                         f"{scale.dtype} {tuple(scale.shape)}, offset {offset.dtype} {tuple(offset.shape)}")
    return 2 * half // scale.shape[1]


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W~ [N, K] in ``dtype``: ``fl32(fl32(scale * q) + offset)`` computed in float32 (the module docstring)."""
    group = _check(qweight, scale, offset)
    q = unpack(qweight).float()
    n, k = q.shape
    w = q.reshape(n, k // group, group).mul_(scale.float()[..., None]).add_(offset.float()[..., None])
    return w.reshape(n, k).to(dtype)


def nbytes(n: int, k: int, group: int, scale_dtype: torch.dtype = torch.float16) -> int:
    """Bytes of one [N, K] weight in the format: codes plus scale and offset."""
    return n * k // 2 + 2 * n * (k // group) * torch.empty((), dtype=scale_dtype).element_size()


def narrowest_exact(*values: torch.Tensor) -> torch.dtype:
    """float16 where every value (float32 tensors) survives the round trip through it, else float32."""
    for v in values:
        h = v.to(torch.float16)
        if not torch.equal(h.float(), v) or not torch.equal(torch.signbit(h), torch.signbit(v)):
            return torch.float32
    return torch.float16


@dataclass
class Int4Weight:
    """One weight in the format: ``qweight`` uint8 [N, K / 2], ``scale`` and ``offset`` [N, K / G]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def __post_init__(self):
        _check(self.qweight, self.scale, self.offset)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], 2 * self.qweight.shape[1]

    @property
    def group(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        return nbytes(*self.shape, self.group, self.scale.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.qweight, self.scale, self.offset, dtype)

    def rows(self, index: torch.Tensor) -> "Int4Weight":
        """The weight with its rows reordered (``W~[index]``): rows are independent, so this is exact."""
        return Int4Weight(self.qweight[index], self.scale[index], self.offset[index])


def quantize_rtn(w: torch.Tensor, group: int = 128, scale_dtype: torch.dtype = torch.float16) -> Int4Weight:
    """Round-to-nearest, min-max per group of ``group`` columns (the module docstring) of ``w [N, K]`` (any float
    dtype, any device)."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be torch.float16 or torch.float32, got {scale_dtype}")
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(f"w must be a matrix [N, K] with K a multiple of group={group}, got {tuple(w.shape)}")
    n, k = w.shape
    wg = w.detach().float().contiguous().reshape(n, k // group, group)  # (a transposed view: codes row-major all the same)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15).to(scale_dtype)
    offset = lo.to(scale_dtype)
    if not (torch.isfinite(scale).all() and torch.isfinite(offset).all()):
        raise ValueError(f"a group's range does not fit {scale_dtype} (or the weight is not finite): "
                         "pass scale_dtype=torch.float32")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((wg - offset.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return Int4Weight(pack(q.to(torch.uint8).reshape(n, k)), scale, offset)
