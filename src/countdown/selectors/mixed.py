"""The ``mixed`` kind (dual): D-CountDown decides each row's precision, not its presence.

``dual[mixed]``: each Gated-MLP's weights are held in the nested 8-bit format (``countdown/int4/nested.py``: two
4-bit planes, groups of ``group`` input columns). Per token, rows are ranked by ``|u~ act(g~)|`` from the high planes
(dual[shadow4]'s score, from the format's own 4-bit plane instead of a separate shadow); the rows over the
layer's calibrated cut (``selection="cut"``, the product) or the top ``1 - k`` (``selection="topk"``) are computed
at 8 bits (u = u~ + x Delta_up for those rows, the same for g, and W_down's low plane on their coefficients), the
rest at 4 bits; nothing is skipped (``countdown/patch/mixed_mlp.py`` computes it). k is the share of rows left at 4 bits.

The user's path, on a model as loaded (float weights)::

    art = countdown.prepare(model, tok, "dual[mixed]", [0.9])   # converts the MLPs to the nested format, in place,
                                                                # then calibrates the cuts on the 8-bit model
    countdown.sparsify(model, "dual[mixed]", 0.9, artifacts=art)

``sparsify`` converts the MLPs itself where they are not nested yet (a fresh model with a saved artifact: the
conversion is deterministic, so the artifact's fingerprint, taken on the nested model, fits), before the artifact
is checked, and puts the float Linears back if the check fails. ``unsparsify`` leaves the 8-bit model (every MLP
Linear nested, computing with both planes): the float weights are gone, which is the memory the format saves.
``countdown.save`` / ``load_model`` round-trip the nested MLPs and the artifact (config.json records the format).

Options: ``group`` (32 / 64 / 128; default 64, which divides d_model and d_inter of every real model here),
``scales`` (``float16`` / ``float32``, the planes' scales and offsets), ``rank`` (``shadow``: the high planes' score,
the method; ``exact``: the exact ``|u act(g)|``, with ``selection="topk"`` the SP-Ideal variant, a quality study;
``error``: the expected size of each row's refinement, from the high planes and four constants a row,
``mixed_rows.row_score``: the rows whose precision matters most rather than the largest ones),
``kept`` (``8bit``: the method; ``float``: the reference variant, the MLP's float Linears kept as loaded and the
high planes held beside them in the selector, the kept rows in the model's precision, no conversion), and the
shadow kind's ``cut_rule`` and ``max_activation_gb``.

Saved tensors: ``k=<k>/layer<i>/cut`` only (the planes live in the model). Bytes a decode step reads per Gated-MLP:
the three high planes plus the kept share of the three low planes (each plane ``1/2 + 4/G`` byte a weight with
float16 scales: 4.5 bits at G = 64), or, for ``kept="float"``, the kept rows of the float weights.
"""

from __future__ import annotations

import torch

from ..artifacts.store import ArtifactError, sparsity_key
from ..int4.format import GROUPS
from ..int4.nested import nbytes as nested_bytes
from ..patch.mixed_mlp import ACT_GRADS, FloatPlanes, MixedGatedMLP, NestedPlanes, error_constants, ranking_score, row_score
from ..model.gated_mlp import GatedMLP
from ..sparse_methods.registry import kept_rows
from .base import RowSelector, SelectorKind, register_kind, select
from .capture import fit_by_capture
from .cuts import CUT_RULES, calibrated_cuts, check_cut_rule

SCALES = {"float16": torch.float16, "float32": torch.float32}
RANKS = ("shadow", "exact", "error")
KEPT = ("8bit", "float")


class MixedSelector(RowSelector):
    """Which rows of a token are computed at full precision: the ranking ``rank`` names (``mixed_rows.row_score``)
    over the layer's cut, or its top ``n_keep``. ``planes`` gives the mixed forward its weights."""

    needs_up = needs_gate = True
    patched_class = MixedGatedMLP  # countdown.sparsify patches the MLP with this class

    def __init__(self, planes, act, act_name: str, rank: str, selection: str, n_keep: int, cut: torch.Tensor):
        super().__init__()
        self.planes, self.act, self.act_name, self.rank = planes, act, act_name, rank
        self.selection, self.n_keep = selection, int(n_keep)
        self.register_buffer("cut", cut.float().reshape(()).clone())
        self.register_buffer("consts", error_constants(planes) if rank == "error" else None)

    def rank_score(self, x, u, g):
        """The float32 ranking of the rows from ``x`` and its projections ``u``, ``g`` (pre-activation)."""
        return row_score(self.rank, self.act, self.act_name, x, u, g, self.consts)

    def pick(self, score):
        return select(score, self.selection, self.cut, self.n_keep)

    def forward(self, x, u, h):
        if self.rank == "error":
            raise ValueError("rank='error' ranks from u and g (before the activation): use rank_score, then pick")
        return self.pick((u * h).abs().float())

    def score(self, x, mlp: GatedMLP):
        return ranking_score(self.planes, self.act, self.act_name, x, self.rank, self.consts, mlp.b_gate, mlp.b_up)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, selection={self.selection}, n_keep={self.n_keep}"


