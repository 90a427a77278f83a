"""SP-Prac thresholds for threshold methods (M-CountDown, CATS), and the shared streaming pass.

For a threshold method with indicator ``I`` (mono ``|u|``, cats ``|act(g)|``) the paper replaces the
per-token cut ``Quantile(k, I(x_t))`` by one constant per layer, estimated on ``T`` calibration tokens:

    tau_hat^k = (1 / T) * sum_t Quantile(k, I(x_t))

At run time a row is kept when ``I > tau_hat`` (strict). We take ``Quantile(k, v)`` as the value
that exactly ``kept_rows(d_inter, k)`` entries of ``v`` exceed: the ``(n_keep + 1)``-th largest
entry. Then ``I > Quantile`` reproduces the SP-Ideal top-k of that token, and tau_hat is its average.

Everything streams: forward pre-hooks on each Gated-MLP see its input ``x`` as the (unpatched) model
runs over the calibration text in windows; each hook turns ``x`` into per-token quantiles at every
requested ``k`` and adds them to running sums, so nothing per token is kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .artifacts import Artifacts, new_meta
from .mlp import GatedMLP, require_gated_mlps
from .registry import Method, check_sparsity, get_method, kept_rows
from .tp import refuse_sharded

DEFAULT_WINDOW = 512
DEFAULT_CALIBRATION_TOKENS = 4096
DEFAULT_REFINE_TOKENS = 2048  # per k, for the passes on the sparsified model (see calibrate's refine)


# --------------------------------------------------------------------------------------------
# Text -> token windows
# --------------------------------------------------------------------------------------------


def resolve_texts(texts) -> tuple[list[str], str]:
    """``(texts, name)``: the calibration passages of :mod:`countdown.data` when ``texts`` is None,
    otherwise the user's texts named by a hash of their content (recorded in artifacts)."""
    if texts is None:
        from .data import calibration_texts

        return list(calibration_texts()), "countdown.data.calibration_texts (Wikipedia passages)"
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a non-empty list of strings (or None for the default calibration text)")
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]
    return texts, f"user texts ({len(texts)} passages, sha256 {digest})"


def token_windows(tokenizer, texts: Iterable[str], num_tokens: int, window: int = DEFAULT_WINDOW
                  ) -> list[torch.Tensor]:
    """The first ``num_tokens`` tokens of the texts (joined by blank lines) as windows of ``window``
    tokens, each starting with BOS when the tokenizer has one (as :func:`countdown.perplexity`
    scores text, so calibration sees the same positions): LongTensors ``[1, <= window]``."""
    if num_tokens < 1 or window < 2:
        raise ValueError(f"num_tokens must be >= 1 and window >= 2, got {num_tokens} and {window}")
    bos = getattr(tokenizer, "bos_token_id", None)
    body = window - 1 if bos is not None else window
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= num_tokens:
            break
    if not ids:
        raise ValueError("the texts produced no tokens; give non-empty text")
    out, used = [], 0
    for start in range(0, len(ids), body):
        if used >= num_tokens:
            break
        chunk = ([bos] if bos is not None else []) + ids[start:start + body]
        chunk = chunk[:num_tokens - used]
        out.append(torch.tensor([chunk], dtype=torch.long))
        used += len(chunk)
    return out


def first_windows(windows: list[torch.Tensor], num_tokens: int) -> list[torch.Tensor]:
    """The leading windows that hold at most ``num_tokens`` tokens (at least one window)."""
    out, used = [], 0
    for w in windows:
        if out and used + w.numel() > num_tokens:
            break
        out.append(w)
        used += w.numel()
    return out


