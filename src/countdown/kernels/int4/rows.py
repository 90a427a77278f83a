"""Triton kernels: the kept rows of a 4-bit Gated-MLP for one token (sparse rows on 4-bit weights).

On a 4-bit model (``countdown.int4``), for one token x whose indicator GEMV has already run (``gemv.py``,
fp32 partial sums over slices of K):

    "abs"     (mono)  ind = u = x W_up~^T      keep |u| > t          g of the kept rows from their W_gate~ rows
    "abs_act" (cats)  ind = g = x W_gate~^T    keep |act(g)| > t     u of the kept rows from their W_up~ rows
    "dual"    (dual)  ind = (g, u), both       keep |act(g) u| > t   (nothing more to compute)
    s[i] = u[i] act(g[i])                      kept rows only
    P[b] = sum over the kept rows of row set b of s[i] Wd~t[i]      fp32 partials [n_parts, d_model]

and y = P.sum(0) is left to the caller, or with a residual h the down launch's last programs write h + y (+ bias)
in h's dtype (a decode step's residual add, ``decode_add_partials``'s arithmetic, without a launch of its own).
Wd~t is W_down^T in the 4-bit format, ``[d_inter, d_model]`` with groups along d_model: a kept row is one
contiguous run of d_model / 2 bytes and d_model / G scales and offsets, so a skipped row is bytes not read. (In
W_down's own layout, groups along d_inter, a row of W_down^T is one nibble of every word: nothing could be skipped;
docs/int4.md measures what the transposed grouping costs in quality.) Bytes a token: the indicator's matrix
in full (both for dual), then for each kept row one row of the other matrix (not for dual) and one row of Wd~t.

Three launches for mono / cats, two for dual, each shaped like a GEMV rather than like a loop over chunks:

* **select** (one program per set of SET rows): sums the indicator's partials CHUNK rows at a time, keeps the rows
  past the threshold and writes them compacted (``IDX``: row numbers, ``SV``: their indicator, s for dual), in row
  order, at the set's own offset, and their count (``CNT``). It counts its kept rows (Sparsity-Real, ``jit_helpers.add_count``).
* **other** (``rows_other.py``, mono / cats): the other GEMV on the kept rows only, the dense 4-bit GEMV's
  arithmetic and shape of work (a slice of x a program, tiles of kept rows): fp32 partial sums at the lists'
  positions.
* **down** (``rows_down.py``, a grid of SUB sets x column slices of SLICE words): s of each kept row (from SV
  and the other GEMV's partials), then row streams of the kept rows of Wd~t (one warp a program by default), UR rows
  of a stream summed inside each thread as fp16x2 products of the nibbles and s' = s scale 2**e (e per stream and
  group), then added to fp32 accumulators: fp32 partials.

Each launches with PDL where the decode step has it on (``jit_helpers.py``): each waits for the previous kernel at its
start, so only the launch gap is saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import act_code, act_torch, op_count, pow2
from ..config import LAUNCH, launch_config, launch_kwargs, launching, pdl_mode
from ..jit_helpers import KEEP_RULES, act, act_grad, add_count, gdc_launch_dependents, gdc_wait
from .rows_down import column_slices, down
from .rows_other import other

RULES = ("abs", "abs_act", "dual")  # the keep rules served (jit_helpers.KEEP_RULES)
# Launch configuration: config.LAUNCH["int4_rows"], the fastest of benchmarks/int4_decode.py --parts rows at the
# Llama-3.1-8B MLP for mono at k = 0.7 (H200; results/int4/rows.csv). UR = 32 rows a stream: 8-9 % faster a sparse
# MLP than 16, its fp16 sums of a tile's rows adding about 0.17 % of the MLP's output in rounding (below 3e-3 in the
# float64 tests) against a worst case of 33 2**-11 of a column's |terms|. EARLY = 1 (mono / cats with PDL on): the
# other GEMV lets the down kernel launch only once past its own wait, and down reads the row lists, the counts and
# its first tiles' words before its wait, the other GEMV's partials after it (docs/int4.md).


@triton.jit
def rows_select_kernel(IND, IDX, SV, CNT, THR, KEPT, ROWS, LOCK, d_inter, ind_stride, n_locks, CONSTS, X, d_model,
                       MODE: tl.constexpr, ACT: tl.constexpr, S: tl.constexpr, CHUNK: tl.constexpr, SET: tl.constexpr,
                       COUNT: tl.constexpr, NL: tl.constexpr, XB: tl.constexpr = 16, PDL: tl.constexpr = 0):
    if PDL:  # launched early (PDL): everything below reads the indicator GEMV's output
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    if NL > 0:  # the down kernel's counters of finished programs (its residual add), zero before it starts
        if b == 0:
            li = tl.arange(0, NL)
            tl.store(LOCK + li, tl.zeros([NL], dtype=tl.int32), mask=li < n_locks)
    set0 = b * SET
    thr = tl.load(THR).to(tl.float32)
    if MODE == 5:  # error: |x|^2, each program on its own (x is d_model values, from L2)
        xs = tl.zeros([XB], dtype=tl.float32)
        for x0 in range(0, d_model, XB):
            xi = x0 + tl.arange(0, XB)
            xv = tl.load(X + xi, mask=xi < d_model, other=0.0).to(tl.float32)
            xs += xv * xv
        x2 = tl.sum(xs, axis=0)
        thr = thr * thr  # the score compared squared
    cr = tl.arange(0, CHUNK)
    n = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), axis=0)
    for c0 in tl.static_range(0, SET, CHUNK):
        r = set0 + c0 + cr
        rm = r < d_inter
        a = tl.zeros([CHUNK], dtype=tl.float32)
        g2 = tl.zeros([CHUNK], dtype=tl.float32)
        for i in tl.static_range(S):  # the indicator GEMV's partial sums over its slices of K
            a += tl.load(IND + i * ind_stride + r, mask=rm, other=0.0)
            if MODE >= 4:  # dual, error
                g2 += tl.load(IND + i * ind_stride + d_inter + r, mask=rm, other=0.0)
        if MODE == 2:  # abs
            ind = a                      # u
        elif MODE == 3:  # abs_act
            ind = act(a, ACT)            # act(g)
        elif MODE == 4:
            ind = act(a, ACT) * g2       # s = act(g) u
            a = ind
        else:  # error (patch/mixed_mlp.row_score), squared: x2 (sig_up^2 h^2 + sig_gate^2 (u act'(g))^2) hd^2 + s^2 ld^2
            h = act(a, ACT)
            su = tl.load(CONSTS + r, mask=rm, other=0.0)
            sg = tl.load(CONSTS + d_inter + r, mask=rm, other=0.0)
            hd = tl.load(CONSTS + 2 * d_inter + r, mask=rm, other=0.0)
            ld = tl.load(CONSTS + 3 * d_inter + r, mask=rm, other=0.0)
            dg = sg * g2 * act_grad(a, ACT)
            sv = h * g2
            ind = x2 * (su * su * h * h + dg * dg) * (hd * hd) + sv * sv * (ld * ld)
            a = sv
        keep = (tl.abs(ind) > thr) & rm
        ki = keep.to(tl.int32)
        pos = set0 + n + tl.cumsum(ki, axis=0) - 1
        tl.store(IDX + pos, r, mask=keep)
        tl.store(SV + pos, a, mask=keep)   # u (mono), g (cats) or s (dual)
        n += tl.sum(ki, axis=0)
    tl.store(CNT + b, n)
    if COUNT:
        add_count(KEPT, ROWS, n, d_inter, b == 0)


def _words(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int32 words [N, K / 8], scale, offset) of an Int4Weight-like object (qweight, scale, offset)."""
    return weight.qweight.view(torch.int32), weight.scale, weight.offset


