"""Measuring cells: lm-eval tasks (all configurations of a task in one shared-prompt pass),
perplexity in both styles, agreement with dense; and the SP-Prac artifacts they need."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from ..agreement import agreement
from ..grid import STYLES
from ..perplexity import perplexity
from ...patch.sparsify import reset_sparsity_stats, sparsify, sparsity_real, unsparsify, with_mode
from ...spec import Spec
from .cells import AGREEMENT_METRICS, PPL_TASKS, CellSpec, format_k

DEFAULT_CHUNK = 16  # prompts per shared batch (countdown.eval.shared_prompt.score_requests)
# configurations per shared pass: more share each prompt's forward; fewer lose less to an interruption
DEFAULT_PASS_CONFIGS = 12


def is_generation_task(task_manager, task: str) -> bool:
    """True when lm-eval scores ``task`` by generating (gsm8k): its prompts cannot be shared."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(task_manager.task_index[task].yaml_path)
    except Exception:  # unreadable here: lm-eval will say what is wrong when it runs the task
        return False
    return config.get("output_type") == "generate_until"


def measure_lmeval(model, tokenizer, cell: CellSpec, method: str, artifacts, limit, batch_size, num_fewshot,
                   task_manager) -> dict:
    """One lm-eval cell on its own (generation tasks): ``{"metrics", "real", "n", "samples", "seconds"}``."""
    from ..lmeval import evaluate  # lm-eval is slow to import: only when a task cell runs

    start = time.perf_counter()
    res = evaluate(model, tokenizer, [cell.task], limit=limit, method=method, sparsity=cell.sparsity,
                   mode=cell.mode or "ideal", artifacts=artifacts, batch_size=batch_size,
                   num_fewshot=num_fewshot, task_manager=task_manager)
    if cell.task not in res["tasks"]:
        raise RuntimeError(f"lm-eval returned no results for task {cell.task!r} (got {sorted(res['tasks'])})")
    real = 0.0 if method == "dense" else res["sparsity_real"]
    return {"metrics": sorted(res["tasks"][cell.task].items()), "real": real,
            "n": res["n_samples"].get(cell.task, ""), "samples": None, "seconds": time.perf_counter() - start}


def measure_task_shared(model, tokenizer, task: str, cells: Sequence[CellSpec], methods: dict[str, str],
                        artifacts: dict[str, Any], limit, batch_size, num_fewshot, task_manager,
                        chunk: int = DEFAULT_CHUNK) -> list[dict]:
    """Every cell of one lm-eval task in one pass (:func:`countdown.eval.shared_prompt.evaluate_configs`).

    methods: cell label -> registry method; artifacts: cell label -> SP-Prac artifacts (prac cells).
    Returns one dict per cell as :func:`measure_lmeval`, with ``samples`` the per-document outcomes.
    """
    from ..shared_prompt import EvalConfig, evaluate_configs

    configs = [EvalConfig(methods[c.method], c.mode or "ideal", c.sparsity,
                          artifacts.get(c.method) if c.mode == "prac" else None) for c in cells]
    results = evaluate_configs(model, tokenizer, task, configs, limit=limit, batch_size=batch_size,
                               num_fewshot=num_fewshot, task_manager=task_manager, chunk=chunk)
    return task_rows(cells, results, task)


def task_rows(cells, results: list[dict], task: str) -> list[dict]:
    """One row of metrics per cell from lm-eval's results for ``task`` (shared with the offline scorer)."""
    out = []
    for cell, res in zip(cells, results):
        if task not in res["tasks"]:
            raise RuntimeError(f"lm-eval returned no results for task {task!r} (got {sorted(res['tasks'])})")
        out.append({"metrics": sorted(res["tasks"][task].items()),
                    "real": 0.0 if not cell.mode else res["sparsity_real"],  # dense, dense@weights
                    "n": res["n_samples"].get(task, ""), "samples": res["samples"], "seconds": res["seconds"]})
    return out


def measure_ppl(model, tokenizer, cell: CellSpec, method: str, artifacts, texts, tokens, window, progress) -> dict:
    """Perplexity in the cell's style: the same sparsify -> perplexity -> unsparsify as demo.run_grid."""
    style = PPL_TASKS[cell.task]
    start = time.perf_counter()
    if method == "dense":
        ppl = perplexity(model, tokenizer, texts, max_tokens=tokens, window=window,
                         prompt_fraction=STYLES[style], progress=progress, desc=cell.label())
        return {"metrics": [("perplexity", ppl)], "real": 0.0, "n": tokens, "samples": None,
                "seconds": time.perf_counter() - start}
    sparsify(model, with_mode(method, cell.mode, artifacts), cell.sparsity, scope="all" if style == "all" else "decode",
             artifacts=artifacts, path="masked")
    try:
        reset_sparsity_stats(model)
        ppl = perplexity(model, tokenizer, texts, max_tokens=tokens, window=window,
                         prompt_fraction=STYLES[style], progress=progress, desc=cell.label())
        real = sparsity_real(model)["mean"]
    finally:
        unsparsify(model)
    return {"metrics": [("perplexity", ppl)], "real": real, "n": tokens, "samples": None,
            "seconds": time.perf_counter() - start}


def measure_agreement(model, tokenizer, cell: CellSpec, method: str, artifacts, prompts, max_new_tokens) -> dict:
    start = time.perf_counter()
    res = agreement(model, tokenizer, method, cell.sparsity, mode=cell.mode, artifacts=artifacts,
                    prompts=prompts, max_new_tokens=max_new_tokens)
    return {"metrics": [(m, res[m]) for m in AGREEMENT_METRICS], "real": res["sparsity_real"],
            "n": res["n_prompts"], "samples": None, "seconds": time.perf_counter() - start}


def ensure_prac(model, tokenizer, spec: Spec, sparsities, artifacts_dir, options: dict | None, progress,
                log: Callable[[str], None]):
    """The SP-Prac artifacts of one method spec for every k (built once, cached in ``artifacts_dir``; the
    spec's kind and options key the file, an option at its default as if left out)."""
    from ...artifacts.prepare import prepare

    if artifacts_dir is None:
        from ...data.texts import cache_root

        artifacts_dir = cache_root() / "artifacts"
    log(f"  SP-Prac artifacts for {spec.resolved().label} (k = {', '.join(format_k(k) for k in sparsities)}) "
        f"from {artifacts_dir} (built and cached on first use)")
    return prepare(model, tokenizer, spec, list(sparsities), cache_dir=artifacts_dir,
                   **{"progress": progress, **(options or {})})


def artifact_summary(art, tag: str) -> dict:
    meta = art.meta
    return {"kind": meta.get("kind"), "selection": meta.get("selection"), "d_rank": meta.get("d_rank"),
            "data": meta.get("data"), "sparsities": meta.get("sparsities"), "options_tag": tag,
            "rule": meta.get("rule"), "training": meta.get("training")}
