"""Theoretical FLOPs and memory traffic of one Gated-MLP decode step (the paper's appendix).

One token ``x`` of width ``d_m`` goes through a Gated-MLP of width ``d_i``; ``s`` is the number of
rows *kept* at sparsity ``k``, ``s = int(d_i * (1 - k))`` (the paper's notation table writes
``int(d_inter * k)``, but its printed figures are only reproduced with the kept count), ``d_r`` the
rank of D-CountDown's low-rank predictor and ``c_act`` the FLOPs of one activation (SiLU ~ 5).

FLOPs (paper, "Theoretical FLOPs Analysis"; a GEMV of an ``a x b`` matrix costs ``2ab``)::

    dense  6 d_m d_i + c_act d_i + d_i
    cats   2 d_m d_i + c_act d_i + 2 d_i + 4 d_m s + s
    mono   2 d_m d_i + 2 d_i + 4 d_m s + c_act s + s
    dual   2 d_m d_r + 2 d_r d_i + d_i + 6 d_m s + c_act s + s
    teal   2 d_m + 4 d_i s_x + c_act d_i + d_i + 2 d_i + 2 d_m s

with, for teal (not in the paper; TEAL skips inputs, :mod:`countdown.sparse_methods.teal`), ``s_x = int(d_m (1 - k))``
kept entries of x (columns of W_gate and W_up) and ``s`` kept entries of the intermediate (columns of
W_down): uniform k on both, so its weight traffic ``2 d_i s_x + d_m s`` is the share ``1 - k`` of
the three matrices, as for the row methods.

Memory traffic, in elements read or written (paper, "Theoretical Memory Traffic Analysis")::

    dense  3 d_m d_i + 3 d_m + 8 d_i
    cats   d_m d_i + 2 d_m s + 3 d_m + 10 d_i + s
    mono   d_m d_i + 2 d_m s + 3 d_m + 8 d_i + s
    dual   d_m d_r + d_r d_i + 3 d_m s + 3 d_m + 2 d_r + 6 d_i
    teal   2 d_i s_x + d_m s + 4 d_m + 8 d_i

Units of the paper's efficiency table: ``FLOPs(M)`` is FLOPs / 10^6 and ``Mem.(MB)`` is the element
count / 2^20 (MiB at one byte per element); with Llama-3.1-8B (4096, 14336) and ``d_r = 512`` this
reproduces every printed figure except D-CountDown's memory, printed 0.005-0.011 below (docs/cost.md).
Deja Vu is left out: the paper gives no cost formulas for it.
"""

from __future__ import annotations

from ..sparse_methods.registry import kept_rows

METHODS = ("dense", "cats", "mono", "dual", "teal")
_MEGA = 1e6
_MEBI = 2**20


def _flops_terms(d_m: int, d_i: int, d_r: int, s: int, c_act: float, s_x: int) -> dict[str, list[tuple[float, str]]]:
    """FLOPs per method as the paper's rows: (count, what it is)."""
    return {
        "dense": [(6 * d_m * d_i, "full GEMV x3"), (c_act * d_i, "full act"), (d_i, "full u*h")],
        "cats": [(2 * d_m * d_i, "full GEMV W_gate"), (c_act * d_i, "full act"),
                 (2 * d_i, "abs and threshold"), (2 * d_m * s, "sparse GEMV W_up"),
                 (s, "sparse u*h"), (2 * d_m * s, "sparse GEMV W_down")],
        "mono": [(2 * d_m * d_i, "full GEMV W_up"), (2 * d_i, "abs and threshold"),
                 (2 * d_m * s, "sparse GEMV W_gate"), (c_act * s, "sparse act"),
                 (s, "sparse u*h"), (2 * d_m * s, "sparse GEMV W_down")],
        "dual": [(2 * d_m * d_r, "low-rank GEMV theta_A"), (2 * d_r * d_i, "low-rank GEMV theta_B"),
                 (d_i, "threshold"), (4 * d_m * s, "sparse GEMV W_gate, W_up"),
                 (c_act * s, "sparse act"), (s, "sparse u*h"), (2 * d_m * s, "sparse GEMV W_down")],
        "teal": [(2 * d_m, "abs and threshold x"), (4 * d_i * s_x, "input-sparse GEMV W_gate, W_up"),
                 (c_act * d_i, "full act"), (d_i, "full u*h"), (2 * d_i, "abs and threshold s"),
                 (2 * d_m * s, "sparse GEMV W_down")],
    }


