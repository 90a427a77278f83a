"""End-to-end decode speed on a GPU: sparse methods against a compiled dense decoder, one harness.

    PYTHONPATH=src python benchmarks/decode.py --out $OUT                      # the full sweep
    PYTHONPATH=src python benchmarks/decode.py --report RUN1,RUN2 --out benchmarks/results  # merge runs

A paper-scale shape with random weights (values do not change speed), bf16, prompt of 64 random
tokens, then 512 and 1024 new tokens through ``countdown.decode.generate_fast`` (static KV cache,
CUDA graphs). Rows:

    dense       eager (plain loop, no graphs) and compiled: "compile-cdt" (generate_fast's CUDA default:
                CUDA graphs + Inductor coordinate-descent tuning, gpt-fast's setting), "compile"
                (mode="reduce-overhead" alone), "cudagraph" (the eager step in one captured graph)
    cats, mono  SP-Prac thresholds from ``countdown.calibrate`` on random-token text
    dual        SP-Prac low-rank predictor (the paper's kind, rank --rank): ``countdown.train_predictors
                (kind="lowrank")`` on random-token text, run inside the fused dual kernel
                (``--predictor-route masked``: mask in PyTorch, then the masked kernel). With
                ``--allow-stand-in``, a failed training falls back to a clearly labelled stand-in
                (random A, B; the cut keeps 1 - k): speed depends on the kept fraction, not on the
                predictor's quality.

Per row: tokens/s (batch x new tokens / (prefill + decode)), the dense compiled and eager figures of
the same run, and achieved bandwidth = weight bytes read per decode step x steps/s, where the bytes
are every parameter (attention, norms, lm_head; the embedding's looked-up rows only) with each
Gated-MLP counted as the method reads it: the rows kept (the union over the batch's tokens, measured
on the same prompt), the dense projection it needs (W_up for mono, W_gate for cats) and the
predictor. "share" divides by the device-to-device copy bandwidth measured in the same run (bytes
read + written). Sparsity-Real (the fraction of rows skipped per token) is measured with the
``masked`` path over the first decode steps.

Switching k within a method copies the new thresholds / cuts into the patched model's buffers in
place: the compiled graph reads them from the device, so no recompilation is needed and the timed
computation is exactly that of a model patched at that k.

Before timing it checks, on a small fp32 model, that every harness mode produces the tokens of
``model.generate`` (dense and patched) and that the compiled step has no graph break and no
recompilation per token; the Dynamo logs go to ``<out>/dynamo.log``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import logging
import math
import os
import sys
import tempfile
import time

import torch

import countdown
from countdown.decode import generate_fast, reset_decoders
from countdown.mlp import require_gated_mlps
from countdown.registry import get_method, kept_rows

from _gpu import copy_bandwidth  # benchmarks/_gpu.py (scripts run with benchmarks/ on sys.path)

COLUMNS = [
    "device", "date", "run", "config", "method", "harness", "sparsity", "sparsity_real", "kept_union", "batch",
    "new_tokens", "tokens_per_s", "decode_tokens_per_s", "ms_per_step", "dense_compiled_tokens_per_s",
    "dense_eager_tokens_per_s", "speedup_vs_compiled", "speedup_vs_eager", "speedup_vs_dense_same_harness", "gbps", "copy_gbps", "bw_share",
    "weight_gb_per_step", "peak_mem_gb", "model_mem_gb", "setup_s", "graphs", "graph_breaks", "artifacts",
]
T0 = time.perf_counter()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for --smoke (a check of this script)
SMOKE_OVERRIDES = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 352,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}


def log(*parts) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *parts, flush=True)


# --------------------------------------------------------------------------------------------
# Random-token text and SP-Prac artifacts for weightless shapes
# --------------------------------------------------------------------------------------------


class IdTokenizer:
    """A stand-in tokenizer for models without one: the text is token ids separated by spaces, so
    ``countdown.calibrate`` / ``train_predictors`` can run on random-token "text"."""

    bos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [int(t) for t in text.split()]}


def random_token_texts(vocab: int, n_tokens: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(t)) for t in torch.randint(0, vocab, (n_tokens,), generator=g))]


CALIB_PROMPTS = 8


def generated_texts(model, prompt_len: int, n_tokens: int, n_prompts: int) -> list[str]:
    """Calibration text like the decode workload: ``n_prompts`` random prompts (seeds 100, 101, ...;
    the timed prompt uses seed 3) each followed by the dense model's greedy continuation, about
    ``n_tokens`` tokens in all. One greedy continuation alone is too narrow (a random-weight model
    soon repeats a few tokens): a predictor calibrated on it misses the target sparsity on other
    prompts (measured: Sparsity-Real 0.96 at k = 0.9)."""
    from countdown.decode import generate_fast

    vocab = model.config.vocab_size
    new = max(1, n_tokens // n_prompts - prompt_len)
    texts = []
    for i in range(n_prompts):
        prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(100 + i))
        out, _ = generate_fast(model, prompt.to(DEVICE), new, compile="eager")
        texts.append(" ".join(str(int(t)) for t in out[0].tolist()))
    return texts


def threshold_artifacts(model, method: str, ks: list[float], n_tokens: int, window: int, texts=None):
    from countdown.calibrate import calibrate

    texts = texts or random_token_texts(model.config.vocab_size, n_tokens + 8)
    return calibrate(model, IdTokenizer(), method, ks, texts=texts, num_tokens=n_tokens, window=window,
                     batch_size=4, progress=False)


def predictor_artifacts(model, ks: list[float], n_tokens: int, window: int, rank: int,
                        allow_stand_in: bool = False, texts=None):
    """``(artifacts, label)``: ``train_predictors`` (1 epoch); if that fails, the error is raised
    unless ``allow_stand_in``, which falls back to a stand-in with the same file format: random ``A [d_model, rank]``, ``B [rank, d_inter]``, zero bias, and a
    per-layer cut = mean over the random-token inputs of the per-token k-quantile of ``x A B``."""
    from countdown.artifacts import Artifacts, new_meta, sparsity_key
    from countdown.calibrate import stream_mlp_inputs, token_quantiles

    texts = texts or random_token_texts(model.config.vocab_size, n_tokens + 8, seed=1)
    try:
        from countdown.predictors import train_predictors

        # kind="lowrank": the paper's D-CountDown predictor (x alone; no dense projection). The library's
        # default for dual, "hybrid", reads W_up densely as mono does: mono's speed plus a predictor.
        art = train_predictors(model, IdTokenizer(), "dual", ks, texts=texts, num_tokens=n_tokens, window=window,
                               kind="lowrank", d_rank=rank, epochs=1, cut_rule="pooled", progress=False)
        return art, f"trained (train_predictors kind=lowrank, rank {rank}, 1 epoch, pooled cut, {n_tokens} tokens)"
    except Exception as error:
        if not allow_stand_in:
            raise
        log(f"train_predictors failed on this model ({type(error).__name__}: {str(error)[:160]}); "
            "using the stand-in predictor")
    mlps = require_gated_mlps(model)
    g = torch.Generator(device=mlps[0].w_up.device).manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(mlps))}
    stream_mlp_inputs(model, mlps, [torch.tensor([[int(t) for t in texts[0].split()][:n_tokens]])],
                      lambda i, x: inputs[i].append(x.float()), progress=False)
    for i, mlp in enumerate(mlps):
        dev = mlp.w_up.device
        A = torch.randn(mlp.d_model, rank, generator=g, device=dev) / math.sqrt(mlp.d_model)
        B = torch.randn(rank, mlp.d_inter, generator=g, device=dev) / math.sqrt(rank)
        bias = torch.zeros(mlp.d_inter, device=dev)
        x = torch.cat(inputs.pop(i))
        score = (x @ A) @ B + bias
        cuts = token_quantiles(score, [kept_rows(mlp.d_inter, k) for k in ks]).mean(dim=1)
        A, B, bias = A.cpu(), B.cpu(), bias.cpu()
        for j, k in enumerate(ks):
            prefix = f"{sparsity_key(k)}/layer{i}/"
            tensors.update({prefix + "A": A, prefix + "B": B, prefix + "bias": bias,
                            prefix + "cut": cuts[j].reshape(()).cpu()})
    meta = new_meta(get_method("dual"), "lowrank", ks, mlps, selection="cut",
                    data={"name": "random tokens", "num_tokens": n_tokens, "window": window},
                    d_rank=rank, stand_in=True)
    return Artifacts(meta, tensors), f"STAND-IN predictor (random rank-{rank} A, B; cut keeps 1-k)"


def refit_cuts(model, art, prompt_len: int, rounds: int, n_prompts: int = CALIB_PROMPTS) -> dict:
    """``countdown.predictors.refine_cuts_on_decode`` on ``n_prompts`` random prompts (seeds 100, 101,
    ...; never the timed prompt's), 64 new tokens each: dual's trained cuts re-fitted on the sparse
    model's own decode steps, where a random-weight model's activations drift from the dense model's
    (without it, Sparsity-Real 0.963 at k = 0.9, runs D-F)."""
    from countdown.predictors import refine_cuts_on_decode

    vocab = model.config.vocab_size
    prompts = torch.cat([torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(100 + i))
                         for i in range(n_prompts)])
    return refine_cuts_on_decode(model, art, prompts, new_tokens=64, rounds=rounds)


def selectors_of(model):
    from countdown.sparse import SparseGatedMLP

    return [m.selector for m in model.modules() if isinstance(m, SparseGatedMLP)]


def retarget(model, artifacts, method: str, k: float) -> None:
    """Point a model patched with ``artifacts`` at sparsity ``k`` by copying the new selectors'
    buffers (thresholds, predictor tensors, cuts) into the patched ones, in place."""
    from countdown.artifacts import prac_selectors

    fresh = prac_selectors(artifacts, require_gated_mlps(model), method, k)
    for old, new in zip(selectors_of(model), fresh):
        old_buffers = dict(old.named_buffers())
        for name, value in new.named_buffers():
            old_buffers[name].copy_(value)


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def free_memory() -> None:
    import gc

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def kept_fractions(model, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    """(mean kept fraction per token, mean kept fraction of the batch's union per step) over ``steps``
    eager decode steps of a model patched with path="masked" (its selectors run on every token)."""
    per_token, union = [], []

    def hook(module, args, keep):
        per_token.append(keep.float().mean().item())
        union.append(keep.any(dim=0).float().mean().item())

    handles = [s.register_forward_hook(hook) for s in selectors_of(model)]
    try:
        generate_fast(model, prompt, steps + 1, compile=False)
    finally:
        for h in handles:
            h.remove()
    return sum(per_token) / len(per_token), sum(union) / len(union)


def weight_bytes_per_step(model, method: str, kept: float, batch: int) -> int:
    """Bytes of weights one decode step reads (see the module docstring)."""
    mlps = require_gated_mlps(model)
    m = get_method(method)
    mlp_params = {id(p) for mlp in mlps for p in mlp.module.parameters()}
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    total = 0
    for p in model.parameters():  # parameters() yields a tied tensor once
        if id(p) in mlp_params:
            continue
        if p is emb and not tied:
            total += batch * p.shape[1] * p.element_size()  # only the looked-up rows
        else:
            total += p.numel() * p.element_size()
    selectors = selectors_of(model) if countdown.is_sparsified(model) else [None] * len(mlps)
    for mlp, sel in zip(mlps, selectors):
        row = mlp.d_model * mlp.w_up.element_size()  # one row of one of the three matrices
        if m.is_dense or sel is None:
            total += 3 * mlp.d_inter * row
            continue
        dense_parts = int(sel.needs_up) + int(sel.needs_gate)
        total += dense_parts * mlp.d_inter * row + (3 - dense_parts) * kept * mlp.d_inter * row
        total += sum(b.numel() * b.element_size() for b in sel.buffers())
    return int(total)


def model_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# --------------------------------------------------------------------------------------------
# Correctness and graph checks on a small fp32 model
# --------------------------------------------------------------------------------------------


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    # Every recompilation adds a graph, so one graph over two calls of 32 steps means none.
    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def run_checks(out_dir: str) -> bool:
    """generate_fast (eager / compile / cudagraph) against model.generate, greedy, on a small fp32 Llama,
    dense and patched (mono thresholds, a trained dual low-rank predictor: the Triton kernel path); the compiled
    step must be one graph for the whole generation (no graph break, no recompilation per token)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, 512, (2, 9), device=DEVICE)
    modes = ("eager", "compile", "cudagraph") if DEVICE == "cuda" else ("eager",)
    ok = True
    setups = [("dense", None, None)]
    setups.append(("mono", threshold_artifacts(model, "mono", [0.8], 256, 64), 0.8))
    setups.append(("dual", predictor_artifacts(model, [0.8], 256, 64, rank=32)[0], 0.8))
    n_new = 32
    for name, art, k in setups:
        if art is not None:
            countdown.sparsify(model, name, k, mode="prac", artifacts=art, path="auto")
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new, do_sample=False)
        for mode in modes:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            try:
                out, stats = generate_fast(model, prompt, n_new, compile=mode)
                out2, _ = generate_fast(model, prompt, n_new, compile=mode)  # reused graph / compiled step
            except Exception as error:  # report and go on: the other modes and the sweep still run
                ok = False
                log(f"check {name:5s} {mode:9s}: FAILED with {type(error).__name__}: {str(error)[:400]}")
                continue
            same = int((out[:, 9:] == ref[:, 9:]).all(dim=0).cumprod(0).sum())
            counts = _dynamo_counts()
            good = same == n_new and bool((out == out2).all())
            if mode == "compile":
                good = good and counts["unique_graphs"] == 1 and counts["graph_breaks"] == 0
            ok &= good
            log(f"check {name:5s} {mode:9s}: first {same}/{n_new} tokens equal model.generate; "
                f"repeat equal {bool((out == out2).all())}; dynamo {counts}; setup {stats['setup_s']:.1f}s "
                f"-> {'ok' if good else 'FAILED'}")
        if art is None:  # sampling (dense only, to save compiles): same seed -> same tokens in every mode
            try:
                samples = [generate_fast(model, prompt, 16, temperature=0.9, top_k=50, seed=11, compile=mode)[0]
                           for mode in modes]
                same_sampled = [bool((s == samples[0]).all()) for s in samples[1:]]
                ok &= all(same_sampled)
                log(f"check {name:5s} sampled (T=0.9, top_k=50, seed 11): {modes[1:]} equal eager: {same_sampled}")
            except Exception as error:
                ok = False
                log(f"check sampled: FAILED with {type(error).__name__}: {str(error)[:400]}")
        reset_decoders()
        if art is not None:
            countdown.unsparsify(model)
    del model
    free_memory()
    return ok


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------


