"""The operating-point report of one model: CSV, Markdown, a quality-vs-speed plot with the Pareto
frontier, and a one-line recommendation. Shared by ``countdown bench`` (:mod:`.operating`) and the
merge of the CPU quality grid with the GPU speed run (:mod:`.merge`)."""

from __future__ import annotations

import csv
import io
import math
import os

ISSUE_COLUMNS = ["model", "method", "sparsity", "sparsity_real", "ppl_increase", "kl", "decode_speedup", "device", "date"]


def _known(value) -> bool:
    return value not in ("", None) and not (isinstance(value, float) and math.isnan(value))


# a row's weights -> what its label adds: the quantized copies countdown bench measures beside the model as loaded
WEIGHT_LABELS = {"int4": " (int4)", "nested8+int4": " (other Linears int4)"}


def is_reference(row: dict) -> bool:
    """The row every ratio is against: dense on the weights as loaded (a dense 4-bit row is a configuration)."""
    return row["method"] == "dense" and row.get("weights") not in WEIGHT_LABELS


def configurations(rows: list[dict]) -> list[dict]:
    """The rows a recommendation chooses from: every row but the reference."""
    return [r for r in rows if not is_reference(r)]


def what(row: dict) -> str:
    """A configuration as the recommendation names it: its label, and its k where it has one."""
    return label(row) + ("" if row["method"] == "dense" else f" at k={row['sparsity']:g}")


def spread(row: dict) -> tuple[float, float]:
    """(min, max) of a row's speed-up over its timings; a row measured once (or merged without a spread) is its
    one value."""
    low, high = row.get("speedup_min"), row.get("speedup_max")
    if _known(low) and _known(high):
        return float(low), float(high)
    return float(row["decode_speedup"]), float(row["decode_speedup"])


def faster(row: dict) -> bool:
    """Faster than dense beyond the run-to-run spread: every timing of the row above 1.0x."""
    return _known(row.get("decode_speedup")) and spread(row)[0] > 1.0


def speed_text(row: dict) -> str:
    """``1.23x`` for one timing, ``1.23x (1.10-1.31x over 3 rounds)`` with a spread."""
    low, high = spread(row)
    if not (_known(row.get("speedup_min")) and _known(row.get("speedup_max"))):
        return f"{row['decode_speedup']:.2f}x"
    rounds = f" over {row['samples']} rounds" if _known(row.get("samples")) else ""
    return f"{row['decode_speedup']:.2f}x ({low:.2f}-{high:.2f}x{rounds})"


def recommended(rows: list[dict], max_ppl_increase: float = 0.05) -> dict | None:
    """The row :func:`recommendation` names as the one to use: the fastest (median) within the bound whose every
    timing beat dense (speed only: the fastest such), or None where it names none."""
    every = configurations(rows)
    sparse = [r for r in every if faster(r)]
    if all(not _known(r.get("ppl_increase")) for r in every):
        return max(sparse, key=lambda r: r["decode_speedup"]) if sparse else None
    ok = [r for r in sparse if _known(r.get("ppl_increase")) and r["ppl_increase"] <= max_ppl_increase]
    return max(ok, key=lambda r: r["decode_speedup"]) if ok else None


