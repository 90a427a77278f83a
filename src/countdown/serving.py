"""Serving a countdown model through transformers' OpenAI-compatible server, in this process.

``transformers serve`` (``transformers.cli.serve.Serve``, the ``transformers[serving]`` extra: fastapi, uvicorn,
openai) loads each model with ``from_pretrained`` and generates with the model's own ``generate``. A bare
``transformers serve`` never imports countdown, so it would serve a saved folder dense (or, 4-bit, with random
Linears). In this process countdown is imported, so its transformers quantizer is registered
(:mod:`countdown.model.hf_quantizer`), and :func:`serving` runs the same server on a folder or hub id that the server loads
itself: ``from_pretrained`` rebuilds a saved countdown model as saved. A model object (one sparsified in this process,
or a catalogue model :func:`countdown.load_model` made) is served as it is instead: the server's model manager is
handed the object (its loading hooks, ``_load_model`` / ``_load_processor``, return it). Every endpoint, request
check, chat template and streamer is transformers'.

The model's ``generate`` is routed to :func:`countdown.generate` (the fastest decode step the library has: on CUDA
compiled with CUDA graphs and the sparse kernels) for the requests it can serve exactly: batch 1, no padding, greedy
or sampled at a temperature with top-k / top-p, a streamer or none, stopping at the EOS. Any other generation setting
(a repetition or frequency penalty, stop strings, beams, logit biases...) goes to transformers' ``generate``;
:class:`RoutedGenerate` counts both. The server decodes one request at a time (its sequential manager), so sparsity
is never diluted by batching; with ``--continuous-batching`` transformers' paged-attention path takes over and the
route is unused (a skipping step pays up to about 4 tokens a step, docs/results.md's union rule).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import torch
from torch import nn

from .data.texts import PackageUnavailableError

# Generation settings the route runs itself; a setting outside these (at a value that changes the output) sends the
# request to transformers' generate.
ROUTED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
          "pad_token_id", "bos_token_id", "use_cache", "cache_implementation", "transformers_version",
          "_from_model_config"}
NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "length_penalty": 1.0}
START_TIMEOUT_S = 60.0


class ServingUnavailableError(PackageUnavailableError):
    """transformers' serving modules or their packages are missing (the message gives the install command; the
    command line prints it as one line)."""


def _serve_modules():
    try:
        from transformers.cli.serve import Serve
        from transformers.cli.serving import model_manager
        from transformers.utils.import_utils import is_serve_available
    except ImportError as error:
        raise ServingUnavailableError(f"countdown serve needs transformers >= 5.17 with its serving modules "
                                      f"({error}): pip install 'countdown[serve]'") from None
    if not is_serve_available():
        raise ServingUnavailableError("countdown serve needs transformers' serving packages (fastapi, uvicorn, "
                                      "openai): pip install 'countdown[serve]'")
    return Serve, model_manager


class RoutedGenerate:
    """``model.generate`` as the server calls it: :func:`countdown.generate` where the request allows (see the
    module docstring), else the model's own ``generate``. ``calls`` counts each; ``last`` names the last one's
    route and ``why`` why it fell back (None when routed)."""

    def __init__(self, model: nn.Module):
        self.model, self.original = model, model.generate
        self.calls = {"countdown": 0, "transformers": 0}
        self.last, self.why = None, None

    def unroutable(self, input_ids, attention_mask, config, other: dict) -> str | None:
        """Why the request cannot take countdown.generate, or None."""
        if other:
            return f"arguments {', '.join(sorted(other))}"
        if self.model.training:
            return "the model is in training mode"
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            return "not one prompt"
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            return "a padded prompt"
        if config is None:
            return "no generation config"
        changed = sorted(key for key, value in config.to_diff_dict().items()
                         if key not in ROUTED and value not in (None, False, NEUTRAL.get(key, False)))
        return f"generation settings {', '.join(changed)}" if changed else None

    def __call__(self, input_ids=None, attention_mask=None, generation_config=None, streamer=None, tokenizer=None,
                 **other):
        why = self.unroutable(input_ids, attention_mask, generation_config, other)
        self.why = why
        if why is not None:
            self.calls["transformers"] += 1
            self.last = "transformers"
            kwargs = {"attention_mask": attention_mask, "generation_config": generation_config, "streamer": streamer,
                      **({"tokenizer": tokenizer} if tokenizer is not None else {}), **other}
            return self.original(input_ids, **kwargs)
        from .decode.generate import generate

        config = generation_config
        new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - input_ids.shape[1]
        sample = bool(config.do_sample)
        vocab = self.model.config.vocab_size
        self.calls["countdown"] += 1
        self.last = "countdown"
        eos = config.eos_token_id
        return generate(self.model, input_ids, new, do_sample=sample,
                        temperature=config.temperature if sample and config.temperature else 1.0,
                        top_k=min(config.top_k, vocab) if sample and config.top_k else None,
                        top_p=config.top_p if sample else None, eos_token_id=[] if eos is None else eos,
                        streamer=streamer)


@contextlib.contextmanager
def routed_generate(model: nn.Module):
    """``model.generate`` is a :class:`RoutedGenerate` inside the block (yielded), the model's own after it."""
    had = "generate" in model.__dict__
    previous = model.__dict__.get("generate")
    route = RoutedGenerate(model)
    model.generate = route
    try:
        yield route
    finally:
        if had:
            model.generate = previous
        else:
            del model.generate


