"""Why M-CountDown beats CATS: how well ``u`` and ``h`` each explain the oracle mask of ``s``.

For one token at sparsity ``k`` let ``S``, ``U``, ``H`` be the keep masks of ``s = u * h``, ``u`` and
``h = act(g)``: True for the ``kept_rows(d_inter, k)`` entries of largest magnitude (per-token top-k,
the paper's quantile threshold). With ``|.|`` counting True entries over all tokens, the paper's
indicators of ``u`` against ``h`` are::

    CIF(u, alive) = |S & ~H| / |S|          u rescues a row that h would have pruned
    CAF(u, alive) = |S & ~H & U| / |S|      ... and u itself keeps it (agrees with s, h does not)
    CIF(u, dead)  = |~S & H| / |~S|         u kills a row that h would have kept
    CAF(u, dead)  = |~S & H & ~U| / |~S|    ... and u itself prunes it

and those of ``h`` swap the roles of ``U`` and ``H``. Because every token keeps the same number of
rows in all three masks, counts over all tokens equal the mean of per-token ratios, and
``|S & ~H| = |H & ~S|``, so ``CIF(u, dead) * |~S| = CIF(u, alive) * |S|``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..sparse_methods.registry import check_sparsity, kept_rows

SIGNALS = ("u", "h")
FACTORS = ("cif_alive", "cif_dead", "caf_alive", "caf_dead")


def top_mask(v: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep mask of ``v [tokens, d_inter]``: True for the ``kept_rows`` largest ``|v|`` of each row."""
    keep = kept_rows(v.shape[-1], sparsity)
    idx = v.abs().topk(keep, dim=-1).indices
    return torch.zeros(v.shape, dtype=torch.bool, device=v.device).scatter_(-1, idx, True)


def indicator_counts(u: torch.Tensor, h: torch.Tensor, s: torch.Tensor, sparsity: float) -> dict[str, int]:
    """The integer counts behind CIF and CAF (additive over tokens and batches)."""
    if not (u.shape == h.shape == s.shape) or u.dim() < 1:
        raise ValueError(f"u, h, s must share one shape [..., d_inter], got {tuple(u.shape)}, "
                         f"{tuple(h.shape)}, {tuple(s.shape)}")
    d = u.shape[-1]
    S, U, H = (top_mask(t.reshape(-1, d), sparsity) for t in (s, u, h))
    counts = {"alive": int(S.sum()), "dead": int((~S).sum())}
    for name, mine, other in (("u", U, H), ("h", H, U)):
        counts[f"{name}_cif_alive"] = int((S & ~other).sum())
        counts[f"{name}_caf_alive"] = int((S & ~other & mine).sum())
        counts[f"{name}_cif_dead"] = int((~S & other).sum())
        counts[f"{name}_caf_dead"] = int((~S & other & ~mine).sum())
    return counts


def factors_from_counts(counts: dict[str, int]) -> dict[str, dict[str, float]]:
    """``{"u": {"cif_alive", "cif_dead", "caf_alive", "caf_dead"}, "h": {...}}`` from counts."""
    out = {}
    for name in SIGNALS:
        out[name] = {f: counts[f"{name}_{f}"] / max(counts[f.split("_")[1]], 1) for f in FACTORS}
    return out


def indicator_factors(u: torch.Tensor, h: torch.Tensor, s: torch.Tensor,
                      sparsities=(0.7, 0.8, 0.9)) -> dict[float, dict[str, dict[str, float]]]:
    """CIF and CAF of ``u`` and ``h`` against ``s`` (tensors ``[tokens, d_inter]``), per sparsity."""
    return {float(k): factors_from_counts(indicator_counts(u, h, s, k)) for k in _sparsities(sparsities)}


def _sparsities(sparsities) -> list[float]:
    ks = [check_sparsity(k) for k in ([sparsities] if isinstance(sparsities, (int, float)) else sparsities)]
    if not ks:
        raise ValueError("give at least one sparsity")
    return ks


def _add(total: dict[str, int], counts: dict[str, int]) -> None:
    for key, n in counts.items():
        total[key] = total.get(key, 0) + n


