"""The ``hybrid`` kind (dual only): a dense ``u`` and a closed-form low-rank estimate of the gate.

Compute ``u`` densely (as M-CountDown does: W_up is read in full), predict only the gate
pre-activation with a rank-``d_rank`` map ``g_hat = x A B + b`` and keep rows by the score
``|u| * |act(g_hat)|`` against a per-layer cut. ``A, B, b`` come in closed form: the rank-``d_rank``
map closest to ``x W_gate^T + b_gate`` in mean squared error over the calibration tokens
(:func:`fit_gate_lowrank`), so no gradient training is needed.

Saved tensors: ``shared/layer<i>/{A [d_model, r], B [r, d_inter], bias [d_inter]}`` (one gate
estimate serves every k) and ``k=<k>/layer<i>/cut``. Kernel: u by cuBLAS before the op, then the
hybrid kernel keeps rows on ``|u| |act(x A B + b)| > cut`` and reads only the kept rows of W_gate
and W_down (W_up's rows are not read a second time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..artifacts.store import ArtifactError, sparsity_key
from ..model.gated_mlp import GatedMLP
from ..sparse_methods.registry import kept_rows
from .stream import like
from .base import RowSelector, SelectorKind, register_kind, select
from .capture import fit_by_capture
from .cuts import CUT_RULES, calibrated_cuts, check_cut_rule


def fit_gate_lowrank(mlp: GatedMLP, X: torch.Tensor, d_rank: int) -> dict[str, torch.Tensor]:
    """The rank-``d_rank`` affine map ``x A B + b`` closest to ``g = x W_gate^T + b_gate`` in mean
    squared error over the rows of ``X [N, d_model]``.

    With ``mu`` the mean of ``x`` and ``C = L L^T`` the covariance of ``x``, the error is
    ``||L^T (W^T - A B)||_F^2``; the best rank-r ``A B`` keeps the top-r right singular vectors
    ``V_r`` of ``L^T W^T``: ``A = W^T V_r``, ``B = V_r^T``, and the bias restores the mean:
    ``b = mu W^T + b_gate - mu A B``. Returns float32 ``{"A", "B", "bias"}``.
    """
    W = mlp.w_gate.detach().to(device=X.device, dtype=torch.float64)  # [d_inter, d_model]
    Xd = X.double()
    mu = Xd.mean(dim=0)
    Xc = Xd - mu
    cov = Xc.T @ Xc / max(X.shape[0] - 1, 1)
    eps = 1e-6 * cov.diagonal().mean().clamp_min(1e-12)
    L = torch.linalg.cholesky(cov + eps * torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device))
    _, _, vh = torch.linalg.svd(L.T @ W.T, full_matrices=False)
    r = min(d_rank, vh.shape[0])
    V = vh[:r].T  # [d_inter, r]
    A = W.T @ V
    B = V.T
    b_gate = (mlp.b_gate.detach().to(W) if mlp.b_gate is not None
              else torch.zeros(W.shape[0], dtype=W.dtype, device=W.device))
    bias = mu @ W.T + b_gate - (mu @ A) @ B
    return {"A": A.float(), "B": B.float(), "bias": bias.float()}


class LowRankFactors(RowSelector):
    """A selector holding low-rank factors ``A [d_model, r]`` (a view of a contiguous ``A^T``),
    ``Bt = B^T [d_inter, r]`` (contiguous: the layout the kernels read), a float32 ``bias [d_inter]`` and a 0-dim float32 ``cut``;
    :meth:`to_model_dtype` holds ``A`` and ``Bt`` in a half-precision model's dtype (two bytes a
    weight at decode time), the bias, cut and comparisons stay in float32."""

    def __init__(self, tensors: dict[str, torch.Tensor], selection: str, n_keep: int):
        super().__init__()
        self.selection = selection
        self.n_keep = int(n_keep)
        # A is held as the transposed view of a contiguous A^T [r, d_model]: the one-token decode GEMV
        # (kernels/decode_step/linear.py, via dual_gated_mlp) reads A^T's rows; x @ A is the same product
        self.register_buffer("A", tensors["A"].t().contiguous().t())
        self.register_buffer("Bt", tensors["B"].t().contiguous())
        self.register_buffer("bias", tensors["bias"].float().clone())
        self.register_buffer("cut", tensors["cut"].float().reshape(()).clone())

    def to_model_dtype(self, dtype: torch.dtype) -> None:
        if dtype in (torch.bfloat16, torch.float16):
            self.A = self.A.to(dtype)
            self.Bt = self.Bt.to(dtype)


class HybridDualSelector(LowRankFactors):
    """Dual SP-Prac with a dense ``u``: score ``|u| * |act(x A B + b)|`` (the gate side predicted)."""

    needs_up = True
    needs_gate = False

    def __init__(self, tensors: dict[str, torch.Tensor], act, selection: str, n_keep: int):
        super().__init__(tensors, selection, n_keep)
        self.act = act

    def gate_estimate(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.to(self.A.dtype) @ self.A) @ self.Bt.t()).float() + self.bias

    def hybrid_score(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return u.float().abs() * self.act(self.gate_estimate(x)).abs()

    def score(self, x: torch.Tensor, mlp: GatedMLP) -> torch.Tensor:
        return self.hybrid_score(x, F.linear(x, *like(x, mlp.w_up, mlp.b_up)))

    def forward(self, x, u, h):
        return select(self.hybrid_score(x, u), self.selection, self.cut, self.n_keep)

    def kernel_forward(self, x2, mlp, w_down_t, count=None):
        fused = getattr(kernels, "hybrid_gated_mlp", None)
        if fused is None or self.selection != "cut":
            return super().kernel_forward(x2, mlp, w_down_t, count)
        u = F.linear(x2, mlp.w_up)
        latent = x2.to(self.A.dtype) @ self.A
        return fused(x2, u, latent, self.Bt, self.bias, self.cut, mlp.w_gate, w_down_t, mlp.act_name, count=count)

    def extra_repr(self) -> str:
        return f"selection={self.selection}, n_keep={self.n_keep}"


def fit_hybrid_layer(method, mlp: GatedMLP, layer: int, X: torch.Tensor, ks: list[float], opts: dict,
                     progress: bool = False) -> dict[str, torch.Tensor]:
    """The shared gate estimate and one cut per k of one layer."""
    n_keeps = [kept_rows(mlp.d_inter, k) for k in ks]
    with torch.no_grad():
        fitted = fit_gate_lowrank(mlp, X, opts["d_rank"])
        U = F.linear(X, *like(X, mlp.w_up, mlp.b_up)).abs()

        def hybrid_score(start: int, stop: int) -> torch.Tensor:
            g_hat = (X[start:stop] @ fitted["A"]) @ fitted["B"] + fitted["bias"]
            return U[start:stop] * mlp.act(g_hat).abs()

        cuts = calibrated_cuts(hybrid_score, X.shape[0], n_keeps, rule=opts["cut_rule"])
    out = {f"shared/layer{layer}/{name}": t.cpu().contiguous() for name, t in fitted.items()}
    for k, cut in zip(ks, cuts):
        out[f"{sparsity_key(k)}/layer{layer}/cut"] = cut
    return out


def full_rank(mlps: list[GatedMLP]) -> int:
    return min(min(mlp.d_model, mlp.d_inter) for mlp in mlps)


def resolve_rank(opts: dict, given: dict, mlps: list[GatedMLP]) -> dict:
    """A default ``d_rank`` above the model's full rank becomes full rank; a given one is an error."""
    top = full_rank(mlps)
    if opts["d_rank"] is None or int(opts["d_rank"]) < 1:
        raise ValueError(f"need d_rank >= 1, got {opts['d_rank']}")
    if int(opts["d_rank"]) > top:
        if "d_rank" in given:
            raise ValueError(f"d_rank={opts['d_rank']} exceeds the full rank {top} of this model's Gated-MLPs "
                             f"(min(d_model, d_inter)); choose d_rank <= {top}")
        opts["d_rank"] = top
    opts["d_rank"] = int(opts["d_rank"])
    return opts


