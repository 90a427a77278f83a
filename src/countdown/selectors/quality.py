"""How good SP-Prac masks are, and cuts re-fitted on the sparse model's own decode steps.

:func:`predictor_quality` compares any kind's keep masks with the SP-Ideal (oracle) masks of its
method on held-out text; :func:`refine_cuts_on_decode` re-fits the cuts of kinds scored from ``x``
alone on the sparse model's own greedy continuations, where activations drift from the dense ones.
"""

from __future__ import annotations

import torch
from torch import nn

from ..artifacts.store import Artifacts, load_artifacts, sparsity_key
from ..decode.generate import generate_fast
from ..model.gated_mlp import GatedMLP, require_gated_mlps
from ..sparse_methods.registry import get_method, kept_rows
from ..patch.sparsify import sparsify, unsparsify, with_mode
from ..patch.state import sparsity_real, state_of
from .stream import DEFAULT_WINDOW, stream_mlp_inputs, token_windows
from ..model.tensor_parallel import refuse_sharded
from .base import selectors_for
from .train import oracle_masks

# Kinds whose score needs nothing but x (their cuts can be re-fitted from captured decode inputs).
DECODE_REFIT_KINDS = ("lowrank", "ternary", "shadow")


def _on_devices(selectors: list, mlps: list[GatedMLP]) -> list:
    """Each selector in its Gated-MLP's dtype, as :func:`countdown.sparsify` holds it."""
    for sel, mlp in zip(selectors, mlps):
        sel.to_model_dtype(mlp.w_down.dtype)
    return selectors


def refine_cuts_on_decode(model: nn.Module, artifacts: Artifacts, prompts: torch.Tensor, new_tokens: int = 64,
                          rounds: int = 2) -> dict[float, list[float]]:
    """Re-fit a predictor artifact's cuts, in place, on the *sparse* model's own decode steps.

    Cuts fitted on the dense model's activations (or refined on calibration text) can keep another
    fraction of rows on the sparse model's own greedy continuations: its activations drift (measured on
    a random-weight Llama-3.1-8B shape: Sparsity-Real 0.963 at k = 0.9, docs/decode.md). Per k and
    round: patch the model with the current cuts (masked path, prompt dense), generate ``new_tokens``
    greedily after every row of ``prompts [n, prompt_len]``, collect each layer's decode-step inputs
    x, and set the layer's cut to the k-quantile of the pooled scores of those steps (so that exactly a
    fraction 1 - k of (step, row) pairs scores above it). Only ``cut`` tensors change. Use prompts
    other than the ones you evaluate on.

    Returns ``{k: [Sparsity-Real of each round's generation]}``: how far each round's cuts were from k
    on the sparse model's own decode steps (the first entry is the artifact as given)."""
    from ..options import check

    new_tokens, rounds = check("max_new_tokens", new_tokens, "new_tokens"), check("rounds", rounds)
    m = get_method(artifacts.method)
    if artifacts.kind not in DECODE_REFIT_KINDS:
        raise ValueError(f"refine_cuts_on_decode re-fits cuts of predictors scored from x alone ({', '.join(DECODE_REFIT_KINDS)}), "
                         f"got kind {artifacts.kind!r}")
    if prompts.dim() != 2 or prompts.shape[0] < 1:
        raise ValueError(f"prompts must be token ids [n, prompt_len], got shape {tuple(prompts.shape)}")
    mlps = require_gated_mlps(model)
    refuse_sharded(mlps, "refine_cuts_on_decode")  # a cut is a quantile over every row of a layer
    prompts = prompts.to(mlps[0].w_up.device)
    history: dict[float, list[float]] = {}
    for k in artifacts.sparsities:
        history[k] = []
        for _ in range(rounds):
            by_cut = artifacts.with_selection("cut")
            sparsify(model, with_mode(m.name, "prac", by_cut), k, artifacts=by_cut, path="masked")
            layers = state_of(model).layers
            selectors = [layer.selector for layer in layers]
            inputs: list[list[torch.Tensor]] = [[] for _ in selectors]
            hooks = [sel.register_forward_hook(lambda mod, args, out, i=i: inputs[i].append(args[0].detach()))
                     for i, sel in enumerate(selectors)]
            try:
                with torch.no_grad():
                    generate_fast(model, prompts, new_tokens, compile=False)
                    history[k].append(round(sparsity_real(model)["mean"], 4))
                    for i, (sel, xs) in enumerate(zip(selectors, inputs)):
                        score = sel.score(torch.cat(xs), layers[i].mlp).float().flatten()
                        rank = min(max(1, round(k * score.numel())), score.numel())
                        cut = score.kthvalue(rank).values
                        artifacts.tensors[f"{sparsity_key(k)}/layer{i}/cut"] = cut.reshape(()).cpu()
            finally:
                for h in hooks:
                    h.remove()
                unsparsify(model)
    artifacts.meta["decode_refit"] = {"rounds": rounds, "prompts": int(prompts.shape[0]),
                                      "prompt_len": int(prompts.shape[1]), "new_tokens": new_tokens,
                                      "sparsity_real_per_round": {f"{k:g}": v for k, v in history.items()}}
    return history


