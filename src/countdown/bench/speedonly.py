"""Speed-only SP-Prac artifacts: the right tensors, cut where the model's own decode steps keep 1 - k.

On a model with random weights (a paper-scale shape) a predictor's quality means nothing, and batch-1
decode speed depends on how many rows are kept, not on which. So instead of calibrating on text and
training predictors (66-95 s per method on the Llama-3.1-8B shape), the benchmark builds artifacts of
the real file format and size, with random predictor weights, and fits every layer's threshold or cut
on the sparse model's own decode steps (:func:`fit_cuts_on_decode`), so the kept fraction is k where
it is timed. Rows made with them are labelled ``speed-only``. Kinds this module cannot synthesise
(e.g. a newer one) are built by the library's own calibrate / train_predictors on the dense model's
greedy continuations, then cut the same way.
"""

from __future__ import annotations

import math

import torch

from .specs import Spec

SPEED_ONLY = "speed-only"
RANDOM_KINDS = ("threshold", "lowrank", "hybrid", "ternary")


class SpecUnavailable(RuntimeError):
    """A spec that cannot be built or run here; the message says why (benchmarks print it and skip)."""


def default_rank(spec: Spec, d_model: int, d_inter: int) -> int:
    from ..predictors import DEFAULT_RANK

    rank = spec.options.get("d_rank") or (512 if spec.kind == "lowrank" else DEFAULT_RANK.get(spec.kind, 128))
    return max(1, min(rank, d_model, d_inter))


def _random_tensors(spec: Spec, mlps, ks, generator) -> tuple[dict, dict]:
    """Tensors of a ``spec.kind`` artifact with random predictors and placeholder cuts (keep all)."""
    from ..artifacts import sparsity_key

    if spec.kind == "threshold":
        return {"thresholds": torch.full((len(ks), len(mlps)), -1.0)}, {}
    tensors: dict[str, torch.Tensor] = {}
    rank = default_rank(spec, mlps[0].d_model, mlps[0].d_inter)
    for i, mlp in enumerate(mlps):
        d_m, d_i = mlp.d_model, mlp.d_inter
        if spec.kind == "ternary":
            layer = {"ternary": torch.randint(-1, 2, (d_m, d_i), generator=generator).to(torch.int8),
                     "scale": torch.full((d_i,), 1.0 / math.sqrt(d_m))}
        else:
            layer = {"A": torch.randn(d_m, rank, generator=generator) / math.sqrt(d_m),
                     "B": torch.randn(rank, d_i, generator=generator) / math.sqrt(rank)}
        layer["bias"] = torch.zeros(d_i)
        for k in ks:
            prefix = f"{sparsity_key(k)}/layer{i}/"
            tensors.update({prefix + name: t for name, t in layer.items()})
            tensors[prefix + "cut"] = torch.tensor(-1e30)  # keep everything until fitted
    return tensors, ({} if spec.kind == "ternary" else {"d_rank": rank})


def random_artifacts(model, spec: Spec, ks: list[float], seed: int = 7):
    """A ``spec.kind`` artifact (threshold, lowrank, hybrid, ternary) for ``model`` at ``ks`` with
    random predictor weights and cuts that keep every row: call :func:`fit_cuts_on_decode` next."""
    from ..artifacts import Artifacts, new_meta
    from ..mlp import require_gated_mlps
    from ..registry import get_method

    if spec.kind not in RANDOM_KINDS:
        raise SpecUnavailable(f"{spec.label}: no random stand-in for kind {spec.kind!r}")
    mlps = require_gated_mlps(model)
    tensors, extra = _random_tensors(spec, mlps, ks, torch.Generator().manual_seed(seed))
    selection = "threshold" if spec.kind == "threshold" else "cut"
    meta = new_meta(get_method(spec.method), spec.kind, ks, mlps, selection=selection,
                    data={"name": SPEED_ONLY, "num_tokens": 0, "window": 0}, stand_in=True, **extra)
    return Artifacts(meta, tensors)


def library_artifacts(model, spec: Spec, ks: list[float], texts: list[str], tokenizer, num_tokens: int,
                      window: int = 128):
    """The library's own calibrate / train_predictors for ``spec`` (a kind this module cannot
    synthesise); :class:`SpecUnavailable` with the library's message if it refuses."""
    from ..registry import get_method

    method = get_method(spec.method)
    try:
        if method.prac == "threshold" or spec.kind in (None, "threshold") and method.prac != "predictor":
            from ..calibrate import calibrate

            return calibrate(model, tokenizer, method, ks, texts=texts, num_tokens=num_tokens, window=window,
                             progress=False)
        from ..predictors import train_predictors

        return train_predictors(model, tokenizer, method, ks, texts=texts, num_tokens=num_tokens, window=window,
                                kind=spec.kind, epochs=1, progress=False, **spec.options)
    except (TypeError, ValueError, KeyError, NotImplementedError) as error:
        raise SpecUnavailable(f"{spec.label}: the library could not build it here ({type(error).__name__}: "
                              f"{str(error)[:200]})") from error