def _config(config: dict | None) -> dict:
    cfg = launch_config("int4_rows", extra=config)
    cfg["CHUNK"] = min(cfg["CHUNK"], cfg["SET"])
    if cfg["SET"] % cfg["CHUNK"]:
        raise ValueError(f"SET ({cfg['SET']}) must be a multiple of CHUNK ({cfg['CHUNK']})")
    if cfg["AHEAD"] not in (1, 2):
        raise ValueError(f"AHEAD (tiles of words in flight) is 1 or 2, got {cfg['AHEAD']}")
    if cfg["EARLY"] not in (0, 1):
        raise ValueError(f"EARLY (down reads the lists before its PDL wait) is 0 or 1, got {cfg['EARLY']}")
    known = LAUNCH["int4_rows"]
    unknown = set(cfg) - set(known)
    if unknown:
        raise ValueError(f"unknown kept-rows launch setting(s) {sorted(unknown)}: the settings are {sorted(known)}")
    for key in ("SUB", "O_SUB", "O_R", "UR", "NW"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 1):
            raise ValueError(f"{key} is a positive integer, got {cfg[key]!r}")
    return cfg


def kept_rows(ind: torch.Tensor, x: torch.Tensor, other, down_t, threshold: torch.Tensor, mode: str,
              activation: str = "silu", count: tuple[torch.Tensor, torch.Tensor] | None = None,
              config: dict | None = None, residual: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 partials ``[P, d_model]`` whose sum over P is the sparse MLP's output for one token ``x [1, d_model]``;
    with a ``residual`` h [1, d_model], h + that output (+ ``bias``) in h's dtype instead (the same launches).

    ``ind``: the indicator GEMV's fp32 partial sums, ``[S, d_inter]`` (u for mode "abs", g for "abs_act") or
    ``[S, 2, d_inter]`` (g and u, mode "dual"); ``other``: the 4-bit weight (``qweight``, ``scale``, ``offset``) whose
    kept rows are computed (W_gate for "abs", W_up for "abs_act"; None for "dual"); ``down_t``: W_down^T in the
    format, ``[d_inter, d_model]``; ``threshold``: a one-value fp32 tensor; ``count`` = (kept, rows): the kept rows
    added to a patched layer's Sparsity-Real counters."""
    if mode not in RULES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(RULES)}")
    words_d, sc_d, of_d = _words(down_t)
    words_o, sc_o, of_o = _words(other) if other is not None else (None, None, None)
    return launch(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, mode, activation, count, config,
                  residual, bias)