def batches(windows: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Stack equal-length windows into batches ``[b, window]`` (a shorter last window goes alone)."""
    out, group = [], []
    for w in windows:
        if group and (len(group) == batch_size or group[0].shape[1] != w.shape[1]):
            out.append(torch.cat(group))
            group = []
        group.append(w)
    if group:
        out.append(torch.cat(group))
    return out


# --------------------------------------------------------------------------------------------
# The streaming pass: every Gated-MLP's input, handed to a callback
# --------------------------------------------------------------------------------------------


class _StopForward(Exception):
    """Raised by a hook once every wanted layer has seen its input: the rest of the model is skipped."""


def _check_unpatched(model: nn.Module) -> None:
    from .sparse import is_sparsified

    if is_sparsified(model):
        raise RuntimeError("calibrate/train on the dense model: call countdown.unsparsify(model) first "
                           "(a patched model feeds sparse activations to later layers)")


def stream_mlp_inputs(model: nn.Module, mlps: list[GatedMLP], windows: list[torch.Tensor],
                      on_input: Callable[[int, torch.Tensor], None], layers: list[int] | None = None,
                      batch_size: int = 4, progress: bool = True, desc: str = "calibration pass",
                      allow_patched: bool = False, sharded_ok: bool = False) -> int:
    """Run the model over ``windows`` and call ``on_input(layer_index, x [tokens, d_model])`` for each
    wanted layer's Gated-MLP input. Returns the number of tokens seen.

    The forward stops after the last wanted layer (a later layer's input is never needed).
    ``allow_patched``: run a sparsified model too (its Gated-MLPs then see the inputs that sparse
    upstream layers produce); by default a patched model is refused. ``sharded_ok``: the caller copes
    with a tensor-parallel model (its per-row values gathered, as :func:`indicator_of` does).
    """
    from tqdm.auto import tqdm

    if not allow_patched:
        _check_unpatched(model)
    if not sharded_ok:
        refuse_sharded(mlps, "predictor training")
    wanted = sorted(range(len(mlps)) if layers is None else set(layers))
    if not wanted:
        return 0
    last = wanted[-1]
    device = mlps[0].w_down.device
    handles = []

    def make_hook(index: int):
        def hook(module, args):
            x = args[0]
            on_input(index, x.reshape(-1, x.shape[-1]))
            if index == last:
                raise _StopForward

        return hook

    for i in wanted:
        handles.append(mlps[i].module.register_forward_pre_hook(make_hook(i)))
    seen = 0
    try:
        with torch.no_grad():
            for batch in tqdm(batches(windows, batch_size), desc=desc, disable=not progress, leave=False):
                try:
                    model(input_ids=batch.to(device), use_cache=False)
                except _StopForward:
                    pass
                seen += batch.numel()
    finally:
        for handle in handles:
            handle.remove()
    return seen


# --------------------------------------------------------------------------------------------
# Indicators and quantiles
# --------------------------------------------------------------------------------------------


def indicator_of(method: Method, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """The method's indicator for inputs ``x [N, d_model]``, in float32, computing only what it needs."""
    u = F.linear(x, *_like(x, mlp.w_up, mlp.b_up)).float() if method.needs_up else None
    h = mlp.act(F.linear(x, *_like(x, mlp.w_gate, mlp.b_gate))).float() if method.needs_gate else None
    return mlp.whole_layer(method.indicator(u, h))  # tensor parallel: every rank sees the whole layer


def _like(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``weight, bias`` in ``x``'s dtype and device (captured float32 inputs of a bf16 model)."""
    cast = lambda t: None if t is None else t.detach().to(device=x.device, dtype=x.dtype)  # noqa: E731
    return cast(weight), cast(bias)


def pooled_sample(score: torch.Tensor, n_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """A uniform sample (on the CPU) of the values of ``score [N, d]``, of ``POOLED_SAMPLES * N / n_tokens``
    values: summed over the batches of ``n_tokens`` tokens, about ``POOLED_SAMPLES`` per layer."""
    flat = score.reshape(-1)
    n = max(1, round(POOLED_SAMPLES * score.shape[0] / max(n_tokens, 1)))
    return flat[torch.randint(0, flat.numel(), (n,), generator=gen).to(flat.device)].cpu()


def token_quantiles(score: torch.Tensor, n_keeps: list[int]) -> torch.Tensor:
    """Per token, the value that exactly ``n_keep`` entries exceed (the ``(n_keep + 1)``-th largest),
    for each ``n_keep``: ``[len(n_keeps), N]``. With ``n_keep == d_inter`` there is no such entry
    and the cut is -inf (keep everything)."""
    d = score.shape[-1]
    top = min(max(n_keeps) + 1, d)
    values = score.topk(top, dim=-1, sorted=True).values
    rows = []
    for n in n_keeps:
        if n >= d:
            rows.append(torch.full(score.shape[:-1], -math.inf, dtype=score.dtype, device=score.device))
        else:
            rows.append(values[:, n])
    return torch.stack(rows)


def _sparsity_list(sparsity) -> list[float]:
    ks = [sparsity] if isinstance(sparsity, (int, float)) else list(sparsity)
    if not ks:
        raise ValueError("give at least one sparsity")
    ks = [check_sparsity(k) for k in ks]
    if len({round(k, 6) for k in ks}) != len(ks):
        raise ValueError(f"sparsities must be distinct, got {ks}")
    return ks


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------


RULES = ("mean-quantile", "pooled")
POOLED_SAMPLES = 1 << 18  # indicator values kept per layer for the pooled rule (quantile error ~1e-3)


def calibrate(model: nn.Module, tokenizer, method: str | Method, sparsity, texts=None,
              num_tokens: int = DEFAULT_CALIBRATION_TOKENS, window: int = DEFAULT_WINDOW,
              batch_size: int = 4, rule: str = "mean-quantile", refine: bool = True,
              refine_tokens: int = DEFAULT_REFINE_TOKENS, progress: bool = True) -> Artifacts:
    """Calibrate per-layer SP-Prac thresholds ``tau_hat`` for a threshold method (cats, mono).

    ``sparsity`` is one k or a list: all of them come from ONE pass over ``num_tokens`` tokens of
    ``texts`` (default: :func:`countdown.data.calibration_texts`, never the evaluation text).
    ``rule``: ``"mean-quantile"`` (the paper: mean over tokens of the per-token k-quantile) or
    ``"pooled"`` (the k-quantile of all calibration tokens' indicator values together, estimated from
    a uniform sample of ``POOLED_SAMPLES`` values per layer: it makes the fraction skipped on the
    calibration text exactly k on average, where the paper's rule is biased by how the per-token
    distributions spread).
    ``refine`` (default on): after the dense pass, one more pass per k over the first
    ``refine_tokens`` tokens with the model sparsified by the first thresholds (every position
    sparse), re-estimating each layer's tau from the inputs it sees when the layers before it are
    sparse, as at run time. Dense-only thresholds (``refine=False``, the paper's calibration) skip
    less than k once upstream layers are sparse: on SmolLM2 CATS at k=0.8 skipped 0.768 instead of
    0.787 refined (docs/prac.md).
    Returns :class:`~countdown.artifacts.Artifacts` holding ``thresholds [n_sparsities, n_layers]``.
    """
    m = get_method(method)
    if m.prac != "threshold":
        hint = ("train predictors with countdown.train_predictors" if m.prac == "predictor"
                else "it skips nothing")
        raise ValueError(f"method {m.name!r} does not use calibrated thresholds: {hint}")
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: choose one of {', '.join(RULES)}")
    ks = _sparsity_list(sparsity)
    mlps = require_gated_mlps(model)
    _check_unpatched(model)
    texts, data_name = resolve_texts(texts)
    windows = token_windows(tokenizer, texts, num_tokens, window)

    thresholds, seen = _calibration_pass(model, mlps, windows, m, ks, rule, batch_size, progress,
                                         f"calibrating {m.name}", False)
    refine_windows = first_windows(windows, refine_tokens) if refine else []
    meta = new_meta(m, "threshold", ks, mlps, selection="threshold",
                    data={"name": data_name, "num_tokens": seen, "window": window},
                    d_rank=None, rule=rule, refine=bool(refine),
                    refine_tokens=sum(w.numel() for w in refine_windows))
    if refine:
        from .sparse import sparsify, unsparsify

        first = Artifacts(meta, {"thresholds": thresholds})
        refined = thresholds.clone()
        for j, k in enumerate(ks):
            sparsify(model, m, k, mode="prac", artifacts=first, scope="all")
            try:
                refined[j] = _calibration_pass(model, mlps, refine_windows, m, [k], rule, batch_size, progress,
                                               f"refining {m.name} k={k:g}", True)[0][0]
            finally:
                unsparsify(model)
        thresholds = refined
    return Artifacts(meta, {"thresholds": thresholds})


def _calibration_pass(model, mlps, windows, m: Method, ks: list[float], rule: str, batch_size: int,
                      progress: bool, desc: str, allow_patched: bool) -> tuple[torch.Tensor, int]:
    """One pass over ``windows``: thresholds ``[len(ks), n_layers]`` by ``rule``, and the token count."""
    n_tokens = sum(w.numel() for w in windows)
    n_keeps = [[kept_rows(mlp.d_inter, k) for k in ks] for mlp in mlps]
    sums = torch.zeros(len(ks), len(mlps), dtype=torch.float64)
    counts = torch.zeros(len(mlps), dtype=torch.float64)
    samples: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(mlps))}
    gen = torch.Generator().manual_seed(0)

    def on_input(i: int, x: torch.Tensor) -> None:
        score = indicator_of(m, mlps[i], x)
        if rule == "mean-quantile":
            q = token_quantiles(score, n_keeps[i])
            sums[:, i] += q.double().sum(dim=1).cpu()
        else:
            samples[i].append(pooled_sample(score, n_tokens, gen))
        counts[i] += score.shape[0]

    seen = stream_mlp_inputs(model, mlps, windows, on_input, batch_size=batch_size, progress=progress,
                             desc=desc, allow_patched=allow_patched, sharded_ok=True)
    if rule == "mean-quantile":
        return (sums / counts.clamp_min(1)).float(), seen
    thresholds = torch.zeros(len(ks), len(mlps))
    for i in range(len(mlps)):
        pooled = torch.cat(samples[i]).double()
        for j, k in enumerate(ks):
            thresholds[j, i] = torch.quantile(pooled, k, interpolation="linear").float()
    return thresholds, seen
