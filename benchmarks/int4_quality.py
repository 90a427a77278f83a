"""Quality of 4-bit weights on the real models, dense and sparse, on the CPU (issue 45, item 4).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/int4_quality.py \\
        --models smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m --out results/int4

Reference: the model as ``countdown.load_model`` gives it, its GGUF file de-quantized, in float32 (the CSV's
``*_vs_bf16`` columns are named for the bf16 model a GPU runs; the ``bf16`` row says how far bf16 is from it).
Weights (``--weights``, one dense row each; ``method = dense``):

* ``fp32``: the reference against itself (0 by construction: checks the harness); ``bf16``: the model cast to bf16;
* ``int4-rtn-g32`` / ``-g64`` / ``-g128``: every decoder Linear rounded to 4 bits (``countdown.quantize(model,
  group=G)``), the route of a user with a bf16 checkpoint;
* ``int4-gguf``: ``countdown.quantize(model, source="gguf")``: the file's own 4-bit blocks, exact by construction
  (checked: identical logits); tensors the file keeps at 5-8 bits (Q5_0, Q6_K, Q8_0) stay so, as loaded;
* ``int4-gguf+rtn-gG``: the same with ``requantize=True``: those tensors rounded to 4 bits (RTN, groups of G), the
  file's 4-bit blocks kept exact; only where the GGUF route leaves some in float (Gemma, Qwen).

Sparse rows (``--sparse-weights`` x ``--methods`` x ``--ks``): ``dual:ideal`` is D-CountDown SP-Ideal (u and g from
the model's own weights, 4-bit on a 4-bit model: the full gate / up read, kept rows of down), the other specs
SP-Prac (``mono`` / ``cats`` thresholds, ``teal``, ``dual[shadow4]``) with artifacts from ``countdown.ensure_artifacts``
built on the weights being measured (the 4-bit model itself; default calibration, Wikipedia passages; cached in
``--artifacts-dir``). A 4-bit model is computed through its float twin (``float_twin``: the same de-quantized
weights in nn.Linear, which is what Int4Linear's reference computes, at half the CPU time); the script checks
per 4-bit weights that the twin's logits equal the 4-bit model's, dense and with the first SP-Prac method at the
first k, and that the artifacts' fingerprint is the 4-bit model's.

Scores: decode-style (512-token windows of held-out XSum, the first half a dense prompt, the second half sparse
and scored; ``countdown.bench.quality``): perplexity increase, KL, top-1 against the reference and (json) against
the same weights dense; Sparsity-Real measured. Writes ``<out>/<model>.csv`` (the columns of FIELDS, kept as they
are) and ``<out>/<model>.json`` (every figure); each row as it finishes, atomically: a killed run resumes, and a
row already there is skipped (the settings must match, else the script stops).
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import platform
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import countdown
from countdown.bench.quality import compare_held, decode_quality, held_out
from countdown.bench.qualitygrid import artifact_tag
from countdown.eval.cost import mlp_weight_bytes
from countdown.fingerprint import model_fingerprint
from countdown.int4 import Int4Linear
from countdown.int4.quantize import int4_config
from countdown.io import atomic_write, file_lock, write_json
from countdown.mlp import find_gated_mlps
from countdown.spec import parse_specs
from countdown.state import dense_prefix

FIELDS = ["weights", "method", "sparsity", "sparsity_real", "ppl_increase_vs_bf16", "kl_vs_bf16"]
WEIGHTS = "fp32,bf16,int4-rtn-g32,int4-rtn-g64,int4-rtn-g128,int4-gguf,int4-gguf+rtn-g128"
SPARSE_WEIGHTS = "fp32,int4-gguf,int4-rtn-g128"
METHODS = "dual:ideal,mono,cats,teal,dual[shadow4]"
KS = "0.5,0.6,0.7"
MODELS = "smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m"
IDEAL = ":ideal"
BOUND = 0.05  # the target: decode-style perplexity within +5 % of bf16 dense


def build(label: str, reference):
    """The model of a weights label, from a copy of the reference."""
    if label == "fp32":
        return reference
    if label == "bf16":
        return copy.deepcopy(reference).to(torch.bfloat16)
    if match := re.fullmatch(r"int4-rtn-g(\d+)", label):
        return countdown.quantize(copy.deepcopy(reference), group=int(match[1]))
    if label == "int4-gguf":
        return countdown.quantize(copy.deepcopy(reference), source="gguf")
    if match := re.fullmatch(r"int4-gguf\+rtn-g(\d+)", label):
        return countdown.quantize(copy.deepcopy(reference), source="gguf", requantize=True, group=int(match[1]))
    raise SystemExit(f"unknown weights {label!r}: fp32, bf16, int4-rtn-g<G>, int4-gguf, int4-gguf+rtn-g<G>")


def float_twin(model):
    """The model with each Int4Linear replaced by an nn.Linear holding its de-quantized weight: Int4Linear's reference
    forward is ``F.linear(x, dequantize(...), bias)``, so the twin computes the same numbers (checked by the caller)."""
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, Int4Linear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device=module.qweight.device, dtype=module.compute_dtype)
            linear.weight = nn.Parameter(module.weight.detach(), requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
            twin.set_submodule(name, linear)
    return twin


def mlp_bytes(model) -> tuple[float, int, int]:
    """Bytes per weight of the Gated-MLPs as held (4-bit: codes, scales and offsets), d_model, d_inter."""
    held = count = 0
    for mlp in find_gated_mlps(model):
        for linear in (getattr(mlp.module, a) for a in (mlp.gate, mlp.up, mlp.fused, mlp.down) if a):
            count += linear.in_features * linear.out_features
            held += linear.int4.nbytes if isinstance(linear, Int4Linear) else 2 * linear.weight.numel()  # bf16
    mlp = find_gated_mlps(model)[0]
    return held / count, mlp.d_model, mlp.d_inter


def bytes_fraction(spec, ideal: bool, kept: float, elem: float, d_model: int, d_inter: int) -> float:
    """Weight bytes a decode token reads per Gated-MLP, over the dense MLP's, at ``elem`` bytes a weight (bf16: 2).
    dual SP-Ideal reads W_gate and W_up in full (they are the indicator) and the kept rows of W_down."""
    if spec.is_dense:
        return 1.0
    if ideal:
        return (2 + kept) / 3 if spec.method == "dual" else float("nan")
    opts = {k: v for k, v in spec.options.items() if k in ("bits", "group", "d_rank")}
    dense = mlp_weight_bytes("dense", d_model, d_inter, 1.0, elem_bytes=elem)
    return mlp_weight_bytes(spec.roofline_kind, d_model, d_inter, kept, elem_bytes=elem, **opts) / dense


def label_of(spec, ideal: bool) -> str:
    return f"{spec.label} (SP-Ideal)" if ideal else spec.label


def write(out: Path, name: str, meta: dict, rows: dict, order: list) -> None:
    """<name>.json (every figure) and <name>.csv (FIELDS), rows in a fixed order, each file atomically."""
    def rank(row):
        weights = order.index(row["weights"]) if row["weights"] in order else len(order)
        return weights, row["method"] != "dense", row["method"], row["sparsity"]
    ordered = sorted(rows.values(), key=rank)
    write_json(out / f"{name}.json", {**meta, "rows": ordered}, what="int4 quality")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in ordered:
        writer.writerow({**row, "sparsity": f"{row['sparsity']:g}", "sparsity_real": f"{row['sparsity_real']:.4f}",
                         "ppl_increase_vs_bf16": f"{row['ppl_increase_vs_bf16']:.6f}",
                         "kl_vs_bf16": f"{row['kl_vs_bf16']:.6g}"})
    atomic_write(out / f"{name}.csv", buf.getvalue(), what="int4 quality")
    atomic_write(out / f"{name}.md", report(meta, ordered), what="int4 quality")


def report(meta: dict, rows: list) -> str:
    """<name>.md: every row, the sparse 4-bit ones within BOUND in bold, the best of them (fewest MLP bytes) starred."""
    def vs_bf16(row):  # MLP bytes a token reads over the bf16 dense MLP's
        return row["mlp_bytes_fraction"] * meta["notes"].get(row["weights"], {}).get("mlp_bytes_per_weight", 2) / 2
    ok = [r for r in rows if r["method"] != "dense" and r["ppl_increase_vs_bf16"] <= BOUND]
    best4 = min((r for r in ok if r["weights"].startswith("int4")), key=vs_bf16, default=None)
    best = min((r for r in ok if r["weights"] == "fp32"), key=vs_bf16, default=None)
    s = meta["settings"]
    lines = [f"# 4-bit weights, dense and sparse: {meta['model']}", ""]
    for what, row in (("sparse 4-bit configuration", best4), ("sparse configuration on the reference weights (bf16 on a GPU)", best)):
        lines.append(f"- **best {what} within +{100 * BOUND:g} % of bf16 dense**: " + (
            "none" if row is None else f"{row['weights']} {row['method']} at k = {row['sparsity']:g} "
            f"({100 * row['ppl_increase_vs_bf16']:+.2f} %, Sparsity-Real {row['sparsity_real']:.3f}): its MLP reads "
            f"{row['mlp_bytes_fraction']:.3f} of its dense MLP's bytes, {vs_bf16(row):.3f} of bf16 dense's"))
    scored = next((r["tokens"] for r in rows), 0)
    lines += [f"- {meta['date']}, {meta['device']}, torch {meta['torch']}; decode-style, {s['tokens']} held-out "
              f"XSum tokens in windows of {s['window']} ({scored} scored); `{meta['command']}`", "",
              "| weights | method | k | Sparsity-Real | ppl vs bf16 | ppl vs its dense | KL vs bf16 | KL vs its dense "
              "| top-1 vs bf16 | MLP bytes vs its dense | vs bf16 dense |", "|" + "---|" * 11]
    for r in rows:
        mark = " ★" if r is best4 or r is best else ""
        bold = "**" if r in ok else ""
        lines.append(f"| {r['weights']} | {bold}{r['method']}{bold}{mark} | {r['sparsity']:g} | {r['sparsity_real']:.3f} "
                     f"| {bold}{100 * r['ppl_increase_vs_bf16']:+.2f} %{bold} | {100 * r['ppl_increase_vs_dense']:+.2f} % "
                     f"| {r['kl_vs_bf16']:.4f} | {r['kl_vs_dense']:.4f} | {r['top1_vs_bf16']:.3f} "
                     f"| {r['mlp_bytes_fraction']:.3f} | {vs_bf16(r):.3f} |")
    return "\n".join(lines) + "\n"


def first_window_logits(model, held, sparse: bool):
    with torch.no_grad():
        if not sparse:
            return model(held.rows[:1]).logits
        with dense_prefix(model, held.prompt):
            return model(held.rows[:1]).logits


def run_model(name: str, args, out: Path) -> None:
    import json

    path = out / f"{name}.json"
    settings = {"tokens": args.tokens, "window": 512, "prompt_fraction": 0.5, "text": "xsum", "threads": args.threads,
                "calibration": "countdown.ensure_artifacts defaults", "path": "masked"}
    old = json.loads(path.read_text()) if path.exists() else {}
    if old and old.get("settings") != settings:
        sys.exit(f"{path} holds rows measured with other settings ({old.get('settings')}); use another --out or "
                 "remove it")
    rows = {(r["weights"], r["method"], r["sparsity"]): r for r in old.get("rows", [])}
    weights = [w for w in args.weights.split(",") if w]
    sparse_weights = [w for w in args.sparse_weights.split(",") if w]
    order = list(dict.fromkeys(weights + sparse_weights))
    methods = [(spec, entry.endswith(IDEAL)) for entry in args.methods.split(",") if entry
               for spec in parse_specs(entry.removesuffix(IDEAL))]
    methods = [(spec if ideal else spec.resolved(), ideal) for spec, ideal in methods]
    ks = [float(k) for k in args.ks.split(",")]
    meta = {"model": name, "settings": settings, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "device": f"CPU ({platform.processor() or platform.machine()}, {args.threads} torch thread(s), "
                      f"{torch.backends.cpu.get_cpu_capability()})", "command": " ".join(sys.argv),
            "notes": old.get("notes", {}), "runs": old.get("runs", [])}
    start_model, cpu_model, before = time.perf_counter(), time.process_time(), len(rows)
    reference, tokenizer = countdown.load_model(name)
    reference.eval()
    held = held_out(reference, tokenizer, max_tokens=args.tokens)
    print(f"{name}: reference decode-style perplexity {held.dense_ppl:.4f} on {held.scored} scored tokens "
          f"({held.rows.shape[0]} windows of {held.rows.shape[1]})", flush=True)
    for label in order:
        if meta["notes"].get(label, {}).get("skipped"):
            continue
        todo = [(spec, ideal, k) for spec, ideal in methods for k in ks if label in sparse_weights
                and (label, label_of(spec, ideal), k) not in rows]
        if label == "int4-gguf" and meta["notes"].get(label, {}).get("kept_in_float"):
            todo = []  # no sparse rows where the GGUF route leaves Linears in float (below)
        if (label, "dense", 0.0) in rows and not todo:
            continue
        start, cpu = time.perf_counter(), time.process_time()
        model = build(label, reference)
        record = int4_config(model) or {}
        if label.startswith("int4-gguf+") and not record.get("kept"):
            meta["notes"][label] = {"skipped": "the GGUF route maps every Linear: int4-gguf is this model"}
            print(f"{label}: skipped, {meta['notes'][label]['skipped']}", flush=True)
            continue
        twin = float_twin(model) if record else model
        variant = held if model is reference else held_out(twin, tokenizer, max_tokens=args.tokens)
        if record:  # the twin computes the 4-bit model's numbers: same logits, same fingerprint
            same = torch.equal(first_window_logits(model, held, False), first_window_logits(twin, held, False))
            if not same or model_fingerprint(find_gated_mlps(model)) != model_fingerprint(find_gated_mlps(twin)):
                sys.exit(f"{label}: the float twin does not compute the 4-bit model's numbers")
        dense = compare_held(held, variant)
        exact = label == "int4-gguf" and torch.equal(
            first_window_logits(model, held, False), first_window_logits(reference, held, False))
        if label == "int4-gguf" and not (exact and dense["kl"] == 0.0):
            sys.exit("the GGUF route did not reproduce the de-quantized model exactly")
        elem, d_model, d_inter = mlp_bytes(model)
        meta["notes"][label] = {**meta["notes"].get(label, {}), "int4": record.get("int4"), "kept_in_float": record.get("kept"),
                                "mlp_bytes_per_weight": elem, "identical_logits_to_reference": bool(
                                    exact or model is reference)}
        rows[(label, "dense", 0.0)] = {
            "weights": label, "method": "dense", "sparsity": 0.0, "sparsity_real": 0.0,
            "ppl_increase_vs_bf16": dense["ppl_increase"], "kl_vs_bf16": dense["kl"], "top1_vs_bf16": dense["top1"],
            "ppl": dense["ppl"], "reference_ppl": held.dense_ppl, "ppl_increase_vs_dense": 0.0, "kl_vs_dense": 0.0,
            "top1_vs_dense": 1.0, "tokens": dense["tokens"], "mode": "", "mlp_bytes_fraction": 1.0,
            "seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(time.process_time() - cpu, 1)}
        write(out, name, meta, rows, order)
        print(f"{label:20s} dense: ppl {dense['ppl']:.4f} ({100 * dense['ppl_increase']:+.2f} %), KL {dense['kl']:.5f},"
              f" top-1 {dense['top1']:.4f}{'  (identical logits)' if exact else ''}", flush=True)
        if label not in sparse_weights:
            continue
        if label == "int4-gguf" and record.get("kept"):
            print(f"{label}: no sparse rows, the GGUF route leaves {sum(record['kept'].values())} Linears at 5-8 bits "
                  "(the reference's own weights): see int4-gguf+rtn and fp32", flush=True)
            continue
        checked = not record
        bar = tqdm(total=len(todo), desc=f"{name} {label}", file=sys.stdout, disable=args.no_progress)
        for spec, ideal in methods:
            cells = [k for k in ks if (label, label_of(spec, ideal), k) not in rows]
            if not cells:
                continue
            art, tag, about = None, "", ""
            if not ideal:
                built, built_cpu = time.perf_counter(), time.process_time()
                art = countdown.ensure_artifacts(twin, tokenizer, spec, ks, args.artifacts_dir, progress=False)
                tag = artifact_tag(art)
                data = art.meta["data"]
                about = f"{art.kind}, {data.get('num_tokens')} tokens of {data.get('name')}, built on {label}"
                took = {"tag": tag, "wall_seconds": round(time.perf_counter() - built, 1),
                        "cpu_seconds": round(time.process_time() - built_cpu, 1)}
                made = meta["notes"][label].setdefault("artifacts", {})
                if made.get(spec.label, {}).get("tag") != tag:  # built (or first met) in this run
                    made[spec.label] = took
                bar.write(f"  {spec.label}: artifacts ({about}, tag {tag}) in {took['wall_seconds']:.0f} s")
            for k in cells:
                start, cpu = time.perf_counter(), time.process_time()
                mode = "ideal" if ideal else "prac"
                if not checked:  # the twin's sparse logits are the 4-bit model's, on the 4-bit model's artifacts
                    logits = []
                    for m in (model, twin):
                        countdown.sparsify(m, spec, k, mode=mode, artifacts=art, path="masked")
                        logits.append(first_window_logits(m, held, True))
                        countdown.unsparsify(m)
                    if not torch.equal(*logits):
                        sys.exit(f"{label}: the float twin's {spec.label} logits differ from the 4-bit model's")
                    checked = True
                countdown.sparsify(twin, spec, k, mode=mode, artifacts=art, path="masked")
                try:
                    q = decode_quality(twin, held, others=[variant] if variant is not held else [])
                finally:
                    countdown.unsparsify(twin)
                own = q["others"][0] if "others" in q else q
                method = label_of(spec, ideal)
                rows[(label, method, k)] = {
                    "weights": label, "method": method, "sparsity": k, "sparsity_real": q["sparsity_real"],
                    "ppl_increase_vs_bf16": q["ppl_increase"], "kl_vs_bf16": q["kl"], "top1_vs_bf16": q["top1"],
                    "ppl": q["ppl"], "reference_ppl": held.dense_ppl, "ppl_increase_vs_dense": own["ppl_increase"],
                    "kl_vs_dense": own["kl"], "top1_vs_dense": own["top1"], "tokens": q["tokens"], "mode": mode,
                    "artifacts": about, "artifact_tag": tag, "seconds": round(time.perf_counter() - start, 1),
                    "cpu_seconds": round(time.process_time() - cpu, 1),
                    "mlp_bytes_fraction": bytes_fraction(spec, ideal, 1 - q["sparsity_real"], elem, d_model, d_inter)}
                write(out, name, meta, rows, order)
                bar.update()
                bar.write(f"  {label:18s} {method:18s} k={k:g}: {100 * q['ppl_increase']:+7.2f} % vs bf16 "
                          f"({100 * own['ppl_increase']:+.2f} % vs its dense), KL {q['kl']:.4f}, Sparsity-Real "
                          f"{q['sparsity_real']:.3f} ({rows[(label, method, k)]['seconds']:.0f} s)")
        bar.close()
        del model, twin, variant
    meta["runs"].append({"date": meta["date"], "rows_added": len(rows) - before, "command": meta["command"],
                         "wall_seconds": round(time.perf_counter() - start_model, 1),
                         "cpu_seconds": round(time.process_time() - cpu_model, 1)})
    write(out, name, meta, rows, order)


def main(argv=None) -> None:
    from countdown.data.texts import cache_root

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=MODELS, help=f"catalogue names, comma-separated (default {MODELS})")
    parser.add_argument("--weights", default=WEIGHTS, help=f"dense rows (default {WEIGHTS})")
    parser.add_argument("--sparse-weights", default=SPARSE_WEIGHTS,
                        help=f"weights that get sparse rows (default {SPARSE_WEIGHTS}; int4-gguf only where the GGUF "
                             "route makes the whole decoder 4-bit)")
    parser.add_argument("--methods", default=METHODS,
                        help=f"specs; SPEC{IDEAL} runs SP-Ideal, any other SP-Prac (default {METHODS})")
    parser.add_argument("--ks", default=KS, help=f"sparsities (default {KS})")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="held-out XSum tokens, in 512-token windows whose second half is scored (default 2048: "
                             "4 windows, 1,024 scored tokens, as the operating-point tables)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; part of the settings)")
    parser.add_argument("--artifacts-dir", default=str(cache_root() / "artifacts"),
                        help="cache of SP-Prac artifacts (default: countdown's cache, shared with the sweeps)")
    parser.add_argument("--out", default="results/int4")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in [m for m in args.models.split(",") if m]:
        with file_lock(out / f"{name}.csv", what="int4 quality table"):
            run_model(name, args, out)


if __name__ == "__main__":
    main()