def collect_indicator_stats(model, tokenizer, texts, sparsities=(0.7, 0.8, 0.9),
                            max_tokens: int = 2048) -> dict:
    """CIF and CAF of every Gated-MLP of ``model`` on ``texts``, per layer and pooled over layers.

    Each text is tokenized (``tokenizer(text, return_tensors="pt")["input_ids"]``) and run through
    the dense model (a sparsified one is refused: its residual stream is no longer the model's); a
    forward pre-hook on every Gated-MLP found by
    :func:`countdown.model.gated_mlp.find_gated_mlps` takes its input ``x`` and computes ``u, g = parts(x)``,
    ``h = act(g)``, ``s = u * h`` (in at least float32) for every token. At most ``max_tokens``
    tokens are used in all (an integer >= 1), the last text cut short if needed. ``texts``: a source name or a
    .txt / .jsonl path (as ``--texts``: :func:`countdown.data.texts.as_texts`), or a list of strings, the text.

    Returns ``{"sparsities", "tokens", "texts", "overall": {k: factors}, "layers": {name: {k: factors}}}``
    with ``factors`` as in :func:`factors_from_counts`; "overall" pools the counts of all layers.
    """
    from ..model.gated_mlp import require_gated_mlps
    from ..patch.sparsify import is_sparsified

    if is_sparsified(model):
        raise ValueError("the model is sparsified: call countdown.unsparsify(model) first")
    from ..data.texts import as_texts
    from ..options import check, check_found

    ks = _sparsities(sparsities)
    max_tokens = check("analysis_tokens", max_tokens, "max_tokens")
    texts = as_texts(texts)  # a source name or a .txt / .jsonl path (as --texts); a list of strings is the text
    mlps = require_gated_mlps(model)
    counts = {view.name: {k: {} for k in ks} for view in mlps}

    def hook_for(view):
        def hook(module, args):
            u, g = view.parts(args[0])
            dtype = torch.promote_types(u.dtype, torch.float32)
            u, g = u.to(dtype), g.to(dtype)
            h = view.act(g)
            for k in ks:
                _add(counts[view.name][k], indicator_counts(u, h, u * h, k))
        return hook

    device = next(model.parameters()).device
    handles = [view.module.register_forward_pre_hook(hook_for(view)) for view in mlps]
    tokens = used = 0
    try:
        with torch.no_grad():
            for text in texts:
                if tokens >= max_tokens:
                    break
                ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : max_tokens - tokens]
                if ids.numel() == 0:
                    continue
                model(input_ids=ids.to(device))
                tokens += ids.shape[1]
                used += 1
    finally:
        for handle in handles:
            handle.remove()
    check_found("analysis_tokens", tokens, max_tokens, "max_tokens")  # none: refused; fewer than asked: a warning
    overall = {k: {} for k in ks}
    for per_k in counts.values():
        for k in ks:
            _add(overall[k], per_k[k])
    return {
        "sparsities": ks,
        "tokens": tokens,
        "texts": used,
        "overall": {k: factors_from_counts(overall[k]) for k in ks},
        "layers": {name: {k: factors_from_counts(c) for k, c in per_k.items()}
                   for name, per_k in counts.items()},
    }


def format_indicator_stats(factors_by_k: dict) -> str:
    """A text table of ``{k: factors}`` (e.g. ``stats["overall"]``): one row per sparsity."""
    header = ["k"] + [f"{f[:3].upper()}({v},{f[4:]})" for f in FACTORS for v in SIGNALS]
    rows = [[f"{float(k):g}"] + [f"{factors[v][f]:.3f}" for f in FACTORS for v in SIGNALS]
            for k, factors in factors_by_k.items()]
    widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header] + rows)


def plot_tornado(factors_by_k: dict, path, title: str | None = None) -> Path:
    """Tornado plots of CIF and CAF of ``u`` against ``h``, one bar pair per sparsity, saved as PNG.

    ``factors_by_k`` is ``{k: factors}`` (e.g. ``stats["overall"]``). As in the paper's figure, bars
    to the right are the "alive" factor and bars to the left the "dead" one.
    """
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, leaves the global backend alone

    ks = list(factors_by_k)
    fig = Figure(figsize=(10, 0.6 * len(ks) + 2.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    colors = {"u": "tab:blue", "h": "tab:orange"}
    height = 0.38
    for ax, kind in zip(axes, ("cif", "caf")):
        for j, v in enumerate(SIGNALS):
            y = [i + (j - 0.5) * height for i in range(len(ks))]
            alive = [factors_by_k[k][v][f"{kind}_alive"] for k in ks]
            dead = [factors_by_k[k][v][f"{kind}_dead"] for k in ks]
            ax.barh(y, alive, height=height, color=colors[v], label=v)
            ax.barh(y, [-d for d in dead], height=height, color=colors[v], alpha=0.55)
        ax.axvline(0, color="black", linewidth=0.8)
        limit = max(0.05, *(abs(factors_by_k[k][v][f"{kind}_{a}"]) for k in ks for v in SIGNALS
                            for a in ("alive", "dead"))) * 1.1
        ax.set_xlim(-limit, limit)
        ax.xaxis.set_major_formatter(lambda x, _: f"{abs(x):.2f}")
        ax.set_title(f"{kind.upper()}: dead  <-  |  ->  alive")
        ax.set_yticks(range(len(ks)), [f"k={float(k):g}" for k in ks])
        ax.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    from ..io import atomic_path

    path = Path(path)
    with atomic_path(path, suffix=".png", what="plot") as tmp:  # atomic, the mode kept, OS errors in one line
        fig.savefig(tmp, format="png", dpi=120)
    return path
