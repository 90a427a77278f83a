"""The ``threshold`` kind: a calibrated per-layer cut on the method's own indicator (CATS, M-CountDown).

For a threshold method with indicator ``I`` (mono ``|u|``, cats ``|act(g)|``) the paper replaces the
per-token cut ``Quantile(k, I(x_t))`` by one constant per layer, estimated on ``T`` calibration tokens:

    tau_hat^k = (1 / T) * sum_t Quantile(k, I(x_t))

At run time a row is kept when ``I > tau_hat`` (strict). We take ``Quantile(k, v)`` as the value
that exactly ``kept_rows(d_inter, k)`` entries of ``v`` exceed: the ``(n_keep + 1)``-th largest
entry, so ``I > Quantile`` reproduces the SP-Ideal top-k of that token and tau_hat is its average.
All k come from one streaming pass (:mod:`countdown.selectors.stream`); ``rule="pooled"`` takes the quantile of
all tokens' values together instead (:mod:`countdown.selectors.cuts`).

Saved tensors: ``thresholds [n_sparsities, n_layers]`` (float32). Kernel: the fused mono / cats
kernels compare the indicator with tau on the GPU (the one-launch kernel for a single token).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..artifacts.store import ArtifactError, Artifacts
from ..model.gated_mlp import GatedMLP
from ..sparse_methods.registry import Method, kept_rows
from .stream import indicator_of, stream_mlp_inputs
from .base import FitContext, RowSelector, SelectorKind, register_kind
from .cuts import CUT_RULES, CutEstimator


class ThresholdSelector(RowSelector):
    """Keep rows whose indicator exceeds the calibrated cut ``threshold`` (a 0-dim float32 buffer)."""

    def __init__(self, method: Method, threshold: float | torch.Tensor):
        super().__init__()
        self.method = method
        self.needs_up = method.needs_up
        self.needs_gate = method.needs_gate
        self.register_buffer("threshold", torch.as_tensor(threshold, dtype=torch.float32).reshape(()).clone())

    def forward(self, x, u, h):
        # Compared in float32, as the kernels do, so both paths keep the same rows.
        return self.method.indicator(u, h).float() > self.threshold

    def score(self, x: torch.Tensor, mlp: GatedMLP) -> torch.Tensor:
        return indicator_of(self.method, mlp, x)

    def kernel_forward(self, x2, mlp, w_down_t, count=None):
        op = {"mono": kernels.mono_gated_mlp, "cats": kernels.cats_gated_mlp}.get(self.method.name)
        if op is None:  # a threshold on another indicator: mask in PyTorch, masked kernel
            return super().kernel_forward(x2, mlp, w_down_t, count)
        return op(x2, mlp.w_gate, mlp.w_up, w_down_t, self.threshold, mlp.act_name, count=count)

    def kernel_block(self, h2, mlp, w_down_t, norm_w, eps, count=None):
        op = {"mono": kernels.mono_gated_mlp, "cats": kernels.cats_gated_mlp}.get(self.method.name)
        if op is None:
            return None
        out = kernels.threshold_block(h2, norm_w, eps, mlp.w_gate, mlp.w_up, w_down_t, self.threshold,
                                      self.method.name, mlp.act_name, count=count)  # the norm inside the kernel
        if out is None:  # the norm on its kernel, the add in the partials' sum
            out = op(kernels.block_input(h2, norm_w, eps), mlp.w_gate, mlp.w_up, w_down_t, self.threshold,
                     mlp.act_name, residual=h2, count=count)
        return out

    def extra_repr(self) -> str:
        return f"method={self.method.name}, threshold={float(self.threshold):.5g}"


class ThresholdKind(SelectorKind):
    name = "threshold"
    methods = ("cats", "mono")
    selections = ("threshold",)
    default_selection = "threshold"
    cut_selection = "threshold"
    pooled_at_k = True  # tau is the k-quantile of all calibration values (the pooled rule's definition)
    default_tokens = 4096
    # rule: how tau is estimated (mean-quantile: the paper; pooled); batch_size: windows per forward.
    defaults = {"rule": "mean-quantile", "batch_size": 4}
    choices = {"rule": CUT_RULES}

    def refine_rule(self, opts: dict) -> str:
        return opts["rule"]

    def meta(self, opts: dict) -> dict:
        return {"rule": opts["rule"], "d_rank": None}

    def fit(self, ctx: FitContext) -> dict[str, torch.Tensor]:
        mlps, m = ctx.mlps, ctx.method
        n_tokens = sum(w.numel() for w in ctx.windows)
        est = CutEstimator([[kept_rows(mlp.d_inter, k) for k in ctx.ks] for mlp in mlps], ctx.opts["rule"], n_tokens,
                           skips=[list(ctx.ks)] * len(mlps))
        stream_mlp_inputs(ctx.model, mlps, ctx.windows, lambda i, x: est.add(i, indicator_of(m, mlps[i], x)),
                          batch_size=ctx.opts["batch_size"], progress=ctx.progress, desc=f"calibrating {m.name}")
        thresholds = torch.zeros(len(ctx.ks), len(mlps))
        for i in range(len(mlps)):
            thresholds[:, i] = torch.stack(est.cuts(i))
        return {"thresholds": thresholds}

    def check(self, artifacts: Artifacts) -> None:
        t = artifacts.tensors.get("thresholds")
        want = (len(artifacts.sparsities), artifacts.meta["model"]["n_layers"])
        if t is None or tuple(t.shape) != want:
            raise ArtifactError(f"threshold artifact lacks 'thresholds' of shape {want}; rebuild it")

    def selectors(self, artifacts, mlps, method, k):
        taus = artifacts.thresholds(k)
        return [ThresholdSelector(method, taus[i]) for i in range(len(mlps))]

    def set_cuts(self, artifacts, k, cuts):
        artifacts.tensors["thresholds"][artifacts.sparsity_index(k)] = torch.stack([c.reshape(()).float() for c in cuts])

    def weight_bytes(self, d_model, d_inter, kept, elem_bytes, meta):
        # the indicator's matrix in full (W_up or W_gate), then the other two at the kept rows
        return elem_bytes * d_model * d_inter * (1 + 2 * kept)


register_kind(ThresholdKind())
