"""How many rows a batch of B decode tokens keeps together, on a real model: the batch rule.

    PYTHONPATH=src python benchmarks/batch_union.py --model smollm2-135m --passages 32 --out results
    PYTHONPATH=src python benchmarks/batch_union.py --model gemma3-270m --passages 16 --out results

results/batch_union_<model>.md / .json / .png (CPU, fp32) came from these commands (with ``--ks 0.7,0.8,0.9
--batches 1,2,4,8 --tokens 128``, the defaults, and ``benchmarks/results`` for ``--kernels`` and ``--out``
then).

At batch B a sparse decode step reads the *union* of the B tokens' kept rows (the kernels' batch
path). If the tokens chose their rows independently the union would keep ``1 - k^B`` of the rows
(k = 0.9: 0.19 / 0.34 / 0.57 at B = 2 / 4 / 8); real tokens share their large rows, so it keeps
fewer. This script measures it: B held-out passages run through the dense model side by side, and
at every position the B tokens (one per passage, what one decode step of a batch of B sequences
sees) are masked by each method's SP-Ideal indicator (per-token top-k of |u|, |act(g)|, |u * act(g)|);
the union's kept fraction is averaged over positions and layers. The kernel table
(``results/kernels.csv``, H200) gives the MLP speed-up as a function of the union's kept
fraction, and together they give the rule the README states.

Output: ``batch_union.md`` / ``.json`` / ``.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import time
from pathlib import Path

import torch

import countdown
from countdown.eval.analysis import top_mask
from countdown.data.texts import eval_texts
from countdown.io import atomic_path, atomic_write, write_json
from countdown.model.gated_mlp import require_gated_mlps

INDICATORS = {"mono": lambda u, h: u, "cats": lambda u, h: h, "dual": lambda u, h: u * h}


def passages(tokenizer, count: int, tokens: int) -> torch.Tensor:
    """``count`` held-out passages of exactly ``tokens`` tokens each, ``[count, tokens]``."""
    rows = []
    for text in eval_texts():
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if ids.numel() >= tokens:
            rows.append(ids[:tokens])
        if len(rows) == count:
            return torch.stack(rows)
    raise SystemExit(f"only {len(rows)} held-out passages have {tokens} tokens; ask for fewer --tokens")


@torch.no_grad()
def union_fractions(model, ids: torch.Tensor, batches: list[int], ks: list[float]) -> dict:
    """``{method: {k: {B: mean kept fraction of the union of B tokens}}}`` plus per-token kept."""
    mlps = require_gated_mlps(model)
    inputs: list[torch.Tensor] = []
    hooks = [m.module.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach()))
             for m in mlps]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    sums = {m: {k: {b: 0.0 for b in batches} for k in ks} for m in INDICATORS}
    count = {b: 0 for b in batches}
    for mlp, x in zip(mlps, inputs):  # x: [passages, positions, d_model]
        u, g = mlp.parts(x.float())
        h = mlp.act(g)
        for name, ind in INDICATORS.items():
            score = ind(u, h)
            for k in ks:
                keep = top_mask(score, k)  # [passages, positions, d_inter]
                for b in batches:
                    groups = keep.shape[0] // b
                    union = keep[: groups * b].reshape(groups, b, *keep.shape[1:]).any(dim=1)
                    sums[name][k][b] += union.float().mean().item()
    for b in batches:
        count[b] = len(mlps)
    return {m: {str(k): {str(b): sums[m][k][b] / count[b] for b in batches} for k in ks} for m in sums}


def kernel_speedups(path: Path) -> list[dict]:
    """Rows of the kernel table at the Llama-3.1-8B shape: batch, kept fraction of the union, speed-up."""
    if not path.exists():
        return []
    out = []
    for r in csv.DictReader(path.open()):
        if r["shape"] == "Llama-3.1-8B" and r["method"] in ("mono", "cats", "dual") and r["union_frac"]:
            out.append({"method": r["method"], "batch": int(r["batch"]), "sparsity": float(r["sparsity"]),
                        "union_frac": float(r["union_frac"]), "speedup": float(r["speedup"]), "device": r["device"]})
    return out


def plot(result: dict, kernel_rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, by_k in result["union"].items():
        for k, by_b in by_k.items():
            bs = [int(x) for x in by_b]
            a.plot(bs, list(by_b.values()), marker="o", label=f"{name} k={k}")
    for k in result["ks"]:
        bs = result["batches"]
        a.plot(bs, [1 - k ** x for x in bs], ls=":", color="grey")
    a.set_xlabel("batch B (tokens of different sequences)")
    a.set_ylabel("kept fraction of the union")
    a.set_title(f"{result['model']}: union of B tokens' masks (dotted: independent 1-k^B)", fontsize=9)
    a.legend(fontsize=7, ncol=2)
    for name in ("mono", "cats", "dual"):
        rows = [r for r in kernel_rows if r["method"] == name]
        b.scatter([r["union_frac"] for r in rows], [r["speedup"] for r in rows], s=14, label=name)
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_xlabel("kept fraction of the union (rows read)")
    b.set_ylabel("MLP speed-up over cuBLAS dense")
    dev = kernel_rows[0]["device"] if kernel_rows else "?"
    b.set_title(f"kernel table, Llama-3.1-8B MLP, batch 1-8, {dev}", fontsize=9)
    b.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def break_even(kernel_rows: list[dict]) -> float | None:
    """The largest union kept fraction at which the batch path still beat dense (speed-up >= 1)."""
    paying = [r["union_frac"] for r in kernel_rows if r["batch"] > 1 and r["speedup"] >= 1.0]
    return max(paying) if paying else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ks", default="0.7,0.8,0.9")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--passages", type=int, default=32, help="held-out passages (a multiple of every batch)")
    ap.add_argument("--tokens", type=int, default=128, help="positions per passage")
    ap.add_argument("--kernels", default="results/kernels.csv")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    ks = [float(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    t0 = time.time()
    model, tok = countdown.load_model(args.model)
    ids = passages(tok, args.passages, args.tokens)
    union = union_fractions(model, ids, batches, ks)
    kernel_rows = kernel_speedups(Path(args.kernels))
    result = {"model": args.model, "ks": ks, "batches": batches, "passages": args.passages,
              "tokens": args.tokens, "union": union, "kernel_break_even_union": break_even(kernel_rows),
              "date": datetime.date.today().isoformat(), "seconds": round(time.time() - t0, 1),
              "command": "PYTHONPATH=src python benchmarks/batch_union.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"batch_union_{args.model}"
    write_json(out / f"{stem}.json", result)
    lines = [f"# Union of a batch's kept rows on {args.model} (SP-Ideal masks, dense activations)", "",
             f"{args.passages} held-out XSum passages x {args.tokens} positions; at each position B tokens "
             f"of B different passages form one decode batch. {result['date']}, CPU, fp32.", "",
             f"`{result['command']}`", "",
             "| method | k | " + " | ".join(f"B={b}" for b in batches) + " | independent 1-k^B at B=" + str(batches[-1]) + " |",
             "|---|---|" + "---|" * len(batches) + "---|"]
    for name, by_k in union.items():
        for k, by_b in by_k.items():
            lines.append(f"| {name} | {k} | " + " | ".join(f"{v:.3f}" for v in by_b.values())
                         + f" | {1 - float(k) ** batches[-1]:.3f} |")
    be = result["kernel_break_even_union"]
    lines += ["", f"Kernel table ({args.kernels}): the largest union kept fraction at which a batch > 1 "
              f"sparse MLP still beat cuBLAS dense: {be if be is None else round(be, 3)}."]
    atomic_write(out / f"{stem}.md", "\n".join(lines) + "\n")
    plot(result, kernel_rows, out / f"{stem}.png")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
