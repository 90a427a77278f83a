"""The decode benchmark's outputs: decode.csv, decode.md, decode.png and decode_meta.json.

Every speed-up is taken within one run (same ``run`` id): against the best dense compiled harness
of the run, dense eager, and dense in the row's own harness.
"""

from __future__ import annotations

import csv
import io
import json
import os

DECODE_COLUMNS = [
    "device", "date", "run", "config", "method", "harness", "sparsity", "sparsity_real", "kept_union", "batch",
    "new_tokens", "tokens_per_s", "decode_tokens_per_s", "ms_per_step", "dense_compiled_tokens_per_s",
    "dense_eager_tokens_per_s", "speedup_vs_compiled", "speedup_vs_eager", "speedup_vs_dense_same_harness", "gbps",
    "copy_gbps", "bw_share", "weight_gb_per_step", "peak_mem_gb", "model_mem_gb", "setup_s", "graphs", "graph_breaks",
    "artifacts", "tokens_per_s_min", "tokens_per_s_max", "samples",
    # the one-compile benchmark adds: the step's roofline, and one Gated-MLP alone against its roofline
    "roofline_ms", "kernel_us", "kernel_roofline_us", "kernel_sparsity_real", "mlp_speedup",
    "decode_speedup_vs_compiled",  # decode steps/s (prefill left out) over the fastest compiled dense decoder's
]
COMPILED_HARNESSES = ("compile-cdt", "compile", "one-compile")  # the dense reference: the fastest of these


def fill_references(rows: list) -> None:
    """Dense compiled / eager tokens/s of the same run next to every row, and the speed-ups. The
    reference of a dense configuration is its median sample (``tokens_per_s``); with several dense
    rows of one configuration in a run (independent compiles), the fastest."""
    def find(run, harness, batch, n):
        found = [float(r["tokens_per_s"]) for r in rows
                 if r["run"] == run and r["method"] == "dense" and r["harness"] == harness
                 and int(r["batch"]) == int(batch) and int(r["new_tokens"]) == int(n)]
        return max(found) if found else None

    def find_decode(run, batch, n):
        found = [float(r["decode_tokens_per_s"]) for r in rows
                 if r["run"] == run and r["method"] == "dense" and r["harness"] in COMPILED_HARNESSES
                 and int(r["batch"]) == int(batch) and int(r["new_tokens"]) == int(n)
                 and r.get("decode_tokens_per_s") not in ("", None)]
        return max(found) if found else None

    for r in rows:
        ref = find_decode(r["run"], r["batch"], r["new_tokens"])
        r["decode_speedup_vs_compiled"] = ("" if ref is None or r.get("decode_tokens_per_s") in ("", None)
                                           else round(float(r["decode_tokens_per_s"]) / ref, 4))
        compiled = [find(r["run"], h, r["batch"], r["new_tokens"]) for h in COMPILED_HARNESSES]
        compiled = [c for c in compiled if c is not None]
        comp = max(compiled) if compiled else None
        eager = find(r["run"], "eager", 1, r["new_tokens"]) if int(r["batch"]) == 1 else None
        same = find(r["run"], r["harness"], r["batch"], r["new_tokens"])
        r["speedup_vs_dense_same_harness"] = "" if same is None else round(float(r["tokens_per_s"]) / same, 3)
        r["dense_compiled_tokens_per_s"] = "" if comp is None else comp
        r["dense_eager_tokens_per_s"] = "" if eager is None else eager
        r["speedup_vs_compiled"] = "" if comp is None else round(float(r["tokens_per_s"]) / comp, 3)
        r["speedup_vs_eager"] = "" if eager is None else round(float(r["tokens_per_s"]) / eager, 3)


def write_csv(rows: list, path: str) -> None:
    from countdown.io import atomic_write

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=DECODE_COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue(), what="decode table")


def _x(value) -> str:
    return "-" if value in ("", None) else f"{float(value):.2f}x"


def _f(value, fmt: str) -> str:
    return "-" if value in ("", None) else format(float(value), fmt)


