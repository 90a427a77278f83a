"""Fast decoding for dense and patched Hugging Face models: ``generate_fast``.

The gpt-fast recipe on a ``transformers`` model, so that dense and sparse decoding are timed in one
harness:

* a static KV cache (``transformers.StaticCache``), allocated once per (model, batch, length
  bucket) and reset in place between calls, so its tensors keep their addresses;
* the prompt in one eager forward, dense on a model patched with ``scope="decode"``;
* every later token through a one-token *step* (forward, then sampling) that runs

  - ``"compile"``: ``torch.compile(step, fullgraph=True)`` with CUDA graphs (what
    ``mode="reduce-overhead"`` sets) and Inductor's coordinate-descent tuning, as gpt-fast does: Inductor
    kernels replayed as CUDA graphs (the default on CUDA; see ``CUDA_INDUCTOR_OPTIONS``);
  - ``"cudagraph"``: the eager step captured once with ``torch.cuda.CUDAGraph`` and replayed (no
    Inductor: seconds to set up instead of a compile, but the small ops stay unfused);
  - ``"eager"``: a plain Python loop (the default on CPU, where a patched model with
    ``path="gather"`` is the fast path).

Sampling, at temperature ``T`` over the ``top_k`` largest logits, draws token ``i`` with probability
``p_i = softmax(logits / T)_i`` by the exponential race ``argmax_i p_i / E_i``, ``E_i ~ Exp(1)``
(the smallest of independent ``E_i / p_i`` falls on ``i`` with probability ``p_i``). The noise comes
from a ``torch.Generator`` seeded by ``seed`` and is drawn outside the graph, so a seed gives the
same tokens in every mode and no step reads the host.

Why the step calls ``model.forward`` and not ``model(...)``: ``countdown.sparsify`` hangs a forward
pre-hook on the model that decides "prompt or decode?" from ``cache.get_seq_length()``, which on a
``StaticCache`` is a device tensor; reading it is a host sync and, under ``torch.compile``, a graph
break. ``generate_fast`` does not need the guess: it knows which forward is the prompt and says so
with :func:`countdown.dense_prefix` (prompt: all positions dense; steps: all sparse), which the
sparse layers obey whatever the hook found. Models patched with ``scope="all"`` stay sparse
everywhere.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

# Re-exported: the decoder, its sampling rule and helpers lived here before the split.
from .decoder import (CUDA_INDUCTOR_OPTIONS, EOS_CHECK_EVERY, MODES, WARMUP_STEPS, Decoder, _all_finished, _mark_step, _patch_state, _scope, _synchronize, _Timer, sample_tokens)

CACHE_BUCKET = 128  # cache lengths are rounded up to this, so calls of similar length share a graph


# --------------------------------------------------------------------------------------------
# The decoder: cache, step, graph
# --------------------------------------------------------------------------------------------


def _resolve_mode(compile: bool | str | None, device: torch.device) -> str:
    if compile is None:
        return "compile" if device.type == "cuda" else "eager"
    if compile is True:
        return "compile"
    if compile is False:
        return "eager"
    if compile not in MODES:
        raise ValueError(f"compile must be True, False, None or one of {', '.join(MODES)}; got {compile!r}")
    if compile == "cudagraph" and device.type != "cuda":
        raise ValueError("compile='cudagraph' captures a CUDA graph: it needs the model on a CUDA device "
                         "(use compile=False on CPU)")
    return compile



_DECODERS: "weakref.WeakKeyDictionary[nn.Module, Decoder]" = weakref.WeakKeyDictionary()


def reset_decoders(model: nn.Module | None = None) -> None:
    """Drop the cached decoders (static caches, compiled steps, CUDA graphs) of ``model``, or of every
    model. Also resets torch.compile's caches when a compiled decoder is dropped: one step function
    serves every decoder, and Dynamo allows it only a few recompilations (one per patch state)."""
    models = list(_DECODERS) if model is None else [model]
    compiled = False
    for m in models:
        decoder = _DECODERS.pop(m, None)
        compiled |= decoder is not None and decoder.mode == "compile"
    if compiled:
        torch._dynamo.reset()


def _bucket(n: int) -> int:
    return int(math.ceil(n / CACHE_BUCKET) * CACHE_BUCKET)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def generate_fast(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int | None = None, compile: bool | str | None = None, seed: int | None = None,
                  eos_token_id: int | list[int] | None = None, max_cache_len: int | None = None,
                  compile_options: dict | None = None) -> tuple[torch.Tensor, dict]:
    """Generate ``max_new_tokens`` tokens after ``input_ids`` ``[batch, prompt]`` (no padding: every
    row is a full prompt of the same length); returns ``(tokens [batch, prompt + new], stats)``.

    temperature: 0 = greedy (argmax); > 0 samples from ``softmax(logits / temperature)``, restricted to
        the ``top_k`` largest logits when ``top_k`` is given.
    compile: None (default: "compile" on CUDA, "eager" on CPU), True / "compile" (torch.compile,
        fullgraph, CUDA graphs + coordinate-descent tuning on CUDA), "cudagraph" (explicit CUDA graph of
        the eager step: seconds to set up, but slower steps) or
        False / "eager". The compiled step or captured graph is kept for the next call with the same
        model, batch, cache length bucket, sampling kind and patch state.
    seed: seeds the sampling noise (a private generator: the global RNG is untouched); None draws a
        seed from the global RNG.
    eos_token_id: stop once every row has produced one (checked every 16 steps; the host reads the
        tokens then); tokens after a row's EOS are left as generated.
    max_cache_len: static KV-cache length (default: prompt + new tokens rounded up to 128).
    compile_options: extra ``torch.compile`` arguments, e.g. ``{"backend": "eager"}`` for debugging, or
        ``{"mode": "reduce-overhead"}`` (plain CUDA graphs, no tuning). Given ``mode`` or ``options``,
        they replace the CUDA default (torch.compile takes one or the other).

    On a model patched by :func:`countdown.sparsify` with ``scope="decode"`` the prompt is dense and
    every generated token sparse, as with ``model.generate``; with ``scope="all"`` all are sparse.

    stats: ``mode``, ``device``, ``batch``, ``prompt_tokens``, ``new_tokens`` (per row),
    ``setup_s`` (compile/capture in this call, not in the times below; 0 when reused),
    ``prefill_s``, ``decode_s``, ``total_s``, ``tokens_per_s`` (batch x new tokens / total_s),
    ``decode_tokens_per_s`` (tokens of the decode steps / decode_s) and ``ms_per_step``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor [batch, prompt_len] (use input_ids[None] for one prompt)")
    batch, n_prompt = input_ids.shape
    if batch < 1 or n_prompt < 1:
        raise ValueError(f"input_ids needs at least one row and one token, got shape {tuple(input_ids.shape)}")
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_new_tokens = int(max_new_tokens)
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None \
        else model.config.vocab_size
    if top_k is not None and not 1 <= int(top_k) <= vocab:
        raise ValueError(f"top_k must be in [1, vocab size {vocab}] or None, got {top_k}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    mode = _resolve_mode(compile, device)
    need = n_prompt + max_new_tokens
    if max_cache_len is None:
        max_cache_len = _bucket(need)
    elif max_cache_len < need:
        raise ValueError(f"max_cache_len={max_cache_len} cannot hold the prompt ({n_prompt}) plus "
                         f"{max_new_tokens} new tokens; give at least {need}")
    greedy = temperature == 0
    top_k = None if greedy or top_k is None else int(top_k)
    compile_options = dict(compile_options or {})
    if model.training:
        raise ValueError("generate_fast needs the model in eval mode: call model.eval() first")

    decoder = _DECODERS.get(model)
    setup_s = 0.0
    if decoder is None or not decoder.matches(model, mode, batch, max_cache_len, greedy, top_k, compile_options):
        if decoder is not None:
            reset_decoders(model)
        decoder = Decoder(model, mode, batch, max_cache_len, greedy, top_k, _patch_state(model), compile_options)
        _DECODERS[model] = decoder

    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    inv_temperature = None if greedy else torch.tensor(1.0 / temperature, dtype=torch.float32, device=device)

    def noise_fn():
        if greedy:
            return None
        return torch.empty(batch, vocab, dtype=torch.float32, device=device).exponential_(generator=generator)

    if not decoder.warmed and mode != "eager":
        setup_s = decoder.warm_up(input_ids, noise_fn, inv_temperature)
        generator.manual_seed(generator.initial_seed())  # the warm-up drew noise: start the seed afresh
    eos = None
    if eos_token_id is not None:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        eos = torch.tensor(ids, dtype=torch.long, device=device)
    tokens, prefill_s, decode_s = decoder.run(input_ids, max_new_tokens, noise_fn, inv_temperature, eos)
    new = tokens.shape[1] - n_prompt
    total_s = prefill_s + decode_s
    stats = {
        "mode": mode, "device": str(device), "batch": batch, "prompt_tokens": n_prompt, "new_tokens": new,
        "setup_s": setup_s, "prefill_s": prefill_s, "decode_s": decode_s, "total_s": total_s,
        "tokens_per_s": batch * new / total_s if total_s > 0 else float("nan"),
        "decode_tokens_per_s": batch * (new - 1) / decode_s if decode_s > 0 and new > 1 else float("nan"),
        "ms_per_step": 1e3 * decode_s / (new - 1) if new > 1 else float("nan"),
    }
    return tokens, stats
