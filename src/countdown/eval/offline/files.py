"""The two files between the CPU and the GPU: a *job* (requests and configurations) and its *scores*.

A job (``<model>.job.json.gz``) is written on the CPU by ``countdown sweep --export``: lm-eval's
log-likelihood requests of every task as token ids (what :class:`countdown.eval.lmeval.CountdownLM` would
score), the model's ``max_length`` and pad id, and the configurations to score, each with the
SP-Prac artifact file it uses (trimmed to the sweep's k, :func:`trim_artifacts`) and that artifact's
identity (:func:`artifact_identity`). Scores (``<model>.scores.json.gz``) come back from the GPU
(:mod:`countdown.eval.offline.device`): per task and configuration, each request's log-likelihood and
whether it is greedy, the Sparsity-Real over the task's sparse positions and the seconds spent.
``countdown sweep --scores`` replays them through lm-eval's metrics.

Both are gzip'd JSON written atomically; nothing here imports lm-eval or datasets.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

JOB_FORMAT = "countdown-offline-job"
SCORES_FORMAT = "countdown-offline-scores"


def config_key(method: str, mode: str, sparsity) -> str:
    """``"mono|ideal|0.7"``, ``"dual[hybrid]|prac|0.8"``, ``"dense||"``: a configuration as the
    sweep's CSV spells it (method label, mode, k)."""
    k = "" if sparsity is None else f"{float(sparsity):g}"
    return f"{method}|{mode or ''}|{k}"


def requests_digest(requests: Sequence) -> str:
    """sha256 of a task's request list ``[[context ids], [continuation ids]]``: the same documents,
    prompts and tokenizer give the same digest."""
    text = json.dumps([[list(c), list(k)] for c, k in requests], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write_gz_json(path: str | os.PathLike, data: dict) -> Path:
    from ...io import atomic_path

    path = Path(path)
    with atomic_path(path, suffix=".gz") as tmp:
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as fh:
            json.dump(data, fh, separators=(",", ":"))
    return path


def read_gz_json(path: str | os.PathLike, fmt: str) -> dict:
    """A job or scores file; a ValueError names the file when it is something else or damaged."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, EOFError) as err:
        raise ValueError(f"{path} is not a readable countdown {fmt} file ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise ValueError(f"{path} is not a countdown {fmt} file (format {data.get('format') if isinstance(data, dict) else None!r})")
    return data


def read_job(path) -> dict:
    return read_gz_json(path, JOB_FORMAT)


def read_scores(path) -> dict:
    return read_gz_json(path, SCORES_FORMAT)


# ------------------------------------------------------------------------------------------------
# SP-Prac artifacts that travel: only the k a sweep scores, identified by content
# ------------------------------------------------------------------------------------------------


def trim_artifacts(art, ks: Sequence[float]):
    """A copy of ``art`` holding only the sparsities ``ks`` (each must be in it): per-k tensors of the
    other k dropped, a threshold table cut to the rows of ``ks``. Selectors built from the copy at
    any of ``ks`` equal those built from ``art``."""
    from ...artifacts.store import Artifacts, sparsity_key

    keep = [art.sparsity_index(k) for k in ks]
    kept_keys = {sparsity_key(art.sparsities[i]) for i in keep}
    tensors = {}
    for name, t in art.tensors.items():
        if name == "thresholds":
            tensors[name] = t[keep].clone()
        elif name.startswith("k="):
            if name.split("/", 1)[0] in kept_keys:
                tensors[name] = t
        else:
            tensors[name] = t
    meta = json.loads(json.dumps(art.meta))
    meta["sparsities"] = [art.sparsities[i] for i in keep]
    return Artifacts(meta, tensors)


def strip_shadows(art):
    """A shadow artifact without its low-bit copies of W_gate / W_up (``shared/`` tensors): they are a
    function of the model's weights, rebuilt where the model is (:func:`restore_shadows`), so they
    need not travel. Other kinds are returned as they are."""
    from ...artifacts.store import Artifacts

    if art.kind != "shadow":
        return art
    return Artifacts(json.loads(json.dumps(art.meta)), {n: t for n, t in art.tensors.items()
                                                         if not n.startswith("shared/")})


def restore_shadows(art, model):
    """The shadow tensors of ``art`` rebuilt from ``model``'s Gated-MLPs as the shadow kind builds them
    (round-to-nearest of each weight, :func:`countdown.kernels.shadow.format.quantize_rtn`), on the weights'
    device; the caller checks the result with :func:`artifact_identity`."""
    from ...artifacts.store import Artifacts
    from ...kernels.shadow.format import pack_bits, quantize_rtn
    from ...model.gated_mlp import require_gated_mlps

    if art.kind != "shadow" or any(n.startswith("shared/") for n in art.tensors):
        return art
    bits, group = art.meta["bits"], art.meta["group"]
    tensors = dict(art.tensors)
    for i, mlp in enumerate(require_gated_mlps(model)):
        for name, w in (("gate", mlp.w_gate), ("up", mlp.w_up)):
            q, scale = quantize_rtn(w.detach().float().cpu(), bits, group)  # on the CPU, as it was built
            tensors[f"shared/layer{i}/{name}_q"] = pack_bits(q, bits).cpu()
            tensors[f"shared/layer{i}/{name}_scale"] = scale.cpu()
    return Artifacts(art.meta, tensors)


def artifact_identity(art, ks: Sequence[float]) -> str:
    """The checksum of ``art`` trimmed to ``ks``: equal on both machines exactly when the GPU scored
    with the tensors the CPU sweep would use."""
    from ...artifacts.store import artifact_checksum

    trimmed = trim_artifacts(art, ks)
    return artifact_checksum(trimmed.meta, trimmed.tensors)


# ------------------------------------------------------------------------------------------------
# Scores: merged task by task, so an interrupted GPU call still returns what it finished
# ------------------------------------------------------------------------------------------------


def empty_scores(job: dict) -> dict:
    return {"format": SCORES_FORMAT, "version": 1, "model": job["model"], "job_sha256": job_digest(job),
            "requests_sha256": {t: v["sha256"] for t, v in job["tasks"].items()}, "configs": job["configs"],
            "tasks": {}, "runs": []}


def job_digest(job: dict) -> str:
    text = json.dumps({k: job[k] for k in ("model", "max_length", "pad_id", "configs")}, sort_keys=True)
    text += "".join(f"{t}:{job['tasks'][t]['sha256']}" for t in sorted(job["tasks"]))
    return hashlib.sha256(text.encode()).hexdigest()


def task_entry(results, sparsity, seconds: float, prompt_seconds: float) -> dict:
    """One (task, configuration) of a scores file: log-likelihoods (``%.9g`` text is not needed: JSON
    floats keep every bit), greedy flags as a ``"0110"`` string, Sparsity-Real, seconds."""
    return {"logp": [float(lp) for lp, _ in results], "greedy": "".join("1" if g else "0" for _, g in results),
            "sparsity_real": sparsity, "seconds": seconds, "prompt_seconds": prompt_seconds}


def answers(entry: dict) -> list[tuple[float, bool]]:
    """``[(log-likelihood, is_greedy)]`` of one task entry, in the job's request order."""
    if len(entry["logp"]) != len(entry["greedy"]):
        raise ValueError("a scores entry has as many log-likelihoods as greedy flags; this one does not")
    return [(float(lp), g == "1") for lp, g in zip(entry["logp"], entry["greedy"])]
