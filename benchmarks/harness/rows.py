"""One decode row of the one-compile benchmark: tokens/s, bytes read, roofline, and the MLP alone.

Bytes per decode step: every parameter outside the Gated-MLPs (:func:`harness.weightbytes.
non_mlp_weight_bytes`) plus per Gated-MLP :func:`countdown.eval.cost.mlp_weight_bytes` of the row's kind at
its kept fraction; the roofline time is those bytes over the copy bandwidth of the run. The MLP alone:
``kernel_us`` (one Gated-MLP call, median, cycling over the first layers' weights) against
``kernel_roofline_us`` (its weight bytes / copy bandwidth); ``mlp_speedup`` = dense ``kernel_us`` / the
row's. The shapes are taken once (:func:`shapes_of`) because the MLPs move behind slots while timing.
"""

from __future__ import annotations

from countdown.eval.cost import mlp_weight_bytes

OPTION_KEYS = ("d_rank", "bits", "group")


def shapes_of(model) -> dict:
    """What the byte counts need, read before the MLPs move: bytes outside the MLPs, each MLP's shape."""
    from countdown.model.gated_mlp import require_gated_mlps
    from .weightbytes import non_mlp_weight_bytes

    mlps = require_gated_mlps(model)
    return {"non_mlp_bytes": non_mlp_weight_bytes(model, 1), "mlps": [(m.d_model, m.d_inter) for m in mlps],
            "elem_bytes": mlps[0].w_up.element_size()}


def options_of(spec, art) -> dict:
    """The roofline options (d_rank, bits, group) of ``spec`` as built in ``art``."""
    built = {key: art.meta.get(key) for key in OPTION_KEYS} if art is not None else {}
    merged = {**(spec.options if spec is not None else {}), **built}
    return {key: v for key, v in merged.items() if v is not None and key in OPTION_KEYS}


def mlp_bytes(shapes: dict, kind: str, kept: float, index: int = 0, **options) -> float:
    d_model, d_inter = shapes["mlps"][index]
    try:
        return mlp_weight_bytes(kind, d_model, d_inter, 1.0 if kind == "dense" else kept,
                                elem_bytes=shapes["elem_bytes"], **options)
    except ValueError:  # a kind the cost model does not know yet
        return float("nan")


def step_bytes(shapes: dict, kind: str, kept: float, **options) -> float:
    return shapes["non_mlp_bytes"] + sum(mlp_bytes(shapes, kind, kept, i, **options)
                                         for i in range(len(shapes["mlps"])))


def _r(value, digits: int):
    return "" if value is None or value != value else round(value, digits)


def decode_row(ctx: dict, label: str, spec, k, stats_list: list[dict], kept: tuple[float, float], art_label: str,
               harness: str, peak, patched_bytes: int, art=None, graphs: dict | None = None,
               kernel_us: float | None = None, kernel_real: float | None = None,
               dense_kernel_us: float | None = None) -> dict:
    """A row with ``harness.report.DECODE_COLUMNS`` (plus the MLP columns) from the timings of
    one configuration. ``ctx``: ``meta``, ``shapes`` (:func:`shapes_of`), ``copy_bps``, ``batch``,
    ``new_tokens``. The row's figure is the median sample; min and max beside it."""
    meta, shapes, copy_bps = ctx["meta"], ctx["shapes"], ctx["copy_bps"]
    stats = sorted(stats_list, key=lambda st: st["tokens_per_s"])[len(stats_list) // 2]
    kept_token, kept_union = kept
    kind = "dense" if spec is None else spec.roofline_kind
    opts = options_of(spec, art)
    nbytes = step_bytes(shapes, kind, kept_token, **opts)
    gbps = nbytes / (stats["ms_per_step"] / 1e3) / 1e9
    one_mlp = mlp_bytes(shapes, kind, kernel_kept(kept_token, kernel_real), **opts)
    tps = [st["tokens_per_s"] for st in stats_list]
    have_bw = copy_bps == copy_bps
    return {
        "device": meta.get("device"), "date": meta.get("date"), "run": meta.get("run"), "config": meta.get("config"),
        "method": label, "harness": harness, "sparsity": "" if k is None else k,
        "sparsity_real": "" if k is None else round(1 - kept_token, 4),
        "kept_union": "" if k is None else round(kept_union, 4), "batch": ctx["batch"], "new_tokens": ctx["new_tokens"],
        "tokens_per_s": round(stats["tokens_per_s"], 2), "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 2),
        "ms_per_step": round(stats["ms_per_step"], 4), "gbps": round(gbps, 1),
        "copy_gbps": _r(copy_bps / 1e9, 1), "bw_share": round(gbps * 1e9 / copy_bps, 4) if have_bw else "",
        "weight_gb_per_step": round(nbytes / 1e9, 4),
        "roofline_ms": _r(1e3 * nbytes / copy_bps, 4) if have_bw else "",
        "peak_mem_gb": "" if peak is None else round(peak / 1e9, 3), "model_mem_gb": round(patched_bytes / 1e9, 3),
        "setup_s": round(stats_list[0]["setup_s"], 1),
        "graphs": "" if graphs is None else graphs["unique_graphs"],
        "graph_breaks": "" if graphs is None else graphs["graph_breaks"], "artifacts": art_label,
        "tokens_per_s_min": round(min(tps), 2), "tokens_per_s_max": round(max(tps), 2), "samples": len(tps),
        "kernel_us": _r(kernel_us, 2), "kernel_sparsity_real": _r(kernel_real, 4),
        "kernel_roofline_us": _r(1e6 * one_mlp / copy_bps, 2) if have_bw else "",
        "mlp_speedup": _r(dense_kernel_us / kernel_us, 3) if kernel_us and dense_kernel_us else "",
    }


def kernel_kept(kept_token: float, kernel_real: float | None) -> float:
    """The kept fraction of the MLP timing: counted on its own inputs when known."""
    return kept_token if kernel_real is None or kernel_real != kernel_real else 1.0 - kernel_real
