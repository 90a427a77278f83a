"""Speed of the shared-prompt lm-eval path against one lm-eval run per configuration, outputs compared.

    PYTHONPATH=src python benchmarks/shared_prompt.py --model smollm2-135m --task arc_easy --limit 20 \
        --configs dense,mono:0.8,dual:0.8,cats:0.8 --threads 1

Prints, per configuration, the old and new score and seconds, whether every per-document outcome is
equal, the largest per-request log-likelihood difference, then the speed-up per cell (seconds per
document per configuration, old / new).

Its result is recorded in docs/sweep.md (the shared-prompt section: scores equal on arc_easy at
``--limit 50``, per-request log-likelihoods within 4e-5 but for one SP-Ideal boundary flip); it writes no
file, and the exact command line of that run was not recorded.
"""

import argparse
import json
import time

import torch

from countdown.eval.lmeval import CountdownLM, evaluate
from countdown.data.models import load_model
from countdown.eval.shared_prompt import EvalConfig, evaluate_configs, score_requests
from countdown.eval.tasks import task_manager


def parse_configs(text):
    out = []
    for part in text.split(","):
        method, _, k = part.partition(":")
        out.append(EvalConfig(method, "ideal", float(k) if k else None))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="arc_easy")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--configs", default="dense,mono:0.8,dual:0.8,cats:0.8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check-docs", type=int, default=20, help="documents whose per-request log-likelihoods are compared")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    configs = parse_configs(args.configs)
    manager = task_manager([args.task])

    old, old_cpu = [], 0.0
    for cfg in configs:
        start, cpu = time.perf_counter(), time.process_time()
        res = evaluate(model, tok, [args.task], limit=args.limit, method=cfg.method, sparsity=cfg.sparsity,
                       mode=cfg.mode, task_manager=manager)
        old.append((res, time.perf_counter() - start))
        old_cpu += time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    new = evaluate_configs(model, tok, args.task, configs, limit=args.limit, task_manager=manager)
    new_total, new_cpu = time.perf_counter() - start, time.process_time() - cpu

    # per-request log-likelihoods: the old adapter against score_requests on the task's requests
    lm = CountdownLM(pretrained=model, tokenizer=tok, method=None)
    from lm_eval.tasks import get_task_dict

    task = get_task_dict([args.task], manager)[args.task]
    task.build_all_requests(limit=min(args.limit, args.check_docs), rank=0, world_size=1)
    requests = [lm._encode_pair(*inst.args) for inst in task.instances]
    shared, _ = score_requests(model, requests, configs, lm.max_length)
    diffs = []
    for c, cfg in enumerate(configs):
        ref = CountdownLM(pretrained=model, tokenizer=tok, method=cfg.method, sparsity=cfg.sparsity)
        try:
            answers = ref._loglikelihood_tokens([(None, a, b) for a, b in requests], disable_tqdm=True)
        finally:
            ref.restore()
        diffs.append((max(abs(a[0] - b[0]) for a, b in zip(answers, shared[c])),
                      sum(a[1] != b[1] for a, b in zip(answers, shared[c]))))

    n = args.limit
    rows = []
    print(f"\n{args.model} {args.task} limit {n}, {len(requests)} requests, torch threads {torch.get_num_threads()}")
    print("| config | old score | new score | old s/doc | new s/doc (shared) | max |dll| | greedy flips |")
    print("|---|---|---|---|---|---|---|")
    for cfg, (res, secs), nres, (d, flips) in zip(configs, old, new, diffs):
        metric = "acc_norm" if "acc_norm" in res["tasks"][args.task] else "acc"
        a, b = res["tasks"][args.task][metric], nres["tasks"][args.task][metric]
        label = cfg.method + ("" if cfg.sparsity is None else f" k={cfg.sparsity:g}")
        rows.append({"config": label, "old": a, "new": b, "old_s": secs, "new_s": nres["seconds"], "dll": d})
        print(f"| {label} | {a:.4f} | {b:.4f} | {secs / n:.3f} | {nres['seconds'] / n:.3f} | {d:.2e} | {flips} |")
    old_total = sum(s for _, s in old)
    print(f"\nall {len(configs)} configurations: old {old_total:.1f} s wall / {old_cpu:.1f} s CPU, new {new_total:.1f} s "
          f"wall / {new_cpu:.1f} s CPU: {old_total / new_total:.1f}x (wall), {old_cpu / new_cpu:.1f}x (CPU) less per cell; "
          f"per-request log-likelihoods compared on the first {min(n, args.check_docs)} documents")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "old_total": old_total, "new_total": new_total, "old_cpu": old_cpu,
                       "new_cpu": new_cpu}, fh, indent=1)


if __name__ == "__main__":
    main()
