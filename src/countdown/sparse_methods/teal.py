"""TEAL (Liu et al. 2024, "Training-Free Activation Sparsity in Large Language Models") on the Gated-MLP.

TEAL skips the *inputs* of each projection by magnitude instead of rows of d_inter:

    x_t = x * [|x| > tau_x]                       a zero entry x[j] skips column j of W_gate and W_up
    s   = (x_t W_up^T) * act(x_t W_gate^T)
    y   = (s * [|s| > tau_s]) W_down^T            a zero entry s[i] skips column i of W_down

At sparsity k, SP-Ideal keeps per token exactly the ``kept_rows(d_model, k)`` largest |x| and the
``kept_rows(d_inter, k)`` largest |s| (:class:`TealTopK`); SP-Prac compares with per-layer thresholds
calibrated on the calibration text, with TEAL's greedy per-layer allocation of k between x and s
(the ``teal`` kind, :mod:`countdown.selectors.teal`).

Sparsity-Real of teal is the fraction of the Gated-MLP's weights a token does not need: a skipped
x entry saves d_inter weights of W_gate and d_inter of W_up, a skipped s entry d_model weights of
W_down, out of 3 d_model d_inter, so per token

    Sparsity-Real = 1 - (2 n_x / d_model + n_s / d_inter) / 3 = (2 k_x + k_s) / 3

with n_x, n_s the kept entries and k_x, k_s the skipped fractions of x and s. It is the same quantity
as the row methods' Sparsity-Real (there, the fraction of rows skipped is the fraction of the three
matrices not read), so both give the bytes a batch-1 decode step reads: (1 - Sparsity-Real) x 3 matrices.

Weight layout: TEAL's kernels read W_gate^T and W_up^T ([d_model, d_inter], a kept x entry is one
contiguous row) and W_down^T. :meth:`InputSparseGatedMLP.store_for_kernels` lays the three weights
out that way in place (no copy beside them) where the kernels may run, and back on unpatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..model import tensor_parallel as _tp
from ..kernels.teal import count_teal, kept_weight_fraction  # the kernels count it too (kernels/teal/kernels.py)
from ..model.gated_mlp import GatedMLP
from ..patch.patched_mlp import PatchedMLP


def kept_fractions(keep_x: torch.Tensor, keep_s: torch.Tensor) -> tuple[float, float]:
    """(mean kept weight share per token, kept weight share of the batch's union): what one decode
    step of a batch reads of the Gated-MLP, as :func:`kept_weight_fraction` counts it."""
    per_token = kept_weight_fraction(keep_x, keep_s).mean().item()
    union = kept_weight_fraction(keep_x.any(dim=0, keepdim=True), keep_s.any(dim=0, keepdim=True)).item()
    return per_token, union


def refuse_teal_sharded(mlps: list[GatedMLP]) -> None:
    if any(m.tp is not None for m in mlps):
        raise _tp.ShardingError("teal does not run on a tensor-parallel model yet (its s threshold and the "
                                "column skips of W_gate / W_up are per layer): load the model on one process")


class InputSelector(nn.Module):
    """One layer's rule for teal: which entries of x (:meth:`keep_x`) and of s (:meth:`keep_s`) to keep.

    ``forward(keep_x, keep_s)`` returns the pair unchanged: the layer calls it once per forward with
    the masks it used, so forward hooks (the decode benchmark's kept fractions) see them.
    """

    has_kernel = False  # the fused Triton path (thresholds only)

    def keep_x(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def keep_s(self, s: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, keep_x: torch.Tensor, keep_s: torch.Tensor):
        return keep_x, keep_s

    def score(self, x: torch.Tensor, mlp: GatedMLP) -> torch.Tensor:
        raise NotImplementedError("teal has two thresholds per layer (x and s), not one score with a cut")

    def to_model_dtype(self, dtype: torch.dtype) -> None:
        """Thresholds stay float32 (compared in float32, as the kernel does)."""

    def kernel_forward(self, x2, mlp: GatedMLP, w_gate_t, w_up_t, w_down_t, count=None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no kernel path")


class TealTopK(InputSelector):
    """SP-Ideal: per token, exactly the ``n_keep_x`` largest |x| and ``n_keep_s`` largest |s|."""

    def __init__(self, n_keep_x: int, n_keep_s: int):
        super().__init__()
        self.n_keep_x, self.n_keep_s = int(n_keep_x), int(n_keep_s)

    @staticmethod
    def _top(v: torch.Tensor, n: int) -> torch.Tensor:
        score = v.abs()
        idx = score.topk(n, dim=-1, sorted=False).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)

    def keep_x(self, x):
        return self._top(x, self.n_keep_x)

    def keep_s(self, s):
        return self._top(s, self.n_keep_s)

    def extra_repr(self) -> str:
        return f"n_keep_x={self.n_keep_x}, n_keep_s={self.n_keep_s}"


def _zero_where_not(keep: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, v, torch.zeros((), dtype=v.dtype, device=v.device))


class InputSparseGatedMLP(PatchedMLP):
    """Skips entries of x (columns of W_gate and W_up) and of s (columns of W_down) per token."""

    def _selector_has_kernel(self) -> bool:
        return bool(getattr(self.selector, "has_kernel", False))

    def _scoped(self, keep: torch.Tensor, token_sparse: torch.Tensor | None) -> torch.Tensor:
        return keep if token_sparse is None else keep | ~token_sparse[:, None]

    def _count(self, keep_x, keep_s, token_sparse) -> None:
        self.selector(keep_x, keep_s)  # for forward hooks
        if token_sparse is not None:
            keep_x, keep_s = keep_x[token_sparse], keep_s[token_sparse]
        count_teal(self.counters(), keep_x, keep_s)

    def _masked(self, x2, token_sparse):
        mlp, sel = self.mlp, self.selector
        keep_x = sel.keep_x(x2)
        u, g = mlp.parts(_zero_where_not(self._scoped(keep_x, token_sparse), x2))
        s = u * mlp.act(g)
        keep_s = sel.keep_s(s)
        self._count(keep_x, keep_s, token_sparse)
        return F.linear(_zero_where_not(self._scoped(keep_s, token_sparse), s), mlp.w_down, mlp.b_down)

    def _gather(self, x2, token_sparse):
        """Only the columns of W_gate / W_up of the batch's kept x entries and the columns of W_down of
        its kept s entries are read; each token still uses its own masks."""
        mlp, sel = self.mlp, self.selector
        keep_x = sel.keep_x(x2)
        kx = self._scoped(keep_x, token_sparse)
        cols = kx.any(dim=0).nonzero().squeeze(1)
        x_cols = _zero_where_not(kx, x2).index_select(1, cols)
        u = F.linear(x_cols, mlp.w_up.index_select(1, cols), mlp.b_up)
        g = F.linear(x_cols, mlp.w_gate.index_select(1, cols), mlp.b_gate)
        s = u * mlp.act(g)
        keep_s = sel.keep_s(s)
        self._count(keep_x, keep_s, token_sparse)
        ks = self._scoped(keep_s, token_sparse)
        rows = ks.any(dim=0).nonzero().squeeze(1)
        s_rows = _zero_where_not(ks, s).index_select(1, rows)
        return F.linear(s_rows, mlp.w_down.index_select(1, rows), mlp.b_down)

    def _kernel(self, x2):
        mlp = self.mlp
        # views: after store_for_kernels each has unit inner stride (W_down^T contiguous); the kernels count
        return self.selector.kernel_forward(x2, mlp, mlp.w_gate.t(), mlp.w_up.t(), mlp.w_down.t(),
                                            count=self.counters())

    def _kernel_layout(self, path: str) -> list[torch.Tensor]:
        """W_gate, W_up (or a fused gate_up) and W_down, stored transposed in place where the kernels may
        run (CUDA, or Triton's interpreter on the CPU), so that their ``.t()`` views are row-major."""
        mlp = self.mlp
        if path not in ("auto", "kernel") or not kernels.available(mlp.w_down):
            return []
        names = (mlp.fused,) if mlp.fused else (mlp.gate, mlp.up)
        return [getattr(mlp.module, name).weight for name in names] + [mlp.w_down]
