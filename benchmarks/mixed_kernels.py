"""Why the mixed MLP costs what it does: its one-token kernels alone at the Llama-3.1-8B MLP shape, per launch.

    PYTHONPATH=src:benchmarks python benchmarks/mixed_kernels.py --out DIR     # an H200: CUDA-graph times + profile
    TRITON_INTERPRET=1 PYTHONPATH=src:benchmarks python benchmarks/mixed_kernels.py --smoke   # CPU: the checks only
    PYTHONPATH=src:benchmarks python benchmarks/mixed_kernels.py --compile-check   # CPU: low_down's sm_90 registers
    PYTHONPATH=src:benchmarks python benchmarks/mixed_kernels.py --out DIR --pdl --sweep   # as a folded decode step

A tool for finding why (results/mixed/decode.md has the user's figure, through ``countdown.generate``). Random
bf16 weights [14336, 4096] quantized to the nested 8-bit format (groups of 64), several layers' worth so that no
call finds its weights in L2; per call one token and its own cut (the k-quantile of that token's |act(g~) u~|),
so exactly 1 - k of the rows are refined. Times: the dense 4-bit MLP (two GEMVs) and the mixed MLP at each k,
CUDA-graph medians (``harness.timing.time_graph``), then each launch's time from torch.profiler, and the bytes
each must read over the copy bandwidth of the same run. Every mixed output is first checked against the float64
reference of the rows the kernel kept (``mixed_mlp_kernel_ref``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os

import torch

from countdown.int4.nested import quantize_nested
from countdown.kernels.int4 import gemv
from countdown.kernels.int4.nested_rows import keep_of_lists, mixed_mlp, mixed_mlp_kernel_ref
from harness.timing import copy_bandwidth, time_graph

KS = (0.8, 0.9, 0.95)


def words(w):
    return (w.qweight.view(torch.int32), w.scale, w.offset)


def layer(d_model: int, d_inter: int, group: int, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda n, k: (torch.randn(n, k, generator=gen) * 0.02).to(device)  # noqa: E731
    gate, up = quantize_nested(mk(d_inter, d_model), group), quantize_nested(mk(d_inter, d_model), group)
    down = quantize_nested(mk(d_model, d_inter), group, low_transposed=True)
    gh, uh = gate.high, up.high
    gate_up = (torch.cat([gh.qweight, uh.qweight]).view(torch.int32), torch.cat([gh.scale, uh.scale]),
               torch.cat([gh.offset, uh.offset]))
    low = lambda w: (w.low_qweight.view(torch.int32), w.low_scale, w.low_offset)  # noqa: E731
    return dict(gate=gate, up=up, down=down, gate_up=gate_up, gate_low=low(gate), up_low=low(up),
                down_high=words(down.high), down_low_t=(down.low_qweight, down.low_scale, down.low_offset))


def cut_of(x, L, k: float, consts=None) -> torch.Tensor:
    """The k-quantile of this token's |act(g~) u~| (or with ``consts``, of its rank=error score)."""
    from countdown.patch.mixed_mlp import row_score

    d_inter = L["gate_low"][0].shape[0]
    gu = gemv.launch(x, *L["gate_up"]).sum(0).view(2, d_inter)
    s = row_score("error" if consts is not None else "shadow", torch.nn.functional.silu, "silu", x.float(),
                  gu[1][None], gu[0][None], consts).reshape(-1)
    return torch.quantile(s.float().cpu(), k).reshape(1).to(x.device)


def mixed(x, L, cut, h, lists=False, config=None, consts=None):
    return mixed_mlp(x, L["gate_up"], L["gate_low"], L["up_low"], L["down_high"], L["down_low_t"], cut, "silu",
                     residual=h, lists=lists, config=config, consts=consts)


def error_consts(L) -> torch.Tensor:
    """rank=error's four constants a row (``patch.mixed_mlp.error_constants``) of a layer's planes, fp32 [4, d_inter]."""
    rows = []
    for role in ("up", "gate"):
        w = L[role]
        rows.append(w.dequantize("low").pow(2).mean(dim=1).sqrt())
    d = L["down"]
    rows += [d.dequantize("high").pow(2).sum(dim=0).sqrt(), d.dequantize("low").pow(2).sum(dim=0).sqrt()]
    return torch.stack(rows).float().contiguous()


