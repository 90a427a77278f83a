"""lm-eval for many sparse configurations at once: the dense prompt runs once, only continuations per k.

In countdown's evaluation setting (:mod:`countdown.eval.lmeval`) the prompt of a log-likelihood request
is dense and only the continuation is sparse, so the prompt's forward pass and KV cache are the same
for every method, mode and k. :func:`score_requests` runs each distinct prompt once on the dense
model, keeps its KV cache and its last position's logits (the dense prediction of the first
continuation token), then, configuration by configuration, feeds only the continuation tokens
through a copy of that cache with the model patched. A multiple-choice item's choices share one
prompt, so its prompt runs once for all choices and all configurations.

The numbers are today's (:class:`countdown.eval.lmeval.CountdownLM`) up to float32 rounding: the same
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
from typing import Any, Sequence

from .lmeval import DEFAULT_SEED, CountdownLM, _metrics
from .scoring import Counts, EvalConfig, score_requests, split_request

__all__ = ["EvalConfig", "SharedPromptLM", "evaluate_configs", "score_requests", "split_request"]


class SharedPromptLM(CountdownLM):
    """lm-eval model that scores log-likelihood requests for every configuration of ``configs`` at once.

    ``current`` picks the configuration whose answers lm-eval gets; answers already computed are
    replayed, missing ones are computed for all configurations in one pass. The model stays dense
    between calls. Generation requests are not shared: evaluate those tasks per configuration
    (:func:`countdown.eval.lmeval.evaluate`).

    ``supply``: None (compute here), or a function ``supply(keys) -> [[answer per configuration] per
    key]`` that provides the answers of the missing requests ``keys`` (``(context ids, continuation
    ids)`` tuples, in the order lm-eval asked for them): answers scored elsewhere (on a GPU,
    :mod:`countdown.eval.offline`), or placeholders while the requests are only recorded.
    """

    def __init__(self, model, tokenizer, configs: Sequence[EvalConfig], batch_size: int | str = 8,
                 chunk: int = 16, **kwargs):
        super().__init__(pretrained=model, tokenizer=tokenizer, method=None, batch_size=batch_size, **kwargs)
        self.configs = list(configs)
        self.current = 0
        self.chunk = chunk
        self.answers: dict[tuple, list] = {}
        self.counts = [Counts() for _ in self.configs]
        self.seconds = 0.0
        self.supply = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        keys = [(tuple(ctx), tuple(cont)) for _, ctx, cont in requests]
        missing = list(dict.fromkeys(k for k in keys if k not in self.answers))
        if missing and self.supply is not None:
            for key, row in zip(missing, self.supply(missing), strict=True):
                self.answers[key] = list(row)
        elif missing:
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
                                  "generation tasks (gsm8k) per configuration with countdown.eval.lmeval.evaluate")


def evaluate_configs(model, tokenizer, task: str, configs: Sequence[EvalConfig], limit: int | None = None,
                     batch_size: int | str = 8, num_fewshot: int | None = None, task_manager: Any = None,
                     seed: int = DEFAULT_SEED, bootstrap_iters: int = 1000, chunk: int = 16, supply=None,
                     sparsity: Sequence | None = None, seconds: Sequence | None = None) -> list[dict]:
    """:func:`countdown.eval.lmeval.evaluate` of one task for every configuration, prompts computed once.

    Returns one dict per configuration, as ``evaluate`` returns, plus ``"samples"``: the per-document
    outcomes ``[(doc_id, {metric: value})]`` in document order (for paired significance tests), and
    ``"seconds"``: the shared scoring time divided evenly among the configurations plus its own
    replay.

    supply / sparsity / seconds: answers scored elsewhere (see :class:`SharedPromptLM`), with each
    configuration's Sparsity-Real and seconds as measured there (they replace this run's).
    """
    import lm_eval

    if task_manager is None:
        from .tasks import task_manager as offline_task_manager

        task_manager = offline_task_manager([task])
    lm = SharedPromptLM(model, tokenizer, configs, batch_size=batch_size, chunk=chunk)
    lm.supply = supply
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
            "sparsity_real": (None if config.is_dense else
                              lm.sparsity_real(index) if sparsity is None else sparsity[index]),
            "seconds": shared + replay[index] if seconds is None else seconds[index],
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
