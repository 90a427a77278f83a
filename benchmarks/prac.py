"""SP-Prac on the real SmolLM2-135M: build cost, predictor quality, perplexity and Sparsity-Real.

    PYTHONPATH=src python benchmarks/prac.py                      # writes results/prac.json and prac.md
    PYTHONPATH=src python benchmarks/prac.py --eval-tokens 16384  # a longer perplexity run

results/prac.json / .md (2-core CPU, 2026-11-21, 1 torch thread, the default token counts) came from the
first command with ``--demo-build`` naming a ``--build-only`` run's .json (the demo budget, 2 threads);
the exact command lines were not recorded (prac.json holds the device, threads and token counts).
Prints the perplexity ratios to dense and the mask F1 per configuration.

1. Build cost of the demo's artifacts with the library defaults (``ensure_artifacts`` into a fresh
   cache): mono and cats thresholds, dual and dejavu predictors, at k = 0.7 / 0.8 / 0.9 each.
   Wall time, CPU time of this process and peak RSS (``ru_maxrss``).
2. Variants: thresholds calibrated on the dense model only (``refine=False``, the paper's way);
   the paper's low-rank dual predictor (random init, as in the paper, and our gate-initialised
   one) with each selection rule; the default hybrid with top-k selection; dejavu by logit.
3. Predictor quality on held-out XSum text: precision / recall / F1 of the SP-Prac mask against the
   SP-Ideal mask, mean over layers, and the predictors' footprint.
4. Perplexity on XSum (``countdown.data.texts.eval_texts``), every position sparse (``scope="all"``),
   dense / SP-Ideal / SP-Prac, with the Sparsity-Real each run measured.

Calibration and training use ``countdown.data.texts.calibration_texts`` (Wikipedia); evaluation never does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

import countdown
from countdown import calibrate, ensure_artifacts, predictor_quality, train_predictors
from countdown.artifacts.store import footprint
from countdown.data.texts import eval_texts

KS = [0.7, 0.8, 0.9]


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, {"wall_s": round(time.perf_counter() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1),
                 "peak_rss_gb": round(peak_rss_gb(), 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="perplexity tokens (XSum)")
    parser.add_argument("--quality-tokens", type=int, default=4096, help="held-out tokens for F1")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "prac"),
                        help="path stem: writes <out>.json and <out>.md (default: results/prac)")
    parser.add_argument("--cache", default=None, help="artifact cache (default: a fresh temporary folder)")
    parser.add_argument("--build-tokens", type=int, default=None,
                        help="override the library's calibration/training token counts (smoke runs only)")
    parser.add_argument("--build-only", action="store_true", help="only time the demo's artifact builds")
    parser.add_argument("--demo-build", default=None,
                        help="a --build-only .json to include as the demo budget (measured at the default threads)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
                  f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "date": datetime.date.today().isoformat(),
        "model": args.model, "eval_tokens": args.eval_tokens, "quality_tokens": args.quality_tokens,
        "build": {}, "quality": {}, "perplexity": {},
    }

    if args.demo_build:
        demo = json.loads(Path(args.demo_build).read_text())
        report["demo_build"] = {key: demo[key] for key in ("device", "date", "build", "load_average_before",
                                                          "load_average_after")}

    def save():
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        out.with_suffix(".md").write_text(markdown(report))

    model, tok = countdown.load_model(args.model)
    cache = Path(args.cache or tempfile.mkdtemp(prefix="countdown-prac-"))
    extra = {} if args.build_tokens is None else {"num_tokens": args.build_tokens}

    # 1. the demo's artifacts, library defaults
    arts = {}
    total_wall = total_cpu = 0.0
    report["load_average_before"] = [round(v, 1) for v in os.getloadavg()]
    for method in ("mono", "cats", "dual", "dejavu"):
        arts[method], cost = timed(lambda: ensure_artifacts(model, tok, method, KS, cache, progress=False, **extra))
        report["build"][method] = {**cost, "kind": arts[method].kind,
                                   "tokens": arts[method].meta["data"]["num_tokens"],
                                   "d_rank": arts[method].meta.get("d_rank"),
                                   "epochs": arts[method].meta.get("training", {}).get("epochs")}
        total_wall += cost["wall_s"]
        total_cpu += cost["cpu_s"]
        print(f"build {method}: {report['build'][method]}", flush=True)
    report["build"]["total"] = {"wall_s": round(total_wall, 1), "cpu_s": round(total_cpu, 1),
                                "peak_rss_gb": round(peak_rss_gb(), 2)}
    report["load_average_after"] = [round(v, 1) for v in os.getloadavg()]
    save()
    if args.build_only:
        return 0

    # 2. variants: (label, artifacts, run perplexity?)
    def name(art, selection=None):
        rank = f" r{art.meta['d_rank']}" if art.meta.get("d_rank") else ""
        init = f" init={art.meta['training']['init']}" if art.kind in ("lowrank", "ternary") else ""
        refine = "" if art.meta.get("refine") else " refine=False"
        if art.kind == "threshold":
            return f"threshold {art.meta['rule']}{refine}"
        return f"{art.kind}{rank}{init}{refine} {selection or art.selection}"

    variants = {method: [(name(arts[method]), arts[method], True)] for method in arts}
    variants["dual"].append((name(arts["dual"], "topk"), arts["dual"].with_selection("topk"), True))
    variants["dejavu"].append((name(arts["dejavu"], "logit"), arts["dejavu"].with_selection("logit"), True))
    for method in ("mono", "cats"):  # the paper's calibration: dense model only, no refine pass
        paper, cost = timed(lambda: calibrate(model, tok, method, KS, refine=False, progress=False, **extra))
        report["build"][f"{method} refine=False"] = {**cost, "kind": "threshold", "tokens": paper.meta["data"]["num_tokens"]}
        variants[method].append((name(paper), paper, True))
    for init in ("gate", "random"):
        lowrank, cost = timed(lambda: train_predictors(model, tok, "dual", KS, kind="lowrank", init=init,
                                                       progress=False, **extra))
        report["build"][f"dual lowrank init={init}"] = {**cost, "kind": "lowrank", "tokens": lowrank.meta["data"]["num_tokens"],
                                                        "d_rank": lowrank.meta["d_rank"], "epochs": lowrank.meta["training"]["epochs"]}
        for selection in ("cut", "logit", "topk"):
            run_ppl = (init, selection) in (("gate", "cut"), ("gate", "logit"), ("random", "logit"))
            variants["dual"].append((name(lowrank, selection), lowrank.with_selection(selection), run_ppl))
    save()

    # 3. predictor quality (held-out XSum) and footprint
    texts = eval_texts()
    for method, entries in variants.items():
        for label, art, _ in entries:
            q = predictor_quality(model, tok, art, texts=texts, num_tokens=args.quality_tokens, progress=False)
            report["quality"][f"{method} {label}"] = {
                "footprint_share": round(footprint(art, model)["share"], 4),
                **{f"{k:g}": {key: round(v[key], 3) for key in ("precision", "recall", "f1", "sparsity")}
                   for k, v in q["by_sparsity"].items()},
            }
            print(f"quality {method} {label}: {report['quality'][f'{method} {label}']}", flush=True)
            save()

    # 4. perplexity, every position sparse
    def ppl(label, method=None, k=None, mode="ideal", art=None):
        if method is not None:
            countdown.sparsify(model, method, k, mode=mode, scope="all", artifacts=art)
        try:
            value, cost = timed(lambda: countdown.perplexity(model, tok, texts, max_tokens=args.eval_tokens,
                                                              progress=False))
            real = countdown.sparsity_real(model)["mean"] if method is not None else 0.0
        finally:
            if method is not None:
                countdown.unsparsify(model)
        report["perplexity"][label] = {"ppl": round(value, 3), "sparsity_real": round(real, 4),
                                       "wall_s": cost["wall_s"]}
        print(f"ppl {label}: {report['perplexity'][label]}", flush=True)
        save()

    ppl("dense")
    for k in KS:
        for method in ("cats", "mono", "dual", "dejavu"):
            ppl(f"{method} ideal k={k:g}", method, k)
            for label, art, run_ppl in variants[method]:
                if run_ppl:
                    ppl(f"{method} prac {label} k={k:g}", method, k, "prac", art)
    report["peak_rss_gb"] = round(peak_rss_gb(), 2)
    save()
    return 0


def markdown(report: dict) -> str:
    lines = [f"# SP-Prac on {report['model']}", "",
             f"Device: {report['device']}. Date: {report['date']}. Perplexity: XSum, "
             f"{report['eval_tokens']} tokens, every position sparse. F1: {report['quality_tokens']} held-out "
             "XSum tokens. Calibration/training: Wikipedia (countdown.data.texts.calibration_texts).", ""]
    demo = report.get("demo_build")
    if demo:
        lines += [f"## Demo budget: the four default artifacts, {demo['device']}, load average "
                  f"{demo['load_average_before'][0]} before / {demo['load_average_after'][0]} after", "",
                  "| artifact | kind | tokens | wall s | CPU s | peak RSS GB |", "|---|---|---|---|---|---|"]
        for name, b in demo["build"].items():
            lines.append(f"| {name} | {b.get('kind', '')} | {b.get('tokens', '')} | {b['wall_s']} | {b['cpu_s']} | "
                         f"{b['peak_rss_gb']} |")
        lines.append("")
    if report["build"]:
        lines += ["## Build cost in this run (library defaults, k = 0.7/0.8/0.9 in one artifact each)", "",
                  "| artifact | kind | tokens | d_rank | epochs | wall s | CPU s | peak RSS GB |", "|---|---|---|---|---|---|---|---|"]
        for name, b in report["build"].items():
            lines.append(f"| {name} | {b.get('kind', '')} | {b.get('tokens', '')} | {b.get('d_rank') or ''} | "
                         f"{'' if b.get('epochs') is None else b['epochs']} | {b['wall_s']} | {b['cpu_s']} | {b['peak_rss_gb']} |")
        lines.append("")
    if report["quality"]:
        lines += ["## Mask quality against SP-Ideal (held-out XSum; mean over layers)", "",
                  "| method / variant | footprint | F1 k=0.7 | F1 k=0.8 | P / R k=0.8 | F1 k=0.9 | skipped k=0.8 |",
                  "|---|---|---|---|---|---|---|"]
        for name, q in report["quality"].items():
            k8 = q.get("0.8", {})
            lines.append(f"| {name} | {q['footprint_share']:.2%} | {q.get('0.7', {}).get('f1', '')} | {k8.get('f1', '')} | "
                         f"{k8.get('precision', '')} / {k8.get('recall', '')} | {q.get('0.9', {}).get('f1', '')} | "
                         f"{k8.get('sparsity', '')} |")
        lines.append("")
    if report["perplexity"]:
        # one row per run, one column per k: "ppl (Sparsity-Real)"
        rows: dict[str, dict[str, str]] = {}
        for name, p in report["perplexity"].items():
            label, _, k = name.rpartition(" k=") if " k=" in name else (name, "", "-")
            rows.setdefault(label, {})[k] = f"{p['ppl']:.4g} ({p['sparsity_real']:.3f})"
        lines += ["## Perplexity (XSum, all positions sparse) and (Sparsity-Real)", "",
                  "| run | k=0.7 | k=0.8 | k=0.9 |", "|---|---|---|---|"]
        for label, by_k in rows.items():
            if "-" in by_k:
                lines.append(f"| {label} | {by_k['-']} | | |")
            else:
                lines.append(f"| {label} | " + " | ".join(by_k.get(f"{k:g}", "") for k in KS) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())


def rewrite_markdown(json_path: str) -> None:
    """Regenerate the .md beside a results .json (after editing the format)."""
    path = Path(json_path)
    path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