def _planes(mlp: GatedMLP, opts: dict):
    if opts["kept"] == "float":
        from ..int4.nested_linear import NestedLinear

        if any(isinstance(getattr(mlp.module, getattr(mlp, r)), NestedLinear) for r in ("gate", "up", "down")):
            raise ValueError("dual[mixed,kept=float] keeps the float weights as loaded, but this model's MLPs are "
                             "nested 8-bit already: load the model again")
        return FloatPlanes(mlp, opts["group"], SCALES[opts["scales"]])
    return NestedPlanes(mlp)


def fit_mixed_layer(method, mlp: GatedMLP, layer: int, X: torch.Tensor, ks: list[float], opts: dict,
                    progress: bool = False) -> dict[str, torch.Tensor]:
    """One layer's cut per k on its ranking score over its captured inputs."""
    planes = _planes(mlp, opts)
    with torch.no_grad():
        consts = error_constants(planes) if opts["rank"] == "error" else None
        cuts = calibrated_cuts(lambda a, b: ranking_score(planes, mlp.act, mlp.act_name, X[a:b], opts["rank"], consts,
                                                          mlp.b_gate, mlp.b_up),
                               X.shape[0], [kept_rows(mlp.d_inter, k) for k in ks], rule=opts["cut_rule"])
    return {f"{sparsity_key(k)}/layer{layer}/cut": cut.reshape(()).cpu() for k, cut in zip(ks, cuts)}


class MixedKind(SelectorKind):
    name = "mixed"
    methods = ("dual",)
    selections = ("cut", "topk")
    default_selection = "cut"
    defaults = {"group": 64, "scales": "float16", "rank": "shadow", "kept": "8bit", "cut_rule": "mean-quantile",
                "max_activation_gb": 2.0}
    spec_letters = {"g": "group"}  # dual[mixedg128]
    choices = {"group": GROUPS, "scales": tuple(SCALES), "rank": RANKS, "kept": KEPT, "cut_rule": CUT_RULES}

    def resolve_options(self, method, mlps, given):
        opts = super().resolve_options(method, mlps, given)
        check_cut_rule(opts["cut_rule"])
        for key, allowed in (("group", GROUPS), ("scales", tuple(SCALES)), ("rank", RANKS), ("kept", KEPT)):
            if opts[key] not in allowed:
                raise ValueError(f"{key} must be one of {', '.join(map(str, allowed))}, got {opts[key]!r}")
        if opts["rank"] == "error" and any(m.act_name not in ACT_GRADS for m in mlps):
            raise ValueError(f"rank=error needs the activation's derivative (known: {', '.join(ACT_GRADS)}); this "
                             f"model's is {mlps[0].act_name!r}: use rank=shadow")
        widths = sorted({w for m in mlps for w in (m.d_model, m.d_inter)})
        if any(w % opts["group"] for w in widths):
            fits = [g for g in GROUPS if not any(w % g for w in widths)]
            raise ValueError(f"group={opts['group']} does not divide d_model and d_inter {widths}: choose "
                             f"{', '.join(map(str, fits)) or 'a model whose widths are multiples of 32'}")
        return opts

    def meta(self, opts):
        return {key: opts[key] for key in ("group", "scales", "rank", "kept", "cut_rule")}

    def prepare_model(self, model, mlps, options: dict):
        """The nested MLPs the 8-bit kinds run on, made in place where they are float (``kept="8bit"``); returns
        the undo (the float Linears put back), or None where nothing changed."""
        if options.get("kept", "8bit") != "8bit":
            return None
        from ..int4.nested_model import convert, restore

        replaced = convert(model, mlps, int(options.get("group", 64)), SCALES[options.get("scales", "float16")])
        return (lambda: restore(model, replaced)) if replaced else None

    def fit(self, ctx):
        self.prepare_model(ctx.model, ctx.mlps, ctx.opts)
        what = "8-bit rows over a 4-bit MLP" if ctx.opts["kept"] == "8bit" else "float rows over a 4-bit MLP"
        return fit_by_capture(ctx, fit_mixed_layer, desc=f"calibrating dual mixed ({what})")

    def check(self, artifacts):
        meta = artifacts.meta
        for key, allowed in (("group", GROUPS), ("scales", tuple(SCALES)), ("rank", RANKS), ("kept", KEPT)):
            if meta.get(key) not in allowed:
                raise ArtifactError(f"mixed artifact lacks a valid {key!r} ({meta.get(key)!r}): rebuild it")
        for k in artifacts.sparsities:
            for i in range(meta["model"]["n_layers"]):
                t = artifacts.tensors.get(f"{sparsity_key(k)}/layer{i}/cut")
                if t is None or t.numel() != 1:
                    raise ArtifactError(f"mixed artifact's {sparsity_key(k)}/layer{i}/cut is missing: rebuild it")

    def selectors(self, artifacts, mlps, method, k):
        opts = artifacts.meta
        return [MixedSelector(_planes(mlp, opts), mlp.act, mlp.act_name, opts["rank"], artifacts.selection,
                              kept_rows(mlp.d_inter, k), artifacts.layer_tensors(k, i)["cut"])
                for i, mlp in enumerate(mlps)]

    def weight_bytes(self, d_model, d_inter, kept, elem_bytes, meta):
        group = int(meta.get("group", 64))
        scale = SCALES[meta.get("scales", "float16")]
        plane = nested_bytes(d_inter, d_model, group, scale) / 2  # one plane of one matrix
        if meta.get("kept", "8bit") == "float":
            return 3 * plane + elem_bytes * 3 * d_model * d_inter * kept
        return 3 * plane * (1 + kept)


register_kind(MixedKind())
