"""Calibration text as token windows, and the streaming pass that hands every Gated-MLP's input to
a callback: what every SP-Prac kind is built from.

Everything streams: forward pre-hooks on each Gated-MLP see its input ``x`` as the model runs over
the calibration text in windows; the callback turns ``x`` into what it needs (per-token quantiles,
a uniform sample of scores, captured activations) and nothing else per token is kept.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..model.gated_mlp import GatedMLP
from ..sparse_methods.registry import Method
from ..patch.state import AlreadySparsifiedError, is_sparsified
from ..model.tensor_parallel import refuse_sharded

DEFAULT_WINDOW = 512
DEFAULT_CALIBRATION_TOKENS = 4096
DEFAULT_REFINE_TOKENS = 2048  # per k, for the passes on the sparsified model (see prac.cuts.refine_cuts)
POOLED_SAMPLES = 1 << 18  # indicator values kept per layer for the pooled rule (quantile error ~1e-3)


# --------------------------------------------------------------------------------------------
# Text -> token windows
# --------------------------------------------------------------------------------------------


def resolve_texts(texts) -> tuple[list[str], str]:
    """``(texts, name)``: the calibration passages of :mod:`countdown.data.texts` when ``texts`` is None; a
    string or path is a source name or a .txt / .jsonl file (:func:`countdown.data.texts.as_texts`, the rule of
    ``--texts``), a list of strings the text itself, named by a hash of its content (recorded in artifacts)."""
    import os

    from ..data.texts import DEFAULT_CALIBRATION_SOURCE, as_texts

    if texts is None or isinstance(texts, str) and texts == DEFAULT_CALIBRATION_SOURCE:
        return list(as_texts(None, DEFAULT_CALIBRATION_SOURCE)), \
            "countdown.data.texts.calibration_texts (Wikipedia passages)"
    source = os.fspath(texts) if isinstance(texts, (str, os.PathLike)) else "user texts"
    texts = as_texts(texts)
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]
    return texts, f"{source} ({len(texts)} passages, sha256 {digest})"


def token_windows(tokenizer, texts: Iterable[str], num_tokens: int, window: int = DEFAULT_WINDOW,
                  name: str | None = "num_tokens") -> list[torch.Tensor]:
    """The first ``num_tokens`` tokens of the texts (joined by blank lines) as windows of ``window``
    tokens, each starting with BOS when the tokenizer has one (as :func:`countdown.perplexity`
    scores text, so calibration sees the same positions): LongTensors ``[1, <= window]``.

    ``name``: the argument that asked for ``num_tokens``; the windows' tokens (BOS included, as ``num_tokens``
    counts them) are checked against it by :func:`countdown.options.check_found`: fewer than 64 refused, fewer
    than asked a warning. None: no check (a count the library chose)."""
    if num_tokens < 1 or window < 2:
        raise ValueError(f"num_tokens must be >= 1 and window >= 2, got {num_tokens} and {window}")
    bos = getattr(tokenizer, "bos_token_id", None)
    body = window - 1 if bos is not None else window
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= num_tokens:
            break
    if not ids:
        raise ValueError("the texts produced no tokens; give non-empty text")
    out, used = [], 0
    for start in range(0, len(ids), body):
        if used >= num_tokens:
            break
        chunk = ([bos] if bos is not None else []) + ids[start:start + body]
        chunk = chunk[:num_tokens - used]
        out.append(torch.tensor([chunk], dtype=torch.long))
        used += len(chunk)
    if name is not None:
        from ..options import check_found

        check_found("num_tokens", used, num_tokens, name)
    return out


def first_windows(windows: list[torch.Tensor], num_tokens: int) -> list[torch.Tensor]:
    """The leading windows that hold at most ``num_tokens`` tokens (at least one window)."""
    out, used = [], 0
    for w in windows:
        if out and used + w.numel() > num_tokens:
            break
        out.append(w)
        used += w.numel()
    return out


def batches(windows: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Stack equal-length windows into batches ``[b, window]`` (a shorter last window goes alone)."""
    out, group = [], []
    for w in windows:
        if group and (len(group) == batch_size or group[0].shape[1] != w.shape[1]):
            out.append(torch.cat(group))
            group = []
        group.append(w)
    if group:
        out.append(torch.cat(group))
    return out


# --------------------------------------------------------------------------------------------
# The streaming pass: every Gated-MLP's input, handed to a callback
# --------------------------------------------------------------------------------------------


