"""Plots of the one-token sparse routes against the default: overlap.py's whole MLPs over k and split.py's
launches alone (results written by those scripts).

    cd benchmarks && python plot_routes.py results/overlap/overlap.csv results/split/split.csv
"""

from __future__ import annotations

import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _save(fig, path: str) -> str:
    """The figure as PATH with .png for its extension; returns that path."""
    out = os.path.splitext(path)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def plot_overlap(path: str) -> str:
    rows = [r for r in _rows(path) if r["stage"] in ("ks", "compiled")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    for ax, method in zip(axes, ("mono", "dual")):
        for stage, style in (("ks", "-"), ("compiled", ":")):
            for route, color in (("onepass", "tab:blue"), ("overlap", "tab:orange")):
                pts = sorted((float(r["k"]), float(r["us"])) for r in rows
                             if r["method"] == method and r["stage"] == stage and r["route"] == route)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{route} ({stage})")
        roof = sorted({(float(r["k"]), float(r["roofline_us"])) for r in rows if r["method"] == method})
        ax.plot(*zip(*roof), "--", color="gray", label="roofline")
        ax.set_title(f"{method}: whole MLP, one token")
        ax.set_xlabel("k (share of rows skipped)")
        ax.set_ylabel("us")
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_split(path: str) -> str:
    rows = [r for r in _rows(path) if r["stage"] == "parts"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, method in zip(axes, ("mono", "dual")):
        labels, onepass, split = [], [], []
        for k in sorted({r["k"] for r in rows}, reverse=True):
            get = {r["kernel"]: float(r["us"]) for r in rows if r["method"] == method and r["k"] == k}
            labels.append(f"k={k}")
            onepass.append((get.get("onepass-op", 0), get.get("onepass-sum", 0)))
            split.append((get.get("split-coef", 0), get.get("split-down", 0)))
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], [a for a, _ in onepass], 0.4, label="onepass op", color="tab:blue")
        ax.bar([i - 0.2 for i in x], [b for _, b in onepass], 0.4, bottom=[a for a, _ in onepass],
               label="partials' sum", color="lightsteelblue")
        ax.bar([i + 0.2 for i in x], [a for a, _ in split], 0.4, label="split: coefficients", color="tab:orange")
        ax.bar([i + 0.2 for i in x], [b for _, b in split], 0.4, bottom=[a for a, _ in split],
               label="split: down by columns", color="navajowhite")
        ax.set_xticks(list(x), labels)
        ax.set_title(f"{method}: sparse phase, each launch alone")
        ax.set_ylabel("us")
        ax.legend(fontsize=7)
    return _save(fig, path)


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    for path in sys.argv[1:]:
        name = os.path.basename(path)
        out = plot_overlap(path) if name.startswith("overlap") else plot_split(path)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