class Budget:
    """Seconds left of ``seconds`` counted from the start of the script (checks included)."""

    def __init__(self, seconds: float):
        self.deadline = T0 + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()


# harness name -> generate_fast(compile=..., compile_options=...)
HARNESSES = {
    "eager": ("eager", None),
    "compile": ("compile", {"mode": "reduce-overhead"}),  # torch.compile(mode="reduce-overhead", fullgraph=True)
    # generate_fast's CUDA default since run 2 (gpt-fast's Inductor setting): CUDA graphs + matrix-vector
    # products as tuned Triton reductions (fusable)
    "compile-cdt": ("compile", {"options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}}),
    "cudagraph": ("cudagraph", None),  # the eager step captured in one torch.cuda.CUDAGraph
}


def timed_runs(model, prompt, lengths, harness, max_cache_len) -> dict:
    """{new_tokens: stats} for one model state; the first call sets up (compile / capture)."""
    # generate_fast compiles / captures on a throw-away run first (stats["setup_s"]), so even the
    # first call's timings are of the replayed graph.
    mode, options = HARNESSES[harness]
    return {n: generate_fast(model, prompt, n, compile=mode, max_cache_len=max_cache_len, compile_options=options)[1]
            for n in lengths}


KERNEL_CLASSES = [  # (class, substrings of kernel names), first match wins
    ("countdown sparse (Triton)", ("_sparse_glu", "_sparse_down")),
    ("cuBLAS matmul", ("gemv", "gemm", "cutlass", "sm90_", "xmma", "cublas", "splitk", "splitK")),
    ("attention", ("fmha", "attention", "flash", "efficient", "sdpa")),
    ("Inductor Triton", ("triton_",)),
    ("copy / index", ("copy", "index", "scatter", "gather", "memcpy", "Memcpy", "memset", "Memset", "fill")),
]


def profile_steps(model, n_steps: int = 16) -> dict:
    """Device time per decode step by kernel class, from torch.profiler over ``n_steps`` calls of the
    model's cached (compiled or captured) step, after a generate_fast run left the cache part full."""
    from torch.profiler import ProfilerActivity, profile

    from countdown.decode import _DECODERS, _scope

    decoder = _DECODERS[model]
    # The static cache writes at its own running length (not at position_ids): start it afresh so the
    # n_steps + 2 writes stay inside it. Attention reads the whole static cache either way.
    decoder.cache.reset()
    token = torch.zeros(decoder.batch, 1, dtype=torch.long, device=DEVICE)
    position = torch.full_like(token, n_steps + 2)
    with torch.no_grad(), _scope(model, 0):
        for _ in range(2):
            decoder.step(token, position, None, None)
        free_memory()
        with profile(activities=[ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU]) as prof:
            for _ in range(n_steps):
                if decoder.mode == "compile":
                    torch.compiler.cudagraph_mark_step_begin()
                decoder.step(token, position, None, None)
            free_memory()
    classes: dict = {}
    kernels = 0
    for event in prof.key_averages():
        # self time: a kernel's own time; a CPU op's self time on the device is 0 (no double count)
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if not us or event.key.startswith(("cudaGraph", "Graph", "ProfilerStep")):
            continue
        name = next((c for c, keys in KERNEL_CLASSES if any(key in event.key for key in keys)), "other")
        entry = classes.setdefault(name, {"ms_per_step": 0.0, "kernels_per_step": 0.0, "top": []})
        entry["ms_per_step"] += us / 1e3 / n_steps
        entry["kernels_per_step"] += event.count / n_steps
        entry["top"].append((round(us / 1e3 / n_steps, 4), event.key[:80]))
        kernels += event.count
    for entry in classes.values():
        entry["top"] = sorted(entry["top"], reverse=True)[:4]
    total = sum(e["ms_per_step"] for e in classes.values())
    return {"device_ms_per_step": total, "kernels_per_step": kernels / n_steps, "classes": classes}


def sweep(args, rows: list, meta: dict) -> None:
    budget = Budget(args.budget_s)
    log(f"loading {args.config} (random weights, bf16)")
    torch.manual_seed(0)
    model, _ = countdown.load_model(args.config, dtype="bf16" if DEVICE == "cuda" else "fp32", device=DEVICE,
                                    random_weights=True, config_overrides=SMOKE_OVERRIDES if args.smoke else None)
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    lengths = [int(n) for n in args.new_tokens.split(",")]
    max_cache_len = args.prompt + max(lengths)
    dense_model_bytes = model_bytes(model)
    meta["model_gb"] = dense_model_bytes / 1e9
    log(f"model {dense_model_bytes / 1e9:.2f} GB; copy bandwidth {meta['copy_gbps']:.0f} GB/s")
    ks = sorted((float(k) for k in args.ks.split(",")), reverse=True)  # the headline k = 0.9 first
    batches = [int(b) for b in args.batches.split(",")]
    artifacts = {}
    calib_texts, calib_label = None, f"{args.calib_tokens} random tokens"
    if args.calib_text == "generated":
        # What the decode steps will see: the dense model's own greedy continuation of a random prompt
        # (random tokens as input give activations unlike decode steps for some predictors).
        from countdown.decode import generate_fast

        calib_texts = generated_texts(model, args.prompt, args.calib_tokens, n_prompts=CALIB_PROMPTS)
        calib_label = (f"{CALIB_PROMPTS} random {args.prompt}-token prompts (seeds other than the timed "
                       "prompt's) and the dense model's greedy continuations")
    for method in args.methods.split(","):
        start = time.perf_counter()
        if get_method(method).prac == "threshold":
            artifacts[method] = (threshold_artifacts(model, method, ks, args.calib_tokens, 128, texts=calib_texts),
                                 f"calibrate() on {calib_label}")
        else:
            artifacts[method] = predictor_artifacts(model, ks, args.calib_tokens, 128, args.rank,
                                                    allow_stand_in=args.allow_stand_in, texts=calib_texts)
            if args.refit_cuts:
                hist = refit_cuts(model, artifacts[method][0], args.prompt, rounds=args.refit_cuts)
                meta.setdefault("refit_cuts", {})[method] = {str(k): v for k, v in hist.items()}
                log(f"{method} cuts re-fitted on the sparse model's own decode steps; Sparsity-Real on the "
                    f"calibration prompts before each round: {hist}")
                artifacts[method] = (artifacts[method][0], artifacts[method][1] + f"; cuts re-fitted on the "
                                     f"sparse model's decode steps ({args.refit_cuts} rounds, {CALIB_PROMPTS} prompts)")
        log(f"{method} artifacts in {time.perf_counter() - start:.1f}s: {artifacts[method][1]}")

    def add_row(method, harness, k, batch, n, stats, kept=(float("nan"), float("nan")), label="", mem=(None, None)):
        kept_token, kept_union = kept
        nbytes = weight_bytes_per_step(model, method, kept_union if batch > 1 else kept_token, batch)
        steps_per_s = 1.0 / (stats["ms_per_step"] / 1e3)
        gbps = nbytes * steps_per_s / 1e9
        rows.append({
            "device": meta["device"], "date": meta["date"], "run": meta["run"], "config": args.config, "method": method,
            "harness": harness, "sparsity": "" if k is None else k,
            "sparsity_real": "" if k is None else round(1 - kept_token, 4),
            "kept_union": "" if k is None else round(kept_union, 4), "batch": batch, "new_tokens": n,
            "tokens_per_s": round(stats["tokens_per_s"], 2), "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 2),
            "ms_per_step": round(stats["ms_per_step"], 4), "gbps": round(gbps, 1),
            "copy_gbps": round(meta["copy_gbps"], 1), "bw_share": round(gbps / meta["copy_gbps"], 4),
            "weight_gb_per_step": round(nbytes / 1e9, 4),
            "peak_mem_gb": "" if mem[0] is None else round(mem[0] / 1e9, 3),
            "model_mem_gb": "" if mem[1] is None else round(mem[1] / 1e9, 3),
            "setup_s": round(stats["setup_s"], 1), "artifacts": label,
            **({"graphs": "", "graph_breaks": ""} if not harness.startswith("compile") else
               {"graphs": _dynamo_counts()["unique_graphs"], "graph_breaks": _dynamo_counts()["graph_breaks"]}),
        })
        r = rows[-1]
        log(f"  {method:5s} {harness:9s} k={r['sparsity'] or '-':<4} b={batch} n={n}: {r['tokens_per_s']:8.1f} tok/s "
            f"{r['ms_per_step']:.3f} ms/step  {gbps:6.0f} GB/s ({100 * r['bw_share']:.0f}% of copy)  "
            f"setup {stats['setup_s']:.1f}s" + (f"  graphs {r['graphs']} breaks {r['graph_breaks']}" if r["graphs"] != "" else ""))

    def memory_window():
        free_memory()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak():
        return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else None

    def profiled(method, harness, k, batch) -> dict:
        try:
            result = {"method": method, "harness": harness, "k": k, "batch": batch, **profile_steps(model)}
        except Exception as error:
            log(f"profile of {method} {harness} failed: {type(error).__name__}: {str(error)[:200]}")
            return {"method": method, "harness": harness, "k": k, "batch": batch, "error": str(error)[:400]}
        parts = ", ".join(f"{name} {e['ms_per_step']:.2f} ms ({e['kernels_per_step']:.0f})"
                          for name, e in sorted(result["classes"].items(), key=lambda kv: -kv[1]["ms_per_step"]))
        log(f"  profile {method} {harness} k={k} b={batch}: {result['device_ms_per_step']:.2f} ms of kernels/step, "
            f"{result['kernels_per_step']:.0f} kernels/step: {parts}")
        return result

    profiles = meta.setdefault("profiles", [])
    prompt_all = torch.randint(0, vocab, (max(batches), args.prompt), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for batch in batches:
        prompt = prompt_all[:batch]
        run_lengths = lengths if batch == 1 else [min(lengths)]
        # dense: eager (batch 1), compiled, and the explicit CUDA graph
        if batch == 1 and args.eager_tokens:
            for n in [int(x) for x in args.eager_tokens.split(",")]:
                if budget.left() < 60:
                    log("budget: skipping dense eager")
                    break
                memory_window()
                stats = timed_runs(model, prompt, [n], "eager", max_cache_len)[n]
                add_row("dense", "eager", None, batch, n, stats, mem=(peak(), model_bytes(model)))
        harnesses = args.harnesses.split(",") if batch == 1 else args.batch_harnesses.split(",")
        if DEVICE == "cpu":  # --smoke: the sparse rows in eager, the dense eager row above is the reference
            harnesses = ["eager"]
        samples = [(h, i) for h in harnesses if h != "eager"
                   for i in range(args.dense_samples if batch == 1 and h.startswith("compile") else 1)]
        for harness, sample in samples:
            if budget.left() < 90:
                log(f"budget: skipping dense {harness} b={batch}")
                continue
            if sample:  # an independent compile: Inductor's tuning runs again in an empty cache
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-sample-")
                log(f"dense {harness}: sample {sample + 1}, Inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
            memory_window()
            torch._dynamo.utils.counters.clear()  # graphs / breaks of this configuration only
            try:
                res = timed_runs(model, prompt, run_lengths if harness == args.full_harness else [min(lengths)],
                                 harness, max_cache_len)
            except Exception as error:
                log(f"dense {harness} b={batch} FAILED: {type(error).__name__}: {str(error)[:400]}")
                reset_decoders()
                continue
            for n, stats in res.items():
                add_row("dense", harness, None, batch, n, stats, mem=(peak(), model_bytes(model)))
            if args.profile and harness.startswith("compile"):
                profiles.append(profiled("dense", harness, None, batch))
            reset_decoders()
        for method in args.methods.split(","):
            art, label = artifacts[method]
            method_ks = ks if batch == 1 else ks[:1]
            if batch > 1 and method not in args.batch_methods.split(","):
                continue
            if budget.left() < args.compile_estimate_s + 30:
                log(f"budget: skipping {method} b={batch} ({budget.left():.0f}s left)")
                continue
            # Sparsity-Real and the batch union, with the masked path (selectors see every token)
            countdown.sparsify(model, method, method_ks[0], mode="prac", artifacts=art, path="masked")
            kept = {}
            for k in method_ks:
                retarget(model, art, method, k)
                kept[k] = kept_fractions(model, prompt, args.kept_steps)
            countdown.unsparsify(model)
            reset_decoders()
            countdown.sparsify(model, method, method_ks[0], mode="prac", artifacts=art, path="auto")
            patched_bytes = model_bytes(model)
            for harness in harnesses:
                torch._dynamo.utils.counters.clear()  # one count over every k: retargeting must not recompile
                for k in (method_ks if harness == args.full_harness else method_ks[:1]):
                    if budget.left() < 20:
                        log(f"budget: skipping {method} {harness} k={k}")
                        continue
                    retarget(model, art, method, k)
                    memory_window()
                    try:
                        res = timed_runs(model, prompt,
                                         run_lengths if harness == args.full_harness else [min(lengths)],
                                         harness, max_cache_len)
                    except Exception as error:
                        log(f"{method} {harness} k={k} b={batch} FAILED: {type(error).__name__}: {str(error)[:400]}")
                        break
                    for n, stats in res.items():
                        add_row(method, harness, k, batch, n, stats, kept[k], label,
                                mem=(peak(), patched_bytes))
                    if args.profile and harness.startswith("compile") and k == method_ks[0]:
                        profiles.append(profiled(method, harness, k, batch))
                reset_decoders()
            countdown.unsparsify(model)
    fill_references(rows)


def fill_references(rows: list) -> None:
    """Dense compiled / eager tokens/s of the same run (same ``run`` id) next to every row, and the
    speed-ups: against the best dense compiled harness of the run, dense eager, and dense in the
    row's own harness."""
    def find(run, harness, batch, n):  # the best of the run's samples of this dense configuration
        found = [float(r["tokens_per_s"]) for r in rows
                 if r["run"] == run and r["method"] == "dense" and r["harness"] == harness
                 and int(r["batch"]) == int(batch) and int(r["new_tokens"]) == int(n)]
        return max(found) if found else None

    for r in rows:
        compiled = [find(r["run"], h, r["batch"], r["new_tokens"]) for h in HARNESSES if h.startswith("compile")]
        compiled = [c for c in compiled if c is not None]
        comp = max(compiled) if compiled else None  # the best dense compiled decoder of the run
        eager = find(r["run"], "eager", 1, r["new_tokens"]) if int(r["batch"]) == 1 else None
        same = find(r["run"], r["harness"], r["batch"], r["new_tokens"])
        r["speedup_vs_dense_same_harness"] = "" if same is None else round(float(r["tokens_per_s"]) / same, 3)
        r["dense_compiled_tokens_per_s"] = "" if comp is None else comp
        r["dense_eager_tokens_per_s"] = "" if eager is None else eager
        r["speedup_vs_compiled"] = "" if comp is None else round(float(r["tokens_per_s"]) / comp, 3)
        r["speedup_vs_eager"] = "" if eager is None else round(float(r["tokens_per_s"]) / eager, 3)


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def write_csv(rows: list, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def markdown(rows: list, metas: list) -> str:
    """One table per run (its figures are ratios within that run), each under its device, date and
    exact command."""
    lines = [f"# End-to-end decode: {metas[0].get('config', '') if metas else ''}", "",
             "tokens/s = batch x new tokens / (prefill + decode); vs dense compiled = against the best dense "
             "compiled harness of the same run; GB/s = weight bytes read per decode step (attention, norms, "
             "lm_head, embedding rows looked up; each Gated-MLP as the method reads it: its dense projection, "
             "the kept rows, the predictor) x steps/s; share = GB/s / device-to-device copy bandwidth (read + "
             "write) measured in the same run. Harnesses: eager = plain loop; compile = torch.compile "
             "reduce-overhead fullgraph (Inductor + CUDA graphs); compile-cdt = the same with Inductor's "
             "coordinate_descent_tuning (gpt-fast's setting); cudagraph = the eager step in one CUDA graph.", ""]
    for meta in metas:
        run_rows = [r for r in rows if r.get("run") == meta.get("run")]
        if not run_rows:
            continue
        lines += [f"## Run {meta.get('run')}", "",
                  f"- device: {meta.get('device')}; date: {meta.get('date')}; torch {meta.get('torch')}, "
                  f"transformers {meta.get('transformers')}, triton {meta.get('triton')}; prompt "
                  f"{meta.get('prompt', 64)} tokens; checks {'passed' if meta.get('checks_ok') else meta.get('checks_ok')}",
                  f"- command: `{meta.get('command')}`",
                  f"- copy bandwidth {float(meta.get('copy_gbps', 'nan')):.0f} GB/s; model {float(meta.get('model_gb', 'nan')):.2f} GB",
                  "",
                  "| method | harness | k | Sparsity-Real | batch | new tokens | tokens/s | vs dense compiled | "
                  "vs dense eager | ms/step | GB/s | share | peak mem GB | model GB | graphs / breaks | artifacts |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run_rows:
            graphs = f"{r['graphs']} / {r['graph_breaks']}" if r.get("graphs") not in ("", None) else "-"
            lines.append(
                f"| {r['method']} | {r['harness']} | {r['sparsity'] or '-'} | {r['sparsity_real'] or '-'} | "
                f"{r['batch']} | {r['new_tokens']} | {float(r['tokens_per_s']):.1f} | {_x(r['speedup_vs_compiled'])} | "
                f"{_x(r['speedup_vs_eager'])} | {float(r['ms_per_step']):.2f} | {float(r['gbps']):.0f} | "
                f"{100 * float(r['bw_share']):.0f}% | {r['peak_mem_gb'] or '-'} | {r.get('model_mem_gb') or '-'} | "
                f"{graphs} | {r['artifacts'] or '-'} |")
        lines.append("")
    return "\n".join(lines)


def _x(value) -> str:
    return "-" if value in ("", None) else f"{float(value):.2f}x"


def plot(rows: list, path: str, metas: list) -> None:
    """Per run: tokens/s against k at batch 1 (one panel per length, for every harness timed at more
    than one k), and a bar chart of every configuration timed at one k (harness and batch compared)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []  # (kind, run meta, rows)
    for meta in metas:
        run = [r for r in rows if r.get("run") == meta.get("run")]
        b1 = [r for r in run if int(r["batch"]) == 1 and r["harness"] != "eager"]
        swept = {r["harness"] for r in b1 if r["method"] != "dense"
                 and len({r2["sparsity"] for r2 in b1 if r2["harness"] == r["harness"] and r2["method"] == r["method"]}) > 1}
        for n in sorted({int(r["new_tokens"]) for r in b1 if r["harness"] in swept}):
            panels.append(("lines", meta, [r for r in run if int(r["new_tokens"]) == n], n, swept))
        if not swept and run:
            panels.append(("bars", meta, run, None, None))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (kind, meta, sel, n, swept) in zip(axes[0], panels):
        title = f"{meta.get('device', '')} ({meta.get('run', '')})"
        if kind == "lines":
            for harness in sorted(swept):
                for method, marker, color in (("cats", "s", "tab:blue"), ("mono", "o", "tab:orange"),
                                              ("dual", "^", "tab:green")):
                    pts = sorted((float(r["sparsity"]), float(r["tokens_per_s"])) for r in sel
                                 if r["method"] == method and r["harness"] == harness and int(r["batch"]) == 1)
                    if pts:
                        ax.plot(*zip(*pts), marker=marker, color=color, label=f"{method} ({harness})")
            labelled = set()  # one legend entry per dense harness; later samples drawn fainter
            for r in sel:
                if r["method"] == "dense" and int(r["batch"]) == 1:
                    style = {"eager": ("gray", ":"), "cudagraph": ("tab:brown", "-.")}.get(r["harness"], ("k", "--"))
                    first = r["harness"] not in labelled
                    labelled.add(r["harness"])
                    ax.axhline(float(r["tokens_per_s"]), color=style[0], ls=style[1], alpha=1.0 if first else 0.5,
                               label=f"dense ({r['harness']})" if first else None)
            ax.set_xlabel("target sparsity k")
            ax.set_ylabel("tokens/s (batch 1)")
            ax.set_title(f"{title}\n{n} new tokens", fontsize=9)
        else:
            labels = [f"{r['method']}{'' if not r['sparsity'] else ' ' + str(r['sparsity'])}\n{r['harness']} b{r['batch']}"
                      for r in sel]
            values = [float(r["tokens_per_s"]) / int(r["batch"]) for r in sel]
            colors = ["k" if r["method"] == "dense" else {"mono": "tab:orange", "dual": "tab:green"}.get(r["method"], "tab:blue")
                      for r in sel]
            ax.bar(range(len(sel)), values, color=colors)
            ax.set_xticks(range(len(sel)), labels, fontsize=6, rotation=60)
            ax.set_ylabel("tokens/s per sequence")
            ax.set_title(f"{title}\n{sel[0]['new_tokens']} new tokens", fontsize=9)
        ax.grid(alpha=0.3)
        if kind == "lines":
            ax.legend(fontsize=6)
    config = metas[0].get("config", "") if metas else ""
    fig.suptitle(f"End-to-end decode, {config}, bf16 random weights, prompt 64", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(rows: list, metas: list, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    write_csv(rows, os.path.join(out_dir, "decode.csv"))
    with open(os.path.join(out_dir, "decode.md"), "w") as f:
        f.write(markdown(rows, metas))
    with open(os.path.join(out_dir, "decode_meta.json"), "w") as f:
        json.dump(metas, f, indent=1)
    try:
        plot(rows, os.path.join(out_dir, "decode.png"), metas)
    except Exception as error:  # a missing matplotlib must not lose the numbers
        log(f"plot failed: {error}")


def short_table(rows: list) -> str:
    out = io.StringIO()
    out.write(f"{'method':6s} {'harness':9s} {'k':>4s} {'real':>5s} {'b':>2s} {'new':>5s} {'tok/s':>8s} "
              f"{'vsComp':>6s} {'vsEager':>7s} {'GB/s':>6s} {'share':>5s} {'peakGB':>6s}\n")
    for r in rows:
        out.write(f"{r['method']:6s} {r['harness']:9s} {str(r['sparsity'] or '-'):>4s} {str(r['sparsity_real'] or '-'):>5s} "
                  f"{r['batch']:>2} {r['new_tokens']:>5} {float(r['tokens_per_s']):8.1f} "
                  f"{_x(r['speedup_vs_compiled']):>6s} {_x(r['speedup_vs_eager']):>7s} {float(r['gbps']):6.0f} "
                  f"{100 * float(r['bw_share']):4.0f}% {str(r['peak_mem_gb'] or '-'):>6s}\n")
    return out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b-shape", help="a shape name from countdown.catalogue()")
    ap.add_argument("--methods", default="cats,mono,dual")
    ap.add_argument("--ks", default="0.7,0.8,0.9")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--batch-methods", default="mono,dual", help="methods also timed at batch > 1 (largest k)")
    ap.add_argument("--new-tokens", default="512,1024")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--eager-tokens", default="512", help="lengths for dense eager ('' to skip)")
    ap.add_argument("--harnesses", default="compile-cdt,compile",
                    help=f"batch-1 harnesses, from {', '.join(h for h in HARNESSES if h != 'eager')}")
    ap.add_argument("--batch-harnesses", default="compile-cdt", help="harnesses at batch > 1")
    ap.add_argument("--full-harness", default="compile-cdt",
                    help="the harness timed at every k and length (the others: the largest k, shortest length)")
    ap.add_argument("--predictor-route", choices=("fused", "masked"), default="fused",
                    help="dual on the kernel path: predictor inside the fused kernel, or mask in PyTorch + "
                    "masked kernel (countdown.sparse.PREDICTOR_IN_KERNEL)")
    ap.add_argument("--profile", action="store_true", help="kernel-time breakdown of each compiled step")
    ap.add_argument("--rank", type=int, default=512, help="predictor rank for dual")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--dense-samples", type=int, default=2,
                    help="independent compiles of the dense model at batch 1 (each re-tunes in an empty Inductor "
                         "cache); the fastest is the reference: coordinate-descent tuning varies by up to 20%% "
                         "between compiles")
    ap.add_argument("--refit-cuts", type=int, default=2, metavar="ROUNDS",
                    help="re-fit dual's trained cuts on the sparse model's own decode steps (rounds; 0: off)")
    ap.add_argument("--calib-text", choices=("random", "generated"), default="generated",
                    help="calibration / training text: random tokens, or the dense model's own greedy "
                    "generation (the inputs decode steps see)")
    ap.add_argument("--allow-stand-in", action="store_true",
                    help="if train_predictors fails, time dual with a labelled random stand-in predictor")
    ap.add_argument("--kept-steps", type=int, default=32, help="decode steps for Sparsity-Real")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting new configs after this")
    ap.add_argument("--compile-estimate-s", type=float, default=60)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--smoke", action="store_true", help="a 2-layer version of the shape, on CPU if no GPU "
                    "(checks this script; its numbers mean nothing)")
    ap.add_argument("--report", help="comma-separated result folders (decode.csv + decode_meta.json) to merge "
                    "into --out as decode.csv / decode.md / decode.png, then exit")
    args = ap.parse_args()

    if args.report:  # merge the runs' folders (each: decode.csv + decode_meta.json) into --out
        rows, metas = [], []
        for folder in args.report.split(","):
            rows += list(csv.DictReader(open(os.path.join(folder, "decode.csv"))))
            loaded = json.load(open(os.path.join(folder, "decode_meta.json")))
            metas += loaded if isinstance(loaded, list) else [loaded]
        fill_references(rows)
        report(rows, metas, args.out)
        print(short_table(rows))
        return 0
    if DEVICE != "cuda" and not args.smoke:
        print("benchmarks/decode.py needs a CUDA GPU (benchmarks/decode_cpu.py is the CPU benchmark)")
        return 2
    import transformers
    import triton

    import countdown.sparse

    countdown.sparse.PREDICTOR_IN_KERNEL = args.predictor_route == "fused"
    os.makedirs(args.out, exist_ok=True)
    handler = logging.FileHandler(os.path.join(args.out, "dynamo.log"))
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    for name in ("torch._dynamo", "torch._inductor"):
        logging.getLogger(name).addHandler(handler)
    meta = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
            "run": datetime.datetime.now().strftime("%Y%m%dT%H%M%S"), "date": datetime.date.today().isoformat(),
            "config": args.config, "prompt": args.prompt, "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": triton.__version__, "predictor_route": args.predictor_route, "command": "PYTHONPATH=src python benchmarks/decode.py " + " ".join(sys.argv[1:])}
    log(json.dumps(meta))
    checks_ok = None
    if not args.skip_checks:
        checks_ok = run_checks(args.out)
        log(f"checks {'passed' if checks_ok else 'FAILED'}")
    meta["checks_ok"] = checks_ok
    meta["copy_gbps"] = copy_bandwidth() / 1e9 if DEVICE == "cuda" else float("nan")
    rows: list = []
    try:
        sweep(args, rows, meta)
    finally:
        fill_references(rows)
        report(rows, [meta], args.out)
        print(short_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
