"""Perplexity grids: every (method, mode, k) cell on held-out text, as a resumable CSV, a table and a plot.

Each finished cell is appended to the grid's CSV at once (atomically), so an interrupted run
resumes where it stopped and a second run only redoes what changed (``countdown demo``, the sweep's
perplexity cells).

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
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..patch.sparsify import reset_sparsity_stats, sparsify, sparsity_real, unsparsify, with_mode


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
    root = Path(__file__).resolve().parent.parent
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

    from ..io import atomic_write

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
    from ..io import atomic_path

    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def run_grid(model, tokenizer, model_name: str, configs: Sequence[tuple[str, str, float | None]],
             texts: Sequence[str], max_tokens: int, out_csv: Path, styles: Sequence[str] = tuple(STYLES),
             artifacts_for: Callable[[str, float], object] | None = None, log=print) -> list[Cell]:
    """Perplexity of each (method, mode, k) in each style, resuming from ``out_csv``: cells computed in
    another environment (:func:`environment_key`) are dropped and computed again."""
    from .perplexity import perplexity

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
            sparsify(model, with_mode(method, mode, artifacts), k, scope=scope, artifacts=artifacts)
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
