"""Does rounding x to int8 (kernels/_gemv_i8.py) change which rows a shadow keeps? On a real model, CPU.

    PYTHONPATH=src python benchmarks/shadow_int8_agreement.py --out DIR [--model smollm2-135m] [--tokens 1024]

For every Gated-MLP of the model, on real text (countdown.data.texts.calibration_texts), its inputs x are taken
by a forward pre-hook; the 4-bit group-64 shadows of W_gate and W_up (quant.quantize_rtn) give three
indicators |u~ act(g~)| per token: "exact" (float64 x . w~), "int8" (float64 model of _gemv_i8.py's
arithmetic: x rounded per group as the kernel rounds it, the integer dots exact; tests/test_shadow_gemv_i8.py
checks the kernel against the same model) and the dense "oracle" |u act(g)| of the real weights. At
k = 0.7 / 0.8 / 0.9, with one cut per layer (the exact indicator's quantile over the layer's tokens, as
calibration does), it reports: the share of kept rows where int8 and exact disagree, and the MLP
output error ||y_kept - y|| / ||y|| of each indicator's rows (the dense MLP on those rows only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

import countdown.kernels as K
from countdown.data.texts import calibration_texts
from countdown.mlp import require_gated_mlps
from countdown.data.models import load_model

KS, BITS, GROUP = (0.7, 0.8, 0.9), 4, 64


def int8_dot(x, q, s, group):
    """float64 model of _gemv_i8.py: x [T, d] rounded to int8 per group (float32, halves away from 0)."""
    t, d = x.shape
    xf = x.float().reshape(t, -1, group)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    v = (xf * inv).clamp(-127, 127)
    xq = torch.where(v >= 0, v + 0.5, v - 0.5).trunc()
    xs = torch.where(amax > 0, amax / 127.0, torch.zeros_like(amax)).double()
    dots = torch.einsum("tgj,ngj->tng", xq.double(), q.double().reshape(q.shape[0], -1, group))
    return (dots * s.double()[None] * xs.reshape(t, 1, -1)).sum(-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    views = require_gated_mlps(model)
    xs = {v.name: [] for v in views}
    hooks = [v.module.register_forward_pre_hook(lambda m, a, n=v.name: xs[n].append(a[0].reshape(-1, a[0].shape[-1])))
             for v in views]
    used = 0
    with torch.no_grad():
        for text in calibration_texts():
            ids = tok(text, return_tensors="pt")["input_ids"][:, : args.tokens - used]
            if ids.numel():
                model(input_ids=ids)
                used += ids.shape[1]
            if used >= args.tokens:
                break
    for h in hooks:
        h.remove()
    rows = []
    for v in views:
        x = torch.cat(xs[v.name]).double()
        wg, wu, wd = v.w_gate.double(), v.w_up.double(), v.w_down.double()
        qg, sg = K.quantize_rtn(v.w_gate.float(), BITS, GROUP)
        qu, su = K.quantize_rtn(v.w_up.float(), BITS, GROUP)
        dg, du = K.dequantize(qg, sg, torch.float64), K.dequantize(qu, su, torch.float64)
        act = lambda g: v.act(g)
        exact = (x @ du.t() * act(x @ dg.t())).abs()
        i8 = (int8_dot(x, qu, su, GROUP) * act(int8_dot(x, qg, sg, GROUP))).abs()
        s = (x @ wu.t()) * act(x @ wg.t())
        y = s @ wd.t()
        for k in KS:
            cut = torch.quantile(exact.flatten()[:2**24].float(), k).item()
            ke, ki = exact > cut, i8 > cut
            err = lambda keep: ((s * keep) @ wd.t() - y).norm().item() / y.norm().item()
            oracle = s.abs() >= s.abs().quantile(k, dim=-1, keepdim=True)
            rows.append(dict(layer=v.name, k=k, kept=ke.float().mean().item(), kept_int8=ki.float().mean().item(),
                             disagree=(ke != ki).float().sum().item() / max(1, ke.sum().item()),
                             err_exact=err(ke), err_int8=err(ki), err_oracle=err(oracle)))
        print(f"{v.name}: " + ", ".join(f"k={r['k']} disagree {r['disagree']:.3%} err {r['err_exact']:.4f} -> "
                                       f"{r['err_int8']:.4f}" for r in rows[-len(KS):]), flush=True)
    summary = []
    for k in KS:
        rs = [r for r in rows if r["k"] == k]
        mean = lambda key: sum(r[key] for r in rs) / len(rs)
        summary.append(dict(k=k, disagree=mean("disagree"), err_exact=mean("err_exact"), err_int8=mean("err_int8"),
                            err_oracle=mean("err_oracle"), kept=mean("kept"), kept_int8=mean("kept_int8")))
    os.makedirs(args.out, exist_ok=True)
    meta = dict(model=args.model, tokens=used, date=datetime.date.today().isoformat(), bits=BITS, group=GROUP,
                command="PYTHONPATH=src python " + " ".join(sys.argv))
    lines = [f"# int8 x in the shadow GEMV: kept rows on {args.model} ({used} tokens, {meta['date']}, CPU)", "",
             f"`{meta['command']}`", "", "Means over the model's Gated-MLPs; err = ||y_kept - y|| / ||y|| of the MLP "
             "output (dense on the kept rows); disagree = rows kept by one indicator only / rows kept by exact.", "",
             "| k | kept (exact) | kept (int8) | disagree | err exact shadow | err int8 shadow | err oracle top-k |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['k']} | {r['kept']:.4f} | {r['kept_int8']:.4f} | {r['disagree']:.3%} | {r['err_exact']:.4f} | "
              f"{r['err_int8']:.4f} | {r['err_oracle']:.4f} |" for r in summary]
    tmp = os.path.join(args.out, ".agreement.json.tmp")
    with open(tmp, "w") as f:
        json.dump(dict(meta=meta, summary=summary, layers=rows), f, indent=1)
    os.replace(tmp, os.path.join(args.out, "agreement.json"))
    with open(os.path.join(args.out, "agreement.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
