"""The ``shadow`` kind (dual): rank rows by ``|u~ * act(g~)|`` from low-bit copies of W_up and W_gate.

D-CountDown keeps the rows with the largest ``|u * act(g)|``; computing that exactly reads W_up and
W_gate in full. The shadow kind reads instead a *shadow* of each: a symmetric group-wise
round-to-nearest copy at ``bits`` bits (4 by default; 3 and 8 as options; groups of ``group``
columns along d_model, fp16 scales; format in :mod:`countdown.kernels.shadow.format`), scores
``u~ = x Q_up^T``, ``g~ = x Q_gate^T`` in float32, keeps rows with ``|u~ act(g~)| > cut`` (a per-layer
cut calibrated like the thresholds, several k from one pass) and then computes the EXACT MLP on the
kept rows of the full-precision W_gate, W_up and W_down. No training: the shadows come from the
weights, the cuts from the calibration text.

Bytes a decode step reads per Gated-MLP: both shadows (4-bit, group 64: about 0.53 byte per weight
each) plus the kept rows of the three full-precision matrices; on a Llama-3.1-8B MLP at k = 0.9,
2 x 29.4 MB + 3 x 11.7 MB = 94 MB against 352 MB dense and 141 MB for mono. Memory: the shadows add
about 12 % of a bf16 model at 4 bits (3 bits: about 9 %).

Saved tensors: ``shared/layer<i>/{gate_q, up_q}`` (uint8, packed by ``quant.pack_bits``),
``shared/layer<i>/{gate_scale, up_scale}`` (float16) and ``k=<k>/layer<i>/cut``. Kernel: at batch 1
the int8 shadow GEMV writes the scores and the one-launch sparse kernel keeps the rows over the cut
(``countdown.kernels.shadow``); 4 and 8 bits on the GPU, other widths on the reference path.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..artifacts.store import ArtifactError, sparsity_key
from ..kernels.shadow.format import BITS, dequantize, pack_bits, quantize_rtn, shadow_bytes, unpack_bits
from ..model.gated_mlp import GatedMLP
from ..sparse_methods.registry import kept_rows
from .base import RowSelector, SelectorKind, register_kind, select
from .capture import fit_by_capture
from .cuts import CUT_RULES, calibrated_cuts, check_cut_rule

DEFAULT_BITS = 4
DEFAULT_GROUP = 64


def shadow_score(act, x: torch.Tensor, w_gate_t: torch.Tensor, w_up_t: torch.Tensor) -> torch.Tensor:
    """``|u~ * act(g~)|`` in float32 from dequantized shadows ``w~ [d_inter, d_model]`` (float32)."""
    xf = x.float()
    return ((xf @ w_up_t.t()) * act(xf @ w_gate_t.t())).abs()


class ShadowSelector(RowSelector):
    """Keep rows with ``|u~ act(g~)| > cut`` (or the top ``n_keep`` of it, ``selection="topk"``).

    Holds the shadows as int8 ``q`` and float16 ``scale`` (CPU paths: dequantized per call), or,
    on CUDA after :meth:`to_model_dtype`, in the kernel's packed layout only (``prepared``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], d_model: int, bits: int, act, selection: str, n_keep: int):
        super().__init__()
        self.bits, self.act, self.selection, self.n_keep = bits, act, selection, int(n_keep)
        self.register_buffer("q_gate", unpack_bits(tensors["gate_q"], bits, d_model))
        self.register_buffer("q_up", unpack_bits(tensors["up_q"], bits, d_model))
        self.register_buffer("s_gate", tensors["gate_scale"].to(torch.float16).clone())
        self.register_buffer("s_up", tensors["up_scale"].to(torch.float16).clone())
        self.register_buffer("cut", tensors["cut"].float().reshape(()).clone())
        self.prepared_names: tuple[str, ...] | None = None

    def to_model_dtype(self, dtype: torch.dtype) -> None:
        """On CUDA: build the kernel layout once and drop the int8 copies (memory as deployed)."""
        if self.q_up is not None and self.q_up.is_cuda:
            self._prepare()
            self.q_gate = self.q_up = None

    def _prepare(self) -> dict[str, torch.Tensor]:
        if self.prepared_names is None:
            prepared = kernels.prepare_shadow(self.q_gate, self.s_gate, self.q_up, self.s_up, self.bits)
            for name, t in prepared.items():
                self.register_buffer(f"prepared_{name}", t)
            self.prepared_names = tuple(prepared)
        return {name: getattr(self, f"prepared_{name}") for name in self.prepared_names}

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """``|u~ act(g~)|`` float32 ``[tokens, d_inter]``."""
        if self.q_up is None:  # CUDA: the shadow GEMVs of the kernel library
            u_t, g_t = kernels.shadow_scores(x, self._prepare())
            return (u_t * self.act(g_t)).abs()
        return shadow_score(self.act, x, dequantize(self.q_gate, self.s_gate), dequantize(self.q_up, self.s_up))

    def score(self, x, mlp=None):
        return self.scores(x)

    def forward(self, x, u, h):
        return select(self.scores(x), self.selection, self.cut, self.n_keep)

    def kernel_forward(self, x2, mlp, w_down_t, count=None):
        if self.selection != "cut":
            return super().kernel_forward(x2, mlp, w_down_t, count)
        return kernels.shadow_dual_gated_mlp(x2, self._prepare(), self.cut, mlp.w_gate, mlp.w_up, w_down_t,
                                             mlp.act_name, count=count)

    def kernel_block(self, h2, mlp, w_down_t, norm_w, eps, count=None):
        if self.selection != "cut":
            return None
        # the norm on its kernel, the add in the partials' sum
        return kernels.shadow_dual_gated_mlp(kernels.block_input(h2, norm_w, eps), self._prepare(), self.cut,
                                             mlp.w_gate, mlp.w_up, w_down_t, mlp.act_name, residual=h2, count=count)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, selection={self.selection}, n_keep={self.n_keep}"


