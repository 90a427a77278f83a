"""The ``teal`` kind: per-layer magnitude thresholds on the inputs of gate/up (x) and of down (s).

TEAL (FasterDecoding/TEAL) calibrates, per layer and projection, the threshold below which an input
entry is dropped from the empirical distribution of that input on calibration text: for a target
sparsity l the threshold is the l-quantile of |x| (its code reads ``icdf(0.5 + l/2)`` of a signed
histogram, the same number for a distribution symmetric about 0; we take the quantile of |x| itself).

**Allocation** (``allocation="greedy"``, the default; TEAL's block-wise greedy optimisation). A layer's
Sparsity-Real is ``(2 l_x + l_s) / 3`` (x feeds two matrices, s one: :mod:`countdown.sparse_methods.teal`). Starting
from nothing skipped, each step raises either l_x by ``1.5 step`` or l_s by ``3 step`` (each adds
``step`` to the layer's Sparsity-Real, as TEAL's steps are scaled by each projection's weight count),
whichever moves the layer's output least (mean over tokens of ||y_sparse - y_dense||, on
``greedy_tokens`` of the layer's captured calibration inputs), until the layer reaches k; one walk
serves every k (its state at each k). Unlike TEAL's, the s thresholds a step tries come from s computed
with x already sparse at the step's l_x, so l_s is the fraction of s really skipped. gate and up share
x's threshold (one mask feeds the fused kernel; TEAL's accuracy code may give them two, its
inference kernels one). ``allocation="uniform"``: l_x = l_s = k in every layer.

The cuts then come from all calibration tokens (pooled quantiles of |x| and, with x cut, of |s|) and,
with ``refine=True`` (the library default), are re-estimated on the model sparsified by them, so each
layer sees the inputs sparse upstream layers give it (TEAL calibrates on the dense model only).

Saved tensors: ``k=<k>/layer<i>/{cut_x, cut_s, level_x, level_s}`` (float32 scalars; the levels are
the allocation). Kernel: ``kernels.teal_gated_mlp`` on decode steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import kernels
from ..artifacts.store import ArtifactError, sparsity_key
from ..model.gated_mlp import GatedMLP
from ..patch.sparsify import sparsify, unsparsify, with_mode
from .stream import like, pooled_sample, stream_mlp_inputs
from ..sparse_methods.teal import InputSelector
from .base import SelectorKind, register_kind
from .capture import fit_by_capture
from .cuts import pooled_cut

ALLOCATIONS = ("greedy", "uniform")
MAX_LEVEL = 0.995  # the most of x or of s a layer may skip
GREEDY_SAMPLES = 1 << 16  # |s| values the greedy walk's quantiles are taken from (fixed positions)


class TealThresholdSelector(InputSelector):
    """Keep x entries with |x| > ``cut_x`` and s entries with |s| > ``cut_s`` (0-dim float32 buffers)."""

    has_kernel = True

    def __init__(self, cut_x, cut_s):
        super().__init__()
        self.register_buffer("cut_x", torch.as_tensor(cut_x, dtype=torch.float32).reshape(()).clone())
        self.register_buffer("cut_s", torch.as_tensor(cut_s, dtype=torch.float32).reshape(()).clone())

    def keep_x(self, x):
        return x.float().abs() > self.cut_x

    def keep_s(self, s):
        return s.float().abs() > self.cut_s

    def kernel_forward(self, x2, mlp, w_gate_t, w_up_t, w_down_t, count=None):
        return kernels.teal_gated_mlp(x2, w_gate_t, w_up_t, w_down_t, self.cut_x, self.cut_s, mlp.act_name,
                                      count=count)

    def extra_repr(self) -> str:
        return f"cut_x={float(self.cut_x):.5g}, cut_s={float(self.cut_s):.5g}"


class _Layer:
    """One layer's float32 computation on captured inputs (weights cast to x's dtype and device)."""

    def __init__(self, mlp: GatedMLP, like_x: torch.Tensor):
        self.act = mlp.act
        self.wg, self.bg = like(like_x, mlp.w_gate, mlp.b_gate)
        self.wu, self.bu = like(like_x, mlp.w_up, mlp.b_up)
        self.wd, self.bd = like(like_x, mlp.w_down, mlp.b_down)

    def s(self, x: torch.Tensor, cut_x) -> torch.Tensor:
        xt = torch.where(x.abs() > cut_x, x, torch.zeros((), dtype=x.dtype, device=x.device))
        return F.linear(xt, self.wu, self.bu) * self.act(F.linear(xt, self.wg, self.bg))

    def y(self, s: torch.Tensor, cut_s) -> torch.Tensor:
        st = torch.where(s.abs() > cut_s, s, torch.zeros((), dtype=s.dtype, device=s.device))
        return F.linear(st, self.wd, self.bd)


def _quantile(sorted_values: torch.Tensor, level: float) -> torch.Tensor:
    """The value a fraction ``1 - level`` of the (ascending) values exceeds, by linear interpolation
    (torch.quantile's rule); -inf at level 0 (keep everything)."""
    if level <= 0:
        return torch.tensor(-math.inf, device=sorted_values.device)
    pos = level * (sorted_values.numel() - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, sorted_values.numel() - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


def greedy_levels(layer: _Layer, X: torch.Tensor, ks: list[float], step: float, seed: int = 0) -> dict[float, tuple]:
    """TEAL's block-wise greedy allocation on one layer's inputs ``X [N, d_model]``: ``{k: (l_x, l_s)}``
    with ``(2 l_x + l_s) / 3 = k`` (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    ax = X.abs().flatten().sort().values
    y_dense = layer.y(layer.s(X, -math.inf), -math.inf)
    pick = None

    def sorted_abs_s(s):
        nonlocal pick
        if pick is None:
            pick = torch.randint(0, s.numel(), (min(GREEDY_SAMPLES, s.numel()),), generator=gen).to(s.device)
        return s.flatten()[pick].abs().sort().values

    def error(s, sorted_s, level_s):
        return (layer.y(s, _quantile(sorted_s, level_s)) - y_dense).norm(dim=-1).mean().item()

    lx = ls = eff = 0.0
    s_cur = layer.s(X, -math.inf)
    srt_cur = sorted_abs_s(s_cur)
    out = {}
    for target in sorted(ks):
        while eff < target - 1e-9:
            d = min(step, target - eff)
            best = None
            if lx + 1.5 * d <= MAX_LEVEL:
                s_new = layer.s(X, _quantile(ax, lx + 1.5 * d))
                srt_new = sorted_abs_s(s_new)
                best = (error(s_new, srt_new, ls), "x", s_new, srt_new)
            if ls + 3 * d <= MAX_LEVEL:
                err = error(s_cur, srt_cur, ls + 3 * d)
                if best is None or err < best[0]:
                    best = (err, "s", None, None)
            if best is None:
                raise ValueError(f"k={target:g} needs more than {MAX_LEVEL} of x or s skipped in a layer: choose a "
                                 "lower k")
            if best[1] == "x":
                lx += 1.5 * d
                s_cur, srt_cur = best[2], best[3]
            else:
                ls += 3 * d
            eff += d
        out[target] = (lx, ls)
    return out


class TealKind(SelectorKind):
    name = "teal"
    methods = ("teal",)
    selections = ("threshold",)
    default_selection = "threshold"
    default_tokens = 4096
    # allocation: greedy (TEAL's block-wise greedy) or uniform; step: the greedy walk's step of a layer's
    # Sparsity-Real; greedy_tokens: captured inputs the walk measures output errors on.
    defaults = {"allocation": "greedy", "step": 0.02, "greedy_tokens": 512, "batch_size": 4,
                "max_activation_gb": 2.0}
    choices = {"allocation": ALLOCATIONS}

    def resolve_options(self, method, mlps, given):
        opts = super().resolve_options(method, mlps, given)
        if opts["allocation"] not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {opts['allocation']!r}: choose one of {', '.join(ALLOCATIONS)}")
        return opts

    def fit(self, ctx):
        return fit_by_capture(ctx, self.fit_layer, desc=f"calibrating teal ({ctx.opts['allocation']})")

    def fit_layer(self, method, mlp, layer, X, ks, opts, progress=False):
        fit = _Layer(mlp, X)
        if opts["allocation"] == "greedy":
            idx = torch.linspace(0, X.shape[0] - 1, min(int(opts["greedy_tokens"]), X.shape[0])).long()
            levels = greedy_levels(fit, X[idx.to(X.device)], ks, float(opts["step"]), seed=layer)
        else:
            levels = {k: (k, k) for k in ks}
        gen = torch.Generator().manual_seed(layer)
        ax = pooled_sample(X.abs(), X.shape[0], gen)
        tensors = {}
        for k in ks:
            lx, ls = levels[k]
            cut_x = pooled_cut(ax, lx).to(X.device)
            cut_s = pooled_cut(pooled_sample(fit.s(X, cut_x).abs(), X.shape[0], gen), ls)
            key = f"{sparsity_key(k)}/layer{layer}"
            tensors.update({f"{key}/cut_x": cut_x.float().cpu(), f"{key}/cut_s": cut_s.float().cpu(),
                            f"{key}/level_x": torch.tensor(float(lx)), f"{key}/level_s": torch.tensor(float(ls))})
        return tensors

    def check(self, artifacts):
        n = artifacts.meta["model"]["n_layers"]
        for k in artifacts.sparsities:
            for i in range(n):
                have = artifacts.layer_tensors(k, i)
                missing = [name for name in ("cut_x", "cut_s", "level_x", "level_s") if name not in have]
                if missing:
                    raise ArtifactError(f"teal artifact lacks {', '.join(missing)} of layer {i} at k={k:g}; rebuild it")

    def selectors(self, artifacts, mlps, method, k):
        out = []
        for i in range(len(mlps)):
            t = artifacts.layer_tensors(k, i)
            out.append(TealThresholdSelector(t["cut_x"], t["cut_s"]))
        return out

    def set_cuts(self, artifacts, k, cuts):
        raise NotImplementedError("teal keeps two cuts per layer (x and s); they are refitted by TealKind.refine")

    def refine(self, model, mlps, method, artifacts, windows, progress, opts) -> bool:
        """Re-estimate every layer's cut_x and cut_s at its allocated levels on the model sparsified
        with the current cuts (every position sparse); s is taken with x cut by the current cut_x."""
        n_tokens = sum(w.numel() for w in windows)
        layers = [_Layer(mlp, torch.empty(0, device=mlp.w_down.device)) for mlp in mlps]
        for k in artifacts.sparsities:
            gen = torch.Generator().manual_seed(0)
            samples = {i: ([], []) for i in range(len(mlps))}
            cuts = [artifacts.layer_tensors(k, i) for i in range(len(mlps))]

            def on_input(i, x):
                x = x.float()
                samples[i][0].append(pooled_sample(x.abs(), n_tokens, gen))
                s = layers[i].s(x, cuts[i]["cut_x"].to(x.device))
                samples[i][1].append(pooled_sample(s.abs(), n_tokens, gen))

            sparsify(model, with_mode(method, "prac", artifacts), k, artifacts=artifacts, scope="all")
            try:
                with torch.no_grad():
                    stream_mlp_inputs(model, mlps, windows, on_input, batch_size=int(opts["batch_size"]),
                                      progress=progress, desc=f"refining teal cuts k={k:g}", allow_patched=True)
            finally:
                unsparsify(model)
            key = sparsity_key(artifacts.sparsities[artifacts.sparsity_index(k)])
            for i, (ax, as_) in samples.items():
                artifacts.tensors[f"{key}/layer{i}/cut_x"] = pooled_cut(torch.cat(ax), float(cuts[i]["level_x"])).float()
                artifacts.tensors[f"{key}/layer{i}/cut_s"] = pooled_cut(torch.cat(as_), float(cuts[i]["level_s"])).float()
        return True

    def weight_bytes(self, d_model, d_inter, kept, elem_bytes, meta):
        # kept = 1 - Sparsity-Real = (2 kept_x + kept_s) / 3: the kept share of the three matrices
        return 3.0 * kept * elem_bytes * d_model * d_inter


register_kind(TealKind())