def predictor_quality(model: nn.Module, tokenizer, artifacts, texts=None, num_tokens: int = 4096,
                      window: int = DEFAULT_WINDOW, progress: bool = True) -> dict:
    """Per-layer precision / recall / F1 of the SP-Prac keep masks against the SP-Ideal (oracle) mask
    of the artifact's method, and the fraction of rows they skip, on held-out text.

    texts: default :func:`countdown.data.texts.eval_texts` (XSum; never the calibration text); a string is a source
        name or a .txt / .jsonl path (as ``--texts``), a list of strings the text itself. num_tokens: an integer
        >= 64; window: an integer >= 2 (:data:`countdown.options.RANGES`). artifacts: an Artifacts or a path.
    Works for threshold artifacts too (the mask of ``indicator > tau``).
    Returns ``{"method", "kind", "selection", "num_tokens", "by_sparsity": {k: {"precision",
    "recall", "f1", "sparsity", "per_layer": [{"precision", "recall", "f1", "sparsity"}, ...]}}}``
    where the top-level figures are means over layers.
    """
    from ..data.models import require_tokenizer
    from ..data.texts import as_texts
    from ..options import check

    num_tokens, window = check("num_tokens", num_tokens), check("calib_window", window, "window")
    require_tokenizer(tokenizer, "predictor_quality")
    if not isinstance(artifacts, Artifacts):
        artifacts = load_artifacts(artifacts)
    texts = as_texts(texts)  # None: XSum; a source name or a file path; a list of strings is the text itself
    m = get_method(artifacts.method)
    mlps = require_gated_mlps(model)
    ks = artifacts.sparsities
    selectors = {k: _on_devices(selectors_for(artifacts, mlps, m, k), mlps) for k in ks}
    counts = torch.zeros(len(ks), len(mlps), 4, dtype=torch.float64)  # tp, fp, fn, kept
    rows = torch.zeros(len(mlps), dtype=torch.float64)
    windows = token_windows(tokenizer, texts, num_tokens, window)

    def on_input(i: int, x: torch.Tensor) -> None:
        mlp = mlps[i]
        u, g = mlp.parts(x)
        u, h = u.float(), mlp.act(g).float()
        oracle = oracle_masks(m.indicator(u, h), [kept_rows(mlp.d_inter, k) for k in ks])
        for j, k in enumerate(ks):
            pred = selectors[k][i](x, u, h)
            counts[j, i, 0] += float((pred & oracle[j]).sum())
            counts[j, i, 1] += float((pred & ~oracle[j]).sum())
            counts[j, i, 2] += float((~pred & oracle[j]).sum())
            counts[j, i, 3] += float(pred.sum())
        rows[i] += x.shape[0] * mlp.d_inter

    seen = stream_mlp_inputs(model, mlps, windows, on_input, progress=progress, desc="predictor quality")
    report = {"method": m.name, "kind": artifacts.kind, "selection": artifacts.selection,
              "num_tokens": seen, "by_sparsity": {}}
    for j, k in enumerate(ks):
        per_layer = []
        for i in range(len(mlps)):
            tp, fp, fn, kept = counts[j, i].tolist()
            precision = tp / max(tp + fp, 1)
            recall = tp / max(tp + fn, 1)
            f1 = 2 * precision * recall / max(precision + recall, 1e-12)
            per_layer.append({"precision": precision, "recall": recall, "f1": f1,
                              "sparsity": 1.0 - kept / max(float(rows[i]), 1)})
        summary = {key: sum(p[key] for p in per_layer) / len(per_layer)
                   for key in ("precision", "recall", "f1", "sparsity")}
        report["by_sparsity"][k] = {**summary, "per_layer": per_layer}
    return report
