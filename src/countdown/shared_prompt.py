"""lm-eval for many sparse configurations at once: the dense prompt runs once, only continuations per k.

In countdown's evaluation setting (:mod:`countdown.lmeval`) the prompt of a log-likelihood request
is dense and only the continuation is sparse, so the prompt's forward pass and KV cache are the same
for every method, mode and k. :func:`score_requests` runs each distinct prompt once on the dense
model, keeps its KV cache and its last position's logits (the dense prediction of the first
continuation token), then, configuration by configuration, feeds only the continuation tokens
through a copy of that cache with the model patched. A multiple-choice item's choices share one
prompt, so its prompt runs once for all choices and all configurations.

The numbers are today's (:class:`countdown.lmeval.CountdownLM`) up to float32 rounding: the same
tokens (lm-eval's left truncation to ``max_length`` included), the same dense and sparse positions
and the same Sparsity-Real counts; only the order of the floating-point sums inside attention
differs (prompt and continuation in two calls instead of one). ``tests/test_shared_prompt.py``
compares the two paths request by request.

:class:`SharedPromptLM` is the lm-eval model: the first ``simple_evaluate`` computes every
configuration's log-likelihoods, later calls (one per configuration, :func:`evaluate_configs`)
replay them through lm-eval's own metrics, so acc / acc_norm / stderr are lm-eval's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .lmeval import DEFAULT_SEED, CountdownLM, _metrics
from .sparse import dense_prefix, sparsify, state_of, unsparsify


@dataclass(frozen=True)
class EvalConfig:
    """One configuration: ``method`` ("dense", "mono" ...), ``mode`` ("ideal"/"prac"), ``sparsity`` k
    (None for dense) and the SP-Prac ``artifacts`` (an :class:`countdown.artifacts.Artifacts` or path)."""

    method: str
    mode: str = "ideal"
    sparsity: float | None = None
    artifacts: Any = None

    @property
    def is_dense(self) -> bool:
        return self.method == "dense"


class _Counts:
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


@torch.no_grad()
def score_requests(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], configs: Sequence[EvalConfig],
                   max_length: int, softmax_dtype=None, chunk: int = 16, pad_id: int = 0, counts=None,
                   batch_tokens: int = 256):
    """Log-likelihoods of every request under every configuration, each prompt run once.

    requests: ``[(context_tokens, continuation_tokens)]``; configs: :class:`EvalConfig` list.
    chunk: prompts handled together (default 16). Their KV caches are held at once, one copy per
        distinct continuation (memory: about ``chunk`` x choices x prompt length x the model's KV
        bytes per token), and each configuration is patched once per chunk.
    batch_tokens: the continuations of a chunk run sorted by length, in batches of about this many
        tokens (rows x longest row; default 256), so that padding wastes little.
    counts: per-configuration row counters to add to (a later call goes on counting), or None.
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
    counts = [_Counts() for _ in configs] if counts is None else counts
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        first, layers = {}, {}
        for prompt in part:
            out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
            first[prompt] = out.logits[0, -1:]
            layers[prompt] = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        # continuations sorted by length into batches of about ``batch_tokens`` (rows x width): little padding
        rows = sorted(((p, c) for p in part for c in conts.get(p, [])), key=lambda row: (len(row[1]), row))
        batches, current = [], []
        for row in rows:
            if current and (len(current) + 1) * len(row[1]) > batch_tokens:
                batches.append(current)
                current = []
            current.append(row)
        if current:
            batches.append(current)
        batches = [_ContinuationBatch(model, b, layers, device, pad_id) for b in batches]
        for c, config in enumerate(configs):
            if not config.is_dense:
                sparsify(model, config.method, config.sparsity, mode=config.mode, scope="decode",
                         artifacts=config.artifacts, path="masked")
            try:
                logits = {}
                for batch in batches:
                    logits.update(batch.run(sparse=not config.is_dense))
                for prompt in part:
                    for i in by_prompt[prompt]:
                        cont = split[i][1]
                        rows = first[prompt] if not cont else torch.cat([first[prompt], logits[(prompt, cont)]])
                        target = torch.tensor(requests[i][1], dtype=torch.long, device=device)
                        logp = F.log_softmax(rows, dim=-1, dtype=softmax_dtype)
                        results[c][i] = (float(logp.gather(-1, target[:, None]).sum()),
                                         bool((logp.argmax(-1) == target).all()))
                if not config.is_dense:
                    counts[c].add(model)
            finally:
                if not config.is_dense:
                    unsparsify(model)
    return results, [None if config.is_dense else counts[c].mean() for c, config in enumerate(configs)]


