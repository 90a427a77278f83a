"""GPU scores against the CPU reference, request by request and cell by cell.

Request level: the first ``--requests`` requests of each task of the job are scored here on the CPU
(:func:`countdown.eval.scoring.score_requests`, the sweep's own path) and compared with the scores file.
Cell level: the CPU sweep (``run_sweep``, no --scores) at ``--limit`` documents for the given configurations,
against the mean of the GPU-scored per-document outcomes of those same documents (the replayed
``<model>.docs.csv``). Writes a Markdown table::

    PYTHONPATH=src python benchmarks/offline_check.py --model smollm2-135m \\
        --job JOB --scores results/quality/smollm2-135m.scores.json.gz --docs results/quality/smollm2-135m.docs.csv \\
        --tasks arc_easy,hellaswag,piqa --configs 'dense||,mono|ideal|0.8,dual|prac|0.8,cats|prac|0.8' \\
        --limit 100 --requests 200 --out results/quality/smollm2-135m-gpu-vs-cpu.md

results/quality/smollm2-135m-gpu-vs-cpu.md (2026-11-23) came from that command (JOB: the exported
smollm2-135m.job.json.gz). Its last table (the CPU path against itself under another batch layout) came
from benchmarks/offline_sensitivity.py, deleted in issue 42 (last at commit 12e5c91).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import countdown
from countdown.io import atomic_write
from countdown.eval.offline.files import read_job, read_scores
from countdown.eval.offline.device import load_configs
from countdown.eval.scoring import score_requests
from countdown.eval.sweep import read_rows, run_sweep
from countdown.eval.sweep.store import DOC_FIELDS, decode_outcomes


def _shown(key: str) -> str:
    """``"mono|ideal|0.8"`` as a Markdown cell: ``mono ideal k=0.8``."""
    label, mode, k = key.split("|")
    return " ".join([label, mode] + ([f"k={k}"] if k else [])).replace("  ", " ").strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("--model", "--job", "--scores", "--docs", "--tasks", "--configs", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args()
    job, scores = read_job(args.job), read_scores(args.scores)
    tasks, keys = args.tasks.split(","), args.configs.split(",")
    model, tok = countdown.load_model(args.model)
    lines = [f"# GPU against CPU: {args.model}", "",
             f"{_dt.date.today().isoformat()}; CPU reference: this machine, fp32 (`python {' '.join(sys.argv)}`); "
             f"GPU: {', '.join(r['device'] for r in scores['runs'])}, fp32, TF32 off.", ""]
    # cell level: the CPU sweep on the first --limit documents
    with tempfile.TemporaryDirectory() as tmp:
        labels = sorted({k.split("|")[0] for k in keys})
        modes = sorted({k.split("|")[1] for k in keys if k.split("|")[1]})
        ks = sorted({float(k.split("|")[2]) for k in keys if k.split("|")[2]})
        start = time.perf_counter()
        res = run_sweep(args.model, methods=labels, modes=modes or ["ideal"], sparsities=ks, tasks=tasks,
                        limit=args.limit, out_dir=tmp, ppl_tokens=0, agreement_prompts=0, model=model,
                        tokenizer=tok, progress=False, log=lambda s: None)
        cpu_seconds = time.perf_counter() - start
        cpu = [r for r in read_rows(res["csv"]) if "|".join([r["method"], r["mode"], r["sparsity"]]) in keys]
    gpu_docs = {}
    for r in read_rows(args.docs, DOC_FIELDS):
        ids, values = decode_outcomes(r)
        gpu_docs[("|".join([r["method"], r["mode"], r["sparsity"]]), r["task"], r["metric"])] = dict(zip(ids, values))
    lines += [f"## Cells: the first {args.limit} documents of each task", "",
              "| task | configuration | metric | CPU | GPU | difference |", "|---|---|---|---|---|---|"]
    worst = 0.0
    for r in sorted(cpu, key=lambda r: (r["task"], r["method"], r["mode"], r["sparsity"], r["metric"])):
        key = "|".join([r["method"], r["mode"], r["sparsity"]])
        per = gpu_docs.get((key, r["task"], r["metric"]))
        if per is None or r["metric"].endswith("stderr"):
            continue
        gpu = float(np.mean([per[i] for i in range(args.limit) if i in per]))
        worst = max(worst, abs(gpu - float(r["value"])))
        lines.append(f"| {r['task']} | {_shown(key)} | {r['metric']} | {float(r['value']):.4f} | {gpu:.4f} | "
                     f"{gpu - float(r['value']):+.4f} |")
    lines += ["", f"Largest cell difference: {worst:.4f} (CPU sweep {cpu_seconds:.0f} s here).", ""]
    # request level, with the job's own artifact files (exactly what the GPU used)
    configs = load_configs(job, Path(args.job).parent, model)
    lines += [f"## Requests: the first {args.requests} of each task", "",
              "| task | configuration | requests | median abs diff of log p | share within 1e-3 | largest | greedy flips |",
              "|---|---|---|---|---|---|---|"]
    for task in tasks:
        reqs = [(c, k) for c, k in job["tasks"][task]["requests"][:args.requests]]
        out, _ = score_requests(model, reqs, [configs[k] for k in keys], job["max_length"], pad_id=job["pad_id"])
        for j, key in enumerate(keys):
            entry = scores["tasks"][task][key]
            d = np.abs(np.array([lp for lp, _ in out[j]]) - np.array(entry["logp"][:len(reqs)]))
            flips = sum(g != ("1" if o else "0") for (_, o), g in zip(out[j], entry["greedy"]))
            lines.append(f"| {task} | {_shown(key)} | {len(reqs)} | {np.median(d):.1e} | {np.mean(d <= 1e-3):.2f} | "
                         f"{d.max():.2g} | {flips} |")
    atomic_write(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
