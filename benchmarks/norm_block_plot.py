"""Plot session 24's MLP halves with no norm kernel (benchmarks/results/norm_block/).

    python benchmarks/norm_block_plot.py benchmarks/results/norm_block

Left: benchmarks/block_ab.py --shadow's routes (DIR/block_ab.csv), us a call by k, each against its own
norm-kernel route. Right: tokens/s of each method in the decode step (DIR/*/decode.csv, one-compile rows at k = 0.9),
a bar per folder (benchmarks/norm_block_call.sh's runs: "-off" folders with both routes off). Writes DIR/norm_block.png.
"""

import csv
import glob
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(folder: str) -> None:
    path = os.path.join(folder, "block_ab.csv")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: give the folder that benchmarks/norm_block_call.sh's results went to")
    rows = list(csv.DictReader(open(path)))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    routes = list(dict.fromkeys(r["route"] for r in rows))
    ks = sorted({r["k"] for r in rows})
    width = 0.8 / len(routes)
    for j, route in enumerate(routes):
        base = "shadow norm kernel" if route.startswith("shadow") else "norm kernel"
        us = [next(float(r["us"]) for r in rows if r["k"] == k and r["route"] == route) for k in ks]
        ref = [next(float(r["us"]) for r in rows if r["k"] == k and r["route"] == base) for k in ks]
        xs = [i + (j - (len(routes) - 1) / 2) * width for i in range(len(ks))]
        ax.bar(xs, us, width, label=route)
        for x, u, b in zip(xs, us, ref):
            ax.text(x, u + 0.5, f"{b / u:.3f}x", ha="center", fontsize=6, rotation=90)
    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([f"k = {k}" for k in ks])
    ax.set_ylabel("us a call (median of 3 rounds)")
    ax.set_ylim(0, max(float(r["us"]) for r in rows) * 1.3)
    ax.set_title(f"the MLP half alone, {rows[0]['device']}, {rows[0]['date']}", fontsize=9)
    ax.legend(fontsize=6, loc="upper right")
    runs = sorted(glob.glob(os.path.join(folder, "*", "decode.csv")))
    methods = ["mono", "dual[lowrank]", "dual[shadow4]"]
    width = 0.8 / max(1, len(runs))
    for j, run in enumerate(runs):
        got = {r["method"]: float(r["tokens_per_s"]) for r in csv.DictReader(open(run))
               if r["harness"] == "one-compile" and r["sparsity"] == "0.9"}
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(methods))]
        bx.bar(xs, [got.get(m, 0.0) for m in methods], width, label=os.path.basename(os.path.dirname(run)),
               hatch="//" if run.split(os.sep)[-2].endswith("-off") else None)
    bx.set_xticks(range(len(methods)))
    bx.set_xticklabels(methods)
    bx.set_ylabel("tokens/s at k = 0.9 (one-compile)")
    bx.set_ylim(250, 380)
    bx.set_title("in the decode step (hatched: both routes off)", fontsize=9)
    bx.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "norm_block.png"), dpi=120)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/norm_block")
