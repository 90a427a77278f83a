"""Log-likelihoods of many requests under many sparse configurations, each dense prompt run once.

In countdown's evaluation setting (:mod:`countdown.eval.lmeval`) the prompt of a log-likelihood request
is dense and only the continuation is sparse, so the prompt's forward pass and KV cache are the same
for every method, mode and k. :func:`score_requests` runs the distinct prompts once on the dense
model (left-padded batches), keeps each prompt's KV cache and the dense prediction of the first
continuation token, then, configuration by configuration, feeds only the continuation tokens
through those caches with the model patched. A multiple-choice item's choices share one prompt.

This module imports neither lm-eval nor datasets: it is what runs on a machine that has only torch
and transformers (the GPU machine of :mod:`countdown.eval.offline`). The numbers equal
:class:`countdown.eval.lmeval.CountdownLM`'s (one patched forward of context + continuation per request)
up to float32 rounding: the same tokens (lm-eval's left truncation to ``max_length`` included), the
same dense and sparse positions and the same Sparsity-Real counts; ``tests/test_shared_prompt.py``
compares the two request by request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..decode.cache import cache_kwargs, output_cache
from ..nonfinite import check_finite_values
from ..patch.sparsify import dense_prefix, sparsify, state_of, unsparsify, with_mode


@dataclass(frozen=True)
class EvalConfig:
    """One configuration: ``method`` ("dense", "mono" ...), ``mode`` ("ideal"/"prac"), ``sparsity`` k
    (None for dense) and the SP-Prac ``artifacts`` (an :class:`countdown.artifacts.store.Artifacts` or path)."""

    method: str
    mode: str = "ideal"
    sparsity: float | None = None
    artifacts: Any = None

    @property
    def is_dense(self) -> bool:
        return self.method == "dense"


class Counts:
    """Per-layer kept / seen row counts of one configuration, summed over every forward pass."""

    def __init__(self):
        self.kept: list[float] = []
        self.rows: list[int] = []

    def add(self, model) -> None:
        layers = state_of(model).layers
        if not self.kept:
            self.kept, self.rows = [0.0] * len(layers), [0] * len(layers)
        for i, layer in enumerate(layers):
            self.kept[i] += float(layer.kept_total)
            self.rows[i] += int(layer.rows_total)

    def mean(self) -> float | None:
        """Sparsity-Real as :func:`countdown.sparsity_real` computes it (mean over layers)."""
        seen = [1.0 - k / r for k, r in zip(self.kept, self.rows) if r]
        return sum(seen) / len(seen) if seen else None


def split_request(context: Sequence[int], continuation: Sequence[int], max_length: int):
    """``(prompt, continuation_input)`` token tuples of one request, after lm-eval's left truncation.

    The model input is ``(context + continuation)[-(max_length + 1):][:-1]`` (as in
    :meth:`CountdownLM._model_input`); its first ``len(input) - (len(continuation) - 1)`` tokens are
    the dense prompt, the rest (``continuation[:-1]``) the sparse positions.
    """
    if len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens is longer than max_length={max_length}")
    if not continuation:
        raise ValueError("a log-likelihood request with an empty continuation has nothing to score")
    tokens = (list(context) + list(continuation))[-(max_length + 1):][:-1]
    n_dense = len(tokens) - (len(continuation) - 1)
    if n_dense < 1:
        raise ValueError("a request without a single prompt token cannot be scored with a dense prompt")
    return tuple(tokens[:n_dense]), tuple(tokens[n_dense:])


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(items: list, width, budget: int) -> list[list]:
    """Consecutive ``items`` in batches of at most ``budget`` tokens (rows x ``width(item)`` of the
    widest row, items sorted so that the widest comes first or last)."""
    out, current, widest = [], [], 0
    for item in items:
        w = max(widest, width(item))
        if current and (len(current) + 1) * w > budget:
            out.append(current)
            current, w = [], width(item)
        current.append(item)
        widest = w
    if current:
        out.append(current)
    return out


def _prompt_pass(model, prompts: list[tuple], device, pad_id: int, budget: int, softmax_dtype=None):
    """Dense forward of every prompt (left-padded batches): ``{prompt: log-softmax of the next-token
    logits [V]}`` and ``{prompt: [(keys, values) per layer, each [1, heads, len, head_dim]]}``."""
    from transformers import DynamicCache

    first, layers = {}, {}
    for batch in _batches(prompts, len, budget):
        longest = max(len(p) for p in batch)
        ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, longest - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # a cache without the config keeps every position of sliding-window layers too (the window
        # is applied by the attention mask), so each prompt's full KV can be cut out of the batch
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                    **cache_kwargs(DynamicCache()), use_cache=True, logits_to_keep=1)
        logp = F.log_softmax(out.logits[:, -1], dim=-1, dtype=softmax_dtype)
        kv = [(layer.keys, layer.values) for layer in output_cache(out).layers]
        for r, p in enumerate(batch):
            first[p] = logp[r]
            layers[p] = [(k[r:r + 1, :, longest - len(p):], v[r:r + 1, :, longest - len(p):]) for k, v in kv]
    return first, layers


@torch.no_grad()
def score_requests(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], configs: Sequence[EvalConfig],
                   max_length: int, softmax_dtype=None, chunk: int = 16, pad_id: int = 0, counts=None,
                   batch_tokens: int = 256, prompt_tokens: int | None = None, seconds: list | None = None,
                   progress=None):
    """Log-likelihoods of every request under every configuration, each prompt run once.

    requests: ``[(context_tokens, continuation_tokens)]``; configs: :class:`EvalConfig` list.
    chunk: prompts handled together (default 16). Their KV caches are held at once, one copy per
        distinct continuation (memory: about ``chunk`` x choices x prompt length x the model's KV
        bytes per token), and each configuration is patched once per chunk.
    batch_tokens: continuations run sorted by length in batches of about this many tokens (rows x
        longest row; default 256); ``prompt_tokens`` (default ``batch_tokens``) likewise for prompts.
        The logits of a batch are held at once (tokens x vocabulary floats): on a GPU raise both.
    counts: per-configuration :class:`Counts` to add to (a later call goes on counting), or None.
    seconds: a list ``[prompt seconds, config 0 seconds, ...]`` to add this call's times to (the
        shared dense prompt pass, then each configuration's continuation passes), or None.
    progress: called as ``progress(prompts done, prompts)`` after each chunk, or None.
    Returns ``(results, sparsity)``: ``results[c][i] = (log p(continuation_i), is_greedy_i)`` under
    configuration ``c``; ``sparsity[c]`` its Sparsity-Real over the sparse positions counted so far
    (None for dense).
    """
    device = next(model.parameters()).device
    split = [split_request(c, k, max_length) for c, k in requests]
    # longest first: prompts of one chunk have similar lengths, so little padding
    prompts = sorted(set(p for p, _ in split), key=lambda p: (-len(p), p))
    conts: dict[tuple, list[tuple]] = {}
    by_prompt: dict[tuple, list[int]] = {}
    for i, (prompt, cont) in enumerate(split):
        by_prompt.setdefault(prompt, []).append(i)
        if cont and cont not in conts.setdefault(prompt, []):
            conts[prompt].append(cont)
    results: list[list] = [[None] * len(requests) for _ in configs]
    counts = [Counts() for _ in configs] if counts is None else counts
    times = [0.0] * (len(configs) + 1)
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        _sync(device)
        tick = time.perf_counter()
        first, layers = _prompt_pass(model, part, device, pad_id, prompt_tokens or batch_tokens, softmax_dtype)
        # continuations sorted by length into batches of about ``batch_tokens`` (rows x width): little padding
        rows = sorted(((p, c) for p in part for c in conts.get(p, [])), key=lambda row: (len(row[1]), row))
        groups = _batches(rows, lambda row: len(row[1]), batch_tokens)
        where = {row: (b, r) for b, group in enumerate(groups) for r, row in enumerate(group)}
        # one entry per distinct (continuation row, last token): the last token is the request's own
        needs: list[list] = [[] for _ in groups]
        local: dict[tuple, tuple[int, int]] = {}
        index = [i for p in part for i in by_prompt[p]]
        for i in index:
            prompt, cont = split[i]
            if cont:
                b, r = where[(prompt, cont)]
                key = (b, r, requests[i][1][-1])
                if key not in local:
                    local[key] = (b, len(needs[b]))
                    needs[b].append((r, key[2]))
        offset = [0]
        for n in needs:
            offset.append(offset[-1] + len(n))
        entry_of = []
        for i in index:
            prompt, cont = split[i]
            if cont:
                b, pos = local[(*where[(prompt, cont)], requests[i][1][-1])]
                entry_of.append(offset[b] + pos)
            else:
                entry_of.append(-1)
        entry = torch.tensor(entry_of, dtype=torch.long, device=device)
        batches = [_ContinuationBatch(model, g, layers, device, pad_id, n) for g, n in zip(groups, needs)]
        # the first continuation token is predicted by the dense prompt: the same in every configuration
        slot = {p: s for s, p in enumerate(part)}
        first_all = torch.stack([first[p] for p in part])
        pidx = torch.tensor([slot[split[i][0]] for i in index], dtype=torch.long, device=device)
        tok0 = torch.tensor([requests[i][1][0] for i in index], dtype=torch.long, device=device)
        first_lp = first_all[pidx, tok0]
        first_ok = first_all.argmax(-1)[pidx] == tok0
        has = entry >= 0
        safe = entry.clamp(min=0)
        del first, first_all
        _sync(device)
        times[0] += time.perf_counter() - tick
        for c, config in enumerate(configs):
            tick = time.perf_counter()
            if not config.is_dense:
                sparsify(model, with_mode(config.method, config.mode, config.artifacts), config.sparsity, scope="decode",
                         artifacts=config.artifacts, path="masked")
            try:
                parts = [batch.run(not config.is_dense, softmax_dtype) for batch in batches]
                if parts:
                    e_lp = torch.cat([p[0] for p in parts])
                    e_ok = torch.cat([p[1] for p in parts])
                    lp = first_lp + torch.where(has, e_lp[safe], torch.zeros((), dtype=e_lp.dtype, device=device))
                    ok = first_ok & (e_ok[safe] | ~has)
                else:
                    lp, ok = first_lp, first_ok
                for j, (value, greedy) in enumerate(zip(lp.double().tolist(), ok.tolist())):
                    results[c][index[j]] = (float(value), bool(greedy))
                if not config.is_dense:
                    counts[c].add(model)
            finally:
                if not config.is_dense:
                    unsparsify(model)
            _sync(device)
            times[c + 1] += time.perf_counter() - tick
        if progress is not None:
            progress(min(start + chunk, len(prompts)), len(prompts))
    if seconds is not None:
        for i, t in enumerate(times):
            seconds[i] += t
    for config, scored in zip(configs, results):  # a NaN would still rank the choices: refused
        check_finite_values(scored, f"the log-likelihoods of {config.method} {config.mode or ''} {config.sparsity or ''}")
    return results, [None if config.is_dense else counts[c].mean() for c, config in enumerate(configs)]


class _ContinuationBatch:
    """The continuations of several prompts as one batch through their prompts' KV caches.

    Row r holds prompt p_r's cache, left-padded to the longest prompt (masked out by the attention
    mask), and continuation c_r, right-padded (after the real tokens, so never attended to by them;
    computed dense and left out of Sparsity-Real). Position ids continue each prompt's own positions,
    so every row computes what its request alone would.
    """

    def __init__(self, model, rows: list[tuple[tuple, tuple]], layers: dict, device, pad_id: int,
                 needs: list[tuple[int, int]]):
        self.model, self.rows = model, rows
        width = max(len(c) for _, c in rows)
        longest = max(len(p) for p, _ in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.ones((len(rows), longest + width), dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        # targets of positions 0 .. len-2 (continuation_input[1:]); the last position's target is the
        # request's last token, read per request
        targets = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (prompt, cont) in enumerate(rows):
            ids[r, :len(cont)] = torch.tensor(cont, dtype=torch.long)
            mask[r, :longest - len(prompt)] = 0
            positions[r] = torch.arange(len(prompt), len(prompt) + width)
            targets[r, :len(cont) - 1] = torch.tensor(cont[1:], dtype=torch.long)
        self.ids, self.mask, self.positions = ids.to(device), mask.to(device), positions.to(device)
        self.targets = targets.to(device)
        self.lengths = torch.tensor([len(c) for _, c in rows], dtype=torch.long, device=device)
        self.inner = torch.arange(width, device=device)[None, :] < (self.lengths[:, None] - 1)
        # the entries to score: (row, the request's last token)
        self.need_row = torch.tensor([r for r, _ in needs], dtype=torch.long, device=device)
        self.need_tok = torch.tensor([t for _, t in needs], dtype=torch.long, device=device)
        n_layers = len(layers[rows[0][0]])
        self.kv = []
        for i in range(n_layers):
            pads = [(F.pad(layers[p][i][0], (0, 0, longest - len(p), 0)), F.pad(layers[p][i][1], (0, 0, longest - len(p), 0)))
                    for p, _ in rows]
            self.kv.append((torch.cat([k for k, _ in pads]), torch.cat([v for _, v in pads])))

    def run(self, sparse: bool, softmax_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p, greedy)`` of each entry (row, last token) given at construction, over the row's
        continuation positions, under the model as patched now."""
        from transformers import DynamicCache

        cache = DynamicCache()  # a fresh cache per call: the forward appends to it
        for i, (k, v) in enumerate(self.kv):
            cache.update(k, v, i)
        kwargs = dict(input_ids=self.ids, attention_mask=self.mask, position_ids=self.positions,
                      **cache_kwargs(cache), use_cache=True)
        if sparse:
            with dense_prefix(self.model, torch.zeros_like(self.lengths), self.lengths):
                logits = self.model(**kwargs).logits
        else:
            logits = self.model(**kwargs).logits
        logp = F.log_softmax(logits, dim=-1, dtype=softmax_dtype)
        del logits
        greedy = logp.argmax(-1)
        picked = logp.gather(-1, self.targets[..., None]).squeeze(-1)
        inner_lp = torch.where(self.inner, picked, torch.zeros((), dtype=picked.dtype, device=picked.device)).sum(-1)
        inner_ok = ((greedy == self.targets) | ~self.inner).all(-1)
        r = self.need_row
        last = self.lengths[r] - 1
        lp = inner_lp[r] + logp[r, last, self.need_tok]
        ok = inner_ok[r] & (greedy[r, last] == self.need_tok)
        return lp, ok
