"""``python -m countdown.eval.offline.device``: score a job's requests on this machine (the GPU).

Needs torch, transformers, numpy and the ``gguf`` package (for :mod:`countdown.eval.offline.weights`);
not lm-eval, datasets or a tokenizer. For every task of the job and every configuration not yet in
``--out``, :func:`countdown.eval.scoring.score_requests` computes each request's log-likelihood and
greediness and the Sparsity-Real counts, and the scores file is rewritten atomically after each task,
so a call stopped by its time limit keeps what it finished and ``--out`` resumes it. ``--stop-after``
seconds: no task is started after that time (keep it well inside the machine's per-call limit).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from pathlib import Path

import torch

from ...artifacts.store import load_artifacts
from ..scoring import EvalConfig, score_requests
from .files import (artifact_identity, empty_scores, job_digest, read_job, read_scores, restore_shadows,
                    task_entry, write_gz_json)
from .weights import build_model

LOGITS_BYTES = 6 << 30  # bytes of logits + log-softmax a continuation batch may hold


def load_configs(job: dict, artifacts_dir: Path, model=None) -> dict[str, EvalConfig]:
    """``{config key: EvalConfig}`` of the job, SP-Prac artifacts loaded (shadows rebuilt from
    ``model``) and checked against the identity the CPU recorded (a ValueError names a file that differs)."""
    loaded, out = {}, {}
    for c in job["configs"]:
        art = None
        if c["artifacts"]:
            name = c["artifacts"]["file"]
            if name not in loaded:
                loaded[name] = restore_shadows(load_artifacts(artifacts_dir / name), model)
            art = loaded[name]
            if artifact_identity(art, job["sparsities"]) != c["artifacts"]["identity"]:
                raise ValueError(f"{name} is not the SP-Prac artifact the job was made with ({c['key']})")
        out[c["key"]] = EvalConfig(c["registry"], c["mode"] or "ideal", c["sparsity"], art)
    return out


def score_job(model, job: dict, configs: dict[str, EvalConfig], scores: dict, out: Path, chunk: int,
              batch_tokens: int, stop_after: float | None, log=print) -> dict:
    """Score every (task, configuration) of ``job`` missing from ``scores``; write ``out`` after each task."""
    started = time.perf_counter()
    for task, spec in job["tasks"].items():
        done = scores["tasks"].setdefault(task, {})
        keys = [k for k in configs if k not in done]
        if not keys:
            continue
        if stop_after is not None and time.perf_counter() - started > stop_after:
            log(f"stopping before {task}: {stop_after:.0f} s passed; run again with the same --out to go on")
            break
        requests = [(c, k) for c, k in spec["requests"]]
        seconds = [0.0] * (len(keys) + 1)
        results, real = score_requests(model, requests, [configs[k] for k in keys], job["max_length"],
                                       chunk=chunk, pad_id=job["pad_id"], batch_tokens=batch_tokens,
                                       prompt_tokens=batch_tokens, seconds=seconds)
        for j, key in enumerate(keys):
            done[key] = task_entry(results[j], real[j], seconds[j + 1], seconds[0] / len(keys))
        write_gz_json(out, scores)
        log(f"{task}: {len(requests)} requests x {len(keys)} configurations; dense prompts {seconds[0]:.1f} s, "
            f"configurations {sum(seconds[1:]):.1f} s ({sum(seconds[1:]) / len(keys):.2f} s each)")
    return scores


def _parser() -> argparse.ArgumentParser:
    from ...options import Parser, add_number, path_option

    p = Parser(prog="python -m countdown.eval.offline.device", description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True, help="<model>.job.json.gz from `countdown sweep --export`")
    p.add_argument("--weights", required=True, help="weights pack (countdown.eval.offline.weights)")
    p.add_argument("--config-dir", required=True, help="folder with the model's config.json")
    p.add_argument("--artifacts-dir", default=None, type=path_option, help="folder of the job's artifact files (default: beside --job)")
    p.add_argument("--out", required=True, type=path_option, help="scores file to write (and to resume, if it exists)")
    p.add_argument("--device", default="cuda")
    add_number(p, "--chunk", range="chunk", default=512, help="prompts whose KV caches are held at once (default 512)")
    add_number(p, "--batch-tokens", range="batch_tokens", default=None,
               help=f"tokens per batch (default: {LOGITS_BYTES >> 30} GiB of logits and log-softmax)")
    add_number(p, "--stop-after", range="wait", default=None,
               help="start no task after this many seconds (default: none)")
    add_number(p, "--threads", range="threads", default=8, help="threads that de-quantize the weights")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as on the CPU reference
    torch.backends.cudnn.allow_tf32 = False
    job = read_job(args.job)
    out = Path(args.out)
    scores = read_scores(out) if out.exists() else empty_scores(job)
    if scores["job_sha256"] != job_digest(job):
        print(f"{out} holds scores of another job: move it aside or pass another --out", file=sys.stderr)
        return 2
    artifacts_dir = Path(args.artifacts_dir) if args.artifacts_dir else Path(args.job).parent
    model = build_model(args.config_dir, args.weights, args.device, args.threads)
    loaded = time.perf_counter() - start
    configs = load_configs(job, artifacts_dir, model)
    vocab = model.get_output_embeddings().weight.shape[0]
    batch_tokens = args.batch_tokens or max(256, LOGITS_BYTES // (vocab * 4 * 2))
    device = torch.cuda.get_device_name() if str(args.device).startswith("cuda") else str(args.device)
    print(f"{job['model']}: weights checked and loaded in {loaded:.1f} s on {device}; {len(configs)} configurations, "
          f"{len(job['tasks'])} tasks, batches of {batch_tokens} tokens", flush=True)
    tick = time.perf_counter()
    score_job(model, job, configs, scores, out, args.chunk, batch_tokens, args.stop_after,
              log=lambda s: print(s, flush=True))
    scores["runs"].append({"date": _dt.date.today().isoformat(), "device": device, "torch": torch.__version__,
                           "load_seconds": round(loaded, 1), "score_seconds": round(time.perf_counter() - tick, 1),
                           "host": os.uname().nodename})
    write_gz_json(out, scores)
    missing = [(t, k) for t in job["tasks"] for k in configs if k not in scores["tasks"].get(t, {})]
    print(f"wrote {out}: {sum(len(v) for v in scores['tasks'].values())} (task, configuration) scores"
          + (f"; {len(missing)} still missing" if missing else ", complete"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
