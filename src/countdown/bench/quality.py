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
    from ..patch.state import is_sparsified

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


def _same_windows(held: HeldOut, other: HeldOut) -> None:
    if other.first != held.first or other.prompt != held.prompt or not torch.equal(other.rows, held.rows):
        raise ValueError("the held-out sets cover different windows: build them with the same texts, max_tokens, "
                         "window and prompt_fraction")


def _kl_top1(dense: torch.Tensor, logp: torch.Tensor) -> tuple[float, int]:
    """Summed ``KL(dense || logp)`` (float64) and the count of positions whose argmax agrees."""
    p64, q64 = dense.double(), logp.double()
    return float((p64.exp() * (p64 - q64)).sum()), int((dense.argmax(-1) == logp.argmax(-1)).sum())


@torch.no_grad()
def decode_quality(model, held: HeldOut, others: Sequence[HeldOut] = ()) -> dict:
    """Decode-style scores of a sparsified ``model`` on ``held``'s windows:
    ``{"ppl", "ppl_increase", "kl", "top1", "sparsity_real", "tokens"}``. ``ppl_increase`` is relative
    (0.05 = 5 %); ``top1``: the share of scored positions whose argmax agrees with dense.

    ``others``: more dense references on the same windows (another model's :func:`held_out`, e.g. the 4-bit
    model's own dense answer beside the float one's): the same sparse pass is scored against each too, and
    ``"others"`` lists ``{"ppl_increase", "kl", "top1"}`` per reference, in order (no extra forward)."""
    from ..patch.state import dense_prefix, is_sparsified, reset_sparsity_stats, sparsity_real

    if not is_sparsified(model):
        raise ValueError("decode_quality scores a sparsified model: call countdown.sparsify(model, ...) first")
    for other in others:
        _same_windows(held, other)
    references = [held, *others]
    device = next(model.parameters()).device
    reset_sparsity_stats(model)
    nll, count = 0.0, 0
    kl, top1 = [0.0] * len(references), [0] * len(references)
    for i, row in enumerate(held.rows.split(1)):
        row = row.to(device)
        with dense_prefix(model, held.prompt):
            logp = _logp(model(row).logits, held.first).cpu()
        target = row[0, held.first + 1:].cpu()
        nll -= float(logp.gather(-1, target[:, None]).sum())
        for j, reference in enumerate(references):
            window_kl, window_top1 = _kl_top1(reference.dense_logp[i], logp)
            kl[j] += window_kl
            top1[j] += window_top1
        count += target.numel()
    ppl = math.exp(nll / count)
    real = sparsity_real(model)["mean"]
    scores = {"ppl": ppl, "ppl_increase": ppl / held.dense_ppl - 1.0, "kl": kl[0] / count, "top1": top1[0] / count,
              "sparsity_real": real, "tokens": count}
    if others:
        scores["others"] = [{"ppl_increase": ppl / other.dense_ppl - 1.0, "kl": kl[j] / count, "top1": top1[j] / count}
                            for j, other in enumerate(others, 1)]
    return scores


def compare_held(reference: HeldOut, other: HeldOut) -> dict:
    """Decode-style scores of the dense model behind ``other`` against the one behind ``reference`` (two
    :func:`held_out` on the same windows, e.g. a 4-bit model and its float original), from the
    log-probabilities both kept, with no forward: ``{"ppl", "ppl_increase", "kl", "top1", "tokens"}`` as
    :func:`decode_quality` gives them (``KL(reference || other)``)."""
    _same_windows(reference, other)
    kl, top1, count = 0.0, 0, 0
    for dense, logp in zip(reference.dense_logp, other.dense_logp):
        window_kl, window_top1 = _kl_top1(dense, logp)
        kl += window_kl
        top1 += window_top1
        count += dense.shape[0]
    return {"ppl": other.dense_ppl, "ppl_increase": other.dense_ppl / reference.dense_ppl - 1.0, "kl": kl / count,
            "top1": top1 / count, "tokens": count}