def recommendation(rows: list[dict], max_ppl_increase: float = 0.05, where: str = "") -> str:
    """One line: the fastest configuration within ``max_ppl_increase`` (relative, 0.05 = 5 %) of dense
    decode-style perplexity, and its speed-up (``where``: e.g. " at the Llama-3.1-8B shape on an H200");
    on speed-only rows, the fastest and that quality was not measured. A configuration whose speed-up spread
    reaches down to 1.0x or below (:func:`faster`) is never recommended: the line says so. The configurations are
    every row but the reference (:func:`is_reference`): the dense 4-bit row is one; the line gives the recommended
    one's bits read per MLP weight where the row has them."""
    every = configurations(rows)
    sparse = [r for r in every if _known(r.get("decode_speedup"))]
    if not every:
        return "no sparse configuration was measured"
    if all(not _known(r.get("ppl_increase")) for r in every):
        if not sparse:
            return "no sparse configuration was measured"
        best = recommended(rows, max_ppl_increase)
        if best is None:
            top = max(sparse, key=lambda r: r["decode_speedup"])
            return (f"speed only (random weights, quality not measured): no configuration is faster than the dense "
                    f"decoder beyond the run-to-run spread{where}; the fastest is {what(top)}: "
                    f"{speed_text(top)}; stay dense")
        return (f"speed only (random weights, quality not measured): the fastest is {what(best)}: "
                f"{speed_text(best)} the dense decoder{where}{_bits(best)}")
    pct = f"{100 * max_ppl_increase:g} %"
    within = [r for r in every if _known(r.get("ppl_increase")) and r["ppl_increase"] <= max_ppl_increase]
    ok = [r for r in within if _known(r.get("decode_speedup"))]
    if within and not ok:
        names = ", ".join(f"{what(r)} ({100 * r['ppl_increase']:+.1f} %, Sparsity-Real "
                          f"{r['sparsity_real']:.3f})" for r in within)
        return (f"for at most {pct} perplexity increase: {names}; no decode speed was measured at "
                f"{'that Sparsity-Real' if len(within) == 1 else 'those Sparsity-Real values'}")
    if not ok:
        closest = min((r for r in every if _known(r.get("ppl_increase"))), key=lambda r: r["ppl_increase"])
        speed = (f", {closest['decode_speedup']:.2f}x{where}" if _known(closest.get("decode_speedup")) else "")
        return (f"no configuration stays within {pct} perplexity increase; the closest is {what(closest)} "
                f"({100 * closest['ppl_increase']:+.1f} %{speed}); stay dense or accept more")
    best = recommended(rows, max_ppl_increase)
    if best is None:
        top = max(ok, key=lambda r: r["decode_speedup"])
        return (f"for at most {pct} perplexity increase no configuration is faster than dense beyond the run-to-run "
                f"spread{where}: the fastest within it, {what(top)} "
                f"({100 * top['ppl_increase']:+.1f} %), runs {speed_text(top)}; stay dense")
    real = "" if best["method"] == "dense" else f", Sparsity-Real {best['sparsity_real']:.3f}"
    return (f"for at most {pct} perplexity increase, use {what(best)} ({100 * best['ppl_increase']:+.1f} %{real}"
            f"{_bits(best)}): {speed_text(best)} faster{where}")


def _bits(row: dict) -> str:
    """``, 5.40 bits read per MLP weight`` where the row has them, else nothing."""
    return f", {float(row['mlp_bits']):.2f} bits read per MLP weight" if _known(row.get("mlp_bits")) else ""


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both perplexity increase (lower) and speed-up (higher)."""
    pts = [r for r in rows if _known(r.get("ppl_increase")) and _known(r.get("decode_speedup"))]
    return [r for r in pts if not any(o is not r and o["ppl_increase"] <= r["ppl_increase"]
                                      and o["decode_speedup"] >= r["decode_speedup"]
                                      and (o["ppl_increase"], o["decode_speedup"]) != (r["ppl_increase"], r["decode_speedup"])
                                      for o in pts)]


def _cell(value, fmt: str) -> str:
    return format(value, fmt) if _known(value) else "-"


# optional Markdown columns: (row key, header, format); shown when some row has the key filled
_EXTRA = [("mlp_bits", "bits read / MLP weight", ".2f"), ("kernel_us", "MLP us", ".1f"), ("mlp_speedup", "MLP speed-up", ".2f"), ("task_score", "task score", ".3f"),
          ("tokens_per_s", "tokens/s", ".1f")]


def label(row: dict) -> str:
    """A row's method as the table and the plot name it: with " (int4)" for the 4-bit model's row, " (other Linears
    int4)" for a dual[mixed] row (its MLPs nested 8-bit, every other Linear 4-bit: :data:`WEIGHT_LABELS`)."""
    return row["method"] + WEIGHT_LABELS.get(row.get("weights"), "")


