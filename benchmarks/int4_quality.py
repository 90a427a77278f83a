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
  file's 4-bit blocks kept exact; only where the GGUF route leaves some in float (Gemma, Qwen);
* ``<int4 weights>+downT-gG``: those weights with each W_down as a 4-bit W_down^T would hold it (RTN in groups of G
  along d_model, ``down_transposed``): the layout in which W_down's kept columns are contiguous, so that the row
  methods' skipped W_down reads are saved (``layout_of``); the format groups every Linear along its input, and a
  GGUF file's ffn_down blocks run along d_inter, where a kept column is a nibble inside a group of every row.

Sparse rows (``--sparse-weights`` x ``--methods`` x ``--ks``): ``dual:ideal`` is D-CountDown SP-Ideal (u and g from
the model's own weights, 4-bit on a 4-bit model: the full gate / up read, kept rows of down), the other specs
SP-Prac (``mono`` / ``cats`` thresholds, ``teal``, ``dual[shadow4]``) with artifacts from ``countdown.ensure_artifacts``
built on the weights being measured (the 4-bit model itself; default calibration, Wikipedia passages; cached in
``--artifacts-dir``). A 4-bit model is computed through its float twin (``float_twin``: the same de-quantized
weights in nn.Linear, which is what Int4Linear's reference computes, at half the CPU time); the script checks
per 4-bit weights that the twin's logits equal the 4-bit model's, dense and with the first SP-Prac method at the
first k, and that the twin's fingerprint (the one its artifacts carry) is the 4-bit model's (``+downT`` weights have
no 4-bit module to check against). ``int4-gguf`` gets sparse rows only where it makes the whole decoder 4-bit.

MLP bytes per token (json, .md): over the same weights' dense MLP, counting only the skips their layout makes pay.
Scores: decode-style (512-token windows of held-out XSum, the first half a dense prompt, the second half sparse
and scored; ``countdown.bench.quality``): perplexity increase, KL, top-1 against the reference and (json) against
the same weights dense; Sparsity-Real measured. Writes ``<out>/<model>.csv`` (the columns of FIELDS, kept as they
are), ``<out>/<model>.json`` (every figure) and ``<out>/<model>.md`` (every row, the best configurations within
BOUND named); each row as it finishes, atomically: a killed run resumes, and a row already there is skipped (the
settings must match, else the script stops). The same command gives the same numbers (torch threads are a setting).
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
from tqdm import tqdm

import countdown
from countdown.bench.quality import compare_held, decode_quality, held_out
from countdown.model.fingerprint import model_fingerprint
from countdown.int4.quantize import int4_config
from countdown.io import atomic_write, file_lock, write_json
from countdown.model.gated_mlp import find_gated_mlps
from countdown.spec import parse_specs
from countdown.patch.state import dense_prefix
from harness.int4quality import LAYOUTS, down_transposed, float_twin, mlp_bytes_fraction, mlp_bytes_per_weight
from harness.qualitygrid import artifact_tag

FIELDS = ["weights", "method", "sparsity", "sparsity_real", "ppl_increase_vs_bf16", "kl_vs_bf16"]
WEIGHTS = "fp32,bf16,int4-rtn-g32,int4-rtn-g64,int4-rtn-g128,int4-gguf,int4-gguf+rtn-g128"
SPARSE_WEIGHTS = "fp32,int4-gguf,int4-rtn-g128"
METHODS = "dual:ideal,mono,cats,teal,dual[shadow4]"
KS = "0.5,0.6,0.7"
MODELS = "smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m"
IDEAL = ":ideal"
BOUND = 0.05  # the target: decode-style perplexity within +5 % of bf16 dense


def build(label: str, reference):
    """The model of a weights label, from a copy of the reference (``+downT-gG``: see down_transposed)."""
    label = label.partition("+downT-g")[0]
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
    raise SystemExit(f"unknown weights {label!r}: fp32, bf16, int4-rtn-g<G>, int4-gguf, int4-gguf+rtn-g<G>, and any "
                     "int4 one with +downT-g<G>")


def layout_of(label: str) -> str:
    """The layout (harness.int4quality.LAYOUTS) of a weights label."""
    return "any" if not label.startswith("int4") else "downT" if "+downT-g" in label else "native"


def weights_key(label: str) -> tuple:
    """Table order: fp32, bf16, RTN by group, GGUF, GGUF + RTN; each +downT variant after its weights."""
    base, _, down = label.partition("+downT-g")
    kinds = ["fp32", "bf16", "int4-rtn-g", "int4-gguf", "int4-gguf+rtn-g"]
    kind = max((k for k in kinds if base.startswith(k)), key=len, default="")
    group = int(base[len(kind):] or 0) if base[len(kind):].isdigit() else 0
    return kinds.index(kind) if kind else len(kinds), group, int(down or 0), label


def label_of(spec, ideal: bool) -> str:
    return f"{spec.label} (SP-Ideal)" if ideal else spec.label


def with_bytes(row: dict, meta: dict) -> dict:
    """The row with ``mlp_bytes_fraction`` (over the same weights' dense MLP, in their layout) and
    ``mlp_bytes_vs_bf16`` (over the bf16 dense MLP's bytes)."""
    note, shape = meta["notes"].get(row["weights"], {}), meta["shape"]
    elem, layout = note.get("mlp_bytes_per_weight", 2.0), layout_of(row["weights"])
    ideal = row["method"].endswith(" (SP-Ideal)")
    spec = parse_specs(row["method"].removesuffix(" (SP-Ideal)"))[0]
    fraction = mlp_bytes_fraction(spec, ideal, 1 - row["sparsity_real"], elem, shape["d_model"], shape["d_inter"], layout)
    return {**row, "layout": layout, "mlp_bytes_fraction": fraction, "mlp_bytes_vs_bf16": fraction * elem / 2}


def write(out: Path, name: str, meta: dict, rows: dict) -> None:
    """<name>.json (every figure), <name>.csv (FIELDS) and <name>.md, rows in a fixed order, each file atomically."""
    labels = meta["methods"]
    meta["order"] = sorted(set(meta["order"]) | {row["weights"] for row in rows.values()}, key=weights_key)

    def rank(row):
        method = labels.index(row["method"]) if row["method"] in labels else len(labels)
        return weights_key(row["weights"]), method, row["method"], row["sparsity"]
    ordered = [with_bytes(row, meta) for row in sorted(rows.values(), key=rank)]
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
    """<name>.md: every row, those within BOUND of bf16 dense in bold; the best (fewest MLP bytes, fewer than its dense
    model's) on 4-bit and on the reference weights ★, the best 4-bit one within BOUND of its own dense model ☆."""
    def vs_bf16(row):  # MLP bytes a token reads over the bf16 dense MLP's (nan: a layout that cannot skip them)
        return row["mlp_bytes_vs_bf16"] if row["mlp_bytes_vs_bf16"] == row["mlp_bytes_vs_bf16"] else float("inf")
    ok = [r for r in rows if r["method"] != "dense" and r["ppl_increase_vs_bf16"] <= BOUND]
    pays = [r for r in ok if r["mlp_bytes_fraction"] < 1]  # fewer bytes than its dense model: a candidate
    best4 = min((r for r in pays if r["weights"].startswith("int4")), key=vs_bf16, default=None)
    best = min((r for r in pays if r["weights"] == "fp32"), key=vs_bf16, default=None)
    own = min((r for r in rows if r["method"] != "dense" and r["weights"].startswith("int4") and r["mlp_bytes_fraction"]
               < 1 and r["ppl_increase_vs_dense"] <= BOUND), key=vs_bf16, default=None)  # against its own 4-bit dense
    s = meta["settings"]
    lines = [f"# 4-bit weights, dense and sparse: {meta['model']}", ""]
    bound = f"+{100 * BOUND:g} %"
    for what, row in ((f"sparse 4-bit configuration within {bound} of bf16 dense", best4),
                      (f"sparse configuration on the reference weights (bf16 on a GPU) within {bound} of bf16 dense", best),
                      (f"sparse 4-bit configuration within {bound} of its own 4-bit dense model", own)):
        lines.append(f"- **best {what}**: " + (
            "none" if row is None else f"{row['weights']} {row['method']} at k = {row['sparsity']:g} "
            f"({100 * row['ppl_increase_vs_bf16']:+.2f} % vs bf16, {100 * row['ppl_increase_vs_dense']:+.2f} % vs its "
            f"dense, Sparsity-Real {row['sparsity_real']:.3f}): its MLP reads "
            f"{row['mlp_bytes_fraction']:.3f} of its dense MLP's bytes, {row['mlp_bytes_vs_bf16']:.3f} of bf16 dense's"))
    scored = next((r["tokens"] for r in rows), 0)
    commands = "; ".join(dict.fromkeys(f"`{run['command']}`" for run in meta["runs"] if run["rows_added"]))
    lines += [f"- {meta['date']}, {meta['device']}, torch {meta['torch']}; decode-style, {s['tokens']} held-out "
              f"XSum tokens in windows of {s['window']} ({scored} scored); {commands}",
              "- MLP bytes a token reads, over its dense MLP's and over bf16 dense's, in the weights' layout:"]
    for layout in dict.fromkeys(layout_of(w) for w in meta["order"]):
        which = ", ".join(w for w in meta["order"] if layout_of(w) == layout)
        lines.append(f"  `{layout}` ({which}): {LAYOUTS[layout]}")
    lines += ["",
              "| weights | method | k | Sparsity-Real | ppl vs bf16 | ppl vs its dense | KL vs bf16 | KL vs its dense "
              "| top-1 vs bf16 | MLP bytes vs its dense | vs bf16 dense |", "|" + "---|" * 11]
    for r in rows:
        mark = " ★" if r is best4 or r is best else " ☆" if r is own else ""
        bold = "**" if r in ok else ""
        lines.append(f"| {r['weights']} | {bold}{r['method']}{bold}{mark} | {r['sparsity']:g} | {r['sparsity_real']:.3f} "
                     f"| {bold}{100 * r['ppl_increase_vs_bf16']:+.2f} %{bold} | {100 * r['ppl_increase_vs_dense']:+.2f} % "
                     f"| {r['kl_vs_bf16']:.4f} | {r['kl_vs_dense']:.4f} | {r['top1_vs_bf16']:.3f} "
                     f"| {r['mlp_bytes_fraction']:.3f} | {r['mlp_bytes_vs_bf16']:.3f} |")
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
    meta = {"order": sorted(set(old.get("order", []) + order), key=weights_key), "methods": list(dict.fromkeys(
        old.get("methods", []) + ["dense"] + [label_of(spec, ideal) for spec, ideal in methods])), "model": name, "settings": settings, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "device": f"CPU ({platform.processor() or platform.machine()}, {args.threads} torch thread(s), "
                      f"{torch.backends.cpu.get_cpu_capability()})", "command": " ".join(sys.argv),
            "notes": old.get("notes", {}), "runs": old.get("runs", [])}
    start_model, cpu_model, before = time.perf_counter(), time.process_time(), len(rows)
    reference, tokenizer = countdown.load_model(name)
    reference.eval()
    meta["shape"] = {"d_model": find_gated_mlps(reference)[0].d_model, "d_inter": find_gated_mlps(reference)[0].d_inter}
    held = held_out(reference, tokenizer, max_tokens=args.tokens)
    print(f"{name}: reference decode-style perplexity {held.dense_ppl:.4f} on {held.scored} scored tokens "
          f"({held.rows.shape[0]} windows of {held.rows.shape[1]})", flush=True)
    for label in order:
        todo = [(spec, ideal, k) for spec, ideal in methods for k in ks if label in sparse_weights
                and (label, label_of(spec, ideal), k) not in rows]
        if label == "int4-gguf" and meta["notes"].get(label, {}).get("kept_in_float"):
            todo = []  # no sparse rows where the GGUF route leaves Linears in float (below)
        if (label, "dense", 0.0) in rows and not todo:
            continue
        start, cpu = time.perf_counter(), time.process_time()
        model = build(label, reference)
        record = int4_config(model) or {}
        if label.startswith("int4-gguf+rtn") and not any(how.startswith("rtn") for how in record.get("int4", {})):
            meta["notes"][label] = {"skipped": "the GGUF route maps every Linear: int4-gguf is this model"}
            print(f"{label}: skipped, {meta['notes'][label]['skipped']}", flush=True)
            continue
        twin = float_twin(model) if record else model
        if record:  # the twin computes the 4-bit model's numbers: same logits, same fingerprint
            same = torch.equal(first_window_logits(model, held, False), first_window_logits(twin, held, False))
            if not same or model_fingerprint(find_gated_mlps(model)) != model_fingerprint(find_gated_mlps(twin)):
                sys.exit(f"{label}: the float twin does not compute the 4-bit model's numbers")
        down_group = int(label.partition("+downT-g")[2] or 0)
        if down_group:  # W_down as W_down^T in 4 bits would hold it: on the twin only (no module holds this layout)
            down_group = down_transposed(twin, down_group)
        variant = held if twin is reference else held_out(twin, tokenizer, max_tokens=args.tokens)
        dense = compare_held(held, variant)
        exact = label == "int4-gguf" and torch.equal(
            first_window_logits(model, held, False), first_window_logits(reference, held, False))
        if label == "int4-gguf" and not (exact and dense["kl"] == 0.0):
            sys.exit("the GGUF route did not reproduce the de-quantized model exactly")
        elem = mlp_bytes_per_weight(model, down_group)
        kept_notes = {key: value for key, value in meta["notes"].get(label, {}).items() if key != "skipped"}
        meta["notes"][label] = {**kept_notes, "int4": record.get("int4"),
                                "kept_in_float": record.get("kept"), "down_transposed_group": down_group or None,
                                "mlp_bytes_per_weight": elem, "identical_logits_to_reference": bool(
                                    exact or model is reference)}
        rows[(label, "dense", 0.0)] = {
            "weights": label, "method": "dense", "sparsity": 0.0, "sparsity_real": 0.0,
            "ppl_increase_vs_bf16": dense["ppl_increase"], "kl_vs_bf16": dense["kl"], "top1_vs_bf16": dense["top1"],
            "ppl": dense["ppl"], "reference_ppl": held.dense_ppl, "ppl_increase_vs_dense": 0.0, "kl_vs_dense": 0.0,
            "top1_vs_dense": 1.0, "tokens": dense["tokens"], "mode": "",
            "seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(time.process_time() - cpu, 1)}
        write(out, name, meta, rows)
        print(f"{label:20s} dense: ppl {dense['ppl']:.4f} ({100 * dense['ppl_increase']:+.2f} %), KL {dense['kl']:.5f},"
              f" top-1 {dense['top1']:.4f}{'  (identical logits)' if exact else ''}", flush=True)
        if label not in sparse_weights:
            continue
        if label == "int4-gguf" and record.get("kept"):
            print(f"{label}: no sparse rows, the GGUF route leaves {sum(record['kept'].values())} Linears at 5-8 bits "
                  "(the reference's own weights): see int4-gguf+rtn and fp32", flush=True)
            continue
        checked = not record or bool(down_group)  # a +downT model has no 4-bit module to check against
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
                    "cpu_seconds": round(time.process_time() - cpu, 1)}
                write(out, name, meta, rows)
                bar.update()
                bar.write(f"  {label:18s} {method:18s} k={k:g}: {100 * q['ppl_increase']:+7.2f} % vs bf16 "
                          f"({100 * own['ppl_increase']:+.2f} % vs its dense), KL {q['kl']:.4f}, Sparsity-Real "
                          f"{q['sparsity_real']:.3f} ({rows[(label, method, k)]['seconds']:.0f} s)")
        bar.close()
        del model, twin, variant
    meta["runs"].append({"date": meta["date"], "rows_added": len(rows) - before, "command": meta["command"],
                         "wall_seconds": round(time.perf_counter() - start_model, 1),
                         "cpu_seconds": round(time.process_time() - cpu_model, 1)})
    write(out, name, meta, rows)


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
