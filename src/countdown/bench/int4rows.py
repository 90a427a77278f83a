"""Sparse rows on 4-bit weights, the kernel alone (kernels/_int4_rows.py), and the memory they take
(``benchmarks/int4_decode.py --parts rows,memory``).

:func:`kernel_rows`: one Gated-MLP of the Llama-3.1-8B shape (4096 x 14336, RTN group 128, random weights, bf16
activations, one token), weight copies cycled past the L2 cache. For mono and dual at each k: the dense MLP as the
4-bit step runs it (stacked gate/up GEMV, down GEMV reading its partials, the residual add summing the down GEMV's
partials) against the sparse one (the indicator's GEMV, the kept-rows kernel, the residual add summing its
partials), for every launch configuration of the kept-rows kernel in the grid (each checked against the default
configuration's output first); microseconds and the ratio to the bytes' roofline; the fastest configuration per
method written to ``<out>/rows_best.json`` (``int4_decode.py --rows-config`` takes it). Rows append to
``<out>/rows.csv``: ``run, device, date, method, sparsity, config, us, dense_us, bytes, roofline_ratio``.

:func:`memory_rows`: the 8B shape's bytes in memory (bf16, 4-bit, 4-bit with a W_down^T per layer for sparse rows,
beside W_down or instead of it), by arithmetic on the format's sizes on the meta device: ``<out>/memory.csv``
(``run, date, what, bytes, share_of_bf16``).
"""

from __future__ import annotations

import csv
import itertools
import math
import os

import torch

from ..int4 import Int4Linear, quantize_rtn, stack
from ..int4.format import nbytes

GROUP = 128
GRID = {"ROWWISE": (False, True), "CHUNK": (64, 128), "BM": (4, 8, 16), "PER_SM": (1, 2), "num_warps": (4, 8)}  # 48
SMOKE_GRID = {"ROWWISE": (False, True), "CHUNK": (64,), "BM": (4,), "PER_SM": (1,), "num_warps": (4,)}
RULES = {"mono": "abs", "dual": "dual"}


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


def kernel_rows(device, shape, ks, grid, stamp, out, bw):
    """See the module docstring."""
    from ..kernels import _int4, _int4_rows, _rmsnorm  # noqa: F401  (Triton; _rmsnorm registers decode_add_partials)

    d_model, d_inter = shape
    per_mlp = 3 * nbytes(d_inter, d_model, GROUP)
    sets = max(2, math.ceil((256 << 20) / per_mlp)) if device == "cuda" else 1
    mlps = [make_mlp(d_model, d_inter, device, seed) for seed in range(sets)]
    x = torch.randn(1, d_model, device=device, dtype=torch.bfloat16)
    h = torch.randn(1, d_model, device=device, dtype=torch.bfloat16)

    def dense(gu_mod, down, _):
        gu = _int4.launch(x, *words(gu_mod))
        return torch.ops.countdown.decode_add_partials(h, _int4.launch(gu.view(gu.shape[0], 2, -1), *words(down),
                                                                       "silu"), None)

    from .timing import time_graph

    dense_us = time_graph([lambda m=m: dense(*m) for m in mlps])
    roof_dense = per_mlp / bw * 1e6
    log(f"dense MLP {dense_us:7.1f} us ({dense_us / roof_dense:.2f}x roofline, {per_mlp / 1e6:.1f} MB)")
    best = {}
    for method, k in itertools.product(RULES, ks):
        rule = RULES[method]
        gate_up0 = mlps[0][0]
        gate, up = gate_up0.stacked_from

        def indicator(gu_mod):
            g, u = gu_mod.stacked_from
            if rule == "abs":
                return _int4.launch(x, *words(u))
            gu = _int4.launch(x, *words(gu_mod))
            return gu.view(gu.shape[0], 2, -1)

        ind0 = indicator(gate_up0)
        total = ind0.float().sum(0)
        values = total if rule == "abs" else torch.nn.functional.silu(total[0]) * total[1]
        thr = values.abs().flatten().kthvalue(max(1, int(k * values.numel()))).values.reshape(1)

        def sparse(gu_mod, down, down_t, cfg):
            other = None if rule == "dual" else gu_mod.stacked_from[0]
            p = _int4_rows.kept_rows(indicator(gu_mod), x, other, down_t, thr, rule, config=cfg)
            return torch.ops.countdown.decode_add_partials(h, p, None)

        want = sparse(*mlps[0], None)
        read = (1 if rule == "abs" else 2) * nbytes(d_inter, d_model, GROUP) \
            + (1 - k) * (2 if rule == "abs" else 1) * nbytes(d_inter, d_model, GROUP)
        results = []
        for values_ in itertools.product(*grid.values()):
            cfg = dict(zip(grid, values_))
            try:
                got = sparse(*mlps[0], cfg)
                if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max())):
                    log(f"  {method} k={k} {cfg}: output differs, skipped")
                    continue
                us = time_graph([lambda m=m: sparse(*m, cfg) for m in mlps])
            except Exception as e:  # noqa: BLE001  (a configuration that does not compile or fit)
                log(f"  {method} k={k} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            results.append((us, cfg))
            append(os.path.join(out, "rows.csv"), {**stamp, "method": method, "sparsity": k, "config": str(cfg),
                                                    "us": round(us, 2), "dense_us": round(dense_us, 2),
                                                    "bytes": int(read), "roofline_ratio": round(us / (read / bw * 1e6), 3)
                                                    if bw == bw else ""})
        results.sort(key=lambda r: r[0])
        for us, cfg in results[:3]:
            log(f"  {method} k={k} {us:7.1f} us ({dense_us / us:.2f}x dense) {cfg}")
        if results:
            us, cfg = results[0]
            log(f"rows {method} k={k}: best {us:.1f} us = {dense_us / us:.2f}x the dense MLP; bytes {read / 1e6:.1f} MB "
                f"(at most {per_mlp / read:.2f}x by bytes); {cfg}")
            best.setdefault(method, (us, cfg))
    # the fastest configuration of the first method, for benchmarks/int4_decode.py --rows-config <out>/rows_best.json
    if best:
        import json

        with open(os.path.join(out, "rows_best.json"), "w") as f:
            json.dump({m: cfg for m, (_, cfg) in best.items()}, f)


def memory_rows(stamp: dict, out: str) -> None:
    """What the 8B shape holds (arithmetic on the format's sizes; the model built on the meta device)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ..data.models import shape_config_dict

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


