"""Decode speed under tensor parallelism: dense and sparse on 1 and 2 GPUs, one run.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/tp_decode.py --out $OUT
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/tp_decode.py --smoke --out /tmp/tp  # CPU, gloo

results/tp_decode.md / .csv / _meta.json (2 H200s on NVLink, 2026-11-23): the first two lines as
``PYTHONPATH=src timeout 420 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/tp_decode.py
--out $OUT`` (log: results/tp_decode_runs/H200x2-20261123/run.log); rows print the speed-up over dense.

Shapes, random bf16 weights (values do not change speed): ``llama-3.1-8b-shape`` and a 70B-shaped
Llama cut to 8 layers (``llama-70b-shape-8l``: d_model 8192, d_inter 28672, 64 heads, 8 KV heads;
the full 80 layers would not fit one GPU, which the 1-GPU rows need).

1. One GPU per config, the configs in parallel (rank r takes configs r, r + world, ...): build the
   model, save it with ``save_pretrained`` (to /dev/shm when it has room, else /tmp), build the
   SP-Prac artifacts on that single process (``countdown.prepare`` thresholds for mono and cats and
   a ``dual[lowrank]`` predictor (``init="random"``) for dual, its cuts re-fitted on the
   sparse model's own decode steps; all on random-token text: on random weights only the kept
   fraction matters for speed, so the closed-form gate start, an SVD per layer, is skipped), measure Sparsity-Real (masked path, eager) and time
   dense and every (method, k) with ``countdown.decode.generate.generate_fast``: static cache, the decode step
   captured in one CUDA graph (``compile="cudagraph"``), batch 1. These are the ``gpus = 1`` rows.
2. Every rank together, per config: ``from_pretrained(folder, tp_plan="auto")`` (gate/up colwise,
   down rowwise, attention sharded by heads), ``countdown.sparsify`` with the SAME artifact files
   (sliced to each rank's rows at load), the same timings. If capturing the step fails under NCCL
   the rows fall back to ``eager`` and say so in ``harness``. These are the ``gpus = world`` rows.

3. If time is left (``--compile-before-s``), the first config's dense and ``--compile-methods`` rows
   at the first k through ``generate_fast(compile=True)`` (torch.compile fullgraph, CUDA graphs,
   Inductor coordinate-descent tuning: the repo's CUDA default), sharded, then on one GPU; harness
   ``compile-cdt``. Results are written before this phase and again after each part.

Changing k re-points the patched model's selector buffers in place (as benchmarks/decode.py does),
so one captured graph serves every k of a method. ``speedup_vs_dense_same_gpus`` divides by dense
on the same number of GPUs in the same harness. Output: ``tp_decode.csv`` and ``tp_decode.md``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

import countdown
from countdown import prepare, refine_cuts_on_decode
from countdown.patch.sparsify import with_mode
from countdown.artifacts.store import load_artifacts
from countdown.selectors.base import selectors_for
from countdown.decode.generate import generate_fast, reset_decoders
from countdown.model.gated_mlp import require_gated_mlps
from countdown.patch.state import state_of
from countdown.model.tensor_parallel import shard_selectors

COLUMNS = ["gpus", "config", "method", "sparsity", "batch", "tokens_per_s", "speedup_vs_dense_same_gpus", "device",
           "date", "harness", "sparsity_real", "ms_per_step", "new_tokens", "setup_s", "artifacts"]
CONFIGS = {
    "llama-3.1-8b-shape": {},
    "llama-70b-shape-8l": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                           "num_key_value_heads": 8, "num_hidden_layers": 8},
}
SMOKE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}
T0 = time.perf_counter()


class IdTokenizer:
    """Random-token "text": token ids separated by spaces (models built from a shape have no tokenizer)."""

    bos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [int(t) for t in text.split()]}


def log(*parts) -> None:
    rank = os.environ.get("RANK", 0)
    print(f"[{time.perf_counter() - T0:7.1f}s r{rank}]", *parts, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    reset_decoders()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def random_texts(vocab: int, n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(t)) for t in torch.randint(0, vocab, (n,), generator=g))]


# --------------------------------------------------------------------------------------------
# Artifacts (one process) and retargeting k in place
# --------------------------------------------------------------------------------------------


def build_artifacts(model, methods, ks, folder, args) -> dict:
    """{method: (path, label)}: artifacts built on this single process, saved under ``folder``."""
    vocab = model.config.vocab_size
    out = {}
    for method in methods:
        start = time.perf_counter()
        if method in ("mono", "cats"):
            art = prepare(model, IdTokenizer(), f"{method}[threshold]", ks,
                          texts=random_texts(vocab, args.calib_tokens + 8, 0), num_tokens=args.calib_tokens,
                          window=128, refine_tokens=args.calib_tokens, progress=False)
            label = f"prepare() of thresholds on {args.calib_tokens} random tokens"
        else:
            art = prepare(model, IdTokenizer(), "dual[lowrank]", ks, texts=random_texts(vocab, args.calib_tokens + 8, 1),
                          num_tokens=args.calib_tokens, window=128, d_rank=args.rank, epochs=1, init="random",
                          cut_rule="pooled", refine_tokens=args.calib_tokens, progress=False)
            prompts = torch.randint(0, vocab, (4, args.prompt), generator=torch.Generator().manual_seed(100))
            refine_cuts_on_decode(model, art, prompts, new_tokens=32, rounds=1)
            label = (f"prepare(dual[lowrank], rank {args.rank}, init=random, 1 epoch) on {args.calib_tokens} "
                     "random tokens, cuts re-fitted on 4 x 32 sparse decode steps")
        path = os.path.join(folder, f"{method}.safetensors")
        art.save(path)
        out[method] = (path, label)
        log(f"{method} artifacts in {time.perf_counter() - start:.1f}s: {label}")
    return out


def retarget(model, art, method: str, k: float) -> None:
    """Copy the selectors of sparsity ``k`` into the patched model's buffers (sliced to this rank's
    rows on a tensor-parallel model): the captured graph reads them in place."""
    mlps = require_gated_mlps(model)
    fresh = selectors_for(art, mlps, method, k)
    shard_selectors(mlps, fresh)
    for layer, new in zip(state_of(model).layers, fresh):
        old = dict(layer.selector.named_buffers())
        for name, value in new.named_buffers():
            old[name].copy_(value)


def sparsity_real(model, art, method, k, prompt, steps) -> float:
    countdown.sparsify(model, with_mode(method, "prac", art), k, artifacts=art, path="masked")
    try:
        generate_fast(model, prompt, steps + 1, compile=False)
        return countdown.sparsity_real(model)["mean"]
    finally:
        countdown.unsparsify(model)
        free()


# --------------------------------------------------------------------------------------------
# Timing one model (one process or one rank of many)
# --------------------------------------------------------------------------------------------


def timed(model, prompt, n_new: int, harnesses: list[str]) -> tuple[dict, str]:
    """(generate_fast stats, harness) with the first harness that works; generate_fast sets up
    (captures) on a throw-away run first, so the timings are of the replayed step."""
    error = None
    for harness in harnesses:
        try:
            _, stats = generate_fast(model, prompt, n_new, compile=harness)
            return stats, harness
        except Exception as err:  # e.g. a collective that cannot be captured: the next harness
            error = err
            log(f"harness {harness} failed: {type(err).__name__}: {str(err)[:300]}")
            free()
    raise RuntimeError(f"every harness failed; last: {error}")


def time_model(model, gpus, config, artifacts, methods, ks, args, meta, kept=None) -> list[dict]:
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(3)).to(device)
    harnesses = ["cudagraph", "eager"] if device.type == "cuda" else ["eager"]
    rows = []

    def add(method, k, stats, harness, label=""):
        rows.append({"gpus": gpus, "config": config, "method": method, "sparsity": "" if k is None else k, "batch": 1,
                     "tokens_per_s": round(stats["tokens_per_s"], 2), "device": meta["device"], "date": meta["date"],
                     "harness": harness, "ms_per_step": round(stats["ms_per_step"], 4), "new_tokens": args.new_tokens,
                     "setup_s": round(stats["setup_s"], 1), "artifacts": label,
                     "sparsity_real": "" if kept is None or k is None else round(kept[(method, k)], 4)})
        log(f"{config} gpus={gpus} {method:5s} k={k if k is not None else '-':<4} {harness}: "
            f"{stats['tokens_per_s']:8.1f} tok/s {stats['ms_per_step']:.3f} ms/step setup {stats['setup_s']:.1f}s")

    stats, harness = timed(model, prompt, args.new_tokens, harnesses)
    add("dense", None, stats, harness)
    free()
    for method in methods:
        path, label = artifacts[method]
        art = load_artifacts(path)
        countdown.sparsify(model, with_mode(method, "prac", art), ks[0], artifacts=art, path="auto")
        for k in ks:
            retarget(model, art, method, k)
            stats, h = timed(model, prompt, args.new_tokens, [harness] + [x for x in harnesses if x != harness])
            add(method, k, stats, h, label)
        countdown.unsparsify(model)
        free()
    dense = {r["harness"]: r["tokens_per_s"] for r in rows if r["method"] == "dense"}
    for r in rows:
        r["speedup_vs_dense_same_gpus"] = round(r["tokens_per_s"] / dense[r["harness"]], 3) if r["harness"] in dense else ""
    return rows


# --------------------------------------------------------------------------------------------
# The two phases
# --------------------------------------------------------------------------------------------


def model_folder(root: str, config: str) -> str:
    return os.path.join(root, config)


def one_gpu(config, overrides, root, methods, ks, args, meta) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model, _ = countdown.load_model("llama-3.1-8b-shape", dtype="bf16" if device.type == "cuda" else "fp32",
                                    device=device, random_weights=True, config_overrides=overrides or None)
    model.generation_config.eos_token_id = None
    folder = model_folder(root, config)
    start = time.perf_counter()
    model.save_pretrained(folder)
    log(f"{config}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, saved to {folder} in "
        f"{time.perf_counter() - start:.1f}s")
    artifacts = build_artifacts(model, methods, ks, folder, args)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(3))
    kept = {(m, k): sparsity_real(model, load_artifacts(artifacts[m][0]), m, k, prompt.to(device), args.kept_steps)
            for m in methods for k in ks}
    log(f"{config}: Sparsity-Real {kept}")
    rows = time_model(model, 1, config, artifacts, methods, ks, args, meta, kept)
    with open(os.path.join(folder, "countdown_tp.json"), "w") as f:
        json.dump({"artifacts": artifacts, "kept": [[m, k, v] for (m, k), v in kept.items()]}, f)
    del model
    free()
    return rows


def one_gpu_compiled(config, root, methods, k, args, meta) -> list[dict]:
    """compile_rows on this process's GPU alone, the model reloaded from the saved folder."""
    from transformers import AutoModelForCausalLM

    folder = model_folder(root, config)
    with open(os.path.join(folder, "countdown_tp.json")) as f:
        saved = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(f"cuda:{torch.cuda.current_device()}")
    model.eval().generation_config.eos_token_id = None
    rows = compile_rows(model, 1, config, {m: tuple(v) for m, v in saved["artifacts"].items()}, methods, k, args, meta,
                        {(m, kk): v for m, kk, v in saved["kept"]})
    del model
    free()
    return rows


