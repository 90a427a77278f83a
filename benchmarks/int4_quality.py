"""Quality of 4-bit weights on a real model, on the CPU: RTN at groups of 32 / 64 / 128 and the GGUF route.

    PYTHONPATH=src python benchmarks/int4_quality.py --model smollm2-135m --out results/int4

The reference is the model as ``countdown.load_model`` gives it: its GGUF file de-quantized, in float32 (the
CSV's ``*_vs_bf16`` columns are named for the bf16 model a GPU runs; on the CPU the reference is this float32
one, and the ``bf16`` row says how far bf16 itself is from it). Rows, all ``method = dense`` (sparse rows on
4-bit weights come later):

* ``fp32``: the reference against itself (0 by construction: checks the harness);
* ``bf16``: the whole model cast to bfloat16 (weights and arithmetic);
* ``int4-rtn-g32`` / ``-g64`` / ``-g128``: every decoder Linear rounded to 4 bits from the reference weights
  (``countdown.quantize(model, group=G)``: min-max, float16 scales and offsets), computed in float32;
* ``int4-gguf``: ``countdown.quantize(model, source="gguf")``: the file's own 4-bit blocks, which must give the
  reference exactly (the script checks the logits are identical and says so).

Per row: decode-style perplexity (``countdown.perplexity(metric="decode")``: 512-token windows of held-out
XSum, the first half a dense prompt, the second half scored) and, on the same windows,
``KL(reference || row)`` and top-1 agreement as ``countdown.bench.quality.decode_quality`` computes them.
Writes ``<out>/<model>.csv`` (the columns below) and ``<out>/<model>.json`` (every figure, bytes included).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import platform
import sys
import time
from pathlib import Path

import torch

import countdown
from countdown.bench.quality import decode_quality, held_out
from countdown.int4 import Int4Linear

FIELDS = ["weights", "method", "sparsity", "sparsity_real", "ppl_increase_vs_bf16", "kl_vs_bf16"]


def variants(reference):
    """(label, model) for every row, each built from a copy of the reference."""
    yield "fp32", reference
    yield "bf16", copy.deepcopy(reference).to(torch.bfloat16)
    for group in (32, 64, 128):
        yield f"int4-rtn-g{group}", countdown.quantize(copy.deepcopy(reference), group=group)
    yield "int4-gguf", countdown.quantize(copy.deepcopy(reference), source="gguf")


def linear_bytes(model) -> dict:
    """Bytes of the decoder Linears' weights as held, and the same weights in bf16."""
    held = bf16 = 0
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, Int4Linear):
            held += module.int4.nbytes
            bf16 += 2 * module.in_features * module.out_features
        elif isinstance(module, torch.nn.Linear) and module is not head:
            held += module.weight.numel() * module.weight.element_size()
            bf16 += 2 * module.weight.numel()
    return {"linear_bytes": held, "linear_bytes_bf16": bf16}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096, help="held-out XSum tokens (512-token windows)")
    parser.add_argument("--out", default="results/int4")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    reference, tokenizer = countdown.load_model(args.model)
    held = held_out(reference, tokenizer, max_tokens=args.tokens)
    probe = held.rows[:1]
    with torch.no_grad():
        reference_logits = reference(probe).logits
    rows, details = [], []
    for label, model in variants(reference):
        start = time.perf_counter()
        ppl = countdown.perplexity(model, tokenizer, max_tokens=args.tokens, metric="decode", progress=False)
        countdown.sparsify(model, "dense")  # decode_quality scores a patched model; "dense" computes the model
        scores = decode_quality(model, held)
        countdown.unsparsify(model)
        with torch.no_grad():
            identical = bool(torch.equal(model(probe).logits.float(), reference_logits))
        detail = {"weights": label, "ppl_decode": ppl, "ppl_decode_quality": scores["ppl"],
                  "reference_ppl": held.dense_ppl, "kl": scores["kl"], "top1": scores["top1"],
                  "tokens_scored": scores["tokens"], "identical_logits_first_window": identical,
                  "seconds": round(time.perf_counter() - start, 1), **linear_bytes(model)}
        details.append(detail)
        rows.append({"weights": label, "method": "dense", "sparsity": 0.0, "sparsity_real": 0.0,
                     "ppl_increase_vs_bf16": f"{scores['ppl_increase']:.6f}", "kl_vs_bf16": f"{scores['kl']:.6g}"})
        print(f"{label:14s} ppl {ppl:.4f} (+{100 * scores['ppl_increase']:.3f} %)  KL {scores['kl']:.5f}  "
              f"top-1 {scores['top1']:.4f}  identical logits {identical}  "
              f"Linear weights {detail['linear_bytes'] / 1e6:.1f} MB  ({detail['seconds']} s)", flush=True)
        if label == "int4-gguf" and not (identical and scores["kl"] == 0.0 and scores["ppl_increase"] == 0.0):
            sys.exit("the GGUF route did not reproduce the de-quantized model exactly")
        if model is not reference:
            del model
    with open(out / f"{args.model}.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    meta = {"model": args.model, "tokens": args.tokens, "device": f"CPU ({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})",
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "command": " ".join(sys.argv)}
    (out / f"{args.model}.json").write_text(json.dumps({**meta, "rows": details}, indent=2) + "\n")


if __name__ == "__main__":
    main()
