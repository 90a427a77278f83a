"""One token's mono MLP with its indicator streamed inside the sparse kernel (kernels/_onepass.py, IND "kernel",
RB rows a step: mono's default since 2026-11-25) in several configurations against the route before it (u on the
fixed GEMV, then the sparse kernel: "GEMV route" below, `IND="torch"`), one MLP alone.

    cd benchmarks && COUNTDOWN_PDL=1 PYTHONPATH=../src:. python ind_kernel.py --out DIR [--ks 0.9]

Llama-3.1-8B's MLP shape, bf16, batch 1, CUDA graphs of 8 calls over 4 weight sets (benchmarks/kernels.py's
Problem and timing), the partials summed by kernels/_psum.py as in an eager call. Each configuration's output
is checked against the GEMV route's first (same kept rows: the thresholds sit in wide gaps). Rows: the GEMV
route, the fixed GEMV alone (u), and per configuration the whole MLP and its indicator phase alone (SPARSE
False: the W_up rows streamed and compared, no kept row loaded). Prints a table; DIR/ind_kernel.{json,md,png}
(`--plot DIR/ind_kernel.json` redraws the plot).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

import countdown.kernels as K
from countdown.bench import copy_bandwidth
from countdown.kernels import _onepass

from kernels import DTYPE, SHAPES, Problem, log, safe_time  # noqa: E402
from onepass import onepass  # noqa: E402

BASE = dict(_onepass.CONFIGS["abs"])  # mono's default since 2026-11-25 (RB 2, ISTAGES 3, W_EARLY, 2 programs an SM)
CANDIDATES = {  # name: changes to BASE. Timed before (H200, results/ind_kernel/README.md), all slower than the
    # default: RB 4 / 8, 8 warps, CHUNK 16 / 32, BLOCK_M 2, rows loaded by hand a step ahead, the tensor-core
    # indicator (IND_DOT), more programs an SM (the step's rows clamped: 168 registers; BLOCK_M 1 / 2 at 3-4 an SM),
    # IND_FMA at 1-3 programs an SM (session 20: its u phase 33-35 us, its kept rows slower: 45.4-103 us in all),
    # each chunk's rows strided over d_inter (session 20, call 6: 45.0-52.9 us; results/ind_kernel/s20-call6/),
    # the u phase by TMA tiles through shared memory (IND_TMA, session 21, results/ind_kernel/s21-tma/: 46.6-94 us,
    # its u phase 43-85 us against 35.9).
    # These (session 21): the kept rows in fewer, larger steps or pipelined (the heaviest chunk keeps about 12
    # rows where the mean is 5.6: its chain of BLOCK_M-row steps sets the kernel's end).
    "default": {},
    "bm8": dict(BLOCK_M=8),
    "stages2": dict(STAGES=2),
    "bm8 stages2": dict(BLOCK_M=8, STAGES=2),
    "bm2 stages3": dict(BLOCK_M=2, STAGES=3),
    "bm4 stages3": dict(STAGES=3),
}


def plot(json_path: str) -> str:
    """A bar per configuration (k = the largest timed): the whole MLP and its u phase alone, with the default
    route and the fixed GEMV as lines; written next to the JSON as ind_kernel.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    rows = data["rows"]
    k = max(r["k"] for r in rows)
    whole = [r for r in rows if r["config"] and r["k"] == k]
    phase = {r["name"][: -len(" (u phase)")]: r["us"] for r in rows if r["name"].endswith("(u phase)")}
    ref = {r["name"]: r["us"] for r in rows if r["config"] is None and r["k"] in (0, k)}
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(whole) + 1.5))
    names = [r["name"] for r in whole]
    ax.barh(names, [r["us"] for r in whole], color="tab:blue", label="whole MLP (k = %g)" % k)
    ax.barh(names, [phase.get(n, 0) for n in names], color="tab:orange", height=0.4, label="its u phase alone")
    for name, style in (("GEMV route", "k--"), ("fixed GEMV u alone", "g:")):
        if name in ref:
            ax.axvline(ref[name], color=style[0], linestyle=style[1:], label=f"{name} {ref[name]:.1f} us")
    ax.set_xlabel("us (one mono MLP, CUDA graph)")
    meta = data["meta"]
    ax.set_title(f"in-kernel indicator, {meta['device']}, {meta['date']}", fontsize=9)
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = os.path.join(os.path.dirname(json_path), "ind_kernel.png")
    fig.savefig(out, dpi=110)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/ind_kernel")
    ap.add_argument("--ks", nargs="*", type=float, default=[0.9])
    ap.add_argument("--plot", metavar="JSON", help="only redraw the plot of a results file (no GPU)")
    args = ap.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    os.makedirs(args.out, exist_ok=True)
    d_model, d_inter, act = SHAPES["Llama-3.1-8B"]
    bw = copy_bandwidth()
    p = Problem(d_model, d_inter, act, 1, 512)
    mat = d_model * d_inter * torch.finfo(DTYPE).bits // 8
    rows = []

    def add(name, k, us, nbytes, cfg=None):
        kern = _onepass.LAST_KERNEL if cfg is not None else None  # the launch just timed: its registers, spills
        regs, spills = (getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)) if kern else (None, None)
        rows.append(dict(name=name, k=k, us=us, roofline_us=nbytes / bw * 1e6, config=cfg, regs=regs, spills=spills))
        log(f"{name:28s} k={k:.2f} {us:7.1f} us  roof {nbytes / bw * 1e6:6.1f}  regs {regs} spills {spills}")

    add("fixed GEMV u alone", 0, safe_time("u", [lambda i=i: _onepass.ind_linear(p.xs[i], p.w(i)["wu"])
                                                 for i in range(8)]), mat)
    for k in args.ks:
        thr = p.thresholds(k)["mono"]
        kept = float(torch.stack([m.float().mean() for m in p.masks(k)[0]["mono"]]).mean())
        nbytes = mat * (1 + 2 * kept)
        call = lambda i: (lambda: K.mono_gated_mlp(p.xs[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"], thr, act))
        with onepass(True, dict(IND="torch", ROWS=None, RB=0, CHUNK=64, BLOCK_M=4, PER_SM=4, W_EARLY=False), "abs"):
            ref = call(0)().float()
            add("GEMV route", k, safe_time("GEMV route", [call(i) for i in range(8)]), nbytes)
        for name, change in CANDIDATES.items():
            cfg = {key: v for key, v in {**BASE, **change}.items() if v is not None}
            with onepass(True, cfg, "abs"):
                try:
                    got = call(0)().float()
                    err = float((got - ref).abs().max() / ref.abs().max())
                    if not err < 2e-2:
                        raise RuntimeError(f"differs from the GEMV route by {err:.3g} (relative)")
                except Exception as e:  # noqa: BLE001
                    log(f"{name}: DROPPED {type(e).__name__}: {str(e).splitlines()[-1][:200]}")
                    continue
                add(name, k, safe_time(name, [call(i) for i in range(8)]), nbytes, cfg)
            with onepass(True, {**cfg, "SPARSE": False}, "abs"):
                add(name + " (u phase)", k, safe_time(name + " u", [call(i) for i in range(8)]), mat)
    best = min((r for r in rows if r["config"] and r["k"] == max(args.ks)), key=lambda r: r["us"], default=None)
    if best is not None:  # for a decode run: COUNTDOWN_ONEPASS_CONFIGS="$(cat DIR/best.json)"
        with open(os.path.join(args.out, "best.json"), "w") as f:
            json.dump({"abs": best["config"]}, f)
    meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), bw=bw,
                pdl=os.environ.get("COUNTDOWN_PDL", "auto"),
                command=f"cd benchmarks && COUNTDOWN_PDL=1 PYTHONPATH=../src:. python ind_kernel.py --out {args.out} "
                        f"--ks {' '.join(map(str, args.ks))}")
    with open(os.path.join(args.out, "ind_kernel.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# mono, in-kernel indicator vs the GEMV route ({meta['device']}, {meta['date']})", "",
             f"`{meta['command']}`; copy bandwidth {bw / 1e12:.2f} TB/s", "",
             "| row | k | us | roofline us | x roofline |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['k']} | {r['us']:.1f} | {r['roofline_us']:.1f} | {r['us'] / r['roofline_us']:.2f} |"
              for r in rows]
    with open(os.path.join(args.out, "ind_kernel.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(os.path.join(args.out, "ind_kernel.json"))


if __name__ == "__main__":
    main()
