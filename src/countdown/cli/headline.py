"""The main job in a few minutes: dense against the recommended practical configuration on the default model.

``countdown demo`` (``make demo``) loads SmolLM2-135M, builds the SP-Prac artifact of :data:`SPEC` at :data:`K`
(the configuration the operating-point tables recommend for this model: within +5 % decode-style perplexity of
dense), and shows, for dense and that configuration: decode-style perplexity on held-out XSum text, the
Sparsity-Real, a greedy continuation of one prompt side by side, and the decode speed this machine measured
(countdown.generate, batch 1; on a CPU it is honest about not paying), and where the project's GPU figure of the
same configuration is (the README, docs/results.md). It writes ``demo.md``, ``demo.csv`` and ``demo.png``.
``countdown demo --full`` runs the grid of every method, mode and k instead (``cli/demo.py``).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import statistics
import sys
import time
from pathlib import Path

import torch

SPEC, K = "dual[shadow4]", 0.5
PROMPT = "Explain in two sentences why the sky is blue."
FIELDS = ["model", "config", "ppl_decode", "ppl_increase", "sparsity_real", "tokens_per_s", "vs_dense", "device"]
# The stages of the demo and the seconds each is given: the 157 s of results/demo/headline (2-core CPU, an empty
# cache) split by stage as an estimate. They are the overall bar's units, so its first estimate of the time left is
# of that order; tqdm then follows this run's own pace. Download and de-quantize happen on the first run only, as does
# the calibration (its artifact is cached).
STAGES = (("download + de-quantize the model (first run only)", 45), ("calibrate (first run only)", 40),
          ("score dense and sparse", 45), ("decode", 30))


def _speed(model, ids: torch.Tensor, new_tokens: int, repeats: int) -> float:
    """Median tokens/s of ``repeats`` greedy decodes of ``new_tokens`` (countdown.generate, EOS off)."""
    from ..decode.generate import generate

    runs = [generate(model, ids, new_tokens, eos_token_id=[], return_stats=True)[1]["tokens_per_s"]
            for _ in range(repeats)]
    return statistics.median(runs)


class Progress:
    """The demo's overall progress bar (stderr): :data:`STAGES` in order, each advancing the bar by its measured
    seconds when it ends, with tqdm's estimate of the time left; ``progress=False``: no bar."""

    def __init__(self, progress: bool = True):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=sum(s for _, s in STAGES), desc="countdown demo", unit="s", disable=not progress,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")
        self.index = -1
        self.quiet = not progress

    def next(self) -> None:
        """Close the current stage (if any) and start the next."""
        if self.index >= 0:
            self.bar.update(STAGES[self.index][1])
        self.index += 1
        if self.index < len(STAGES):
            self.bar.set_description_str(f"countdown demo, {STAGES[self.index][0]}")

    def close(self) -> None:
        while self.index < len(STAGES):
            self.next()
        self.bar.close()

    def log(self, message: str) -> None:
        """A line of the demo's output, written above the bar (stdout)."""
        if self.quiet:
            print(message)
        else:
            self.bar.write(message, file=sys.stdout)


def run_headline(model_name: str = "smollm2-135m", out_dir: str | os.PathLike = "demo_out", max_tokens: int = 2048,
                 new_tokens: int = 48, speed_tokens: int = 64, repeats: int = 3, log=None, device: str = "cpu",
                 progress: bool = True) -> dict:
    """Run the headline demo; returns the rows and the paths written. ``out_dir`` is checked writable and locked
    before the model loads (a second demo into the same folder stops at once). ``device``: where the model runs
    (the command line's --device rule: cuda when PyTorch sees a GPU, else cpu); the dtype is bf16 on cuda, fp32 on
    cpu. ``progress``: a bar per stage (download, de-quantize, calibrate, score, decode) with the time left;
    ``log``: where the output lines go (default: stdout, above the bars)."""
    from ..io import claim_output
    from ..options import check_all

    check_all(max_tokens=max_tokens, max_new_tokens=new_tokens, samples=repeats)  # the numbers before any work
    check_all(max_new_tokens=speed_tokens)
    with claim_output(out_dir, "--out", "demo folder", folder=True, lock_name="demo.md"):
        stages = Progress(progress)
        try:
            return _run_headline(Path(out_dir), model_name, max_tokens, new_tokens, speed_tokens, repeats,
                                 log or stages.log, device, stages)
        finally:
            stages.close()


