"""Masked down projection: y = s W_down^T over kept rows only.

    y[b, :] = sum_{i : keep[b, i]} s[b, i] * w_down_t[i, :]

``w_down_t`` is W_down transposed once ([d_inter, d_model], contiguous) so that each kept row is a
contiguous run; ``keep`` is a bool mask [n_tok, d_inter] or None (then rows with s != 0 are kept, which
is what the fused gate/up kernels leave). fp32 accumulation, y in s's dtype. The kernel reads the
union of the batch's kept rows once and applies each token's own mask (see ``_down.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import available


def sparse_down_proj_ref(s: torch.Tensor, keep: Optional[torch.Tensor], w_down_t: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch at s's precision (any leading dims)."""
    if keep is not None:
        s = torch.where(keep, s, torch.zeros((), dtype=s.dtype, device=s.device))
    return s @ w_down_t


@torch.library.custom_op("countdown::sparse_down_proj", mutates_args=())
def _sparse_down_proj_op(s: torch.Tensor, keep: Optional[torch.Tensor], w_down_t: torch.Tensor,
                         per_token: bool) -> torch.Tensor:
    from ._down import sparse_down

    return sparse_down(s, keep, w_down_t, per_token=per_token)


@_sparse_down_proj_op.register_fake
def _(s, keep, w_down_t, per_token):
    return s.new_empty((s.shape[0], w_down_t.shape[1]))


def sparse_down_proj(s: torch.Tensor, keep: Optional[torch.Tensor], w_down_t: torch.Tensor,
                     per_token: bool = False) -> torch.Tensor:
    """y [..., d_model] = masked s [..., d_inter] @ w_down_t; Triton where ``available(s)``."""
    d_inter, d_model = w_down_t.shape
    if s.shape[-1] != d_inter:
        raise ValueError(f"s has {s.shape[-1]} rows, w_down_t has {d_inter}")
    if s.dtype != w_down_t.dtype:
        raise ValueError(f"s dtype {s.dtype} differs from w_down_t dtype {w_down_t.dtype}")
    if keep is not None and keep.shape != s.shape:
        raise ValueError(f"keep shape {tuple(keep.shape)} differs from s shape {tuple(s.shape)}")
    if not available(s):
        return sparse_down_proj_ref(s, keep, w_down_t)
    lead = s.shape[:-1]
    k2 = None if keep is None else keep.reshape(-1, d_inter).to(torch.bool)
    y = torch.ops.countdown.sparse_down_proj(s.reshape(-1, d_inter), k2, w_down_t, per_token)
    return y.reshape(*lead, d_model)
