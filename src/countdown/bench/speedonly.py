"""Speed-only SP-Prac artifacts: the right tensors, cut where the model's own decode steps keep 1 - k.

On a model with random weights (a paper-scale shape) a predictor's quality means nothing, and batch-1
decode speed depends on how many rows are kept, not on which. So instead of calibrating on text and
training predictors (66-95 s per method on the Llama-3.1-8B shape), the benchmark builds artifacts of
the real file format and size, with random predictor weights, and fits every layer's threshold or cut
on the sparse model's own decode steps (:func:`fit_cuts_on_decode`), so the kept fraction is k where
it is timed. Rows made with them are labelled ``speed-only``. Kinds this module cannot synthesise
(shadow, or a newer one) are built by the library's own ``countdown.artifacts.prepare`` on the dense model's
greedy continuations (:func:`generated_texts`, read back by :class:`IdTokenizer`), then cut the same way.
:func:`retarget` switches a patched model to another k in place (on a :func:`private_copy` of the artifact).
"""

from __future__ import annotations

import math

import torch

from ..spec import Spec, parse_spec

SPEED_ONLY = "speed-only"
RANDOM_KINDS = ("threshold", "lowrank", "hybrid", "ternary", "shadow")  # shadow: the model's own weights quantized


class SpecUnavailable(RuntimeError):
    """A spec that cannot be built or run here; the message says why (benchmarks print it and skip)."""


SPEED_RANK = {"lowrank": 512}  # the paper's d_rank at the Llama-3.1-8B shape (the library's default is 64)


def default_rank(spec: Spec, d_model: int, d_inter: int) -> int:
    """``d_rank`` of a random stand-in: the spec's, else :data:`SPEED_RANK`, else the kind's default."""
    from ..selectors.kinds import KINDS

    rank = spec.options.get("d_rank") or SPEED_RANK.get(spec.kind) or KINDS[spec.kind].defaults.get("d_rank") or 128
    return max(1, min(int(rank), d_model, d_inter))


def _random_tensors(spec: Spec, mlps, ks, generator) -> tuple[dict, dict]:
    """Tensors of a ``spec.kind`` artifact with random predictors and placeholder cuts (keep all):
    per layer ``shared/layer<i>/...`` (served at every k) and ``k=<k>/layer<i>/cut``."""
    from ..artifacts.store import sparsity_key

    if spec.kind == "threshold":
        return {"thresholds": torch.full((len(ks), len(mlps)), -1.0)}, {"rule": "speed-only", "d_rank": None}
    if spec.kind == "shadow":
        return _shadow_tensors(spec, mlps, ks)
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
        tensors.update({f"shared/layer{i}/{name}": t for name, t in layer.items()})
        for k in ks:
            tensors[f"{sparsity_key(k)}/layer{i}/cut"] = torch.tensor(-1e30)  # keep everything until fitted
    return tensors, {"d_rank": None if spec.kind == "ternary" else rank}


def _shadow_tensors(spec: Spec, mlps, ks) -> tuple[dict, dict]:
    """The shadow kind's tensors: the model's own W_gate / W_up quantized (on their device, as the
    library's fit does; closed form, nothing to train) and placeholder cuts that keep every row."""
    from ..artifacts.store import sparsity_key
    from ..kernels.shadow.format import pack_bits, quantize_rtn
    from ..selectors.shadow import DEFAULT_BITS, DEFAULT_GROUP

    bits, group = int(spec.options.get("bits", DEFAULT_BITS)), int(spec.options.get("group", DEFAULT_GROUP))
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, mlp in enumerate(mlps):
            for name, w in (("gate", mlp.w_gate), ("up", mlp.w_up)):
                q, scale = quantize_rtn(w, bits, group)
                tensors[f"shared/layer{i}/{name}_q"] = pack_bits(q, bits).cpu()
                tensors[f"shared/layer{i}/{name}_scale"] = scale.cpu()
            for k in ks:
                tensors[f"{sparsity_key(k)}/layer{i}/cut"] = torch.tensor(-1e30)
    return tensors, {"bits": bits, "group": group, "cut_rule": "speed-only", "d_rank": None}


