"""Decode measurements of ``countdown bench``: tokens/s through ``generate_fast`` in a named harness, and the kept
fractions a patched model's selectors give on its own decode steps.
"""

from __future__ import annotations

import torch

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
    eager decode steps of a model patched with ``path="masked"`` (its selectors run on every token). A patch that
    ranks rows inside the MLP instead of calling its selector (dual[mixed]) gives the per-token fraction from its
    own counters (Sparsity-Real) and NaN for the union, which it does not count."""
    from ..decode.generate import generate_fast
    from ..patch.sparsify import state_of
    from ..patch.state import reset_sparsity_stats, sparsity_real

    per_token, union = [], []

    def hook(module, args, keep):
        if isinstance(keep, tuple):  # teal: (keep_x, keep_s), weighted by the weights each entry skips
            from ..sparse_methods.teal import kept_fractions as input_kept

            token, both = input_kept(*keep)
            per_token.append(token)
            union.append(both)
            return
        per_token.append(keep.float().mean().item())
        union.append(keep.any(dim=0).float().mean().item())

    handles = [layer.selector.register_forward_hook(hook) for layer in state_of(model).layers]
    reset_sparsity_stats(model)
    try:
        generate_fast(model, prompt, steps + 1, compile=False)
    finally:
        for h in handles:
            h.remove()
    if not per_token:
        real = sparsity_real(model)["mean"]
        if real == real:  # counted by the patch itself
            return 1.0 - real, float("nan")
        raise RuntimeError("no decode step ran a selector: is the model patched with path='masked'?")
    return sum(per_token) / len(per_token), sum(union) / len(union)
