"""4-bit decoding on one GPU, in one call: each GEMV of the step alone, then the whole step, with our 4-bit GEMV
(kernels/int4/gemv.py), PyTorch's int4 (tinygemm, ``aten._weight_int4pack_mm``) and gemlite's A16W4 in the same step,
against our fastest bf16 step.

    PYTHONPATH=src python benchmarks/int4_decode.py --out results/int4 --run A
    PYTHONPATH=src python benchmarks/int4_decode.py --parts sweep,gemv --out /tmp/i4     # the GEMVs only
    PYTHONPATH=src python benchmarks/int4_decode.py --smoke --out /tmp/i4                # this script on the CPU
    PYTHONPATH=src python benchmarks/int4_decode.py --report --out results/int4          # decode / rows .md, .png
    PYTHONPATH=src python benchmarks/int4_decode.py --parts memory --smoke --out results/int4 --run M1
    PYTHONPATH=src python benchmarks/int4_decode.py --parts prefill --out results/int4 --run P1  # 4-bit prompts
    PYTHONPATH=src python benchmarks/int4_decode.py --parts bound --out results/int4 --run B1    # mono's bound

The Llama-3.1-8B shape with random weights (values do not change batch-1 speed), bf16 activations, batch 1,
every decoder Linear and lm_head rounded to 4 bits (``countdown.quantize(model, group=128, lm_head=True)``: 4.25
bits a weight). Parts (``--parts``):

* ``sweep``: launch configurations of our GEMV per shape of the step (the fastest whose output matches is used
  for the rest of the call and printed, to be kept in kernels/config.py's launch table);
* ``gemv``: each GEMV shape alone (q/k/v stacked, o_proj, gate/up stacked, down with its act(g) * u input, lm_head)
  for each backend and bf16 cuBLAS, cycling through weight copies of more than 256 MB so that none is read from
  the L2 cache; microseconds and the ratio to the roofline (bytes / the copy bandwidth of the same call);
* ``rows``: the kept-rows kernel of sparse rows on 4-bit weights alone against the dense 4-bit MLP, over a grid of
  its launch configurations (``harness.int4rows``: ``rows.csv``, the fastest per method in ``rows_best.json``,
  the kernels dual[mixed] reuses); ``memory``: the 8B shape's bytes in memory by arithmetic (``memory.csv``; any machine);
* ``prefill``: a 4-bit model's prompt, our one-pass de-quantization against the format's reference and bf16
  (``harness.int4prefill``: ``prefill.csv``; ``--tiles`` times the kernel's tiles);
* ``step``: ``countdown.decode.generate_fast`` on the fastest step (``fastest_step``: fused attention, compiled,
  CUDA graphs), bf16 first, then the 4-bit model with each backend (only the GEMVs differ); decode tokens/s
  (prefill excluded) over ``--new-tokens`` greedy tokens after a 64-token prompt, best of ``--repeats``;
  ``--profile``: each 4-bit configuration of ours then profiled, kernel by kernel on the step's critical path
  (``harness.int4profile``: ``step_kernels.csv``);
* ``bound``: the fastest mono could be at ``--bound-k`` with kept-rows kernels as fast as our dense GEMVs (a
  narrow model's dense step plus the indicator: ``harness.int4bound``, ``bound.csv``).

Rows append to ``<out>/decode.csv`` (``run, device, date, weights, method, sparsity, tokens_per_s, bw_share,
gemv_roofline_ratio``; weights ``bf16``, ``int4`` (ours), ``int4-torch``, ``int4-gemlite``; bw_share = the step's
weight bytes as held x tokens/s / copy bandwidth; gemv_roofline_ratio = the worst GEMV of the step, from this
call's gemv part) and ``<out>/gemv.csv`` (``run, device, date, backend, shape, n, k, us, bytes, roofline_ratio``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import os

import torch

import countdown
from countdown.int4 import Int4Linear, quantize_rtn, use_backend
from countdown.kernels import overrides
from countdown.kernels.config import LAUNCH
from countdown.kernels.int4 import gemv as _int4
from harness.int4profile import profile_step
from harness.timing import time_graph

DECODE_FIELDS = ["run", "device", "date", "weights", "method", "sparsity", "tokens_per_s", "bw_share",
                 "gemv_roofline_ratio"]
GEMV_FIELDS = ["run", "device", "date", "backend", "shape", "n", "k", "us", "bytes", "roofline_ratio"]
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"qkv": (256, 128), "down": (128, 512)}
SMOKE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}
BACKEND_WEIGHTS = {"countdown": "int4", "torch": "int4-torch", "gemlite": "int4-gemlite"}
GROUP = 128


def log(msg: str) -> None:
    print(msg, flush=True)


def append(path: str, fields: list[str], row: dict) -> None:
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerow(row)


def have_gemlite() -> bool:
    try:
        import gemlite  # noqa: F401
    except Exception as e:  # noqa: BLE001  (an optional baseline: say why it is missing)
        log(f"gemlite unavailable: {type(e).__name__}: {str(e)[:200]}")
        return False
    return True


def sets_for(nbytes: int, device: str) -> int:
    """Weight copies to cycle through: more than 256 MB in all on CUDA (the L2 cache is 50-60 MB)."""
    return max(2, math.ceil((256 << 20) / nbytes)) if device == "cuda" else 1


def make_modules(n: int, k: int, sets: int, device: str) -> list[Int4Linear]:
    g = torch.Generator(device=device).manual_seed(n + k)
    return [Int4Linear.from_weight(quantize_rtn(torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16),
                                                GROUP), dtype=torch.bfloat16) for _ in range(sets)]


def gemv_calls(backend: str, mods: list[Int4Linear], x: torch.Tensor, glu: bool, config: dict | None):
    """One call per weight copy computing what the step computes with that backend."""
    if backend == "countdown":
        return [lambda m=m: _int4.launch(x, m.qweight.view(torch.int32), m.scale, m.offset,
                                         "silu" if glu else None, config) for m in mods]
    xin = (torch.nn.functional.silu(x[0]) * x[1]).to(torch.bfloat16).reshape(1, -1) if glu else x
    for m in mods:
        m.backend = backend
    return [lambda m=m: m(xin) for m in mods]


def sweep(device: str, shapes: dict, bw: float) -> dict:
    """The fastest matching launch configuration of our GEMV per shape."""
    best = {}
    for name, (n, k) in shapes.items():
        glu = name == "down"
        mods = make_modules(n, k, sets_for(mods_bytes(n, k), device), device)
        x = torch.randn(2 if glu else 1, k, device=device, dtype=torch.float32 if glu else torch.bfloat16)
        want = _int4.launch(x, mods[0].qweight.view(torch.int32), mods[0].scale, mods[0].offset,
                            "silu" if glu else None).sum(0)
        results = []
        # q/k/v's partial sums would need a kernel of their own before the attention: one slice only
        col_opts = (4096,) if name == "qkv" else (1024, 2048, 4096)
        for R in (8, 16):
            for ahead in (1, 2):
                for cols in col_opts:
                    for per_sm in (1, 2, 3, 4, 6):
                        cfg = dict(R=R, num_warps=4, PER_SM=per_sm, MAX_COLS=cols, AHEAD=ahead)
                        try:
                            got = _int4.launch(x, mods[0].qweight.view(torch.int32), mods[0].scale, mods[0].offset,
                                               "silu" if glu else None, cfg).sum(0)
                            if not torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max())):
                                continue
                            results.append((time_graph(gemv_calls("countdown", mods, x, glu, cfg)), cfg))
                        except Exception as e:  # noqa: BLE001  (a configuration that does not compile or fit)
                            log(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
        results.sort(key=lambda r: r[0])
        us, cfg = results[0]
        for u, c in results[:4]:
            log(f"  {name:8s} {u:7.1f} us {c}")
        roof = mods_bytes(n, k) / bw * 1e6
        log(f"sweep {name:8s} best {us:7.1f} us ({us / roof:.2f}x roofline) {cfg}; default "
            f"{next((u for u, c in results if all(c[key] == LAUNCH['int4_gemv']['default'][key] for key in c)), float('nan')):.1f} us")
        best[(n, k)] = cfg
        del mods
        torch.cuda.empty_cache() if device == "cuda" else None
    return best


def mods_bytes(n: int, k: int) -> int:
    return n * k // 2 + 2 * 2 * n * (k // GROUP)


def gemv_table(device: str, shapes: dict, bw: float, stamp: dict, out: str) -> dict:
    """Per shape and backend: microseconds and the roofline ratio; returns the worst ratio per backend."""
    backends = ["countdown", "torch"] + (["gemlite"] if have_gemlite() else [])
    worst = {}
    for name, (n, k) in shapes.items():
        glu = name == "down"
        nbytes = mods_bytes(n, k)
        mods = make_modules(n, k, sets_for(nbytes, device), device)
        x = torch.randn(2 if glu else 1, k, device=device, dtype=torch.float32 if glu else torch.bfloat16)
        for backend in backends + ["bf16"]:
            if backend == "bf16":
                ws = [m.weight for m in mods[: max(2, len(mods) // 4)]]
                xb = x[:1].to(torch.bfloat16)
                calls, nb = [lambda w=w: torch.nn.functional.linear(xb, w) for w in ws], 2 * n * k
            elif backend != "countdown" and device != "cuda":
                continue
            else:
                calls, nb = gemv_calls(backend, mods, x, glu, None), nbytes
            try:
                us = time_graph(calls)
            except Exception as e:  # noqa: BLE001  (a baseline that cannot take the shape)
                log(f"gemv {name} {backend}: {type(e).__name__}: {str(e)[:160]}")
                continue
            ratio = us / (nb / bw * 1e6)
            if backend != "bf16":
                worst[backend] = max(worst.get(backend, 0.0), ratio)
            append(os.path.join(out, "gemv.csv"), GEMV_FIELDS, {**stamp, "backend": backend, "shape": name, "n": n,
                                                                 "k": k, "us": round(us, 2), "bytes": nb,
                                                                 "roofline_ratio": round(ratio, 3)})
            log(f"gemv {name:8s} {backend:10s} {us:8.1f} us  {ratio:5.2f}x roofline ({nb / 1e6:.1f} MB, "
                f"roofline {nb / bw * 1e6:.1f} us)")
        del mods
        torch.cuda.empty_cache() if device == "cuda" else None
    return worst


def step_bytes(model) -> int:
    """Weight bytes a decode step reads, as held (4-bit Linears with their scales and offsets)."""
    head = model.get_output_embeddings()
    total = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            total += module.int4.nbytes
        elif isinstance(module, torch.nn.Linear) or module is head:
            total += module.weight.numel() * module.weight.element_size()
    return total


def gemv_config(text: str, shapes: dict) -> dict:
    """--gemv-config as launch overrides (``countdown.kernels.overrides(launch=...)``), entered before anything
    compiles."""
    changes = {}
    named = {**shapes, "up": (shapes["gate_up"][0] // 2, shapes["gate_up"][1])} if "gate_up" in shapes else shapes
    for name, cfg in json.loads(text).items():
        if name not in named:
            raise SystemExit(f"--gemv-config: unknown shape {name!r}; give one of {sorted(named)}")
        changes[("int4_gemv", named[name])] = cfg
        log(f"4-bit GEMV configuration of {name} {named[name]}: {cfg}")
    return changes


def decode_tps(model, ids, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(decode tokens/s, ms a step): best of ``repeats`` after a first, compiling call."""
    from countdown.decode.generate import generate_fast, reset_decoders

    mode = ids.is_cuda  # compiled on CUDA; eager on the CPU (the smoke check)
    reset_decoders(model)
    generate_fast(model, ids, new_tokens, compile=mode, eos_token_id=[])
    best = max((generate_fast(model, ids, new_tokens, compile=mode, eos_token_id=[])[1] for _ in range(repeats)),
               key=lambda s: s["decode_tokens_per_s"])
    return best["decode_tokens_per_s"], best["ms_per_step"]


