"""Gated-MLP with a given per-token keep mask (D-CountDown with its mask precomputed).

    s[b, i] = (x W_up^T)[b, i] * act((x W_gate^T)[b, i])   for keep[b, i], else 0
    y[b]    = sum_i s[b, i] * w_down_t[i, :]

Only kept rows of all three matrices are read: one fused Triton kernel computes the gate and up
GEMVs for the union of the batch's kept rows with the activation and product fused (``_glu.py``),
then the masked down projection (``_down.py``). :func:`gated_chain` is that chain for every method that
takes it (mono, cats and dual beyond one token too, where the indicator selects the rows).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import act_torch, available, check_mlp_args, count_keep, op_count, op_counters


def gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation: str) -> torch.Tensor:
    """Plain PyTorch at the inputs' precision: the dense computation with unkept s zeroed."""
    g = x @ w_gate.t()
    u = x @ w_up.t()
    s = u * act_torch(g, activation)
    s = torch.where(keep, s, torch.zeros((), dtype=s.dtype, device=s.device))
    return s @ w_down_t


masked_gated_mlp_ref = gated_mlp_masked_ref


def gated_chain(x, w_gate, w_up, w_down_t, *, ind, thr_t=None, thr_f=0.0,
                mode: str, activation: str, gate: bool, up: bool, per_token: bool = False, count=None):
    """The fused gate / up kernel followed by the masked down projection: GLU kernel, down kernel (fp32
    atomics), cast to x's dtype. The GLU kernel clears the down projection's fp32 accumulator on its way, so
    the chain needs no memset, and adds the kept rows to ``count`` = (kept, rows) if given (_count.py)."""
    from ._down import DownPlan, sparse_down  # Triton: only where the kernels run
    from ._glu import sparse_glu

    n_tok, d_model = x.shape
    plan = DownPlan(n_tok, w_down_t.shape[0], d_model, per_token)
    work = plan.workspace(x.device, zeroed=False) if plan.atomic else None
    s = sparse_glu(x, w_gate, w_up, ind, thr_t, thr_f, mode, activation, gate=gate, up=up,
                   per_token=per_token, zero=work, count=count)
    return sparse_down(s, None, w_down_t, per_token=per_token, plan=plan, workspace=work)


@torch.library.custom_op("countdown::masked_gated_mlp", mutates_args=("kept", "rows"))
def _masked_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
               keep: torch.Tensor, activation: str, per_token: bool, kept: Optional[torch.Tensor] = None,
               rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    return gated_chain(x, w_gate, w_up, w_down_t, ind=keep, mode="mask", activation=activation,
                       gate=True, up=True, per_token=per_token, count=op_count(kept, rows))


@_masked_op.register_fake
def _(x, w_gate, w_up, w_down_t, keep, activation, per_token, kept=None, rows=None):
    return torch.empty_like(x)


def masked_gated_mlp(x, w_gate, w_up, w_down_t, keep, activation: str = "silu",
                     per_token: bool = False, count=None) -> torch.Tensor:
    """x [..., d_model], keep bool [..., d_inter] -> y [..., d_model] in x's dtype. The kept entries of
    ``keep`` are added to ``count`` = (kept, rows) if given (a patched layer's Sparsity-Real, _count.py)."""
    d_model, d_inter = check_mlp_args(x, w_gate, w_up, w_down_t)
    if keep.shape[-1] != d_inter or keep.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"keep must be [..., {d_inter}] matching x, got {tuple(keep.shape)}")
    keep = keep.to(torch.bool)
    if not available(x):
        count_keep(count, keep)
        return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation)
    kept, rows = op_counters(count, x.device)
    y = torch.ops.countdown.masked_gated_mlp(x.reshape(-1, d_model), w_gate, w_up, w_down_t,
                                             keep.reshape(-1, d_inter), activation, per_token, kept, rows)
    return y.reshape(x.shape)
