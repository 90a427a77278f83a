"""Patching a model so that its Gated-MLPs skip rows, and restoring it.

``sparsify`` attaches a :class:`SparseGatedMLP` (or, for a method that skips inputs rather than rows,
TEAL, a :class:`countdown.sparse_methods.teal.InputSparseGatedMLP`) to every Gated-MLP module and points the module's
``forward`` at it; parameters, their names and the module tree stay as they were, so
``unsparsify`` only has to undo two attributes and the original computation comes back bit for bit.

Each sparse forward is: pick the rows to keep per token (a *selector*: exact top-k of the method's
indicator in SP-Ideal, a calibrated threshold or a trained predictor in SP-Prac), then compute only
those rows. Two equivalent paths:

* ``masked``: every projection dense, coefficients of skipped rows zeroed (for evaluation);
* ``gather``: only the union of the batch's kept rows of W_gate / W_up / W_down is read and
  multiplied, so FLOPs really drop (for CPU decoding; batch-1 decode reads exactly the kept rows).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..model.foreign_weights import refuse_foreign_quantization
from ..model.gated_mlp import GatedMLP, require_gated_mlps
from .patched_mlp import PatchedMLP
from ..selectors.base import KINDS, RowSelector, selectors_for
from ..artifacts.store import ArtifactError, Artifacts, load_artifacts, method_mismatch, read_meta
from ..sparse_methods.registry import Method, check_sparsity, get_method, kept_rows
from ..spec import DEFAULT_SCOPE, SCOPES, Spec, artifact_spec, check_artifact, parse_spec, resolve_mode
from .state import (STATE_ATTR, AlreadySparsifiedError, NotSparsifiedError, SparsityState, dense_prefix,
                    is_sparsified, mark_prompt_pass, reset_sparsity_stats, sparsity_real, state_of)
from ..sparse_methods.teal import InputSparseGatedMLP, TealTopK, refuse_teal_sharded
from ..model.tensor_parallel import shard_selectors

PATHS = ("auto", "masked", "gather", "kernel")


# --------------------------------------------------------------------------------------------
# SP-Ideal: the exact per-token top-k (the SP-Prac kinds live in countdown.selectors)
# --------------------------------------------------------------------------------------------


class TopKSelector(RowSelector):
    """SP-Ideal: per token, exactly the ``n_keep`` rows with the largest indicator."""

    def __init__(self, method: Method, n_keep: int):
        super().__init__()
        self.method = method
        self.n_keep = int(n_keep)
        self.needs_up = method.needs_up
        self.needs_gate = method.needs_gate

    def forward(self, x, u, h):
        score = self.method.indicator(u, h)
        idx = score.topk(self.n_keep, dim=-1, sorted=False).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)

    def extra_repr(self) -> str:
        return f"method={self.method.name}, n_keep={self.n_keep}"


# --------------------------------------------------------------------------------------------
# The sparse Gated-MLP
# --------------------------------------------------------------------------------------------


class SparseGatedMLP(PatchedMLP):
    """Skips rows of d_inter: a row of W_gate and W_up and a column of W_down per keep decision."""

    def _select(self, x2, u, h, token_sparse):
        keep = self.selector(x2, u, h)
        if token_sparse is not None:
            self._count(keep[token_sparse])
            keep = keep | ~token_sparse[:, None]
        else:
            self._count(keep)
        return keep

    def _count(self, keep: torch.Tensor) -> None:
        kernels.count_keep(self.counters(), keep)

    def _selector_has_kernel(self) -> bool:
        return not isinstance(self.selector, TopKSelector)

    def _kernel_layout(self, path: str) -> list[torch.Tensor]:
        # the kernels read W_down^T rows; W_gate / W_up rows are contiguous already. CPU runs keep the layout.
        return [self.mlp.w_down] if path in ("auto", "kernel") and self.mlp.w_down.is_cuda else []

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        # w_down.t() is contiguous on CUDA: sparsify stored W_down transposed in place (store_for_kernels).
        # The kernel that keeps the rows counts them (kernels/jit_helpers.py add_count).
        return self.selector.kernel_forward(x2, self.mlp, self.mlp.w_down.t().contiguous(), count=self.counters())

    def _block(self, h2: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor | None:
        block = getattr(self.selector, "kernel_block", None)
        return None if block is None else block(h2, self.mlp, self.mlp.w_down.t().contiguous(), norm_w, eps,
                                                count=self.counters())

    def _masked(self, x2: torch.Tensor, token_sparse: torch.Tensor | None) -> torch.Tensor:
        mlp = self.mlp
        u, g = mlp.parts(x2)
        h = mlp.act(g)
        keep = self._select(x2, u, h, token_sparse)
        s = torch.where(keep, u * h, torch.zeros((), dtype=u.dtype, device=u.device))
        return F.linear(s, mlp.w_down, mlp.b_down)

    def _gather(self, x2: torch.Tensor, token_sparse: torch.Tensor | None) -> torch.Tensor:
        mlp, sel = self.mlp, self.selector
        u = h = None
        if sel.needs_up:
            u = F.linear(x2, mlp.w_up, mlp.b_up)
        if sel.needs_gate:
            h = mlp.act(F.linear(x2, mlp.w_gate, mlp.b_gate))
        keep = self._select(x2, u, h, token_sparse)
        rows = keep.any(dim=0).nonzero().squeeze(1)
        if u is not None:
            u_rows = u.index_select(1, rows)
        else:
            u_rows = F.linear(x2, mlp.w_up.index_select(0, rows), _rows(mlp.b_up, rows))
        if h is not None:
            h_rows = h.index_select(1, rows)
        else:
            h_rows = mlp.act(F.linear(x2, mlp.w_gate.index_select(0, rows), _rows(mlp.b_gate, rows)))
        s_rows = u_rows * h_rows
        if x2.shape[0] > 1:  # rows kept by another token of the batch do not count for this one
            s_rows = torch.where(keep.index_select(1, rows), s_rows, torch.zeros((), dtype=s_rows.dtype, device=s_rows.device))
        return F.linear(s_rows, mlp.w_down.index_select(1, rows), mlp.b_down)


def _rows(bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if bias is None else bias.index_select(0, rows)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return value


def build_selectors(mlps: list[GatedMLP], method: Method, sparsity: float | None, mode: str,
                    artifacts: Any = None) -> list[RowSelector | None]:
    """One selector per Gated-MLP for (method, sparsity, mode); None everywhere for dense."""
    if method.is_dense:
        return [None] * len(mlps)
    if mode == "ideal" and method.structure == "inputs":
        return [TealTopK(kept_rows(m.d_model, sparsity), kept_rows(m.d_inter, sparsity)) for m in mlps]
    if mode == "ideal":
        return [TopKSelector(method, kept_rows(m.d_inter, sparsity)) for m in mlps]
    return selectors_for(artifacts, mlps, method, sparsity)


def with_mode(spec: str | Spec | Method, mode: str | None, artifacts: Any = None) -> Spec:
    """The spec that says ``mode`` by itself: the ``mode=`` of earlier releases folded in (no warning here; the
    entry points that take ``mode=`` warn). None or ``"ideal"`` leave the spec as it is (``"ideal"`` with a kind is
    refused); ``"prac"`` on a plain method names the artifact's kind and options (``"dual"`` with a dual[hybrid]
    artifact -> ``dual[hybrid]``; a path's metadata is read, not its tensors)."""
    spec = parse_spec(spec)
    if mode is None:
        return spec
    resolve_mode(spec, mode)
    if mode == "ideal" or spec.kind is not None or spec.is_dense:
        return spec
    if artifacts is None:
        raise ValueError(f"mode='prac' needs artifacts for {spec.method}: build them with countdown.prepare(model, "
                         f"tokenizer, {spec.resolved().label!r}, k) (`countdown calibrate` / `countdown train`) and "
                         f"pass artifacts=<path or object> (--artifacts PATH) with the spec {spec.resolved().label!r}")
    meta = artifacts.meta if isinstance(artifacts, Artifacts) else read_meta(artifacts)
    if not isinstance(meta, dict) or meta.get("kind") not in KINDS:
        meta = load_artifacts(artifacts).meta  # its own error: no such file, corrupt, an unknown kind
    if meta.get("method") != spec.method:
        raise method_mismatch(meta["method"], spec.method)
    try:
        return spec._keep(artifact_spec(meta))
    except ArtifactError:  # a kind not registered: said as the artifact's own error
        raise
    except ValueError:  # options recorded outside the spec grammar (a harness's stand-in artifact): its kind alone
        return spec._keep(parse_spec(f"{spec.method}[{meta['kind']}]"))