def fit_shadow_layer(method, mlp: GatedMLP, layer: int, X: torch.Tensor, ks: list[float], opts: dict,
                     progress: bool = False) -> dict[str, torch.Tensor]:
    """One layer's packed shadows and a cut per k on ``|u~ act(g~)|`` over its captured inputs."""
    bits, group = opts["bits"], opts["group"]
    out = {}
    with torch.no_grad():
        deq = {}
        for name, w in (("gate", mlp.w_gate), ("up", mlp.w_up)):
            q, scale = quantize_rtn(w.detach().float(), bits, group)  # on the weight's device
            out[f"shared/layer{layer}/{name}_q"] = pack_bits(q, bits).cpu()
            out[f"shared/layer{layer}/{name}_scale"] = scale.cpu()
            deq[name] = dequantize(q, scale).to(X.device)
        cuts = calibrated_cuts(lambda a, b: shadow_score(mlp.act, X[a:b], deq["gate"], deq["up"]), X.shape[0],
                               [kept_rows(mlp.d_inter, k) for k in ks], rule=opts["cut_rule"])
    for k, cut in zip(ks, cuts):
        out[f"{sparsity_key(k)}/layer{layer}/cut"] = cut.reshape(()).cpu()
    return out


class ShadowKind(SelectorKind):
    name = "shadow"
    methods = ("dual",)
    selections = ("cut", "topk")
    default_selection = "cut"
    defaults = {"bits": DEFAULT_BITS, "group": DEFAULT_GROUP, "cut_rule": "mean-quantile", "max_activation_gb": 2.0}
    spec_number, spec_number_shown, spec_letters = "bits", True, {"g": "group"}  # dual[shadow4], dual[shadow3g32]
    choices = {"bits": BITS, "cut_rule": CUT_RULES}

    def resolve_options(self, method, mlps, given):
        opts = super().resolve_options(method, mlps, given)
        check_cut_rule(opts["cut_rule"])
        opts["bits"], opts["group"] = int(opts["bits"]), int(opts["group"])
        if opts["bits"] not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {opts['bits']}")
        bad = sorted({m.d_model for m in mlps if m.d_model % opts["group"] or (m.d_model * opts["bits"]) % 8})
        if opts["group"] < 1 or bad:
            raise ValueError(f"group={opts['group']} does not divide d_model {bad}: choose a group that divides "
                             "it (e.g. 32 or 64)")
        return opts

    def meta(self, opts):
        return {"bits": opts["bits"], "group": opts["group"], "cut_rule": opts["cut_rule"], "d_rank": None}

    def fit(self, ctx):
        return fit_by_capture(ctx, fit_shadow_layer, desc=f"building dual {ctx.opts['bits']}-bit shadows")

    def check(self, artifacts):
        meta = artifacts.meta
        if meta.get("bits") not in BITS or not isinstance(meta.get("group"), int):
            raise ArtifactError("shadow artifact lacks valid 'bits' / 'group' metadata; rebuild it")
        d_model = meta["model"]["d_model"]
        for i, d_inter in enumerate(meta["model"]["d_inter"]):
            for name, shape in (("gate_q", (d_inter, d_model * meta["bits"] // 8)),
                                ("up_q", (d_inter, d_model * meta["bits"] // 8)),
                                ("gate_scale", (d_inter, d_model // meta["group"])),
                                ("up_scale", (d_inter, d_model // meta["group"]))):
                t = artifacts.tensors.get(f"shared/layer{i}/{name}")
                if t is None or tuple(t.shape) != shape:
                    raise ArtifactError(f"shadow artifact's shared/layer{i}/{name} is missing or not {shape} "
                                        f"(bits {meta['bits']}, group {meta['group']}): rebuild it")

    def selectors(self, artifacts, mlps, method, k):
        bits = artifacts.meta["bits"]
        return [ShadowSelector(artifacts.layer_tensors(k, i), mlp.d_model, bits, mlp.act, artifacts.selection,
                               kept_rows(mlp.d_inter, k)) for i, mlp in enumerate(mlps)]

    def weight_bytes(self, d_model, d_inter, kept, elem_bytes, meta):
        bits, group = int(meta.get("bits", DEFAULT_BITS)), int(meta.get("group", DEFAULT_GROUP))
        return shadow_bytes(d_inter, d_model, bits, group) + elem_bytes * 3 * d_model * d_inter * kept


register_kind(ShadowKind())
