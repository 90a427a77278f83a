"""A model changed after ``countdown.generate`` prepared its step: rebuilt, never run stale (GPU check and speed).

    PYTHONPATH=src python benchmarks/stale_step.py --out $OUT/stale      # CUDA: the Llama-3.1-8B shape, bf16
    PYTHONPATH=src python benchmarks/stale_step.py --smoke                # CPU: a tiny Llama (a check of this script)

Two models with the same random weights: A decodes in bf16 first, then is quantized in place
(``countdown.quantize``) and decodes again; B is quantized before its first ``generate``. A's second call must give
B's tokens (and, compiled, B's speed): a step prepared for the bf16 model that kept running would read its stacked
bf16 q/k/v copy with 4-bit MLPs (different tokens) at the bf16 speed. Then the same for ``sparsify`` after a dense
generate against a model sparsified first. Prints a table of tokens/s and whether the tokens match; writes
``stale_step.csv`` with the command, device and date.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import sys
import time

import torch

import countdown


def model_pair(device: str, smoke: bool):
    """Two models with the same weights (bf16 on CUDA, fp32 on the CPU)."""
    if smoke:
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=352, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=1000)
        torch.manual_seed(0)
        a = AutoModelForCausalLM.from_config(cfg).eval()
        torch.manual_seed(0)
        b = AutoModelForCausalLM.from_config(LlamaConfig(**cfg.to_dict())).eval()
        return a, b
    load = dict(dtype="bf16", device=device, random_weights=True)
    torch.manual_seed(0)
    a = countdown.load_model("llama-3.1-8b-shape", **load)[0]
    b = countdown.load_model("llama-3.1-8b-shape", **load)[0]
    b.load_state_dict(a.state_dict())
    return a, b


def timed(model, ids, new: int) -> tuple[torch.Tensor, float]:
    """Tokens of one greedy call after one untimed call, and the tokens/s of the timed one (prompt counted)."""
    countdown.generate(model, ids, new, eos_token_id=[])
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = countdown.generate(model, ids, new, eos_token_id=[])
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, new / (time.perf_counter() - start)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for stale_step.csv")
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    a, b = model_pair(device, args.smoke)
    for m in (a, b):
        m.generation_config.eos_token_id = None
    ids = torch.randint(0, a.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    rows = []
    _, tps = timed(a, ids, args.new_tokens)
    rows.append(("bf16, A's first step", tps, ""))
    countdown.quantize(a, group=args.group, lm_head=True)
    after, tps_after = timed(a, ids, args.new_tokens)
    countdown.quantize(b, group=args.group, lm_head=True)
    first, tps_first = timed(b, ids, args.new_tokens)
    same = torch.equal(after, first)
    rows.append(("4-bit, quantized after a bf16 generate (A)", tps_after, same))
    rows.append(("4-bit, quantized before the first generate (B)", tps_first, ""))
    stamp = {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
             "date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv)}
    print(f"{'model':48s} {'tokens/s':>9s}  same tokens as B")
    for name, value, match in rows:
        print(f"{name:48s} {value:9.1f}  {match}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "stale_step.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["run", "tokens_per_s", "same_tokens_as_quantized_first", "device", "date", "command"])
            for name, value, match in rows:
                w.writerow([name, f"{value:.1f}", match, stamp["device"], stamp["date"], stamp["command"]])
        print(json.dumps(stamp))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
