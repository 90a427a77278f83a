"""Mixed-precision rows: a Gated-MLP that computes every row, the rows its selector keeps at full precision and the
rest from the high planes (4 bits), and the plain-PyTorch reference of that computation.

With ``u = x W_up^T``, ``g = x W_gate^T``, ``s = u act(g)`` and ``y = s W_down^T``, and for each weight W its high
plane W~h (``int4/nested.py``: a 4-bit weight) and its full-precision weight W (the 8-bit weight W8 of the nested
format, or, for the reference variant, the float weight as loaded), per token and a keep mask over d_inter:

    kept row i:  u_i = x W_up[i]^T,     g_i = x W_gate[i]^T          (W8: u~_i + x Delta_up[i]^T, Delta the low plane)
    other row i: u_i = x W~h_up[i]^T,   g_i = x W~h_gate[i]^T
    y = sum over other rows of s_i W~h_down[:, i]  +  sum over kept rows of s_i W_down[:, i]

Nothing is skipped: Sparsity-Real here is the share of rows left at 4 bits. The selector ranks rows by
``|u~ act(g~)|`` from the high planes (``rank="shadow"``), by the exact ``|u act(g)|`` (``rank="exact"``, a quality
study) or by the expected size of each row's refinement from the high planes (``rank="error"``, :func:`row_score`);
:mod:`countdown.selectors.mixed` builds it and its cuts. The weights come from a planes object:
:class:`NestedPlanes` (the MLP's Linears are :class:`~countdown.int4.nested_linear.NestedLinear`: memory 8 bits a
weight, no float copy) or :class:`FloatPlanes` (the float Linears as loaded plus their high planes).

Paths (``countdown.sparsify``'s): ``masked`` computes both precisions for every row and picks per row (prompt rows of
a dense prefix are all kept: the 8-bit model's own numbers, up to float32 summation order); ``gather`` computes
the high planes in full and the full-precision weights of the batch's kept rows only (per token, a row kept by
another token stays at 4 bits, so both paths compute the same function). One-token decode steps on CUDA take the
kernels of ``kernels/int4/nested_rows.py`` (``decode/nested_step.py``), which compute as ``mixed_mlp_ref`` does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..int4.nested import NestedWeight, mixed_mlp_ref, quantize_nested  # noqa: F401  (mixed_mlp_ref: its reference, here too)
from ..int4.nested_linear import NestedLinear
from ..model.gated_mlp import GatedMLP
from .sparsify import SparseGatedMLP

ROLES = ("gate", "up", "down")
ACT_GRADS = ("silu", "gelu_tanh", "gelu", "relu")  # the activations whose derivative act_grad knows


class NestedPlanes(nn.Module):
    """The weights of a Gated-MLP whose gate / up / down are :class:`NestedLinear`: high planes and 8-bit weights,
    de-quantized (float32) on each call from the modules' planes."""

    def __init__(self, mlp: GatedMLP):
        super().__init__()
        object.__setattr__(self, "mlp", mlp)  # a view, not a submodule

    def nested(self, role: str) -> NestedWeight:
        module = getattr(self.mlp.module, getattr(self.mlp, role))
        if not isinstance(module, NestedLinear):
            raise ValueError(f"{self.mlp.name}.{getattr(self.mlp, role)} is not a nested 8-bit Linear")
        return module.nested

    def high(self, role: str) -> torch.Tensor:
        return self.nested(role).dequantize("high")

    def pair(self, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(high plane, 8-bit weight) [out, in], float32 (the 8-bit weight as NestedLinear computes it)."""
        nw = self.nested(role)
        high = nw.dequantize("high")
        return high, high + nw.dequantize_low_rows(None)

    def full(self, role: str) -> torch.Tensor:
        return self.nested(role).dequantize("both")

    def full_rows(self, role: str, rows: torch.Tensor, high_down: torch.Tensor | None = None) -> torch.Tensor:
        """The 8-bit weight's ``rows`` of W_gate / W_up ``[len, d_model]``, or of W_down its columns ``rows``
        ``[d_model, len]`` from ``high_down`` (its high plane, float32) and the transposed low plane's rows."""
        nw = self.nested(role)
        if role != "down":
            return nw.rows(rows).dequantize("both")
        high = nw.dequantize("high") if high_down is None else high_down
        return high.index_select(1, rows) + nw.dequantize_low_rows(rows).t()


class FloatPlanes(nn.Module):
    """The weights of a Gated-MLP with float Linears (as loaded) and their high planes, held here (the reference
    variant: the kept rows in the model's precision)."""

    def __init__(self, mlp: GatedMLP, group: int, scale_dtype: torch.dtype):
        super().__init__()
        object.__setattr__(self, "mlp", mlp)
        with torch.no_grad():
            for role in ROLES:
                high = quantize_nested(getattr(mlp, "w_" + role).detach(), group, scale_dtype).high
                for name in ("qweight", "scale", "offset"):
                    self.register_buffer(f"{role}_{name}", getattr(high, name))

    def high(self, role: str) -> torch.Tensor:
        from ..int4.format import dequantize

        return dequantize(*(getattr(self, f"{role}_{name}") for name in ("qweight", "scale", "offset")))

    def full(self, role: str) -> torch.Tensor:
        return getattr(self.mlp, "w_" + role).detach().float()

    def pair(self, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.high(role), self.full(role)

    def full_rows(self, role: str, rows: torch.Tensor, high_down: torch.Tensor | None = None) -> torch.Tensor:
        w = getattr(self.mlp, "w_" + role).detach()
        return (w.index_select(1, rows) if role == "down" else w.index_select(0, rows)).float()


def act_grad(name: str, g: torch.Tensor) -> torch.Tensor:
    """The derivative of the activation ``name`` (``mlp.GatedMLP.act_name``) at ``g``."""
    if name == "silu":
        sig = torch.sigmoid(g)
        return sig * (1 + g * (1 - sig))
    if name == "gelu_tanh":
        c = math.sqrt(2 / math.pi)
        t = torch.tanh(c * (g + 0.044715 * g ** 3))
        return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g)
    if name == "gelu":
        return 0.5 * (1 + torch.erf(g / math.sqrt(2))) + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    if name == "relu":
        return (g > 0).to(g.dtype)
    raise ValueError(f"rank='error' needs the activation's derivative; this MLP's activation is {name!r} (known: "
                     "silu, gelu_tanh, gelu, relu): use rank='shadow'")


def error_constants(planes) -> torch.Tensor:
    """Per row of d_inter, float32 ``[4, d_inter]``: the RMS over d_model of W_up's and of W_gate's refinement
    (full precision minus the high plane: the low plane), and the norms of W_down's high plane's and its refinement's
    columns; what ``rank="error"`` weighs its terms with."""
    rows = []
    for role in ("up", "gate"):
        high, full = planes.pair(role)
        rows.append((full - high).pow(2).mean(dim=1).sqrt())
    high, full = planes.pair("down")
    rows += [high.pow(2).sum(dim=0).sqrt(), (full - high).pow(2).sum(dim=0).sqrt()]
    return torch.stack(rows).float()


def row_score(rank: str, act, act_name: str, x: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
              consts: torch.Tensor | None = None) -> torch.Tensor:
    """The ranking float32 ``[tokens, d_inter]`` from the projections ``u``, ``g`` of ``x`` (the high planes', or the
    full-precision ones for ``rank="exact"``): ``|u act(g)|``, or for ``rank="error"`` the expected size of the change
    that refining the row makes to the output,

        sqrt(|x|^2 (sig_up^2 act(g)^2 + sig_gate^2 (u act'(g))^2) |W~h_down[:, i]|^2 + (u act(g))^2 |Delta_down[:, i]|^2)

    (the low planes' corrections of u and g taken as random against x, ``consts`` from :func:`error_constants`)."""
    u, g = u.float(), g.float()
    h = act(g)
    if rank != "error":
        return (u * h).abs()
    sig_up, sig_gate, high_down, low_down = consts
    x2 = x.float().pow(2).sum(dim=-1, keepdim=True)
    ds2 = x2 * ((sig_up * h) ** 2 + (sig_gate * u * act_grad(act_name, g)) ** 2)
    return (ds2 * high_down ** 2 + (u * h) ** 2 * low_down ** 2).sqrt()


def ranking_score(planes, act, act_name: str, x: torch.Tensor, rank: str, consts: torch.Tensor | None = None,
                  b_gate=None, b_up=None) -> torch.Tensor:
    """:func:`row_score` of ``x`` from the high planes (``"shadow"``, ``"error"``) or the full-precision weights
    (``"exact"``), in float32 (for calibration)."""
    weights = planes.full if rank == "exact" else planes.high
    xf = x.float()
    u = F.linear(xf, weights("up"), None if b_up is None else b_up.float())
    g = F.linear(xf, weights("gate"), None if b_gate is None else b_gate.float())
    return row_score(rank, act, act_name, xf, u, g, consts)


def _bias_rows(bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if bias is None else bias.index_select(0, rows)


class MixedGatedMLP(SparseGatedMLP):
    """The patch of one Gated-MLP under a mixed-rows selector (the module docstring): nothing skipped."""

    def kernels_serve(self) -> bool:
        """Whether the one-token mixed kernels compute this patch: ranked on the high planes (rank=shadow, or
        rank=error with an activation the kernels know), kept rows over the calibrated cut, a kernel path, not
        tensor-parallel."""
        sel = self.selector
        ranked = sel.rank == "shadow" or (sel.rank == "error" and self.mlp.act_name in ("silu", "gelu_tanh"))
        return (isinstance(sel.planes, NestedPlanes) and ranked and sel.selection == "cut"
                and self.state.path in ("auto", "kernel") and self.mlp.tp is None)

    def _selector_has_kernel(self) -> bool:
        # the one-token kernels (kernels/int4/nested_rows.py) on an MLP the 4-bit decode step has taken
        # (countdown.generate's step on CUDA: decode/nested_step.py); a folded layer calls them without this
        from ..decode.nested_step import serves

        return serves(self)

    def _kernel_ready(self, x2: torch.Tensor, path: str) -> bool:
        return x2.shape[0] == 1 and super()._kernel_ready(x2, path)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        from ..decode.nested_step import patch_kernel

        return patch_kernel(self, x2)

    def _kernel_layout(self, path: str) -> list[torch.Tensor]:
        return []

    def _keep(self, score: torch.Tensor, token_sparse: torch.Tensor | None) -> torch.Tensor:
        """The rows refined per token from the selector's ranking (a dense prompt's tokens: every row), counted."""
        keep = self.selector.pick(score)
        if token_sparse is not None:
            self._count(keep[token_sparse])
            return keep | ~token_sparse[:, None]
        self._count(keep)
        return keep

    def _masked(self, x2: torch.Tensor, token_sparse: torch.Tensor | None) -> torch.Tensor:
        mlp, sel = self.mlp, self.selector
        dt = x2.dtype
        (gh, gf), (uh, uf), (dh, df) = (tuple(w.to(dt) for w in sel.planes.pair(role)) for role in ROLES)
        u_h, g_h = F.linear(x2, uh, mlp.b_up), F.linear(x2, gh, mlp.b_gate)
        u_f, g_f = F.linear(x2, uf, mlp.b_up), F.linear(x2, gf, mlp.b_gate)
        keep = self._keep(sel.rank_score(x2, *((u_f, g_f) if sel.rank == "exact" else (u_h, g_h))), token_sparse)
        s = torch.where(keep, u_f * mlp.act(g_f), u_h * mlp.act(g_h))
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        return F.linear(torch.where(keep, zero, s), dh, mlp.b_down) + F.linear(torch.where(keep, s, zero), df)

    def _gather(self, x2: torch.Tensor, token_sparse: torch.Tensor | None) -> torch.Tensor:
        mlp, sel = self.mlp, self.selector
        planes, dt = sel.planes, x2.dtype
        u_h = F.linear(x2, planes.high("up").to(dt), mlp.b_up)
        g_h = F.linear(x2, planes.high("gate").to(dt), mlp.b_gate)
        h_h = mlp.act(g_h)
        if sel.rank != "exact":
            keep = self._keep(sel.rank_score(x2, u_h, g_h), token_sparse)
        else:  # the exact ranking reads every row at full precision: a quality study
            u_f = F.linear(x2, planes.full("up").to(dt), mlp.b_up)
            keep = self._keep(sel.rank_score(x2, u_f, F.linear(x2, planes.full("gate").to(dt), mlp.b_gate)),
                              token_sparse)
        rows = keep.any(dim=0).nonzero().squeeze(1)
        u_r = F.linear(x2, planes.full_rows("up", rows).to(dt), _bias_rows(mlp.b_up, rows))
        h_r = mlp.act(F.linear(x2, planes.full_rows("gate", rows).to(dt), _bias_rows(mlp.b_gate, rows)))
        s = u_h * h_h
        kept = keep.index_select(1, rows)
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        high_down = planes.high("down")
        y = F.linear(torch.where(keep, zero, s), high_down.to(dt), mlp.b_down)
        return y + F.linear(torch.where(kept, u_r * h_r, zero), planes.full_rows("down", rows, high_down).to(dt))


