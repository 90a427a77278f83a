"""Gradient-trained predictors (the paper's kinds, ``lowrank`` and ``ternary``): the shared training.

A predictor scores every row of a Gated-MLP from the block's input ``x`` alone. Both kinds are
trained with binary cross-entropy against the oracle keep mask: per token, the
``kept_rows(d_inter, k)`` rows with the largest indicator (``|u * act(g)|`` for dual, ``act(g)``
for dejavu). ``pos_weight`` (> 1) weighs kept rows up, trading precision for recall.
``init="gate"`` (default) starts them from the closed-form gate estimate of
:func:`countdown.selectors.hybrid.fit_gate_lowrank` instead of noise (``"random"``, the paper): rows with
a large gate pre-activation are the ones both methods keep most, and with the few epochs a CPU
budget allows this start is worth more than the training (docs/prac.md).

Run-time rules (``selection``): ``"logit"`` keeps rows with ``z > 0`` (the paper); ``"cut"`` keeps
rows whose score exceeds a per-layer cut calibrated like the thresholds; ``"topk"`` keeps exactly
``kept_rows(d_inter, k)`` rows of largest score per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..artifacts.store import ArtifactError, sparsity_key
from ..model.gated_mlp import GatedMLP
from ..nonfinite import check_finite
from ..sparse_methods.registry import Method, kept_rows
from .stream import indicator_of
from .base import SelectorKind
from .capture import fit_by_capture
from .cuts import CUT_RULES, calibrated_cuts, check_cut_rule
from .hybrid import fit_gate_lowrank

INITS = ("gate", "random")
GATE_INIT_SLOPE = 4.0


def oracle_masks(score: torch.Tensor, n_keeps: list[int]) -> list[torch.Tensor]:
    """Per token, True for the ``n_keep`` largest entries of ``score [N, d_inter]``, per ``n_keep``."""
    order = score.topk(max(n_keeps), dim=-1, sorted=True).indices
    return [torch.zeros_like(score, dtype=torch.bool).scatter_(-1, order[:, :n], True) for n in n_keeps]


def layer_seed(seed: int, layer: int, k_index: int) -> int:
    """One seed per (layer, sparsity): a layer trains the same way whether or not others ran first."""
    return int(seed) * 1_000_003 + layer * 1009 + k_index


def train_bce(predictor: nn.Module, X: torch.Tensor, Y: torch.Tensor, *, epochs: int, batch_size: int,
              lr: float, weight_decay: float, pos_weight: float | None, generator: torch.Generator,
              progress: bool, desc: str) -> list[float]:
    """AdamW on binary cross-entropy between ``predictor(X)`` and the 0/1 mask ``Y``; returns the
    mean loss of each epoch."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(predictor.parameters(), lr=lr, weight_decay=weight_decay)
    pw = None if pos_weight is None else torch.tensor(float(pos_weight), device=X.device)
    losses = []
    n = X.shape[0]
    for _ in tqdm(range(epochs), desc=desc, disable=not progress, leave=False):
        perm = torch.randperm(n, generator=generator)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start:start + batch_size]
            loss = F.binary_cross_entropy_with_logits(predictor(X[idx]), Y[idx].float(), pos_weight=pw)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * idx.numel()
        losses.append(check_finite(total / n, f"{desc}: the training loss"))  # per epoch: no read per batch
    return losses


