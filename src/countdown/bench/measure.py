"""Decode measurements: tokens/s through ``generate_fast``, kept fractions, bytes read per step.

The bytes one decode step reads are every parameter outside the Gated-MLPs (attention, norms,
lm_head; of the embedding only the looked-up rows, unless it is tied to lm_head) plus, per Gated-MLP,
:func:`countdown.eval.cost.mlp_weight_bytes` of the configuration at its measured kept fraction (per token
at batch 1, the union over the batch's tokens above). Achieved bandwidth = those bytes x steps/s.
"""

from __future__ import annotations

import torch

from ..eval.cost import mlp_weight_bytes

# harness name -> generate_fast(compile=..., compile_options=...)
HARNESSES = {
    "eager": ("eager", None),
    "compile": ("compile", {"mode": "reduce-overhead"}),  # torch.compile(mode="reduce-overhead", fullgraph=True)
    # generate_fast's CUDA default (gpt-fast's Inductor setting): CUDA graphs + matrix-vector products as
    # tuned Triton reductions
    "compile-cdt": ("compile", {"options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}}),
    "cudagraph": ("cudagraph", None),  # the eager step captured in one torch.cuda.CUDAGraph
}


def check_harness(name: str) -> str:
    if name not in HARNESSES:
        raise ValueError(f"unknown harness {name!r}: choose one of {', '.join(HARNESSES)}")
    return name


def time_decode(model, prompt: torch.Tensor, new_tokens: int, harness: str = "compile-cdt",
                max_cache_len: int | None = None) -> dict:
    """``generate_fast`` stats of one greedy run of ``new_tokens`` after ``prompt [batch, len]`` in
    ``harness`` (see :data:`HARNESSES`). The first call for a (model, batch, patch state) compiles or
    captures on a throw-away run first (``stats["setup_s"]``), so every timing is of the replayed step."""
    from ..decode.generate import generate_fast

    mode, options = HARNESSES[check_harness(harness)]
    if mode != "eager" and prompt.device.type != "cuda":
        raise ValueError(f"harness {harness!r} needs a CUDA model; use 'eager' on CPU")
    return generate_fast(model, prompt, new_tokens, compile=mode, max_cache_len=max_cache_len,
                         compile_options=options)[1]


def kept_fractions(model, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    """(mean kept fraction per token, mean kept fraction of the batch's union per step) over ``steps``
    eager decode steps of a model patched with ``path="masked"`` (its selectors run on every token)."""
    from ..decode.generate import generate_fast
    from ..sparse import state_of

    per_token, union = [], []

    def hook(module, args, keep):
        if isinstance(keep, tuple):  # teal: (keep_x, keep_s), weighted by the weights each entry skips
            from ..teal import kept_fractions as input_kept

            token, both = input_kept(*keep)
            per_token.append(token)
            union.append(both)
            return
        per_token.append(keep.float().mean().item())
        union.append(keep.any(dim=0).float().mean().item())

    handles = [layer.selector.register_forward_hook(hook) for layer in state_of(model).layers]
    try:
        generate_fast(model, prompt, steps + 1, compile=False)
    finally:
        for h in handles:
            h.remove()
    if not per_token:
        raise RuntimeError("no decode step ran a selector: is the model patched with path='masked'?")
    return sum(per_token) / len(per_token), sum(union) / len(union)


def non_mlp_weight_bytes(model, batch: int = 1) -> int:
    """Bytes of every parameter outside the Gated-MLPs that one decode step of ``batch`` rows reads."""
    from ..mlp import require_gated_mlps

    mlp_params = {id(p) for mlp in require_gated_mlps(model) for p in mlp.module.parameters()}
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    total = 0
    for p in model.parameters():  # a tied tensor is yielded once
        if id(p) in mlp_params:
            continue
        if p is emb and not tied:
            total += batch * p.shape[1] * p.element_size()  # only the looked-up rows
        else:
            total += p.numel() * p.element_size()
    return total


def step_weight_bytes(model, kind: str, kept: float, batch: int = 1, **options) -> int:
    """Weight bytes one decode step reads with every Gated-MLP read as ``kind``
    (:func:`countdown.eval.cost.mlp_weight_bytes`) at kept fraction ``kept``; ``options``: d_rank, bits, group."""
    from ..mlp import require_gated_mlps

    total = float(non_mlp_weight_bytes(model, batch))
    for mlp in require_gated_mlps(model):
        total += mlp_weight_bytes(kind, mlp.d_model, mlp.d_inter, 1.0 if kind == "dense" else kept,
                                  elem_bytes=mlp.w_up.element_size(), **options)
    return int(total)


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (a patched model's selectors included), each
    storage counted once: views into one storage (tied weights, fuse_attention's q/k/v) count as
    their storage, whatever their offsets."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def dynamo_counts() -> dict:
    """Dynamo's graph and graph-break counters since they were last cleared: one graph over every
    call of a configuration means no recompilation."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def clear_dynamo_counts() -> None:
    from torch._dynamo.utils import counters

    counters.clear()
