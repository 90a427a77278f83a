"""Fast decoding for dense and patched Hugging Face models: :func:`generate` (and its alias ``generate_fast``).

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
break. The decoder does not need the guess: it knows which forward is the prompt and says so
with :func:`countdown.dense_prefix` (prompt: all positions dense; steps: all sparse), which the
sparse layers obey whatever the hook found. Models patched with ``scope="all"`` stay sparse
everywhere.

The decoder of a model (static cache, compiled step) is kept between calls and keyed, as the prepared step
(:mod:`countdown.decode.prepared`) is, on what the model is: a model changed since (quantized, sparsified, moved)
gets both built again.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from ..model.gated_mlp import refuse_meta
from ..nonfinite import check_finite_logits
from ..options import check, check_optional, check_sampling, check_token_ids
from .prepared import StepKey, current_step

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
                  compile_options: dict | None = None, top_p: float | None = None,
                  on_tokens=None) -> tuple[torch.Tensor, dict]:
    """Alias kept for the benchmarks: :func:`generate` as the harness calls it (no step prepared, temperature 0 is
    greedy, no EOS unless given, the tokens after a row's EOS left as generated); returns ``(tokens, stats)``."""
    return _decode(model, input_ids, max_new_tokens, temperature, top_k, compile, seed, eos_token_id, max_cache_len,
                   compile_options, top_p, on_tokens)


def _decode(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
            top_k: int | None = None, compile: bool | str | None = None, seed: int | None = None,
            eos_token_id: int | list[int] | None = None, max_cache_len: int | None = None,
            compile_options: dict | None = None, top_p: float | None = None,
            on_tokens=None, key: StepKey | None = None) -> tuple[torch.Tensor, dict]:
    """Generate ``max_new_tokens`` tokens after ``input_ids`` ``[batch, prompt]`` (no padding: every
    row is a full prompt of the same length); returns ``(tokens [batch, prompt + new], stats)``.

    temperature: 0 = greedy (argmax); > 0 samples from ``softmax(logits / temperature)``, restricted to
        the ``top_k`` largest logits when ``top_k`` is given and to the nucleus of mass ``top_p`` when
        ``top_p`` is given. Ranges (:data:`countdown.options.RANGES`, as on the command line): max_new_tokens
        an integer >= 1, temperature a finite number >= 0, top_k an integer from 1 to the vocabulary, top_p in
        (0, 1], seed an integer from 0 to 2^32 - 1; checked before any work.
    compile: None (default: "compile" on CUDA, "eager" on CPU), True / "compile" (torch.compile,
        fullgraph, CUDA graphs + coordinate-descent tuning on CUDA), "cudagraph" (explicit CUDA graph of
        the eager step: seconds to set up, but slower steps) or
        False / "eager". The compiled step or captured graph is kept for the next call with the same
        model, batch, cache length bucket, sampling kind and patch state.
    seed: seeds the sampling noise (a private generator: the global RNG is untouched); None draws a
        seed from the global RNG.
    eos_token_id: stop once every row has produced one (checked every 16 steps; the host reads the
        tokens then, waiting for the device); tokens after a row's EOS are left as generated. None or []: no
        EOS, no reads until the end.
    max_cache_len: static KV-cache length (default: prompt + new tokens rounded up to 128).
    on_tokens: called with the new tokens ``[batch, n]`` (CPU) as they come (every 16 steps, then once more).
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
    max_new_tokens = check("max_new_tokens", max_new_tokens)
    check_token_ids(input_ids, model)  # an id beyond the vocabulary: a ValueError naming it, not an IndexError
    temperature = check("temperature", temperature)  # 0 = greedy
    seed, top_p = check_optional("seed", seed), check_optional("top_p", top_p)
    head = model.get_output_embeddings()  # out_features first: a 4-bit head builds its weight on each read
    vocab = model.config.vocab_size if head is None else getattr(head, "out_features", None) or head.weight.shape[0]
    if top_k is not None and check("top_k", top_k) > vocab:
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
    top_p = None if greedy or top_p is None or float(top_p) == 1.0 else float(top_p)
    compile_options = dict(compile_options or {})
    if model.training:
        raise ValueError("generation needs the model in eval mode: call model.eval() first")

    if key is None:  # (generate has made the step fit and passes its key)
        key = current_step(model)  # a step prepared before and stale since is prepared again: never run stale
    decoder = _DECODERS.get(model)
    setup_s = 0.0
    if decoder is None or not decoder.matches(model, mode, batch, max_cache_len, greedy, top_k, compile_options,
                                              top_p, key):
        if decoder is not None:
            reset_decoders(model)
        decoder = Decoder(model, mode, batch, max_cache_len, greedy, top_k, _patch_state(model), compile_options,
                          top_p, key=key)
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
    ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if ids:  # no EOS (None or []): no host read of the tokens during the decode
        eos = torch.tensor(ids, dtype=torch.long, device=device)
    tokens, prefill_s, decode_s = decoder.run(input_ids, max_new_tokens, noise_fn, inv_temperature, eos, on_tokens)
    check_finite_logits(decoder.prompt_logits, "generate")  # once per call, after the last step: NaN weights
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


def _prompt_ids(input_ids, pad_token_id: int | None = None) -> torch.Tensor:
    """input_ids as ``[batch, prompt]``: a tensor (1-D for one prompt) or a tokenizer's output. A batch whose rows
    start with the pad token (some, not all: a left-padded batch) passed without its attention mask is decoded as it
    is, with a warning, as transformers' generate warns."""
    mask = None
    if not isinstance(input_ids, torch.Tensor) and hasattr(input_ids, "keys") and "input_ids" in input_ids:
        mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a LongTensor or a tokenizer's output, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("the prompts are padded (attention_mask has zeros): countdown.generate takes prompts of "
                         "one length; generate each length separately, or use model.generate for padded batches")
    if mask is None and pad_token_id is not None and input_ids.dim() == 2 and input_ids.shape[0] > 1:
        starts = input_ids[:, 0] == pad_token_id
        if bool(starts.any()) and not bool(starts.all()):
            import warnings

            warnings.warn(f"rows {starts.nonzero().flatten().tolist()} of the batch start with the pad token "
                          f"({pad_token_id}) and no attention_mask was passed: a left-padded batch? countdown.generate "
                          "decodes every position as a token of the prompt; pass the tokenizer's output with its "
                          "attention_mask (padded prompts are refused: generate each length separately)",
                          UserWarning, stacklevel=3)
    return input_ids