def _manager_class(base: type, pinned: tuple | None, routes: list | None) -> type:
    """transformers' model manager, handed ``pinned`` (model, tokenizer) instead of loading them, or loading as it does
    and then routing the model's ``generate`` (each route appended to ``routes``; None: not routed)."""

    class CountdownModelManager(base):
        def _load_processor(self, *args, **kwargs):
            processor = pinned[1] if pinned is not None else super()._load_processor(*args, **kwargs)
            _check_chat_tokenizer(processor)
            return processor

        def _load_model(self, *args, **kwargs):
            if pinned is not None:
                return pinned[0]
            model = super()._load_model(*args, **kwargs)
            if routes is not None:
                routes.append(RoutedGenerate(model))
                model.generate = routes[-1]
            return model

    return CountdownModelManager


def _check_chat_tokenizer(tokenizer) -> None:
    if not hasattr(tokenizer, "_tokenizer") or not getattr(tokenizer, "chat_template", None):
        raise ValueError("serving needs the model's fast tokenizer with a chat template (the server applies it to "
                         "each request); this tokenizer has " + ("no chat template" if hasattr(tokenizer, "_tokenizer")
                                                                  else "no fast (Rust) tokenizer"))


def _check_port(host: str, port: int) -> None:
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            raise ValueError(f"cannot serve on {host}:{port}: {error.strerror or error} (another server there? "
                             f"give another --port, or --port 0 for a free one)") from None


class Server:
    """transformers' server running in a background thread with one countdown model (see :func:`serving`).
    ``url``: its base address (``http://host:port``); ``route``: the model's :class:`RoutedGenerate` (None when
    ``fast=False``)."""

    def __init__(self, serve, host: str, route: RoutedGenerate | None):
        self.serve, self.route = serve, route
        port = serve.server.servers[0].sockets[0].getsockname()[1]
        self.host, self.port = host, port
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    @property
    def thread(self) -> threading.Thread:
        return self.serve._thread

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and wait for its thread (idempotent)."""
        self.serve.kill_server()
        self.serve.server.should_exit = True
        self.thread.join(timeout)


@contextlib.contextmanager
def serving(model: nn.Module | str | os.PathLike, tokenizer=None, name: str | None = None, host: str = "127.0.0.1",
            port: int = 8000, fast: bool = True, log_level: str = "warning", device: str = "auto",
            dtype: str = "auto"):
    """Serve ``model`` with transformers' OpenAI-compatible server on ``host``:``port`` (0: a free port), in a
    background thread of this process; yields the :class:`Server` once it accepts connections and always stops it
    on exit.

    model: a folder or hub id, which the server loads itself (``from_pretrained`` with ``device`` and ``dtype``,
    transformers' ``serve`` options; a saved countdown model comes back as saved) and serves under that name; or a
    model object, served as it is with ``tokenizer`` under ``name``. Either way the tokenizer must be a fast one with
    a chat template. ``fast``: route ``generate`` to :func:`countdown.generate` where it can
    (:class:`RoutedGenerate`)."""
    Serve, model_manager = _serve_modules()
    by_name = isinstance(model, (str, os.PathLike))
    if by_name:
        name = os.fspath(model)
    else:
        _check_chat_tokenizer(tokenizer)
    _check_port(host, port)
    routes: list[RoutedGenerate] = []
    with contextlib.ExitStack() as stack:
        if not by_name:
            model.eval()
            if fast:
                routes.append(stack.enter_context(routed_generate(model)))
        base = model_manager.ModelManager
        model_manager.ModelManager = _manager_class(base, None if by_name else (model, tokenizer),
                                                    routes if fast and by_name else None)
        loading = {"device": device, "dtype": dtype} if by_name else {}
        try:  # Serve builds its manager (which loads, or is handed, the one model) first thing, then starts the thread
            serve = Serve(force_model=name, host=host, port=port, log_level=log_level, non_blocking=True, **loading)
        finally:
            model_manager.ModelManager = base
        deadline = time.monotonic() + START_TIMEOUT_S
        while not serve.server.started:
            if not serve._thread.is_alive() or time.monotonic() > deadline:
                serve.kill_server()
                raise RuntimeError(f"transformers' server did not start on {host}:{port} (its log above says why)")
            time.sleep(0.02)
        server = Server(serve, host, routes[0] if routes else None)
        try:
            yield server
        finally:
            server.stop()