def _memory_terms(d_m: int, d_i: int, d_r: int, s: int, s_x: int) -> dict[str, list[tuple[int, str]]]:
    """Elements read or written per method as the paper's rows: (count, what it is)."""
    return {
        "dense": [(2 * d_m * d_i, "read W_up, W_gate"), (2 * d_m, "read x twice"),
                  (2 * d_i, "write gate, up"), (d_i, "read gate"), (d_i, "write act_gate"),
                  (2 * d_i, "read act_gate, up"), (d_i, "write inter"), (d_m * d_i, "read W_down"),
                  (d_i, "read inter"), (d_m, "write y")],
        "cats": [(d_m * d_i, "read W_gate"), (d_m, "read x"), (d_i, "write gate"), (d_i, "read gate"),
                 (d_i, "write act_gate"), (d_i, "read act_gate"), (d_i, "write abs_act_gate"),
                 (d_i, "read abs_act_gate"), (d_i, "write mask"), (d_m * s, "read sparse W_up"),
                 (d_m, "read x"), (s, "read sparse act_gate"), (d_i, "read mask"),
                 (d_i, "write inter"), (d_m * s, "read sparse W_down"), (d_i, "read inter"),
                 (d_m, "write y")],
        "mono": [(d_m * d_i, "read W_up"), (d_m, "read x"), (d_i, "write up"), (d_i, "read up"),
                 (d_i, "write abs_up"), (d_i, "read abs_up"), (d_i, "write mask"),
                 (d_m * s, "read sparse W_gate"), (d_m, "read x"), (s, "read sparse up"),
                 (d_i, "read mask"), (d_i, "write inter"), (d_m * s, "read sparse W_down"),
                 (d_i, "read inter"), (d_m, "write y")],
        "dual": [(d_m * d_r, "read theta_A"), (d_m, "read x"), (d_r, "write latent"),
                 (d_r * d_i, "read theta_B"), (d_r, "read latent"), (d_i, "write s_hat"),
                 (d_i, "read s_hat"), (d_i, "write mask"), (2 * d_m * s, "read sparse W_up, W_gate"),
                 (d_m, "read x"), (d_i, "read mask"), (d_i, "write inter"),
                 (d_m * s, "read sparse W_down"), (d_i, "read inter"), (d_m, "write y")],
        "teal": [(d_m, "read x"), (d_m, "write sparse x"), (d_m, "read sparse x"),
                 (2 * d_i * s_x, "read kept columns of W_gate, W_up"), (2 * d_i, "write gate, up"),
                 (2 * d_i, "read gate, up"), (d_i, "write inter"), (d_i, "read inter"), (d_i, "write sparse inter"),
                 (d_m * s, "read kept columns of W_down"), (d_i, "read sparse inter"), (d_m, "write y")],
    }


def cost_table(d_model: int, d_inter: int, d_rank: int, sparsity: float, c_act: float = 5,
               dtype_bytes: int | None = None) -> dict[str, dict]:
    """Theoretical cost of one token through one Gated-MLP, per method.

    Returns ``{method: {"flops", "flops_m", "mem_elements", "mem_mb", "kept_rows"}}`` for
    dense, cats, mono, dual and teal (whose ``kept_inputs`` is also given: kept entries of x), where ``flops_m = flops / 1e6`` and ``mem_mb = mem_elements / 2**20``
    are the paper's ``FLOPs(M)`` and ``Mem.(MB)``. ``dense`` keeps every row whatever ``sparsity``.
    With ``dtype_bytes`` (e.g. 2 for bf16) each entry also gets ``mem_bytes`` and
    ``mem_mib = mem_bytes / 2**20``, the real traffic at that element size.
    """
    from ..options import check, check_at_most, check_optional

    d_m, d_i, d_r = check("d_model", d_model), check("d_inter", d_inter), check("d_rank", d_rank)
    check_at_most("d_rank", d_r, "d_model", d_m, "a predictor of rank above its input's width costs more and predicts "
                  "nothing more (x A B has rank at most d_model)")
    check("c_act", c_act)  # validated; an int stays an int (integer FLOP counts)
    dtype_bytes = check_optional("dtype_bytes", dtype_bytes)
    s = kept_rows(d_i, sparsity)
    s_x = kept_rows(d_m, sparsity)
    flops = _flops_terms(d_m, d_i, d_r, s, c_act, s_x)
    memory = _memory_terms(d_m, d_i, d_r, s, s_x)
    table = {}
    for method in METHODS:
        f = sum(n for n, _ in flops[method])
        m = sum(n for n, _ in memory[method])
        entry = {"flops": f, "flops_m": f / _MEGA, "mem_elements": m, "mem_mb": m / _MEBI,
                 "kept_rows": d_i if method == "dense" else s}
        if method == "teal":
            entry["kept_inputs"] = s_x
        if dtype_bytes is not None:
            entry["mem_bytes"] = m * dtype_bytes
            entry["mem_mib"] = m * dtype_bytes / _MEBI
        table[method] = entry
    return table


