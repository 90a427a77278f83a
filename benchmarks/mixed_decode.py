"""dual[mixed] decoding on one GPU (issue 58, item 5): the mixed MLP's step against our dense 4-bit, 8-bit and bf16
steps, batch 1, in one call.

    PYTHONPATH=src python benchmarks/mixed_decode.py --out results/mixed --run M1
    PYTHONPATH=src python benchmarks/mixed_decode.py --smoke --out /tmp/mixed      # this script on the CPU

The Llama-3.1-8B shape with random weights (values do not change batch-1 speed, except for the share of rows the
mixed MLP refines: that share is set by cuts calibrated with ``countdown.prepare`` on the model's own MLP inputs, and
the kernels count it: Sparsity-Real, the share left at 4 bits, is printed and written to ``decode.md``), bf16
activations, groups of 64 for the 4-bit and the nested weights alike. Configurations (``config``):

* ``bf16``: the model as loaded on our fastest step;
* ``int4``: every Linear and lm_head 4-bit (``countdown.quantize(group=64, lm_head=True)``);
* ``int4-torch``: that model on PyTorch's int4 GEMV (``countdown.int4.use_backend(model, "torch")``:
  ``aten._weight_int4pack_mm``, gpt-fast's kernel), the baseline a user has without us;
* ``int8``: the MLPs nested 8-bit read whole (``to_nested``, then the other Linears and lm_head 4-bit as above; the
  mixed kernels with every row refined);
* ``dual[mixed]`` at k = 0.8 / 0.9 / 0.95: that model, ``prepare`` then ``sparsify`` (the kernels refine the rows
  over each layer's calibrated cut). One compile serves the three k: the selectors' cuts are swapped in place
  between runs (the artifact's cuts of that k; the step reads them as buffers);
* ``dual[mixed,rank=error]`` (``--configs mixed-error``): the same with rows ranked by the expected size of their
  refinement (the select reads |x| and four constants a row besides).

Each configuration is timed through ``countdown.generate`` (compiled, CUDA graphs; best of ``--repeats`` after a
first, compiling call) over ``--new-tokens`` greedy tokens after a ``--prompt``-token prompt: ``<config>`` rows hold
the decode steps alone (tokens/s of the steps, ms a step), ``<config>+prompt`` rows the whole call with the prompt
counted (new tokens / total seconds; ms = total / new tokens). ``mlp_us``: one MLP of one token alone, on its decode
route (our kernels), cycling through the layers (each layer's weights once per pass: none from L2), from a CUDA
graph; ``mlp_bytes``: the bytes it reads (high planes, plus the kept share of the low planes for dual[mixed]).
Rows append to ``<out>/decode.csv`` (``run, device, date, config, k, tokens_per_s, step_ms, mlp_us, mlp_bytes``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import random

import torch

import countdown

FIELDS = ["run", "device", "date", "config", "k", "tokens_per_s", "step_ms", "mlp_us", "mlp_bytes"]
SMOKE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}
GROUP = 64
KS = (0.8, 0.9, 0.95)
MIXED = {"mixed": "dual[mixed]", "mixed-error": "dual[mixed,rank=error]"}  # --configs name: the method spec


class ByteTokenizer:
    """Calibration text to ids: one token per byte (+3), BOS 1; enough for cuts on a random-weight model."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + b for b in text.encode()]}

    def encode(self, text, add_special_tokens=False):
        return self(text)["input_ids"]


def texts(n: int = 8, words: int = 400) -> list[str]:
    rng = random.Random(0)
    vocab = ["".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    return [" ".join(rng.choices(vocab, weights=[1 / (r + 1) for r in range(300)], k=words)) for _ in range(n)]


def log(msg: str) -> None:
    print(msg, flush=True)


def bf16_model(device: str):
    if device == "cuda":
        return countdown.load_model("llama-3.1-8b-shape", dtype="bf16", device=device, random_weights=True)[0]
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**SMOKE)).eval()


def timed(model, ids, new_tokens: int, repeats: int) -> dict:
    """countdown.generate's statistics: best decode of ``repeats`` after a first (compiling) call."""
    countdown.generate(model, ids, new_tokens, eos_token_id=[], return_stats=True)
    runs = [countdown.generate(model, ids, new_tokens, eos_token_id=[], return_stats=True)[1] for _ in range(repeats)]
    return max(runs, key=lambda s: s["decode_tokens_per_s"])


