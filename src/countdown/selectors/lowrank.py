"""The ``lowrank`` kind (the paper's predictor): ``z = x A B + b`` trained per (layer, k).

``A [d_model, d_rank]``, ``B [d_rank, d_inter]``, ``b [d_inter]``, trained by
:class:`countdown.selectors.train.TrainedKind`. Saved tensors: ``k=<k>/layer<i>/{A, B, bias, cut}``.

Kernel: the predictor's scores ``x A B`` go straight to the dual kernels, which apply the cut themselves
(rows with ``x A B > cut - bias`` are kept: no mask tensor is written) where the selection is a cut or the logit
and kernels/route.py's "lowrank" entry says "dual" (the default); else the mask is computed in PyTorch and the
masked kernel runs ("masked": benchmarks/decode.py --predictor-route compares them).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import kernels
from ..kernels.route import route
from ..sparse_methods.registry import kept_rows
from .base import register_kind, select
from .hybrid import LowRankFactors, full_rank, resolve_rank
from .train import TrainedKind

class LowRankPredictor(nn.Module):
    """``z = x A B + b``: ``A [d_model, d_rank]``, ``B [d_rank, d_inter]``, ``b [d_inter]``."""

    def __init__(self, d_model: int, d_inter: int, d_rank: int, generator: torch.Generator,
                 input_rms: float = 1.0, prior: float = 0.0):
        super().__init__()
        # Scaled so that z starts as N(prior, ~1) whatever the size of x.
        self.A = nn.Parameter(torch.randn(d_model, d_rank, generator=generator) / (math.sqrt(d_model) * input_rms))
        self.B = nn.Parameter(torch.randn(d_rank, d_inter, generator=generator) / math.sqrt(d_rank))
        self.bias = nn.Parameter(torch.full((d_inter,), float(prior)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.A) @ self.B + self.bias

    def export(self) -> dict[str, torch.Tensor]:
        return {"A": self.A.detach().clone(), "B": self.B.detach().clone(), "bias": self.bias.detach().clone()}


def row_cut(bias: torch.Tensor, cut: torch.Tensor, selection: str) -> torch.Tensor:
    """Per-row threshold on the bias-free score: ``cut - bias`` (``"cut"``), ``-bias`` (``"logit"``)."""
    return (-bias if selection == "logit" else cut - bias).float().contiguous()


class LowRankSelector(LowRankFactors):
    """Rows from ``x`` alone by ``x A B + b``; ``row_cut = cut - bias`` (``-bias`` for ``"logit"``) is
    the per-row threshold on ``x A B`` that the fused dual kernel compares against."""

    def __init__(self, tensors: dict[str, torch.Tensor], selection: str, n_keep: int):
        super().__init__(tensors, selection, n_keep)
        self.register_buffer("row_cut", row_cut(self.bias, self.cut, selection))

    def latent_score(self, x: torch.Tensor) -> torch.Tensor:
        """``x A B`` (without the bias) in float32, computed at the factors' precision."""
        return ((x.to(self.A.dtype) @ self.A) @ self.Bt.t()).float()

    def score(self, x, mlp=None):
        return self.latent_score(x) + self.bias

    def forward(self, x, u, h):
        if self.selection != "topk":
            # score > cut  <=>  x A B > cut - bias: the same rule the fused kernel applies
            return self.latent_score(x) > self.row_cut
        return select(self.score(x), self.selection, self.cut, self.n_keep)

    def kernel_forward(self, x2, mlp, w_down_t, count=None):
        if self.selection == "topk" or route("lowrank", x2) == "masked":
            return super().kernel_forward(x2, mlp, w_down_t, count)
        return kernels.dual_gated_mlp(x2, mlp.w_gate, mlp.w_up, w_down_t, self.A, self.Bt.t(), self.row_cut,
                                      mlp.act_name, count=count)

    def kernel_block(self, h2, mlp, w_down_t, norm_w, eps, count=None):
        if self.selection == "topk" or route("lowrank", h2) == "masked":
            return None
        out = kernels.dual_block(h2, norm_w, eps, mlp.w_gate, mlp.w_up, w_down_t, self.A, self.Bt.t(), self.row_cut,
                                 mlp.act_name, count=count)  # no norm kernel: the norm is in the predictor's GEMV
        if out is None:  # the norm on its kernel, the add in the partials' sum
            out = kernels.dual_gated_mlp(kernels.block_input(h2, norm_w, eps), mlp.w_gate, mlp.w_up, w_down_t,
                                         self.A, self.Bt.t(), self.row_cut, mlp.act_name, residual=h2, count=count)
        return out

    def extra_repr(self) -> str:
        return f"kind=lowrank, selection={self.selection}, n_keep={self.n_keep}"


class LowRankKind(TrainedKind):
    name = "lowrank"
    tensor_names = ("A", "B")
    # d_rank keeps the paper's ratio d_rank / d_model = 512 / 4096 (72 for SmolLM2's 576, rounded to 64)
    defaults = {**TrainedKind.defaults, "d_rank": 64}

    def resolve_options(self, method, mlps, given):
        return resolve_rank(super().resolve_options(method, mlps, given), given, mlps)

    def init_rank(self, mlp, opts) -> int:
        return opts["d_rank"]

    def make_predictor(self, mlp, opts, gen, input_rms, prior):
        return LowRankPredictor(mlp.d_model, mlp.d_inter, opts["d_rank"], gen, input_rms, prior)

    def init_from_gate(self, predictor, fit, scale):
        predictor.A.copy_(fit["A"] * scale)
        predictor.B.copy_(fit["B"])

    def selectors(self, artifacts, mlps, method, k):
        return [LowRankSelector(artifacts.layer_tensors(k, i), artifacts.selection, kept_rows(mlp.d_inter, k))
                for i, mlp in enumerate(mlps)]

    def weight_bytes(self, d_model, d_inter, kept, elem_bytes, meta):
        rank = int(meta.get("d_rank") or 64)
        return elem_bytes * (rank * (d_model + d_inter) + 3 * d_model * d_inter * kept) + 8 * d_inter


register_kind(LowRankKind())
__all__ = ["LowRankKind", "LowRankPredictor", "LowRankSelector", "full_rank", "row_cut"]