def format_cost_table(table: dict[str, dict], title: str | None = None) -> str:
    """A fixed-width text table of :func:`cost_table`'s result, with ratios to dense."""
    real = all("mem_mib" in e for e in table.values())
    header = ["method", "kept", "FLOPs(M)", "x dense", "Mem.(MB)", "x dense"]
    if real:
        header.append("MiB(dtype)")
    dense = table.get("dense")
    rows = []
    for method, e in table.items():
        ratio_f = f"{e['flops'] / dense['flops']:.3f}" if dense else "-"
        ratio_m = f"{e['mem_elements'] / dense['mem_elements']:.3f}" if dense else "-"
        row = [method, str(e["kept_rows"]), f"{e['flops_m']:.2f}", ratio_f, f"{e['mem_mb']:.3f}", ratio_m]
        if real:
            row.append(f"{e['mem_mib']:.3f}")
        rows.append(row)
    widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]

    def fmt(r):
        return "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))

    lines = [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    return "\n".join([title] + lines if title else lines)


# --------------------------------------------------------------------------------------------
# Roofline: the weight bytes one token's Gated-MLP must read, per method and SP-Prac kind
# --------------------------------------------------------------------------------------------


def mlp_weight_bytes(kind: str, d_model: int, d_inter: int, kept: float, elem_bytes: int = 2,
                     d_rank: int | None = None, bits: int | None = None, group: int | None = None,
                     kept_in: float | None = None) -> float:
    """Weight bytes one decode step reads from one Gated-MLP: the roofline numerator.

    kind: ``"dense"`` (all three matrices), ``"mono"`` / ``"cats"`` (the indicator's matrix in full +
        kept rows of the other two), ``"teal"`` (input sparsity: the columns of W_gate and W_up of the
        kept inputs, ``kept_in`` of d_model, and the columns of W_down of the kept intermediate entries,
        ``kept`` of d_inter; with ``kept_in`` None, ``kept`` is teal's kept weight share
        ``1 - Sparsity-Real = (2 kept_x + kept_s) / 3`` and the bytes are ``3 kept`` matrices), or any SP-Prac kind of ``countdown.selectors`` (``"lowrank"``, ``"hybrid"``,
        ``"ternary"``, ``"shadow"``, ...), whose own ``weight_bytes`` counts its predictor / shadows
        (``d_rank``, ``bits``, ``group``: its options; None: the kind's default) plus the kept rows.
    kept: the kept fraction of the ``d_inter`` rows (``1 - Sparsity-Real``; for a batch, the union
        over its tokens), in [0, 1]. ``elem_bytes``: bytes per model weight (2 for bf16 / fp16).
    """
    if not 0.0 <= kept <= 1.0:
        raise ValueError(f"kept must be a fraction in [0, 1], got {kept}")
    matrix = d_model * d_inter * elem_bytes  # one full matrix
    if kind == "dense":
        return 3.0 * matrix
    from ..selectors.kinds import KINDS  # the kinds count their own bytes; prac never imports this module

    if kind == "teal":  # its kind in KINDS counts the same bytes from the kept weight share alone
        return 2 * (kept if kept_in is None else kept_in) * matrix + kept * matrix
    name = "threshold" if kind in ("mono", "cats") else kind
    if name not in KINDS:
        raise ValueError(f"unknown roofline kind {kind!r}: choose dense, mono, cats, teal or a kind of "
                         f"countdown.selectors ({', '.join(KINDS)})")
    meta = {key: value for key, value in (("d_rank", d_rank), ("bits", bits), ("group", group)) if value is not None}
    return float(KINDS[name].weight_bytes(d_model, d_inter, kept, elem_bytes, meta))
