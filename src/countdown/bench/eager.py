"""What one sparse MLP call costs the host in transformers' eager generate, against the dense MLP's call
(``benchmarks/generate_paths.py --eager-overhead``).

Eager ``model.generate`` at batch 1 is bound by the host: each layer's modules launch their kernels from
Python, and the GPU waits. A patched MLP replays its kernel route from a CUDA graph (``patched.PatchedMLP``);
whether the sparse model is faster than the dense one in eager generate is then whether that call costs the host
less than the dense MLP's launches. :func:`host_rows` times, per call, on a small Llama (hidden 256, so the GPU
work of a call is a few microseconds and the loop measures the host), the dense MLP module and the patched one for
each method, and the pieces of the patched call (the route's checks, the graph's key, the input copy, the replay,
the output copy); :func:`generate_rows` times transformers' eager generate on the Llama-3.1-8B shape, dense and
sparse alternated over rounds (the host's speed drifts), and profiles one call of each with cProfile.
"""

from __future__ import annotations

import datetime
import time

import torch

SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000}


def per_call_us(fn, n=3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def host_rows(specs, k) -> list[tuple[str, float]]:
    import countdown
    from countdown.bench.speedonly import fit_cuts_on_decode, decode_prompts, on_device, random_artifacts
    from countdown.sparse import state_of
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL)).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 1, SMALL["hidden_size"], device="cuda", dtype=torch.bfloat16)
    rows = [("dense MLP module", per_call_us(lambda: mlp(x)))]
    for spec in specs:
        art = on_device(random_artifacts(model, spec, [k]), "cuda")
        fit_cuts_on_decode(model, art, decode_prompts(SMALL["vocab_size"], 2, 16).to("cuda"), new_tokens=8)
        countdown.sparsify(model, spec, k, mode="prac", artifacts=art)
        layer = state_of(model).layers[0]
        rows.append((f"{spec} k={k}: patched MLP module", per_call_us(lambda: mlp(x))))
        x2 = x.reshape(-1, x.shape[-1])
        rows.append(("  sparse_positions + kernel_ready", per_call_us(
            lambda: (layer.state.sparse_positions(x), layer._kernel_ready(x2, "auto")))))
        sel = layer.selector
        rows.append(("  graph key (buffers' addresses)", per_call_us(
            lambda: (tuple(x2.shape), x2.dtype, tuple(b.data_ptr() for b in (*sel.buffers(), *layer.counters()))))))
        entry = next(iter(layer.__dict__.get("_graphs", {}).values()), None)
        if entry is not None and entry[1] is not None:
            graph, x_in, y_out = entry[1]
            rows.append(("  input copy", per_call_us(lambda: x_in.copy_(x2))))
            rows.append(("  graph replay", per_call_us(graph.replay)))
            rows.append(("  output clone", per_call_us(y_out.clone)))
        else:
            rows.append(("  (no CUDA graph: the route runs launch by launch)", float("nan")))
        countdown.unsparsify(model)
    return rows


def generate_rows(specs, k, new_tokens=64, rounds=4, profile_steps=None) -> list[tuple[str, float]]:
    import countdown
    from countdown.bench.speedonly import fit_cuts_on_decode, decode_prompts, on_device, random_artifacts

    model, _ = countdown.load_model("llama-3.1-8b-shape", dtype="bf16", device="cuda", random_weights=True)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0)).cuda()

    def tps():
        run = lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,  # noqa
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        run()
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            best = max(best, new_tokens / (time.perf_counter() - t0))
        return best

    arts = {}
    for spec in specs:
        arts[spec] = on_device(random_artifacts(model, spec, [k]), "cuda")
        fit_cuts_on_decode(model, arts[spec], decode_prompts(model.config.vocab_size, 2, 64).cuda(), new_tokens=16)
    # dense and each method alternated over ``rounds`` (the host's speed drifts by 10 % in a minute here)
    speeds = {"dense": [], **{spec: [] for spec in specs}}
    for _ in range(rounds):
        speeds["dense"].append(tps())
        for spec in specs:
            countdown.sparsify(model, spec, k, mode="prac", artifacts=arts[spec])
            speeds[spec].append(tps())
            countdown.unsparsify(model)
    rows = []
    for name, values in speeds.items():
        label = "dense" if name == "dense" else f"{name} k={k}"
        rows.append((f"8B eager generate {label}: each round", " / ".join(f"{v:.1f}" for v in values)))
        ratio = [v / d for v, d in zip(values, speeds["dense"])]
        rows.append((f"8B eager generate {label}: vs dense, each round", " / ".join(f"{r:.3f}" for r in ratio)))
    if profile_steps is not None:
        import cProfile
        import io
        import pstats

        for spec in (None, specs[-1]):
            if spec is not None:
                countdown.sparsify(model, spec, k, mode="prac", artifacts=arts[spec])
            tps()
            prof = cProfile.Profile()
            prof.enable()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            profile_steps.append((spec or "dense", buf.getvalue()))
            if spec is not None:
                countdown.unsparsify(model)
    return rows


def report(specs, k: float, out: str | None) -> str:
    """Both tables as Markdown (written to ``out`` and its cProfile tables beside it, if given)."""
    with torch.no_grad():
        rows = host_rows(specs, k)
        profiles: list = []
        gen = generate_rows(specs, k, profile_steps=profiles)
    lines = [f"{torch.cuda.get_device_name()}, {datetime.date.today().isoformat()}, "
             f"`PYTHONPATH=src python benchmarks/generate_paths.py --eager-overhead`", "",
             "| what | us a call (small model, host-bound) |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in rows]
    lines += ["", "| what | tokens/s |", "|---|---|"]
    lines += [f"| {name} | {t} |" for name, t in gen]
    text = "\n".join(lines)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
        with open(out.replace(".md", "_profile.txt"), "w") as f:
            for name, table in profiles:
                f.write(f"== {name}\n{table}\n")
    return text
