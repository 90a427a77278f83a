"""The mixed model's memory at the Llama-3.1-8B shape against the bf16 model (issue 58's memory target: other Linears
and lm_head 4-bit, embedding bf16, at most 55 % of the bf16 model).

    PYTHONPATH=src python benchmarks/mixed_memory.py --out results/mixed       # about a minute on a CPU, ~5 GB RAM

The model is built with ``--layers`` decoder layers (default 2: the real widths, vocabulary and embedding) and its
tensors counted, by kind, as it holds them (parameters and buffers, each storage once: the stacked gate/up views of a
prepared step are not made here). A decoder layer's bytes are the same in every layer, so the 32-layer model's bytes
are the counted embedding, lm_head and final norm plus 32 times one layer's (the layer's bytes are the mean over the
``--layers`` built). Configurations: ``bf16`` (the model as loaded), ``int4`` (``countdown.quantize(group=64,
lm_head=True)``) and ``mixed`` (``to_nested(group=64)``, then that quantize: what ``countdown.prepare`` with
``dual[mixed]`` leaves, since the patch adds only its per-layer cut and counters). Writes ``<out>/memory.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch

import countdown


def storages(module: torch.nn.Module):
    """(name, tensor) of every parameter and buffer, each storage once."""
    seen = set()
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            yield name, t


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for _, t in storages(module))


def model(layers: int, config: str):
    from countdown.int4.nested_model import to_nested

    m = countdown.load_model("llama-3.1-8b-shape", dtype="bf16", random_weights=True,
                             config_overrides={"num_hidden_layers": layers})[0]
    if config == "mixed":
        m = to_nested(m, group=64)
    if config in ("int4", "mixed"):
        countdown.quantize(m, group=64, lm_head=True)
    return m


def parts(m, full_layers: int) -> dict[str, float]:
    layers = m.model.layers
    per_layer = sum(nbytes(layer) for layer in layers) / len(layers)
    mlp = sum(nbytes(layer.mlp) for layer in layers) / len(layers)
    rest = nbytes(m) - sum(nbytes(layer) for layer in layers)
    head = nbytes(m.lm_head) if m.lm_head.weight is not m.model.embed_tokens.weight else 0
    return {"embedding": nbytes(m.model.embed_tokens), "lm_head": head, "MLPs": full_layers * mlp,
            "attention and norms": full_layers * (per_layer - mlp), "total": rest + full_layers * per_layer}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/mixed")
    p.add_argument("--layers", type=int, default=2, help="decoder layers built (the count is per layer)")
    a = p.parse_args(argv)
    full = 32  # Llama-3.1-8B's layers
    got = {}
    for config in ("bf16", "int4", "mixed"):
        m = model(a.layers, config)
        got[config] = parts(m, full)
        del m
        print(f"{config}: {got[config]['total'] / 1e9:.3f} GB", flush=True)
    base = got["bf16"]["total"]
    lines = ["# Memory at the Llama-3.1-8B shape (issue 58's memory target)", "",
             f"{datetime.date.today()}, CPU, torch {torch.__version__}; the tensors counted on a {a.layers}-layer model "
             f"of the real widths, a layer's bytes times {full} (`benchmarks/mixed_memory.py`, its docstring):", "",
             f"    PYTHONPATH=src python benchmarks/mixed_memory.py --out {a.out} --layers {a.layers}", "",
             "| config | embedding | lm_head | attention and norms | MLPs | total GB | x bf16 |", "|---|---|---|---|---|---|---|"]
    for config, r in got.items():
        lines.append(f"| {config} | {r['embedding'] / 1e9:.3f} | {r['lm_head'] / 1e9:.3f} | "
                     f"{r['attention and norms'] / 1e9:.3f} | {r['MLPs'] / 1e9:.3f} | {r['total'] / 1e9:.3f} | "
                     f"{r['total'] / base:.3f} |")
    lines += ["", "GB = 10^9 bytes. `mixed`: the MLPs nested 8-bit (9 bits a weight with scales, groups of 64), every "
              "other Linear and lm_head 4-bit (4.5 bits), the embedding bf16 (target: at most 0.55 of bf16)."]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-len(got) - 4:]))


if __name__ == "__main__":
    main()
