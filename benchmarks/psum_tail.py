"""The one-token sparse kernel summing its own partials (kernels/_psum.py's "tail" route), timed on chains.

    PYTHONPATH=src python benchmarks/psum_tail.py --out OUT        # on the GPU (about a minute)

benchmarks/pdl.py's chains of 32 layers (Llama-3.1-8B shapes, bf16, one token, a weight set per layer, each
chain's cuts fitted on its own inputs at k = 0.9, one CUDA graph) for the methods whose one-token MLP is
the one-launch kernel (_onepass.py: dual[lowrank], mono), with the partials summed by a launch of their own
(route "kernel", the default where the MLP runs eagerly) or by the kernel's last programs ("tail"), PDL off
and on. Checks first: on layer 0 both routes against float64 (the same kept rows; the error of each, the
tail's no larger than the sum's by more than an ulp of the output), the counters back at zero. Writes
psum_tail.csv / psum_tail.md under --out; prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pdl import Layers, chains, run_chain, set_mode, write_table  # noqa: E402  (benchmarks/pdl.py)

from countdown.bench import copy_bandwidth  # noqa: E402
from countdown.kernels import _psum  # noqa: E402
from countdown.kernels.masked import gated_mlp_masked_ref  # noqa: E402

ROUTES = ("kernel", "tail")
PDL_MODES = ("off", "start, W auto")


def check_layer0(L: Layers, fns: dict) -> list[dict]:
    """Layer 0 of each chain by both routes against float64 (keep decided as the kernels decide it)."""
    rows = []
    w, x = L.w[0], L.x0
    for name in ("dual", "mono"):
        if name == "dual":
            keep = ((x @ w["at"].t()) @ w["bt"].t()).float() > L.cuts[name][0]
        else:
            keep = (x @ w["u"].t()).float().abs() > L.cuts[name][0]
        ref = gated_mlp_masked_ref(*(t.double() for t in (x, w["g"], w["u"], w["dt_" + name])), keep, "silu")
        out = {}
        for route in ROUTES:
            _psum.ROUTE = route
            out[route] = fns[name](0, x)
            torch.cuda.synchronize()
        counters = _psum.counters(x.device).tolist()
        err = {r: ((o.double() - ref).abs().max() / ref.abs().max()).item() for r, o in out.items()}
        rows.append(dict(chain=name, kept=round(keep.float().mean().item(), 4), rel_err_kernel=err["kernel"],
                         rel_err_tail=err["tail"], identical=bool(torch.equal(out["kernel"], out["tail"])),
                         counters_after=str(counters),
                         ok=err["tail"] <= err["kernel"] + 2.0**-8 and counters == [0, 0]))
    _psum.ROUTE = "auto"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/psum_tail")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/psum_tail.py times CUDA graphs: run it on a GPU machine")
    t0 = time.time()
    _psum.prepare_tail(torch.device("cuda", torch.cuda.current_device()))
    set_mode("off")
    L = Layers(args.layers)
    fns = chains(L)
    checks = check_layer0(L, fns)
    for c in checks:
        print(f"check {c['chain']}: kept {c['kept']}, rel err kernel {c['rel_err_kernel']:.2e} tail "
              f"{c['rel_err_tail']:.2e}, identical {c['identical']}, counters {c['counters_after']}, ok {c['ok']}")
    nbytes = L.bytes_per_layer()
    rows = []
    for name in ("dual", "mono"):
        for mode in PDL_MODES:
            set_mode(mode)
            for route in ROUTES:
                _psum.ROUTE = route
                us, _ = run_chain(fns[name], args.layers, L.x0)
                rows.append(dict(chain=name, pdl=mode, route=route, kept=round(L.kept[name], 4),
                                 bytes_per_layer=int(nbytes[name]), us_per_layer=round(us, 2)))
                print(f"{name:5s} {mode:14s} {route:7s} {us:7.2f} us/layer", flush=True)
    set_mode("off")
    _psum.ROUTE = "auto"
    copy = copy_bandwidth()
    for r in rows:
        base = next(o for o in rows if o["chain"] == r["chain"] and o["pdl"] == r["pdl"] and o["route"] == "kernel")
        r["vs_kernel_route"] = round(r["us_per_layer"] / base["us_per_layer"], 4)
        r["x_roofline"] = round(r["us_per_layer"] * 1e-6 * copy / r["bytes_per_layer"], 3)
    lines = [f"# The sparse kernel summing its own partials, {torch.cuda.get_device_name()}, "
             f"{time.strftime('%Y-%m-%d')}", "",
             f"`PYTHONPATH=src python benchmarks/psum_tail.py --out ...` ({time.time() - t0:.0f} s; torch "
             f"{torch.__version__}); us per layer, median of CUDA-graph replays of {args.layers} layers, k = 0.9; "
             f"roofline: weight bytes at this run's copy bandwidth, {copy / 1e9:.0f} GB/s.", "",
             "| chain | PDL | partials summed by | kept | us / layer | x roofline | vs its own launch |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['chain']} | {r['pdl']} | {'a launch of their own' if r['route'] == 'kernel' else 'the kernel (tail)'} "
              f"| {r['kept']:.3f} | {r['us_per_layer']:.2f} | {r['x_roofline']:.2f} | {r['vs_kernel_route']:.3f} |"
              for r in rows]
    lines += ["", "Checks (layer 0, against float64): " + "; ".join(
        f"{c['chain']} kept {c['kept']}, max error / max |y| {c['rel_err_kernel']:.2e} (launch) vs "
        f"{c['rel_err_tail']:.2e} (tail), bit-identical {c['identical']}, counters after {c['counters_after']}"
        for c in checks)]
    write_table(args.out, "psum_tail", rows, lines)
    if not all(c["ok"] for c in checks):
        raise SystemExit("a check failed: see the Checks line")


if __name__ == "__main__":
    main()
