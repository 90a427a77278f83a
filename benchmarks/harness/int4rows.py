"""Sparse rows on 4-bit weights, the kernel alone (kernels/int4/rows.py), and the memory they take
(``benchmarks/int4_decode.py --parts rows,memory``).

:func:`kernel_rows`: one Gated-MLP of the Llama-3.1-8B shape (4096 x 14336, RTN group 128, random weights, bf16
activations, one token), weight copies cycled past the L2 cache. The dense MLP as the 4-bit step runs it (stacked
gate/up GEMV, down GEMV reading its partials, the residual add summing the down GEMV's partials) against the sparse
one (the indicator's GEMV, the select, other (mono) and down kernels, the residual add in the down launch). Launch
configurations are swept in stages at the first k (stage ``down``: the down kernel's grid on mono; ``select``: the
select kernel's on mono and dual with the best down configuration; ``other``: the other GEMV's on mono; each
checked against the default configuration's output first), then each method's best is timed at every k (stage
``best``; dual also at k = 0, every row kept: the dense decode of a W_down held transposed) with its parts
(indicator, select, other, down and add) by difference. Microseconds and the ratio to the bytes' roofline; the best
configuration per method in ``<out>/rows_best.json`` (``int4_decode.py --rows-config`` takes it). Rows append to
``<out>/rows.csv``: ``run, device, date, stage, method, sparsity, config, us, dense_us, bytes, roofline_ratio``;
stages ``alone:select`` / ``alone:other`` / ``alone:down`` time each kernel alone on inputs computed once (bytes:
the kept rows it reads). Runs before R7 computed the other GEMV inside the select kernel: their ``select`` part
holds both.

:func:`memory_rows`: the 8B shape's bytes in memory (bf16, 4-bit, 4-bit with a W_down^T per layer for sparse rows,
beside W_down or instead of it), by arithmetic on the format's sizes on the meta device: ``<out>/memory.csv``
(``run, date, what, bytes, share_of_bf16``).
"""

from __future__ import annotations

import csv
import math
import os

import torch

from countdown.int4 import Int4Linear, quantize_rtn, stack
from countdown.int4.format import nbytes

GROUP = 128
# The kept-rows kernels' launch configurations (kernels/int4/rows.py: select, other, down), swept in stages: the
# down kernel's (SUB sets a program, NW row streams of UR rows, column slices of SLICE words, AHEAD tiles of words in
# flight; NW = 2 lost to 1 at every point of run R5, AHEAD = 1 to 2 in R6-R8) with the others' defaults, then the
# select kernel's (SET rows a program on A_WARPS warps; SUB follows SET so that a down program keeps its rows; SET =
# 32 lost in runs R4 / R5) on mono and dual, then the other GEMV's on mono (O_SUB sets a program, tiles of O_R rows,
# slices of O_COLS columns; O_WARPS = 8 lost to 4 at every point of R8).
DOWN_GRID = [dict(SUB=sub, UR=ur, NW=1, SLICE=sl, AHEAD=2) for sub in (2, 4, 8) for ur in (16, 32)
             for sl in (16, 32)]                                                                                # 12
SELECT_GRID = [dict(SET=st, A_WARPS=w) for st in (64, 128) for w in (4, 8)]                                     # 4
OTHER_GRID = [dict(O_SUB=sub, O_R=r, O_COLS=cols, O_WARPS=4) for sub in (1, 2) for r in (8, 16)
              for cols in (1024, 2048)]                                                                         # 8
SMOKE_DOWN = [dict(SUB=1, UR=2, NW=1, SLICE=128), dict(SUB=2, UR=4, NW=2, SLICE=128, AHEAD=2)]
SMOKE_SELECT = [dict(SET=64, A_WARPS=1), dict(SET=128, A_WARPS=2)]
SMOKE_OTHER = [dict(O_SUB=1, O_R=4, O_COLS=128, O_WARPS=1), dict(O_SUB=2, O_R=8, O_COLS=256, O_WARPS=2)]
RULES = {"mono": "abs", "dual": "dual"}
FIELDS = ["run", "device", "date", "stage", "method", "sparsity", "config", "us", "dense_us", "bytes",
          "roofline_ratio"]


def log(msg: str) -> None:
    print(msg, flush=True)


def append(path: str, row: dict) -> None:
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        if new:
            w.writeheader()
        w.writerow(row)


def make_mlp(d_model: int, d_inter: int, device: str, seed: int):
    """(stacked gate/up, down, W_down^T) of one random 4-bit MLP."""
    g = torch.Generator(device=device).manual_seed(seed)

    def linear(n, k):
        return Int4Linear.from_weight(quantize_rtn(torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16)
                                                   / k ** 0.5, GROUP), dtype=torch.bfloat16)

    gate, up, down = linear(d_inter, d_model), linear(d_inter, d_model), linear(d_model, d_inter)
    return stack([gate, up]), down, quantize_rtn(down.weight.t().contiguous(), GROUP)


