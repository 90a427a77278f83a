"""Finding every Gated-MLP in a model, by structure, and reading its parts.

A module is a Gated-MLP when its direct ``nn.Linear`` children can be cast as ``gate`` and ``up``
(``d_model -> d_inter``) and ``down`` (``d_inter -> d_model``), or as one fused ``gate_up``
(``d_model -> 2 d_inter``, Phi-3 style) and ``down``, together with an activation, such that

    module(x) == down(act(gate(x)) * up(x))

on a random probe input. Names and class names are never consulted: gate and up have the same
shape, so which is which (and which half of a fused projection is the gate) is decided by the probe,
which also confirms the activation. This finds Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3 and any
look-alike, and rejects attention blocks and plain MLPs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import tensor_parallel as _tp


class NoGatedMLPError(ValueError):
    """The model has no module of the Gated-MLP form y = down(act(gate(x)) * up(x))."""


class MetaTensorError(ValueError):
    """The model's weights are on the meta device: shapes without values, nothing to compute with."""


def refuse_meta(model: nn.Module, what: str) -> None:
    """A model whose weights are meta tensors (built under ``torch.device("meta")``, or ``from_pretrained`` with
    weights not loaded yet) is refused by name before ``what`` runs: its probe, its quantization or its forward
    would fail inside PyTorch ("Tensor.item() cannot be called on meta tensors") or report no Gated-MLP."""
    meta = next((name for name, p in model.named_parameters() if p.device.type == "meta"), None)
    if meta is not None:
        raise MetaTensorError(f"{what}: the model's weights are meta tensors (shapes without values; {meta} is one): "
                              "load the weights first (from_pretrained, or load_state_dict(state, assign=True) on a "
                              "model built under torch.device('meta')), then call it again")


def _gelu_tanh(t):
    return F.gelu(t, approximate="tanh")


# Reference activations, used to name the model's own activation (kernels need a name) and as
# candidates when a module keeps its activation in a plain function rather than a child module.
KNOWN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
}


def activation_name(act: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """Name an activation by what it computes: "silu", "gelu_tanh", "gelu", "relu" or "custom"."""
    t = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64)
    with torch.no_grad():
        try:
            out = act(t)
        except Exception:
            return "custom"
    for name, ref in KNOWN_ACTIVATIONS.items():
        if torch.allclose(out, ref(t), atol=1e-7, rtol=1e-6):
            return name
    return "custom"


