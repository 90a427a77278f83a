"""Where a dense decode step's time goes: each operation timed alone, and the compiled step profiled.

:func:`op_breakdown` times every operation of one decode step of a Llama-style Hugging Face model
(embedding, RMSNorms, QKV projections, rotary embedding, KV-cache write, attention over the static
cache, O projection, residual adds, Gated-MLP, lm_head, sampling) in its own CUDA graph over the
model's own weights, one call per layer (so consecutive calls never find their weights in L2), and
gives each its bytes (weights + KV cache + logits) and time per step. These are eager PyTorch ops:
the compiled step fuses some of them (norms with residual adds, rotary with the projections), so the
sum is an upper bound of what the same ops cost inside it. :func:`profile_steps` gives the compiled
step's own device time by kernel class (torch.profiler over replayed steps).
"""

from __future__ import annotations

import sys

import torch

from .timing import time_graph

KERNEL_CLASSES = [  # (class, substrings of kernel names), first match wins. Ours are named by their @triton.jit
    # functions (countdown.kernels); Inductor names its kernels after the ops it fused (e.g.
    # triton_red_fused__unsafe_view_mm_mul_silu_t_view_10: gate/up GEMV + act).
    ("countdown sparse kernels", ("gate_up_kernel", "down_kernel", "one_token_kernel", "partial_sums_kernel",
                                  "few_tokens_kernel", "select_kernel", "teal_", "rows_other_kernel")),
    ("countdown shadow GEMV", ("shadow_gemv_kernel", "x_prepare_kernel")),
    ("attention", ("fmha", "attention", "flash", "sdpa", "split_kernel", "combine_kernel")),  # ours: kernels/decode_step/
    ("countdown fixed GEMV (projections, indicators)", ("linear_kernel", "int4_gemv_kernel")),
    ("countdown norms and residual adds", ("rmsnorm_kernel", "add_kernel", "add_partials_kernel", "add_norm_kernel")),
    ("GEMV + activation (MLP gate/up)", ("silu", "gelu")),
    ("RMSNorm (+ fused GEMV)", ("rsqrt",)),
    ("sampling (argmax)", ("argmax",)),
    ("other GEMV (projections, W_down, lm_head)", ("_mm_", "_mm", "addmm", "gemv", "gemm", "cutlass", "sm90_",
                                                   "xmma", "cublas", "splitk", "splitK")),
    ("other Inductor Triton", ("triton_",)),
    ("copy / index", ("copy", "index", "scatter", "gather", "memcpy", "Memcpy", "memset", "Memset", "fill")),
]


