"""One-token attention over a static KV cache: transformers' SDPA call against countdown's split-KV kernel.

    PYTHONPATH=src python benchmarks/attention.py --out DIR [--tiny]

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head size 128), bf16, batch 1 and 4,
cache lengths 640 (the decode benchmark's) to 8192, a boolean mask with the valid prefix (as
transformers builds it for a static cache); each layer's cache its own (32 rotating caches, past
L2), CUDA-graph timing. Roofline: K and V of the valid prefix / copy bandwidth. Checks each case
against float64 first. Writes attention.csv / attention.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from countdown.attention import mask_bias
from countdown.bench import copy_bandwidth
from countdown.bench.timing import time_graph
from countdown.io import atomic_write
from countdown.kernels import _attention

H, KVH, D, LAYERS = 32, 8, 128, 32


def sdpa(q, k, v, mask, scale):  # what transformers' sdpa_attention_forward runs for one token under compile
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def case(B, T, valid, dev, dtype):
    g = torch.Generator(device="cpu").manual_seed(T + B)
    caches = [(torch.randn(B, KVH, T, D, generator=g).to(dev, dtype), torch.randn(B, KVH, T, D, generator=g).to(dev, dtype))
              for _ in range(LAYERS)]
    q = torch.randn(B, H, 1, D, generator=g).to(dev, dtype)
    mask = (torch.arange(T) < valid)[None, None, None, :].expand(B, 1, 1, T).to(dev)
    return q, caches, mask


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test under TRITON_INTERPRET=1 (checks only)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.tiny:
        sys.exit("benchmarks/attention.py needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    global LAYERS
    LAYERS = 2 if args.tiny else LAYERS
    bw = copy_bandwidth() if dev == "cuda" else 1e12
    dtype = torch.bfloat16
    scale = 1 / math.sqrt(D)
    rows = []
    shapes = [(1, 64, 40)] if args.tiny else [(1, 640, 576), (1, 2048, 2000), (1, 8192, 8000), (4, 640, 576), (4, 4096, 4000)]
    for B, T, valid in shapes:
        q, caches, mask = case(B, T, valid, dev, dtype)
        bias = mask_bias(mask, B, T)
        k, v = caches[0]
        ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(H // KVH, 1),
                                             v.double().repeat_interleave(H // KVH, 1), attn_mask=mask, scale=scale)
        ours = _attention.decode_attention(q, k, v, bias, scale)
        err = (ours.double() - ref).abs().max().item()
        err_sdpa = (sdpa(q, k, v, mask, scale).double() - ref).abs().max().item()
        row = dict(batch=B, cache=T, valid=valid, err=err, err_sdpa=err_sdpa, ok=err <= 2 * err_sdpa + 1e-2)
        if dev == "cuda":
            nbytes = 2 * B * KVH * valid * D * 2
            roof = nbytes / bw * 1e6
            row["sdpa_us"] = time_graph([lambda k=k, v=v: sdpa(q, k, v, mask, scale) for k, v in caches])
            row["ours_us"] = time_graph([lambda k=k, v=v: _attention.decode_attention(q, k, v, bias, scale)
                                         for k, v in caches])
            row.update(roofline_us=roof, speedup=row["sdpa_us"] / row["ours_us"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    keys = ["batch", "cache", "valid", "sdpa_us", "ours_us", "roofline_us", "speedup", "err", "err_sdpa", "ok"]
    atomic_write(os.path.join(args.out, "attention.csv"), "\n".join(
        [",".join(keys)] + [",".join(f"{r.get(c, '')}" for c in keys) for r in rows]) + "\n")
    dev_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke test)"
    lines = [f"# One-token attention, Llama-3.1-8B heads ({dev_name}, {datetime.date.today()})", "",
             f"`PYTHONPATH=src python {' '.join(sys.argv)}`; copy bandwidth {bw / 1e12:.2f} TB/s", "",
             "| batch | cache | valid | SDPA us | ours us | roofline us | speed-up | max err (ours / SDPA, vs float64) |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "" if x is None else f"{x:.1f}"
    lines += [f"| {r['batch']} | {r['cache']} | {r['valid']} | {fmt(r.get('sdpa_us'))} | {fmt(r.get('ours_us'))} | "
              f"{fmt(r.get('roofline_us'))} | {'' if 'speedup' not in r else '%.2fx' % r['speedup']} | "
              f"{r['err']:.2e} / {r['err_sdpa']:.2e} |" for r in rows]
    atomic_write(os.path.join(args.out, "attention.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