@dataclass(eq=False)
class GatedMLP:
    """A view on one Gated-MLP module of a model. Weights are read live from the module, so the
    view stays right after ``model.to(...)``.

    ``gate``/``up``/``down``/``fused`` are the attribute names of the module's Linear children;
    for a fused projection, ``gate_first`` says whether its first ``d_inter`` outputs are the gate.

    ``tp``: on a tensor-parallel model (Hugging Face ``tp_plan="auto"``: gate/up colwise, down
    rowwise), this rank's :class:`countdown.model.tensor_parallel.ShardSpec`, else None. Then ``w_*`` / ``b_gate`` /
    ``b_up`` are this rank's LOCAL shards (rows ``tp.start:tp.stop``), ``b_down`` is None (added once,
    after the reduction, by :meth:`finish`), ``parts`` gives the local columns of ``u, g``, and
    ``d_inter`` stays the global row count.
    """

    name: str
    module: nn.Module
    down: str
    act: Callable[[torch.Tensor], torch.Tensor]
    act_name: str
    gate: str | None = None
    up: str | None = None
    fused: str | None = None
    gate_first: bool = True
    tp: _tp.ShardSpec | None = None

    def _linear(self, attr: str) -> nn.Linear:
        return getattr(self.module, attr)

    @property
    def d_model(self) -> int:
        return self._linear(self.down).out_features

    @property
    def d_inter(self) -> int:
        if self.tp is not None:
            return self.tp.d_inter
        return self._linear(self.down).in_features

    def _fused_half(self, tensor: torch.Tensor | None, want_gate: bool) -> torch.Tensor | None:
        if tensor is None:
            return None
        first = want_gate == self.gate_first
        d = self.d_inter
        return tensor[:d] if first else tensor[d:]

    @property
    def w_gate(self) -> torch.Tensor:
        if self.fused:
            return self._fused_half(self._linear(self.fused).weight, True)
        return _tp.local_tensor(self._linear(self.gate).weight)

    @property
    def w_up(self) -> torch.Tensor:
        if self.fused:
            return self._fused_half(self._linear(self.fused).weight, False)
        return _tp.local_tensor(self._linear(self.up).weight)

    @property
    def w_down(self) -> torch.Tensor:
        return _tp.local_tensor(self._linear(self.down).weight)

    @property
    def b_gate(self) -> torch.Tensor | None:
        if self.fused:
            return self._fused_half(self._linear(self.fused).bias, True)
        return _tp.local_tensor(self._linear(self.gate).bias)

    @property
    def b_up(self) -> torch.Tensor | None:
        if self.fused:
            return self._fused_half(self._linear(self.fused).bias, False)
        return _tp.local_tensor(self._linear(self.up).bias)

    @property
    def b_down(self) -> torch.Tensor | None:
        if self.tp is not None:
            return None  # added once, after the ranks' partial outputs are summed (finish)
        return self._linear(self.down).bias

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The module's output from ``y``, the down projection of this process's rows: ``y`` itself
        on one process; on a tensor-parallel rank the sum over ranks (one all-reduce) plus the down
        bias."""
        if self.tp is None:
            return y
        return _tp.reduce_partial(y, self.tp, self._linear(self.down).bias)

    def weight_shape(self, which: str) -> tuple[int, ...]:
        """Global shape of W_gate / W_up / W_down (``which``: "gate", "up", "down")."""
        if self.tp is None:
            return tuple(getattr(self, "w_" + which).shape)
        return tuple(self._linear(getattr(self, which)).weight.shape)

    def weight_rows(self, which: str, rows: list[int]) -> torch.Tensor:
        """Rows ``rows`` of the global W_gate / W_up / W_down (a collective on a tensor-parallel
        rank: every rank must call it)."""
        if self.tp is None:
            return getattr(self, "w_" + which).detach()[rows]
        return _tp.global_rows(self._linear(getattr(self, which)).weight, rows, self.tp)

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-activation ``(u, g)`` for inputs ``x [..., d_model]``."""
        if self.fused:
            both = self._linear(self.fused)(x)
            first, second = both.split(self.d_inter, dim=-1)
            g, u = (first, second) if self.gate_first else (second, first)
            return u, g
        if self.tp is not None:  # local rows, on plain tensors (no DTensor dispatch)
            return F.linear(x, self.w_up, self.b_up), F.linear(x, self.w_gate, self.b_gate)
        return self._linear(self.up)(x), self._linear(self.gate)(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dense output ``down(act(g) * u)`` computed from the parts (used by the probe)."""
        u, g = self.parts(x)
        if self.tp is not None:
            return self.finish(F.linear(self.act(g) * u, self.w_down))
        return self._linear(self.down)(self.act(g) * u)


def _activation_candidates(module: nn.Module) -> list[Callable]:
    found = [
        child for name, child in module.named_children()
        if name != "countdown_sparse"
        and not isinstance(child, nn.Linear)
        and not any(True for _ in child.parameters())
    ]
    return found or list(KNOWN_ACTIVATIONS.values())


def _probe_tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def _candidate_views(name: str, module: nn.Module, errors: list) -> Iterator[GatedMLP]:
    """Every way of reading ``module`` as a Gated-MLP; layouts that fit by shape but are sharded in a
    way countdown cannot run go to ``errors`` instead."""
    linears = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear)]
    if not 2 <= len(linears) <= 3:
        return
    acts = _activation_candidates(module)
    for down_name, down in linears:
        d_model, d_inter = down.out_features, down.in_features
        others = [(n, c) for n, c in linears if n != down_name]
        if len(others) == 2:
            if not all(c.in_features == d_model and c.out_features == d_inter for _, c in others):
                continue
            for (gate_name, _), (up_name, _) in itertools.permutations(others):
                try:
                    spec = _tp.shard_spec(module.get_submodule(gate_name).weight,
                                          module.get_submodule(up_name).weight, down.weight)
                except _tp.ShardingError as error:
                    errors.append(error)
                    continue
                for act in acts:
                    yield GatedMLP(name, module, down_name, act, "", gate=gate_name, up=up_name, tp=spec)
        elif len(others) == 1:
            fused_name, fused = others[0]
            if fused.in_features != d_model or fused.out_features != 2 * d_inter:
                continue
            if _tp.is_dtensor(fused.weight) or _tp.is_dtensor(down.weight):
                errors.append(_tp.ShardingError(f"{name}: a fused gate_up projection under tensor parallelism "
                                                "is not supported (each rank would hold a mix of gate and up rows)"))
                continue
            for gate_first in (True, False):
                for act in acts:
                    yield GatedMLP(name, module, down_name, act, "", fused=fused_name, gate_first=gate_first)


def _verify(name: str, module: nn.Module) -> GatedMLP | None:
    """Return the view under which ``module`` computes a Gated-MLP, or None."""
    patched = getattr(module, "countdown_sparse", None)
    if patched is not None:  # already sparsified: its view was verified at patch time
        return patched.mlp
    errors: list = []
    candidates = list(_candidate_views(name, module, errors))
    if not candidates:
        if errors:
            raise errors[0]
        return None
    first = candidates[0]
    weight = first.w_down
    if weight.device.type == "meta":
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, first.d_model, generator=gen).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        try:
            expected = module(x)
        except Exception:
            return None
        if not isinstance(expected, torch.Tensor) or expected.shape != x.shape:
            return None
        scale = expected.float().norm().item() + 1e-12
        best, best_err = None, math.inf
        for view in candidates:
            err = (view.reference(x).float() - expected.float()).norm().item() / scale
            if err < best_err:
                best, best_err = view, err
    if best is None or best_err > _probe_tolerance(weight.dtype):
        return None
    best.act_name = activation_name(best.act)
    return best


def find_gated_mlps(model: nn.Module) -> list[GatedMLP]:
    """Every Gated-MLP in ``model``, in module order, found by structure and verified by a probe."""
    found: list[GatedMLP] = []
    skip_below: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in skip_below):
            continue
        view = _verify(name, module)
        if view is not None:
            found.append(view)
            skip_below.append(name)
    return found


def require_gated_mlps(model: nn.Module) -> list[GatedMLP]:
    """Like :func:`find_gated_mlps`, but a model without any raises a clear error (a model on the meta device
    another, :class:`MetaTensorError`)."""
    refuse_meta(model, "countdown")
    found = find_gated_mlps(model)
    if not found:
        raise NoGatedMLPError(
            f"{type(model).__name__} has no Gated-MLP block (a module computing "
            "down(act(gate(x)) * up(x)) from nn.Linear children); countdown sparsifies SwiGLU/GeGLU "
            "models such as Llama, Mistral, Qwen, Gemma and Phi-3"
        )
    return found