def _run_headline(out: Path, model_name: str, max_tokens: int, new_tokens: int, speed_tokens: int, repeats: int,
                  log, device: str, stages: Progress) -> dict:
    from .. import load_model, perplexity, prepare, sparsity_real
    from ..data.texts import cache_root, eval_texts
    from ..decode.generate import generate
    from .demo import chat_prompt

    t0 = time.time()
    log(f"countdown demo: dense against {SPEC} at k = {K} on {model_name} (countdown demo --full: every method); "
        f"about {sum(s for _, s in STAGES) // 60 + 1} minutes on 2 CPU cores from an empty cache")
    stages.next()
    model, tok = load_model(model_name, dtype="auto", device=device)
    device = next(model.parameters()).device
    log(f"  model loaded in {time.time() - t0:.0f} s")
    stages.next()
    start = time.time()
    art = prepare(model, tok, SPEC, K, cache_dir=cache_root() / "artifacts", progress=not stages.quiet)
    log(f"  {SPEC} artifact (4-bit shadows of W_gate / W_up, cuts calibrated on Wikipedia passages) ready in "
        f"{time.time() - start:.0f} s")
    stages.next()
    texts = eval_texts()
    ids = chat_prompt(tok, PROMPT).to(device)
    scores = {}
    for config in ("dense", SPEC):  # quality first, then every decode: the bar's stages in order
        with _config(model, config, art):
            start = time.time()
            scores[config] = (perplexity(model, tok, texts, max_tokens=max_tokens, metric="decode",
                                         progress=not stages.quiet, desc=f"perplexity, {config}"),
                              sparsity_real(model)["mean"] if config != "dense" else 0.0, time.time() - start)
    stages.next()
    rows, texts_out = [], {}
    for config in ("dense", SPEC):
        ppl, real, seconds = scores[config]
        with _config(model, config, art):
            start = time.time()
            gen = generate(model, ids, new_tokens, eos_token_id=tok.eos_token_id)
            texts_out[config] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
            tps = _speed(model, ids, speed_tokens, repeats)
        rows.append({"model": model_name, "config": "dense" if config == "dense" else f"{SPEC} k={K:g}",
                     "ppl_decode": round(ppl, 3), "sparsity_real": round(real, 4), "tokens_per_s": round(tps, 2),
                     "device": _device_name(device)})
        log(f"  {rows[-1]['config']}: perplexity {ppl:.2f}, {tps:.1f} tokens/s "
            f"({seconds + time.time() - start:.0f} s)")
    dense = rows[0]
    for row in rows:
        row["ppl_increase"] = round(row["ppl_decode"] / dense["ppl_decode"] - 1, 4)
        row["vs_dense"] = round(row["tokens_per_s"] / dense["tokens_per_s"], 3)
    paths = _write(out, rows, texts_out, max_tokens, time.time() - t0)
    log("\n" + (out / "demo.md").read_text())
    return {"rows": rows, **paths}


@contextlib.contextmanager
def _config(model, config: str, art):
    """``model`` as ``config`` says for the block: dense as loaded, or sparsified with :data:`SPEC` at :data:`K`."""
    from .. import sparsify, unsparsify

    if config == "dense":
        yield
        return
    sparsify(model, SPEC, K, artifacts=art)
    try:
        yield
    finally:
        unsparsify(model)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def _write(out: Path, rows: list[dict], texts: dict, max_tokens: int, seconds: float) -> dict:
    from ..io import atomic_write

    dense, sparse = rows
    on_cpu = dense["device"].startswith("CPU")
    verdict = ("slower than dense here: on a CPU the kept rows are gathered, which costs what skipping saves"
               if sparse["vs_dense"] < 1 else "faster than dense here")
    md = [f"# countdown demo: {dense['model']}", "",
          f"Dense against **{SPEC} at k = {K:g}**, the practical configuration the operating-point tables recommend "
          f"for this model. Perplexity: decode-style (the first half of each 512-token window a dense prompt, the "
          f"second half scored), {max_tokens} tokens of held-out XSum text. Speed: greedy decoding of batch 1 "
          f"through countdown.generate on {dense['device']}.", "",
          "| configuration | perplexity | increase | Sparsity-Real | tokens/s | vs dense |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['config']} | {r['ppl_decode']:.2f} | {100 * r['ppl_increase']:+.1f} % | "
                  f"{r['sparsity_real']:.3f} | {r['tokens_per_s']:.1f} | {r['vs_dense']:.2f}x |")
    md += ["", f"Speed measured here: {sparse['vs_dense']:.2f}x, {verdict}." if on_cpu else
           f"Speed measured here: {sparse['vs_dense']:.2f}x.",
           "On a GPU: the README and docs/results.md (\"Operating points per real model\") give this configuration's "
           "decode speed measured on an NVIDIA H200.", "",
           "## Generation (greedy, prompt dense, new tokens sparse)", "", f"Prompt: *{PROMPT}*", "",
           "| configuration | continuation |", "|---|---|"]
    md += [f"| {name} | {text.replace('|', '/').replace(chr(10), ' ')} |" for name, text in
           zip((r["config"] for r in rows), texts.values())]
    md += ["", f"Demo time {seconds:.0f} s. `countdown demo --full` runs every method, mode and k."]
    paths = {"markdown": out / "demo.md", "csv": out / "demo.csv", "plot": out / "demo.png"}
    atomic_write(paths["markdown"], "\n".join(md) + "\n", what="demo table", option="--out")
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(paths["csv"], table.getvalue(), what="demo table", option="--out")
    _plot(rows, paths["plot"])
    return paths


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..io import atomic_path

    labels = [r["config"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.bar(labels, [r["ppl_decode"] for r in rows], color=["tab:gray", "tab:orange"])
    left.set_title("decode-style perplexity (lower is better)", fontsize=9)
    right.bar(labels, [r["tokens_per_s"] for r in rows], color=["tab:gray", "tab:orange"])
    right.set_title(f"tokens/s on {rows[0]['device']}", fontsize=9)
    for ax in (left, right):
        ax.tick_params(labelsize=8)
    fig.tight_layout()
    with atomic_path(path, suffix=".png", what="demo plot", option="--out") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