SWEEP = (  # each kernel's launch configuration (config.LAUNCH["int4_nested"]) varied alone, the other at its default
    [dict(L_R=r, L_COLS=c, L_WARPS=w) for r in (8, 16) for c in (1024, 4096) for w in (2, 4)]
    # low_down (nested_down.py): E = D_T D_CB / (32 D_WARPS) bytes a thread a tile (8 by default; registers ~14 E
    # with two tiles ahead, ~8 E with one); D_SUB sets a program: its tiles in one chain, the tail's NP partials; the
    # grid's registers ~ sets / D_SUB x D_T x d_model / 2 x 14: the default fits an H200 at once, D_SUB 2 ~1.5x over
    + [dict(D_CB=256, D_WARPS=8), dict(D_T=16, D_WARPS=8), dict(D_CB=64, D_WARPS=2), dict(D_CB=64, D_WARPS=4),
       dict(D_CB=32, D_WARPS=1), dict(D_T=4, D_WARPS=2), dict(D_T=16, D_CB=64), dict(D_WARPS=8),
       dict(D_SUB=2), dict(D_SUB=1), dict(D_SUB=8, D_CB=64), dict(D_SUB=2, D_CB=64, D_WARPS=4),
       dict(D_SUB=2, D_T=4, D_WARPS=2), dict(D_AHEAD=1), dict(D_AHEAD=1, D_SUB=2), dict(D_AHEAD=1, D_CB=256),
       dict(D_EARLY=0), dict(D_EARLY=0, D_SUB=2), dict(Q_PER_SM=2), dict(Q_PER_SM=2, D_SUB=2)])


def sweep(xs, layers, cuts, device) -> list[dict]:
    """k = 0.9's CUDA-graph time under each configuration of :data:`SWEEP` whose output equals the default's (which
    :func:`check` compared with float64) to bf16's rounding."""
    zero = torch.zeros_like(xs[0])
    want = mixed(xs[0], layers[0], cuts[0], zero).float()
    out = []
    for cfg in [{}] + SWEEP:
        y = mixed(xs[0], layers[0], cuts[0], zero, config=cfg).float()
        if not torch.allclose(y, want, rtol=2e-2, atol=1e-3 * want.abs().max().item()):
            print(f"  {cfg}: output differs from the default's, not timed", flush=True)
            continue
        calls = [(lambda x=x, L=L, c=c: mixed(x, L, c, x, config=cfg)) for x, L, c in zip(xs, layers, cuts)]
        out.append(dict(config=json.dumps(cfg), us=round(time_graph(calls, device=device), 2)))
    out.sort(key=lambda r: r["us"])
    return out


