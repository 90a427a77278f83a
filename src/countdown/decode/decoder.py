"""The per-(model, batch, cache length) state of :func:`countdown.generate`: the static KV cache,
the one-token step (eager, ``torch.compile``-d or captured in a CUDA graph), the sampling rule and the
device-side timer. :mod:`countdown.decode.generate` holds the public entry point and the decoder cache; the
module docstring there says why the step calls ``model.forward`` and how sampling avoids host syncs.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .cache import cache_kwargs

MODES = ("eager", "compile", "cudagraph")
# What compile=True means on CUDA: CUDA graphs (all that mode="reduce-overhead" sets) plus Inductor's
# coordinate-descent tuning, gpt-fast's setting, which turns each matrix-vector product into a tuned
# Triton reduction fused with its neighbours: faster steps than reduce-overhead alone for some more compile
# time (docs/decode.md).
CUDA_INDUCTOR_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
WARMUP_STEPS = 3  # Inductor's CUDA-graph trees: warm-up run, recording run, then replays
EOS_CHECK_EVERY = 16  # with eos_token_id, the host looks at the tokens once per this many steps


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def sample_tokens(logits: torch.Tensor, noise: torch.Tensor | None, inv_temperature: torch.Tensor | None,
                  top_k: int | None, top_p: float | None = None) -> torch.Tensor:
    """Next tokens ``[batch]`` from last-position logits ``[batch, vocab]``.

    ``noise`` None means greedy (``argmax``). Otherwise ``noise`` holds ``Exp(1)`` draws
    ``[batch, vocab]`` and the token is ``argmax(p / noise)`` with
    ``p = softmax(filter(logits * inv_temperature))``: a draw from ``p`` without a host sync. The filter keeps
    the ``top_k`` largest logits, then (``top_p``) the smallest set of the most likely tokens whose
    probability reaches ``top_p`` (nucleus sampling; the most likely token always stays).
    """
    if noise is None:
        return logits.argmax(dim=-1)
    logits = logits.float() * inv_temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        ordered, order = logits.sort(dim=-1, descending=True)
        p_sorted = torch.softmax(ordered, dim=-1)
        outside = p_sorted.cumsum(dim=-1) - p_sorted > top_p  # the mass before this token already reaches top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))
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
    from ..patch.sparsify import dense_prefix

    return dense_prefix(model, dense_positions)


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass
class Decoder:
    """Everything one (model, batch, cache length, sampling, patch state, model key) needs between calls.

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
    top_p: float | None = None
    key: Any = None  # the model's StepKey when built (countdown.decode.prepared): another key, another decoder
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

    def matches(self, model, mode, batch, max_cache_len, greedy, top_k, compile_options, top_p=None,
                key=None) -> bool:
        return (self.model is model and self.mode == mode and self.batch == batch
                and self.max_cache_len == max_cache_len and self.greedy == greedy and self.top_k == top_k
                and self.top_p == top_p and self.patch_state is _patch_state(model)
                and self.compile_options == compile_options and (key is None or self.key == key))

    # -- forwards ------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt through the model (dense under scope="decode"); last-position logits."""
        n = input_ids.shape[1]
        position_ids = torch.arange(n, device=input_ids.device)[None].expand(input_ids.shape[0], n)
        kwargs = {"logits_to_keep": 1} if self._keep_one else {}
        with _scope(self.model, n):
            out = self.model(input_ids=input_ids, position_ids=position_ids, **cache_kwargs(self.cache),
                             use_cache=True, **kwargs)
        return out.logits[:, -1, :]

    def _step(self, token: torch.Tensor, position: torch.Tensor, noise: torch.Tensor | None,
              inv_temperature: torch.Tensor | None) -> torch.Tensor:
        """One token per row: ``token``, ``position`` ``[batch, 1]`` -> next token ``[batch, 1]``.

        Calls ``model.forward`` directly: see the module docstring (the sparse scope is set by the
        caller with dense_prefix, and sparsify's pre-hook would read the cache length on the device).
        """
        out = self.model.forward(input_ids=token, position_ids=position, **cache_kwargs(self.cache),
                                 use_cache=True)
        return sample_tokens(out.logits[:, -1, :], noise, inv_temperature, self.top_k, self.top_p)[:, None]

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
        # the throw-away tokens are not the user's: Sparsity-Real is given its values back afterwards
        counters = [c for layer in getattr(_patch_state(self.model), "layers", ()) for c in layer.counters()]
        saved = [c.clone() for c in counters]
        with torch.no_grad():
            logits = self.prefill(input_ids)
            token = sample_tokens(logits, noise_fn(), inv_temperature, self.top_k, self.top_p)[:, None]
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
        with torch.no_grad():
            for counter, value in zip(counters, saved):
                counter.copy_(value)
        self.cache.reset()
        self.warmed = True
        return time.perf_counter() - start

    def run(self, input_ids: torch.Tensor, max_new_tokens: int, noise_fn, inv_temperature,
            eos: torch.Tensor | None, on_tokens=None) -> tuple[torch.Tensor, float, float]:
        """Prompt + ``max_new_tokens`` tokens; returns ``(tokens, prefill_s, decode_s)``. ``on_tokens(new)``, if
        given, receives the new tokens ``[batch, n]`` (CPU) as they come, every EOS_CHECK_EVERY steps (one host
        read each) and once at the end."""
        sent = 0

        def deliver(new_so_far: torch.Tensor) -> None:
            nonlocal sent
            if on_tokens is not None and new_so_far.shape[1] > sent:
                on_tokens(new_so_far[:, sent:].cpu())
                sent = new_so_far.shape[1]

        batch, n_prompt = input_ids.shape
        timer = _Timer(self.device)
        self.cache.reset()
        with torch.no_grad():
            timer.mark()
            logits = self.prefill(input_ids)
            self.prompt_logits = logits  # read once after the decode (countdown.nonfinite), never in a step
            first = sample_tokens(logits, noise_fn(), inv_temperature, self.top_k, self.top_p)[:, None]
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
                        if (i + 1) % EOS_CHECK_EVERY == 0:
                            deliver(b["seq"][:, n_prompt:n_prompt + i + 2])
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
                        if (i + 1) % EOS_CHECK_EVERY == 0:
                            deliver(new[:, :i + 2])
                        if eos is not None and _all_finished(i, new[:, :i + 2], eos):
                            done_at = i + 1
                            break
                    new = new[:, :done_at + 1]
            timer.mark()
        deliver(new)
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