def mode_warning(spec: Spec, mode: str) -> str:
    """The deprecation message of ``mode=`` (``--mode``), naming the spec that says it (``spec``: folded)."""
    how = "a plain method is SP-Ideal" if spec.kind is None else "the kind in brackets makes it SP-Prac"
    return (f"mode={mode!r} (--mode {mode}) is deprecated and goes in the next release: a spec says SP-Ideal or "
            f"SP-Prac by itself; write {spec.label!r} ({how})")


def check_artifacts_given(spec: Spec, artifacts: Any) -> None:
    """Refuse a spec that cannot use what was given: an SP-Prac spec needs its artifact, an SP-Ideal one takes
    none (every entry point calls this before its work, the command line before the model load)."""
    if spec.is_dense:
        return
    if spec.mode == "ideal" and artifacts is not None:
        have = _artifact_label(artifacts)
        have = f" ({have!r} for this artifact)" if have else ""
        raise ValueError(f"{spec.label!r} is SP-Ideal (the exact per-token top-k) and would ignore the artifacts "
                         f"(calibrated thresholds / predictors): write the artifact's spec, the method with its kind "
                         f"in brackets{have}, for SP-Prac, or drop artifacts (--artifacts)")
    if spec.mode == "prac" and artifacts is None:
        raise ValueError(f"{spec.label!r} is SP-Prac (its kind in brackets) and needs its artifact: build it with "
                         f"countdown.prepare(model, tokenizer, {spec.label!r}, k) (`countdown calibrate` / `countdown "
                         f"train`) and pass artifacts=<path or object> (--artifacts PATH), or write {spec.method!r} "
                         "for SP-Ideal")