def compile_check(d_model: int = 4096, d_inter: int = 14336, group: int = 64, set_rows: int = 128) -> bool:
    """low_down (and the down GEMV that signals late) compiled for sm_90 on this machine, no GPU (``harness.sm90``):
    the default and every D_ / Q_ configuration of :data:`SWEEP` at the Llama-3.1-8B MLP shape with PDL and a residual,
    and the default without PDL, without a residual, with a bias and GELU-tanh, with fp32 scales. Logs registers and
    spills; False if any fails."""
    from countdown.kernels import config as kconfig
    from countdown.kernels.int4 import nested_down
    from harness.launches import stand_in
    from harness.sm90 import Compile

    failures = []
    z = lambda *shape, dt=torch.float32: torch.zeros(shape, dtype=dt)  # noqa: E731
    lists = (z(d_inter, dt=torch.int32), z(d_inter // set_rows, dt=torch.int32), z(64, dt=torch.int32))
    gu, q, h, bias = z(4, 2, d_inter), z(14, d_model), z(1, d_model, dt=torch.bfloat16), z(d_model, dt=torch.bfloat16)
    low = (z(d_inter, d_model // 2, dt=torch.uint8), z(d_inter // group, d_model, dt=torch.float16),
           z(d_inter // group, d_model, dt=torch.float16))
    low32 = (low[0], low[1].float(), low[2].float())
    runs = [(c, 1, "silu", low, h, None) for c in [{}] + [c for c in SWEEP if not any(k.startswith("L_") for k in c)]]
    runs += [({}, 0, "silu", low, h, None), ({}, 1, "silu", low, None, None), ({}, 1, "gelu_tanh", low, h, bias),
             ({}, 1, "silu", low32, h, None)]
    pdl_mode = nested_down.pdl_mode
    try:
        with stand_in(["int4_nested", "int4_gemv"], lambda name, jit: Compile(jit, failures)):
            for cfg, pdl, act_name, low_t, res, b in runs:
                print(f"low_down {cfg} PDL {pdl} {act_name} scales {low_t[1].dtype} residual {res is not None} "
                      f"bias {b is not None}:", flush=True)
                nested_down.pdl_mode = lambda t, p=pdl: p
                full = kconfig.launch_config("int4_nested", None, extra=cfg)
                nested_down.low_down(*lists, gu, q, low_t, act_name, set_rows, full, res, b)
            gemv.pdl_mode = lambda t: 1
            print("the down GEMV, late PDL signal:", flush=True)
            sc = z(d_model, d_inter // group, dt=torch.float16)
            gemv.launch(gu, z(d_model, d_inter // 8, dt=torch.int32), sc, sc, activation="silu", late=True)
    finally:
        nested_down.pdl_mode = gemv.pdl_mode = pdl_mode
    print(f"compile check: {len(failures)} failures", flush=True)
    return not failures


def dense4(x, L, h):
    gu = gemv.launch(x, *L["gate_up"])
    return h + gemv.launch(gu.view(gu.shape[0], 2, -1), *L["down_high"], activation="silu").sum(0)


def check(x, L, cut, consts=None) -> float:
    h = torch.zeros_like(x)  # h + y in h's dtype: a zero h leaves only y's own rounding
    y, idx, cnt = mixed(x, L, cut, h, lists=True, consts=consts)
    keep = keep_of_lists(idx, cnt, L["gate_low"][0].shape[0], idx.numel() // cnt.numel())
    ref = mixed_mlp_kernel_ref(x.double().cpu(), *(_cpu(L[r]) for r in ("gate", "up", "down")), keep)
    err = ((y.double().cpu() - h.double().cpu()).reshape(-1) - ref).abs().max().item()
    scale = ref.abs().max().item()
    if not err <= 1e-2 * scale + 1e-4:
        raise SystemExit(f"mixed kernel output off its float64 reference: max error {err:.3g} (|ref| {scale:.3g})")
    return keep.float().mean().item()


def _cpu(w):
    import dataclasses

    return dataclasses.replace(w, high=dataclasses.replace(w.high, **{f: getattr(w.high, f).cpu() for f in
                                                                       ("qweight", "scale", "offset")}),
                               low_qweight=w.low_qweight.cpu(), low_scale=w.low_scale.cpu(),
                               low_offset=w.low_offset.cpu())


def profile(calls, reps: int = 3) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile as prof

    for c in calls:
        c()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as pr:
        for _ in range(reps):
            for c in calls:
                c()
        torch.cuda.synchronize()
    out = {}
    for e in pr.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            out[e.key[:60]] = (getattr(e, "device_time_total", 0) or e.cuda_time_total) / (reps * len(calls))
    return out


def plot(folder: str, runs: list[str], path: str) -> None:
    """Stacked bars of each launch's time (``<run>_launches.csv`` under ``folder``), a bar per run and
    configuration: where a mixed MLP's microseconds go."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {}
    for run in runs:
        with open(os.path.join(folder, f"{run}_launches.csv")) as f:
            for r in csv.DictReader(f):
                name = "PyTorch sum / add (the harness's)" if r["kernel"].startswith("void") else \
                    r["kernel"].split("_kernel")[0]
                bars.setdefault(f"{r['config']}\n{run}", {}).setdefault(name, 0.0)
                bars[f"{r['config']}\n{run}"][name] += float(r["us"])
    names = sorted({n for b in bars.values() for n in b})
    fig, ax = plt.subplots(figsize=(1.1 * len(bars) + 2, 4.5))
    labels = sorted(bars, key=lambda lab: (lab.split("\n")[0], runs.index(lab.split("\n")[1])))
    bottom = [0.0] * len(labels)
    for n in names:
        vals = [bars[lab].get(n, 0.0) for lab in labels]
        ax.bar(range(len(labels)), vals, bottom=bottom, label=n)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(0, 1.25 * max(bottom))
    ax.set_ylabel("us a call (torch.profiler, one MLP of the 8B shape)")
    ax.set_title("Mixed MLP one-token launches (H200)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="a small shape on the CPU (TRITON_INTERPRET=1): checks only")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sweep", action="store_true", help="also time k = 0.9 under each launch configuration")
    p.add_argument("--pdl", action="store_true",
                   help="programmatic dependent launch on, as in a folded decode step (D_EARLY acts only then)")
    p.add_argument("--compile-check", action="store_true",
                   help="compile low_down's configurations for sm_90 here (no GPU) and log registers and spills")
    p.add_argument("--plot", default=None, metavar="RUN[,RUN]",
                   help="draw <out>/launches.png from <out>/<RUN>_launches.csv (earlier runs' files); time nothing")
    a = p.parse_args(argv)
    if a.plot:
        return plot(a.out, a.plot.split(","), os.path.join(a.out, "launches.png"))
    if a.compile_check:
        raise SystemExit(0 if compile_check() else 1)
    if a.pdl:  # for the whole run: every launch of every configuration
        from countdown.kernels.config import overrides

        contextlib.ExitStack().enter_context(overrides(pdl=True))
    device = "cpu" if a.smoke else "cuda"
    d_model, d_inter, n = (128, 256, 1) if a.smoke else (4096, 14336, a.layers)
    layers = [layer(d_model, d_inter, 64, device, s) for s in range(n)]
    for L in layers:
        L["consts"] = error_consts(L)
    gen = torch.Generator().manual_seed(99)
    xs = [torch.randn(1, d_model, generator=gen).to(device, torch.bfloat16) for _ in layers]
    hs = [torch.randn(1, d_model, generator=gen).to(device, torch.bfloat16) for _ in layers]
    rows, prof_rows = [], []
    cuts = {k: [cut_of(x, L, k) for x, L in zip(xs, layers)] for k in KS}
    cuts["error"] = [cut_of(x, L, 0.9, L["consts"]) for x, L in zip(xs, layers)]
    for k in KS:
        kept = check(xs[0], layers[0], cuts[k][0])
        print(f"k={k}: kept {kept:.4f} of the rows, output matches float64", flush=True)
    kept = check(xs[0], layers[0], cuts["error"][0], layers[0]["consts"])
    print(f"rank=error k=0.9: kept {kept:.4f} of the rows, output matches float64", flush=True)
    if a.smoke:  # every configuration of the sweep gives the default's output
        want = mixed(xs[0], layers[0], cuts[0.9][0], hs[0]).float()
        for cfg in SWEEP:
            y = mixed(xs[0], layers[0], cuts[0.9][0], hs[0], config=cfg).float()
            if not torch.allclose(y, want, rtol=2e-2, atol=1e-3 * want.abs().max().item()):
                raise SystemExit(f"{cfg}: output differs from the default's")
        print(f"the sweep's {len(SWEEP)} configurations: the default's output", flush=True)
        return
    bw = copy_bandwidth()
    plane = d_inter * d_model // 2 + 2 * 2 * d_inter * d_model // 64
    configs = {"int4": (lambda x, L, h, c=None: dense4(x, L, h), None, 3 * plane)}
    for k in KS:
        configs[f"mixed k={k}"] = (lambda x, L, h, c: mixed(x, L, c, h), k, round(3 * plane * (2 - k)))
    configs["rank=error k=0.9"] = (lambda x, L, h, c: mixed(x, L, c, h, consts=L["consts"]), "error",
                                   round(3 * plane * 1.1))  # the select's error rule, its own k = 0.9 cut
    for name, (fn, k, nbytes) in configs.items():
        calls = [(lambda x=x, L=L, h=h, c=(cuts[k][i] if k else None): fn(x, L, h, c))
                 for i, (x, L, h) in enumerate(zip(xs, layers, hs))]
        us = time_graph(calls, device=device)
        roof = nbytes / bw * 1e6
        rows.append(dict(config=name, k=(0.9 if k == "error" else k) or "", us=round(us, 2), mlp_bytes=nbytes,
                         roofline_us=round(roof, 2),
                         x_roofline=round(us / roof, 3)))
        for kname, t in profile(calls).items():
            prof_rows.append(dict(config=name, kernel=kname, us=round(t, 2)))
    base = rows[0]["us"]
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}")
    print(f"{'config':<16}{'us':>9}{'x int4':>9}{'MB':>8}{'x roof':>8}")
    for r in rows:
        print(f"{r['config']:<16}{r['us']:>9.2f}{r['us'] / base:>9.3f}{r['mlp_bytes'] / 1e6:>8.1f}{r['x_roofline']:>8.2f}")
    print("\nper launch (torch.profiler, launched one by one: no graph):")
    for r in prof_rows:
        print(f"  {r['config']:<14}{r['us']:>8.2f} us  {r['kernel']}")
    swept = sweep(xs, layers, cuts[0.9], device) if a.sweep else []
    if swept:
        print("\nk = 0.9 by launch configuration (fastest 12 of %d; default {} first in the CSV order):" % len(swept))
        for r in swept[:12]:
            print(f"  {r['us']:>8.2f} us  {r['config']}")
        print(f"  default: {next(r['us'] for r in swept if r['config'] == '{}')} us")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        if swept:
            rows_sw = swept
            with open(os.path.join(a.out, "mixed_kernels_sweep.csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows_sw[0]))
                w.writeheader()
                w.writerows(rows_sw)
        for fname, data in (("mixed_kernels.csv", rows), ("mixed_kernels_launches.csv", prof_rows)):
            with open(os.path.join(a.out, fname), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(data[0]))
                w.writeheader()
                w.writerows(data)
        with open(os.path.join(a.out, "mixed_kernels_meta.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, torch=torch.__version__,
                           pdl=a.pdl), f)


if __name__ == "__main__":
    main()