def random_artifacts(model, spec: str | Spec, ks: list[float], seed: int = 7):
    """A ``spec.kind`` artifact (threshold, lowrank, hybrid, ternary, shadow; a plain method: its default
    kind) for ``model`` at ``ks`` with random predictor weights (shadow: the model's own weights quantized)
    and cuts that keep every row: call :func:`fit_cuts_on_decode` next."""
    from ..artifacts.store import Artifacts, new_meta
    from ..model.gated_mlp import require_gated_mlps
    from ..sparse_methods.registry import get_method

    spec = parse_spec(spec).resolved()
    if spec.kind not in RANDOM_KINDS:
        raise SpecUnavailable(f"{spec.label}: no random stand-in for kind {spec.kind!r}")
    mlps = require_gated_mlps(model)
    tensors, extra = _random_tensors(spec, mlps, ks, torch.Generator().manual_seed(seed))
    selection = "threshold" if spec.kind == "threshold" else "cut"  # every kind's cut rule
    meta = new_meta(get_method(spec.method), spec.kind, ks, mlps, selection=selection,
                    data={"name": SPEED_ONLY, "num_tokens": 0, "window": 0}, stand_in=True, **extra)
    return Artifacts(meta, tensors)


def library_artifacts(model, spec: str | Spec, ks: list[float], texts: list[str], tokenizer, num_tokens: int,
                      window: int = 128):
    """The library's own builder (``countdown.artifacts.prepare``) for ``spec`` (a kind this module cannot
    synthesise, e.g. shadow: closed-form, seconds); :class:`SpecUnavailable` with the library's
    message if it refuses."""
    from ..artifacts.prepare import prepare

    spec = parse_spec(spec).resolved()
    options = dict(spec.options)
    if spec.kind in ("lowrank", "ternary"):
        options.setdefault("epochs", 1)
    try:
        return prepare(model, tokenizer, spec.method, ks, kind=None if spec.kind == "threshold" else spec.kind,
                       texts=texts, num_tokens=num_tokens, window=window, progress=False, **options)
    except (TypeError, ValueError, KeyError, NotImplementedError) as error:
        raise SpecUnavailable(f"{spec.label}: the library could not build it here ({type(error).__name__}: "
                              f"{str(error)[:200]})") from error


def _decode_scores(model, art, k: float, prompts: torch.Tensor, new_tokens: int):
    """Every layer's selector scores on the decode steps of ``model`` patched with ``art`` at ``k``
    (masked path, prompt dense, greedy, eager), and the Sparsity-Real of that generation; None for a
    kind without a score, or whose patch does not call its selector's forward (dual[mixed])."""
    from ..decode.generate import generate_fast
    from ..patch.sparsify import sparsify, sparsity_real, state_of, unsparsify, with_mode

    sparsify(model, with_mode(art.method, "prac", art), k, artifacts=art, path="masked")
    try:
        layers = state_of(model).layers
        if not all(callable(getattr(layer.selector, "score", None)) for layer in layers):
            return None, float("nan")  # a selector with no score (teal's keeps two cuts): its own cuts stay
        scores: list[list[torch.Tensor]] = [[] for _ in layers]

        def hook(module, args, out, i):
            scores[i].append(module.score(args[0], layers[i].mlp).float().flatten())

        handles = [layer.selector.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i))
                   for i, layer in enumerate(layers)]
        try:
            with torch.no_grad():
                generate_fast(model, prompts.to(next(model.parameters()).device), new_tokens, compile=False)
        except NotImplementedError:  # a kind without a score keeps the cuts it was built with
            return None, float("nan")
        finally:
            for h in handles:
                h.remove()
        if not all(scores):  # a patch that never calls its selector's forward (dual[mixed] ranks inside the MLP):
            return None, float("nan")  # its cuts stay as its builder fitted them
        return [torch.cat(s) for s in scores], round(sparsity_real(model)["mean"], 4)
    finally:
        unsparsify(model)


def _quantile_cuts(scores: list[torch.Tensor], k: float) -> list[torch.Tensor]:
    cuts = []
    for s in scores:
        rank = min(max(1, round(k * s.numel())), s.numel())
        cuts.append(s.kthvalue(rank).values.cpu())
    return cuts


