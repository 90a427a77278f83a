"""Where the compiled dense decode step's time goes, kernel by kernel, for each attention path.

    PYTHONPATH=src python benchmarks/step_profile.py --variants sdpa,countdown,fused --out $OUT

Committed results (H200): results/step_profile/ from ``--variants countdown,fused --out /root/out``;
results/step_profile_gemv/ from ``--variants fused,fused+down,fused+down+o --samples 2 --out /root/out/step``;
results/step_profile_qkv/ from ``--variants fused+down+o,fused+down+o+qkv --samples 3 --out /root/out/step``.

Per variant (one model, random weights, bf16, batch 1; the variant applied, the step compiled as
``generate_fast`` compiles it: full graph, CUDA graphs, coordinate-descent tuning): tokens/s of
``--samples`` timed runs (min / median / max), the step's weight + KV-cache bytes against the copy
bandwidth measured in the same run, and a torch.profiler table of every kernel of 16 replayed steps
(calls, microseconds per step and per call, class). Variants:

- ``sdpa``: transformers' SDPA attention (the model as loaded);
- ``countdown``: countdown's split-KV kernel behind transformers' interface (countdown.decode.hf_attention);
- ``fused``: one QKV GEMV and the fused rotary + cache-write + attention kernel (countdown.decode.attention).
- ``fused+down`` / ``fused+down+o`` / ``fused+down+o+qkv``: the same with the MLPs' down projections (and
  the attention output projections, and the fused QKV GEMV) on kernels/decode_step/linear.py's fixed GEMV;
  ``fused+all``: every projection of the layers there (gate and up too) (countdown.decode.linears.route_linears);
  ``fused+all+norm``: and each layer's input RMSNorm folded into the QKV GEMV (countdown.decode.layer); ``fused``
  leaves every projection to Inductor.

Writes ``step_profile.csv`` (one row per variant), ``step_kernels.csv`` (every kernel of every variant),
``step_profile.md`` and ``step_profile_meta.json`` under ``--out``; prints the short table last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch

T0 = time.perf_counter()
VARIANTS = ("sdpa", "countdown", "fused", "fused+down", "fused+down+o", "fused+down+o+qkv", "fused+all",
            "fused+all+norm")


def log(*parts) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *parts, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b-shape")
    ap.add_argument("--variants", default="countdown,fused", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", "results/step_profile"))
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers (a quick check)")
    ap.add_argument("--check-only", action="store_true", help="only compare the fused path with transformers'")
    ap.add_argument("--smoke", action="store_true", help="2 layers on CPU, eager (checks this script only)")
    args = ap.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}: choose from {', '.join(VARIANTS)}")
    return args


def apply_variant(model, variant: str) -> str:
    """Switch ``model`` to ``variant`` (from the loaded state); returns a note (modules left alone)."""
    from countdown.decode.hf_attention import use_decode_attention
    from countdown.decode.linears import route_linears
    from countdown.decode.attention import fuse_attention

    if variant == "countdown":
        use_decode_attention(model)
    elif variant.startswith("fused"):
        targets = {"fused+down": ("down",), "fused+down+o": ("down", "o_proj"),
                   "fused+down+o+qkv": ("down", "o_proj", "qkv"),
                   "fused+all": ("down", "gate_up", "o_proj", "qkv"),
                   "fused+all+norm": ("down", "gate_up", "o_proj", "qkv", "norm")}.get(variant, ())
        skipped = fuse_attention(model)
        if targets:
            route_linears(model, targets)
        return f"{len(skipped)} modules left alone: {skipped[:1]}" if skipped else ""
    return ""


def undo_variant(model, variant: str) -> None:
    from countdown.decode.hf_attention import use_decode_attention
    from countdown.decode.generate import reset_decoders
    from countdown.decode.linears import route_linears
    from countdown.decode.attention import fuse_attention

    reset_decoders(model)
    route_linears(model, (), on=False)
    if variant.startswith("fused"):
        fuse_attention(model, False)
    use_decode_attention(model, False)
    torch._dynamo.reset()


def write_csv(path: str, rows: list[dict]) -> None:
    import csv
    import io

    from countdown.io import atomic_write

    fields = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def check_fused(model, prompt: torch.Tensor, steps: int = 4) -> dict:
    """The fused path, and countdown's unfused kernel (the bf16 noise floor), against transformers' SDPA
    (eager, the same cache contents and tokens): the largest logit difference over ``steps``
    teacher-forced decode steps relative to the largest logit, and how many steps agree on the argmax."""
    from transformers import StaticCache

    tokens = torch.randint(0, model.config.vocab_size, (prompt.shape[0], steps),
                           generator=torch.Generator().manual_seed(2)).to(prompt.device)
    logits = {}
    for variant in ("sdpa", "countdown", "fused"):
        apply_variant(model, variant)
        cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 8)
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
            out = []
            for i in range(steps):
                pos = torch.tensor([prompt.shape[1] + i], device=prompt.device)
                out.append(model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True,
                                 cache_position=pos).logits[:, -1].float())
        logits[variant] = torch.stack(out)
        undo_variant(model, variant)
    a = logits["sdpa"]
    result = {"steps": a.shape[0] * a.shape[1]}
    if prompt.device.type == "cuda":  # greedy tokens: transformers' generate (SDPA) vs the compiled fused step
        from countdown.decode.generate import generate_fast

        ref = model.generate(prompt, max_new_tokens=32, do_sample=False)[:, prompt.shape[1]:]
        for variant in ("sdpa", "countdown", "fused"):  # the unfused ones: how far bf16 alone carries
            for mode in ("eager", "compile"):
                apply_variant(model, variant)
                got = generate_fast(model, prompt, 32, compile=mode)[0][:, prompt.shape[1]:]
                undo_variant(model, variant)
                same = (ref == got).all(0).long()
                result[f"tokens_equal_{variant}_{mode}"] = int(same.cumprod(0).sum())
    for variant in ("countdown", "fused"):
        b = logits[variant]
        result[variant] = {"max_rel_diff": float((a - b).abs().max() / a.abs().max()),
                           "argmax_agree": int((a.argmax(-1) == b.argmax(-1)).sum())}
    return result


def kv_cache_bytes(model, cache_len: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cache_len * head_dim * model.dtype.itemsize


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("benchmarks/step_profile.py needs a CUDA GPU (--smoke checks the script on CPU)")
        return 2
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-step-"))
    import countdown
    from countdown.decode.generate import generate_fast
    from countdown.io import atomic_write, write_json
    from harness.breakdown import profile_steps
    from harness.timing import copy_bandwidth, spread
    from harness.weightbytes import step_weight_bytes

    os.makedirs(args.out, exist_ok=True)
    overrides = ({"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000} if args.smoke else {})
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model, _ = countdown.load_model(args.config, dtype="bf16" if cuda else "fp32", device=device,
                                    random_weights=True, config_overrides=overrides or None)
    model.generation_config.eos_token_id = None
    copy_bps = copy_bandwidth() if cuda else float("nan")
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "date": datetime.date.today().isoformat(),
            "config": args.config, "torch": torch.__version__, "copy_gbps": copy_bps / 1e9,
            "command": "PYTHONPATH=src python benchmarks/step_profile.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    log(meta)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    if "fused" in args.variants.split(",") or args.check_only:
        meta["fused_check"] = check_fused(model, prompt)
        log(f"fused path vs transformers' (eager, bf16): {meta['fused_check']}")
        if args.check_only:
            return 0
    mode = "compile" if cuda else "eager"
    rows, kernels = [], []
    for variant in args.variants.split(","):
        note = apply_variant(model, variant)
        _, first = generate_fast(model, prompt, args.new_tokens, compile=mode)
        runs = [generate_fast(model, prompt, args.new_tokens, compile=mode)[1] for _ in range(args.samples)]
        tps = spread([r["decode_tokens_per_s"] for r in runs])
        ms = 1e3 / tps["median"]
        cache_len = args.prompt + args.new_tokens  # the valid part the attention reads, on average half of it
        nbytes = step_weight_bytes(model, "dense", 1.0) + kv_cache_bytes(model, cache_len) // 2
        row = {"variant": variant, "tokens_per_s": tps["median"], "tokens_per_s_min": tps["min"],
               "tokens_per_s_max": tps["max"], "ms_per_step": ms, "setup_s": first["setup_s"], "step_gb": nbytes / 1e9,
               "bandwidth_share": nbytes / (ms / 1e3) / copy_bps if cuda else float("nan"), "note": note}
        if cuda:
            prof = profile_steps(model, args.profile_steps)
            row.update(device_ms_per_step=prof["device_ms_per_step"], kernels_per_step=prof["kernels_per_step"])
            for k in prof["kernels"]:
                kernels.append({"variant": variant, **k})
            for name, entry in sorted(prof["classes"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
                log(f"  {variant:10s} {name:42s} {entry['ms_per_step']:.3f} ms/step  {entry['kernels_per_step']:.0f} kernels")
        rows.append(row)
        log(f"{variant}: {tps['median']:.1f} tokens/s ({tps['min']:.1f}-{tps['max']:.1f}), {ms:.3f} ms/step, "
            f"setup {first['setup_s']:.1f} s {note}")
        undo_variant(model, variant)
    write_csv(os.path.join(args.out, "step_profile.csv"), rows)
    if kernels:
        write_csv(os.path.join(args.out, "step_kernels.csv"), kernels)
    meta["wall_s"] = time.perf_counter() - T0
    write_json(os.path.join(args.out, "step_profile_meta.json"), meta)
    lines = [f"# Dense decode step by attention path ({meta['device']}, {meta['date']})", "",
             f"`{meta['command']}`; copy bandwidth {meta['copy_gbps']:.0f} GB/s.", "",
             "| variant | tokens/s (min-max) | ms/step | share of copy BW | kernels/step | device ms/step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}) "
                     f"| {r['ms_per_step']:.3f} | {100 * r['bandwidth_share']:.0f} % | {r.get('kernels_per_step', float('nan')):.0f} "
                     f"| {r.get('device_ms_per_step', float('nan')):.3f} |")
    for variant in args.variants.split(","):
        top = [k for k in kernels if k["variant"] == variant][:14]
        if top:
            lines += ["", f"## {variant}: slowest kernels per step", "", "| kernel | class | calls | us/step | us/call |",
                      "|---|---|---|---|---|"]
            lines += [f"| `{k['kernel'][:90]}` | {k['class']} | {k['calls_per_step']:.0f} | {k['us_per_step']:.1f} "
                      f"| {k['us_per_call']:.2f} |" for k in top]
    atomic_write(os.path.join(args.out, "step_profile.md"), "\n".join(lines) + "\n")
    print("\n".join(lines[:6 + len(rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
