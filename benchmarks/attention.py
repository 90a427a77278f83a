"""One-token attention over a static KV cache: PyTorch SDPA against countdown's flash-decoding kernel.

    PYTHONPATH=src python benchmarks/attention.py --sweep --out DIR   # default DIR: results/attention
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/attention.py --tiny --out /tmp/a   # CPU: checks only

results/attention/attention.md / .csv and sweep.csv (H200, 2026-11-23) came from the first command with
``--out /root/out/attn``; rows print the speed-up over SDPA. (sweep_one_launch.csv there: an earlier run
the same day, at an earlier commit whose kernel also had LAST_MERGES.)

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head size 128), bf16, batch 1 at cache
640 / 2048 / 8192 and batch 4 at 640 / 4096, a boolean mask with the valid prefix (as transformers
builds it for a static cache); each of 32 layers has its own cache (more than L2 holds). Three ways:

- ``sdpa``: ``F.scaled_dot_product_attention(..., enable_gqa=True)`` with the boolean mask;
- ``sdpa_hf``: what transformers runs under torch.compile (``repeat_kv`` copies, then SDPA);
- ``ours``: ``kernels/decode_step/attention.decode_attention`` on the mask's last row (what ``countdown_decode`` calls).

Each is timed two ways: ``graph`` (the 32 calls captured in one CUDA graph and replayed, as the
compiled decode step runs them; ``harness.timing.time_graph``) and ``eager`` (the 32 calls
launched from Python, timed with events around the loop: launch overhead included). Roofline: the
valid prefix of K and V / copy bandwidth. Every case is checked against float64 first (ours no worse
than 2x SDPA's error + 1e-3; + 1e-2 under the interpreter, which truncates to bf16). ``--sweep`` first times the kernel's configurations under graphs
(sweep.csv) and runs the table with the best one (geometric mean over the shapes).
Writes attention.csv / attention.md (and sweep.csv).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from countdown.decode.hf_attention import mask_row
from countdown.io import atomic_write
from countdown.kernels.config import launch_config
from countdown.kernels.decode_step import attention as _attention
from harness.timing import copy_bandwidth, time_graph

H, KVH, D, LAYERS = 32, 8, 128, 32
SHAPES = [(1, 640, 576), (1, 2048, 2000), (1, 8192, 8000), (4, 640, 576), (4, 4096, 4000)]  # batch, cache, valid
SWEEP = ([dict(BLOCK_N=bn, PER_SM=ps, SKIP_MASKED=sk, num_stages=2, num_warps=4)
          for bn in (32, 64) for ps in (2, 4, 8) for sk in (True, False)]
         + [dict(BLOCK_N=64, PER_SM=4, SKIP_MASKED=True, num_stages=3, num_warps=4),
            dict(BLOCK_N=64, PER_SM=4, SKIP_MASKED=True, num_stages=2, num_warps=8)])


def sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sdpa_hf(q, k, v, mask, scale):  # transformers' compiled path: repeat_kv (a copy) and SDPA
    g = q.shape[1] // k.shape[1]
    rep = lambda x: x[:, :, None].expand(x.shape[0], x.shape[1], g, *x.shape[2:]).reshape(x.shape[0], -1, *x.shape[2:])
    return F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask, scale=scale)


def ours(q, k, v, mask, scale, config=None):
    return _attention.decode_attention(q, k, v, mask_row(mask, q.shape[0], k.shape[2]), scale, config)


def case(B, T, valid, dev, dtype, layers):
    g = torch.Generator(device=dev).manual_seed(T + B)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)
    caches = [(rand(B, KVH, T, D), rand(B, KVH, T, D)) for _ in range(layers)]
    q = rand(B, H, 1, D)
    mask = (torch.arange(T) < valid)[None, None, None, :].expand(B, 1, 1, T).to(dev)
    return q, caches, mask


def time_eager(calls, reps: int = 20) -> float:
    """Median microseconds per call of ``calls`` launched from Python back to back (after a warm-up)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def max_err(fn, q, k, v, mask, scale, ref):
    return (fn(q, k, v, mask, scale).double() - ref).abs().max().item()


