"""How far SP-Ideal's cheap per-shard top-k is from the exact global top-k, on a real model.

    PYTHONPATH=src python benchmarks/tp_topk_gap.py --out results

results/tp_topk_gap.md / .json (2-core CPU, 36 min) came from ``--model smollm2-135m --methods mono,dual
--ks 0.7,0.8,0.9 --worlds 2,4,8 --tokens 1024 --ppl-tokens 2048 --ppl-k 0.8`` (the defaults) with
``--out benchmarks/results`` then.

Under tensor parallelism each rank holds ``d_inter / world`` rows of every Gated-MLP. The exact
SP-Ideal mask keeps the ``n_keep`` rows of largest indicator over ALL rows (``tp_topk="exact"``: one
all-gather per layer); ``tp_topk="shard"`` keeps ``n_keep / world`` rows on every shard. The masks
depend only on the rows, not on where they run, so ``world`` shards are simulated on one process:

* per layer, on the Gated-MLP inputs of held-out text (dense model): the fraction of keep bits that
  differ, the share of the exact mask the per-shard mask keeps (recall), and the relative error of
  the MLP output against the exact-mask output (``countdown.model.tensor_parallel.topk_gap``);
* end to end: perplexity (every position sparse) with the exact and the per-shard top-k.

Output: ``tp_topk_gap.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

import countdown
from countdown.selectors.stream import stream_mlp_inputs, token_windows
from countdown.data.texts import eval_texts
from countdown.model.gated_mlp import require_gated_mlps
from countdown.sparse_methods.registry import get_method
from countdown.patch.state import state_of
from countdown.model.tensor_parallel import ShardSpec, chunk_range, shard_topk_keep, topk_gap


def simulate_shard_topk(model, world: int) -> None:
    """On a one-process model patched in SP-Ideal: every selector keeps the per-shard top-k of
    ``world`` simulated shards (what ``tp_topk="shard"`` does on ``world`` ranks)."""
    for layer in state_of(model).layers:
        sel, d = layer.selector, layer.mlp.d_inter

        def forward(x, u, h, sel=sel, d=d):
            score = sel.method.indicator(u, h)
            keep = torch.zeros_like(score, dtype=torch.bool)
            for r in range(world):
                start, stop = chunk_range(d, world, r)
                keep[:, start:stop] = shard_topk_keep(score[:, start:stop], sel.n_keep, ShardSpec(r, world, start, stop, d))
            return keep

        sel.forward = forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="mono,dual")
    ap.add_argument("--ks", default="0.7,0.8,0.9")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--tokens", type=int, default=1024, help="held-out tokens for the per-layer figures")
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--ppl-k", type=float, default=0.8)
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    start = time.perf_counter()
    model, tok = countdown.load_model(args.model)
    mlps = require_gated_mlps(model)
    texts = eval_texts()
    inputs: dict[int, list] = {i: [] for i in range(len(mlps))}
    stream_mlp_inputs(model, mlps, token_windows(tok, texts, args.tokens, 512),
                      lambda i, x: inputs[i].append(x.detach().clone()), progress=False)
    X = {i: torch.cat(v) for i, v in inputs.items()}
    worlds = [int(w) for w in args.worlds.split(",")]
    ks = [float(k) for k in args.ks.split(",")]
    layer_rows = []
    for method in args.methods.split(","):
        m = get_method(method)
        for k in ks:
            for world in worlds:
                per = [topk_gap(mlp, m, X[i], k, world) for i, mlp in enumerate(mlps)]
                mean = {key: sum(p[key] for p in per) / len(per) for key in per[0]}
                layer_rows.append({"method": method, "k": k, "world": world, **{key: round(v, 4) for key, v in mean.items()}})
                print(layer_rows[-1], flush=True)
    ppl_rows = []
    for method in args.methods.split(","):
        countdown.sparsify(model, method, args.ppl_k, scope="all")
        exact = countdown.perplexity(model, tok, max_tokens=args.ppl_tokens, progress=False)
        countdown.unsparsify(model)
        row = {"method": method, "k": args.ppl_k, "exact": round(exact, 3)}
        for world in worlds:
            countdown.sparsify(model, method, args.ppl_k, scope="all")
            simulate_shard_topk(model, world)
            row[f"shard_world{world}"] = round(countdown.perplexity(model, tok, max_tokens=args.ppl_tokens, progress=False), 3)
            countdown.unsparsify(model)
        ppl_rows.append(row)
        print(row, flush=True)
    dense = countdown.perplexity(model, tok, max_tokens=args.ppl_tokens, progress=False)
    meta = {"model": args.model, "date": datetime.date.today().isoformat(), "device": "cpu (2 cores), fp32",
            "command": "PYTHONPATH=src python benchmarks/tp_topk_gap.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
            "tokens": args.tokens, "ppl_tokens": args.ppl_tokens, "dense_ppl": round(dense, 3),
            "seconds": round(time.perf_counter() - start, 1)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tp_topk_gap.json"), "w") as f:
        json.dump({"meta": meta, "layers": layer_rows, "perplexity": ppl_rows}, f, indent=1)
    lines = ["# SP-Ideal under tensor parallelism: exact global top-k against per-shard top-k", "",
             f"- {meta['model']}, {meta['device']}, {meta['date']}; `{meta['command']}`",
             f"- per layer: Gated-MLP inputs of {args.tokens} XSum tokens (dense model), mean over the "
             f"{len(mlps)} layers; shards simulated on one process (the masks depend only on the rows)", "",
             "| method | k | world | keep bits differing | recall of the exact mask | MLP output error vs exact | "
             "exact vs dense (scale) |", "|---|---|---|---|---|---|---|"]
    for r in layer_rows:
        lines.append(f"| {r['method']} | {r['k']} | {r['world']} | {100 * r['mask_differs']:.2f}% | {r['recall']:.3f} | "
                     f"{r['output_rel_err']:.3f} | {r['dense_rel_err']:.3f} |")
    lines += ["", f"Perplexity, every position sparse, {args.ppl_tokens} XSum tokens, k = {args.ppl_k} (dense "
              f"{dense:.2f}):", "", "| method | exact top-k | " + " | ".join(f"per-shard, {w} shards" for w in worlds) + " |",
              "|---|---|" + "---|" * len(worlds)]
    for r in ppl_rows:
        lines.append(f"| {r['method']} | {r['exact']:.2f} | " + " | ".join(f"{r[f'shard_world{w}']:.2f}" for w in worlds) + " |")
    with open(os.path.join(args.out, "tp_topk_gap.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
