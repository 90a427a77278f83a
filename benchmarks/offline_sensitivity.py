"""How far the CPU path moves against itself when only its batch layout changes, beside the GPU's difference.

The first ``--requests`` requests of each task of an exported job, scored twice here (the default
batches, then one prompt per chunk and 64-token batches) and compared with each other and with a
scores file from the GPU; prints Markdown rows (the table in ``results/quality/<model>-gpu-vs-cpu.md``)::

    PYTHONPATH=src python benchmarks/offline_sensitivity.py --model smollm2-135m --job JOB \\
        --scores results/quality/smollm2-135m.scores.json.gz --tasks piqa,hellaswag \\
        --configs 'dense||,mono|ideal|0.8,dual|prac|0.8,cats|prac|0.8'
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import countdown
from countdown.eval.offline.device import load_configs
from countdown.eval.offline.files import read_job, read_scores
from countdown.eval.scoring import score_requests


def _stats(a, b) -> str:
    d = np.abs(np.array(a) - np.array(b))
    return f"median {np.median(d):.1e}, within 1e-3 {np.mean(d <= 1e-3):.2f}, max {d.max():.2g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("--model", "--job", "--scores", "--tasks", "--configs"):
        p.add_argument(name, required=True)
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args()
    model, _ = countdown.load_model(args.model)
    job, gpu = read_job(args.job), read_scores(args.scores)
    configs = load_configs(job, Path(args.job).parent, model)  # the job's own artifact files
    keys = args.configs.split(",")
    for task in args.tasks.split(","):
        reqs = [(c, k) for c, k in job["tasks"][task]["requests"][:args.requests]]
        a, _ = score_requests(model, reqs, [configs[k] for k in keys], job["max_length"], pad_id=job["pad_id"])
        b, _ = score_requests(model, reqs, [configs[k] for k in keys], job["max_length"], pad_id=job["pad_id"],
                              chunk=1, batch_tokens=64)
        for j, key in enumerate(keys):
            x, y = [v for v, _ in a[j]], [v for v, _ in b[j]]
            g = gpu["tasks"][task][key]["logp"][:len(x)]
            print(f"| {task} | {key.replace('|', ' ').strip()} | {_stats(x, y)} | {_stats(x, g)} |", flush=True)


if __name__ == "__main__":
    main()