def _artifact_label(artifacts: Any) -> str | None:
    """The spec of an artifact (an object, or a path whose header is read), or None where it cannot be read."""
    try:
        return artifact_spec(artifacts.meta if isinstance(artifacts, Artifacts) else read_meta(artifacts)).label
    except Exception:  # no file, no metadata, a kind not registered: the error names the rest
        return None


def sparsify(model: nn.Module, method: str | Spec | Method, sparsity: float | None = None, mode: str | None = None,
             scope: str | None = None, artifacts: Any = None, path: str = "auto",
             tp_topk: str = "exact", kernel_options: kernels.KernelOptions | None = None) -> nn.Module:
    """Patch every Gated-MLP of ``model`` in place to skip rows; returns ``model``.

    method: a method spec (:mod:`countdown.spec`): a name from :func:`countdown.methods` (or an alias such
        as ``"m-countdown"``) for SP-Ideal (the exact per-token top-(1-k) of the indicator), or a method with its
        SP-Prac kind in brackets (``"dual[shadow4]"``, ``"mono[threshold]"``, ``"dual[lowrank]"``): calibrated
        thresholds / trained predictors from ``artifacts``, whose kind it must be. A :class:`~countdown.spec.Spec`
        may carry k and the scope (``parse_spec("dual[shadow4]", k=0.5)``).
    sparsity: k in (0, 1), the fraction of ``d_inter`` rows skipped per token (ignored for dense; teal: the
        fraction of the entries of x and of s = u * act(g) skipped, see :mod:`countdown.sparse_methods.teal`); default the spec's.
    mode: deprecated (it warns; it goes in the next release): ``"prac"`` with a plain method takes the artifact's
        kind, ``"ideal"`` with a kind is refused. Write the spec instead.
    scope: ``"decode"`` (the default, the paper's setting: the prompt, i.e. any forward that starts
        with an empty KV cache, stays dense; generated tokens are sparse) or ``"all"`` (every
        position sparse, as in perplexity-style evaluation); default the spec's, else ``"decode"``.
    path: ``"auto"`` (default: decode steps take the Triton kernels on CUDA with SP-Prac selectors, replayed
        from a CUDA graph when called eagerly, and ``"gather"`` on the CPU; ``"masked"`` otherwise), ``"masked"`` (dense projections, skipped rows zeroed), ``"gather"``
        (only kept rows are read: fewer FLOPs, for CPU decoding) or ``"kernel"`` (the kernels
        wherever Triton can run, e.g. under TRITON_INTERPRET=1). All compute the same function.
    artifacts: for an SP-Prac spec, an :class:`~countdown.artifacts.store.Artifacts` or the path of its file (a string is
        always a path, as ``--artifacts``); it fits the model it was built on in fp32, bf16 and fp16 alike.
    tp_topk: tensor-parallel models (:mod:`countdown.model.tensor_parallel`): a per-token top-k across the ranks' shards is
        ``"exact"`` (default: the global top-k) or ``"shard"`` (each shard keeps its share of rows).
    kernel_options: the kernel route's choices that are the user's (:class:`countdown.kernels.KernelOptions`:
        whether an eager CUDA call replays a CUDA graph); default ``KernelOptions()``.

    ``dual[mixed]`` (:mod:`countdown.selectors.mixed`) skips nothing: its kept rows are computed at 8 bits and the rest at
    4; it holds the MLPs in the nested 8-bit format, converting them here where they are float, and
    :func:`unsparsify` leaves them so (the 8-bit model).
    """
    refuse_foreign_quantization(model, "countdown.sparsify")  # torchao / bitsandbytes / GPTQ... weights
    if is_sparsified(model):
        raise AlreadySparsifiedError(
            "this model is already sparsified; call countdown.unsparsify(model) before patching it again"
        )
    spec = with_mode(method, mode, artifacts)
    if mode is not None:
        warnings.warn(mode_warning(spec, mode), DeprecationWarning, stacklevel=2)
    m = get_method(spec.method)
    k = None if m.is_dense else check_sparsity(_one_of("sparsity", sparsity, spec.k))
    scope = _check_choice(_one_of("scope", scope, spec.scope) or DEFAULT_SCOPE, SCOPES, "scope")
    check_artifacts_given(spec, artifacts)
    _check_choice(path, PATHS, "path")
    if spec.weights is not None and spec.weights != Spec.of(model).weights:
        have = Spec.of(model).weights or "as loaded (not quantized)"
        raise ValueError(f"the spec's weights are {spec.weights} but the model's are {have}: quantize the model as the "
                         "spec says (countdown.quantize) or drop the spec's weights")
    mlps = require_gated_mlps(model)
    if path == "kernel" and not m.is_dense and not kernels.available(mlps[0].w_down):
        why = ("Triton is not installed" if not kernels.common.has_triton() else
               "the model is on the CPU and TRITON_INTERPRET=1 is not set")
        raise ValueError(f"path='kernel' cannot run here: {why}; use path='auto' (kernels where they can run, "
                         "masked otherwise), 'masked' or 'gather'")
    if m.structure == "inputs":
        refuse_teal_sharded(mlps)
    given = artifacts  # kept as given (a path is not held in memory as its tensors: countdown.save re-reads it)
    if spec.mode == "prac" and not m.is_dense:
        artifacts = artifacts if isinstance(artifacts, Artifacts) else load_artifacts(artifacts)
        check_artifact(spec, artifacts)  # a kind in brackets must be the artifact's
    undo = None
    if spec.mode == "prac" and not m.is_dense:  # a kind that runs on weights of its own makes them first (dual[mixed])
        from ..selectors.base import get_kind

        undo = get_kind(artifacts.kind).prepare_model(model, mlps, artifacts.meta)
    try:
        selectors = build_selectors(mlps, m, k, spec.mode, artifacts)  # may raise: nothing patched yet
        shard_selectors(mlps, selectors, tp_topk)  # tensor parallel: each rank's rows of its selectors
    except BaseException:
        if undo is not None:
            undo()
        raise

    spec = replace(spec, k=None, scope=None, weights=None)  # the state holds them in its own fields
    state = SparsityState(method=m, sparsity=k, mode=spec.mode, scope=scope, path=path, spec=spec,
                          artifacts=given if spec.mode == "prac" and not m.is_dense else None,
                          kernel_options=kernel_options or kernels.KernelOptions())
    for index, (mlp, selector) in enumerate(zip(mlps, selectors)):
        layer_class = InputSparseGatedMLP if m.structure == "inputs" else \
            getattr(selector, "patched_class", SparseGatedMLP)  # dual[mixed]: countdown.patch.mixed_mlp
        layer = layer_class(mlp, selector, state, index)
        ref = mlp.w_down
        layer.to(device=ref.device)
        if selector is not None:
            selector.to_model_dtype(ref.dtype)  # half-precision predictors on half-precision models
        module = mlp.module
        object.__setattr__(layer, "original_forward", module.forward)
        object.__setattr__(layer, "had_instance_forward", "forward" in module.__dict__)
        object.__setattr__(layer, "previous_instance_forward", module.__dict__.get("forward"))
        module.countdown_sparse = layer
        module.forward = layer.forward
        state.layers.append(layer)
        if selector is not None:
            layer.store_for_kernels(path, True)
    state.hook = model.register_forward_pre_hook(mark_prompt_pass(state), with_kwargs=True)
    object.__setattr__(model, STATE_ATTR, state)
    if hasattr(type(model), "save_pretrained") and "save_pretrained" not in model.__dict__:
        from ..model.saving import save_pretrained_method  # model.save_pretrained keeps the sparsity (countdown.save)

        object.__setattr__(model, "save_pretrained", save_pretrained_method(model))
    follow_state(model)
    if not m.is_dense:
        _note_4bit_route(mlps)
    return model


