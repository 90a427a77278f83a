"""Perplexity on held-out text: every position (the papers' convention) or decode-style.

The text is tokenized as one stream (documents joined by a blank line), cut to ``max_tokens`` and
split into non-overlapping windows of ``window`` tokens (each starting with BOS when the tokenizer
has one; fewer tokens than one window make one shorter window). The ``metric`` says what is measured, whatever the model's
patch state:

* ``"all"`` (default): every position is scored, and on a sparsified model every position is sparse;
* ``"decode"``: the first half of each window is a dense prompt and only the tokens after it are
  scored, their positions sparse, as when those tokens are generated one by one after a dense prefill.

A dense model is scored the same way, so a ratio of two perplexities of one metric is what the
sparsity costs. (``sparsify``'s ``scope`` decides what ``generate`` does; it plays no part here.)
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..nonfinite import check_finite, finite_exp
from ..patch.sparsify import dense_prefix, is_sparsified


def _token_ids(tokenizer, texts: Sequence[str], needed: int) -> list[int]:
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= needed:
            break
    return ids


def token_windows(tokenizer, texts: Sequence[str], max_tokens: int, window: int) -> torch.Tensor:
    """``[n_windows, window]`` token ids: the first ``max_tokens`` tokens of the joined texts, whole windows
    only (held-out sets that need equal windows; :func:`perplexity` also scores a shorter last one)."""
    rows = _windows(tokenizer, texts, max_tokens, window, short_ok=False)
    if rows[0].shape[1] < window:
        body = window - (getattr(tokenizer, "bos_token_id", None) is not None)
        held = rows[0].shape[1] - (window - body)
        if held < max_tokens:
            raise ValueError(f"the texts hold {held} tokens, fewer than one window of {body}: give more text or "
                             "a smaller window")
        raise ValueError(f"max_tokens={max_tokens} is less than one window of {body} tokens (window {window}): "
                         f"raise max_tokens to at least {body} or lower the window")
    return rows[0]


def _windows(tokenizer, texts: Sequence[str], max_tokens: int, window: int, short_ok: bool = True
             ) -> list[torch.Tensor]:
    """The whole windows ``[n, window]``; fewer tokens than one window make one shorter window ``[1, w]``.
    Tokens after the last whole window are not scored: a short window there would score them with little
    context, and the committed tables (2,048 tokens in windows of 511 + BOS) would move. ``short_ok``: text
    shorter than ``max_tokens`` is judged by :func:`countdown.options.check_found` (False: the caller has its
    own, stricter rule)."""
    if window < 4:
        raise ValueError(f"window must be at least 4 tokens, got {window}")
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (a token and the next one to predict), got {max_tokens}")
    from ..options import check_found

    bos = getattr(tokenizer, "bos_token_id", None)
    body = window - 1 if bos is not None else window
    ids = _token_ids(tokenizer, texts, max(body, max_tokens))[:max_tokens]
    if short_ok:
        check_found("max_tokens", len(ids), max_tokens)  # fewer than 2: refused; fewer than asked: a warning
    elif len(ids) < 2:
        raise ValueError(f"the texts hold {len(ids)} tokens: give at least 2")
    n_full = len(ids) // body
    parts = []
    if n_full:
        parts.append(torch.tensor(ids[: n_full * body]).reshape(n_full, body))
    else:
        parts.append(torch.tensor(ids)[None])
    if bos is not None:
        parts = [torch.cat([torch.full((p.shape[0], 1), bos), p], dim=1) for p in parts]
    return parts


def check_window(model, window: int) -> None:
    """A window longer than the model's positions (``config.max_position_embeddings``) is refused: past them
    the model's position encoding is extrapolated and the perplexity says nothing about the model."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and window > positions:
        raise ValueError(f"window={window} is longer than the model's {positions} positions "
                         f"(config.max_position_embeddings): give a window of at most {positions}")


METRICS = {"all": 0.0, "decode": 0.5}  # metric -> the share of each window that is a dense, unscored prompt


@torch.no_grad()
def perplexity(model, tokenizer, texts: Sequence[str] | None = None, max_tokens: int = 8192,
               window: int = 512, metric: str = "all", batch_size: int = 4, progress: bool = True,
               desc: str = "perplexity", prompt_fraction: float | None = None, return_tokens: bool = False):
    """exp(mean next-token NLL) over the scored tokens of ``max_tokens`` tokens of held-out text.

    texts: defaults to :func:`countdown.data.texts.eval_texts` (XSum articles, never calibration text); a string
        is a source name or a .txt / .jsonl path (as ``--texts``), a list of strings the text itself.
    max_tokens: an integer >= 2; window: an integer >= 4, at most the model's positions
        (``config.max_position_embeddings``); batch_size: an integer >= 1 (:data:`countdown.options.RANGES`).
    metric: ``"all"`` (every position scored and sparse) or ``"decode"`` (the first half of each window a
        dense prompt, the rest sparse and scored); see the module docstring. ``prompt_fraction`` sets that
        share directly instead (0 is ``"all"``, 0.5 ``"decode"``).
    Text with fewer than ``max_tokens`` tokens is scored whole, with a :class:`countdown.options.ShortInputWarning`;
    fewer than 2 is refused. ``return_tokens``: return ``(perplexity, tokens)``, ``tokens`` the text tokens the
    windows held (BOS not counted; tokens after the last whole window are not scored), the count to report.
    A result that is not finite (NaN or inf logits) is a :class:`countdown.nonfinite.NonFiniteError` naming the
    likely cause, never a result.
    """
    from ..data.models import require_tokenizer
    from ..model.gated_mlp import refuse_meta
    from ..data.texts import as_texts
    from ..options import check

    max_tokens, window = check("max_tokens", max_tokens), check("window", window)
    batch_size = check("batch_size", batch_size)
    if prompt_fraction is None:
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {tuple(METRICS)} (every position, or decode-style), got {metric!r}")
        prompt_fraction = METRICS[metric]
    prompt_fraction = check("prompt_fraction", prompt_fraction)
    check_window(model, window)
    refuse_meta(model, "perplexity")
    require_tokenizer(tokenizer, "perplexity")
    texts = as_texts(texts)
    device = next(model.parameters()).device
    sparse = is_sparsified(model)
    total_nll, total_count = 0.0, 0
    windows = _windows(tokenizer, texts, max_tokens, window)
    text_tokens = sum(rows.numel() for rows in windows) - (getattr(tokenizer, "bos_token_id", None) is not None) * \
        sum(rows.shape[0] for rows in windows)
    batches = [rows[i: i + batch_size] for rows in windows for i in range(0, rows.shape[0], batch_size)]
    bar = tqdm(batches, desc=desc, disable=not progress, leave=False)
    for batch in bar:
        batch = batch.to(device)
        prompt = int(batch.shape[1] * prompt_fraction)
        if sparse:
            with dense_prefix(model, prompt):  # 0: every position sparse, whatever the patch's scope
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
        bar.set_postfix(ppl=f"{finite_exp(total_nll / total_count):.2f}")
    ppl = check_finite(finite_exp(total_nll / total_count), "perplexity")
    return (ppl, text_tokens) if return_tokens else ppl
