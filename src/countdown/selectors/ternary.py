"""The ``ternary`` kind (the paper's TernaryLinear): ``z = x (Q * scale) + b`` with ``Q`` in {-1, 0, 1}.

Per-output scale ``scale[j] = mean_i |W[i, j]|`` and ``Q = clamp(round(W / scale), -1, 1)`` of a
latent float ``W`` trained through a straight-through estimator (BitNet b1.58 style) by
:class:`countdown.selectors.train.TrainedKind`. Saved tensors: ``k=<k>/layer<i>/{ternary (int8),
scale, bias, cut}``; deployed at 2 bits a weight. Kernel: mask in PyTorch, then the masked kernel.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..sparse_methods.registry import kept_rows
from .base import RowSelector, register_kind, select
from .train import TrainedKind


def ternarize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, scale)``: ``scale[j] = mean_i |W[i, j]|`` and ``Q = clamp(round(W / scale), -1, 1)``."""
    scale = weight.abs().mean(dim=0).clamp_min(1e-8)
    return (weight / scale).round().clamp(-1, 1), scale


class TernaryPredictor(nn.Module):
    """``z = x (Q * scale) + b``; the forward uses ``Q * scale``, the gradient flows to the latent
    ``weight`` as if the quantization were the identity."""

    def __init__(self, d_model: int, d_inter: int, generator: torch.Generator, input_rms: float = 1.0,
                 prior: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_model, d_inter, generator=generator)
                                   / (math.sqrt(d_model) * input_rms))
        self.bias = nn.Parameter(torch.full((d_inter,), float(prior)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = ternarize(self.weight)
        w = self.weight + (q * scale - self.weight).detach()
        return x @ w + self.bias

    def export(self) -> dict[str, torch.Tensor]:
        q, scale = ternarize(self.weight.detach())
        return {"ternary": q.to(torch.int8), "scale": scale.clone(), "bias": self.bias.detach().clone()}


class TernarySelector(RowSelector):
    """Rows from ``x`` alone by ``(x Q) * scale + b``."""

    def __init__(self, tensors: dict[str, torch.Tensor], selection: str, n_keep: int):
        super().__init__()
        self.selection = selection
        self.n_keep = int(n_keep)
        self.register_buffer("ternary", tensors["ternary"].clone())
        self.register_buffer("scale", tensors["scale"].clone())
        self.register_buffer("bias", tensors["bias"].float().clone())
        self.register_buffer("cut", tensors["cut"].float().reshape(()).clone())

    def score(self, x, mlp=None):
        return (x.float() @ self.ternary.float()) * self.scale + self.bias

    def forward(self, x, u, h):
        return select(self.score(x), self.selection, self.cut, self.n_keep)

    def extra_repr(self) -> str:
        return f"kind=ternary, selection={self.selection}, n_keep={self.n_keep}"


class TernaryKind(TrainedKind):
    name = "ternary"
    tensor_names = ("ternary", "scale")
    spec_number = None  # full rank: no d_rank to write

    def resolve_options(self, method, mlps, given):
        opts = super().resolve_options(method, mlps, given)  # d_rank is accepted and unused: full rank
        opts["d_rank"] = None
        return opts

    def init_rank(self, mlp, opts) -> int:
        return mlp.d_model  # a full-rank start

    def make_predictor(self, mlp, opts, gen, input_rms, prior):
        return TernaryPredictor(mlp.d_model, mlp.d_inter, gen, input_rms, prior)

    def init_from_gate(self, predictor, fit, scale):
        predictor.weight.copy_((fit["A"] @ fit["B"]) * scale)

    def selectors(self, artifacts, mlps, method, k):
        return [TernarySelector(artifacts.layer_tensors(k, i), artifacts.selection, kept_rows(mlp.d_inter, k))
                for i, mlp in enumerate(mlps)]

    def weight_bytes(self, d_model, d_inter, kept, elem_bytes, meta):
        return d_model * d_inter / 4 + elem_bytes * 3 * d_model * d_inter * kept + 12 * d_inter


register_kind(TernaryKind())