class _ContinuationBatch:
    """The continuations of several prompts as one batch through their prompts' KV caches.

    Row r holds prompt p_r's cache, left-padded to the longest prompt (masked out by the attention
    mask), and continuation c_r, right-padded (after the real tokens, so never attended to by them;
    computed dense and left out of Sparsity-Real). Position ids continue each prompt's own positions,
    so every row computes what its request alone would.
    """

    def __init__(self, model, rows: list[tuple[tuple, tuple]], layers: dict, device, pad_id: int):
        self.model, self.rows = model, rows
        if not rows:
            return
        width = max(len(c) for _, c in rows)
        longest = max(len(p) for p, _ in rows)
        self.ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
        self.mask = torch.ones((len(rows), longest + width), dtype=torch.long, device=device)
        self.positions = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        for r, (prompt, cont) in enumerate(rows):
            self.ids[r, :len(cont)] = torch.tensor(cont, dtype=torch.long)
            self.mask[r, :longest - len(prompt)] = 0
            self.positions[r] = torch.arange(len(prompt), len(prompt) + width)
        self.lengths = torch.tensor([len(c) for _, c in rows], dtype=torch.long, device=device)
        n_layers = len(layers[rows[0][0]])
        self.kv = []
        for i in range(n_layers):
            pads = [(F.pad(layers[p][i][0], (0, 0, longest - len(p), 0)), F.pad(layers[p][i][1], (0, 0, longest - len(p), 0)))
                    for p, _ in rows]
            self.kv.append((torch.cat([k for k, _ in pads]), torch.cat([v for _, v in pads])))

    def run(self, sparse: bool) -> dict:
        """``{(prompt, continuation_input): logits [len, vocab]}`` under the model as patched now."""
        if not self.rows:
            return {}
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(self.kv):  # a fresh cache per call: the forward appends to it
            cache.update(k, v, i)
        kwargs = dict(input_ids=self.ids, attention_mask=self.mask, position_ids=self.positions,
                      past_key_values=cache, use_cache=True)
        if sparse:
            with dense_prefix(self.model, torch.zeros_like(self.lengths), self.lengths):
                logits = self.model(**kwargs).logits
        else:
            logits = self.model(**kwargs).logits
        return {row: logits[r, :len(row[1])] for r, row in enumerate(self.rows)}