class TrainedKind(SelectorKind):
    """Base of ``lowrank`` and ``ternary``: BCE-trained per (layer, k), fitted by capture.

    Subclasses give ``make_predictor(mlp, opts, gen, input_rms, prior)`` (an ``nn.Module`` with
    ``forward(x) -> logits`` and ``export() -> tensors``) and ``init_from_gate(predictor, fit, scale)``.
    """

    methods = ("dual", "dejavu")
    selections = ("cut", "logit", "topk")
    default_selection = "cut"
    defaults = {"d_rank": None, "epochs": 2, "batch_size": 512, "lr": 1e-3, "weight_decay": 0.0,
                "pos_weight": None, "init": "gate", "seed": 42, "cut_rule": "mean-quantile",
                "max_activation_gb": 2.0}
    spec_number = "d_rank"  # dual[lowrank256]
    choices = {"cut_rule": CUT_RULES, "init": INITS}

    def resolve_options(self, method, mlps, given):
        opts = super().resolve_options(method, mlps, given)
        check_cut_rule(opts["cut_rule"])
        if opts["init"] not in INITS:
            raise ValueError(f"unknown init {opts['init']!r}: choose one of {', '.join(INITS)}")
        return opts  # the numbers were checked against countdown.options' ranges (SelectorKind.resolve_options)

    def meta(self, opts):
        return {"d_rank": opts["d_rank"], "training": {k: v for k, v in opts.items() if k not in ("d_rank",
                                                                                                   "max_activation_gb")}}

    def fit(self, ctx):
        return fit_by_capture(ctx, self.fit_layer, desc=f"training {ctx.method.name} {self.name} predictors")

    def fit_layer(self, method: Method, mlp: GatedMLP, layer: int, X: torch.Tensor, ks: list[float], opts: dict,
                  progress: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor of one layer's predictors, at every sparsity: ``{"k=<k>/layer<i>/<name>": ...}``."""
        n_keeps = [kept_rows(mlp.d_inter, k) for k in ks]
        with torch.no_grad():
            masks = oracle_masks(indicator_of(method, mlp, X), n_keeps)
            gate_fit = fit_gate_lowrank(mlp, X, self.init_rank(mlp, opts)) if opts["init"] == "gate" else None
        input_rms = float(X.pow(2).mean().sqrt().clamp_min(1e-6))
        out = {}
        for j, (k, n_keep) in enumerate(zip(ks, n_keeps)):
            gen = torch.Generator().manual_seed(layer_seed(opts["seed"], layer, j))
            prior = math.log(n_keep / (mlp.d_inter - n_keep)) if n_keep < mlp.d_inter else 0.0
            predictor = self.make_predictor(mlp, opts, gen, input_rms, prior)
            predictor.to(X.device)  # initialised from the CPU generator: the same start on any device
            if gate_fit is not None:
                self._init_from_gate(predictor, gate_fit, X, n_keep)
            train_bce(predictor, X, masks[j], epochs=opts["epochs"], batch_size=opts["batch_size"], lr=opts["lr"],
                      weight_decay=opts["weight_decay"], pos_weight=opts["pos_weight"], generator=gen,
                      progress=progress, desc=f"layer {layer} k={k:g}")
            tensors = predictor.export()
            with torch.no_grad():
                tensors["cut"] = calibrated_cuts(lambda a, b: predictor(X[a:b]), X.shape[0], [n_keep],
                                                 rule=opts["cut_rule"])[0]
            for name, t in tensors.items():
                out[f"{sparsity_key(k)}/layer{layer}/{name}"] = t.detach().cpu().contiguous()
        return out

    def _init_from_gate(self, predictor: nn.Module, fit: dict, X: torch.Tensor, n_keep: int) -> None:
        """Start at ``z = a * (g_hat - c)``: the closed-form gate estimate, cut at its calibrated
        k-quantile ``c`` and scaled so that one standard deviation of ``g_hat`` is
        ``GATE_INIT_SLOPE`` logits: BCE starts from a sensible ranking instead of noise."""
        with torch.no_grad():
            g_hat = lambda a, b: (X[a:b] @ fit["A"]) @ fit["B"] + fit["bias"]  # noqa: E731
            c = float(calibrated_cuts(g_hat, X.shape[0], [n_keep])[0])
            scale = GATE_INIT_SLOPE / float(g_hat(0, min(X.shape[0], 4096)).std().clamp_min(1e-6))
            self.init_from_gate(predictor, fit, scale)
            predictor.bias.copy_((fit["bias"] - c) * scale)

    def check(self, artifacts):
        for k in artifacts.sparsities:
            for i in range(artifacts.meta["model"]["n_layers"]):
                have = artifacts.layer_tensors(k, i)
                missing = [name for name in self.tensor_names + ("bias", "cut") if name not in have]
                if missing:
                    raise ArtifactError(f"{self.name} artifact lacks {', '.join(missing)} of layer {i} at k={k:g}; "
                                        "rebuild it")
