"""Plot benchmarks/block_ab.py's A/B (dual[lowrank]'s MLP half: the norm on its own kernel or dual_block).

    python benchmarks/block_ab_plot.py benchmarks/results/dual_block

Reads DIR/block_ab.csv and, if present, DIR/block_ab_variants.csv (the norm-folded GEMV's other row blocks / warps,
columns norm_config, k, us_norm_kernel, us_dual_block); writes DIR/block_ab.png.
"""

import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(folder: str) -> None:
    path = os.path.join(folder, "block_ab.csv")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: give the folder that benchmarks/block_ab.py --out wrote")
    rows = list(csv.DictReader(open(path)))
    labels, base, new = [], [], []
    for k in sorted({r["k"] for r in rows}):
        us = {r["route"]: float(r["us"]) for r in rows if r["k"] == k}
        labels.append(f"k = {k}\ndefault"); base.append(us["norm kernel"]); new.append(us["dual_block"])
    extra = os.path.join(folder, "block_ab_variants.csv")
    if os.path.exists(extra):
        for r in csv.DictReader(open(extra)):
            labels.append(f"k = {r['k']}\n{r['norm_config']}")
            base.append(float(r["us_norm_kernel"])); new.append(float(r["us_dual_block"]))
    device, date = rows[0]["device"], rows[0]["date"]
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], base, 0.4, label="the norm on its own kernel (default)")
    ax.bar([i + 0.2 for i in x], new, 0.4, label="dual_block: no norm kernel")
    for i, (b, n) in enumerate(zip(base, new)):
        ax.text(i + 0.2, n + 0.3, f"{b / n:.3f}x", ha="center", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_xlabel("sparsity; the norm-folded GEMV's configuration (default: BN 2, 8 warps)", fontsize=8)
    ax.set_ylabel("us a call (median)")
    ax.set_ylim(0, max(base + new) * 1.2)
    ax.set_title(f"dual[lowrank]: a folded layer's MLP half, Llama-3.1-8B shape, {device}, {date}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "block_ab.png"), dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