def fit_cuts_on_decode(model, art, prompts: torch.Tensor, new_tokens: int = 32, rounds: int = 2,
                       shared_first: bool | None = None) -> dict:
    """Set each layer's threshold / cut of ``art`` (in place) so that on the sparse model's own decode
    steps exactly a fraction ``1 - k`` of (step, row) pairs is kept, for every k of the artifact.

    Per k and round: patch ``model`` with ``art`` at k (masked path, prompt dense), generate
    ``new_tokens`` greedily after each row of ``prompts [n, prompt_len]`` (eager), score every decode
    step's rows as the layer's selector does, and put the cut at the k-quantile of those scores. The
    first round sees the activations of the cuts given (the dense model's when they keep every row);
    later rounds those of the sparse model the previous round made. Every kind's selector gives its
    score (``RowSelector.score(x, mlp)``) and its kind stores the cuts (``SelectorKind.set_cuts``).

    ``shared_first`` (default: for stand-ins, whose placeholder cuts keep every row): the first round
    is the dense model's at every k, so one generation serves all of them. Returns
    ``{k: [Sparsity-Real of each round's generation]}``."""
    from ..selectors.base import get_kind

    kind = get_kind(art.kind)
    ks = list(art.sparsities)
    history: dict[float, list[float]] = {k: [] for k in ks}
    if shared_first is None:
        shared_first = bool(art.meta.get("stand_in"))
    left = {k: rounds for k in ks}
    if shared_first and rounds > 0:
        scores, real = _decode_scores(model, art, ks[0], prompts, new_tokens)
        for k in ks:
            history[k].append(real)
            left[k] -= 1
            if scores is not None:
                kind.set_cuts(art, k, _quantile_cuts(scores, k))
        if scores is None:
            left = {k: 0 for k in ks}
    for k in ks:
        for _ in range(left[k]):
            scores, real = _decode_scores(model, art, k, prompts, new_tokens)
            history[k].append(real)
            if scores is None:
                break
            kind.set_cuts(art, k, _quantile_cuts(scores, k))
    art.meta["decode_fit"] = {"rounds": rounds, "shared_first": shared_first, "prompts": int(prompts.shape[0]),
                              "new_tokens": new_tokens,
                              "sparsity_real_per_round": {f"{k:g}": v for k, v in history.items()}}
    return history


def decode_prompts(vocab: int, n: int, prompt_len: int, seed: int = 100) -> torch.Tensor:
    """``[n, prompt_len]`` random token ids from seeds ``seed, seed + 1, ...`` (never the timed prompt's)."""
    return torch.cat([torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(seed + i))
                      for i in range(n)])


def retarget(model, art, k: float) -> None:
    """Point a model patched with ``art`` at sparsity ``k`` without re-patching: copy the selectors'
    buffers (thresholds, cuts, predictor tensors) of ``art`` at k into the patched selectors in place.
    A compiled decode step reads them from the device, so it runs at k with no recompilation. Buffers
    the patched selector no longer holds (a shadow's int8 copies, once packed for the kernel) are the
    same at every k and skipped."""
    from ..selectors.base import selectors_for
    from ..patch.sparsify import state_of

    layers = state_of(model).layers
    fresh = selectors_for(art, [layer.mlp for layer in layers], art.method, k)
    for layer, new in zip(layers, fresh):
        old_buffers = dict(layer.selector.named_buffers())
        for name, value in new.named_buffers():
            if name in old_buffers:
                old_buffers[name].copy_(value)


def private_copy(art):
    """``art`` with its own tensors: a selector may hold a view of an artifact tensor (a CPU threshold
    does), and :func:`retarget` writes into the selectors' buffers in place."""
    return type(art)(art.meta, {name: t.clone() for name, t in art.tensors.items()})


class IdTokenizer:
    """A stand-in tokenizer for models without one: the text is token ids separated by spaces."""

    bos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [int(t) for t in text.split()]}


def generated_texts(model, prompt_len: int, n_tokens: int, n_prompts: int) -> list[str]:
    """``n_prompts`` random prompts (seeds 100, 101, ...) each with the dense model's greedy
    continuation, about ``n_tokens`` tokens in all, as :class:`IdTokenizer` text."""
    from ..decode.generate import generate_fast

    new = max(1, n_tokens // n_prompts - prompt_len)
    prompts = decode_prompts(model.config.vocab_size, n_prompts, prompt_len).to(next(model.parameters()).device)
    out, _ = generate_fast(model, prompts, new, compile="eager")
    return [" ".join(str(int(t)) for t in row.tolist()) for row in out]
