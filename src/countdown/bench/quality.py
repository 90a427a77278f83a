"""Quality of a configuration as the operating-point tables give it: decode-style perplexity and KL.

Held-out text (XSum by default, never the calibration text) is cut into windows of ``window`` tokens
as :func:`countdown.eval.perplexity.perplexity` cuts it; the first half of each window is a dense prompt and the
second half is sparse and scored, exactly as tokens generated one by one after a dense prefill.

One forward per window gives both figures: the perplexity over the scored positions, and
``KL(p_dense || p_sparse)`` (nats, float64) averaged over the same positions, against the dense
model's log-probabilities computed once per model (:func:`held_out`) and kept in memory, so a
configuration costs one sparse pass instead of a dense and a sparse one. Sparsity-Real comes from
the patched model's own counters over the scored (sparse) positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

DEFAULT_TOKENS = 2048  # as the demo
DEFAULT_WINDOW = 512
PROMPT_FRACTION = 0.5


@dataclass
class HeldOut:
    """The windows of held-out text and the dense model's answer on them.

    ``rows [n_windows, window]``: token ids; ``prompt``: dense positions per window; ``first``: the
    first position whose prediction is scored (``prompt - 1``: the prompt's last, dense position, as
    in prefill); ``dense_logp``: per window the dense log-probabilities ``[scored, vocab]`` (float32);
    ``dense_ppl``: the dense perplexity on the same positions."""

    rows: torch.Tensor
    prompt: int
    first: int
    dense_logp: list[torch.Tensor] = field(default_factory=list)
    dense_ppl: float = float("nan")
    text: str = "xsum"

    @property
    def scored(self) -> int:
        return int(self.rows.shape[0] * (self.rows.shape[1] - 1 - self.first))


def _logp(logits: torch.Tensor, first: int) -> torch.Tensor:
    return F.log_softmax(logits[0, first:-1].float(), dim=-1)


@torch.no_grad()
def held_out(model, tokenizer, texts: Sequence[str] | None = None, max_tokens: int = DEFAULT_TOKENS,
             window: int = DEFAULT_WINDOW, prompt_fraction: float = PROMPT_FRACTION, text_name: str = "xsum") -> HeldOut:
    """Tokenize ``texts`` (default :func:`countdown.data.texts.eval_texts`, XSum) into windows and run the
    dense (unpatched) ``model`` over them once."""
    from ..data.models import require_tokenizer
    from ..data.texts import as_texts
    from ..eval.perplexity import check_window, token_windows
    from ..state import is_sparsified

    if is_sparsified(model):
        raise ValueError("held_out needs the dense model: call countdown.unsparsify(model) first")
    if not 0.0 < prompt_fraction < 1.0:
        raise ValueError(f"prompt_fraction must lie in (0, 1) for decode-style scores, got {prompt_fraction}")
    check_window(model, window)  # past the model's positions the perplexity would say nothing of the model
    require_tokenizer(tokenizer, "held_out")
    texts = as_texts(texts)  # None: XSum; a source name or a file path; a list of strings is the text itself
    rows = token_windows(tokenizer, texts, max_tokens, window)
    prompt = int(rows.shape[1] * prompt_fraction)
    held = HeldOut(rows=rows, prompt=prompt, first=max(prompt - 1, 0), text=text_name)
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for row in rows.split(1):
        row = row.to(device)
        logp = _logp(model(row).logits, held.first)
        target = row[0, held.first + 1:]
        nll -= float(logp.gather(-1, target[:, None]).sum())
        count += target.numel()
        held.dense_logp.append(logp.cpu())
    held.dense_ppl = math.exp(nll / count)
    return held


@torch.no_grad()
def decode_quality(model, held: HeldOut) -> dict:
    """Decode-style scores of a sparsified ``model`` on ``held``'s windows:
    ``{"ppl", "ppl_increase", "kl", "top1", "sparsity_real", "tokens"}``. ``ppl_increase`` is relative
    (0.05 = 5 %); ``top1``: the share of scored positions whose argmax agrees with dense."""
    from ..state import dense_prefix, is_sparsified, reset_sparsity_stats, sparsity_real

    if not is_sparsified(model):
        raise ValueError("decode_quality scores a sparsified model: call countdown.sparsify(model, ...) first")
    device = next(model.parameters()).device
    reset_sparsity_stats(model)
    nll, kl, top1, count = 0.0, 0.0, 0, 0
    for row, dense in zip(held.rows.split(1), held.dense_logp):
        row = row.to(device)
        with dense_prefix(model, held.prompt):
            logp = _logp(model(row).logits, held.first).cpu()
        target = row[0, held.first + 1:].cpu()
        nll -= float(logp.gather(-1, target[:, None]).sum())
        p64, q64 = dense.double(), logp.double()
        kl += float((p64.exp() * (p64 - q64)).sum())
        top1 += int((dense.argmax(-1) == logp.argmax(-1)).sum())
        count += target.numel()
    ppl = math.exp(nll / count)
    real = sparsity_real(model)["mean"]
    return {"ppl": ppl, "ppl_increase": ppl / held.dense_ppl - 1.0, "kl": kl / count, "top1": top1 / count,
            "sparsity_real": real, "tokens": count}


@torch.no_grad()
def record_masks(model, held: HeldOut, n_tokens: int = 64) -> torch.Tensor:
    """Keep masks ``[layers, n_tokens, d_inter]`` (bool) that a sparsified ``model`` (``path="masked"``)
    picks on the first ``n_tokens`` sparse positions of the first window: real masks to replay at
    another shape (:mod:`countdown.bench.maskreplay`)."""
    from ..state import dense_prefix, state_of

    layers = state_of(model).layers
    n = min(n_tokens, held.rows.shape[1] - held.prompt)
    masks: list[torch.Tensor | None] = [None] * len(layers)

    def hook(i):
        def fn(module, args, keep):
            if masks[i] is None:
                masks[i] = keep.reshape(-1, keep.shape[-1])[held.prompt:held.prompt + n].cpu().clone()
        return fn

    handles = [layer.selector.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        with dense_prefix(model, held.prompt):
            model(held.rows[:1].to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    if any(m is None for m in masks):
        raise RuntimeError("a layer's selector did not run: record masks on a model patched with path='masked'")
    return torch.stack(masks)