def mlp_inputs(model, ids) -> list[torch.Tensor]:
    """Each layer's MLP input at the prompt's last position (a hook on the prompt's forward)."""
    seen, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0][:, -1:].detach().clone())))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def mlp_us(model, xs, device: str, profile: bool = False) -> float:
    """One MLP of one token on its decode route, microseconds, cycling through every layer."""
    if device != "cuda":
        return float("nan")
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from harness.timing import time_graph

    for layer in model.model.layers:  # after mlp_inputs' prompt pass a patch computes dense: these are decode calls
        patch = getattr(layer.mlp, "countdown_sparse", None)
        if patch is not None and patch.state is not None:
            patch.state.prompt_pass = False
    calls = [(lambda mlp=layer.mlp, x=x: mlp(x)) for layer, x in zip(model.model.layers, xs)]
    with torch.no_grad():
        us = time_graph(calls, device=device)
        if profile:  # each kernel's time of a pass over the layers' MLPs (launched one by one: no graph)
            from torch.profiler import ProfilerActivity, profile as prof

            with prof(activities=[ProfilerActivity.CUDA]) as pr:
                for _ in range(3):
                    for call in calls:
                        call()
                torch.cuda.synchronize()
            log(pr.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        return us


def mlp_bytes(d_model: int, d_inter: int, config: str, kept: float) -> int:
    plane = d_inter * d_model // 2 + 2 * 2 * d_inter * d_model // GROUP  # codes + fp16 scale and offset
    return {"bf16": 3 * 2 * d_model * d_inter, "int4": 3 * plane, "int8": 6 * plane}.get(config,
                                                                                       round(3 * plane * (1 + kept)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/mixed")
    p.add_argument("--run", default="")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (eager steps)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="bf16,int4,int8,mixed")
    p.add_argument("--profile", action="store_true", help="each MLP kernel's time (torch.profiler), int4 and mixed")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.smoke:
        args.new_tokens, args.repeats, args.prompt = min(args.new_tokens, 6), 1, min(args.prompt, 16)
    stamp = {"run": args.run, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
             "date": datetime.date.today().isoformat()}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode.csv")
    todo = args.configs.split(",")
    rows = []

    def add(config, k, stats, us, nbytes):
        for name, tps, ms in ((config, stats["decode_tokens_per_s"], stats["ms_per_step"]),
                              (config + "+prompt", stats["tokens_per_s"], 1e3 * stats["total_s"] / stats["new_tokens"])):
            row = {**stamp, "config": name, "k": k, "tokens_per_s": round(tps, 2), "step_ms": round(ms, 4),
                   "mlp_us": "" if us != us else round(us, 2), "mlp_bytes": nbytes}
            rows.append(row)
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                if new:
                    w.writeheader()
                w.writerow(row)
            log(f"{name:22s} k={k:<5} {tps:8.1f} tokens/s {ms:7.3f} ms  mlp {row['mlp_us']} us  {nbytes / 1e6:.1f} MB")

    ids = torch.randint(3, 250, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(device)

    def stage(name, fn):  # a configuration that fails is reported, the others still run
        if name not in todo:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            log(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")

    def dense(config, model):
        add(config, 0.0, timed(model, ids, args.new_tokens, args.repeats),
            mlp_us(model, mlp_inputs(model, ids), device, args.profile and config == "int4"),
            mlp_bytes(d_model, d_inter, config, 0))

    def mixed(model, spec):
        art = countdown.prepare(model, ByteTokenizer(), spec, list(KS), texts=texts(),
                                num_tokens=512 if device == "cuda" else 128, window=64, refine=False, progress=False)
        countdown.sparsify(model, spec, KS[1], artifacts=art)
        patches = [layer.mlp.countdown_sparse for layer in model.model.layers]
        try:
            for k in (KS[1], KS[0], KS[2]):  # the compiled step reads the cuts in place
                for i, patch in enumerate(patches):
                    patch.selector.cut.copy_(art.layer_tensors(k, i)["cut"].reshape(()))
                countdown.reset_sparsity_stats(model)
                stats = timed(model, ids, args.new_tokens, args.repeats)
                real = countdown.sparsity_real(model)["mean"]
                us = mlp_us(model, mlp_inputs(model, ids), device, args.profile and k == KS[1])
                log(f"{spec} k={k}: Sparsity-Real {real:.4f} (rows left at 4 bits, decode steps)")
                add(spec, k, stats, us, mlp_bytes(d_model, d_inter, "mixed", 1 - real))
        finally:
            countdown.unsparsify(model)

    with torch.no_grad():
        model = bf16_model(device)
        model.generation_config.eos_token_id = None
        d_model, d_inter = model.config.hidden_size, model.config.intermediate_size
        countdown.quantize(model, group=GROUP, lm_head=True)
        stage("int4", lambda: dense("int4", model))
        if "int4-torch" in todo:
            countdown.int4.use_backend(model, "torch")
            stage("int4-torch", lambda: dense("int4-torch", model))
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
        from countdown.int4.nested_model import to_nested

        model = to_nested(bf16_model(device), group=GROUP)
        model.generation_config.eos_token_id = None
        countdown.quantize(model, group=GROUP, lm_head=True)
        for config, spec in MIXED.items():
            if config in todo:
                stage(config, lambda spec=spec: mixed(model, spec))
        stage("int8", lambda: dense("int8", model))  # unsparsify's result: the 8-bit MLPs read whole
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
        model = bf16_model(device)
        model.generation_config.eos_token_id = None
        stage("bf16", lambda: dense("bf16", model))
    base = {r["config"]: r["tokens_per_s"] for r in rows}
    log("\nratios (tokens/s):")
    for r in rows:
        suffix = "+prompt" if r["config"].endswith("+prompt") else ""
        parts = [f"{r['config']:22s} k={r['k']:<5}"]
        for ref in ("int4", "bf16"):
            if ref + suffix in base:
                parts.append(f"{r['tokens_per_s'] / base[ref + suffix]:.3f}x {ref}")
        log("  ".join(parts))


if __name__ == "__main__":
    main()
