"""Triton kernels: a mixed-precision Gated-MLP on nested 8-bit weights (``int4/nested.py``) for one token, the op
of the whole MLP and its float64 reference.

Each weight is two 4-bit planes: the high plane W~h (an ordinary 4-bit weight) and the low plane Delta (W8 = W~h +
Delta); W_down's low plane is held transposed, ``[d_inter, d_model]`` codes packed along d_model with its scales and
offsets ``[d_inter / G, d_model]``, so a kept row i of d_inter is one contiguous row of codes. For one token x and
the layer's cut (five launches; the first, second and fourth are the 4-bit kernels as they are):

    gu = x [W~h_gate; W~h_up]^T                gemv.py on the stacked high planes: fp32 partials [S, 2, d_inter]
    keep i where |act(g~_i) u~_i| > cut        rows.py's select, dual rule (lists of kept rows a set of SET rows)
    gu[0, :, i] += x [Delta_gate; Delta_up][i]^T   for kept i: low_gate_up (in place: g, u refined to 8 bits)
    q  = W~h_down (act(g) u)                   gemv.py, act(g) u formed from gu as it loads (every row, refined)
    y  = q + sum over kept i of s_i Delta_down[:, i]  (+ h, + bias)     low_down, s_i = act(g_i) u_i from gu

so the rows over the cut are the 8-bit MLP's rows and the rest the 4-bit MLP's: ``mixed_mlp_ref``
(``patch/mixed_mlp.py``) in this order. Bytes a token: the three high planes, and for each kept row one row of
each low plane (W_down's: d_model / 2 bytes of codes and the scales and offsets of its group's row, shared by the
group's kept rows).

low_gate_up: the arithmetic and the shape of work of ``rows_other.py`` (x paired once a program, ``word_dot`` on int32
words, the group's scale, the asymmetric part in fp32), both low planes' rows of a tile at once; the corrections of
slice s of K (``L_COLS`` columns; at most as many slices as gu has) are added to gu's partial slice s with an atomic
add (one writer a value, so the sum is the same on every run). low_down: ``nested_down.py`` (its own file: tiles
of kept rows with the scales and offsets read as fp16 pairs, loads a tile ahead, its walk before its PDL wait behind
a down GEMV that signals late, the residual add by the last program of each column slice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import act_torch, interpreting, op_count, pow2
from ..config import launch_config, launch_kwargs, launching, pdl_mode
from ..jit_helpers import gdc_enter
from . import gemv
from .gemv import _paired_x, _slice_grid, _tile, split_for
from .rows import _config as rows_config, select
from .nested_down import down_slices, low_down
from .rows_list import q_total, tile_at
from .words import word_dot, xload


@triton.jit
def _low_dot(w, sc, of, xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3, ASM: tl.constexpr):
    d = word_dot(w, h0[None], h1[None], h2[None], h3[None], h4[None], h5[None], h6[None], h7[None], e0, e1, e2, e3, ASM)
    return tl.sum(tl.sum(d, axis=2) * sc, axis=1) * down + tl.sum((of + 8.0 * sc) * xs[None, :], axis=1)


@triton.jit
def low_gate_up_kernel(X, WG, SCG, OFG, WU, SCU, OFU, IDX, CNT, GU, n_sets, d_inter, n_words, n_groups,
                       SET: tl.constexpr, SUB: tl.constexpr, R: tl.constexpr, SLICE: tl.constexpr, SG: tl.constexpr,
                       WPG: tl.constexpr, ASM: tl.constexpr, BIG: tl.constexpr, PDL: tl.constexpr = 0):
    if PDL:  # the row lists are the select kernel's output
        gdc_enter(0)
    part = tl.program_id(0)
    s = tl.program_id(1)
    gi, gm, wcol, wm = _slice_grid(s, SLICE, SG, WPG)
    ri = tl.arange(0, R)
    total = q_total(CNT, part, n_sets, SUB, R)
    xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3 = _paired_x(
        xload(X, wcol, wm, 0, 8), xload(X, wcol, wm, 1, 8), xload(X, wcol, wm, 2, 8),
        xload(X, wcol, wm, 3, 8), xload(X, wcol, wm, 4, 8), xload(X, wcol, wm, 5, 8),
        xload(X, wcol, wm, 6, 8), xload(X, wcol, wm, 7, 8))
    for q in range(0, total):
        rows, pos, ok = tile_at(IDX, CNT, q, part, n_sets, ri, d_inter, SET, SUB, R)
        wg, scg, ofg = _tile(WG, SCG, OFG, rows, d_inter, n_words, n_groups, wcol, gi, gm, BIG)
        wu, scu, ofu = _tile(WU, SCU, OFU, rows, d_inter, n_words, n_groups, wcol, gi, gm, BIG)
        dg = _low_dot(wg, scg, ofg, xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3, ASM)
        du = _low_dot(wu, scu, ofu, xs, down, h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3, ASM)
        tl.atomic_add(GU + s * 2 * d_inter + rows, dg, mask=ok, sem="relaxed")  # slice s of K: gu's slice s
        tl.atomic_add(GU + s * 2 * d_inter + d_inter + rows, du, mask=ok, sem="relaxed")


def _config(config: dict | None, device) -> tuple[dict, dict]:
    """(the select's configuration, int4_rows; this file's, int4_nested)."""
    ours = ("L_", "D_", "Q_")
    cfg = launch_config("int4_nested", device, extra={k: v for k, v in (config or {}).items() if k.startswith(ours)})
    return rows_config({k: v for k, v in (config or {}).items() if not k.startswith(ours)}), cfg


def low_gate_up(x, gate_low, up_low, idx, cnt, gu, set_rows: int, cfg: dict) -> None:
    """Add the kept rows' low-plane products ``x Delta[i]^T`` of W_gate and W_up to ``gu``'s partial slices (fp32
    ``[S, 2, d_inter]``; slice s of K to slice s), in place. ``gate_low`` / ``up_low``: (int32 words [d_inter, d_model / 8], scale,
    offset). (Spy hook: ``on_launch("int4_nested_low_gate_up", x, idx)``.)"""
    (d_inter, n_words), n_groups = gate_low[0].shape, gate_low[1].shape[1]
    group = 8 * n_words // n_groups
    n_splits = split_for(n_groups, group, cfg["L_COLS"])
    if n_splits > gu.shape[0]:  # slice s adds to gu's slice s: one writer a value (the same sum on every run)
        n_splits = next(s for s in range(gu.shape[0], 0, -1) if n_groups % s == 0)
    n_sets = cnt.numel()
    pdl = pdl_mode(x)
    launching("int4_nested_low_gate_up", x, idx)
    low_gate_up_kernel[(-(-n_sets // cfg["L_SUB"]), n_splits)](
        x.contiguous(), *(t.contiguous() for t in (*gate_low, *up_low)), idx, cnt, gu, n_sets, d_inter, n_words,
        n_groups, SET=set_rows, SUB=cfg["L_SUB"], R=cfg["L_R"], SLICE=n_groups // n_splits,
        SG=pow2(n_groups // n_splits), WPG=group // 8, ASM=x.device.type == "cuda" and not interpreting(),
        BIG=d_inter * n_words >= 2**31, PDL=pdl, num_warps=cfg["L_WARPS"], num_stages=1, **launch_kwargs(pdl))


def mixed_mlp(x, gate_up_high, gate_low, up_low, down_high, down_low_t, cut: torch.Tensor, activation="silu",
              count=None, config=None, residual=None, bias=None, lists: bool = False,
              consts: torch.Tensor | None = None):
    """The mixed Gated-MLP of one token ``x [1, d_model]`` (the module docstring): fp32 partials ``[P, d_model]``
    whose sum is its output, or with ``residual`` h, h + output (+ ``bias``) in h's dtype. Weights as (int32 words
    [N, K / 8], scale, offset): ``gate_up_high`` the stacked high planes [2 d_inter, d_model], ``gate_low`` /
    ``up_low`` the low planes [d_inter, d_model], ``down_high`` [d_model, d_inter]; ``down_low_t`` (codes uint8
    [d_inter, d_model / 2], scale and offset [d_inter / G, d_model]). ``cut``: one fp32 value; ``count`` = (kept,
    rows): the refined rows added to Sparsity-Real's counters (``1 - kept / rows``: the share left at 4 bits).
    ``lists``: also the select's (IDX, CNT) (tests). ``consts`` (fp32 [4, d_inter], ``patch.mixed_mlp.error_constants``):
    rows ranked by rank=error's expected refinement (``row_score``) instead of ``|act(g~) u~|``; ``cut`` on its scale."""
    sel_cfg, cfg = _config(config, x.device)
    d_inter = gate_low[0].shape[0]
    gu = gemv.launch(x.reshape(1, -1), *gate_up_high).view(-1, 2, d_inter)
    slices = down_slices(down_high[0].shape[0], cfg) if residual is not None else 0
    mode, xr = ("dual", None) if consts is None else ("error", x.reshape(-1))
    idx, _, cnt, counters = select(gu, d_inter, cut, mode, activation, count, sel_cfg, slices, consts, xr)
    low_gate_up(x.reshape(1, -1), gate_low, up_low, idx, cnt, gu, sel_cfg["SET"], cfg)
    q = gemv.launch(gu, *down_high, activation=activation, late=bool(cfg["D_EARLY"]),  # low_down reads gu early
                    config={"PER_SM": cfg["Q_PER_SM"]} if cfg["Q_PER_SM"] else None)
    y = low_down(idx, cnt, counters, gu, q, down_low_t, activation, sel_cfg["SET"], cfg, residual, bias)
    return (y, idx, cnt) if lists else y