def markdown(rows: list, metas: list) -> str:
    """One table per run (its figures are ratios within that run) under its device, date and exact
    command, with the dense baseline's spread, the skipped specs and the per-op breakdown."""
    lines = [f"# End-to-end decode: {metas[0].get('config', '') if metas else ''}", "",
             "tokens/s = batch x new tokens / (prefill + decode), the median of the row's samples (min / max "
             "beside it; one-compile rows take the median of 3 runs of the prompt as their prefill); vs dense "
             "compiled = against the dense compiled decoder of the same run; GB/s = weight "
             "bytes read per decode step (attention, norms, lm_head, embedding rows looked up; each Gated-MLP as "
             "the configuration reads it, countdown.eval.cost.mlp_weight_bytes at the measured kept fraction) x "
             "steps/s; share = GB/s / device-to-device copy bandwidth (read + write) measured in the same run. "
             "Harnesses: eager = plain loop; compile = torch.compile reduce-overhead fullgraph; compile-cdt = the "
             "same with Inductor's coordinate_descent_tuning (gpt-fast's setting); cudagraph = the eager step in "
             "one CUDA graph. `speed-only` artifacts: random predictors, thresholds / cuts fitted so the model's "
             "own decode steps keep 1 - k (a random-weight model's quality means nothing).", ""]
    for meta in metas:
        run_rows = [r for r in rows if r.get("run") == meta.get("run")]
        if not run_rows:
            continue
        lines += [f"## Run {meta.get('run')}", "",
                  f"- device: {meta.get('device')}; date: {meta.get('date')}; torch {meta.get('torch')}, "
                  f"transformers {meta.get('transformers')}, triton {meta.get('triton')}; prompt "
                  f"{meta.get('prompt', 64)} tokens; checks {'passed' if meta.get('checks_ok') else meta.get('checks_ok')}",
                  f"- command: `{meta.get('command')}`",
                  f"- copy bandwidth {_f(meta.get('copy_gbps'), '.0f')} GB/s; model {_f(meta.get('model_gb'), '.2f')} GB"
                  + (f"; wall {meta['wall_s']:.0f} s" if meta.get("wall_s") else ""), ""]
        for batch, by_n in (meta.get("dense_spread") or {}).items():
            for n, sp in by_n.items():
                what = (f"{n} new tokens: {sp['n']} timings of one decoder (one compile)" if str(n).isdigit()
                        else f"{n}: {sp['n']} timings")
                lines.append(f"- dense baseline, batch {batch}, {what}, "
                             f"min {sp['min']:.1f} / median {sp['median']:.1f} / max {sp['max']:.1f} tokens/s "
                             f"(spread {100 * (sp['max'] - sp['min']) / sp['median']:.1f} %)")
        for label, reason in (meta.get("skipped") or {}).items():
            lines.append(f"- skipped: {reason if reason.startswith(label.split(' ')[0]) else label + ': ' + reason}")
        lines += ["", "| method | harness | k | Sparsity-Real | batch | new tokens | tokens/s (min-max) | vs dense compiled | "
                  "vs dense eager | ms/step | GB/s | share | peak mem GB | model GB | graphs / breaks | artifacts |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run_rows:
            graphs = f"{r['graphs']} / {r['graph_breaks']}" if r.get("graphs") not in ("", None) else "-"
            rng = (f" ({float(r['tokens_per_s_min']):.1f}-{float(r['tokens_per_s_max']):.1f})"
                   if r.get("tokens_per_s_min") not in ("", None) and int(r.get("samples") or 1) > 1 else "")
            share = f"{100 * float(r['bw_share']):.0f}%" if r.get("bw_share") not in ("", None) else "-"
            lines.append(
                f"| {r['method']} | {r['harness']} | {r['sparsity'] or '-'} | {r['sparsity_real'] or '-'} | "
                f"{r['batch']} | {r['new_tokens']} | {float(r['tokens_per_s']):.1f}{rng} | {_x(r['speedup_vs_compiled'])} | "
                f"{_x(r['speedup_vs_eager'])} | {float(r['ms_per_step']):.2f} | {float(r['gbps']):.0f} | "
                f"{share} | {r['peak_mem_gb'] or '-'} | {r.get('model_mem_gb') or '-'} | "
                f"{graphs} | {r['artifacts'] or '-'} |")
        lines.append("")
        lines += _mlp_section(run_rows, meta) + _replay_section(meta)
        lines += _breakdown_sections(meta)
    return "\n".join(lines)


def _mlp_section(rows: list, meta: dict) -> list[str]:
    """One Gated-MLP alone per row (the one-compile benchmark), against its roofline."""
    timed = [r for r in rows if r.get("kernel_us") not in ("", None)]
    if not timed:
        return []
    k = meta.get("kernel") or {}
    out = [f"### One Gated-MLP alone (median per call in one CUDA graph, cycling over the first {k.get('layers', '-')} "
           f"layers' weights x {k.get('tokens', '-')} inputs recorded from dense decode steps; Sparsity-Real counted "
           "on those inputs; roofline = weight bytes / copy bandwidth)", "",
           "| method | k | Sparsity-Real (MLP inputs) | us | roofline us | x roofline | vs dense MLP | in the step us |",
           "|---|---|---|---|---|---|---|---|"]
    floor = meta.get("floor") or {}
    seen = set()
    for r in timed:
        key = (r["method"], r["sparsity"])
        if key in seen:
            continue
        seen.add(key)
        ratio = (float(r["kernel_us"]) / float(r["kernel_roofline_us"])
                 if r.get("kernel_roofline_us") not in ("", None) else None)
        out.append(f"| {r['method']} | {r['sparsity'] or '-'} | {r.get('kernel_sparsity_real') or '-'} | "
                   f"{float(r['kernel_us']):.1f} | {_f(r.get('kernel_roofline_us'), '.1f')} | "
                   f"{'-' if ratio is None else f'{ratio:.2f}x'} | {_x(r.get('mlp_speedup'))} | "
                   f"{_in_step(r, floor)} |")
    if floor:
        best = max((float(r["dense_compiled_tokens_per_s"]) for r in rows
                    if r.get("dense_compiled_tokens_per_s") not in ("", None)), default=None)
        cap = (f"; against the dense compiled reference ({best:.1f} tokens/s) no MLP method can pass "
               f"{floor['tokens_per_s'] / best:.2f}x" if best else "")
        out.append(f"\n- floor: with every Gated-MLP a zero fill (one kernel a layer) the step takes "
                   f"{floor['ms_per_step']:.3f} ms ({floor['tokens_per_s']:.1f} tokens/s){cap}. \"in the step\" = "
                   f"(the row's ms/step - the floor) / {floor['layers']} layers: the MLP's cost inside the step")
    graphs = meta.get("slot_graphs")
    if graphs:
        out.append(f"\n- one-compile harness: Dynamo counted {graphs['unique_graphs']} graph(s) and "
                   f"{graphs['graph_breaks']} break(s) over dense, every method and every k (no recompilation)")
    return out + [""]


def _in_step(row: dict, floor: dict) -> str:
    """A one-compile row's Gated-MLP time inside the step: (ms/step - the floor's) / layers, in us."""
    if not floor or row.get("harness") != "one-compile" or row.get("ms_per_step") in ("", None):
        return "-"
    return f"{1e3 * (float(row['ms_per_step']) - floor['ms_per_step']) / floor['layers']:.1f}"


def _replay_section(meta: dict) -> list[str]:
    replay = meta.get("mask_replay")
    if not replay:
        return []
    out = ["### Masks from real models replayed at this shape (masked kernel, same kept rows per layer and token)", "",
           "| masks | kept | real us | random us | real / random | contiguous us | roofline us |", "|---|---|---|---|---|---|---|"]
    for r in replay:
        out.append(f"| {r.get('model')} {r.get('method')} k={r.get('sparsity')} | {r['kept']:.3f} | {r['real_us']:.1f} | "
                   f"{r['random_us']:.1f} | {r['real_over_random']:.3f} | {r['contiguous_us']:.1f} | {r['roofline_us']:.1f} |")
    return out + [""]


def _breakdown_sections(meta: dict) -> list[str]:
    from .breakdown import format_breakdown

    out = []
    copy_bps = float(meta.get("copy_gbps") or "nan") * 1e9
    for batch, b in (meta.get("breakdown") or {}).items():
        if "ops" not in b:
            out += [f"Per-op breakdown, batch {batch}: {b.get('error', 'not measured')}", ""]
            continue
        against = f"against the compiled step's {b['step_ms']:.2f} ms" if b.get("step_ms") else "(no compiled step timed)"
        out += [f"### Dense step, batch {batch}: each operation alone (eager op in its own CUDA graph, one call per "
                f"layer's weights) {against}", "", format_breakdown(b["ops"], copy_bps, b.get("step_ms")), ""]
    for p in meta.get("profiles") or []:
        if "classes" not in p:
            continue
        parts = ", ".join(f"{name} {e['ms_per_step']:.2f} ms ({e['kernels_per_step']:.0f} kernels)"
                          for name, e in sorted(p["classes"].items(), key=lambda kv: -kv[1]["ms_per_step"]))
        out += [f"- compiled step of {p['method']} (batch {p['batch']}{', k=' + str(p['k']) if p.get('k') else ''}), "
                f"torch.profiler: {p['device_ms_per_step']:.2f} ms of kernels per step: {parts}"]
    return out + ([""] if meta.get("profiles") else [])


def plot(rows: list, path: str, metas: list) -> None:
    """Per run: tokens/s against k (one panel per batch) for every configuration, dense lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(meta, b) for meta in metas
              for b in sorted({int(r["batch"]) for r in rows if r.get("run") == meta.get("run")})]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (meta, batch) in zip(axes[0], panels):
        sel = [r for r in rows if r.get("run") == meta.get("run") and int(r["batch"]) == batch]
        n = min(int(r["new_tokens"]) for r in sel)
        sel = [r for r in sel if int(r["new_tokens"]) == n]
        for method in dict.fromkeys(r["method"] for r in sel if r["method"] != "dense"):
            pts = sorted((float(r["sparsity"]), float(r["tokens_per_s"])) for r in sel if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method)
        labelled = set()
        for r in sel:
            if r["method"] == "dense":
                style = {"eager": ("gray", ":"), "cudagraph": ("tab:brown", "-.")}.get(r["harness"], ("k", "--"))
                first = r["harness"] not in labelled
                labelled.add(r["harness"])
                ax.axhline(float(r["tokens_per_s"]), color=style[0], ls=style[1], alpha=1.0 if first else 0.5,
                           label=f"dense ({r['harness']})" if first else None)
                if r.get("tokens_per_s_min") not in ("", None) and int(r.get("samples") or 1) > 1:
                    ax.axhspan(float(r["tokens_per_s_min"]), float(r["tokens_per_s_max"]), color=style[0], alpha=0.1)
        ax.set_xlabel("target sparsity k")
        ax.set_ylabel(f"tokens/s (batch {batch})")
        ax.set_title(f"{meta.get('device', '')} ({meta.get('run', '')})\nbatch {batch}, {n} new tokens", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    config = metas[0].get("config", "") if metas else ""
    fig.suptitle(f"End-to-end decode, {config}, random weights, prompt {metas[0].get('prompt', 64)}", fontsize=10)
    fig.tight_layout()
    from countdown.io import atomic_path

    with atomic_path(path, suffix=".png", what="decode plot") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def write_report(rows: list, metas: list, out_dir: str, log=print) -> None:
    """decode.csv, decode.md, decode_meta.json and decode.png in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    write_csv(rows, os.path.join(out_dir, "decode.csv"))
    from countdown.io import atomic_write

    atomic_write(os.path.join(out_dir, "decode.md"), markdown(rows, metas), what="decode table")
    atomic_write(os.path.join(out_dir, "decode_meta.json"), json.dumps(metas, indent=1, default=str), what="decode table")
    try:
        plot(rows, os.path.join(out_dir, "decode.png"), metas)
    except Exception as error:  # a missing matplotlib must not lose the numbers
        log(f"plot failed: {error}")


def read_runs(folders: list[str]) -> tuple[list, list]:
    """The rows and run metadata of result folders (each: decode.csv + decode_meta.json)."""
    rows, metas = [], []
    for folder in folders:
        with open(os.path.join(folder, "decode.csv")) as f:
            rows += list(csv.DictReader(f))
        with open(os.path.join(folder, "decode_meta.json")) as f:
            loaded = json.load(f)
        metas += loaded if isinstance(loaded, list) else [loaded]
    return rows, metas


def short_table(rows: list) -> str:
    out = io.StringIO()
    out.write(f"{'method':15s} {'harness':11s} {'k':>4s} {'real':>6s} {'b':>2s} {'new':>5s} {'tok/s':>8s} "
              f"{'min':>7s} {'max':>7s} {'vsComp':>6s} {'GB/s':>6s} {'share':>5s} {'peakGB':>6s} {'MLPus':>6s} {'vsMLP':>6s}\n")
    for r in rows:
        share = f"{100 * float(r['bw_share']):4.0f}%" if r.get("bw_share") not in ("", None) else "    -"
        out.write(f"{r['method']:15s} {r['harness']:11s} {str(r['sparsity'] or '-'):>4s} {str(r['sparsity_real'] or '-'):>6s} "
                  f"{r['batch']:>2} {r['new_tokens']:>5} {float(r['tokens_per_s']):8.1f} "
                  f"{_f(r.get('tokens_per_s_min'), '7.1f'):>7s} {_f(r.get('tokens_per_s_max'), '7.1f'):>7s} "
                  f"{_x(r['speedup_vs_compiled']):>6s} {float(r['gbps']):6.0f} {share} {str(r['peak_mem_gb'] or '-'):>6s} "
                  f"{_f(r.get('kernel_us'), '6.1f'):>6s} {_x(r.get('mlp_speedup')):>6s}\n")
    return out.getvalue()
