"""``benchmarks/int4_decode.py --report``: ``decode.md`` (per run, the 4-bit step table and the GEMV table) and
``decode.png`` from the ``decode.csv`` / ``gemv.csv`` rows of that script's calls."""

from __future__ import annotations

import csv
import os


def report(out: str) -> None:
    """decode.md (per run: the step table and the GEMV table) and decode.png from the CSVs in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(csv.DictReader(open(os.path.join(out, "decode.csv"), newline="")))
    gemvs = list(csv.DictReader(open(os.path.join(out, "gemv.csv"), newline=""))) \
        if os.path.exists(os.path.join(out, "gemv.csv")) else []
    lines = ["# 4-bit decoding: the step and its GEMVs", "",
             "Llama-3.1-8B shape (random weights), batch 1, bf16 activations, 4-bit RTN group 128 on every decoder "
             "Linear and lm_head; `PYTHONPATH=src python benchmarks/int4_decode.py` (its docstring says how).", ""]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for run in dict.fromkeys(r["run"] for r in steps):
        mine = [r for r in steps if r["run"] == run]
        base = {r["weights"]: float(r["tokens_per_s"]) for r in mine if r["method"] == "dense"}
        lines += [f"## Run {run} ({mine[0]['device']}, {mine[0]['date']})", "",
                  "| weights | method | k | tokens/s | vs bf16 | vs int4 dense | vs int4-torch | share of copy bandwidth "
                  "| worst GEMV / roofline |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            t = float(r["tokens_per_s"])
            vs_t = f"{t / base['int4-torch']:.2f}x" if "int4-torch" in base else "-"
            vs_4 = f"{t / base['int4']:.2f}x" if "int4" in base else "-"
            k = "-" if r["method"] == "dense" else r["sparsity"]
            vs_b = f"{t / base['bf16']:.2f}x" if "bf16" in base else "-"
            lines.append(f"| {r['weights']} | {r['method']} | {k} | {t:.1f} | {vs_b} | {vs_4} | {vs_t} | "
                         + (f"{float(r['bw_share']):.0%} | " if r["bw_share"] else "- | ") + f"{r['gemv_roofline_ratio'] or '-'} |")
        mine_g = [g for g in gemvs if g["run"] == run]
        if mine_g:
            lines += ["", "| GEMV | n x k | backend | us | roofline ratio |", "|---|---|---|---|---|"]
            lines += [f"| {g['shape']} | {g['n']} x {g['k']} | {g['backend']} | {g['us']} | {g['roofline_ratio']} |"
                      for g in mine_g]
        lines.append("")
        ax.barh([f"{run} {w}" for w in base], list(base.values()))
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s (batch 1)")
    ax.set_title("Llama-3.1-8B shape: bf16 vs 4-bit backends")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "decode.png"), dpi=120)
    with open(os.path.join(out, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