class HybridKind(SelectorKind):
    name = "hybrid"
    methods = ("dual",)
    selections = ("cut", "topk")
    default_selection = "cut"
    # d_rank 128: the most rank that stays within the paper's 7 %-of-parameters budget on SmolLM2
    # (128 * (576 + 1536) per layer = 6.1 %); the fit is closed-form, so rank costs no training.
    defaults = {"d_rank": 128, "cut_rule": "mean-quantile", "max_activation_gb": 2.0}
    spec_number = "d_rank"  # dual[hybrid64]
    choices = {"cut_rule": CUT_RULES}

    def resolve_options(self, method, mlps, given):
        opts = super().resolve_options(method, mlps, given)
        check_cut_rule(opts["cut_rule"])
        return resolve_rank(opts, given, mlps)

    def meta(self, opts):
        return {"d_rank": opts["d_rank"], "training": {"cut_rule": opts["cut_rule"], "init": "closed-form",
                                                       "epochs": 0}}

    def fit(self, ctx):
        return fit_by_capture(ctx, fit_hybrid_layer, desc="fitting dual hybrid selectors")

    def check(self, artifacts):
        for i in range(artifacts.meta["model"]["n_layers"]):
            for name in ("A", "B", "bias"):
                if f"shared/layer{i}/{name}" not in artifacts.tensors:
                    raise ArtifactError(f"hybrid artifact lacks shared/layer{i}/{name}; rebuild it")

    def selectors(self, artifacts, mlps, method, k):
        n_keep = lambda mlp: kept_rows(mlp.d_inter, k)  # noqa: E731
        return [HybridDualSelector(artifacts.layer_tensors(k, i), mlp.act, artifacts.selection, n_keep(mlp))
                for i, mlp in enumerate(mlps)]

    def weight_bytes(self, d_model, d_inter, kept, elem_bytes, meta):
        rank = int(meta.get("d_rank", 128))
        # W_up in full, the gate estimate, then the kept rows of W_gate and W_down
        return elem_bytes * (d_model * d_inter * (1 + 2 * kept) + rank * (d_model + d_inter))


register_kind(HybridKind())
