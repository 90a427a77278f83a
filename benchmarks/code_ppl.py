"""Code perplexity: a model on Python source (the standard library's own modules, no download), dense
and sparse, every position sparse. Written for Qwen2.5-Coder-0.5B (a coding model), any catalogue
model works.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/code_ppl.py --model qwen2.5-coder-0.5b \
        --sparsity 0.7,0.8,0.9 --out results/quality

results/quality/qwen2.5-coder-0.5b-code.csv / .md (CPU, fp32, 2026-11-23) came from that command; the
table gives each configuration's perplexity increase over dense.

Rows (model, method, mode, sparsity, sparsity_real, ppl, ppl_increase, tokens, python, seconds, date)
go to ``<out>/<model>-code.csv``, a Markdown table beside it; the run resumes: rows already in the CSV
are kept and not recomputed. SP-Prac artifacts are the sweep's (``prepare`` with ``cache_dir``, same cache);
``dual`` SP-Prac is the shadow kind (the default). The text depends on the Python version (recorded).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import os
import sys
import time

COLUMNS = ["model", "method", "mode", "sparsity", "sparsity_real", "ppl", "ppl_increase", "tokens", "python",
           "seconds", "date"]


def configs(methods: list[str], modes: list[str], ks: list[float]) -> list[tuple[str, str, float | None]]:
    out = [("dense", "", None)]
    out += [(m, mode, k) for mode in modes for m in methods for k in ks]
    return out


def key(row: dict) -> tuple:
    return (row["method"], row["mode"], f"{float(row['sparsity']):g}" if row["sparsity"] not in ("", None) else "")


def write(path: str, rows: list[dict]) -> None:
    from countdown.io import atomic_write

    order = {"": 0, "ideal": 1, "prac": 2}
    rows = sorted(rows, key=lambda r: (order.get(r["mode"], 3), r["method"], float(r["sparsity"] or 0)))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())
    md = ["| method | mode | k | Sparsity-Real | perplexity | vs dense |", "|---|---|---|---|---|---|"]
    md += [f"| {r['method']} | {r['mode'] or '-'} | {r['sparsity'] or '-'} | {r['sparsity_real'] or '-'} | "
           f"{float(r['ppl']):.3f} | {float(r['ppl_increase']) * 100:+.1f} % |" for r in rows]
    head = (f"# Code perplexity: {rows[0]['model']} on Python source (standard library {rows[0]['python']}, "
            f"{rows[0]['tokens']} tokens, every position sparse; CPU fp32, {rows[0]['date']})\n\n"
            f"`{' '.join(['PYTHONPATH=src python benchmarks/code_ppl.py'] + sys.argv[1:])}`\n\n")
    atomic_write(os.path.splitext(path)[0] + ".md", head + "\n".join(md) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--methods", default="dual,mono,cats")
    ap.add_argument("--modes", default="ideal,prac")
    ap.add_argument("--sparsity", default="0.8")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default="results/quality")
    args = ap.parse_args(argv)

    import countdown
    from countdown.data.code_text import python_text_version
    from countdown.data.texts import cache_root, load_texts
    from countdown.artifacts.prepare import prepare
    from countdown.patch.state import sparsity_real

    ks = [float(k) for k in args.sparsity.split(",")]
    path = os.path.join(args.out, f"{args.model}-code.csv")
    rows = list(csv.DictReader(open(path))) if os.path.exists(path) else []
    done = {key(r) for r in rows}
    model, tok = countdown.load_model(args.model)
    texts = load_texts("python")
    arts = {}
    dense_ppl = next((float(r["ppl"]) for r in rows if r["method"] == "dense"), None)
    for method, mode, k in configs(args.methods.split(","), args.modes.split(","), ks):
        row_key = (method, mode, f"{k:g}" if k is not None else "")
        if row_key in done:
            continue
        start = time.perf_counter()
        real = ""
        if method != "dense":
            if mode == "prac" and method not in arts:  # one file holds every k: read it once per method
                arts[method] = prepare(model, tok, method, ks, cache_dir=cache_root() / "artifacts", progress=False)
            art = arts.get(method) if mode == "prac" else None
            countdown.sparsify(model, method, k, mode=mode, artifacts=art, scope="all")
        try:
            ppl = countdown.perplexity(model, tok, texts=texts, max_tokens=args.tokens, prompt_fraction=0.0,
                                       desc=f"{method} {mode} {k}")
            if method != "dense":
                real = round(sparsity_real(model)["mean"], 4)
        finally:
            if method != "dense":
                countdown.unsparsify(model)
        if method == "dense":
            dense_ppl = ppl
        rows.append({"model": args.model, "method": method, "mode": mode, "sparsity": "" if k is None else k,
                     "sparsity_real": real, "ppl": round(ppl, 4), "ppl_increase": round(ppl / dense_ppl - 1, 4),
                     "tokens": args.tokens, "python": python_text_version(),
                     "seconds": round(time.perf_counter() - start, 1), "date": datetime.date.today().isoformat()})
        write(path, rows)
        print(f"{method:7s} {mode:5s} {k}: perplexity {ppl:.3f} ({rows[-1]['ppl_increase']:+.1%}) "
              f"Sparsity-Real {real}", flush=True)
    if rows:
        write(path, rows)  # re-rendered in order (and after an edit of this script's table) even when nothing ran
    return 0


if __name__ == "__main__":
    sys.exit(main())
