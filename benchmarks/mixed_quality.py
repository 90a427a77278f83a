"""Quality of dual[mixed] on the real models, MLP only, on the CPU (issue 58, item 4).

    OMP_NUM_THREADS=2 nice -n 10 env PYTHONPATH=src python benchmarks/mixed_quality.py \\
        --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b --out results/mixed

Reference: the model as ``countdown.load_model`` gives it, its GGUF file de-quantized, in float32 (no bf16 checkpoint
exists here; the CSV's ``ppl_increase_vs_bf16`` is named for the bf16 model a GPU runs and is measured against this
fp32 model; the ``bf16`` row is the same model cast to bf16 and run so). Only the Gated-MLPs change; every other
Linear stays as loaded. Rows (``config``, ``k``):

* ``fp32`` (the reference), ``bf16``;
* ``int4-rtn-g64`` / ``int4-rtn-g128``: every MLP weight rounded to 4 bits (``format.quantize_rtn``, min-max RTN, fp16
  scales; computed through the de-quantized weights in nn.Linear, which is Int4Linear's reference); G = 128 only
  where it divides d_model and d_inter;
* ``int8-nested-g64`` / ``int4-high-g64``: the MLPs in the nested 8-bit format read whole, or at the high plane alone;
* ``dual[shadow4]``: D-CountDown skipping on the float model (4-bit shadows, calibrated cuts);
* ``dual[mixed]`` (calibrated cuts, the product) and ``dual[mixed]/topk`` (per-token top-(1 - k), the prototype's rule):
  the kept rows at 8 bits, the rest at 4; ``dual[mixed,rank=error]``: ranked by the expected size of each row's
  refinement (calibrated cuts); ``dual[mixed,rank=exact]/topk``: ranked by the exact 8-bit score (SP-Ideal);
  ``dual[mixed,kept=float]/topk``: the reference variant, kept rows in the model's precision, the rest the high planes.

Artifacts: ``countdown.prepare`` with ``cache_dir`` (default calibration text: Wikipedia passages, never the evaluation text;
cached in ``--artifacts-dir``). Score: ``countdown.perplexity(metric="decode")`` on ``--tokens`` tokens of XSum in
windows of 512 (the first half of each window a dense prompt, the second half sparse and scored: half the tokens are
scored). ``bits_read``: average bits read per MLP weight per decode token, scales and offsets included, from the
kinds' own byte counts at the measured kept share (1 - Sparsity-Real); float weights count 16 bits (a bf16
deployment's read), except the fp32 row (32). Writes ``<out>/<model>.csv`` (FIELDS, nothing else), ``<out>/<model>.json``
(the settings and per row the Sparsity-Real and seconds) and ``<out>/<model>.png``; each row as it finishes, under a
lock: a killed run resumes, a row already there is skipped (the settings must match, else the script stops).
``--configs`` runs only the named rows (a comma list of the ``config`` names above, commas inside brackets kept:
``--configs "fp32,bf16,dual[mixed],dual[mixed,kept=float]/topk"``; default: every row); the fp32 row runs whenever the
table has none (it is the reference).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import io
import json
import platform
import re
import time
from pathlib import Path

import torch

import countdown
from countdown.int4.format import quantize_rtn
from countdown.int4.nested_model import read_planes, to_nested
from countdown.io import atomic_write, file_lock, write_json
from countdown.selectors.base import get_kind

FIELDS = ["model", "config", "k", "bits_read", "ppl", "ppl_increase_vs_bf16"]
KS = "0.5,0.7,0.8,0.9,0.95"
MODELS = "smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b"
ROLES = ("gate", "up", "down")
CONFIGS = ["fp32", "bf16", "int4-rtn-g64", "int4-rtn-g128", "dual[shadow4]", "int8-nested-g{G}", "int4-high-g{G}",
           "dual[mixed]", "dual[mixed]/topk", "dual[mixed,rank=error]", "dual[mixed,rank=exact]/topk",
           "dual[mixed,kept=float]/topk"]


def split_configs(text: str) -> list[str]:
    """A comma list of config names; a comma inside brackets (``dual[mixed,kept=float]/topk``) does not split."""
    return [c.strip() for c in re.split(r",(?![^\[]*\])", text) if c.strip()]


class Table:
    """One model's CSV and JSON: the rows done, appended one at a time under the CSV's lock."""

    def __init__(self, out: Path, model: str, settings: dict):
        self.csv, self.json, self.model = out / f"{model}.csv", out / f"{model}.json", model
        out.mkdir(parents=True, exist_ok=True)
        self.meta = json.loads(self.json.read_text()) if self.json.is_file() else {"settings": settings, "rows": {}}
        if self.meta["settings"] != settings:
            raise SystemExit(f"{self.json} was written with other settings ({self.meta['settings']}); "
                             f"these are {settings}: use another --out, or remove the files to start over")
        self.rows = list(csv.DictReader(self.csv.open())) if self.csv.is_file() else []
        self.reference = next((float(r["ppl"]) for r in self.rows if r["config"] == "fp32"), None)

    @staticmethod
    def key(config: str, k: float | None) -> str:
        return f"{config}@{'' if k is None else f'{k:g}'}"

    def todo(self, config: str, ks: list[float | None]) -> list[float | None]:
        have = {self.key(r["config"], None if r["k"] == "" else float(r["k"])) for r in self.rows}
        return [k for k in ks if self.key(config, k) not in have]

    def add(self, config: str, k: float | None, bits: float, ppl: float, extra: dict) -> None:
        if config == "fp32":
            self.reference = ppl
        row = {"model": self.model, "config": config, "k": "" if k is None else f"{k:g}", "bits_read": f"{bits:.4f}",
               "ppl": f"{ppl:.4f}", "ppl_increase_vs_bf16": f"{ppl / self.reference - 1:.5f}"}
        with file_lock(self.csv, wait=600, what="results table"):
            self.rows.append(row)
            text = io.StringIO()
            writer = csv.DictWriter(text, FIELDS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(self.rows)
            atomic_write(self.csv, text.getvalue())
            self.meta["rows"][self.key(config, k)] = extra
            write_json(self.json, self.meta)
        print(f"{self.model:20s} {config:32s} k={row['k']:5s} bits {bits:6.3f}  ppl {ppl:8.3f}  "
              f"{100 * (ppl / self.reference - 1):+7.2f} %  ({extra})", flush=True)


@contextlib.contextmanager
def mlp_rtn(mlps, group: int):
    """Every MLP weight rounded to 4 bits (RTN, groups of ``group``), restored after."""
    saved = []
    with torch.no_grad():
        for mlp in mlps:
            for role in ROLES:
                linear = getattr(mlp.module, getattr(mlp, role))
                saved.append((linear, linear.weight.data))
                linear.weight.data = quantize_rtn(linear.weight.data, group).dequantize(linear.weight.dtype)
    try:
        yield
    finally:
        for linear, weight in saved:
            linear.weight.data = weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--ks", default=KS)
    ap.add_argument("--tokens", type=int, default=4096, help="XSum tokens read (half of them scored)")
    ap.add_argument("--variant-ks", default="", help="ks of the SP-Ideal and float-kept variants (default --ks)")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/mixed")
    ap.add_argument("--artifacts-dir", default=str(Path.home() / ".cache" / "countdown" / "artifacts"))
    ap.add_argument("--configs", default="",
                    help="only these rows: a comma list of config names (commas inside brackets kept), e.g. "
                         "'fp32,bf16,dual[mixed],dual[mixed,kept=float]/topk'; default: every row "
                         f"({', '.join(CONFIGS)}; G the --group)")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if args.configs:
        known = {c.replace("{G}", str(args.group)) for c in CONFIGS}
        unknown = [c for c in split_configs(args.configs) if c not in known]
        if unknown:
            ap.error(f"unknown --configs {unknown}; known: {sorted(known)}")
    torch.set_num_threads(args.threads)
    ks = [float(k) for k in args.ks.split(",")]
    for name in args.models.split(","):
        if not args.plot_only:
            run_model(name, ks, args)
        plot(Path(args.out), name)


def run_model(name: str, ks: list[float], args) -> None:
    settings = {"tokens": args.tokens, "window": 512, "metric": "decode", "group": args.group,
                "threads": args.threads, "torch": torch.__version__, "machine": platform.machine()}
    table = Table(Path(args.out), name, settings)
    chosen = set(split_configs(args.configs)) if args.configs else None

    def todo(config: str, at: list[float | None]) -> list[float | None]:
        """The ks of ``config`` still to run, none where --configs leaves it out."""
        return table.todo(config, at) if chosen is None or config in chosen else []

    model, tok = countdown.load_model(name)
    texts = countdown.load_texts("xsum")
    mlps = countdown.find_gated_mlps(model)
    d_model, d_inter = mlps[0].d_model, mlps[0].d_inter
    cache = args.artifacts_dir

    def measure(config, k, bits_of, target=None):
        target = model if target is None else target
        if countdown.is_sparsified(target):
            countdown.reset_sparsity_stats(target)
        start = time.perf_counter()
        ppl = countdown.perplexity(target, tok, texts=texts, max_tokens=args.tokens, window=512, metric="decode",
                                   progress=False)
        real = countdown.sparsity_real(target)["mean"] if countdown.is_sparsified(target) else None
        bits = bits_of(1.0 if real is None else 1.0 - real)
        table.add(config, k, bits, ppl, {"sparsity_real": real, "seconds": round(time.perf_counter() - start, 1)})

    def kind_bits(kind, meta):
        return lambda kept: 8 * get_kind(kind).weight_bytes(d_model, d_inter, kept, 2, meta) / (3 * d_model * d_inter)

    def sparse_rows(spec, config, art, meta, kind, at=ks):
        for k in todo(config, at):
            countdown.sparsify(model, spec, k, artifacts=art)
            try:
                measure(config, k, kind_bits(kind, meta))
            finally:
                countdown.unsparsify(model)

    # the float model as loaded
    if table.todo("fp32", [None]) or table.reference is None:
        measure("fp32", None, lambda kept: 32.0)
    if todo("bf16", [None]):
        half = copy.deepcopy(model).to(torch.bfloat16)
        measure("bf16", None, lambda kept: 16.0, half)
        del half
    for group in (64, 128):
        if d_model % group == 0 and d_inter % group == 0 and todo(f"int4-rtn-g{group}", [None]):
            with mlp_rtn(mlps, group):
                measure(f"int4-rtn-g{group}", None, lambda kept, g=group: 4 + 32 / g)
    if todo("dual[shadow4]", ks):
        art = countdown.prepare(model, tok, "dual[shadow4]", ks, cache_dir=cache)
        sparse_rows("dual[shadow4]", "dual[shadow4]", art, {"bits": 4, "group": 64}, "shadow")
    # the nested model: prepare converts it (a cached artifact does not: to_nested then does)
    spec = "dual[mixed]" if args.group == 64 else f"dual[mixedg{args.group}]"
    meta = {"group": args.group}
    variant_ks = [float(k) for k in args.variant_ks.split(",")] if args.variant_ks else ks
    nested = [todo(f"int8-nested-g{args.group}", [None]), todo(f"int4-high-g{args.group}", [None]),
              todo("dual[mixed]", ks), todo("dual[mixed]/topk", ks), todo("dual[mixed,rank=error]", ks),
              todo("dual[mixed,rank=exact]/topk", variant_ks)]
    if any(nested):
        if todo("dual[mixed]", ks) or todo("dual[mixed]/topk", ks):  # calibrated on the float model, as prepare does
            art = countdown.prepare(model, tok, spec, ks, cache_dir=cache)
        to_nested(model, args.group)
        if todo(f"int8-nested-g{args.group}", [None]):
            measure(f"int8-nested-g{args.group}", None, lambda kept: 8 + 64 / args.group)
        if todo(f"int4-high-g{args.group}", [None]):
            read_planes(model, "high")
            measure(f"int4-high-g{args.group}", None, lambda kept: 4 + 32 / args.group)
            read_planes(model, "both")
        if todo("dual[mixed]", ks):
            sparse_rows(spec, "dual[mixed]", art, meta, "mixed")
        if todo("dual[mixed]/topk", ks):
            sparse_rows(spec, "dual[mixed]/topk", art.with_selection("topk"), meta, "mixed")
        error = spec[:-1] + ",rank=error]"  # the rows whose refinement changes the output most (mixed_rows.row_score)
        if todo("dual[mixed,rank=error]", ks):
            sparse_rows(error, "dual[mixed,rank=error]", countdown.prepare(model, tok, error, ks, cache_dir=cache),
                        meta, "mixed")
        # the variants, for quality studies: ranked by the exact 8-bit score; kept rows as loaded (a fresh model)
        exact = spec[:-1] + ",rank=exact]"
        if todo("dual[mixed,rank=exact]/topk", variant_ks):
            art = countdown.prepare(model, tok, exact, variant_ks, cache_dir=cache, refine=False).with_selection("topk")
            sparse_rows(exact, "dual[mixed,rank=exact]/topk", art, meta, "mixed", variant_ks)
        del model
        model, tok = None, None
    if todo("dual[mixed,kept=float]/topk", variant_ks):
        if model is None:  # the nested conversion changed it
            model, tok = countdown.load_model(name)
        spec = spec[:-1] + ",kept=float]"
        art = countdown.prepare(model, tok, spec, variant_ks, cache_dir=cache, refine=False).with_selection("topk")
        sparse_rows(spec, "dual[mixed,kept=float]/topk", art, {**meta, "kept": "float"}, "mixed", variant_ks)


def plot(out: Path, name: str) -> None:
    """Perplexity against bits read a step, every configuration; the fp32 / bf16 rows as lines, +3 % / +5 %."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = out / f"{name}.csv"
    if not path.is_file():
        return
    rows = list(csv.DictReader(path.open()))
    ref = next((float(r["ppl"]) for r in rows if r["config"] == "fp32"), None)
    series: dict[str, list] = {}
    for r in rows:
        series.setdefault(r["config"], []).append((float(r["bits_read"]), float(r["ppl"]), r["k"]))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for ax, zoom in zip(axes, (False, True)):
        for i, (config, points) in enumerate(series.items()):
            points.sort()
            if config in ("fp32", "bf16"):
                ax.axhline(points[0][1], color="black" if config == "fp32" else "grey", lw=1,
                           label=f"{config} dense ({points[0][0]:g} bits)")
                continue
            xs, ys, _ = zip(*points)
            ax.plot(xs, ys, "o-" if len(points) > 1 else "s", ms=5, color=f"C{i % 10}", label=config)
            for x, y, k in points:
                if k and zoom:
                    ax.annotate(k, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        if ref is not None:
            for bound, dash in ((0.03, ":"), (0.05, "--")):
                ax.axhline(ref * (1 + bound), color="red", ls=dash, lw=0.8, label=f"fp32 +{bound:.0%}")
            if zoom:  # up to the dense 4-bit rows
                four = [p[1] for c, ps in series.items() if c.startswith("int4") for p in ps]
                ax.set_ylim(ref * 0.99, min(ref * 1.35, max([ref * 1.08] + [1.02 * y for y in four])))
                ax.set_xlim(4, 10)
        if not zoom:
            ax.set_yscale("log")
        ax.set_xlabel("bits read per MLP weight per decode token (scales included)")
        ax.set_ylabel("decode-style perplexity (XSum)")
        ax.set_title(f"{name}: {'near the reference' if zoom else 'every configuration'} "
                     "(k: share of rows at 4 bits / skipped)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