def kernel_class(kernel: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a kernel's name (the first that matches), else ``"other"``."""
    return next((c for c, keys in KERNEL_CLASSES if any(key in kernel for key in keys)), "other")


def _structure(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(layers[0], "self_attn") or not hasattr(layers[0].self_attn, "q_proj"):
        raise ValueError("op_breakdown knows Llama-style models (model.model.layers[i].self_attn.q_proj, ...); "
                         f"{type(model).__name__} is laid out otherwise")
    return inner, list(layers)


def op_breakdown(model, batch: int = 1, cache_len: int = 640, filled: int = 320) -> list[dict]:
    """Per-operation bytes and time of one decode step of ``model`` (CUDA, Llama-style, dense).

    ``cache_len``: the static KV cache's length (attention reads all of it, as Hugging Face's static
    cache path does, masked beyond ``filled`` positions). Returns one dict per operation: ``op``,
    ``calls`` (per step), ``bytes`` (per step), ``us`` (per step = calls x median us per call),
    ``us_per_call``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    inner, layers = _structure(model)
    n = len(layers)
    cfg = model.config
    attn = layers[0].self_attn
    dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
    d = cfg.hidden_size
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", heads) or heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    esz = torch.finfo(dt).bits // 8
    x = torch.randn(batch, 1, d, device=dev, dtype=dt)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=dev)
    pos = torch.full((batch, 1), filled, device=dev)
    q = torch.randn(batch, heads, 1, hd, device=dev, dtype=dt)
    kv = [(torch.randn(batch, kv_heads, cache_len, hd, device=dev, dtype=dt),
           torch.randn(batch, kv_heads, cache_len, hd, device=dev, dtype=dt)) for _ in range(n)]
    mask = (torch.arange(cache_len, device=dev) <= filled)[None, None, None, :].expand(batch, 1, 1, cache_len)
    k_new = torch.randn(batch, kv_heads, 1, hd, device=dev, dtype=dt)
    cache_pos = torch.tensor([filled], device=dev)
    rotary = getattr(inner, "rotary_emb", None)
    cos, sin = rotary(x, pos) if rotary is not None else (None, None)
    apply_rotary = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    k_one = torch.randn(batch, kv_heads, 1, hd, device=dev, dtype=dt)
    logits = torch.randn(batch, cfg.vocab_size, device=dev, dtype=dt)
    w = lambda module: sum(p.numel() * p.element_size() for p in module.parameters())  # noqa: E731
    act = batch * d * esz
    ops = [  # (name, calls per step, one call per layer's weights, bytes per step)
        ("embedding", 1, [lambda: inner.embed_tokens(ids)], act),
        ("RMSNorm", 2 * n + 1, [lambda i=i: layers[i].input_layernorm(x) for i in range(n)],
         (2 * n + 1) * (w(layers[0].input_layernorm) + 2 * act)),
        ("QKV projections", n, [lambda i=i: (layers[i].self_attn.q_proj(x), layers[i].self_attn.k_proj(x),
                                             layers[i].self_attn.v_proj(x)) for i in range(n)],
         sum(w(l.self_attn.q_proj) + w(l.self_attn.k_proj) + w(l.self_attn.v_proj) for l in layers)),
        ("KV-cache write", n, [lambda i=i: (kv[i][0].index_copy_(2, cache_pos, k_new),
                                            kv[i][1].index_copy_(2, cache_pos, k_new)) for i in range(n)],
         n * 2 * k_new.numel() * esz),
        ("attention (SDPA)", n, [lambda i=i: sdpa_attention_forward(layers[i].self_attn, q, kv[i][0], kv[i][1], mask,
                                                                    scaling=hd ** -0.5, is_causal=False)
                                 for i in range(n)],
         n * 2 * kv[0][0].numel() * esz),
        ("O projection", n, [lambda i=i: layers[i].self_attn.o_proj(q.reshape(batch, 1, heads * hd)) for i in range(n)],
         sum(w(l.self_attn.o_proj) for l in layers)),
        ("residual adds", 2 * n, [lambda: x + x] * 8, 2 * n * 3 * act),
        ("Gated-MLP (dense)", n, [lambda i=i: layers[i].mlp(x) for i in range(n)], sum(w(l.mlp) for l in layers)),
        ("lm_head", 1, [lambda: model.lm_head(x)] * 4, w(model.lm_head)),
        ("sampling (argmax)", 1, [lambda: logits.argmax(dim=-1)] * 8, logits.numel() * esz),
    ]
    if rotary is not None and apply_rotary is not None:
        ops.insert(3, ("rotary embedding", n, [lambda: apply_rotary(q, k_one, cos, sin)] * 8,
                       n * (q.numel() + k_one.numel()) * esz * 2))
    rows = []
    with torch.no_grad():
        for name, calls, fns, nbytes in ops:
            try:
                us = time_graph(fns, device=dev)
            except Exception as error:  # one op that cannot be captured must not lose the others
                rows.append({"op": name, "calls": calls, "bytes": int(nbytes), "us": float("nan"),
                             "us_per_call": float("nan"), "error": f"{type(error).__name__}: {str(error)[:160]}"})
                continue
            rows.append({"op": name, "calls": calls, "bytes": int(nbytes), "us": us * calls, "us_per_call": us})
    del kv
    return rows


def format_breakdown(rows: list[dict], copy_bps: float, step_ms: float | None = None) -> str:
    """A Markdown table of :func:`op_breakdown` with GB/s, share of copy bandwidth and of the step."""
    lines = ["| op | calls/step | MB/step | us/step | GB/s | share of copy bandwidth | share of the compiled step |",
             "|---|---|---|---|---|---|---|"]
    total_b = total_us = 0.0
    for r in rows:
        gbps = r["bytes"] / (r["us"] * 1e-6) / 1e9 if r["us"] == r["us"] and r["us"] > 0 else float("nan")
        share = f"{100 * step_share(r['us'], step_ms):.1f}%" if step_ms else "-"
        lines.append(f"| {r['op']} | {r['calls']} | {r['bytes'] / 1e6:.1f} | {r['us']:.1f} | {gbps:.0f} | "
                     f"{100 * gbps * 1e9 / copy_bps:.0f}% | {share} |")
        if r["us"] == r["us"]:
            total_b += r["bytes"]
            total_us += r["us"]
    gbps = total_b / (total_us * 1e-6) / 1e9 if total_us else float("nan")
    lines.append(f"| **sum of the ops alone** | | {total_b / 1e6:.1f} | {total_us:.1f} | {gbps:.0f} | "
                 f"{100 * gbps * 1e9 / copy_bps:.0f}% | {f'{100 * step_share(total_us, step_ms):.0f}%' if step_ms else '-'} |")
    return "\n".join(lines)


def step_share(us: float, step_ms: float) -> float:
    return us / (step_ms * 1e3)


def profile_steps(model, n_steps: int = 16) -> dict:
    """Device time per decode step by kernel class (:data:`KERNEL_CLASSES`), from torch.profiler over
    ``n_steps`` calls of the model's cached (compiled or captured) step, after a ``generate_fast`` run
    made it. Returns :func:`profile_calls`' dict."""
    from countdown.decode.generate import _DECODERS, _scope

    decoder = _DECODERS[model]
    # The static cache writes at its own running length: start it afresh so the n_steps + 2 writes fit.
    decoder.cache.reset()
    token = torch.zeros(decoder.batch, 1, dtype=torch.long, device=decoder.device)
    position = torch.full_like(token, n_steps + 2)

    def step():
        if decoder.mode == "compile":
            torch.compiler.cudagraph_mark_step_begin()
        decoder.step(token, position, None, None)

    with torch.no_grad(), _scope(model, 0):
        result = profile_calls(step, n_steps, decoder.device)
    decoder.cache.reset()
    return result


def profile_calls(step, n_steps: int, device) -> dict:
    """torch.profiler over ``n_steps`` calls of ``step()`` (after 2 unprofiled ones), kernels classed by
    :data:`KERNEL_CLASSES`. Returns ``{"device_ms_per_step", "kernels_per_step", "classes": {class:
    {"ms_per_step", "kernels_per_step", "top": [(ms, kernel name), ...]}}, "kernels": [{"kernel",
    "class", "calls_per_step", "us_per_step", "us_per_call"}, ...]}`` (every kernel, slowest first)."""
    from torch.profiler import ProfilerActivity, profile

    from .timing import free_memory

    device = torch.device(device)
    for _ in range(2):
        step()
    free_memory()
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(n_steps):
            step()
        free_memory()
    classes: dict = {}
    every: list[dict] = []
    kernels = 0
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if not us or event.key.startswith(("cudaGraph", "Graph", "ProfilerStep")):
            continue
        name = kernel_class(event.key)
        entry = classes.setdefault(name, {"ms_per_step": 0.0, "kernels_per_step": 0.0, "top": []})
        entry["ms_per_step"] += us / 1e3 / n_steps
        entry["kernels_per_step"] += event.count / n_steps
        entry["top"].append((round(us / 1e3 / n_steps, 4), event.key[:80]))
        every.append({"kernel": event.key[:160], "class": name, "calls_per_step": event.count / n_steps,
                      "us_per_step": us / n_steps, "us_per_call": us / max(event.count, 1)})
        kernels += event.count
    for entry in classes.values():
        entry["top"] = sorted(entry["top"], reverse=True)[:4]
    total = sum(e["ms_per_step"] for e in classes.values())
    every.sort(key=lambda e: -e["us_per_step"])
    return {"device_ms_per_step": total, "kernels_per_step": kernels / n_steps, "classes": classes, "kernels": every}