def launch(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, mode, activation="silu", count=None,
           config=None, residual=None, bias=None) -> torch.Tensor:
    """:func:`kept_rows` on the weights' tensors (words int32 [d_inter, d_model / 8], scales, offsets; the other
    weight's None for mode "dual")."""
    d_inter, n_words = words_d.shape
    d_model = 8 * n_words
    dual = mode == "dual"
    want = (2 * d_inter) if dual else d_inter
    if ind.dtype != torch.float32 or ind.numel() % want or x.numel() != d_model or (words_o is None) != dual:
        raise ValueError(f"kept_rows takes fp32 indicator partials [S, {'2, ' if dual else ''}{d_inter}], one token x "
                         f"[1, {d_model}] and {'no other weight' if dual else 'the other weight'} for mode {mode!r}; "
                         f"got ind {ind.dtype} {tuple(ind.shape)}, x {tuple(x.shape)}")
    if words_o is not None:
        if words_o.shape != words_d.shape or sc_o.shape != sc_d.shape:
            raise ValueError(f"the other weight's rows must match W_down^T's: words {tuple(words_o.shape)} vs "
                             f"{tuple(words_d.shape)}, scales {tuple(sc_o.shape)} vs {tuple(sc_d.shape)}")
    cfg = _config(config)
    slices = column_slices(n_words, sc_d.shape[1], cfg)[1] if residual is not None else 0
    idx, sv, cnt, counters = select(ind, d_inter, threshold, mode, activation, count, cfg, slices)
    o = None if dual else other(x, words_o, sc_o, of_o, idx, cnt, cfg)
    return down(idx, sv, cnt, counters, words_d, sc_d, of_d, cfg, o, mode, activation, residual, bias)