def words(m):
    return m.qweight.view(torch.int32), m.scale, m.offset


class _Case:
    """One method at one k on the MLP copies: its threshold, its calls and the bytes a token reads."""

    def __init__(self, method, k, mlps, x, h, per_matrix):
        self.rule, self.mlps, self.x, self.h = RULES[method], mlps, x, h
        ind0 = self.indicator(mlps[0][0])
        total = ind0.float().sum(0)
        values = total if self.rule == "abs" else torch.nn.functional.silu(total[0]) * total[1]
        self.thr = (values.abs().flatten().kthvalue(max(1, int(k * values.numel()))).values if k > 0
                    else torch.tensor(float("-inf"), device=x.device)).reshape(1).float()
        self.bytes = (1 if self.rule == "abs" else 2) * per_matrix + (1 - k) * (2 if self.rule == "abs" else 1) \
            * per_matrix

    def indicator(self, gu_mod):
        from countdown.kernels.int4 import gemv as _int4

        if self.rule == "abs":
            return _int4.launch(self.x, *words(gu_mod.stacked_from[1]))
        gu = _int4.launch(self.x, *words(gu_mod))
        return gu.view(gu.shape[0], 2, -1)

    def run(self, gu_mod, down, down_t, cfg, upto="all"):
        """The sparse MLP as the step runs it: the indicator GEMV, select, other (mono), down, the residual add
        (``upto``: stop after "indicator", "select" or "other", for the parts' times)."""
        from countdown.kernels.int4 import rows as _int4_rows

        ind = self.indicator(gu_mod)
        if upto == "indicator":
            return ind
        full = _int4_rows._config(cfg)
        picked = _int4_rows.select(ind, down_t.qweight.shape[0], self.thr, self.rule, "silu", None, full,
                                   self.slices(down_t, full))
        if upto == "select":
            return picked
        o = self.other_rows(gu_mod, picked, full)
        if upto == "other":
            return o
        return _int4_rows.down(*picked, *words(down_t), full, o, self.rule, residual=self.h)

    @staticmethod
    def slices(down_t, full):
        """The down kernel's column slices (the select kernel zeroes a counter for each)."""
        from countdown.kernels.int4 import rows_down as _int4_rows_down

        return _int4_rows_down.column_slices(words(down_t)[0].shape[1], down_t.scale.shape[1], full)[1]

    def other_rows(self, gu_mod, picked, full):
        """The other GEMV's partials on the kept rows (mono: W_gate's); None for dual."""
        from countdown.kernels.int4 import rows as _int4_rows

        if self.rule == "dual":
            return None
        return _int4_rows.other(self.x, *words(gu_mod.stacked_from[0]), picked[0], picked[2], full)

    def time(self, cfg, upto="all"):
        from .timing import time_graph

        return time_graph([lambda m=m: self.run(*m, cfg, upto) for m in self.mlps])

    def alone(self, cfg):
        """Microseconds of the select, other and down kernels each alone, on inputs computed once per weight copy
        (the indicator's partials; select's row lists; the other GEMV's partials). Other: 0 for dual."""
        from countdown.kernels.int4 import rows as _int4_rows
        from .timing import time_graph

        full = _int4_rows._config(cfg)
        n = len(self.mlps)
        inds = [self.indicator(m[0]) for m in self.mlps]
        d_inter = self.mlps[0][2].qweight.shape[0]

        def select(i):
            return _int4_rows.select(inds[i], d_inter, self.thr, self.rule, "silu", None, full,
                                     self.slices(self.mlps[i][2], full))

        picked = [select(i) for i in range(n)]
        others = [self.other_rows(self.mlps[i][0], picked[i], full) for i in range(n)]
        select_us = time_graph([lambda i=i: select(i) for i in range(n)])
        other_us = 0.0 if self.rule == "dual" else time_graph(
            [lambda i=i: self.other_rows(self.mlps[i][0], picked[i], full) for i in range(n)])
        down_us = time_graph([lambda i=i: _int4_rows.down(*picked[i], *words(self.mlps[i][2]), full, others[i],
                                                          self.rule, residual=self.h) for i in range(n)])
        return select_us, other_us, down_us