@torch.library.custom_op("countdown::int4_nested_mixed_mlp", mutates_args=("kept", "rows"))
def _mixed_mlp_op(x: torch.Tensor, gu_w: torch.Tensor, gu_sc: torch.Tensor, gu_of: torch.Tensor, gl_w: torch.Tensor,
                  gl_sc: torch.Tensor, gl_of: torch.Tensor, ul_w: torch.Tensor, ul_sc: torch.Tensor,
                  ul_of: torch.Tensor, dh_w: torch.Tensor, dh_sc: torch.Tensor, dh_of: torch.Tensor,
                  dl_q: torch.Tensor, dl_sc: torch.Tensor, dl_of: torch.Tensor, cut: torch.Tensor, activation: str,
                  kept: torch.Tensor, rows: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None,
                  consts: torch.Tensor | None = None) -> torch.Tensor:
    # h + the mixed MLP's output (+ bias): a decode step's residual add in the last launch; consts: rank=error
    return mixed_mlp(x, (gu_w, gu_sc, gu_of), (gl_w, gl_sc, gl_of), (ul_w, ul_sc, ul_of), (dh_w, dh_sc, dh_of),
                     (dl_q, dl_sc, dl_of), cut, activation, op_count(kept, rows), residual=h, bias=bias,
                     consts=consts)


