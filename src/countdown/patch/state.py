"""Which positions of a forward pass are sparse, and what a patched model reports.

:class:`SparsityState` is the one object :func:`countdown.sparsify` hangs on a model (as
``model._countdown_state``): the method, k, mode, scope and path, the patched layers, and whether
the current forward is the (dense) prompt (``countdown.Spec.of(model)`` is the configuration it holds). Everything that only *reads* a patched model's state
lives here (so the streaming calibration pass and the reports need not import the patching code).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..kernels.config import KernelOptions
from ..sparse_methods.registry import Method

STATE_ATTR = "_countdown_state"
_SERIALS = itertools.count()  # one number per sparsify call: what a prepared decode step is keyed on


class AlreadySparsifiedError(RuntimeError):
    """sparsify() was called on a model that is already patched."""


class NotSparsifiedError(RuntimeError):
    """unsparsify() or a report was asked of a model that was never patched."""


@dataclass
class SparsityState:
    method: Method
    sparsity: float | None
    mode: str
    scope: str
    path: str
    layers: list["PatchedMLP"] = field(default_factory=list)
    prompt_pass: bool = False  # scope="decode": this forward is the (dense) prompt
    dense_prefix: tuple | None = None  # (prefix, end) set by dense_prefix(); overrides scope
    hook: Any = None
    graph_pool: Any = None  # the CUDA graphs of the layers' eager kernel calls share it (patched._capture)
    spec: Any = None  # the method spec sparsify was given (countdown.spec.Spec)
    artifacts: Any = None  # the SP-Prac artifact (object or path, as given) the selectors came from (countdown.save)
    serial: int = field(default_factory=lambda: next(_SERIALS))  # this patch, not an earlier one at its address
    kernel_options: KernelOptions = field(default_factory=KernelOptions)  # the kernel route's user choices

    def sparse_positions(self, x: torch.Tensor) -> torch.Tensor | bool:
        """True (all sparse), False (all dense) or a bool mask over the leading dims of ``x``."""
        if self.dense_prefix is not None:
            prefix, end = self.dense_prefix
            seq = x.shape[-2] if x.dim() >= 2 else 1
            if end is None and not isinstance(prefix, torch.Tensor):
                n = int(prefix)
                if n <= 0:
                    return True
                if n >= seq:
                    return False
            pos = torch.arange(seq, device=x.device)[None, :]
            prefix = torch.as_tensor(prefix, device=x.device).reshape(-1, 1)
            mask = pos >= prefix
            if end is not None:  # right padding: computed dense, never counted as sparse
                mask = mask & (pos < torch.as_tensor(end, device=x.device).reshape(-1, 1))
            mask = mask.expand(x.shape[0] if x.dim() >= 3 else 1, seq)
            return mask.reshape(-1) if x.dim() == 2 else mask
        if self.scope == "all":
            return True
        return not self.prompt_pass


def _cache_is_empty(cache: Any) -> bool:
    if cache is None:
        return True
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length()) == 0
    if isinstance(cache, (tuple, list)):
        return len(cache) == 0
    return False


def _input_length(args: tuple, kwargs: dict) -> int | None:
    """The sequence length of a causal LM forward's input (ids or embeddings), or None if not found."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    if isinstance(x, torch.Tensor) and x.dim() >= 2:
        return int(x.shape[1])
    return None


def is_prompt_pass(args: tuple, kwargs: dict) -> bool:
    """Whether a forward with these arguments is a prompt (scope "decode": dense).

    One new token with a KV cache is a decode step, decided from the input's shape alone: the cache is not
    read, so a decode step costs no host sync and leaves nothing for torch.compile to break on or guard
    (a static cache's length is a device tensor in some transformers versions, and reading it between
    CUDA-graph replays is what made transformers' compiled generate fail). Several tokens are a prompt
    when the cache is empty (a chunked prefill or a verified draft continues one)."""
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = kwargs.get("cache")  # transformers 5.24 renamed the argument
    if cache is None:
        return True
    if _input_length(args, kwargs) == 1:
        return False
    return _cache_is_empty(cache)


def mark_prompt_pass(state: SparsityState):
    def hook(module, args, kwargs):
        if state.dense_prefix is not None:  # positions are set explicitly: no need to read the cache
            return
        state.prompt_pass = is_prompt_pass(args, kwargs)

    return hook


def state_of(model: nn.Module) -> SparsityState:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise NotSparsifiedError("this model is not sparsified; call countdown.sparsify(model, ...) first")
    return state


def is_sparsified(model: nn.Module) -> bool:
    return getattr(model, STATE_ATTR, None) is not None



@contextlib.contextmanager
def dense_prefix(model: nn.Module, n: int | torch.Tensor, end: int | torch.Tensor | None = None):
    """Inside the block, the first ``n`` positions of every row stay dense and the rest are sparse.

    ``n`` is an int or a LongTensor ``[batch]`` of per-row prompt lengths; ``end`` (same forms)
    marks where each row's real tokens stop: positions from ``end`` on are right padding, computed
    dense and left out of Sparsity-Real. Used for decode-style perplexity and for scoring
    continuations with a dense prompt (the paper's setting).
    """
    state = state_of(model)
    previous = state.dense_prefix
    state.dense_prefix = (n, end)
    try:
        yield model
    finally:
        state.dense_prefix = previous


def reset_sparsity_stats(model: nn.Module) -> None:
    """Start counting Sparsity-Real afresh."""
    for layer in state_of(model).layers:
        layer.reset_stats()


def sparsity_real(model: nn.Module) -> dict:
    """Fraction of rows actually skipped since the model was patched or the stats last reset (teal: the
    fraction of the Gated-MLP's weights its skipped inputs leave unread, ``(2 k_x + k_s) / 3``, see
    :mod:`countdown.sparse_methods.teal`; both are the share of the three matrices a token does not need).

    Returns ``{"mean": float, "per_layer": [float, ...], "target": k}``: the mean is over every sparse
    token of every layer (layers weigh equally since each sees the same tokens). Layers that saw no
    sparse token report NaN. Every path counts, the Triton kernel route too (``path="auto"`` on CUDA: the
    kernels add their kept rows on the device, kernels/jit_helpers.py add_count); reading the counters here syncs once.
    """
    state = state_of(model)
    per_layer = []
    for layer in state.layers:
        rows = int(layer.rows_total)
        per_layer.append(float("nan") if rows == 0 else 1.0 - float(layer.kept_total) / rows)
    seen = [v for v in per_layer if v == v]
    mean = sum(seen) / len(seen) if seen else float("nan")
    return {"mean": mean, "per_layer": per_layer, "target": state.sparsity}