class _StopForward(Exception):
    """Raised by a hook once every wanted layer has seen its input: the rest of the model is skipped."""


def check_unpatched(model: nn.Module) -> None:
    """Calibration reads the dense model: refuse a patched one (sparse upstream layers change x)."""
    if is_sparsified(model):
        raise AlreadySparsifiedError("calibrate/train on the dense model: call countdown.unsparsify(model) first "
                           "(a patched model feeds sparse activations to later layers)")


def stream_mlp_inputs(model: nn.Module, mlps: list[GatedMLP], windows: list[torch.Tensor],
                      on_input: Callable[[int, torch.Tensor], None], layers: list[int] | None = None,
                      batch_size: int = 4, progress: bool = True, desc: str = "calibration pass",
                      allow_patched: bool = False) -> int:
    """Run the model over ``windows`` and call ``on_input(layer_index, x [tokens, d_model])`` for each
    wanted layer's Gated-MLP input. Returns the number of tokens seen.

    The forward stops after the last wanted layer (a later layer's input is never needed).
    ``allow_patched``: run a sparsified model too (its Gated-MLPs then see the inputs that sparse
    upstream layers produce); by default a patched model is refused.
    """
    from tqdm.auto import tqdm

    if not allow_patched:
        check_unpatched(model)
    refuse_sharded(mlps, "calibration and predictor training")
    wanted = sorted(range(len(mlps)) if layers is None else set(layers))
    if not wanted:
        return 0
    last = wanted[-1]
    device = mlps[0].w_down.device
    handles = []

    def make_hook(index: int):
        def hook(module, args):
            x = args[0]
            on_input(index, x.reshape(-1, x.shape[-1]))
            if index == last:
                raise _StopForward

        return hook

    for i in wanted:
        handles.append(mlps[i].module.register_forward_pre_hook(make_hook(i)))
    seen = 0
    try:
        with torch.no_grad():
            for batch in tqdm(batches(windows, batch_size), desc=desc, disable=not progress, leave=False):
                try:
                    model(input_ids=batch.to(device), use_cache=False)
                except _StopForward:
                    pass
                seen += batch.numel()
    finally:
        for handle in handles:
            handle.remove()
    return seen


# --------------------------------------------------------------------------------------------
# Indicators and quantiles
# --------------------------------------------------------------------------------------------


def indicator_of(method: Method, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """The method's indicator for inputs ``x [N, d_model]``, in float32, computing only what it needs."""
    u = F.linear(x, *like(x, mlp.w_up, mlp.b_up)).float() if method.needs_up else None
    h = mlp.act(F.linear(x, *like(x, mlp.w_gate, mlp.b_gate))).float() if method.needs_gate else None
    return method.indicator(u, h)


def like(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``weight, bias`` in ``x``'s dtype and device (captured float32 inputs of a bf16 model)."""
    cast = lambda t: None if t is None else t.detach().to(device=x.device, dtype=x.dtype)  # noqa: E731
    return cast(weight), cast(bias)


def pooled_sample(score: torch.Tensor, n_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """A uniform sample (on the CPU) of the values of ``score [N, d]``, of ``POOLED_SAMPLES * N / n_tokens``
    values: summed over the batches of ``n_tokens`` tokens, about ``POOLED_SAMPLES`` per layer."""
    flat = score.reshape(-1)
    n = max(1, round(POOLED_SAMPLES * score.shape[0] / max(n_tokens, 1)))
    return flat[torch.randint(0, flat.numel(), (n,), generator=gen).to(flat.device)].cpu()


def token_quantiles(score: torch.Tensor, n_keeps: list[int]) -> torch.Tensor:
    """Per token, the value that exactly ``n_keep`` entries exceed (the ``(n_keep + 1)``-th largest),
    for each ``n_keep``: ``[len(n_keeps), N]``. With ``n_keep == d_inter`` there is no such entry
    and the cut is -inf (keep everything)."""
    d = score.shape[-1]
    live = [n for n in n_keeps if n < d]
    if len(live) == 1:  # one selection is cheaper than a sorted top-k (the same value: both are exact)
        picked = {live[0]: score.kthvalue(d - live[0], dim=-1).values}
    elif live:
        values = score.topk(max(live) + 1, dim=-1, sorted=True).values
        picked = {n: values[:, n] for n in live}
    rows = []
    for n in n_keeps:
        if n >= d:
            rows.append(torch.full(score.shape[:-1], -math.inf, dtype=score.dtype, device=score.device))
        else:
            rows.append(picked[n])
    return torch.stack(rows)