def markdown(rows: list[dict], meta: dict, line: str, front: set) -> str:
    extra = [c for c in _EXTRA if any(_known(r.get(c[0])) for r in rows)]
    first = rows[0] if rows else {}
    lines = [f"# Operating points: {meta.get('model')}", "", f"**{line}**", ""]
    lines += [f"- {text}" for text in meta.get("notes", [])]
    if meta.get("command"):
        lines.append(f"- device: {first.get('device', '-')}; date: {first.get('date', '-')}; command: `{meta['command']}`")
    if "prompt" in meta:
        lines.append(f"- speed: tokens/s of `countdown.generate_fast` ({first.get('harness', '-')}, batch "
                     f"{first.get('batch', '-')}, {first.get('new_tokens', '-')} new tokens after a {meta['prompt']}-token "
                     f"prompt) over the dense model in the same harness, timed in {meta.get('samples', '-')} alternated "
                     "rounds (dense, then every configuration, and dense again after the last): the median ratio and, in "
                     "brackets, its min-max over the rounds (dense: its own timings over their median); a configuration "
                     "whose spread reaches 1.0x is not recommended. Quality: decode-style perplexity (half of each window "
                     "a dense prompt) relative to dense, and KL(dense || sparse) in nats.")
    head = ["method", "k", "Sparsity-Real", "ppl increase", "KL", "decode speed-up"] + [c[1] for c in extra] + \
        ["Pareto", "artifacts"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        inc = 100 * r["ppl_increase"] if _known(r.get("ppl_increase")) else None
        cells = [label(r), _cell(r.get("sparsity"), "g"), _cell(r.get("sparsity_real"), ".3f"),
                 "-" if inc is None else f"{inc:+.1f} %", _cell(r.get("kl"), ".3f"),
                 speed_text(r).replace(" over", ",") if _known(r.get("decode_speedup")) else "-"]
        cells += [_cell(r.get(key), fmt) for key, _, fmt in extra]
        cells += ["*" if id(r) in front else "", str(r.get("artifacts") or "-")]
        lines.append("| " + " | ".join(cells) + " |")
    for reason in meta.get("skipped", []):
        lines.append(f"\n- skipped {reason}")
    return "\n".join(lines) + "\n"


def write_operating_points(rows: list[dict], out_dir: str, meta: dict, max_ppl_increase: float = 0.05,
                           columns: list[str] | None = None) -> dict:
    """``<model>.csv``, ``.md`` and ``.png`` in ``out_dir``, each written atomically (the plot: speed-up
    against perplexity increase with the Pareto frontier, or against Sparsity-Real when quality was not
    measured). ``columns``: the CSV's (default :data:`ISSUE_COLUMNS`, then every other key of the rows).
    Returns the paths and the recommendation line."""
    from ..io import atomic_path, atomic_write

    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, str(meta.get("model", "model")).replace("/", "_"))
    if columns is None:
        columns = ISSUE_COLUMNS + [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ISSUE_COLUMNS]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write(stem + ".csv", buf.getvalue())
    line = recommendation(rows, max_ppl_increase, meta.get("where", ""))
    front = {id(r) for r in pareto(rows)}
    atomic_write(stem + ".md", markdown(rows, meta, line, front))
    try:
        with atomic_path(stem + ".png", suffix=".png") as tmp:
            _plot(rows, str(tmp), meta, front)
    except Exception as error:  # a plotting failure must not lose the table
        line += f" (plot failed: {error})"
    return {"csv": stem + ".csv", "markdown": stem + ".md", "plot": stem + ".png", "recommendation": line}


def _plot(rows, path, meta, front) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if _known(r.get("decode_speedup"))]
    quality = any(_known(r.get("ppl_increase")) for r in rows)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method in dict.fromkeys(label(r) for r in rows):
        pts = [r for r in rows if label(r) == method and (not quality or _known(r.get("ppl_increase")))]
        if not pts:
            continue
        xs = [100 * r["ppl_increase"] if quality else r["sparsity_real"] for r in pts]
        dense = pts[0]["method"] == "dense"
        ys = [r["decode_speedup"] for r in pts]
        line, = ax.plot(xs, ys, marker="s" if dense else "o", ls="-" if len(pts) > 1 else "", label=method,
                        ms=6 if dense else 4)
        lows, highs = zip(*(spread(r) for r in pts))
        if lows != tuple(ys) or highs != tuple(ys):  # each point's min-max over the rounds
            ax.vlines(xs, lows, highs, color=line.get_color(), lw=0.8, alpha=0.6)
        for r, x in zip(pts, xs):
            if r["method"] != "dense":
                ax.annotate(f"{r['sparsity']:g}", (x, r["decode_speedup"]), fontsize=6)
    if quality and front:
        pts = sorted((100 * r["ppl_increase"], r["decode_speedup"]) for r in rows if id(r) in front)
        ax.step(*zip(*pts), where="post", color="k", lw=0.9, ls="--", label="Pareto frontier")
        ax.set_xscale("symlog", linthresh=1.0)
        bound = meta.get("max_ppl_increase")
        if bound:
            ax.axvline(100 * bound, color="tab:red", lw=0.8, ls=":", label=f"+{100 * bound:g} % perplexity")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("decode-style perplexity increase over dense (%)" if quality else "Sparsity-Real (speed only)")
    ax.set_ylabel(meta.get("speed_label", "decode speed-up over dense"))
    ax.set_title(meta.get("title") or f"{meta.get('model')} on {rows[0]['device'] if rows else ''}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
