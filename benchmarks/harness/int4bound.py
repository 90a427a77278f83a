"""How fast sparse rows on 4-bit weights could be at most (the ``bound`` part of ``benchmarks/int4_decode.py``),
measured rather than argued: M-CountDown (mono) at sparsity k reads all of W_up (the indicator GEMV), decides the
kept rows (the select kernel), then reads the kept rows of W_gate and W_down. If the two kept-rows kernels read as
fast as our dense GEMVs read the same bytes, the MLP would cost what the dense 4-bit MLP of a *narrow* model costs
(d_inter = the kept rows), plus the indicator, plus the select, minus the kept rows of W_up that the narrow model's
gate/up GEMV reads and mono does not. So, in one call:

* ``dense_ms``: our dense 4-bit step of the model (``fastest_step``, compiled);
* ``narrow_ms``: the same step of the model with ``d_inter`` cut to the kept rows (``kept_inter``: ``(1 - k)
  d_inter`` rounded *down* to whole 1,024-column slices, the slices our GEMVs take at full speed; a count of groups
  that is no power of two pads the GEMV's registers and runs far slower: 4,352 columns ran 303 tokens/s where 4,096
  ran 565 (session 35). Fewer rows than k keeps make the bound generous, not tight);
* ``indicator_us`` / ``up_kept_us``: our GEMV alone of W_up [d_inter, d_model] and of W_up's kept rows
  [kept_inter, d_model] (weights cycled past the L2 cache), both on the indicator's launch configuration;
* ``select_us``: the select kernel a layer, an argument (default 1.95 us: run G16's profile of the step,
  ``step_kernels.csv``), since it does not run without the rest of the kept-rows path;

``bound_ms = narrow_ms + layers (indicator_us - up_kept_us + select_us)``, ``free_select_ms`` the same with the
select at no cost; ``bound_vs_dense`` = dense_ms / bound_ms: no kept-rows kernel of ours can beat it at this k
with this indicator. Rows append, under a lock, to ``<out>/bound.csv``.
"""

from __future__ import annotations

import os

import torch

from countdown.kernels import overrides
from countdown.kernels.int4 import gemv as _int4

FIELDS = ["run", "device", "date", "k", "d_inter", "kept_inter", "dense_ms", "narrow_ms", "indicator_us",
          "up_kept_us", "select_us", "free_select_ms", "bound_ms", "bound_vs_dense"]
SLICE = 1024  # columns: the kept width is whole slices of this many (the 4-bit GEMV's MAX_COLS for these shapes)
SELECT_US = 1.95  # the select kernel a layer in the 8B step (run G16's profile, H200, 2026-11-28)


def kept_width(d_inter: int, k: float, group: int = 128) -> int:
    """The kept rows of W_gate / W_down at sparsity k, rounded down to whole slices of ``SLICE`` columns (at least
    one; of one ``group`` where d_inter is under 8 slices: the CPU's smoke model)."""
    if not 0.0 <= k < 1.0:
        raise ValueError(f"k is the fraction of rows skipped, in [0, 1); got {k}")
    step = SLICE if d_inter >= 8 * SLICE else group
    return max(step, int((1.0 - k) * d_inter) // step * step)


def narrow_configs(d_model: int, d_inter: int, kept: int) -> dict:
    """Launch overrides (``countdown.kernels.overrides(launch=...)``) under which the narrow model's gate/up and down
    shapes launch as the full model's do (its launch table's shape entries)."""
    full_gu, full_down = _int4.config_for(2 * d_inter, d_model), _int4.config_for(d_model, d_inter)
    return {("int4_gemv", (2 * kept, d_model)): full_gu, ("int4_gemv", (d_model, kept)): full_down}


def run(build, step_ms, gemv_us, append, log, device: str, stamp: dict, out: str, k: float,
        select_us: float = SELECT_US) -> dict:
    """The bound at sparsity ``k``. ``build(fields)``: the script's bf16 model with config fields changed
    (``{}``: as it is); ``step_ms(model)``: ms a decode step of a 4-bit model on its fastest step; ``gemv_us(n, k,
    config)``: our GEMV of an [n, k] weight alone, microseconds a call; ``append(path, fields, row)``, ``log(msg)``:
    the script's."""
    import countdown

    def measure(fields: dict):
        with torch.no_grad():
            model = build(fields)
            cfg = model.config
            countdown.quantize(model, group=128, lm_head=True)
            ms = step_ms(model)
            del model
            torch.cuda.empty_cache() if device == "cuda" else None
        log(f"bound: dense 4-bit step at d_inter {cfg.intermediate_size}: {ms:.3f} ms ({1e3 / ms:.1f} tokens/s)")
        return cfg, ms

    cfg, dense_ms = measure({})
    d_model, d_inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kept = kept_width(d_inter, k)
    with overrides(launch=narrow_configs(d_model, d_inter, kept)):
        _, narrow_ms = measure({"intermediate_size": kept})
    ind_cfg = _int4.config_for(d_inter, d_model)  # the indicator's launch configuration for both
    gemv = {}
    for name, n in (("indicator", d_inter), ("up_kept", kept)):
        gemv[name] = gemv_us(n, d_model, ind_cfg)
        log(f"bound: {name} GEMV [{n} x {d_model}] alone {gemv[name]:.2f} us")
    free_ms = narrow_ms + layers * (gemv["indicator"] - gemv["up_kept"]) / 1e3
    bound_ms = free_ms + layers * select_us / 1e3
    row = {**stamp, "k": k, "d_inter": d_inter, "kept_inter": kept, "dense_ms": round(dense_ms, 4),
           "narrow_ms": round(narrow_ms, 4), "indicator_us": round(gemv["indicator"], 2),
           "up_kept_us": round(gemv["up_kept"], 2), "select_us": select_us, "free_select_ms": round(free_ms, 4),
           "bound_ms": round(bound_ms, 4), "bound_vs_dense": round(dense_ms / bound_ms, 3)}
    append(os.path.join(out, "bound.csv"), FIELDS, row)
    log(f"bound at k = {k} ({kept} of {d_inter} rows kept, {kept / d_inter:.3f}): mono's step at most "
        f"{1e3 / bound_ms:.1f} tokens/s ({bound_ms:.3f} ms), {dense_ms / bound_ms:.3f}x our dense 4-bit "
        f"({1e3 / dense_ms:.1f}); with the select free {dense_ms / free_ms:.3f}x")
    return row
