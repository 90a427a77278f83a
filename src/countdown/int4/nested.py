"""The nested 8-bit weight format: 8-bit round-to-nearest codes held as two planes, each an ordinary 4-bit weight of
``format.py``, and its plain-PyTorch reference maths.

A weight ``W [N, K]`` (``nn.Linear`` layout), in groups of ``G`` consecutive input columns (G = 32, 64 or 128; K a
multiple of G), is rounded to 8-bit codes ``c = 16 h + l`` (0..255, h the high nibble, l the low) with one step S
per group, and held as two planes:

    high plane   codes h, scale 16 S, offset O_h      W~h = fl32(fl32(16 S * h) + O_h)      an Int4Weight
    low plane    codes l, scale S,    offset O_l      W~l = fl32(fl32(S * l) + O_l)
    8 bits       W8 = fl32(W~h + W~l)                 (``dequantize(planes="both")``)

The four stored values of a group (float16 by default, or float32; "store" rounds to that dtype):

    lo, hi  = min and max of the group (float32)
    S       = fl32((hi - lo) / 240) stored, rounded UP (never down, also where S is an fp16 subnormal, below 2**-14,
              whose precision is 2**-24 absolute); 16 S is then exact
    O_h     = store(lo)
    O_l     = store(-7.5 S)
    c       = clamp(round((w - fl32(O_h + O_l)) / S), 0, 255)   (round half to even; against the stored values, as
              ``format.quantize_rtn`` rounds)
    a group with hi == lo: S = 0, every code 0, O_h = store(lo), O_l = 0.

The 8-bit grid runs from lo - 7.5 S to hi + 7.5 S (255 steps over the group's range and 7.5 steps beyond each end),
so that the high plane, read at the middle of its bucket (codes 16 h + 7.5: lo - 7.5 S + (16 h + 7.5) S = lo + 16 S h),
is the group's 4-bit min-max RTN (``format.quantize_rtn``: offset lo, step (hi - lo) / 15; the same codes but at exact
ties, the step rounded up instead of to nearest); the low plane is the 4-bit RTN residual at step S. (A min-max 8-bit
grid, step (hi - lo) / 255, reads its high plane 7.5 steps inside the group's ends, where its largest weights are:
measured worse, docs in results/mixed/README.md.) So either plane is a weight the 4-bit kernels read unchanged
(``kernels/_int4.py``: the dense GEMV; the kept rows' kernels), and the two together are the 8-bit weight:
``W~h + W~l = O_h + O_l + S c`` in exact arithmetic. Error bounds against the exact weight w (checked against float64
in tests/test_nested.py), with O = fl32(O_h + O_l) and d = O - (lo - 7.5 S) (the offsets' roundings; the codes of
[lo, hi] lie in [7.5, 247.5] up to d / S, so nothing clamps unless |d| > 7.5 S):

    |W8  - w| <= S / 2 + |d| + float32 roundings
    |W~h - w| <= 8 S + |O_l + 7.5 S| + |d| + float32 roundings

``low_transposed``: the low plane held as ``(W~l)^T [K, N]``, its codes packed along N (byte b of row k: columns 2b
and 2b + 1, as ``pack``) and its scale and offset transposed, ``[K / G, N]``: the layout of a W_down whose kept rows
of d_inter are its input columns, so that a kept column's low codes are one contiguous row (the kept-rows down kernel
reads the scale of row k at ``[k // G, :]``). The values are the same; only the layout differs.

Bytes (``nbytes``): 8 bits a weight for the codes plus four stored values a group, ``N K + 4 N K s / G`` bytes with
s the scale dtype's size: 9 bits a weight at G = 64 in float16 (8.5 at G = 128). One plane reads half of it
(4.5 bits a weight at G = 64, as ``format.py``'s 4-bit weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .format import GROUPS, SCALE_DTYPES, Int4Weight, pack, unpack

PLANES = ("both", "high", "low")


def _store_up(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` (float32, >= 0) in ``dtype``, rounded up: the smallest stored value >= it."""
    stored = value.to(dtype)
    below = stored.float() < value
    if below.any():
        stored = torch.where(below, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)
    return stored