def bf16_model(device: str, fields: dict | None = None):
    """The 8B shape (random weights, bf16) on CUDA; a tiny Llama on the CPU (the smoke check); ``fields``:
    config fields changed (the bound part's narrow model)."""
    if device == "cuda":
        return countdown.load_model("llama-3.1-8b-shape", dtype="bf16", device=device, random_weights=True,
                                    config_overrides=fields or None)[0]
    from transformers import AutoModelForCausalLM, LlamaConfig

    return AutoModelForCausalLM.from_config(LlamaConfig(**{**SMOKE, **(fields or {})})).eval()


def bound_part(device: str, args, stamp: dict) -> None:
    """The measured bound of mono's kept rows at ``--bound-k`` (``harness.int4bound``)."""
    from countdown.decode.linears import fastest_step
    from harness import int4bound

    def step_ms(model):
        model.generation_config.eos_token_id = None
        ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        fastest_step(model)
        return decode_tps(model, ids.to(device), args.new_tokens, args.repeats)[1]

    def gemv_us(n, k, config):
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        mods = make_modules(n, k, sets_for(mods_bytes(n, k), device), device)
        return time_graph(gemv_calls("countdown", mods, x, False, config), device=device)

    int4bound.run(lambda fields: bf16_model(device, fields), step_ms, gemv_us, append, log, device, stamp,
                  args.out, args.bound_k, int4bound.SELECT_US if args.select_us is None else args.select_us)