def kernel_rows(device, shape, ks, grids, stamp, out, bw):
    """See the module docstring. ``grids`` = (down, select, other configurations)."""
    from countdown.kernels.config import launch_config
    from countdown.kernels.decode_step import rmsnorm  # noqa: F401  (Triton; registers decode_add_partials)
    from countdown.kernels.int4 import gemv as _int4
    from .timing import time_graph

    down_grid, select_grid, other_grid = grids
    d_model, d_inter = shape
    per_matrix = nbytes(d_inter, d_model, GROUP)
    sets = max(2, math.ceil((256 << 20) / (3 * per_matrix))) if device == "cuda" else 1
    mlps = [make_mlp(d_model, d_inter, device, seed) for seed in range(sets)]
    x = torch.randn(1, d_model, device=device, dtype=torch.bfloat16)
    h = torch.randn(1, d_model, device=device, dtype=torch.bfloat16)

    def dense(gu_mod, down, _):
        gu = _int4.launch(x, *words(gu_mod))
        return torch.ops.countdown.decode_add_partials(h, _int4.launch(gu.view(gu.shape[0], 2, -1), *words(down),
                                                                       "silu"), None)

    dense_us = time_graph([lambda m=m: dense(*m) for m in mlps])
    roof = lambda n: n / bw * 1e6  # noqa: E731
    log(f"dense MLP {dense_us:7.1f} us ({dense_us / roof(3 * per_matrix):.2f}x roofline, "
        f"{3 * per_matrix / 1e6:.1f} MB)")

    def record(stage, method, k, case, cfg, us, read=None):
        read = case.bytes if read is None else read
        append(os.path.join(out, "rows.csv"), {**stamp, "stage": stage, "method": method, "sparsity": k,
                                               "config": str(cfg), "us": round(us, 2), "dense_us": round(dense_us, 2),
                                               "bytes": int(read),
                                               "roofline_ratio": round(us / roof(read), 3) if bw == bw and read
                                               else ""})

    def sweep(stage, method, k, case, configs, base):
        want = case.run(*mlps[0], base).float()
        results = []
        for cfg in configs:
            full = {**base, **cfg}
            if "SET" in cfg:  # a down program keeps its rows (SET x SUB)
                full["SUB"] = max(1, base["SET"] * base["SUB"] // cfg["SET"])
            try:
                got = case.run(*mlps[0], full).float()
                if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
                    log(f"  {stage} {method} k={k} {cfg}: output differs, skipped")
                    continue
                us = case.time(full)
            except Exception as e:  # noqa: BLE001  (a configuration that does not compile or fit)
                log(f"  {stage} {method} k={k} {cfg}: {type(e).__name__}: {str(e)[:160]}")
                continue
            results.append((us, full))
            record(stage, method, k, case, full, us)
        results.sort(key=lambda r: r[0])
        for us, cfg in results[:3]:
            log(f"  {stage} {method} k={k} {us:7.1f} us {cfg}")
        return results[0][1] if results else dict(base)

    base = launch_config("int4_rows")
    k0 = ks[0]
    best_down = sweep("down", "mono", k0, _Case("mono", k0, mlps, x, h, per_matrix), down_grid, base)
    best = {}
    for method in RULES:
        best[method] = sweep("select", method, k0, _Case(method, k0, mlps, x, h, per_matrix), select_grid, best_down)
    best["mono"] = sweep("other", "mono", k0, _Case("mono", k0, mlps, x, h, per_matrix), other_grid, best["mono"])
    for method in RULES:
        for k in [*ks, 0.0] if method == "dual" else ks:  # dual at k = 0: every row kept (a W_down held transposed)
            case = _Case(method, k, mlps, x, h, per_matrix)
            cfg = best[method]
            us = case.time(cfg)
            ind_us, sel_us = case.time(cfg, "indicator"), case.time(cfg, "select")
            oth_us = case.time(cfg, "other") if case.rule == "abs" else sel_us  # (dual: no other GEMV)
            record("best", method, k, case, cfg, us)
            for part, part_us in (("indicator", ind_us), ("select", sel_us - ind_us), ("other", oth_us - sel_us),
                                  ("down_and_add", us - oth_us)):
                record(f"part:{part}", method, k, case, cfg, part_us)
            log(f"rows {method} k={k}: {us:7.1f} us = {dense_us / us:.2f}x the dense MLP ({us / roof(case.bytes):.2f}x "
                f"its bytes' roofline, {case.bytes / 1e6:.1f} MB, at most {3 * per_matrix / case.bytes:.2f}x by bytes); "
                f"indicator {ind_us:.1f}, + select {sel_us - ind_us:.1f}, + other {oth_us - sel_us:.1f}, + down and "
                f"add {us - oth_us:.1f} us; {cfg}")
            # each kernel alone, against the roofline of the rows it reads (other: the other matrix's kept rows, none
            # for dual; down: W_down^T's kept rows)
            select_alone, other_alone, down_alone = case.alone(cfg)
            kept = (1 - k) * per_matrix
            record("alone:select", method, k, case, cfg, select_alone, 0)
            if case.rule == "abs":
                record("alone:other", method, k, case, cfg, other_alone, kept)
            record("alone:down", method, k, case, cfg, down_alone, kept)
            log(f"  alone: select {select_alone:.1f} us"
                + (f", other {other_alone:.1f} us ({other_alone / roof(kept):.2f}x its rows' roofline)"
                   if case.rule == "abs" and bw == bw else "")
                + f", down {down_alone:.1f} us" + (f" ({down_alone / roof(kept):.2f}x)" if bw == bw else ""))
    import json

    with open(os.path.join(out, "rows_best.json"), "w") as f:
        json.dump(best, f)


def rows_report(out: str) -> None:
    """rows.md (per run: each method's best at each k, with its parts) and rows.png (the latest run's parts, stacked,
    against the dense MLP) from ``<out>/rows.csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(os.path.join(out, "rows.csv"), newline="")))
    lines = ["# Sparse rows on 4-bit weights: one Gated-MLP", "",
             "Llama-3.1-8B MLP (4096 x 14336, RTN group 128, random weights), one token, weight copies cycled past L2; "
             "`PYTHONPATH=src python benchmarks/int4_decode.py --parts rows` (harness.int4rows). Microseconds; "
             "the parts by difference (indicator GEMV, select kernel, other GEMV's kept rows, down kernel and residual "
             "add; before run R7 the select kernel computed the other GEMV's rows: its column holds both).", ""]
    def of_run(run):  # (each method's best at each k, {(method, k, part): us}) of one run
        return ([r for r in rows if r["run"] == run and r["stage"] == "best"],
                {(r["method"], r["sparsity"], r["stage"][5:]): float(r["us"]) for r in rows
                 if r["run"] == run and r["stage"].startswith("part:")})

    runs = list(dict.fromkeys(r["run"] for r in rows if r["stage"] == "best"))
    for run in runs:
        best, part = of_run(run)
        lines += [f"## Run {run} ({best[0]['device']}, {best[0]['date']}): dense MLP {float(best[0]['dense_us']):.1f} us",
                  "", "| method | k | MB read | us | vs dense | x roofline | indicator | select | other | down and add |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in best:
            p = [part.get((r["method"], r["sparsity"], n)) for n in ("indicator", "select", "other", "down_and_add")]
            cells = " | ".join("-" if v is None else f"{v:.1f}" for v in p)
            lines.append(f"| {r['method']} | {r['sparsity']} | {int(r['bytes']) / 1e6:.1f} | {float(r['us']):.1f} | "
                         f"{float(r['dense_us']) / float(r['us']):.2f}x | {r['roofline_ratio']} | {cells} |")
        lines.append("")
    with open(os.path.join(out, "rows.md"), "w") as f:
        f.write("\n".join(lines))
    run = runs[-1]
    best, part = of_run(run)
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['method']} k={r['sparsity']}" for r in best]
    bottom = [0.0] * len(best)
    for name in ("indicator", "select", "other", "down_and_add"):
        vals = [part.get((r["method"], r["sparsity"], name), 0.0) for r in best]
        ax.barh(labels, vals, left=bottom, label=name.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axvline(float(best[0]["dense_us"]), color="k", ls="--", label="dense 4-bit MLP")
    ax.set_xlabel("microseconds a Gated-MLP (one token)")
    ax.set_title(f"Sparse rows on 4-bit weights, run {run} ({best[0]['device']})")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "rows.png"), dpi=120)


def memory_rows(stamp: dict, out: str) -> None:
    """What the 8B shape holds (arithmetic on the format's sizes; the model built on the meta device)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from countdown.data.models import shape_config_dict

    raw = shape_config_dict("llama-3.1-8b-shape")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in raw.items() if not k.startswith("_")}),
                                                 dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    as_bf16 = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    int4 = total - as_bf16 + sum(nbytes(m.out_features, m.in_features, GROUP) for m in linears)
    downs = [m for n, m in model.named_modules() if n.endswith("down_proj")]
    down_t = sum(nbytes(m.in_features, m.out_features, GROUP) for m in downs)
    down = sum(nbytes(m.out_features, m.in_features, GROUP) for m in downs)
    for what, n in [("bf16", total), ("int4 (Linears and lm_head; embedding bf16)", int4),
                    ("int4 + W_down^T beside W_down (sparse rows as built)", int4 + down_t),
                    ("int4 with W_down^T instead of W_down", int4 - down + down_t)]:
        append(os.path.join(out, "memory.csv"), {**stamp, "what": what, "bytes": n,
                                                 "share_of_bf16": round(n / total, 4)})
        log(f"memory {what:55s} {n / 1e9:6.2f} GB  {n / total:.1%} of bf16")