def follow_state(model: nn.Module) -> None:
    """A model ``from_pretrained`` rebuilt carries countdown's quantizer (:mod:`countdown.model.hf_quantizer`): its record
    (``config.quantization_config``) is made what the model is now."""
    follow = getattr(getattr(model, "hf_quantizer", None), "follow_state", None)
    if follow is not None:
        follow(model)


def _one_of(name: str, given: Any, in_spec: Any) -> Any:
    """``given``, else the spec's; both given and different is refused."""
    if given is not None and in_spec is not None and given != in_spec:
        raise ValueError(f"{name}={given!r} was given but the spec says {name}={in_spec!r}: drop one")
    return in_spec if given is None else given


def _note_4bit_route(mlps: list[GatedMLP]) -> None:
    """On 4-bit MLP weights (countdown.quantize), one line on stderr: the patch computes the sparse MLP, but no 4-bit
    kernel skips rows (skipping on 4-bit weights did not pay through countdown.generate: docs/experiments.md)."""
    from ..data.texts import log
    from ..int4.linear import Int4Linear

    if any(isinstance(getattr(g.module, g.down), Int4Linear) for g in mlps):
        log("sparsify: on 4-bit MLP weights the patch computes the sparse MLP with its own forward; no 4-bit kernel "
            "skips rows: expect no speed-up over the dense 4-bit step. For near-4-bit bytes at near-8-bit quality use "
            "dual[mixed] on the float model (docs/mixed.md)")


def unsparsify(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify`: the model computes exactly what it computed before; returns it."""
    state = state_of(model)
    for layer in state.layers:
        module = layer.mlp.module
        del module.forward
        if layer.had_instance_forward:
            module.forward = layer.previous_instance_forward
        del module.countdown_sparse
        layer.store_for_kernels(state.path, False)
    state.hook.remove()
    object.__delattr__(model, STATE_ATTR)
    if Spec.of(model).weights is None:  # a 4-bit model keeps the save that writes its record (countdown.quantize)
        model.__dict__.pop("save_pretrained", None)
    follow_state(model)
    return model


