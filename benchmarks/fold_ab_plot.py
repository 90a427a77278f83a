"""Plot an A/B of COUNTDOWN_FOLD_MLP (benchmarks/fold_mlp_ab.sh) from its CSV: tokens/s per process, by method.

    python benchmarks/fold_ab_plot.py benchmarks/results/decode_runs/H200-run-BM/fold_ab.csv
"""

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str) -> None:
    rows = list(csv.DictReader(open(path)))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for i, method in enumerate(methods):
        for fold, color, label in (("0", "tab:gray", "norm, MLP, add apart (FOLD_MLP=0)"),
                                   ("1", "tab:blue", "folded into the MLP's kernels (FOLD_MLP=1)")):
            ys = [float(r["tokens_per_s"]) for r in rows if r["method"] == method and r["fold_mlp"] == fold]
            xs = [i + (0.15 if fold == "1" else -0.15)] * len(ys)
            ax.scatter(xs, ys, color=color, label=label if i == 0 else None, zorder=3)
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("tokens/s (batch 1, k = 0.9)")
    ax.set_title("Per-compile decode, Llama-3.1-8B shape, H200: one process a point", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    out = Path(path).with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
