"""The dense decode step's PyTorch references (no Triton): what decode_step/linear.py and rmsnorm.py compute."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in PyTorch (the module's own arithmetic)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def decode_linear_ref(x, weight, bias=None, residual=None, norm_weight=None, eps: float = 1e-6) -> torch.Tensor:
    """The float64 reference of decode_step/linear.py's GEMV, rounded to x's dtype once."""
    xd = x.double()
    if norm_weight is not None:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = xd @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y.to(x.dtype)
