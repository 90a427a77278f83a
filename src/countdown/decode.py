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

import contextlib
import inspect
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MODES = ("eager", "compile", "cudagraph")
# What compile=True means on CUDA: CUDA graphs (all that mode="reduce-overhead" sets) plus Inductor's
# coordinate-descent tuning, gpt-fast's setting, which turns each matrix-vector product into a tuned
# Triton reduction fused with its neighbours. Measured on an H200, Llama-3.1-8B shape, bf16, batch 1
# (benchmarks/results/decode.md): dense 205 tokens/s against 174 with reduce-overhead alone, M-CountDown
# k=0.9 246 against 221; it costs about 20 s more compile time.
CUDA_INDUCTOR_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
WARMUP_STEPS = 3  # Inductor's CUDA-graph trees: warm-up run, recording run, then replays
CACHE_BUCKET = 128  # cache lengths are rounded up to this, so calls of similar length share a graph
EOS_CHECK_EVERY = 16  # with eos_token_id, the host looks at the tokens once per this many steps


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def sample_tokens(logits: torch.Tensor, noise: torch.Tensor | None, inv_temperature: torch.Tensor | None,
                  top_k: int | None) -> torch.Tensor:
    """Next tokens ``[batch]`` from last-position logits ``[batch, vocab]``.

    ``noise`` None means greedy (``argmax``). Otherwise ``noise`` holds ``Exp(1)`` draws
    ``[batch, vocab]`` and the token is ``argmax(p / noise)`` with
    ``p = softmax(top_k_filter(logits) * inv_temperature)``: a draw from ``p`` without a host sync.
    """
    if noise is None:
        return logits.argmax(dim=-1)
    logits = logits.float() * inv_temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return (probs / noise).argmax(dim=-1)


# --------------------------------------------------------------------------------------------
# Which forward is sparse
# --------------------------------------------------------------------------------------------


def _patch_state(model: nn.Module):
    return getattr(model, "_countdown_state", None)


