"""End-to-end decode speed on a GPU: dense and every configuration at every k, one command, one budget.

    PYTHONPATH=src python benchmarks/decode.py --out $OUT --budget-s 420      # the full benchmark
    PYTHONPATH=src python benchmarks/decode.py --smoke --out /tmp/smoke         # a check of this script (CPU)
    PYTHONPATH=src python benchmarks/decode.py --report RUN1,RUN2 --out results  # merge runs

results/decode.csv / .md / .png: the first command on an H200 (2026-11-25, ``--out /root/out/decode
--budget-s 420``); results/decode_runs/<run>/ hold later runs, each with its command in decode_meta.json
and what it compared in its README.md. Speeds are printed as tokens/s and x dense.

A paper-scale shape with random weights (values do not change batch-1 speed; ``--masks`` checks that
with masks recorded on real models), bf16, a prompt of 64 random tokens, then 512 new tokens, batch 1,
k = 0.7 / 0.8 / 0.9, for dense and every method spec (``--methods``: mono, cats, dual[lowrank],
dual[hybrid], dual[shadow4], dejavu, teal; parsed by ``countdown.spec``; a spec this library
cannot run yet is skipped with the reason printed). Every row runs the fastest decode step the library
has: the fused attention block (``--attention fused``) and every projection on the fixed GEMV
(``--decode-gemv auto``); on an H200 the whole default run takes about five minutes (run AB,
docs/decode.md).

Runners. ``--runner one-compile`` (default, ``harness.onecompile``): the compiled dense decoder
as ``generate_fast`` runs it (full graph, CUDA graphs, coordinate-descent tuning; compiled twice for the
spread), then every configuration through ONE compile of the step with the Gated-MLPs behind an opaque
slot op (``harness.slots``), one CUDA-graph capture per method, k switched in place; per row
also one MLP alone against its roofline. Fits one 10-minute call. ``--runner per-compile``
(``harness.runner``): the earlier one, one full-graph compile per configuration and batch
(batch > 1 too).

The logic lives in the harness (``benchmarks/harness``): this script is its command line.
``harness.runner`` says what makes it fast (one compile per configuration and batch, k switched
in place, Inductor caches shared by the whole run, speed-only artifacts), ``harness.weightbytes``
how bytes and bandwidth are counted, ``harness.breakdown`` the per-operation breakdown of the
dense step (on by default), ``harness.checks`` the correctness checks run first (generate_fast
in every mode against ``model.generate``, one graph per generation).

Rows: decode.csv keeps the columns of earlier runs (``method`` now holds the spec, e.g.
``dual[lowrank]``; ``artifacts`` says ``speed-only``) plus ``tokens_per_s_min`` / ``_max`` / ``samples``;
the dense baseline is timed ``--dense-samples`` times on its compiled graph (min / median / max).
Earlier flags ``--batch-harnesses``, ``--full-harness``, ``--calib-tokens``, ``--calib-text`` and
``--allow-stand-in`` are gone (one harness for every row; artifacts are speed-only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import sys
import tempfile
import time

import torch

T0 = time.perf_counter()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for --smoke (a check of this script)
SMOKE_OVERRIDES = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 352,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}
DEFAULT_METHODS = "mono,dual[shadow4],teal,cats,dual[hybrid],dual[lowrank],dejavu"  # teal early: a tight budget drops the last


def log(*parts) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *parts, flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b-shape", help="a shape name from countdown.catalogue()")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="method specs (countdown.spec)")
    ap.add_argument("--runner", choices=("one-compile", "per-compile"), default="one-compile")
    ap.add_argument("--ks", default="0.7,0.8,0.9")
    ap.add_argument("--batches", default="1", help="batch sizes (per-compile runner only; one-compile: batch 1)")
    ap.add_argument("--batch-methods", default="", help="specs also timed at batch > 1 (default: all)")
    ap.add_argument("--new-tokens", default="512")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--eager-tokens", default="", help="lengths for a dense eager row at batch 1 ('' to skip)")
    ap.add_argument("--harnesses", default="compile-cdt", help="the harness of every row (the first one given): "
                    "compile-cdt, compile, cudagraph, eager")
    ap.add_argument("--predictor-route", choices=("fused", "masked"), default="fused",
                    help="dual on the kernel path: predictor inside the fused kernel, or mask in PyTorch + "
                    "masked kernel (countdown.kernels.route's \"lowrank\" entry)")
    ap.add_argument("--profile", action="store_true", help="kernel-time breakdown of each compiled step")
    ap.add_argument("--attention", choices=["sdpa", "countdown", "fused"], default="fused",
                    help="decode-step attention of every row: transformers' SDPA, countdown's split-KV kernel "
                         "(countdown.decode.hf_attention.use_decode_attention), or that kernel with the rotary embedding and "
                         "cache write fused in after one QKV GEMV (countdown.decode.attention.fuse_attention)")
    ap.add_argument("--decode-gemv", default="auto", help="comma-separated projections of every row (down, gate_up, "
                    "o_proj, qkv, norm: qkv and norm with --attention fused; norm folds each input RMSNorm into the QKV "
                    "GEMV, opt-in) on kernels/decode_step/linear.py's fixed GEMV in decode steps (countdown.decode.linears.route_linears); 'auto' (default) = every one that applies but norm, '' or 'none' "
                    "= Inductor's own GEMVs")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-op breakdown of the dense step")
    ap.add_argument("--rank", type=int, default=None, help="predictor rank of every spec written [lowrank] without one, e.g. "
                    "dual[lowrank] -> dual[lowrank256] (default 512)")
    ap.add_argument("--dense-samples", type=int, default=3,
                    help="timings of the dense compiled graph per batch (min / median / max reported)")
    ap.add_argument("--samples", type=int, default=1, help="timings per sparse configuration and k")
    ap.add_argument("--dense-compiles", type=int, default=2, help="one-compile: full-graph dense compiles (2: the "
                    "second at the end, if the budget allows)")
    ap.add_argument("--kernel-layers", type=int, default=8, help="one-compile: layers whose MLP is timed alone")
    ap.add_argument("--masks", default="", help="one-compile: comma-separated mask files / folders recorded on real "
                    "models (benchmarks/operating_points.py quality saves them) to replay at this shape")
    ap.add_argument("--refit-cuts", type=int, default=None, metavar="ROUNDS",
                    help="rounds of fitting the speed-only cuts on the sparse model's own decode steps (default: "
                    "1 for one-compile, whose first round serves every k; 2 for per-compile)")
    ap.add_argument("--kept-steps", type=int, default=32, help="decode steps for Sparsity-Real")
    ap.add_argument("--fit-prompts", type=int, default=None, help="prompts the speed-only cuts are fitted on (8; smoke 2)")
    ap.add_argument("--fit-tokens", type=int, default=None, help="decode steps per fit prompt (32; smoke 8)")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting new configurations after this")
    ap.add_argument("--compile-estimate-s", type=float, default=45)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--checks", choices=("quick", "full"), default="quick",
                    help="quick: dense and mono, eager and compile; full: also dual[lowrank] and cudagraph")
    ap.add_argument("--inductor-cache", default=None,
                    help="Inductor's cache folder for the whole run (default: a fresh folder in /tmp)")
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--smoke", action="store_true", help="a 2-layer version of the shape, on CPU if no GPU "
                    "(checks this script; its numbers mean nothing)")
    ap.add_argument("--report", help="comma-separated result folders (decode.csv + decode_meta.json) to merge "
                    "into --out as decode.csv / decode.md / decode.png, then exit")
    return ap.parse_args(argv)


def specs_of(args):
    """The specs of ``args.methods``; ``args.rank`` names the rank of every low-rank spec that gives none, in
    the spec grammar itself (``dual[lowrank]`` -> ``dual[lowrank256]``, also the row's label)."""
    from countdown.spec import parse_specs

    text = args.methods
    if args.rank is not None:
        text = re.sub(r"\[\s*lowrank\s*\]", f"[lowrank{args.rank}]", text)
    return parse_specs(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    from harness import report as rep

    if args.report:
        rows, metas = rep.read_runs(args.report.split(","))
        rep.fill_references(rows)
        rep.write_report(rows, metas, args.out, log)
        print(rep.short_table(rows))
        return 0
    if DEVICE != "cuda" and not args.smoke:
        print("benchmarks/decode.py needs a CUDA GPU (benchmarks/decode_cpu.py is the CPU benchmark)")
        return 2
    # One Inductor cache for the whole run: what a configuration shares with dense is compiled and tuned once.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", args.inductor_cache or tempfile.mkdtemp(prefix="inductor-bench-"))
    import transformers
    import triton

    import countdown
    import countdown.selectors.lowrank
    from harness.checks import run_checks
    from harness.runner import DecodeSettings, decode_sweep
    from harness.timing import copy_bandwidth
    from harness.weightbytes import model_bytes

    predictor_route = countdown.kernels.overrides(  # the whole run takes it (held until main returns)
        routes={("lowrank", dev): ("masked",) * 3 for dev in ("cuda", "interpreter")}
        if args.predictor_route == "masked" else {})
    predictor_route.__enter__()
    os.makedirs(args.out, exist_ok=True)
    handler = logging.FileHandler(os.path.join(args.out, "dynamo.log"))
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    for name in ("torch._dynamo", "torch._inductor"):
        logging.getLogger(name).addHandler(handler)
    specs = specs_of(args)
    meta = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
            "run": datetime.datetime.now().strftime("%Y%m%dT%H%M%S"), "date": datetime.date.today().isoformat(),
            "config": args.config, "prompt": args.prompt, "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton.__version__,
            "predictor_route": args.predictor_route,
            "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
            "command": "PYTHONPATH=src python benchmarks/decode.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    log(json.dumps(meta))
    checks_ok = None
    if not args.skip_checks:
        quick = args.checks == "quick"
        if args.runner == "one-compile":
            from harness.checks import run_slot_checks

            checks_ok = run_slot_checks(lambda *a: log(*a), specs=("mono",) if quick else ("mono", "dual[lowrank]"))
        else:
            checks_ok = run_checks(lambda *a: log(*a), specs=("mono",) if quick else ("mono", "dual[lowrank]"),
                                   modes=None if not quick or DEVICE != "cuda" else ("eager", "compile"),
                                   sampling=not quick)
        log(f"checks {'passed' if checks_ok else 'FAILED'}")
    meta["checks_ok"] = checks_ok
    meta["copy_gbps"] = copy_bandwidth() / 1e9 if DEVICE == "cuda" else float("nan")
    log(f"loading {args.config} (random weights)")
    torch.manual_seed(0)
    model, _ = countdown.load_model(args.config, dtype="bf16" if DEVICE == "cuda" else "fp32", device=DEVICE,
                                    random_weights=True, config_overrides=SMOKE_OVERRIDES if args.smoke else None)
    model.generation_config.eos_token_id = None
    if args.attention == "countdown":
        from countdown.decode.hf_attention import use_decode_attention

        use_decode_attention(model)
    elif args.attention == "fused":
        from countdown.decode.attention import fuse_attention

        skipped = fuse_attention(model)
        if skipped:
            log(f"fuse_attention left {len(skipped)} modules alone: {skipped[0]}")
    meta["attention"] = model.config._attn_implementation + ("+fused" if args.attention == "fused" else "")
    if args.decode_gemv == "auto":
        from countdown.decode.linears import step_targets

        args.decode_gemv = ",".join(step_targets(args.attention == "fused"))
    elif args.decode_gemv == "none":
        args.decode_gemv = ""
    if args.decode_gemv:
        from countdown.decode.linears import route_linears

        routed = route_linears(model, tuple(args.decode_gemv.split(",")))
        log(f"decode GEMV: {routed} projections ({args.decode_gemv}) on kernels/decode_step/linear.py")
    meta["decode_gemv"] = args.decode_gemv
    meta["model_gb"] = model_bytes(model) / 1e9
    log(f"model {meta['model_gb']:.2f} GB; copy bandwidth {meta['copy_gbps']:.0f} GB/s")
    if args.runner == "one-compile":
        return _one_compile(args, model, specs, meta)
    settings = DecodeSettings(
        specs=specs, ks=[float(k) for k in args.ks.split(",")], batches=_ints(args.batches),
        new_tokens=_ints(args.new_tokens), prompt=args.prompt, harness=args.harnesses.split(",")[0],
        dense_samples=args.dense_samples, samples=args.samples, eager_tokens=_ints(args.eager_tokens),
        kept_steps=args.kept_steps, fit_rounds=args.refit_cuts or 2, budget_s=args.budget_s - (time.perf_counter() - T0),
        compile_estimate_s=args.compile_estimate_s,
        batch_specs=[s.label for s in specs_of(argparse.Namespace(methods=args.batch_methods, rank=args.rank))]
        if args.batch_methods else None,
        profile=args.profile, breakdown=not args.no_breakdown)
    rows: list = []

    def checkpoint(done: list) -> None:  # a run cut off by its time limit keeps what it measured
        meta["wall_s"] = time.perf_counter() - T0
        rows[:] = done
        snapshot = [dict(r) for r in done]
        rep.fill_references(snapshot)
        rep.write_report(snapshot, [meta], args.out, log)

    try:
        rows = decode_sweep(model, settings, meta, log=lambda *a: log(*a), checkpoint=checkpoint)
    finally:
        meta["wall_s"] = time.perf_counter() - T0
        rep.fill_references(rows)
        rep.write_report(rows, [meta], args.out, log)
        print(rep.short_table(rows), flush=True)
    return 0


def _one_compile(args, model, specs, meta) -> int:
    from harness import report as rep
    from harness.onecompile import OneCompileSettings, one_compile_sweep

    if _ints(args.batches) != [1]:
        print("--runner one-compile times batch 1; use --runner per-compile for --batches", file=sys.stderr)
        return 2
    settings = OneCompileSettings(
        specs=specs, ks=[float(k) for k in args.ks.split(",")], new_tokens=_ints(args.new_tokens)[0],
        prompt=args.prompt, dense_samples=args.dense_samples, samples=args.samples, dense_compiles=args.dense_compiles,
        fit_rounds=args.refit_cuts or 1, kept_steps=args.kept_steps, kernel_layers=args.kernel_layers,
        fit_prompts=args.fit_prompts or (2 if args.smoke else 8), fit_tokens=args.fit_tokens or (8 if args.smoke else 32),
        budget_s=args.budget_s - (time.perf_counter() - T0), compile="inductor" if DEVICE == "cuda" else "eager-backend",
        masks=[m for m in args.masks.split(",") if m.strip()], breakdown=not args.no_breakdown, profile=args.profile)
    rows: list = []

    def checkpoint(done: list) -> None:
        meta["wall_s"] = time.perf_counter() - T0
        rows[:] = [dict(r) for r in done]
        rep.fill_references(rows)
        rep.write_report(rows, [meta], args.out, log)

    try:
        one_compile_sweep(model, settings, meta, log=lambda *a: log(*a), checkpoint=checkpoint)
    finally:
        meta["wall_s"] = time.perf_counter() - T0
        rep.write_report(rows, [meta], args.out, log)
        print(rep.short_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
