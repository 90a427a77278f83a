"""Building SP-Prac artifacts: one entry point for every kind, with a cache of built artifacts.

``countdown.prepare(model, tok, spec, k)`` builds any kind (``cache_dir=``: loaded from the cache, or built and
saved there). ``countdown.calibrate``, ``countdown.train_predictors`` and ``countdown.ensure_artifacts`` are
deprecated aliases of it (they warn; the first two keep the checks their names promised).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import sys
import time
from pathlib import Path
from typing import Any

from torch import nn
from tqdm.auto import tqdm

from .store import (SPARSITY_TOL, ArtifactError, Artifacts, load_artifacts, model_fingerprint, new_meta, other_weights,
                         read_meta)
from ..io import check_writable
from ..model.gated_mlp import require_gated_mlps
from ..options import check, check_optional
from ..sparse_methods.registry import Method, get_method, sparsity_list
from ..selectors.stream import (DEFAULT_REFINE_TOKENS, DEFAULT_WINDOW, check_unpatched, first_windows, resolve_texts, token_windows)
from ..selectors.base import DEFAULT_KIND, KINDS, FitContext, check_selection, default_kind, get_kind, kinds_for  # noqa: F401
from ..selectors.cuts import refine_cuts
from ..spec import Spec, build_options

TRAINED = ("lowrank", "ternary")  # the kinds that need gradient training (train_predictors)


def prepare(model: nn.Module, tokenizer, method: str | Spec | Method, sparsity, kind: str | None = None, texts=None,
            num_tokens: int | None = None, window: int = DEFAULT_WINDOW, selection: str | None = None,
            refine: bool = True, refine_tokens: int = DEFAULT_REFINE_TOKENS, checkpoint: str | os.PathLike | None = None,
            progress: bool = True, cache_dir: str | os.PathLike | None = None, **options: Any) -> Artifacts:
    """Build the SP-Prac artifact of ``method`` at one or more sparsities for ``model`` (with ``cache_dir``: load it
    from that folder where it was built before, else build it and save it there).

    method: a method spec (:mod:`countdown.spec`): ``"mono"``, ``"dual"`` (its default kind) or a kind and its
        options in brackets, ``"dual[shadow4]"``, ``"dual[lowrank256]"``; an explicit ``kind=`` or option that
        disagrees with the brackets is refused.
    sparsity: one k in (0, 1) or a list (one data pass serves all of them).
    kind: ``"threshold"`` (cats, mono), ``"hybrid"`` / ``"lowrank"`` / ``"ternary"`` (dual; dejavu:
        lowrank, ternary), ``"teal"`` (teal: thresholds on x and s, :mod:`countdown.selectors.teal`) or any registered kind (``countdown.selectors.KINDS``); default per method
        (:data:`DEFAULT_KIND`).
    texts / num_tokens / window: calibration text (default :func:`countdown.data.texts.calibration_texts`,
        never the evaluation text; a string is a source name or a .txt / .jsonl path, as ``--texts`` on the
        command line, a list of strings the text itself), how many tokens of it (default: the kind's, 4,096
        for thresholds, 8,192 otherwise; at least 64), in windows of ``window`` tokens starting with BOS.
    selection: the run-time rule stored in the artifact (default: the kind's).
    refine / refine_tokens: re-estimate each layer's cut on the model sparsified with the first cuts
        (one pass per k over the first ``refine_tokens`` tokens), so each layer sees the inputs that
        sparse upstream layers produce. Only the cuts change.
    checkpoint: a folder; kinds fitted layer by layer save each finished layer there atomically, and
        a rerun with the same settings continues after the last finished layer, with the same result.
    options: the kind's own (``countdown.selectors.get_kind(kind).defaults`` lists them with defaults),
        e.g. ``rule`` for thresholds, ``d_rank``/``epochs``/``cut_rule`` for predictors.
    cache_dir: a folder of built artifacts (:func:`_cached`: one file per model, spec, options and library version;
        a corrupt or edited file is rebuilt; a call for a subset of the k of a file reuses it). A kind that changes
        the model when it builds (dual[mixed] converts the MLPs to the nested format) changes it on a cached file too.
    Numbers out of their range (:data:`countdown.options.RANGES`, the command line's) are refused before any
    work. Returns :class:`~countdown.artifacts.store.Artifacts`; save it with ``.save(path)``.
    """
    given = dict(kind=kind, texts=texts, num_tokens=num_tokens, window=window, selection=selection, refine=refine,
                 refine_tokens=refine_tokens, checkpoint=checkpoint, progress=progress)
    if cache_dir is not None:  # the cache key holds the arguments given, not those left at their defaults
        given = {key: value for key, value in given.items() if not _is_default(value, _DEFAULTS[key])}
        return _cached(model, tokenizer, method, sparsity, cache_dir, **given, **options)
    return _build(model, tokenizer, method, sparsity, **given, **options)


_DEFAULTS = dict(kind=None, texts=None, num_tokens=None, window=DEFAULT_WINDOW, selection=None, refine=True,
                 refine_tokens=DEFAULT_REFINE_TOKENS, checkpoint=None, progress=True)


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (default is not None and type(value) is type(default) and value == default)


def _build(model: nn.Module, tokenizer, method: str | Spec | Method, sparsity, kind: str | None = None, texts=None,
           num_tokens: int | None = None, window: int = DEFAULT_WINDOW, selection: str | None = None,
           refine: bool = True, refine_tokens: int = DEFAULT_REFINE_TOKENS,
           checkpoint: str | os.PathLike | None = None, progress: bool = True, **options: Any) -> Artifacts:
    """:func:`prepare` without the cache: fit, refine, return."""
    from ..data.models import require_tokenizer

    num_tokens = check_optional("num_tokens", num_tokens)
    window = check("calib_window", window, "window")
    refine_tokens = check("refine_tokens", refine_tokens)
    require_tokenizer(tokenizer, "building SP-Prac artifacts")
    method, kind, options = build_options(method, kind, options)
    m = get_method(method)
    kind_name = default_kind(m) if kind is None else kind
    if kind_name not in KINDS:
        raise ValueError(f"unknown selector kind {kind_name!r}: choose one of {', '.join(KINDS)}")
    spec = get_kind(kind_name)
    if m.name not in spec.methods:
        raise ValueError(f"kind {kind_name!r} applies to {' and '.join(spec.methods)} only; {m.name} takes "
                         f"{', '.join(kinds_for(m)) or 'no kind'}")
    selection = spec.default_selection if selection is None else selection
    check_selection(kind_name, selection)
    ks = sparsity_list(sparsity)
    mlps = require_gated_mlps(model)
    check_unpatched(model)
    opts = spec.resolve_options(m, mlps, options)
    texts, data_name = resolve_texts(texts)
    n = spec.default_tokens if num_tokens is None else num_tokens
    windows = token_windows(tokenizer, texts, n, window)
    data = {"name": data_name, "num_tokens": sum(w.numel() for w in windows), "window": window}
    ctx = FitContext(model=model, kind=kind_name, mlps=mlps, method=m, ks=ks, windows=windows, opts=opts,
                     progress=progress, checkpoint=checkpoint, extra_meta={"data": data})
    start = time.perf_counter()
    tensors = spec.fit(ctx)
    fit_s = time.perf_counter() - start
    refine_windows = first_windows(windows, refine_tokens) if refine else []
    meta = new_meta(m, kind_name, ks, mlps, selection=selection, data=data, **spec.meta(opts),
                    refine=bool(refine), refine_tokens=sum(w.numel() for w in refine_windows))
    art = Artifacts(meta, tensors)
    start = time.perf_counter()
    if refine and not spec.refine(model, mlps, m, art, refine_windows, progress, opts):
        refine_cuts(model, mlps, m, art, refine_windows, progress, rule=spec.refine_rule(opts))
    if progress:  # say what was built: most kinds are closed-form (quantized, fitted, calibrated), not trained
        how = "trained" if kind_name in TRAINED else "built in closed form (no training)"
        tqdm.write(f"{m.name} {kind_name}: {how} on {data['num_tokens']} tokens in {fit_s:.0f} s"
                   + (f", cuts refined on the sparse model in {time.perf_counter() - start:.0f} s" if refine else ""),
                   file=sys.stderr)  # beside the progress bars, not in the output
    return art


def _deprecated(name: str, instead: str) -> None:
    warnings.warn(f"countdown.{name} is a deprecated alias of countdown.prepare and goes in the next release: "
                  f"{instead}", DeprecationWarning, stacklevel=3)


def calibrate(model: nn.Module, tokenizer, method: str | Spec | Method, sparsity, kind: str | None = None,
              **kwargs: Any) -> Artifacts:
    """Deprecated alias of :func:`prepare` (it warns) for the kinds that need no gradient training: thresholds for
    cats, mono and teal, or, with ``kind=`` or a spec that names it (``"dual[shadow4]"``), dual's shadow / hybrid
    kinds; a predictor method without such a kind, or a trained kind, is refused as before. Same arguments as
    :func:`prepare`."""
    _deprecated("calibrate", "call countdown.prepare(model, tokenizer, spec, k), e.g. spec 'mono[threshold]'")
    method, kind, kwargs = build_options(method, kind, kwargs)
    m = get_method(method)
    if kind is None and m.prac != "threshold":
        hint = ("train predictors with countdown.train_predictors, or pass kind= (e.g. kind='shadow')"
                if m.prac == "predictor" else "it skips nothing")
        raise ValueError(f"method {m.name!r} does not use calibrated thresholds: {hint}")
    if kind in TRAINED:
        raise ValueError(f"kind {kind!r} is gradient-trained: use countdown.train_predictors")
    return prepare(model, tokenizer, m, sparsity, kind=kind, **kwargs)


def train_predictors(model: nn.Module, tokenizer, method: str | Spec | Method, sparsity, kind: str | None = None,
                     **kwargs: Any) -> Artifacts:
    """Deprecated alias of :func:`prepare` (it warns) for the predictor methods (dual, dejavu): ``kind="lowrank"``,
    ``"ternary"``, ``"hybrid"`` or ``"shadow"`` (dual's default), or a spec that names the kind
    (``"dual[lowrank256]"``); a threshold method is refused as before. Same arguments as :func:`prepare`."""
    _deprecated("train_predictors", "call countdown.prepare(model, tokenizer, spec, k), e.g. spec 'dual[lowrank]'")
    method, kind, kwargs = build_options(method, kind, kwargs)
    m = get_method(method)
    if m.prac != "predictor":
        hint = ("calibrate thresholds with countdown.calibrate" if m.prac == "threshold" else "it skips nothing")
        raise ValueError(f"method {m.name!r} does not use a trained predictor: {hint}")
    return prepare(model, tokenizer, m, sparsity, kind=kind, **kwargs)


def _options_key(method: Method, options: dict) -> str:
    from .. import __version__

    # The version is part of the key: another release may change the defaults behind the options.
    text = json.dumps({"method": method.name, "version": __version__, **options}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


CACHE_OPTION = "the artifact cache folder: --artifacts-dir, or COUNTDOWN_CACHE for the default"


def ensure_artifacts(model, tokenizer, method: str | Spec | Method, sparsity, cache_dir: str | os.PathLike,
                     **options: Any) -> Artifacts:
    """Deprecated alias (it warns) of
    ``prepare(model, tokenizer, method, sparsity, cache_dir=cache_dir, **options)``."""
    _deprecated("ensure_artifacts", "call countdown.prepare(model, tokenizer, spec, k, cache_dir=folder)")
    return prepare(model, tokenizer, method, sparsity, cache_dir=cache_dir, **options)


def _cached(model, tokenizer, method: str | Spec | Method, sparsity, cache_dir: str | os.PathLike,
            **options: Any) -> Artifacts:
    """Load cached artifacts for (model, method spec, sparsity, options) or build and save them.

    ``method`` is a spec as for :func:`prepare` (``"dual[shadow4]"``: kind and options from the brackets).
    ``sparsity`` is one k or a list (one file then holds all of them; a later call for any subset
    reuses it). ``options`` (the arguments of :func:`prepare` given, ``kind=`` included) are part of the cache key
    with the library version, so other options build other files; an option at its kind's default keys
    the same file as leaving it out (``dual`` and ``dual[shadow4]`` share one). Files are named
    ``<method>-<model fingerprint[:12]>-<options hash>-k<k1>_<k2>.safetensors``; a corrupt or edited
    cached file is skipped and rebuilt.
    """
    method, kind, options = build_options(method, options.pop("kind", None), options)
    if kind is not None:
        options["kind"] = kind
    m = get_method(method)
    ks = sorted({round(k, 6) for k in sparsity_list(sparsity)})
    default_kind(m)
    mlps = require_gated_mlps(model)
    fp = model_fingerprint(mlps)[:12]
    # Options that change the result name the file; progress bars and checkpoint folders do not.
    keyed = {key: value for key, value in options.items() if key not in ("progress", "checkpoint")}
    # the kind is part of the key even when left to the default, so a change of default builds anew
    keyed["kind"] = keyed.get("kind") or default_kind(m)
    if keyed["kind"] in KINDS:  # a kind's option at its default is the same file as the option left out
        defaults = get_kind(keyed["kind"]).defaults
        keyed = {key: value for key, value in keyed.items() if key not in defaults or defaults[key] != value}
    key = _options_key(m, keyed)
    stem = f"{m.name}-{fp}-{key}"
    cache = Path(cache_dir).expanduser()
    if cache.is_dir():
        # this model's files first, then those of the same model in another dtype (fp16 rounds the fingerprint
        # off: its probed weights decide, countdown.model.fingerprint), read from their headers before their tensors
        same = sorted(cache.glob(stem + "-k*.safetensors"))
        other = [c for c in sorted(cache.glob(f"{m.name}-*-{key}-k*.safetensors")) if c not in same]
        for candidate in same + other:
            if candidate in other:
                meta = read_meta(candidate)
                if not isinstance(meta, dict) or not isinstance((meta.get("model") or {}).get("probe"), list) \
                        or other_weights(meta["model"], mlps) is not None:
                    continue
            try:
                art = load_artifacts(candidate)
            except ArtifactError:
                continue  # a corrupt cache entry is rebuilt below, under the requested name
            if all(any(abs(k - have) <= SPARSITY_TOL for have in art.sparsities) for k in ks):
                # a kind whose build changes the model (dual[mixed]: the MLPs to the nested format) changes it on a
                # cached artifact too, so that prepare leaves the model as a build would
                get_kind(art.kind).prepare_model(model, mlps, art.meta)
                return art
    target = cache / f"{stem}-k{'_'.join(f'{k:g}' for k in ks)}.safetensors"
    check_writable(target, CACHE_OPTION)  # before the fit: a read-only or full cache folder fails now, not after it
    art = _build(model, tokenizer, m, ks, **options)
    art.save(target, force=True)
    return art