def step_rows(device, args, bw, stamp, worst, out):
    from countdown.decode.linears import fastest_step

    model = bf16_model(device)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []

    def add(weights, tps, ms, nbytes, ratio):
        row = {**stamp, "weights": weights, "method": "dense", "sparsity": 0.0, "tokens_per_s": round(tps, 2),
               "bw_share": round(nbytes * tps / bw, 4) if bw == bw else "",
               "gemv_roofline_ratio": "" if ratio is None else round(ratio, 3)}
        rows.append(row)
        append(os.path.join(out, "decode.csv"), DECODE_FIELDS, row)
        log(f"step {weights:13s} {tps:8.1f} tokens/s  {ms:6.3f} ms a step  {nbytes / 1e9:.2f} GB a step  "
            f"bw {row['bw_share']}")

    with torch.no_grad():
        if args.baselines:
            fastest_step(model)
            tps, ms = decode_tps(model, ids, args.new_tokens, args.repeats)
            add("bf16", tps, ms, step_bytes(model), None)
            fastest_step(model, on=False)
        countdown.quantize(model, group=GROUP, lm_head=True)
        torch.cuda.empty_cache() if device == "cuda" else None
        fastest_step(model)
        for backend in (["countdown", "torch"] + (["gemlite"] if have_gemlite() else [])
                        if device == "cuda" and args.baselines else ["countdown"]):
            use_backend(model, backend)
            try:
                tps, ms = decode_tps(model, ids, args.new_tokens, args.repeats)
            except Exception as e:  # noqa: BLE001  (a baseline that fails is reported, not fatal)
                log(f"step {backend}: {type(e).__name__}: {str(e)[:300]}")
                continue
            add(BACKEND_WEIGHTS[backend], tps, ms, step_bytes(model), worst.get(backend))
            if args.profile and backend == "countdown" and device == "cuda":
                profile_step(model, ids, args.new_tokens, stamp, {"weights": "int4", "method": "dense",
                                                                  "sparsity": 0.0}, out, log)
    base = {r["weights"]: r["tokens_per_s"] for r in rows if r["method"] == "dense"}
    for r in rows:
        log(f"  {r['weights']:13s} {r['method']:6s} {r['sparsity']:<4} {r['tokens_per_s']:8.1f} tokens/s  "
            + (f"{r['tokens_per_s'] / base['bf16']:.2f}x bf16  " if "bf16" in base else "")
            + f"{r['tokens_per_s'] / base['int4']:.2f}x int4"
            + (f"  {r['tokens_per_s'] / base['int4-torch']:.2f}x int4-torch" if "int4-torch" in base else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/int4")
    ap.add_argument("--run", default=datetime.datetime.now().strftime("%H%M"), help="the run column (groups a call)")
    ap.add_argument("--parts", default="sweep,gemv,step", help="any of sweep, gemv, rows, memory, prefill, step, bound")
    ap.add_argument("--tiles", default="", help="prefill part: our de-quantization's tiles, rows x bytes (8x256,...)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rows-ks", default="0.7", help="k of the rows part (the kept-rows kernel alone)")
    ap.add_argument("--gemv-config", default=None,
                    help="launch configuration of our 4-bit GEMV by shape for this call, over kernels/config.py's "
                    "launch table: JSON keyed by shape name (qkv, o_proj, gate_up, up, down, lm_head), e.g. "
                    "'{\"o_proj\": {\"PER_SM\": 2}}' (q/k/v, which hands the attention its finished output, keeps K "
                    "in one slice)")
    ap.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                    help="the step part's bf16 step and the baseline GEMVs (--no-baselines: ours only)")
    ap.add_argument("--bound-k", type=float, default=0.7, help="bound part: the sparsity k")
    ap.add_argument("--select-us", type=float, default=None,
                    help="bound part: the select kernel's microseconds a layer (default: run G16's profile, 1.95)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile each 4-bit step of ours (step_kernels.csv)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks this script only)")
    ap.add_argument("--report", action="store_true", help="write decode.md / .png from the CSVs in --out")
    args = ap.parse_args(argv)
    if args.report:
        if os.path.exists(os.path.join(args.out, "rows.csv")):
            from harness import int4rows

            int4rows.rows_report(args.out)
        from harness.int4report import report

        return report(args.out)
    parts = set(args.parts.split(","))
    run = contextlib.ExitStack()  # the launch configurations this call sets, for the whole call
    if args.gemv_config:
        run.enter_context(overrides(launch=gemv_config(args.gemv_config, SMOKE_SHAPES if args.smoke else SHAPES)))
    device = "cpu" if args.smoke else "cuda"
    from harness.timing import copy_bandwidth

    bw = copy_bandwidth() if device == "cuda" else float("nan")
    name = "CPU" if device == "cpu" else torch.cuda.get_device_name()
    stamp = {"run": args.run, "device": name, "date": datetime.date.today().isoformat()}
    os.makedirs(args.out, exist_ok=True)
    log(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    worst = {}
    with torch.no_grad():
        if "sweep" in parts and device == "cuda":
            best = sweep(device, shapes, bw)
            run.enter_context(overrides(launch={("int4_gemv", shape): cfg for shape, cfg in best.items()}))
            log(f"4-bit GEMV launch configurations by shape: {best}")
        if "gemv" in parts:
            worst = gemv_table(device, shapes, bw, stamp, args.out)
    if "rows" in parts:
        from harness import int4rows

        with torch.no_grad():
            int4rows.kernel_rows(device, (256, 512) if args.smoke else (4096, 14336),
                                 [float(k) for k in args.rows_ks.split(",")],
                                 (int4rows.SMOKE_DOWN, int4rows.SMOKE_SELECT, int4rows.SMOKE_OTHER) if args.smoke
                                 else (int4rows.DOWN_GRID, int4rows.SELECT_GRID, int4rows.OTHER_GRID), stamp,
                                 args.out, bw)
    if "memory" in parts:
        from harness import int4rows

        int4rows.memory_rows({"run": stamp["run"], "date": stamp["date"]}, args.out)
    if "prefill" in parts:
        from harness import int4prefill

        int4prefill.run(bf16_model(device), device, args.out, stamp, args.tiles, args.repeats)
    if "step" in parts:
        step_rows(device, args, bw, stamp, worst, args.out)
    if "bound" in parts:
        bound_part(device, args, stamp)


if __name__ == "__main__":
    main()