@_mixed_mlp_op.register_fake
def _(x, gu_w, gu_sc, gu_of, gl_w, gl_sc, gl_of, ul_w, ul_sc, ul_of, dh_w, dh_sc, dh_of, dl_q, dl_sc, dl_of, cut,
      activation, kept, rows, h, bias, consts=None):
    return torch.empty_like(h)


def keep_of_lists(idx: torch.Tensor, cnt: torch.Tensor, d_inter: int, set_rows: int) -> torch.Tensor:
    """The keep mask [d_inter] of the select kernel's lists (rows ``idx[b SET + m]``, m < ``cnt[b]``)."""
    keep = torch.zeros(d_inter, dtype=torch.bool)
    idx, cnt = idx.cpu().long(), cnt.cpu().long()
    for b, c in enumerate(cnt.tolist()):
        keep[idx[b * set_rows: b * set_rows + c]] = True
    return keep


def mixed_mlp_kernel_ref(x: torch.Tensor, gate, up, down, keep: torch.Tensor, activation: str = "silu"):
    """float64 output [d_model] of the mixed MLP of one token with the rows ``keep`` [d_inter] refined (NestedWeight
    gate / up / down): ``patch.mixed_mlp.mixed_mlp_ref`` with the kernels' activation."""
    from ...int4.nested import mixed_mlp_ref

    return mixed_mlp_ref(x.reshape(1, -1), gate, up, down, lambda g: act_torch(g, activation),
                         keep.reshape(1, -1)).reshape(-1)
