"""Programmatic dependent launch (kernels/_pdl.py): where each grid signals, timed on chains of our kernels.

    PYTHONPATH=src python benchmarks/pdl.py --out OUT            # on the GPU (about a minute)
    PYTHONPATH=src python benchmarks/pdl.py --compile-check      # here: every PDL variant compiles for sm_90

Four chains of 32 layers (Llama-3.1-8B shapes, bf16, one token, random weights, a weight set per layer so
nothing is found in L2), each captured in ONE CUDA graph so that consecutive kernels are PDL neighbours:

- ``projections``: the fixed GEMV (kernels/_linear.py) for QKV, O (+ residual), gate, up, down: the
  dense step's big grids, back to back;
- ``dual``: dual[lowrank] at k = 0.9: x A, (x A) B, the one-launch sparse kernel, the partials' sum;
- ``mono``: mono at k = 0.9: u on the fixed GEMV, the sparse kernel, the sum;
- ``teal``: TEAL at 10 % of x's entries and 10 % of s's: its gate/up, finish and down kernels, the sum.

Each chain runs with PDL off, and on with the signal at each program's start ("start") or after its main loop
("end"), the fixed GEMV's first weight tile loaded before the wait (W early), after it, or "auto" (early
only in grids that fit on the SMs at once: _pdl.weights_early). Outputs are checked bit for bit against
PDL off (PDL changes when a grid launches, not what it computes). Prints a table of us per layer and the
ratio to off; writes pdl.csv / pdl.md under --out.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from countdown.bench import copy_bandwidth, time_graph  # noqa: E402
from countdown.kernels import _linear, _pdl  # noqa: E402
from countdown.kernels.dual import dual_gated_mlp  # noqa: E402
from countdown.kernels.mono import mono_gated_mlp  # noqa: E402
from countdown.kernels.teal import teal_gated_mlp  # noqa: E402

D_MODEL, D_INTER, QKV, RANK, K = 4096, 14336, 6144, 512, 0.9
MODES = {  # name: (ENABLED, TRIGGER, W_EARLY)
    "off": (False, "start", "auto"),
    "start, W early": (True, "start", True),
    "start, W after wait": (True, "start", False),
    "start, W auto": (True, "start", "auto"),
    "end, W auto": (True, "end", "auto"),
}


def set_mode(name: str) -> None:
    _pdl.ENABLED, _pdl.TRIGGER, _pdl.W_EARLY = MODES[name]


def quantile_cut(values: torch.Tensor, k: float) -> float:
    """The k-quantile of ``values`` as a float: keeps about 1 - k of them above it."""
    return torch.quantile(values.float().flatten(), k).item()


class Layers:
    """``n`` layers of weights on the GPU, one set each, and per-layer thresholds for k."""

    def __init__(self, n: int, seed: int = 0):
        torch.manual_seed(seed)
        dev, dt = "cuda", torch.bfloat16
        r = lambda *s: (torch.randn(*s, device=dev) * s[-1] ** -0.5).to(dt)  # noqa: E731
        self.w = [dict(qkv=r(QKV, D_MODEL), o=r(D_MODEL, D_MODEL), g=r(D_INTER, D_MODEL), u=r(D_INTER, D_MODEL),
                       d=r(D_MODEL, D_INTER), dt=r(D_INTER, D_MODEL), at=r(RANK, D_MODEL), bt=r(D_INTER, RANK))
                  for _ in range(n)]
        for w in self.w:  # TEAL's layout: W_gate^T, W_up^T [d_model, d_inter]
            w["gt"], w["ut"] = w["g"].t().contiguous(), w["u"].t().contiguous()
        self.x0 = torch.randn(1, D_MODEL, device=dev).to(dt)

    def bytes_per_layer(self) -> dict:
        """Weight bytes each chain must read a layer, at the kept shares its cuts gave (``self.kept``)."""
        b = lambda *names: sum(self.w[0][n].numel() * 2 for n in names)  # noqa: E731
        k = self.kept
        return {"projections": b("qkv", "o", "g", "u", "d"), "dual": b("at", "bt") + k["dual"] * b("g", "u", "dt"),
                "mono": b("u") + k["mono"] * b("g", "dt"), "teal": k["teal"] * b("g", "u", "dt")}


def chains(L: Layers) -> dict:
    """Per chain: a function running layer i on the previous output. Fits the sparse chains' cuts on their
    own inputs first (``L.cuts``, the kept shares in ``L.kept``)."""
    lin = _linear.decode_linear

    def proj(i, x):
        w = L.w[i]
        qkv = lin(x, w["qkv"])
        a = lin(qkv[:, :D_MODEL], w["o"], residual=x)
        g, u = lin(a, w["g"]), lin(a, w["u"])
        return lin(g, w["d"], residual=a)

    # Each chain's cuts are fitted on that chain's own inputs, layer by layer (PDL off), and each chain's
    # W_down^T of layer i is its own copy scaled so that layer i's output (layer i + 1's input) has an RMS of
    # 1, as the RMSNorm between a model's MLPs would give: without it a chain of MLPs with 10 % of their rows
    # shrinks its activations quadratically, they reach zero within a few layers and nothing is kept (before
    # 2026-11-25 this benchmark's sparse chains kept 2-3 % of rows on average, and cuts came from mono's chain).
    def fit(name, x, w):
        if name == "dual":
            score = (x @ w["at"].t()) @ w["bt"].t()
            cut = quantile_cut(score, K)
            return cut, (score.float() > cut).float().mean().item()
        if name == "mono":
            u = (x @ w["u"].t()).abs()
            cut = quantile_cut(u, K)
            return cut, (u.float() > cut).float().mean().item()
        tx = quantile_cut(x.abs(), K)
        xt = torch.where(x.abs() > tx, x, 0)
        s = ((xt @ w["u"].t()) * torch.nn.functional.silu(xt @ w["g"].t())).abs()
        cut = (tx, quantile_cut(s, K))
        return cut, (s.float() > cut[1]).float().mean().item()

    def apply(name, x, w, cut):
        dt = w["dt_" + name]
        if name == "dual":
            return dual_gated_mlp(x, w["g"], w["u"], dt, w["at"].t(), w["bt"].t(), cut)
        if name == "mono":
            return mono_gated_mlp(x, w["g"], w["u"], dt, cut)
        return teal_gated_mlp(x, w["gt"], w["ut"], dt, *cut)

    cuts, kept = {}, {}
    with torch.no_grad():
        for name in ("dual", "mono", "teal"):
            x, cuts[name], shares = L.x0, [], []
            for i, w in enumerate(L.w):
                cut, share = fit(name, x, w)
                w["dt_" + name] = w["dt"]
                rms = apply(name, x, w, cut).float().pow(2).mean().sqrt().item()
                if not rms > 0:
                    raise SystemExit(f"{name}'s chain died at layer {i} (an all-zero output): no timing of it")
                w["dt_" + name] = (w["dt"].float() / rms).to(w["dt"].dtype)
                x = apply(name, x, w, cut)
                cuts[name].append(cut)
                shares.append(share)
            kept[name] = sum(shares) / len(shares)
    L.kept, L.cuts = {**kept, "projections": 1.0}, cuts

    def chain(name):
        return lambda i, x: apply(name, x, L.w[i], cuts[name][i])

    return {"projections": proj, "dual": chain("dual"), "mono": chain("mono"), "teal": chain("teal")}


def run_chain(layer_fn, n: int, x0: torch.Tensor):
    """(us per layer, the last layer's output): the n layers in one CUDA graph, replayed."""
    state = {}

    def step(i):
        state[i] = layer_fn(i, state[i - 1] if i else x0)

    us = time_graph([lambda i=i: step(i) for i in range(n)])
    return us, state[n - 1].clone()


def write_table(out: str, stem: str, rows: list[dict], lines: list[str]) -> None:
    """``rows`` as OUT/STEM.csv and the Markdown ``lines`` as OUT/STEM.md; prints the Markdown."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def compile_check() -> bool:
    """Compile the PDL variants of the fixed GEMV, the sparse kernel and the sum for sm_90, here."""
    from unittest import mock

    from kernels import Compile  # benchmarks/kernels.py
    from countdown.kernels import _common, _onepass, _psum, _rmsnorm

    failures = []
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt)  # noqa: E731
    with mock.patch.object(_pdl, "active", lambda t: True), \
            mock.patch.object(_common, "persistent_programs", lambda dev, per_sm, interp: 132 * per_sm), \
            mock.patch.object(_common, "interpreting", lambda: False), \
            mock.patch.object(_psum, "counters", lambda dev: torch.zeros(2, dtype=torch.int32)):
        _linear._linear_kernel = Compile(_linear._linear_kernel, failures)
        _onepass._onepass_kernel = Compile(_onepass._onepass_kernel, failures)
        _psum._psum_kernel = Compile(_psum._psum_kernel, failures)
        _rmsnorm._rmsnorm_kernel = Compile(_rmsnorm._rmsnorm_kernel, failures)
        _rmsnorm._add_kernel = Compile(_rmsnorm._add_kernel, failures)
        for trigger in ("start", "end"):
            for early in (True, False):
                _pdl.TRIGGER, _pdl.W_EARLY = trigger, early
                for n, k in ((QKV, D_MODEL), (D_MODEL, D_INTER), (D_INTER, RANK)):
                    _linear.decode_linear(e(1, k), e(n, k))
            ind = e(1, D_INTER)
            for tail in (False, True):  # and with _psum.py's tail (the kernel sums its own partials)
                _onepass.onepass_partials(e(1, D_MODEL), None, None, e(D_INTER, D_MODEL), e(D_INTER, D_MODEL),
                                          e(D_INTER, D_MODEL), None, 0.5, "gt", "silu", True, True, ind=ind, tail=tail)
            _psum.sum_partials(e(224, D_MODEL, dt=torch.float32), torch.bfloat16)
            _rmsnorm.rms_norm(e(1, D_MODEL), e(D_MODEL), 1e-5)
            _rmsnorm.decode_add(e(1, D_MODEL), e(1, D_MODEL))
    print(f"compile check: {len(failures)} failures")
    return not failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/pdl", help="folder for pdl.csv and pdl.md")
    ap.add_argument("--layers", type=int, default=32, help="layers per chain (a weight set each)")
    ap.add_argument("--compile-check", action="store_true", help="only compile the variants for sm_90 (no GPU)")
    args = ap.parse_args()
    if args.compile_check:
        raise SystemExit(0 if compile_check() else 1)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/pdl.py times CUDA graphs: run it on a GPU machine (or --compile-check)")
    if not _pdl.HAVE_GDC or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("PDL needs Triton's grid-dependency control and a GPU of compute capability 9.0 or more")
    t0 = time.time()
    L = Layers(args.layers)
    fns, rows, ok = chains(L), [], True
    nbytes = L.bytes_per_layer()  # after chains(L): it fits the cuts and records the kept shares
    for chain, fn in fns.items():
        ref = None
        for mode in MODES:
            set_mode(mode)
            us, out = run_chain(fn, args.layers, L.x0)
            same = True if ref is None else bool(torch.equal(out, ref))
            ref = out if ref is None else ref
            ok &= same
            rows.append(dict(chain=chain, mode=mode, us_per_layer=round(us, 2), bytes_per_layer=int(nbytes[chain]),
                             kept=round(L.kept[chain], 4), identical_to_off=same))
            print(f"{chain:12s} {mode:18s} {us:8.2f} us/layer  identical={same}", flush=True)
    set_mode("off")
    copy = copy_bandwidth()
    for r in rows:
        off = next(o for o in rows if o["chain"] == r["chain"] and o["mode"] == "off")
        r["ratio_vs_off"] = round(r["us_per_layer"] / off["us_per_layer"], 4)
        r["x_roofline"] = round(r["us_per_layer"] * 1e-6 * copy / r["bytes_per_layer"], 3)
    lines = [f"# PDL placement, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}", "",
             f"`PYTHONPATH=src python benchmarks/pdl.py --out ...` ({time.time() - t0:.0f} s; torch "
             f"{torch.__version__}); us per layer, median of CUDA-graph replays of {args.layers} layers; kept: the "
             f"share of rows the chain's cuts kept (fitted on its own inputs); roofline: its weight bytes at the "
             f"copy bandwidth measured in this run, {copy / 1e9:.0f} GB/s.", "",
             "| chain | PDL | kept | MB / layer | us / layer | x roofline | vs off | bit-identical |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['chain']} | {r['mode']} | {r['kept']:.3f} | {r['bytes_per_layer'] / 1e6:.1f} | "
              f"{r['us_per_layer']:.2f} | {r['x_roofline']:.2f} | {r['ratio_vs_off']:.3f} | {r['identical_to_off']} |"
              for r in rows]
    write_table(args.out, "pdl", rows, lines)
    if not ok:
        raise SystemExit("PDL changed an output: see identical_to_off")


if __name__ == "__main__":
    main()
