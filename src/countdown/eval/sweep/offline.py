"""The sweep's lm-eval cells scored on another machine: export a job here, replay its scores here.

``countdown sweep ... --export DIR`` writes ``DIR/<model>.job.json.gz`` (every pending lm-eval
configuration of the plan, each task's log-likelihood requests as token ids, exactly as lm-eval asks
this model for them) and the SP-Prac artifacts they use, trimmed to the sweep's k. A machine with
torch and transformers only (the GPU) scores it with ``python -m countdown.eval.offline.device``.
``countdown sweep ... --scores FILE`` (the same sweep arguments) then runs lm-eval here as usual, but
each configuration's answers come from the file (checked: the same requests in the same order, the
same SP-Prac artifacts), so acc / acc_norm / stderr / per-document outcomes are lm-eval's own, and
the CSV, side file and report are the sweep's usual ones. A cell's ``seconds`` is then the time the
other machine spent scoring it (its continuation passes plus an even share of the task's dense prompt
pass), not the CPU's replay.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Sequence

from ..offline.files import (JOB_FORMAT, answers, artifact_identity, config_key, read_scores, requests_digest,
                             strip_shadows, trim_artifacts, write_gz_json)
from .cells import CellSpec
from .measure import task_rows

PLACEHOLDER = (0.0, False)


def record_requests(model, tokenizer, task: str, limit, num_fewshot, task_manager, batch_size=8) -> list:
    """The log-likelihood requests lm-eval makes of ``model`` for ``task``: ``[(context ids,
    continuation ids)]`` in the order it asks, duplicates once."""
    from ..shared_prompt import EvalConfig, evaluate_configs

    recorded: list = []

    def supply(keys):
        recorded.extend(keys)
        return [[PLACEHOLDER] for _ in keys]

    evaluate_configs(model, tokenizer, task, [EvalConfig("dense")], limit=limit, batch_size=batch_size,
                     num_fewshot=num_fewshot, task_manager=task_manager, supply=supply, bootstrap_iters=0)
    return recorded


def _file_name(label: str, method: str) -> str:
    return f"{label}-{re.sub(r'[^A-Za-z0-9._-]+', '_', method).strip('_')}.safetensors"


def export_job(out_dir, label: str, model, tokenizer, cells: Sequence[CellSpec], tasks: Sequence[str],
               sparsities: Sequence[float], artifacts_for: Callable, methods: dict[str, str], limit, num_fewshot,
               task_manager, batch_size: int, command: str, log=print) -> Path:
    """Write ``<out_dir>/<label>.job.json.gz`` and the artifact files of the prac ``cells``; returns the job path."""
    from ..lmeval import CountdownLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = CountdownLM(pretrained=model, tokenizer=tokenizer, method=None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    configs, seen, files = [], set(), {}
    for cell in cells:
        key = config_key(cell.method, cell.mode, cell.sparsity)
        if key in seen:
            continue
        seen.add(key)
        art = None
        if cell.mode == "prac":
            if cell.method not in files:
                full = artifacts_for(cell)
                name = _file_name(label, cell.method)
                # shadows are rebuilt from the weights on the other machine: they need not travel
                strip_shadows(trim_artifacts(full, sparsities)).save(out / name, force=True)
                files[cell.method] = {"file": name, "identity": artifact_identity(full, sparsities)}
            art = files[cell.method]
        configs.append({"key": key, "method": cell.method, "registry": methods[cell.method], "mode": cell.mode,
                        "sparsity": cell.sparsity, "artifacts": art})
    job = {"format": JOB_FORMAT, "version": 1, "model": label, "max_length": int(lm.max_length), "pad_id": int(pad),
           "limit": limit, "num_fewshot": num_fewshot, "sparsities": list(sparsities), "command": command,
           "configs": configs, "tasks": {}}
    for task in tasks:
        requests = record_requests(model, tokenizer, task, limit, num_fewshot, task_manager, batch_size)
        pairs = [[list(c), list(k)] for c, k in requests]
        job["tasks"][task] = {"requests": pairs, "sha256": requests_digest(pairs)}
        longest = max(len(c) + len(k) for c, k in pairs)
        log(f"  {task}: {len(pairs)} requests, {sum(len(c) + len(k) for c, k in pairs)} tokens, longest {longest}")
    path = write_gz_json(out / f"{label}.job.json.gz", job)
    log(f"wrote {path}: {len(configs)} configurations x {len(job['tasks'])} tasks; artifacts "
        + (", ".join(f["file"] for f in files.values()) or "none"))
    return path


class Scores:
    """A scores file from the other machine, checked against what this sweep would compute."""

    def __init__(self, paths: Sequence[str], label: str):
        self.data = [read_scores(p) for p in paths]
        mine = [d for d in self.data if d["model"] == label]
        if not mine:
            raise ValueError(f"none of the scores files {', '.join(map(str, paths))} is of model {label!r} "
                             f"(they hold {', '.join(sorted({d['model'] for d in self.data}))})")
        self.data = mine
        self.paths = list(paths)

    def entry(self, task: str, key: str) -> dict | None:
        for d in self.data:
            hit = d["tasks"].get(task, {}).get(key)
            if hit is not None:
                return hit
        return None

    def identity(self, key: str) -> str | None:
        for d in self.data:
            for c in d.get("configs", []):
                if c["key"] == key:
                    return (c.get("artifacts") or {}).get("identity")
        return None

    def digest(self, task: str) -> str | None:
        for d in self.data:
            if task in d["requests_sha256"]:
                return d["requests_sha256"][task]
        return None

    def devices(self) -> str:
        names = sorted({r.get("device", "?") for d in self.data for r in d.get("runs", [])})
        return ", ".join(f"GPU: {n}" for n in names) or "another machine"

    def has(self, task: str, cell: CellSpec) -> bool:
        return self.entry(task, config_key(cell.method, cell.mode, cell.sparsity)) is not None


def replay_task(model, tokenizer, task: str, cells: Sequence[CellSpec], methods: dict[str, str],
                artifacts: dict[str, Any], sparsities: Sequence[float], scores: Scores, limit, batch_size,
                num_fewshot, task_manager) -> list[dict]:
    """Every cell of one lm-eval task from ``scores``, through lm-eval's metrics; the same dicts as
    :func:`countdown.eval.sweep.measure.measure_task_shared`."""
    from ..shared_prompt import EvalConfig, evaluate_configs

    keys = [config_key(c.method, c.mode, c.sparsity) for c in cells]
    entries = []
    for cell, key in zip(cells, keys):
        entry = scores.entry(task, key)
        if entry is None:
            raise ValueError(f"{task} / {key} is not in {', '.join(scores.paths)}: score it on the GPU "
                             "(python -m countdown.eval.offline.device with the exported job), or run without --scores")
        if cell.mode == "prac":
            mine = artifact_identity(artifacts[cell.method], sparsities)
            if scores.identity(key) != mine:
                raise ValueError(f"{key} was scored with other SP-Prac artifacts than this machine has for "
                                 f"{cell.method}: export the job again and re-score it")
        entries.append(answers(entry))

    def supply(missing):
        if requests_digest([[list(c), list(k)] for c, k in missing]) != scores.digest(task):
            raise ValueError(f"lm-eval asks other {task} requests than the scored job holds (another limit, "
                             "few-shot setting, tokenizer or lm-eval version?): export and score the job again")
        return [[e[j] for e in entries] for j in range(len(missing))]

    configs = [EvalConfig(methods[c.method], c.mode or "ideal", c.sparsity, None) for c in cells]
    got = [scores.entry(task, k) for k in keys]
    results = evaluate_configs(model, tokenizer, task, configs, limit=limit, batch_size=batch_size,
                               num_fewshot=num_fewshot, task_manager=task_manager, supply=supply,
                               sparsity=[g["sparsity_real"] for g in got],
                               seconds=[g["seconds"] + g["prompt_seconds"] for g in got])
    return task_rows(cells, results, task)
