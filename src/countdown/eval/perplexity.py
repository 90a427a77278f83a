"""Perplexity on held-out text, with every position sparse or decode-style.

The text is tokenized as one stream (documents joined by a blank line), cut to ``max_tokens`` and
split into non-overlapping windows of ``window`` tokens (each starting with BOS when the tokenizer
has one). Two ways to score a sparsified model:

* ``prompt_fraction=0``: every position is scored (and, with ``scope="all"``, every position is
  sparse): the strict, perplexity-style test;
* ``prompt_fraction=0.5`` (decode-style): the first half of each window is a dense prompt and only
  the tokens after it are scored, their positions sparse, exactly as when those tokens are generated
  one by one after a dense prefill.

By default a model patched with ``scope="decode"`` is scored decode-style and anything else on
every position. Pass ``prompt_fraction`` explicitly to compare a dense model with either.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..sparse import dense_prefix, is_sparsified, state_of


def token_windows(tokenizer, texts: Sequence[str], max_tokens: int, window: int) -> torch.Tensor:
    """``[n_windows, window]`` token ids: the first ``max_tokens`` tokens of the joined texts."""
    if window < 4:
        raise ValueError(f"window must be at least 4 tokens, got {window}")
    bos = getattr(tokenizer, "bos_token_id", None)
    body = window - 1 if bos is not None else window
    needed = max(body, max_tokens)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= needed:
            break
    n_windows = min(len(ids), max_tokens) // body
    if n_windows == 0:
        if len(ids) < body:
            raise ValueError(f"the texts hold {len(ids)} tokens, fewer than one window of {body}: give more "
                             f"text or a smaller window")
        raise ValueError(f"max_tokens={max_tokens} is less than one window of {body} tokens (window {window}"
                         f"{' with BOS' if bos is not None else ''}): raise max_tokens to at least {body} "
                         f"or lower the window (--window)")
    rows = torch.tensor(ids[: n_windows * body]).reshape(n_windows, body)
    if bos is not None:
        rows = torch.cat([torch.full((n_windows, 1), bos), rows], dim=1)
    return rows


def _default_prompt_fraction(model) -> float:
    if is_sparsified(model) and state_of(model).scope == "decode":
        return 0.5
    return 0.0


@torch.no_grad()
def perplexity(model, tokenizer, texts: Sequence[str] | None = None, max_tokens: int = 8192,
               window: int = 512, prompt_fraction: float | None = None, batch_size: int = 4,
               progress: bool = True, desc: str = "perplexity") -> float:
    """exp(mean next-token NLL) over the scored tokens of ``max_tokens`` tokens of held-out text.

    texts: defaults to :func:`countdown.data.texts.eval_texts` (XSum articles, never calibration text).
    prompt_fraction: share of each window kept dense as a prompt and not scored (see module doc).
    """
    if texts is None:
        from ..data.texts import eval_texts

        texts = eval_texts()
    if prompt_fraction is None:
        prompt_fraction = _default_prompt_fraction(model)
    if not 0.0 <= prompt_fraction < 1.0:
        raise ValueError(f"prompt_fraction must lie in [0, 1), got {prompt_fraction}")
    rows = token_windows(tokenizer, texts, max_tokens, window)
    width = rows.shape[1]
    prompt = int(width * prompt_fraction)
    device = next(model.parameters()).device
    total_nll, total_count = 0.0, 0
    bar = tqdm(range(0, rows.shape[0], batch_size), desc=desc, disable=not progress, leave=False)
    for start in bar:
        batch = rows[start: start + batch_size].to(device)
        if is_sparsified(model) and prompt > 0:
            with dense_prefix(model, prompt):
                logits = model(batch).logits
        elif is_sparsified(model):
            with dense_prefix(model, 0):
                logits = model(batch).logits
        else:
            logits = model(batch).logits
        # logits at position p predict token p+1; with a prompt of n tokens the first scored
        # prediction comes from position n-1, the prompt's last (dense) position, as in prefill.
        first = max(prompt - 1, 0)
        pred = logits[:, first:-1]
        if pred.dtype in (torch.float16, torch.bfloat16):
            pred = pred.float()
        target = batch[:, first + 1:]
        nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="sum")
        total_nll += float(nll)
        total_count += target.numel()
        bar.set_postfix(ppl=f"{math.exp(total_nll / total_count):.2f}")
    return math.exp(total_nll / total_count)