def sweep(cases, scale, out_dir):
    """Graph time of every configuration on every shape; returns the best configuration."""
    rows, score = [], {}
    for i, cfg in enumerate(SWEEP):
        logs = []
        for (B, T, valid), (q, caches, mask, ref, base) in cases.items():
            k, v = caches[0]
            try:
                err = max_err(lambda *a: ours(*a, config=cfg), q, k, v, mask, scale, ref)
                us = time_graph([lambda k=k, v=v: ours(q, k, v, mask, scale, cfg) for k, v in caches])
            except Exception as exc:  # a configuration that does not compile here: left out
                print(json.dumps({"config": cfg, "error": repr(exc)[:300]}), flush=True)
                err = us = math.inf
            split_len, n_splits = _attention.plan_splits(B, KVH, T, q.device, cfg)
            rows.append(dict(config=i, **cfg, batch=B, cache=T, splits=n_splits, split_len=split_len, us=us, err=err))
            logs.append(math.log(us / base) if err < 0.05 else math.inf)
        score[i] = sum(logs) / len(logs)
        print(json.dumps({"config": cfg, "geo_vs_sdpa": math.exp(score[i]) if score[i] < math.inf else None}),
              flush=True)
    keys = list(rows[0])
    atomic_write(os.path.join(out_dir, "sweep.csv"),
                 "\n".join([",".join(keys)] + [",".join(str(r[c]) for c in keys) for r in rows]) + "\n")
    return SWEEP[min(score, key=score.get)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/attention")
    ap.add_argument("--sweep", action="store_true", help="time the kernel's configurations first, use the best")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test under TRITON_INTERPRET=1 (checks only)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.tiny:
        sys.exit("benchmarks/attention.py needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    os.makedirs(args.out, exist_ok=True)
    layers = 2 if args.tiny else LAYERS
    bw = copy_bandwidth() if dev == "cuda" else 1e12
    scale = 1 / math.sqrt(D)
    cases = {}
    for B, T, valid in ([(1, 64, 40)] if args.tiny else SHAPES):
        q, caches, mask = case(B, T, valid, dev, torch.bfloat16, layers)
        k, v = caches[0]
        g = H // KVH
        ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(g, 1),
                                             v.double().repeat_interleave(g, 1), attn_mask=mask, scale=scale)
        base = time_graph([lambda k=k, v=v: sdpa(q, k, v, mask, scale) for k, v in caches]) if dev == "cuda" else 1.0
        cases[(B, T, valid)] = (q, caches, mask, ref, base)
    config = launch_config("attention")
    if args.sweep and dev == "cuda":
        config.update(sweep(cases, scale, args.out))
    print(json.dumps({"config": config}), flush=True)
    fns = dict(sdpa=sdpa, sdpa_hf=sdpa_hf, ours=lambda *a: ours(*a, config=config))
    rows = []
    atol = 1e-3 if dev == "cuda" else 1e-2  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
    for (B, T, valid), (q, caches, mask, ref, _) in cases.items():
        k, v = caches[0]
        errs = {name: max_err(fn, q, k, v, mask, scale, ref) for name, fn in fns.items()}
        split_len, n_splits = _attention.plan_splits(B, KVH, T, q.device, config)
        row = dict(batch=B, cache=T, valid=valid, splits=n_splits, err=errs["ours"], err_sdpa=errs["sdpa"],
                   ok=errs["ours"] <= 2 * errs["sdpa"] + atol)
        if dev == "cuda":
            row["roofline_us"] = 2 * B * KVH * valid * D * 2 / bw * 1e6
            for name, fn in fns.items():
                calls = [lambda k=k, v=v, fn=fn: fn(q, k, v, mask, scale) for k, v in caches]
                row[f"{name}_graph_us"] = time_graph(calls)
                row[f"{name}_eager_us"] = time_eager(calls)
            row["speedup_graph"] = row["sdpa_graph_us"] / row["ours_graph_us"]
            row["speedup_eager"] = row["sdpa_eager_us"] / row["ours_eager_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = ["batch", "cache", "valid", "splits", "sdpa_graph_us", "sdpa_hf_graph_us", "ours_graph_us", "roofline_us",
            "speedup_graph", "sdpa_eager_us", "sdpa_hf_eager_us", "ours_eager_us", "speedup_eager", "err", "err_sdpa",
            "ok"]
    atomic_write(os.path.join(args.out, "attention.csv"), "\n".join(
        [",".join(keys)] + [",".join(f"{r.get(c, '')}" for c in keys) for r in rows]) + "\n")
    dev_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke test)"
    fmt = lambda r, c: f"{r[c]:.1f}" if c in r else ""
    cfg = ", ".join(f"{k}={config[k]}" for k in ("BLOCK_N", "PER_SM", "SKIP_MASKED", "num_stages", "num_warps"))
    lines = [f"# One-token attention, Llama-3.1-8B heads ({dev_name}, {datetime.date.today()})", "",
             f"`PYTHONPATH=src python {' '.join(sys.argv)}`; copy bandwidth {bw / 1e12:.2f} TB/s; kernel config "
             f"{cfg}. Microseconds per layer (32 layers' caches in turn); graph: in one CUDA graph, eager: launched "
             "from Python. sdpa: SDPA with enable_gqa; sdpa_hf: repeat_kv + SDPA (transformers under compile).", "",
             "| batch | cache | valid | splits | SDPA graph | SDPA+repeat_kv graph | ours graph | roofline | speed-up "
             "graph | SDPA eager | SDPA+repeat_kv eager | ours eager | speed-up eager | max err ours / SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['cache']} | {r['valid']} | {r['splits']} | {fmt(r, 'sdpa_graph_us')} | "
              f"{fmt(r, 'sdpa_hf_graph_us')} | {fmt(r, 'ours_graph_us')} | {fmt(r, 'roofline_us')} | "
              f"{'%.2fx' % r['speedup_graph'] if 'speedup_graph' in r else ''} | {fmt(r, 'sdpa_eager_us')} | "
              f"{fmt(r, 'sdpa_hf_eager_us')} | {fmt(r, 'ours_eager_us')} | "
              f"{'%.2fx' % r['speedup_eager'] if 'speedup_eager' in r else ''} | {r['err']:.2e} / {r['err_sdpa']:.2e} |"
              for r in rows]
    atomic_write(os.path.join(args.out, "attention.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