class SharedPromptLM(CountdownLM):
    """lm-eval model that scores log-likelihood requests for every configuration of ``configs`` at once.

    ``current`` picks the configuration whose answers lm-eval gets; answers already computed are
    replayed, missing ones are computed for all configurations in one pass. The model stays dense
    between calls. Generation requests are not shared: evaluate those tasks per configuration
    (:func:`countdown.lmeval.evaluate`).
    """

    def __init__(self, model, tokenizer, configs: Sequence[EvalConfig], batch_size: int | str = 8,
                 chunk: int = 16, **kwargs):
        super().__init__(pretrained=model, tokenizer=tokenizer, method=None, batch_size=batch_size, **kwargs)
        self.configs = list(configs)
        self.current = 0
        self.chunk = chunk
        self.answers: dict[tuple, list] = {}
        self.counts = [_Counts() for _ in self.configs]
        self.seconds = 0.0

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        keys = [(tuple(ctx), tuple(cont)) for _, ctx, cont in requests]
        missing = list(dict.fromkeys(k for k in keys if k not in self.answers))
        if missing:
            start = time.perf_counter()
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            results, _ = score_requests(self._model, missing, self.configs, self.max_length, self.softmax_dtype,
                                        chunk=self.chunk, pad_id=pad, counts=self.counts)
            for j, key in enumerate(missing):
                self.answers[key] = [results[c][j] for c in range(len(self.configs))]
            self.seconds += time.perf_counter() - start
        out = []
        for (cache_key, _, _), key in zip(requests, keys):
            answer = self.answers[key][self.current]
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            out.append(answer)
        return out

    def sparsity_real(self, index: int) -> float | None:
        """Sparsity-Real of configuration ``index`` over every request scored so far."""
        return None if self.configs[index].is_dense else self.counts[index].mean()

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("SharedPromptLM shares dense prompts of log-likelihood requests only; evaluate "
                                  "generation tasks (gsm8k) per configuration with countdown.lmeval.evaluate")


def evaluate_configs(model, tokenizer, task: str, configs: Sequence[EvalConfig], limit: int | None = None,
                     batch_size: int | str = 8, num_fewshot: int | None = None, task_manager: Any = None,
                     seed: int = DEFAULT_SEED, bootstrap_iters: int = 1000, chunk: int = 16) -> list[dict]:
    """:func:`countdown.lmeval.evaluate` of one task for every configuration, prompts computed once.

    Returns one dict per configuration, as ``evaluate`` returns, plus ``"samples"``: the per-document
    outcomes ``[(doc_id, {metric: value})]`` in document order (for paired significance tests), and
    ``"seconds"``: the shared scoring time divided evenly among the configurations plus its own
    replay.
    """
    import lm_eval

    if task_manager is None:
        from .tasks import task_manager as offline_task_manager

        task_manager = offline_task_manager([task])
    lm = SharedPromptLM(model, tokenizer, configs, batch_size=batch_size, chunk=chunk)
    # the task's documents are loaded and processed once (HellaSwag's preprocessing alone takes seconds)
    # and the Task object is reused by every configuration's run
    loaded = task_manager.load([task]).get("tasks", {})
    spec = [loaded[task]] if task in loaded else [task]
    outs, replay = [], []
    for index, config in enumerate(lm.configs):
        lm.current = index
        start = time.perf_counter()
        scored_before = lm.seconds
        out = lm_eval.simple_evaluate(
            model=lm, tasks=spec, limit=limit, num_fewshot=num_fewshot, task_manager=task_manager,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            bootstrap_iters=bootstrap_iters, log_samples=True)
        replay.append(time.perf_counter() - start - (lm.seconds - scored_before))
        outs.append(out)
    shared = lm.seconds / max(1, len(lm.configs))
    results = []
    for index, (config, out) in enumerate(zip(lm.configs, outs)):
        samples = sorted(out.get("samples", {}).get(task, []), key=lambda s: s["doc_id"])
        metrics = [m for m in _metrics(out["results"].get(task, {})) if not m.endswith("_stderr")]
        results.append({
            "tasks": {t: _metrics(v) for t, v in out["results"].items()},
            "n_samples": {t: n["effective"] for t, n in out.get("n-samples", {}).items()},
            "sparsity_real": None if config.is_dense else lm.sparsity_real(index),
            "seconds": shared + replay[index],
            "samples": [(s["doc_id"], {m: _sample_value(s.get(m)) for m in metrics if m in s}) for s in samples],
            "config": {"method": config.method, "sparsity": config.sparsity, "mode": config.mode, "limit": limit,
                       "num_fewshot": num_fewshot, "seed": seed},
        })
    return results


def _sample_value(value) -> float:
    """A per-document metric as one number (LAMBADA's per-document perplexity entry is a log-likelihood)."""
    if isinstance(value, (tuple, list)):
        value = value[0]
    return float(value)
