"""Decode speed on the CPU: the real SmolLM2-135M, dense against patched (gather and masked paths).

    PYTHONPATH=src python benchmarks/decode_cpu.py --out results --repeats 3   # [--new-tokens 64]

results/decode_cpu.md / .csv (2-core CPU) came from that command (``--out benchmarks/results`` then); each
row prints its speed-up over dense (the median of paired ratios).

Batch 1, fp32, a 64-token prompt (the start of the first held-out XSum article), greedy, through
``countdown.decode.generate.generate_fast`` in eager mode (no compile on CPU: the same harness for every row).
Rows: dense; cats / mono / dual SP-Ideal with the ``gather`` path (only kept rows of W_gate / W_up /
W_down are read; cats and mono still read their dense indicator projection, dual reads both); mono
SP-Prac (calibrated thresholds) on ``gather`` and on ``masked`` (every projection dense, skipped rows
zeroed: the cost of sparsity without its savings). Per row, ``--repeats`` dense and patched runs
alternate, and each speed-up is the median of paired ratios, so a load
change on a shared machine hits both sides; still, re-run it on a quiet machine before trusting it.

Also printed: the share of per-token multiply-adds in the Gated-MLPs, and the ideal speed-up if the
MLP work fell in proportion to the rows skipped and nothing else cost anything.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time

import torch

import countdown
from countdown.decode.generate import generate_fast, reset_decoders
from countdown.model.gated_mlp import require_gated_mlps

COLUMNS = ["device", "date", "model", "threads", "method", "mode", "path", "sparsity", "sparsity_real", "batch",
           "new_tokens", "tokens_per_s", "ms_per_step", "dense_tokens_per_s", "speedup_vs_dense",
           "ideal_speedup", "runs_tokens_per_s"]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def macs_per_token(model) -> tuple[int, int]:
    """(all multiply-adds per decoded token, those in the Gated-MLPs), weights only (attention over the
    cache is small at these lengths)."""
    mlps = require_gated_mlps(model)
    mlp_ids = {id(p) for m in mlps for p in m.module.parameters()}
    emb = model.get_input_embeddings().weight
    total = mlp = 0
    for p in model.parameters():
        if p.dim() != 2 or (p is emb and model.get_output_embeddings().weight is not emb):
            continue  # norms are not matmuls; an untied embedding is a lookup
        total += p.numel()
        if id(p) in mlp_ids:
            mlp += p.numel()
    return total, mlp


def ideal_speedup(method: str, k: float, total: int, mlp: int) -> float:
    """Dense MACs over the MACs left if each Gated-MLP did only what the method must: its dense
    indicator projection (cats: W_gate, mono: W_up, dual SP-Ideal: both) plus the kept rows of the rest."""
    dense_parts = {"cats": 1, "mono": 1, "dual": 2}[method]
    left = total - mlp + mlp * (dense_parts + (3 - dense_parts) * (1 - k)) / 3
    return total / left


def timed_once(model, prompt, new_tokens: int) -> tuple[float, float]:
    generate_fast(model, prompt, 2, compile=False)  # warm-up: allocator, first-call overheads
    _, stats = generate_fast(model, prompt, new_tokens, compile=False)
    reset_decoders()
    return stats["tokens_per_s"], stats["ms_per_step"]


def op_probe_us(reps: int = 2000) -> float:
    """Microseconds per ``linear(1x576, 1536x576)`` (one SmolLM2 MLP projection): a load indicator. On a
    quiet core it is tens of microseconds; ten times that means other jobs are sharing the CPU."""
    x, w = torch.randn(1, 576), torch.randn(1536, 576)
    for _ in range(50):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - start) / reps * 1e6


def with_dense_row(rows: list, dense_runs: list) -> list:
    """The rows with a first row for dense: the median of every dense run (they alternate with patched ones)."""
    if not rows or not dense_runs:
        return rows
    first = rows[0]
    dense_tps = statistics.median(t for t, _ in dense_runs)
    dense = {**first, "method": "dense", "mode": "-", "path": "-", "sparsity": "", "sparsity_real": "",
             "tokens_per_s": round(dense_tps, 2), "ms_per_step": round(statistics.median(m for _, m in dense_runs), 2),
             "dense_tokens_per_s": round(dense_tps, 2), "speedup_vs_dense": 1.0, "ideal_speedup": 1.0,
             "runs_tokens_per_s": f"median of {len(dense_runs)} dense runs"}
    return [dense] + rows


def write_outputs(rows: list, args, info: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_cpu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"# Decode on the CPU: {args.model}", "",
             f"- device: {info['device']}; date: {info['date']}; torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; 1-minute load average when written: {load:.1f}; load probe: one "
             f"linear(1x576 by 1536x576) took {info['probe_us']:.0f} us (tens of us on a quiet core)",
             f"- command: `{info['command']}`",
             f"- batch 1, fp32, prompt {info['prompt']} tokens, {args.new_tokens} new tokens, greedy, eager "
             f"generate_fast. Dense and patched runs alternate ({args.repeats} pairs per row); tokens/s and "
             f"the speed-up are medians (the speed-up of the pairs). {info['total'] / 1e6:.1f} M multiply-adds "
             f"per token, {100 * info['mlp'] / info['total']:.0f}% in the Gated-MLPs. ideal = dense MACs / MACs "
             "left when each MLP does only its dense indicator projection and the kept rows.", "",
             "| method | mode | path | k | Sparsity-Real | tokens/s | ms/step | vs dense | ideal | "
             "pairs dense/patched (tok/s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['mode']} | {r['path']} | {r['sparsity'] or '-'} | "
                     f"{r['sparsity_real'] or '-'} | {float(r['tokens_per_s']):.1f} | {float(r['ms_per_step']):.2f} | "
                     f"{float(r['speedup_vs_dense']):.2f}x | {float(r['ideal_speedup']):.2f}x | {r['runs_tokens_per_s']} |")
    with open(os.path.join(args.out, "decode_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--ks", default="0.7,0.9")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.perf_counter()
    model, tok = countdown.load_model(args.model)
    model.generation_config.eos_token_id = None
    text = countdown.load_texts("xsum", limit=1)[0]
    prompt = tok(text, return_tensors="pt")["input_ids"][:, :args.prompt]
    ks = [float(k) for k in args.ks.split(",")]
    total, mlp = macs_per_token(model)
    device = f"{cpu_name()} ({os.cpu_count()} cores)"
    date = datetime.date.today().isoformat()
    print(f"{device}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model}: "
          f"{total / 1e6:.1f} M multiply-adds per token, {100 * mlp / total:.0f}% in the Gated-MLPs", flush=True)

    rows = []
    info = {"device": device, "date": date, "total": total, "mlp": mlp, "prompt": prompt.shape[1],
            "probe_us": op_probe_us(), "command": "PYTHONPATH=src python benchmarks/decode_cpu.py " + " ".join(sys.argv[1:])}
    print(f"probe: one linear(1x576 by 1536x576) takes {info['probe_us']:.0f} us (a quiet core: tens of us)", flush=True)

    def add(method, mode, path, k, real, pairs, ideal):
        ratios = [sparse / dense for dense, sparse, _ in pairs]
        rows.append({"device": device, "date": date, "model": args.model, "threads": torch.get_num_threads(),
                     "method": method, "mode": mode, "path": path, "sparsity": k,
                     "sparsity_real": round(real, 4), "batch": 1, "new_tokens": args.new_tokens,
                     "tokens_per_s": round(statistics.median(p[1] for p in pairs), 2),
                     "ms_per_step": round(statistics.median(p[2] for p in pairs), 2),
                     "dense_tokens_per_s": round(statistics.median(p[0] for p in pairs), 2),
                     "speedup_vs_dense": round(statistics.median(ratios), 3), "ideal_speedup": round(ideal, 3),
                     "runs_tokens_per_s": " ".join(f"{d:.1f}/{s_:.1f}" for d, s_, _ in pairs)})
        r = rows[-1]
        print(f"  {method:5s} {mode:5s} {path:6s} k={k:<4} {r['tokens_per_s']:7.1f} tok/s (dense beside it "
              f"{r['dense_tokens_per_s']:.1f}): {r['speedup_vs_dense']:.2f}x  pairs {r['runs_tokens_per_s']}", flush=True)

    def run_patched(method, mode, path, k, artifacts=None):
        """Dense and patched runs alternate (A B A B ...), so a load change on a shared machine hits
        both; the speed-up is the median of the paired ratios."""
        pairs = []
        for _ in range(args.repeats):
            dense_tps, dense_ms = timed_once(model, prompt, args.new_tokens)
            countdown.sparsify(model, method, k, mode=mode, path=path, artifacts=artifacts)
            try:
                countdown.reset_sparsity_stats(model)
                sparse_tps, sparse_ms = timed_once(model, prompt, args.new_tokens)
                real = countdown.sparsity_real(model)["mean"]
            finally:
                countdown.unsparsify(model)
            pairs.append((dense_tps, sparse_tps, sparse_ms))
            dense_runs.append((dense_tps, dense_ms))
        add(method, mode, path, k, real, pairs, ideal_speedup(method, k, total, mlp))
        write_outputs(with_dense_row(rows, dense_runs), args, info)  # partial results survive a timeout

    dense_runs: list[tuple[float, float]] = []
    for k in ks:
        for method in ("cats", "mono", "dual"):
            run_patched(method, "ideal", "gather", k)
    from countdown import prepare

    thresholds = prepare(model, tok, "mono[threshold]", ks, num_tokens=args.calib_tokens, progress=False)
    for k in ks:
        run_patched("mono", "prac", "gather", k, thresholds)
        run_patched("mono", "prac", "masked", k, thresholds)
    write_outputs(with_dense_row(rows, dense_runs), args, info)
    print(f"done in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
