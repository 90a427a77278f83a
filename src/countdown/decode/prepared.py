"""The decode step :func:`countdown.generate` prepares on a model: what it swaps, what it depends on, how it is undone.

    step = countdown.PreparedStep.of(model)   # what generate prepared on this model (None: nothing)
    print(step.describe())                    # each swap and its file, what the step is keyed on, current or stale
    step.check()                              # StaleStepError where the model changed since it was prepared
    step.undo()                               # transformers' own forwards and weights' layout back

On CUDA, ``countdown.generate`` makes the batch-1 decode step fast by swapping parts of the model in place (the
model stays a transformers model: ``model.generate`` keeps working, the state dict is unchanged), through
:func:`countdown.decode.linears.fastest_step`:

=====================  ===================================================================================
decode/attention.py    each Llama-style attention: q/k/v as views of one stacked weight (4-bit: one stacked
                       Int4Linear), its forward the fused one (QKV GEMV, rotary + cache write + attention)
decode/hf_attention.py the model's attention implementation: ``countdown_decode`` (the one-token kernel)
decode/linears.py      the Linears of down, gate/up and o_proj, and the fused QKV, on the fixed GEMV
decode/layer.py        each foldable decoder layer's forward: norms and residual adds on our kernels
                       (programmatic dependent launch, kernels/_pdl.py, on while any layer is folded)
decode/int4_step.py    each 4-bit Gated-MLP: gate/up stacked, its forward and its layer's the 4-bit step's
=====================  ===================================================================================

(:func:`countdown.sparsify`'s own swaps, each Gated-MLP's forward and a forward pre-hook, are the sparsity patch's:
``sparsify`` / ``unsparsify`` install and undo them; the step is keyed on the patch.)

What the step depends on is its :class:`StepKey`: the weights' identity (every parameter and persistent buffer:
name, storage, shape, dtype, device), the weight format (``countdown.quantize``'s record), the sparsity patch
(``countdown.sparsify``'s state: its spec, k, scope, path and artifact), the 4-bit backends
(``countdown.int4.use_backend``), the device, the dtype and the attention implementation. Every decode compares
it (:func:`current_step`): a step prepared for another state of the model (a ``quantize``, ``sparsify``,
``unsparsify``, another artifact, a ``use_backend``, a ``.to()`` since) is undone and prepared again (undone only,
where the kernels cannot run on the model's device now), and the compiled decoder is built again with it: a stale
step never runs. (Outside a decode, in ``model.generate`` or a plain forward, a fused attention whose q/k/v were
replaced since runs its own forward: ``attention.fused_current``.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from torch import nn

STEP_ATTR = "_countdown_prepared_step"
PATCH_ATTR = "countdown_sparse"  # the submodule countdown.sparsify hangs on each Gated-MLP


class StaleStepError(RuntimeError):
    """A prepared decode step no longer fits its model (see :meth:`PreparedStep.check`)."""


@dataclass(frozen=True)
class StepKey:
    """What a prepared decode step (and the compiled decoder over it) depends on; equal keys: the step fits."""

    weights: tuple  # (name, data pointer, shape, dtype, device) of every parameter and persistent buffer (the
    #                 sparsity patch's own, its selectors', are the patch's: keyed by ``patch``)
    weight_format: str | None  # countdown.quantize's record (JSON), None where not quantized
    patch: tuple | None  # countdown.sparsify's state: (serial, spec, k, scope, path, artifact), None where not patched
    backends: tuple  # the backend of every 4-bit Linear (countdown.int4.use_backend)
    device: str
    dtype: str
    attention: str | None  # model.config's attention implementation

    @classmethod
    def of(cls, model: nn.Module) -> StepKey:
        from ..int4.linear import Int4Linear
        from ..patch.state import STATE_ATTR

        weights, backends = [], []
        for prefix, module in model.named_modules():
            if f".{PATCH_ATTR}" in f".{prefix}":  # the patch's selectors: keyed by the patch (layouts built lazily)
                continue
            skip = module._non_persistent_buffers_set
            for name, t in (*module._parameters.items(), *module._buffers.items()):
                if t is not None and name not in skip:  # objects, not their text: this runs at every decode
                    weights.append((prefix, name, t.data_ptr(), t.shape, t.dtype, t.device))
            if isinstance(module, Int4Linear):
                backends.append(getattr(module, "backend", "countdown"))
        first = next(iter(model.parameters()), None)
        state = getattr(model, STATE_ATTR, None)
        patch = None if state is None else (state.serial, state.spec.label, state.sparsity, state.scope, state.path,
                                            id(state.artifacts))
        record = getattr(getattr(model, "config", None), "countdown_int4", None)
        return cls(weights=tuple(weights), weight_format=None if record is None else json.dumps(record, sort_keys=True),
                   patch=patch, backends=tuple(backends), device=str(first.device) if first is not None else "none",
                   dtype=str(first.dtype) if first is not None else "none",
                   attention=getattr(getattr(model, "config", None), "_attn_implementation", None))

    def changes(self, now: StepKey) -> list[str]:
        """What changed from this key to ``now``, in words (empty: nothing)."""
        out = []
        for f in fields(self):
            before, after = getattr(self, f.name), getattr(now, f.name)
            if before != after and not (f.name == "backends" and not (before and after)):  # quantize says it
                out.append(_CHANGED[f.name](before, after))
        return out


_CHANGED = {
    "weights": lambda a, b: "its weights were replaced or moved (countdown.quantize, .to(), new tensors)",
    "weight_format": lambda a, b: "its weight format changed (countdown.quantize)",
    "patch": lambda a, b: ("it was sparsified (countdown.sparsify)" if a is None else "it was unsparsified "
                           "(countdown.unsparsify)" if b is None else
                           f"its sparsity patch changed ({a[1]} -> {b[1]}: countdown.sparsify, another artifact)"),
    "backends": lambda a, b: "its 4-bit backend changed (countdown.int4.use_backend)",
    "device": lambda a, b: f"its device changed ({a} -> {b})",
    "dtype": lambda a, b: f"its dtype changed ({a} -> {b})",
    "attention": lambda a, b: f"its attention implementation changed ({a} -> {b})",
}


def _swaps(model: nn.Module) -> dict[str, int]:
    """How many of each swap of the step are on ``model`` now, by the marker each swap leaves in a module's
    ``__dict__`` (one pass, no attribute lookups that fail: this runs at every decode of a prepared model)."""
    from . import attention, int4_step, layer, linears
    from .hf_attention import NAME

    markers = {"attention": attention._BEFORE, "attention4": attention._QKV4, "qkv": attention.QKV_FIXED,
               "linears": linears._ROUTED, "layers": layer._BEFORE, "mlp4": int4_step._GU}
    counts = dict.fromkeys(markers, 0)
    for module in model.modules():
        found = module.__dict__
        for name, marker in markers.items():
            if found.get(marker) is not None and found.get(marker) is not False:
                counts[name] += 1
    counts["implementation"] = int(getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME)
    return counts


_SWAP_TEXT = {
    "attention": ("decode/attention.py", "attention modules fused (q/k/v as views of one stacked weight)"),
    "attention4": ("decode/attention.py", "of them 4-bit (q/k/v one stacked Int4Linear)"),
    "qkv": ("decode/linears.py", "fused QKV projections on the fixed GEMV"),
    "linears": ("decode/linears.py", "Linears (down, gate/up, o_proj) on the fixed GEMV"),
    "layers": ("decode/layer.py", "decoder layers folded (norms and residual adds on our kernels; PDL on)"),
    "mlp4": ("decode/int4_step.py", "4-bit Gated-MLPs stacked (gate/up one GEMV, the 4-bit step's forward)"),
    "implementation": ("decode/hf_attention.py", "attention implementation switched to 'countdown_decode'"),
}


class PreparedStep:
    """The decode step prepared on one model: made by :meth:`install` (``countdown.generate`` does, on CUDA), found
    with :meth:`of`, inspected with :meth:`describe` / :attr:`swaps`, checked with :meth:`check` / :meth:`stale`,
    undone with :meth:`undo`. Holds the model weakly."""

    def __init__(self, model: nn.Module, skipped: list[str]):
        import weakref

        self._model = weakref.ref(model)
        self.skipped = list(skipped)  # the attention modules / layers left alone, and why
        self.key = StepKey.of(model)
        self.installed = _swaps(model)
        self.undone = False

    @classmethod
    def of(cls, model: nn.Module) -> PreparedStep | None:
        """The step prepared on ``model`` (None: none, or undone)."""
        step = model.__dict__.get(STEP_ATTR)
        return step if isinstance(step, PreparedStep) and not step.undone else None

    @classmethod
    def install(cls, model: nn.Module) -> PreparedStep:
        """Prepare the fastest decode step on ``model`` (a step prepared before is undone first); returns it."""
        from .linears import fastest_step

        if model.training:
            raise ValueError("the decode step is prepared on a model in eval mode: call model.eval() first")
        old = cls.of(model)
        if old is not None:
            old.undo()
        step = cls(model, fastest_step(model))
        model.__dict__[STEP_ATTR] = step
        return step

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this prepared step was garbage-collected")
        return model

    @property
    def swaps(self) -> list[str]:
        """What the step swapped when prepared, one line per kind: ``"decode/layer.py: 30 decoder layers folded"``."""
        return [f"{_SWAP_TEXT[name][0]}: {n} {_SWAP_TEXT[name][1]}" if name != "implementation" else
                f"{_SWAP_TEXT[name][0]}: {_SWAP_TEXT[name][1]}" for name, n in self.installed.items() if n]

    def stale(self) -> list[str]:
        """Why the step no longer fits its model, in words (empty: it fits)."""
        if self.undone:
            return ["it was undone"]
        model = self.model
        why = self.key.changes(StepKey.of(model))
        missing = [name for name, n in _swaps(model).items() if n != self.installed[name]]
        if missing:
            why.append(f"its swaps changed since ({', '.join(missing)})")
        return why

    def check(self) -> None:
        """Raise :class:`StaleStepError` naming what changed where the step no longer fits its model."""
        why = self.stale()
        if why:
            raise StaleStepError(f"the decode step prepared on this model no longer fits it: {'; '.join(why)}. "
                                 "countdown.generate prepares it again; PreparedStep.undo() gives the model back")

    def undo(self) -> None:
        """Undo every swap (:func:`countdown.decode.linears.fastest_step` with ``on=False``): transformers' forwards,
        the attention implementation it had, q/k/v in their own storage."""
        from .linears import fastest_step

        if self.undone:
            return
        model = self.model
        fastest_step(model, on=False)
        self.undone = True
        if model.__dict__.get(STEP_ATTR) is self:
            del model.__dict__[STEP_ATTR]

    def describe(self) -> str:
        """The step in words: the model, each swap and its file, what was left alone, what it is keyed on, and
        whether it fits the model now."""
        key = self.key
        lines = [f"decode step prepared on {type(self.model).__name__} ({key.device}, {key.dtype}); "
                 f"{'current' if not self.stale() else 'STALE: ' + '; '.join(self.stale())}"]
        lines += [f"  {line}" for line in self.swaps]
        lines += [f"  left alone: {why}" for why in self.skipped]
        patch = "dense" if key.patch is None else f"{key.patch[1]} k={key.patch[2]} scope={key.patch[3]}"
        lines.append(f"  keyed on: {len(key.weights)} weight tensors, sparsity {patch}, weight format "
                     f"{'float' if key.weight_format is None else 'int4'}"
                     f"{', backends ' + '/'.join(sorted(set(key.backends))) if key.backends else ''}, "
                     f"attention {key.attention}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<PreparedStep {'undone' if self.undone else ', '.join(self.swaps) or 'nothing swapped'}>"


def current_step(model: nn.Module, install: bool = False) -> StepKey:
    """Make the step a decode of ``model`` runs now fit it: the prepared one where it fits; prepared again where it
    is stale (undone only where the kernels cannot run on the model's device now); prepared where none is and
    ``install``. A model with no prepared step and no ``install`` is left as it is (a step built by hand included).
    Returns the model's key as it decodes (what its compiled decoder is keyed on)."""
    from ..kernels import common as _common

    step = PreparedStep.of(model)
    key = StepKey.of(model)
    if step is not None and (step.key != key or _swaps(model) != step.installed):
        step.undo()
        first = next(iter(model.parameters()), None)
        install = install or (first is not None and _common.available(first))
        step = None
        key = key if install else StepKey.of(model)  # the model as it is now, its step undone
    if step is None and install:
        step = PreparedStep.install(model)
    return key if step is None else step.key
