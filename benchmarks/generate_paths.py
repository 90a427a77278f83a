"""What each generation path gives a user: transformers' own generate (eager; static cache + torch.compile)
and countdown.generate, dense and sparsified, on one GPU, in one call.

    PYTHONPATH=src python benchmarks/generate_paths.py --out results --run A
    PYTHONPATH=src python benchmarks/generate_paths.py --out results --run B --paths hf-static-compile \\
        --methods "dual[shadow4]"                                   # spread the slow compiles over calls
    PYTHONPATH=src python benchmarks/generate_paths.py --smoke --out /tmp/gp     # a check of this script (CPU)
    PYTHONPATH=src python benchmarks/generate_paths.py --report --out results       # generate_paths.md / .png

The Llama-3.1-8B shape with random weights (values do not change batch-1 speed), bf16, batch 1, a prompt of 64
random tokens, ``--new-tokens`` greedy tokens (EOS off). Sparse rows use speed-only artifacts whose cuts are
fitted on the model's own decode steps (``countdown.bench.speedonly``), k switched in place between rows (no
re-patching, no recompilation). Paths (``path`` column):

* ``hf-eager``: ``model.generate`` as loaded;
* ``hf-static-compile``: ``generation_config.cache_implementation = "static"``: transformers compiles its decode
  steps (``torch.compile``, CUDA graphs) on the first call, which is not timed;
* ``countdown``: ``countdown.generate`` (the fastest step, compiled on its first call, not timed); undone after
  its rows so that the next method's transformers rows see the model as loaded.

Every call re-measures the dense row of each path it times; ``tokens_per_s`` counts the new tokens over the
whole call (prefill included), ``bw_share`` is the dense model's weight bytes a step times tokens/s over the
copy bandwidth measured in the same call (as the decode benchmark counts it). Rows append to
``<out>/generate_paths.csv`` with the columns ``run, device, date, path, method, sparsity, tokens_per_s,
bw_share`` (plus ``sparsity_real`` where measured and ``setup_s``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import time

import torch

FIELDS = ["run", "device", "date", "path", "method", "sparsity", "tokens_per_s", "bw_share", "sparsity_real",
          "setup_s"]
PATHS = ("hf-eager", "hf-static-compile", "countdown")
SMOKE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_generate(model, ids, n):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)


def time_path(model, path, ids, n, repeats):
    """(tokens/s of the best of ``repeats`` timed calls, seconds of the untimed first call)."""
    import countdown

    if path == "countdown":
        run = lambda: countdown.generate(model, ids, n, eos_token_id=[])  # noqa: E731
    else:
        model.generation_config.cache_implementation = "static" if path == "hf-static-compile" else None
        run = lambda: hf_generate(model, ids, n)  # noqa: E731
    sync()
    t0 = time.perf_counter()
    run()  # compiles / captures / warms up
    sync()
    setup = time.perf_counter() - t0
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        sync()
        assert out.shape[1] == ids.shape[1] + n, (path, out.shape)
        best = max(best, n / (time.perf_counter() - t0))
    model.generation_config.cache_implementation = None
    return best, setup


def undo_fast_step(model):
    from countdown.decode.generate import _FAST_STEP, reset_decoders
    from countdown.decode.linears import fastest_step

    if getattr(model, _FAST_STEP, False):
        fastest_step(model, on=False)
        delattr(model, _FAST_STEP)
    reset_decoders(model)


def report(out: str) -> None:
    """generate_paths.md (one table per run, each row against its own call's dense row of the same path)
    and generate_paths.png from ``<out>/generate_paths.csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(os.path.join(out, "generate_paths.csv"), newline="")))
    lines = ["# Generation paths: what a user gets", "",
             "Llama-3.1-8B shape (random weights), bf16, batch 1, 64-token prompt, 128 greedy tokens (prefill "
             "included), speed-only artifacts; each row against the dense row of the same path and call. "
             "`PYTHONPATH=src python benchmarks/generate_paths.py` (see its docstring for the calls).", ""]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels, values, colors = [], [], []
    palette = {"hf-eager": "tab:gray", "hf-static-compile": "tab:blue", "countdown": "tab:orange"}
    for run in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == run]
        dense = {r["path"]: float(r["tokens_per_s"]) for r in mine if r["method"] == "dense"}
        lines += [f"## Run {run} ({mine[0]['device']}, {mine[0]['date']})", "",
                  "| path | method | k | tokens/s | vs dense, same path | share of copy bandwidth |",
                  "|---|---|---|---|---|---|"]
        for r in mine:
            tps = float(r["tokens_per_s"])
            vs = f"{tps / dense[r['path']]:.2f}x" if r["path"] in dense else "-"
            lines.append(f"| {r['path']} | {r['method']} | {r['sparsity'] or '-'} | {tps:.1f} | {vs} | "
                         f"{float(r['bw_share']):.0%} |")
            labels.append(f"{run} {r['method']} {r['sparsity']}".strip())
            values.append(tps)
            colors.append(palette.get(r["path"], "k"))
        lines.append("")
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (batch 1)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in palette.values()], labels=list(palette),
              loc="upper right", fontsize=8)
    ax.set_title("transformers' generate (eager, static + compile) and countdown.generate")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "generate_paths.png"), dpi=120)
    with open(os.path.join(out, "generate_paths.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--run", default=datetime.datetime.now().strftime("%H%M"), help="the run column (groups a call)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--methods", default="mono,dual[shadow4],teal", help="method specs (countdown.spec)")
    ap.add_argument("--ks", default="0.7,0.9")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (checks this script only)")
    ap.add_argument("--report", action="store_true", help="write generate_paths.md / .png from the CSV in --out")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.out)

    import countdown
    from countdown.spec import parse_specs
    from countdown.bench.speedonly import (RANDOM_KINDS, IdTokenizer, decode_prompts, fit_cuts_on_decode,
                                           generated_texts, library_artifacts, random_artifacts, retarget)
    from harness.runner import on_device
    from harness.timing import copy_bandwidth
    from harness.weightbytes import step_weight_bytes

    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise SystemExit(f"unknown path(s) {bad}: choose from {PATHS}")
    ks = [float(k) for k in args.ks.split(",")]
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        from transformers import AutoModelForCausalLM, LlamaConfig

        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOKE)).eval()
        paths = [p for p in paths if p != "hf-static-compile"]
    else:
        model, _ = countdown.load_model("llama-3.1-8b-shape", dtype="bf16", device=device, random_weights=True)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
    copy_bps = copy_bandwidth() if device == "cuda" else float("nan")
    dense_bytes = step_weight_bytes(model, "dense", 1.0)
    name = "CPU" if device == "cpu" else torch.cuda.get_device_name()
    stamp = {"run": args.run, "device": name, "date": datetime.date.today().isoformat()}
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "generate_paths.csv")
    rows = []

    def add(path, method, k, tps, setup, real=""):
        row = {**stamp, "path": path, "method": method, "sparsity": "" if k is None else k,
               "tokens_per_s": round(tps, 2), "bw_share": round(dense_bytes * tps / copy_bps, 4) if copy_bps == copy_bps else "",
               "sparsity_real": real, "setup_s": round(setup, 1)}
        rows.append(row)
        new = not os.path.exists(csv_path)
        with open(csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)
        print(f"{path:18s} {method:14s} k={row['sparsity'] or '-':<4} {tps:8.1f} tokens/s  "
              f"bw {row['bw_share']}  setup {setup:.0f}s", flush=True)

    with torch.no_grad():
        for path in paths:
            tps, setup = time_path(model, path, ids, args.new_tokens, args.repeats)
            add(path, "dense", None, tps, setup)
            if path == "countdown":
                undo_fast_step(model)
        for spec in parse_specs(args.methods):
            spec = spec.resolved()
            if spec.kind in RANDOM_KINDS:
                art = on_device(random_artifacts(model, spec, ks), device)
            else:  # teal: the library's own fit on the dense model's greedy text
                texts = generated_texts(model, 64, 2048, 2)
                art = library_artifacts(model, spec, ks, texts, IdTokenizer(), num_tokens=2048)
            fit_cuts_on_decode(model, art, decode_prompts(model.config.vocab_size, 2, 64).to(device), new_tokens=16)
            countdown.sparsify(model, spec, ks[0], artifacts=art)
            try:
                for path in paths:
                    for k in ks:
                        retarget(model, art, k)
                        countdown.reset_sparsity_stats(model)
                        tps, setup = time_path(model, path, ids, args.new_tokens, args.repeats)
                        real = countdown.sparsity_real(model)["mean"]
                        add(path, spec.label, k, tps, setup, "" if real != real else round(real, 4))
                    if path == "countdown":
                        undo_fast_step(model)
            finally:
                countdown.unsparsify(model)
    print("\n| path | method | k | tokens/s | share of copy bandwidth |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['method']} | {r['sparsity'] or '-'} | {r['tokens_per_s']} | {r['bw_share']} |")


if __name__ == "__main__":
    main()