def _selectors(model) -> list:
    from ..sparse import state_of

    return [layer.selector for layer in state_of(model).layers]


def _score_fn(method, art):
    """What a layer's selector thresholds, from the arguments it is called with ``(x, u, h)``."""
    if art.kind == "threshold":
        return lambda sel, x, u, h: method.indicator(u, h).float()

    def score(sel, x, u, h):
        try:
            return sel.score(x, u).float()
        except TypeError:
            return sel.score(x).float()
    return score


def fit_cuts_on_decode(model, art, prompts: torch.Tensor, new_tokens: int = 32, rounds: int = 2) -> dict:
    """Set each layer's threshold / cut of ``art`` (in place) so that on the sparse model's own decode
    steps exactly a fraction ``1 - k`` of (step, row) pairs is kept, for every k of the artifact.

    Per k and round: patch ``model`` with ``art`` at k (masked path, prompt dense), generate
    ``new_tokens`` greedily after each row of ``prompts [n, prompt_len]`` (eager), score every decode
    step's rows as the layer's selector does, and put the cut at the k-quantile of those scores. The
    first round sees the activations of the cuts given (the dense model's when they keep every row);
    later rounds those of the sparse model the previous round made. Returns ``{k: [Sparsity-Real of each
    round's generation]}``. Kinds whose selectors expose no score keep their own cuts (NotImplemented
    is never raised: the history then shows how far they are)."""
    from ..artifacts import sparsity_key
    from ..decode import generate_fast
    from ..registry import get_method
    from ..sparse import sparsify, sparsity_real, unsparsify

    method = get_method(art.method)
    score_of = _score_fn(method, art)
    history: dict[float, list[float]] = {}
    for j, k in enumerate(art.sparsities):
        history[k] = []
        for _ in range(rounds):
            sparsify(model, method.name, k, mode="prac", artifacts=art, path="masked")
            scores: list[list[torch.Tensor]] = []
            try:
                selectors = _selectors(model)
                scores = [[] for _ in selectors]

                def hook(module, args, out, i):
                    scores[i].append(score_of(module, *args).flatten())

                handles = [s.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i)) for i, s in enumerate(selectors)]
                try:
                    with torch.no_grad():
                        generate_fast(model, prompts.to(next(model.parameters()).device), new_tokens, compile=False)
                finally:
                    for h in handles:
                        h.remove()
                history[k].append(round(sparsity_real(model)["mean"], 4))
            except (AttributeError, TypeError):
                history[k].append(float("nan"))
                break
            finally:
                unsparsify(model)
            for i, layer_scores in enumerate(scores):
                s = torch.cat(layer_scores)
                rank = min(max(1, round(k * s.numel())), s.numel())
                cut = s.kthvalue(rank).values.cpu()
                if art.kind == "threshold":
                    art.tensors["thresholds"][j, i] = cut
                else:
                    art.tensors[f"{sparsity_key(k)}/layer{i}/cut"] = cut.reshape(())
    art.meta["decode_fit"] = {"rounds": rounds, "prompts": int(prompts.shape[0]), "new_tokens": new_tokens,
                              "sparsity_real_per_round": {f"{k:g}": v for k, v in history.items()}}
    return history


def decode_prompts(vocab: int, n: int, prompt_len: int, seed: int = 100) -> torch.Tensor:
    """``[n, prompt_len]`` random token ids from seeds ``seed, seed + 1, ...`` (never the timed prompt's)."""
    return torch.cat([torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(seed + i))
                      for i in range(n)])


def retarget(model, art, k: float) -> None:
    """Point a model patched with ``art`` at sparsity ``k`` without re-patching: copy the selectors'
    buffers (thresholds, cuts, predictor tensors) of ``art`` at k into the patched selectors in place.
    A compiled decode step reads them from the device, so it runs at k with no recompilation."""
    from ..artifacts import prac_selectors
    from ..mlp import require_gated_mlps

    fresh = prac_selectors(art, require_gated_mlps(model), art.method, k)
    for old, new in zip(_selectors(model), fresh):
        old_buffers = dict(old.named_buffers())
        for name, value in new.named_buffers():
            old_buffers[name].copy_(value)