def _scope(model: nn.Module, dense_positions: int):
    """Inside: the first ``dense_positions`` positions of each row dense, the rest sparse, on a model
    patched with scope="decode"; nothing changes on a dense model or one patched with scope="all"."""
    state = _patch_state(model)
    if state is None or state.scope == "all":
        return contextlib.nullcontext()
    from .sparse import dense_prefix

    return dense_prefix(model, dense_positions)


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


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass
class Decoder:
    """Everything one (model, batch, cache length, sampling, patch state) needs between calls.

    It holds the model through a weak reference: the decoders live in a WeakKeyDictionary keyed by
    the model, and a strong reference back would keep every model (and its GPU memory) alive."""

    model_ref: Any  # weakref.ref to the model
    mode: str
    batch: int
    max_cache_len: int
    greedy: bool
    top_k: int | None
    patch_state: Any  # the model's countdown state object when built (None: dense); identity-compared
    compile_options: dict = field(default_factory=dict)
    cache: Any = None
    step: Any = None
    graph: Any = None
    buffers: dict = field(default_factory=dict)
    warmed: bool = False

    def __post_init__(self):
        from transformers import StaticCache

        if not isinstance(self.model_ref, weakref.ref):
            self.model_ref = weakref.ref(self.model_ref)
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        self._keep_one = _accepts(self.model.forward, "logits_to_keep")
        if self.mode == "compile":
            options = {"fullgraph": True}
            if self.device.type == "cuda" and not {"mode", "options"} & set(self.compile_options):
                options["options"] = dict(CUDA_INDUCTOR_OPTIONS)
            options.update(self.compile_options)
            self.step = torch.compile(self._step, **options)
        else:
            self.step = self._step

    @property
    def model(self) -> nn.Module:
        model = self.model_ref()
        if model is None:
            raise RuntimeError("the model of this decoder was garbage-collected")
        return model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def matches(self, model, mode, batch, max_cache_len, greedy, top_k, compile_options) -> bool:
        return (self.model is model and self.mode == mode and self.batch == batch
                and self.max_cache_len == max_cache_len and self.greedy == greedy and self.top_k == top_k
                and self.patch_state is _patch_state(model) and self.compile_options == compile_options)

    # -- forwards ------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt through the model (dense under scope="decode"); last-position logits."""
        n = input_ids.shape[1]
        position_ids = torch.arange(n, device=input_ids.device)[None].expand(input_ids.shape[0], n)
        kwargs = {"logits_to_keep": 1} if self._keep_one else {}
        with _scope(self.model, n):
            out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=self.cache,
                             use_cache=True, **kwargs)
        return out.logits[:, -1, :]

    def _step(self, token: torch.Tensor, position: torch.Tensor, noise: torch.Tensor | None,
              inv_temperature: torch.Tensor | None) -> torch.Tensor:
        """One token per row: ``token``, ``position`` ``[batch, 1]`` -> next token ``[batch, 1]``.

        Calls ``model.forward`` directly: see the module docstring (the sparse scope is set by the
        caller with dense_prefix, and sparsify's pre-hook would read the cache length on the device).
        """
        out = self.model.forward(input_ids=token, position_ids=position, past_key_values=self.cache,
                                 use_cache=True)
        return sample_tokens(out.logits[:, -1, :], noise, inv_temperature, self.top_k)[:, None]

    # -- explicit CUDA graph -------------------------------------------------------------------

    def _capture(self, token, position, noise, inv_temperature) -> None:
        """Record one step into a CUDA graph over static buffers; replay writes ``seq[:, pos+1]``,
        then advances ``token`` and ``position`` in place, so the loop launches nothing else."""
        b = self.buffers
        b["token"], b["position"] = token.clone(), position.clone()
        b["noise"] = None if noise is None else noise.clone()
        b["inv_temperature"] = None if inv_temperature is None else inv_temperature.clone()
        b["seq"] = torch.zeros(self.batch, self.max_cache_len + 1, dtype=torch.long, device=token.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            nxt = self._step(b["token"], b["position"], b["noise"], b["inv_temperature"])
            b["seq"].scatter_(1, b["position"] + 1, nxt)
            b["token"].copy_(nxt)
            b["position"].add_(1)
        self.graph = graph

    # -- the loop ------------------------------------------------------------------------------

    def warm_up(self, input_ids, noise_fn, inv_temperature) -> float:
        """Compile / capture on a throw-away run over the real prompt, then reset the cache."""
        start = time.perf_counter()
        with torch.no_grad():
            logits = self.prefill(input_ids)
            token = sample_tokens(logits, noise_fn(), inv_temperature, self.top_k)[:, None]
            position = torch.full_like(token, input_ids.shape[1])
            with _scope(self.model, 0):
                if self.mode == "cudagraph":
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):  # warm-up off the capture stream, as CUDA graphs ask
                        for _ in range(WARMUP_STEPS):
                            token = self._step(token, position, noise_fn(), inv_temperature)
                            position = position + 1
                    torch.cuda.current_stream().wait_stream(stream)
                    self._capture(token, position, noise_fn(), inv_temperature)
                else:
                    for _ in range(WARMUP_STEPS):
                        _mark_step(self.mode)
                        token = self.step(token, position, noise_fn(), inv_temperature).clone()
                        position = position + 1
        _synchronize(self.device)
        self.cache.reset()
        self.warmed = True
        return time.perf_counter() - start

    def run(self, input_ids: torch.Tensor, max_new_tokens: int, noise_fn, inv_temperature,
            eos: torch.Tensor | None) -> tuple[torch.Tensor, float, float]:
        """Prompt + ``max_new_tokens`` tokens; returns ``(tokens, prefill_s, decode_s)``."""
        batch, n_prompt = input_ids.shape
        timer = _Timer(self.device)
        self.cache.reset()
        with torch.no_grad():
            timer.mark()
            logits = self.prefill(input_ids)
            first = sample_tokens(logits, noise_fn(), inv_temperature, self.top_k)[:, None]
            timer.mark()
            steps = max_new_tokens - 1
            done_at = steps
            with _scope(self.model, 0):
                if self.mode == "cudagraph":
                    b = self.buffers
                    b["token"].copy_(first)
                    b["position"].fill_(n_prompt)
                    b["seq"].zero_()
                    b["seq"][:, n_prompt] = first[:, 0]
                    for i in range(steps):
                        if b["noise"] is not None:
                            b["noise"].copy_(noise_fn())
                        self.graph.replay()
                        if eos is not None and _all_finished(i, b["seq"][:, n_prompt:n_prompt + i + 2], eos):
                            done_at = i + 1
                            break
                    new = b["seq"][:, n_prompt:n_prompt + done_at + 1].clone()
                else:
                    new = torch.empty(batch, max_new_tokens, dtype=torch.long, device=input_ids.device)
                    new[:, :1] = first
                    token, position = first, torch.full_like(first, n_prompt)
                    for i in range(steps):
                        _mark_step(self.mode)
                        token = self.step(token, position, noise_fn(), inv_temperature)
                        if self.mode == "compile":
                            token = token.clone()  # the graph's output buffer is reused by the next replay
                        new[:, i + 1:i + 2] = token
                        position = position + 1
                        if eos is not None and _all_finished(i, new[:, :i + 2], eos):
                            done_at = i + 1
                            break
                    new = new[:, :done_at + 1]
            timer.mark()
        prefill_s, decode_s = timer.intervals()
        return torch.cat([input_ids, new], dim=1), prefill_s, decode_s


def _mark_step(mode: str) -> None:
    if mode == "compile" and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        torch.compiler.cudagraph_mark_step_begin()


def _all_finished(i: int, new: torch.Tensor, eos: torch.Tensor) -> bool:
    """Every EOS_CHECK_EVERY steps (one host read): has every row produced an EOS?"""
    if (i + 1) % EOS_CHECK_EVERY:
        return False
    return bool(torch.isin(new, eos).any(dim=1).all())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Marks on the device timeline (CUDA events: no sync until the end) or the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


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