def dequantize_low_t(qweight_t: torch.Tensor, scale_t: torch.Tensor, offset_t: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A transposed low plane, ``(W~l)^T [K, N]`` in ``dtype``: codes packed along N ``[K, N / 2]``, scale and offset
    ``[K / G, N]``; ``fl32(fl32(scale[k // G, n] * l[k, n]) + offset[k // G, n])``."""
    codes = unpack(qweight_t).float()
    k, n = codes.shape
    if scale_t.dim() != 2 or scale_t.shape[1] != n or k % scale_t.shape[0] or scale_t.shape != offset_t.shape:
        raise ValueError(f"a transposed low plane is codes [K, N / 2] with scale and offset [K / G, N]; got codes "
                         f"{tuple(qweight_t.shape)}, scale {tuple(scale_t.shape)}, offset {tuple(offset_t.shape)}")
    group = k // scale_t.shape[0]
    w = codes.reshape(k // group, group, n).mul_(scale_t.float()[:, None]).add_(offset_t.float()[:, None])
    return w.reshape(k, n).to(dtype)


@dataclass
class NestedWeight:
    """One weight in the nested format: ``high`` (an :class:`Int4Weight` [N, K]) and the low plane's ``low_qweight``,
    ``low_scale``, ``low_offset``, as ``high``'s tensors or, with ``low_transposed``, transposed (module docstring)."""

    high: Int4Weight
    low_qweight: torch.Tensor
    low_scale: torch.Tensor
    low_offset: torch.Tensor
    low_transposed: bool = False

    def __post_init__(self):
        n, k = self.high.shape
        g = self.high.group
        want = ((k, n // 2), (k // g, n)) if self.low_transposed else ((n, k // 2), (n, k // g))
        got = (tuple(self.low_qweight.shape), tuple(self.low_scale.shape))
        if got != want or self.low_offset.shape != self.low_scale.shape or self.low_qweight.dtype != torch.uint8 \
                or self.low_scale.dtype != self.high.scale.dtype or self.low_offset.dtype != self.high.scale.dtype:
            raise ValueError(f"the low plane of a nested [{n}, {k}] weight in groups of {g} is codes {want[0]} uint8 "
                             f"with scale and offset {want[1]} of the high plane's dtype "
                             f"({'transposed' if self.low_transposed else 'as the high plane'}); got codes "
                             f"{self.low_qweight.dtype} {got[0]}, scale {self.low_scale.dtype} {got[1]}, offset "
                             f"{self.low_offset.dtype} {tuple(self.low_offset.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.high.shape

    @property
    def group(self) -> int:
        return self.high.group

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.high.scale.dtype

    @property
    def nbytes(self) -> int:
        """Both planes' codes, scales and offsets."""
        return 2 * self.high.nbytes

    @property
    def low(self) -> Int4Weight:
        """The low plane as an Int4Weight [N, K] (a transposed one is laid out as the format first: a copy)."""
        if not self.low_transposed:
            return Int4Weight(self.low_qweight, self.low_scale, self.low_offset)
        codes = unpack(self.low_qweight).t().contiguous()
        return Int4Weight(pack(codes), self.low_scale.t().contiguous(), self.low_offset.t().contiguous())

    def codes(self) -> torch.Tensor:
        """The 8-bit codes ``c = 16 h + l`` [N, K] (int16)."""
        low = unpack(self.low_qweight)
        low = low.t() if self.low_transposed else low
        return 16 * unpack(self.high.qweight).to(torch.int16) + low.to(torch.int16)

    def dequantize(self, planes: str = "both", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W8 (``"both"``), W~h (``"high"``) or W~l (``"low"``) [N, K] in ``dtype``; W8 is the float32 sum of the two
        planes' values, rounded to ``dtype`` once."""
        if planes not in PLANES:
            raise ValueError(f"planes must be one of {PLANES}, got {planes!r}")
        if planes == "high":
            return self.high.dequantize(dtype)
        low = self.dequantize_low_rows(None)
        if planes == "low":
            return low.to(dtype)
        return self.high.dequantize().add_(low).to(dtype)

    def dequantize_low_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """float32 W~l [N, K], or where ``rows`` (indices of K, for a transposed plane: its kept input columns) is
        given, those columns of it as ``(W~l[:, rows])^T [len(rows), N]``; for a plane as the high one, ``rows``
        indexes N and gives ``W~l[rows] [len(rows), K]``."""
        if not self.low_transposed:
            low = Int4Weight(self.low_qweight, self.low_scale, self.low_offset)
            return (low if rows is None else low.rows(rows)).dequantize()
        if rows is None:
            return dequantize_low_t(self.low_qweight, self.low_scale, self.low_offset).t()
        g = self.group
        codes = unpack(self.low_qweight.index_select(0, rows)).float()
        groups = rows // g
        return codes.mul_(self.low_scale.index_select(0, groups).float()) \
            .add_(self.low_offset.index_select(0, groups).float())

    def rows(self, index: torch.Tensor) -> "NestedWeight":
        """The weight with its rows (of N) reordered; a plane as the high one only (a transposed low plane's rows are
        columns of W)."""
        if self.low_transposed:
            raise ValueError("rows of a nested weight with a transposed low plane: its rows are W's columns")
        return NestedWeight(self.high.rows(index), self.low_qweight[index], self.low_scale[index],
                            self.low_offset[index])


def nbytes(n: int, k: int, group: int, scale_dtype: torch.dtype = torch.float16) -> int:
    """Bytes of one [N, K] weight in the nested format: both planes."""
    return n * k + 4 * n * (k // group) * torch.empty((), dtype=scale_dtype).element_size()


def quantize_nested(w: torch.Tensor, group: int = 64, scale_dtype: torch.dtype = torch.float16,
                    low_transposed: bool = False) -> NestedWeight:
    """8-bit round-to-nearest of ``w [N, K]`` (any float dtype), min-max per group of ``group`` columns, as two
    4-bit planes (the module docstring); ``low_transposed`` lays the low plane out transposed."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be torch.float16 or torch.float32, got {scale_dtype}")
    if w.dim() != 2 or w.shape[1] % group or (low_transposed and w.shape[0] % 2):
        raise ValueError(f"w must be a matrix [N, K] with K a multiple of group={group}"
                         f"{' and N even (a transposed low plane packs along N)' if low_transposed else ''}, "
                         f"got {tuple(w.shape)}")
    n, k = w.shape
    wg = w.detach().float().contiguous().reshape(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    step = _store_up((hi - lo) / 240, scale_dtype)
    flat = step == 0  # a constant group
    offset_high = lo.to(scale_dtype)
    offset_low = (-7.5 * step.float()).to(scale_dtype)
    scale_high = (16 * step.float()).to(scale_dtype)
    if not all(torch.isfinite(t).all() for t in (scale_high, offset_high, offset_low)):
        raise ValueError(f"a group's range does not fit {scale_dtype} (or the weight is not finite): "
                         "pass scale_dtype=torch.float32")
    offset = (offset_high.float() + offset_low.float())[..., None]
    safe = torch.where(flat, torch.ones_like(step), step).float()[..., None]
    c = torch.round((wg - offset) / safe).clamp_(0, 255)
    c = torch.where(flat[..., None], torch.zeros_like(c), c).to(torch.uint8).reshape(n, k)
    high = Int4Weight(pack(c >> 4), scale_high, offset_high)
    low = c & 15
    if low_transposed:
        return NestedWeight(high, pack(low.t().contiguous()), step.t().contiguous(), offset_low.t().contiguous(), True)
    return NestedWeight(high, pack(low), step, offset_low)


# ------------------------------------------------------------------------------------------------ references
def nested_linear_ref(x: torch.Tensor, weight: NestedWeight, planes: str = "both",
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with W one plane or both (``planes``), de-quantized in float32 and cast to x's dtype:
    the dense GEMV of a plane (``kernels/_int4.py`` reads either) or of the 8-bit weight."""
    return F.linear(x, weight.dequantize(planes, x.dtype), bias)


def low_rows_ref(x: torch.Tensor, weight: NestedWeight, rows: torch.Tensor) -> torch.Tensor:
    """``x W~l[rows]^T [tokens, len(rows)]``: the low-plane correction of the kept rows of W_gate / W_up (what
    ``kernels/_int4_rows_other.py`` computes on the low plane)."""
    return F.linear(x, weight.dequantize_low_rows(rows).to(x.dtype))


def low_columns_ref(s_rows: torch.Tensor, weight: NestedWeight, rows: torch.Tensor) -> torch.Tensor:
    """``s_rows W~l[:, rows]^T [tokens, N]``: W_down's low-plane correction for the coefficients ``s_rows``
    ``[tokens, len(rows)]`` of its kept input columns ``rows`` (a transposed low plane: its kept rows, each scale
    row ``rows // G``)."""
    if weight.low_transposed:
        return s_rows @ weight.dequantize_low_rows(rows).to(s_rows.dtype)
    return F.linear(s_rows, weight.dequantize_low_rows(None).index_select(1, rows).to(s_rows.dtype))


def mixed_mlp_ref(x: torch.Tensor, gate: NestedWeight, up: NestedWeight, down: NestedWeight, act,
                  keep: torch.Tensor) -> torch.Tensor:
    """The mixed Gated-MLP of ``x [tokens, d_model]`` in float64 as the decode kernels compute it: the high planes'
    products for every row, the low planes' corrections for the kept rows (``keep [tokens, d_inter]``), W_down's high
    plane on every row's coefficient plus its low plane on the kept rows' coefficients."""
    x = x.double()
    plane = {(name, which): w.dequantize(which).double() for name, w in (("gate", gate), ("up", up), ("down", down))
             for which in ("high", "low")}
    k = keep.double()
    u = x @ plane["up", "high"].t() + k * (x @ plane["up", "low"].t())
    g = x @ plane["gate", "high"].t() + k * (x @ plane["gate", "low"].t())
    s = u * act(g)
    return s @ plane["down", "high"].t() + (k * s) @ plane["down", "low"].t()