def sharded(config, root, methods, ks, args, meta, compile_methods=None) -> list[dict]:
    from transformers import AutoModelForCausalLM

    folder = model_folder(root, config)
    with open(os.path.join(folder, "countdown_tp.json")) as f:
        saved = json.load(f)
    kept = {(m, k): v for m, k, v in saved["kept"]}
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    mlp = require_gated_mlps(model)[0]
    log(f"{config}: loaded with tp_plan='auto' in {time.perf_counter() - start:.1f}s; rank rows "
        f"{mlp.tp.start}:{mlp.tp.stop} of {mlp.tp.d_inter}")
    artifacts = {m: tuple(v) for m, v in saved["artifacts"].items()}
    if compile_methods:
        rows = compile_rows(model, dist.get_world_size(), config, artifacts, compile_methods, ks[0], args, meta, kept)
    else:
        rows = time_model(model, dist.get_world_size(), config, artifacts, methods, ks, args, meta, kept)
    del model
    free()
    return rows


def allreduce_us(d_model: int, n: int = 64, reps: int = 20) -> float:
    """Microseconds per all-reduce of one decode token's activations ``[1, d_model]`` bf16 (what each
    sharded MLP and attention block sends), ``n`` of them captured in one CUDA graph and replayed."""
    x = torch.ones(1, d_model, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            dist.all_reduce(x)
    graph.replay()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    sync()
    return start.elapsed_time(end) * 1e3 / (reps * n)


def compile_rows(model, gpus, config, artifacts, methods, k, args, meta, kept) -> list[dict]:
    """Dense and ``methods`` at sparsity ``k`` through generate_fast(compile=True): torch.compile
    fullgraph with CUDA graphs and Inductor's coordinate-descent tuning (the repo's CUDA default), one
    compile each. A failure is logged and leaves its row out."""
    device = next(model.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt),
                           generator=torch.Generator().manual_seed(3)).to(device)
    rows = []
    for method in ["dense"] + methods:
        label = "" if method == "dense" else artifacts[method][1]
        try:
            if method != "dense":
                art = load_artifacts(artifacts[method][0])
                countdown.sparsify(model, with_mode(method, "prac", art), k, artifacts=art)
            _, stats = generate_fast(model, prompt, args.new_tokens, compile=True)
            rows.append({"gpus": gpus, "config": config, "method": method, "sparsity": "" if method == "dense" else k,
                         "batch": 1, "tokens_per_s": round(stats["tokens_per_s"], 2), "device": meta["device"],
                         "date": meta["date"], "harness": "compile-cdt", "ms_per_step": round(stats["ms_per_step"], 4),
                         "new_tokens": args.new_tokens, "setup_s": round(stats["setup_s"], 1), "artifacts": label,
                         "sparsity_real": "" if method == "dense" or kept is None else round(kept[(method, k)], 4)})
            log(f"{config} gpus={gpus} {method:5s} k={k} compile-cdt: {stats['tokens_per_s']:8.1f} tok/s "
                f"{stats['ms_per_step']:.3f} ms/step setup {stats['setup_s']:.1f}s")
        except Exception as error:
            log(f"{config} gpus={gpus} {method} compile-cdt FAILED: {type(error).__name__}: {str(error)[:400]}")
        finally:
            if countdown.is_sparsified(model):
                countdown.unsparsify(model)
            free()
    dense = [r["tokens_per_s"] for r in rows if r["method"] == "dense"]
    for r in rows:
        r["speedup_vs_dense_same_gpus"] = round(r["tokens_per_s"] / dense[0], 3) if dense else ""
    return rows


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def write(rows: list[dict], meta: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tp_decode.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = ["# Decode under tensor parallelism: 1 GPU against 2", "",
             f"- device: {meta['device']} x {meta['world']}; date {meta['date']}; torch {meta['torch']}, "
             f"transformers {meta['transformers']}; batch 1, prompt {meta['prompt']} tokens, {meta['new_tokens']} new tokens",
             f"- command: `{meta['command']}`",
             "- tokens/s = new tokens / (prefill + decode); speed-up against dense on the same GPUs and harness; "
             "Sparsity-Real measured on one GPU (masked path, eager, the timed prompt)", "",
             "| config | method | k | Sparsity-Real | 1 GPU tok/s | 1 GPU speed-up | 2 GPU tok/s | 2 GPU speed-up | "
             "2 GPU / 1 GPU | gain kept | harness (1 / 2) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    def pair(r):  # a 1-GPU row and its sharded twin: same config, method, k and kind of harness
        return r["config"], r["method"], r["sparsity"], r["harness"].startswith("compile")

    def x(value) -> str:
        return "-" if value in ("", None) else f"{value:.2f}x"

    one = {pair(r): r for r in rows if r["gpus"] == 1}
    many = {pair(r): r for r in rows if r["gpus"] != 1}
    for key, r in many.items():  # sharded rows whose 1-GPU twin did not run: shown alone
        if key not in one:
            one[key] = {"sparsity_real": r["sparsity_real"], "tokens_per_s": float("nan"), "harness": "-",
                        "speedup_vs_dense_same_gpus": "", "method": r["method"]}
    for key, a in one.items():
        b = many.get(key, {})
        s1, s2 = a["speedup_vs_dense_same_gpus"], b.get("speedup_vs_dense_same_gpus", "")
        kept = (f"{(s2 - 1) / (s1 - 1):.2f}" if a["method"] != "dense" and "" not in (s1, s2) and s1 > 1 else "-")
        two = b.get("tokens_per_s")
        lines.append(f"| {key[0]} | {key[1]} | {key[2] or '-'} | {a['sparsity_real'] or '-'} | {a['tokens_per_s']:.1f} | "
                     f"{x(s1)} | {'-' if two is None else f'{two:.1f}'} | {x(s2)} | "
                     f"{x(None if two is None else two / a['tokens_per_s'])} | {kept} | "
                     f"{a['harness']} / {b.get('harness', '-')} |")
    if "allreduce_us" in meta:
        lines += ["", f"One all-reduce of a decode token's activations ([1, d_model] bf16, NCCL, captured in a "
                  f"CUDA graph), microseconds by d_model: {meta['allreduce_us']}; a sharded decode step makes two "
                  "per layer (attention, MLP), dense and sparse alike."]
    lines += ["", "gain kept = (2-GPU speed-up - 1) / (1-GPU speed-up - 1): the share of sparsity's one-GPU gain "
              "over dense that survives on 2 GPUs (the issue's target: >= 0.8 for the best method at k = 0.9).", ""]
    with open(os.path.join(out, "tp_decode.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out, "tp_decode_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--methods", default="mono,cats,dual")
    ap.add_argument("--ks", default="0.9,0.8,0.7")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rank", type=int, default=512, help="dual's low-rank predictor rank")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--kept-steps", type=int, default=16, help="decode steps for Sparsity-Real")
    ap.add_argument("--compile-methods", default="dual",
                    help="beside dense, timed through torch.compile (compile-cdt) at the first k on the first "
                         "config, on 1 GPU and sharded, when time allows ('' for none)")
    ap.add_argument("--compile-before-s", type=float, default=220,
                    help="the sharded compile rows start only before this many seconds into the run (the "
                         "1-GPU ones before this + 140 s)")
    ap.add_argument("--smoke", action="store_true", help="tiny 2-layer shapes (CPU and gloo without GPUs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # Phase 1 runs before the process group exists: transformers' save_pretrained writes on rank 0 only
    # once torch.distributed is initialized, and phase 1 needs no collective.
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    configs = args.configs.split(",")
    overrides = {c: ({**CONFIGS[c], **SMOKE} if args.smoke else CONFIGS[c]) for c in configs}
    methods, ks = args.methods.split(","), [float(k) for k in args.ks.split(",")]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 45e9 else "/tmp"
    root = os.path.join(shm if not args.smoke else "/tmp", "countdown_tp_decode")
    import transformers

    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world": world,
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "transformers": transformers.__version__, "prompt": args.prompt, "new_tokens": args.new_tokens,
            "command": "torchrun --nproc-per-node %d benchmarks/tp_decode.py %s" % (world, " ".join(sys.argv[1:])),
            "nccl_env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                        "NVSHMEM_DISABLE_NVLS")}}
    log(json.dumps(meta))
    rows = []
    os.makedirs(args.out, exist_ok=True)
    partial = os.path.join(args.out, f"tp_decode_rows_rank{rank}.json")  # survives a run cut short
    for config in configs[rank::world]:  # phase 1: one GPU per config, the configs in parallel
        rows += one_gpu(config, overrides[config], root, methods, ks, args, meta)
        with open(partial, "w") as f:
            json.dump(rows, f)
    # the rendezvous waits for every rank's phase 1
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    if cuda:
        try:
            meta["allreduce_us"] = {d: round(allreduce_us(d), 2) for d in (4096, 8192)}
        except Exception as error:  # a measurement for the write-up only
            meta["allreduce_us"] = f"failed: {type(error).__name__}: {str(error)[:200]}"
        log(f"all-reduce of one token's activations, bf16, in a CUDA graph: {meta['allreduce_us']} us")
    for config in configs:  # phase 2: every rank on each config
        part = sharded(config, root, methods, ks, args, meta)
        if rank == 0:
            rows += part
            with open(partial, "w") as f:
                json.dump(rows, f)
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    everything = [r for part in gathered for r in part]
    order = {c: i for i, c in enumerate(configs)}
    everything.sort(key=lambda r: (order[r["config"]], r["gpus"]))
    everything = list({json.dumps(r, sort_keys=True): r for r in everything}.values())
    if rank == 0:
        write(everything, meta, args.out)
    # Phase 3, while time is left (rank 0 decides for all; the results above are written first): the
    # first config, dense and --compile-methods at the first k through torch.compile, sharded, then on
    # rank 0's GPU alone.
    compiled = args.compile_methods.split(",") if args.compile_methods and cuda else []
    go = [bool(compiled) and time.perf_counter() - T0 < args.compile_before_s]
    dist.broadcast_object_list(go, src=0)
    if go[0]:
        everything += sharded(configs[0], root, methods, ks, args, meta, compile_methods=compiled)
        if rank == 0:
            write(everything, meta, args.out)
        go = [time.perf_counter() - T0 < args.compile_before_s + 140]
        dist.broadcast_object_list(go, src=0)
        if go[0] and rank == 0:
            everything += one_gpu_compiled(configs[0], root, compiled, ks[0], args, meta)
            write(everything, meta, args.out)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