def generate(model: nn.Module, input_ids, max_new_tokens: int = 128, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, streamer=None, seed: int | None = None,
             fast_step: bool = True, compile: bool | str | None = None, compile_options: dict | None = None,
             max_cache_len: int | None = None, return_stats: bool = False):
    """Generate with the fastest decode step the library has, in one call; dense or sparsified models alike.

    ``input_ids``: ``[batch, prompt]`` (or ``[prompt]``, or a tokenizer's output) without padding; returns
    ``[batch, prompt + new]`` like ``model.generate`` (and, with ``return_stats``, the statistics: ``mode``,
    ``device``, ``batch``, ``prompt_tokens``, ``new_tokens``, ``setup_s`` (compile / capture in this call),
    ``prefill_s``, ``decode_s``, ``total_s``, ``tokens_per_s``, ``decode_tokens_per_s``, ``ms_per_step``). Greedy
    by default; ``do_sample`` draws at ``temperature`` from the ``top_k`` / ``top_p`` filtered distribution
    (``seed`` makes it repeatable). Stops at ``eos_token_id`` (default: the model's ``generation_config``; ``[]``
    never stops early). ``streamer``: a transformers streamer (``put`` / ``end``, e.g. ``TextStreamer``) that
    receives the tokens as they come, batch 1.

    On CUDA the first call prepares the model's decode step once (``fast_step``: the attention fused, every
    projection on the fixed GEMV, the decoder layers folded: a :class:`~countdown.decode.prepared.PreparedStep`,
    ``countdown.PreparedStep.of(model).describe()`` says what it swapped; the model stays a transformers model,
    ``model.generate`` keeps working) and compiles it with CUDA graphs (tens of seconds; later calls of the same
    batch and length reuse it). A model changed since (quantized, sparsified, moved, another backend) gets its
    step prepared and compiled again. On CPU it decodes eagerly. ``compile`` (None: "compile" on CUDA, "eager" on
    CPU; True, False, "cudagraph"), ``compile_options`` and ``max_cache_len``: as :func:`_decode` says.
    """
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    ids = _prompt_ids(input_ids, pad)
    check_sampling(top_k, top_p, seed, model)  # checked greedy or not, as temperature is
    refuse_meta(model, "generate")
    if streamer is not None and ids.shape[0] != 1:
        raise ValueError(f"a streamer takes one sequence; got a batch of {ids.shape[0]}")
    temperature = check("sample_temperature", temperature, "temperature")  # (do_sample=False is greedy)
    max_new_tokens = check("max_new_tokens", max_new_tokens)
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos_token_id, (list, tuple)) and not eos_token_id:
        eos_token_id = None
    device = next(model.parameters()).device
    if model.training:
        raise ValueError("generation needs the model in eval mode: call model.eval() first")
    key = current_step(model, install=fast_step and device.type == "cuda")
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    on_tokens = None
    if streamer is not None:
        streamer.put(ids.cpu())
        on_tokens = _StreamUntilEos(streamer, eos)
    tokens, stats = _decode(model, ids, max_new_tokens, temperature=temperature if do_sample else 0.0,
                            top_k=top_k if do_sample else None, top_p=top_p if do_sample else None, seed=seed,
                            eos_token_id=eos or None, on_tokens=on_tokens, compile=compile,
                            compile_options=compile_options, max_cache_len=max_cache_len, key=key)
    if streamer is not None:
        streamer.end()
    tokens = _pad_after_eos(tokens, ids.shape[1], eos, pad)
    return (tokens, stats) if return_stats else tokens