def select(ind, d_inter, threshold, mode, activation, count, cfg, slices=0, consts=None, x=None):
    """The select kernel: (IDX, SV, CNT, counters), the kept rows of each set of ``cfg["SET"]`` rows compacted (row
    numbers and the indicator: u for mono, g for cats, s for dual and error), their count per set, and ``slices``
    int32 zeros (the down kernel's counters for its residual add: :func:`column_slices`). Mode "error" (dual[mixed]'s
    rank=error) keeps the rows whose expected refinement ``patch.mixed_mlp.row_score`` exceeds the threshold, from g,
    u, the token ``x`` and ``consts`` (fp32 [4, d_inter], ``error_constants``). (Spy hook: ``on_launch("int4_rows",
    ind, mode)``.)"""
    n_sets = -(-d_inter // cfg["SET"])
    want = (2 * d_inter) if mode in ("dual", "error") else d_inter
    if mode == "error" and (consts is None or x is None or consts.shape != (4, d_inter)
                            or consts.dtype != torch.float32):
        raise ValueError(f"mode 'error' needs the token x and fp32 consts [4, {d_inter}] (error_constants); got "
                         f"{None if consts is None else (consts.dtype, tuple(consts.shape))}")
    idx = torch.empty(n_sets * cfg["SET"], dtype=torch.int32, device=ind.device)
    sv = torch.empty(n_sets * cfg["SET"], dtype=torch.float32, device=ind.device)
    cnt = torch.empty(n_sets, dtype=torch.int32, device=ind.device)
    counters = torch.empty(max(1, slices), dtype=torch.int32, device=ind.device)
    kept, rows = count if count is not None else (cnt, cnt)
    pdl = pdl_mode(ind)
    launching("int4_rows", ind, mode)
    rows_select_kernel[(n_sets,)](
        ind.contiguous(), idx, sv, cnt, threshold.reshape(1).to(device=ind.device, dtype=torch.float32), kept, rows,
        counters, d_inter, want, slices, consts if consts is not None else ind, x if x is not None else ind,
        x.numel() if x is not None else 0, MODE=KEEP_RULES[mode], ACT=act_code(activation), S=ind.numel() // want,
        CHUNK=cfg["CHUNK"], SET=cfg["SET"], COUNT=count is not None, NL=pow2(slices) if slices else 0,
        XB=min(1024, pow2(x.numel())) if x is not None else 16, PDL=pdl,
        num_warps=cfg["A_WARPS"], num_stages=1, **launch_kwargs(pdl))
    return idx, sv, cnt, counters


@torch.library.custom_op("countdown::int4_kept_rows", mutates_args=("kept", "rows"))
def _kept_rows_op(ind: torch.Tensor, x: torch.Tensor, words_o: torch.Tensor, sc_o: torch.Tensor, of_o: torch.Tensor,
                  words_d: torch.Tensor, sc_d: torch.Tensor, of_d: torch.Tensor, threshold: torch.Tensor,
                  keep_rule: str, activation: str, kept: torch.Tensor, rows: torch.Tensor, h: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    # (the rule is not called "mode": torch.compile's functionalization of a mutating op takes a "mode" of its own)
    # h + the sparse MLP's output (+ bias): a decode step's residual add in the down launch
    other = (None, None, None) if keep_rule == "dual" else (words_o, sc_o, of_o)
    return launch(ind, x, *other, words_d, sc_d, of_d, threshold, keep_rule, activation, op_count(kept, rows),
                  residual=h, bias=bias)


@_kept_rows_op.register_fake
def _(ind, x, words_o, sc_o, of_o, words_d, sc_d, of_d, threshold, keep_rule, activation, kept, rows, h, bias):
    return torch.empty_like(h)


def kept_rows_ref(x: torch.Tensor, gate, up, down_t, threshold: float, mode: str, activation: str = "silu",
                  ind: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [d_model], keep [d_inter]) in float64 from the de-quantized weights (``Int4Weight``-like objects with
    ``dequantize``): what :func:`kept_rows` computes, with every product and sum exact to float64. ``ind``: the
    indicator GEMV's partials as the kernel takes them; the rows kept are then decided on their float32 sum, as the
    kernel decides them (the float64 indicator otherwise)."""
    x64 = x.reshape(-1).double()
    g = gate.dequantize(torch.float64) @ x64
    u = up.dequantize(torch.float64) @ x64
    h = act_torch(g, activation)
    if ind is None:
        decide = {"abs": u, "abs_act": h, "dual": h * u}[mode]
    else:
        total = ind.float().sum(0).cpu()
        decide = {"abs": lambda: total, "abs_act": lambda: act_torch(total, activation),
                  "dual": lambda: act_torch(total[0], activation) * total[1]}[mode]()
    keep = decide.abs() > threshold
    s = torch.where(keep, u * h, torch.zeros((), dtype=torch.float64))
    return down_t.dequantize(torch.float64).t() @ s, keep
