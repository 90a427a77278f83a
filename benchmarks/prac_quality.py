"""Quality of every practical dual kind against dual SP-Ideal and the threshold methods, one model.

    PYTHONPATH=src python benchmarks/prac_quality.py --model smollm2-135m --out results/prac_quality

results/prac_quality/<model>.csv / .md / .png hold the rows of every run into that folder (each row's
device and date in the CSV; the .md names the last run's command, e.g. ``--model smollm2-135m --specs
dual[shadow4-s] --sparsity 0.5,0.7,0.8,0.9 --out results/prac_quality``, 2026-11-27, and for gemma3-270m
``--model gemma3-270m --specs dual[shadow4-g32] --sparsity 0.7,0.8 --threads 1``, 2026-11-23).

Per configuration (method spec x k): perplexity with every position sparse and decode-style (first
half of each window a dense prompt), teacher-forced KL(dense || sparse) and top-1 agreement on the
same windows, Sparsity-Real, and for SP-Prac kinds the mask precision / recall / F1 against the
dual oracle on held-out text. Artifacts are built with the library defaults on the calibration
text (Wikipedia passages; never the XSum evaluation text) and cached. Rows are appended to
``<out>/<model>.csv`` as they finish (a rerun skips the rows it has), then a Markdown table and a
plot are written beside it.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import countdown
from countdown.eval.agreement import kl_and_top1
from countdown.data.texts import cache_root, eval_texts
from countdown.io import atomic_write, file_lock
from countdown.eval.perplexity import token_windows
from countdown.spec import parse_spec, resolve_mode

FIELDS = ["model", "method", "mode", "sparsity", "sparsity_real", "ppl_all", "ppl_decode", "kl", "top1",
          "precision", "recall", "f1", "seconds", "device", "date"]
# The configurations, as the CSV labels them; countdown.spec parses each (a kind in brackets: SP-Prac, else
# SP-Ideal; dual[shadow4-g32] / -pooled / teal[greedy] / teal[uniform] are its legacy labels). --specs takes any spec.
SPECS = ["dual", "dual[shadow4]", "dual[shadow2]", "dual[shadow3]", "dual[shadow8]", "dual[shadow4-pooled]",
         "dual[shadow4-g32]", "dual[shadow4-s]", "dual[hybrid]", "dual[lowrank]", "mono", "mono[threshold]",
         "cats[threshold]", "teal", "teal[greedy]", "teal[uniform]"]
# an experiment (session 23): the kept rows' coefficients s = u~ act(g~) taken from the shadows themselves, so
# that a kernel would read only W_down's kept rows after the shadow GEMV (see s_from_shadows)
EXPERIMENTS = {"dual[shadow4-s]": "dual[shadow4]"}


def spec_of(label: str):
    """``(spec, mode)`` of a CSV label."""
    spec = parse_spec(EXPERIMENTS.get(label, label))
    return spec, resolve_mode(spec, None)


@contextmanager
def s_from_shadows(model, on: bool):
    """With ``on``, each sparsified shadow layer's masked forward uses the shadows' own u~ and act(g~) for the kept
    rows of its sparse positions (the rows still chosen by the selector as usual; dense positions exact): the MLP
    output sum_i s~_i W_down[i] of the "dual[shadow4-s]" experiment. Off: nothing changes."""
    if not on:
        yield
        return
    from torch.nn import functional as F

    from countdown.kernels.shadow.format import dequantize
    from countdown.patch.state import state_of

    layers = state_of(model).layers
    for layer in layers:
        sel = layer.selector
        wg, wu = dequantize(sel.q_gate, sel.s_gate), dequantize(sel.q_up, sel.s_up)

        def masked(x2, token_sparse, layer=layer, wg=wg, wu=wu):
            mlp = layer.mlp
            u, g = mlp.parts(x2)
            h = mlp.act(g)
            keep = layer._select(x2, u, h, token_sparse)
            xf = x2.float()
            s_shadow = ((xf @ wu.t()) * mlp.act(xf @ wg.t())).to(u.dtype)
            s = s_shadow if token_sparse is None else torch.where(token_sparse[:, None], s_shadow, u * h)
            s = torch.where(keep, s, torch.zeros((), dtype=u.dtype, device=u.device))
            return F.linear(s, mlp.w_down, mlp.b_down)

        object.__setattr__(layer, "_masked", masked)
    try:
        yield
    finally:
        for layer in layers:
            object.__delattr__(layer, "_masked")


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path: Path, rows: list[dict]) -> None:
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


@torch.no_grad()
def kl_top1(model, rows: torch.Tensor, dense_logits: list[torch.Tensor]) -> tuple[float, float]:
    kls, agree = [], []
    for batch, dense in zip(rows.split(1), dense_logits):
        with countdown.dense_prefix(model, 0):
            sparse = model(batch).logits.float()
        kl, top1 = kl_and_top1(dense, sparse)
        kls.append(kl.mean())
        agree.append(top1.double().mean())
    return float(torch.stack(kls).mean()), float(torch.stack(agree).mean())


def markdown(rows: list[dict], model: str) -> str:
    ks = sorted({float(r["sparsity"]) for r in rows if r["sparsity"]})
    lines = [f"# Practical dual kinds vs SP-Ideal: {model}", "",
             "Perplexity (every position sparse / decode-style), in brackets Sparsity-Real; KL in nats; "
             "recall of the dual oracle's rows (mask P/R/F1 on 2,048 held-out XSum tokens). Decode-style scores only the second half of each 512-token window (the first half a dense prompt), so it is not comparable with the dense all-positions figure. Full rows in the CSV beside this file.", "",
             "| method | mode | " + " | ".join(f"k={k:g}" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    dense = next((r for r in rows if r["method"] == "dense"), None)
    if dense:
        lines.append("| dense | — | " + " | ".join(f"{float(dense['ppl_all']):.2f} / {float(dense['ppl_decode']):.2f}"
                                                   for _ in ks) + " |")
    for spec in dict.fromkeys([*SPECS, *(r["method"] for r in rows if r["method"] != "dense")]):
        cells = {float(r["sparsity"]): r for r in rows if r["method"] == spec}
        if not cells:
            continue
        mode = spec_of(spec)[1]
        out = []
        for k in ks:
            r = cells.get(k)
            if r is None:
                out.append("—")
                continue
            rec = f", rec {float(r['recall']):.2f}" if r["recall"] else ""
            out.append(f"{float(r['ppl_all']):.2f} / {float(r['ppl_decode']):.2f} ({float(r['sparsity_real']):.3f}; "
                       f"KL {float(r['kl']):.2f}{rec})")
        lines.append(f"| {spec} | {mode} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in dict.fromkeys([*SPECS, *(r["method"] for r in rows if r["method"] != "dense")]):
        pts = sorted((float(r["sparsity"]), float(r["ppl_all"])) for r in rows if r["method"] == spec)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=spec, linestyle="--" if spec_of(spec)[1] == "ideal" else "-")
    dense = next((r for r in rows if r["method"] == "dense"), None)
    if dense:
        ax.axhline(float(dense["ppl_all"]), color="k", lw=0.8, label="dense")
    ax.set_yscale("log")
    ax.set_xlabel("k (fraction of rows skipped)")
    ax.set_ylabel("perplexity, every position sparse (log)")
    ax.set_title(f"{model}: practical dual kinds vs SP-Ideal (XSum)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    from countdown.io import atomic_path

    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--specs", default=",".join(SPECS))
    p.add_argument("--sparsity", default="0.5,0.7,0.8,0.9")
    p.add_argument("--tokens", type=int, default=2048, help="XSum tokens per perplexity (default 2048)")
    p.add_argument("--kl-windows", type=int, default=2, help="windows of 256 tokens for KL / top-1 (default 2)")
    p.add_argument("--quality-tokens", type=int, default=2048, help="held-out tokens for mask P/R/F1 (default 2048)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/prac_quality")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ks = [float(k) for k in args.sparsity.split(",")]
    out = Path(args.out)
    csv_path = out / f"{args.model}.csv"
    with file_lock(csv_path, what="quality table"):
        rows = read_rows(csv_path)
        done = {(r["method"], float(r["sparsity"] or "nan")) for r in rows}
        model, tok = countdown.load_model(args.model)
        texts = eval_texts()
        kl_rows = token_windows(tok, texts, 255 * args.kl_windows, 256)
        with torch.no_grad():
            dense_logits = [model(b).logits.float() for b in kl_rows.split(1)]
        stamp = dict(model=args.model, device=f"CPU ({torch.get_num_threads()} threads), fp32",
                     date=time.strftime("%Y-%m-%d"))

        def add(row):
            rows.append({**{f: "" for f in FIELDS}, **stamp, **row})
            write_rows(csv_path, rows)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

        if ("dense", math.nan) not in done and not any(r["method"] == "dense" for r in rows):
            t0 = time.time()
            ppl = countdown.perplexity(model, tok, max_tokens=args.tokens, progress=False)
            ppl_dec = countdown.perplexity(model, tok, max_tokens=args.tokens, metric="decode", progress=False)
            add(dict(method="dense", mode="-", sparsity="", ppl_all=f"{ppl:.4f}", ppl_decode=f"{ppl_dec:.4f}",
                     kl="0", top1="1", seconds=f"{time.time() - t0:.1f}"))
        cache = cache_root() / "artifacts"
        for spec in re.split(r",(?![^\[]*\])", args.specs):
            config, mode = spec_of(spec)
            method = config.method
            todo = [k for k in ks if (spec, k) not in done]
            if not todo:
                continue
            art = None
            if mode == "prac":
                t0 = time.time()
                art = countdown.ensure_artifacts(model, tok, config, ks, cache, progress=False)
                print(f"{spec}: artifacts ready in {time.time() - t0:.0f} s", flush=True)
                report = countdown.predictor_quality(model, tok, art, num_tokens=args.quality_tokens, progress=False) \
                    if method == "dual" else None
            for k in todo:
                t0 = time.time()
                shadow_s = spec in EXPERIMENTS
                countdown.sparsify(model, config, k, mode=mode, artifacts=art, scope="all")
                with s_from_shadows(model, shadow_s):
                    ppl_all = countdown.perplexity(model, tok, max_tokens=args.tokens, progress=False)
                    real = countdown.sparsity_real(model)["mean"]
                    kl, top1 = kl_top1(model, kl_rows, dense_logits)
                countdown.unsparsify(model)
                countdown.sparsify(model, config, k, mode=mode, artifacts=art, scope="decode")
                with s_from_shadows(model, shadow_s):
                    ppl_dec = countdown.perplexity(model, tok, max_tokens=args.tokens, metric="decode", progress=False)
                countdown.unsparsify(model)
                q = report["by_sparsity"][k] if art is not None and method == "dual" else {}
                add(dict(method=spec, mode=mode, sparsity=f"{k:g}", sparsity_real=f"{real:.4f}",
                         ppl_all=f"{ppl_all:.4f}", ppl_decode=f"{ppl_dec:.4f}", kl=f"{kl:.4f}", top1=f"{top1:.4f}",
                         precision=f"{q['precision']:.4f}" if q else "", recall=f"{q['recall']:.4f}" if q else "",
                         f1=f"{q['f1']:.4f}" if q else "", seconds=f"{time.time() - t0:.1f}"))
        atomic_write(out / f"{args.model}.md", markdown(rows, args.model)
                     + f"\nThe rows come from every run into this folder (each row's device and date: {args.model}.csv); "
                     f"the last: {stamp['device']}, {stamp['date']}, `PYTHONPATH=src python {' '.join(sys.argv)}`\n")
        plot(rows, out / f"{args.model}.png", args.model)
    print(markdown(rows, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