class _StreamUntilEos:
    """Hands a streamer the new tokens as they come, up to and including the first EOS."""

    def __init__(self, streamer, eos: list[int]):
        self.streamer, self.eos, self.ended = streamer, eos, False

    def __call__(self, new: torch.Tensor) -> None:
        if self.ended:
            return
        cut = _until_eos(new, self.eos)
        self.ended = cut.shape[1] < new.shape[1] or bool(self.eos and cut.numel() and int(cut[0, -1]) in self.eos)
        if cut.numel():
            self.streamer.put(cut[0])


def _until_eos(new: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """``new [1, n]`` up to and including its first EOS."""
    if not eos:
        return new
    hits = torch.isin(new[0], torch.tensor(eos)).nonzero()
    return new if not len(hits) else new[:, :int(hits[0]) + 1]


def _pad_after_eos(tokens: torch.Tensor, n_prompt: int, eos: list[int], pad: int | None) -> torch.Tensor:
    """As transformers' generate returns them: a row stops at its first EOS (later positions hold the pad
    token, else the EOS), and the sequences end where the last row stopped."""
    if not eos:
        return tokens
    new = tokens[:, n_prompt:]
    hit = torch.isin(new, torch.tensor(eos, device=new.device))
    if not bool(hit.any()):
        return tokens
    after = hit.int().cumsum(dim=1) - hit.int() > 0  # strictly after the row's first EOS
    new = new.masked_fill(after, eos[0] if pad is None else pad)
    stopped = torch.where(hit.any(dim=1), hit.int().argmax(dim=1) + 1, torch.full_like(hit[:, 0], new.shape[1],
                                                                                          dtype=torch.long))
    return torch.cat([tokens[:, :n_prompt], new[:, :int(stopped.max())]], dim=1)
