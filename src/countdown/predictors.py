"""SP-Prac predictors for predictor methods (D-CountDown, Deja Vu): models, training, selectors.

A predictor scores every row of a Gated-MLP from the block's input ``x`` alone, without computing the
method's indicator. The paper's kinds (Appendix, Algorithm "Training the predictor"):

* ``lowrank``: ``z = x A B + b`` with ``A [d_model, d_rank]``, ``B [d_rank, d_inter]``;
* ``ternary``: ``z = (x Q) * scale + b`` with ``Q [d_model, d_inter]`` in {-1, 0, +1} and a
  per-output scale ``scale[j] = mean_i |W[i, j]|``; trained on a latent float ``W`` quantized as
  ``Q = clamp(round(W / scale), -1, 1)`` with a straight-through estimator (BitNet b1.58 style).

Both are trained with binary cross-entropy against the oracle keep mask: per token, the
``kept_rows(d_inter, k)`` rows with the largest indicator (``|u * act(g)|`` for dual, ``act(g)`` for
dejavu). ``pos_weight`` (> 1) weighs kept rows up, trading precision for recall. ``init="gate"``
(default) starts them from the closed-form gate estimate below instead of noise (``"random"``, the
paper): rows with a large gate pre-activation are the ones both methods keep most, and with the
few epochs a CPU budget allows this start is worth more than the training (docs/prac.md).

One more kind, for dual only, beyond the paper:

* ``hybrid``: compute ``u`` densely (as M-CountDown does: W_up is read in full), predict only the
  gate pre-activation with a rank-``d_rank`` map ``g_hat = x A B + b`` and keep rows by the score
  ``|u| * |act(g_hat)|``. ``A, B, b`` come in closed form: the rank-``d_rank`` map closest to
  ``x W_gate^T + b_gate`` in mean squared error over the calibration tokens (an SVD of
  ``L^T W_gate^T`` with ``L L^T`` the covariance of ``x``), so no gradient training is needed.

Selection at run time (``selection``): ``"logit"`` keeps rows with ``z > 0`` (the paper);
``"cut"`` keeps rows whose score exceeds a per-layer cut calibrated like the thresholds of
:mod:`countdown.calibrate` (mean over training tokens of the per-token k-quantile of the score), so
that on average the target sparsity is hit; ``"topk"`` keeps exactly ``kept_rows(d_inter, k)`` rows
of largest score per token.

Training streams: the unpatched model runs over the calibration text; forward pre-hooks copy each
Gated-MLP's input into RAM (float32, for as many layers as ``max_activation_gb`` allows per pass;
the forward stops after the last wanted layer), then layers are trained one after another and their
inputs freed. Nothing goes to disk except, with ``checkpoint``, each finished layer's predictor.
With ``refine`` (default) the cuts are then re-estimated on the model sparsified with them, as
:func:`countdown.calibrate.calibrate` does for thresholds.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .artifacts import Artifacts, check_selection, model_fingerprint, new_meta, sparsity_key
from .calibrate import (
    DEFAULT_REFINE_TOKENS,
    DEFAULT_WINDOW,
    _like,
    _sparsity_list,
    first_windows,
    indicator_of,
    pooled_sample,
    resolve_texts,
    stream_mlp_inputs,
    token_quantiles,
    token_windows,
)
from .mlp import KNOWN_ACTIVATIONS, GatedMLP, require_gated_mlps
from .registry import Method, get_method, kept_rows
from .sparse import RowSelector
from .tp import refuse_sharded

PREDICTOR_KINDS = ("lowrank", "ternary", "hybrid")
INITS = ("gate", "random")
DEFAULT_TRAIN_TOKENS = 8192
# d_rank by kind: lowrank keeps the paper's ratio d_rank / d_model = 512 / 4096 (72 for SmolLM2's
# 576, rounded to 64); hybrid's closed-form fit costs no training, so it takes the most rank that stays
# within the 7%-of-parameters budget on SmolLM2 (128 * (576 + 1536) per layer = 6.1%).
DEFAULT_RANK = {"lowrank": 64, "hybrid": 128}
# kind by method: dual's best practical form is the hybrid (docs/prac.md); dejavu has no dense u to use.
DEFAULT_KIND = {"dual": "hybrid", "dejavu": "lowrank"}
DEFAULT_EPOCHS = 2
DEFAULT_BATCH = 512


# --------------------------------------------------------------------------------------------
# Trainable predictors
# --------------------------------------------------------------------------------------------


class LowRankPredictor(nn.Module):
    """``z = x A B + b``: ``A [d_model, d_rank]``, ``B [d_rank, d_inter]``, ``b [d_inter]``."""

    def __init__(self, d_model: int, d_inter: int, d_rank: int, generator: torch.Generator,
                 input_rms: float = 1.0, prior: float = 0.0):
        super().__init__()
        # Scaled so that z starts as N(prior, ~1) whatever the size of x.
        self.A = nn.Parameter(torch.randn(d_model, d_rank, generator=generator) / (math.sqrt(d_model) * input_rms))
        self.B = nn.Parameter(torch.randn(d_rank, d_inter, generator=generator) / math.sqrt(d_rank))
        self.bias = nn.Parameter(torch.full((d_inter,), float(prior)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.A) @ self.B + self.bias

    def export(self) -> dict[str, torch.Tensor]:
        return {"A": self.A.detach().clone(), "B": self.B.detach().clone(), "bias": self.bias.detach().clone()}


def ternarize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, scale)``: ``scale[j] = mean_i |W[i, j]|`` and ``Q = clamp(round(W / scale), -1, 1)``."""
    scale = weight.abs().mean(dim=0).clamp_min(1e-8)
    return (weight / scale).round().clamp(-1, 1), scale


class TernaryPredictor(nn.Module):
    """``z = x (Q * scale) + b`` with ``Q`` in {-1, 0, 1}; trained through a straight-through
    estimator on the latent ``weight`` (the forward uses ``Q * scale``, the gradient flows to
    ``weight`` as if the quantization were the identity)."""

    def __init__(self, d_model: int, d_inter: int, generator: torch.Generator, input_rms: float = 1.0,
                 prior: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_model, d_inter, generator=generator)
                                   / (math.sqrt(d_model) * input_rms))
        self.bias = nn.Parameter(torch.full((d_inter,), float(prior)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = ternarize(self.weight)
        w = self.weight + (q * scale - self.weight).detach()
        return x @ w + self.bias

    def export(self) -> dict[str, torch.Tensor]:
        q, scale = ternarize(self.weight.detach())
        return {"ternary": q.to(torch.int8), "scale": scale.clone(), "bias": self.bias.detach().clone()}


# --------------------------------------------------------------------------------------------
# Selectors (run time)
# --------------------------------------------------------------------------------------------


def _resolve_act(mlp: GatedMLP | None, act_name: str):
    if mlp is not None:
        return mlp.act
    if act_name in KNOWN_ACTIVATIONS:
        return KNOWN_ACTIVATIONS[act_name]
    raise ValueError(f"unknown activation {act_name!r}: pass the GatedMLP so its own activation is used")


class PredictorSelector(RowSelector):
    """SP-Prac with a trained predictor: rows from ``x`` alone (no dense projection needed).

    ``tensors``: ``A, B, bias`` (lowrank) or ``ternary, scale, bias`` (ternary); ``cut``: the
    calibrated score cut used by ``selection="cut"``; ``n_keep``: rows per token for ``"topk"``.

    Low-rank ``B`` is held as ``Bt = B^T`` (contiguous ``[d_inter, d_rank]``: the layout the fused
    dual kernel reads), and ``row_cut = cut - bias`` (``-bias`` for ``"logit"``) is the per-row
    threshold on ``x A B`` that the kernel compares against. :meth:`to_model_dtype` casts ``A`` and
    ``Bt`` to a half-precision model's dtype (:func:`countdown.sparsify` calls it), so a decode step
    reads the predictor at two bytes per weight; bias, cuts and the comparison stay in float32.
    """

    def __init__(self, kind: str, tensors: dict[str, torch.Tensor], selection: str, n_keep: int):
        super().__init__()
        self.kind = kind
        self.selection = check_selection(kind, selection)
        self.n_keep = int(n_keep)
        if kind == "lowrank":
            self.register_buffer("A", tensors["A"].clone())
            self.register_buffer("Bt", tensors["B"].t().contiguous())
        else:
            self.register_buffer("ternary", tensors["ternary"].clone())
            self.register_buffer("scale", tensors["scale"].clone())
        self.register_buffer("bias", tensors["bias"].float().clone())
        self.register_buffer("cut", tensors["cut"].float().reshape(()).clone())
        self.register_buffer("row_cut", _row_cut(self.bias, self.cut, self.selection))

    def to_model_dtype(self, dtype: torch.dtype) -> None:
        """Hold the low-rank factors in ``dtype`` when it is a half-precision type (else no-op)."""
        if self.kind == "lowrank" and dtype in (torch.bfloat16, torch.float16):
            self.A = self.A.to(dtype)
            self.Bt = self.Bt.to(dtype)

    def latent_score(self, x: torch.Tensor) -> torch.Tensor:
        """``x A B`` (low-rank, without the bias) in float32, computed at the factors' precision."""
        return ((x.to(self.A.dtype) @ self.A) @ self.Bt.t()).float()

    def score(self, x: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "lowrank":
            return self.latent_score(x) + self.bias
        return (x.float() @ self.ternary.float()) * self.scale + self.bias

    def forward(self, x, u, h):
        if self.kind == "lowrank" and self.selection != "topk":
            # score > cut  <=>  x A B > cut - bias: the same rule the fused kernel applies
            return self.latent_score(x) > self.row_cut
        return select(self.score(x), self.selection, self.cut, self.n_keep)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, selection={self.selection}, n_keep={self.n_keep}"


def _row_cut(bias: torch.Tensor, cut: torch.Tensor, selection: str) -> torch.Tensor:
    """Per-row threshold on the bias-free score: ``cut - bias`` (``"cut"``), ``-bias`` (``"logit"``)."""
    return (-bias if selection == "logit" else cut - bias).float().contiguous()


class HybridDualSelector(RowSelector):
    """Dual SP-Prac with a dense ``u``: score ``|u| * |act(x A B + b)|`` (the gate side predicted)."""

    needs_up = True
    needs_gate = False

    def __init__(self, tensors: dict[str, torch.Tensor], act, selection: str, n_keep: int):
        super().__init__()
        self.act = act
        self.selection = check_selection("hybrid", selection)
        self.n_keep = int(n_keep)
        self.register_buffer("A", tensors["A"].clone())
        self.register_buffer("Bt", tensors["B"].t().contiguous())
        self.register_buffer("bias", tensors["bias"].float().clone())
        self.register_buffer("cut", tensors["cut"].float().reshape(()).clone())

    def to_model_dtype(self, dtype: torch.dtype) -> None:
        if dtype in (torch.bfloat16, torch.float16):
            self.A = self.A.to(dtype)
            self.Bt = self.Bt.to(dtype)

    def gate_estimate(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.to(self.A.dtype) @ self.A) @ self.Bt.t()).float() + self.bias

    def score(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return u.float().abs() * self.act(self.gate_estimate(x)).abs()

    def forward(self, x, u, h):
        return select(self.score(x, u), self.selection, self.cut, self.n_keep)

    def extra_repr(self) -> str:
        return f"selection={self.selection}, n_keep={self.n_keep}"


def _on_devices(selectors: list, mlps: list[GatedMLP]) -> list:
    """Each selector on its Gated-MLP's device, in its dtype (as :func:`countdown.sparsify` does)."""
    for sel, mlp in zip(selectors, mlps):
        sel.to(mlp.w_down.device)
        sel.to_model_dtype(mlp.w_down.dtype)
    return selectors


def select(score: torch.Tensor, selection: str, cut: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Keep mask from a score ``[N, d_inter]`` by ``"logit"`` (> 0), ``"cut"`` (> cut) or ``"topk"``."""
    if selection == "logit":
        return score > 0
    if selection == "cut":
        return score > cut.to(score.dtype)
    idx = score.topk(n_keep, dim=-1, sorted=False).indices
    return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)


def selector_from_tensors(artifacts: Artifacts, mlp: GatedMLP, layer: int, sparsity: float) -> RowSelector:
    """The run-time selector of one layer (called by :func:`countdown.artifacts.prac_selectors`)."""
    tensors = artifacts.layer_tensors(sparsity, layer)
    n_keep = kept_rows(mlp.d_inter, sparsity)
    if artifacts.kind == "hybrid":
        return HybridDualSelector(tensors, _resolve_act(mlp, artifacts.meta["model"]["act"]),
                                  artifacts.selection, n_keep)
    return PredictorSelector(artifacts.kind, tensors, artifacts.selection, n_keep)


# --------------------------------------------------------------------------------------------
# Targets and closed-form fits
# --------------------------------------------------------------------------------------------


def oracle_masks(score: torch.Tensor, n_keeps: list[int]) -> list[torch.Tensor]:
    """Per token, True for the ``n_keep`` largest entries of ``score [N, d_inter]``, per ``n_keep``."""
    order = score.topk(max(n_keeps), dim=-1, sorted=True).indices
    masks = []
    for n in n_keeps:
        masks.append(torch.zeros_like(score, dtype=torch.bool).scatter_(-1, order[:, :n], True))
    return masks


def fit_gate_lowrank(mlp: GatedMLP, X: torch.Tensor, d_rank: int) -> dict[str, torch.Tensor]:
    """The rank-``d_rank`` affine map ``x A B + b`` closest to ``g = x W_gate^T + b_gate`` in mean
    squared error over the rows of ``X``.

    With ``mu`` the mean of ``x`` and ``C = L L^T`` the covariance of ``x``, the error is
    ``||L^T (W^T - A B)||_F^2``; the best rank-r ``A B`` keeps the top-r right singular vectors
    ``V_r`` of ``L^T W^T``: ``A = W^T V_r``, ``B = V_r^T``, and the bias restores the mean:
    ``b = mu W^T + b_gate - mu A B``.
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


def calibrated_cuts(score_rows, n_rows: int, n_keeps: list[int], chunk: int = 4096,
                    rule: str = "mean-quantile") -> list[torch.Tensor]:
    """Per ``n_keep``: a score cut; ``score_rows(start, stop)`` gives the scores of tokens
    ``start:stop`` (chunked to bound RAM). The rules of :mod:`countdown.calibrate`:
    ``"mean-quantile"``: the mean over the ``n_rows`` tokens of the per-token cut that exactly ``n_keep``
    scores exceed; ``"pooled"``: the cut that ``n_keep / d_inter`` of all scores together exceed (from a
    uniform sample of them), so the kept fraction over the calibration tokens is the target even when
    tokens' score scales differ."""
    check_cut_rule(rule)
    total = torch.zeros(len(n_keeps), dtype=torch.float64)
    samples = []
    gen = torch.Generator().manual_seed(0)
    d_inter = None
    for start in range(0, n_rows, chunk):
        score = score_rows(start, min(start + chunk, n_rows))
        if rule == "mean-quantile":
            total += token_quantiles(score, n_keeps).double().sum(dim=1).cpu()
        else:
            d_inter = score.shape[-1]
            samples.append(pooled_sample(score, n_rows, gen))
    if rule == "mean-quantile":
        return [(t / max(n_rows, 1)).float() for t in total]
    return [_pooled_cut(torch.cat(samples), n, d_inter) for n in n_keeps]


def _pooled_cut(sample: torch.Tensor, n_keep: int, d_inter: int) -> torch.Tensor:
    if n_keep >= d_inter:
        return torch.tensor(-math.inf)
    return torch.quantile(sample.double(), 1.0 - n_keep / d_inter, interpolation="linear").float()


CUT_RULES = ("mean-quantile", "pooled")


def check_cut_rule(rule: str) -> str:
    if rule not in CUT_RULES:
        raise ValueError(f"unknown cut_rule {rule!r}: choose one of {', '.join(CUT_RULES)}")
    return rule


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def layer_seed(seed: int, layer: int, k_index: int) -> int:
    """One seed per (layer, sparsity): a layer trains the same way whether or not others ran first."""
    return int(seed) * 1_000_003 + layer * 1009 + k_index


def _train_bce(predictor: nn.Module, X: torch.Tensor, Y: torch.Tensor, *, epochs: int, batch_size: int,
               lr: float, weight_decay: float, pos_weight: float | None, generator: torch.Generator,
               progress: bool, desc: str) -> list[float]:
    """AdamW on binary cross-entropy between ``predictor(X)`` and the 0/1 mask ``Y``; returns the
    mean loss of each epoch."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(predictor.parameters(), lr=lr, weight_decay=weight_decay)
    pw = None if pos_weight is None else torch.tensor(float(pos_weight), device=X.device)
    losses = []
    n = X.shape[0]
    for _ in tqdm(range(epochs), desc=desc, disable=not progress, leave=False):
        perm = torch.randperm(n, generator=generator)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start:start + batch_size]
            loss = F.binary_cross_entropy_with_logits(predictor(X[idx]), Y[idx].float(), pos_weight=pw)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * idx.numel()
        losses.append(total / n)
    return losses


GATE_INIT_SLOPE = 4.0


def _init_from_gate(predictor: nn.Module, fit: dict[str, torch.Tensor], X: torch.Tensor, n_keep: int) -> None:
    """Start a predictor at ``z = a * (g_hat - c)``: the closed-form low-rank gate estimate, cut at its
    calibrated k-quantile ``c`` and scaled so that one standard deviation of ``g_hat`` is
    ``GATE_INIT_SLOPE`` logits. Rows with a large gate pre-activation are the ones kept by dejavu and,
    with ``u``, by dual; so BCE starts from a sensible ranking instead of noise."""
    with torch.no_grad():
        g_hat = lambda a, b: (X[a:b] @ fit["A"]) @ fit["B"] + fit["bias"]  # noqa: E731
        c = float(calibrated_cuts(g_hat, X.shape[0], [n_keep])[0])
        scale = GATE_INIT_SLOPE / float(g_hat(0, min(X.shape[0], 4096)).std().clamp_min(1e-6))
        if isinstance(predictor, LowRankPredictor):
            predictor.A.copy_(fit["A"] * scale)
            predictor.B.copy_(fit["B"])
        else:
            predictor.weight.copy_((fit["A"] @ fit["B"]) * scale)
        predictor.bias.copy_((fit["bias"] - c) * scale)


def fit_layer(method: Method, mlp: GatedMLP, layer: int, X: torch.Tensor, ks: list[float], opts: dict,
              progress: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of one layer's predictors, at every sparsity: ``{"k=<k>/layer<i>/<name>": ...}``
    (hybrid: the k-independent gate estimate as ``shared/layer<i>/<name>``, a cut per k)."""
    n_keeps = [kept_rows(mlp.d_inter, k) for k in ks]
    out: dict[str, torch.Tensor] = {}
    kind = opts["kind"]
    with torch.no_grad():
        if kind == "hybrid":
            fitted = fit_gate_lowrank(mlp, X, opts["d_rank"])
            U = F.linear(X, *_like(X, mlp.w_up, mlp.b_up)).abs()
        else:
            masks = oracle_masks(indicator_of(method, mlp, X), n_keeps)
            rank = opts["d_rank"] if kind == "lowrank" else mlp.d_model  # ternary: a full-rank start
            gate_fit = fit_gate_lowrank(mlp, X, rank) if opts["init"] == "gate" else None
    if kind == "hybrid":
        # One gate estimate serves every k (it does not depend on k): stored once, plus a cut per k.
        for name, t in fitted.items():
            out[f"shared/layer{layer}/{name}"] = t.cpu().contiguous()

        def hybrid_score(start: int, stop: int) -> torch.Tensor:
            g_hat = (X[start:stop] @ fitted["A"]) @ fitted["B"] + fitted["bias"]
            return U[start:stop] * mlp.act(g_hat).abs()

        with torch.no_grad():
            cuts = calibrated_cuts(hybrid_score, X.shape[0], n_keeps, rule=opts["cut_rule"])
        for k, cut in zip(ks, cuts):
            out[f"{sparsity_key(k)}/layer{layer}/cut"] = cut
        return out
    input_rms = float(X.pow(2).mean().sqrt().clamp_min(1e-6))
    for j, (k, n_keep) in enumerate(zip(ks, n_keeps)):
        gen = torch.Generator().manual_seed(layer_seed(opts["seed"], layer, j))
        prior = math.log(n_keep / (mlp.d_inter - n_keep)) if n_keep < mlp.d_inter else 0.0
        if kind == "lowrank":
            predictor = LowRankPredictor(mlp.d_model, mlp.d_inter, opts["d_rank"], gen, input_rms, prior)
        else:
            predictor = TernaryPredictor(mlp.d_model, mlp.d_inter, gen, input_rms, prior)
        predictor.to(X.device)  # initialised from the CPU generator: the same start on any device
        if opts["init"] == "gate":
            _init_from_gate(predictor, gate_fit, X, n_keep)
        _train_bce(predictor, X, masks[j], epochs=opts["epochs"], batch_size=opts["batch_size"],
                   lr=opts["lr"], weight_decay=opts["weight_decay"], pos_weight=opts["pos_weight"],
                   generator=gen, progress=progress, desc=f"layer {layer} k={k:g}")
        tensors = predictor.export()
        with torch.no_grad():
            tensors["cut"] = calibrated_cuts(lambda a, b: predictor(X[a:b]), X.shape[0], [n_keep],
                                             rule=opts["cut_rule"])[0]
        for name, t in tensors.items():
            out[f"{sparsity_key(k)}/layer{layer}/{name}"] = t.detach().cpu().contiguous()
    return out


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load_checkpoint(folder: Path, config: dict, n_layers: int) -> dict[int, dict[str, torch.Tensor]]:
    """Finished layers of an earlier run with the same config; raises if the config differs."""
    from safetensors.torch import load_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg_path = folder / "config.json"
    if cfg_path.exists():
        old = json.loads(cfg_path.read_text())
        if old != config:
            diff = sorted(key for key in set(old) | set(config) if old.get(key) != config.get(key))
            raise ValueError(f"checkpoint folder {folder} belongs to a run with other settings ({', '.join(diff)} "
                             "differ): pass another checkpoint path, or delete the folder to start over")
    else:
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, sort_keys=True, indent=1)
        os.replace(tmp, cfg_path)
    done = {}
    for i in range(n_layers):
        path = folder / f"layer{i:03d}.safetensors"
        if path.exists():
            try:
                done[i] = load_file(str(path))
            except Exception:  # written atomically, so only an outside hand can corrupt it: redo it
                path.unlink()
    return done


def train_predictors(model: nn.Module, tokenizer, method: str | Method, sparsity, texts=None,
                     num_tokens: int = DEFAULT_TRAIN_TOKENS, d_rank: int | None = None,
                     epochs: int = DEFAULT_EPOCHS, kind: str | None = None, selection: str = "cut",
                     checkpoint: str | os.PathLike | None = None, batch_size: int = DEFAULT_BATCH,
                     lr: float = 1e-3, weight_decay: float = 0.0, pos_weight: float | None = None,
                     init: str = "gate", seed: int = 42, window: int = DEFAULT_WINDOW, max_activation_gb: float = 2.0,
                     refine: bool = True, refine_tokens: int = DEFAULT_REFINE_TOKENS,
                     cut_rule: str = "mean-quantile", progress: bool = True) -> Artifacts:
    """Train one predictor per Gated-MLP (and per sparsity) for a predictor method (dual, dejavu).

    sparsity: one k or a list (one data pass serves all; one predictor per k and layer).
    texts / num_tokens / window: calibration text (default :func:`countdown.data.calibration_texts`).
    kind: ``"lowrank"`` (paper), ``"ternary"`` (paper's TernaryLinear) or ``"hybrid"`` (dual only:
        dense u, closed-form low-rank gate estimate; ``epochs`` unused).
    d_rank / epochs / batch_size (tokens per step) / lr / weight_decay / pos_weight / seed: training.
        The default d_rank is lowered to min(d_model, d_inter) on narrower models; an explicit
        d_rank above that is an error.
    selection: default run-time rule stored in the artifact ("cut", "logit" or "topk").
    checkpoint: a folder; every finished layer is saved there atomically and a rerun with the same
        settings continues after the last finished layer, with the same result.
    max_activation_gb: RAM for captured activations per pass; more layers than fit take more passes.
    refine / refine_tokens: re-estimate each layer's ``cut`` on the model sparsified with the first
        cuts (one pass per k over the first ``refine_tokens`` tokens), as
        :func:`countdown.calibrate.calibrate` does for thresholds. Only the cut changes.
    cut_rule: how a cut is estimated from the calibration tokens' scores (:func:`calibrated_cuts`):
        ``"mean-quantile"`` (the paper's rule for thresholds) or ``"pooled"`` (the kept fraction over
        the calibration tokens is exactly 1 - k; better when tokens' score scales differ).
    """
    from tqdm.auto import tqdm

    m = get_method(method)
    if m.prac != "predictor":
        hint = "calibrate thresholds with countdown.calibrate" if m.prac == "threshold" else "it skips nothing"
        raise ValueError(f"method {m.name!r} does not use a trained predictor: {hint}")
    kind = DEFAULT_KIND.get(m.name, "lowrank") if kind is None else kind
    if kind not in PREDICTOR_KINDS:
        raise ValueError(f"unknown predictor kind {kind!r}: choose one of {', '.join(PREDICTOR_KINDS)}")
    if kind == "hybrid" and m.name != "dual":
        raise ValueError("kind='hybrid' computes u densely and predicts act(g): it applies to dual only "
                         "(for dejavu a dense gate would be CATS); use kind='lowrank'")
    check_selection(kind, selection)
    check_cut_rule(cut_rule)
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}: choose one of {', '.join(INITS)}")
    rank_given = d_rank is not None
    d_rank = DEFAULT_RANK.get(kind, 0) if d_rank is None else int(d_rank)
    if (kind != "ternary" and d_rank < 1) or epochs < 0 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need d_rank >= 1, epochs >= 0, batch_size >= 1, lr > 0; got d_rank={d_rank}, "
                         f"epochs={epochs}, batch_size={batch_size}, lr={lr}")
    ks = _sparsity_list(sparsity)
    mlps = require_gated_mlps(model)
    full_rank = min(min(mlp.d_model, mlp.d_inter) for mlp in mlps)
    if kind != "ternary" and d_rank > full_rank and not rank_given:
        d_rank = full_rank  # the default rank on a model narrower than it: full rank
    if kind != "ternary" and d_rank > full_rank:
        raise ValueError(f"d_rank={d_rank} exceeds the full rank {full_rank} of this model's Gated-MLPs "
                         f"(min(d_model, d_inter)); choose d_rank <= {full_rank}")
    texts, data_name = resolve_texts(texts)
    windows = token_windows(tokenizer, texts, num_tokens, window)
    n_tokens = sum(w.numel() for w in windows)
    opts = {"kind": kind, "d_rank": int(d_rank), "epochs": int(epochs) if kind != "hybrid" else 0,
            "batch_size": int(batch_size), "lr": float(lr), "weight_decay": float(weight_decay),
            "pos_weight": None if pos_weight is None else float(pos_weight),
            "init": init if kind != "hybrid" else "closed-form", "seed": int(seed), "cut_rule": cut_rule}
    data = {"name": data_name, "num_tokens": n_tokens, "window": window}

    done: dict[int, dict[str, torch.Tensor]] = {}
    folder = Path(checkpoint) if checkpoint is not None else None
    if folder is not None:
        config = {"method": m.name, "sparsities": ks, "data": data, "fingerprint": model_fingerprint(mlps), **opts}
        done = _load_checkpoint(folder, config, len(mlps))

    todo = [i for i in range(len(mlps)) if i not in done]
    per_layer_bytes = n_tokens * mlps[0].d_model * 4
    per_pass = max(1, int(max_activation_gb * 2**30 // max(per_layer_bytes, 1)))
    bar = tqdm(total=len(mlps), initial=len(done), desc=f"training {m.name} {kind} predictors",
               disable=not progress)
    for start in range(0, len(todo), per_pass):
        group = todo[start:start + per_pass]
        captured: dict[int, list[torch.Tensor]] = {i: [] for i in group}

        def on_input(i: int, x: torch.Tensor) -> None:
            # float32 on the model's device: a GPU model trains its predictors on the GPU
            captured[i].append(x.detach().float().clone())

        stream_mlp_inputs(model, mlps, windows, on_input, layers=group, progress=progress,
                          desc=f"capturing layers {group[0]}-{group[-1]}")
        for i in group:
            X = torch.cat(captured.pop(i))
            tensors = fit_layer(m, mlps[i], i, X, ks, opts, progress=progress)
            del X
            if folder is not None:
                _atomic_save(tensors, folder / f"layer{i:03d}.safetensors")
            done[i] = tensors
            bar.update(1)
    bar.close()

    tensors = {name: t for i in range(len(mlps)) for name, t in done[i].items()}
    refine_windows = first_windows(windows, refine_tokens) if refine else []
    meta = new_meta(m, kind, ks, mlps, selection=selection, data=data,
                    d_rank=None if kind == "ternary" else d_rank,
                    training={key: value for key, value in opts.items() if key not in ("kind", "d_rank")},
                    refine=bool(refine), refine_tokens=sum(w.numel() for w in refine_windows))
    art = Artifacts(meta, tensors)
    if refine:
        art.tensors.update(refine_cuts(model, mlps, m, art, refine_windows, progress, rule=cut_rule))
    return art


def refine_cuts(model: nn.Module, mlps: list[GatedMLP], method: Method, artifacts: Artifacts,
                windows: list[torch.Tensor], progress: bool = False,
                rule: str = "mean-quantile") -> dict[str, torch.Tensor]:
    """New ``cut`` tensors: per k, the model runs sparsified with the current cuts (every position
    sparse) and each layer's cut is re-estimated, by ``rule`` (see :func:`calibrated_cuts`), from the
    scores of the inputs it then sees."""
    from .artifacts import prac_selectors
    from .sparse import sparsify, unsparsify

    check_cut_rule(rule)
    by_cut = artifacts.with_selection("cut")
    n_tokens = sum(w.numel() for w in windows)
    new = {}
    for k in artifacts.sparsities:
        selectors = _on_devices(prac_selectors(by_cut, mlps, method, k), mlps)
        sums = torch.zeros(len(mlps), dtype=torch.float64)
        counts = torch.zeros(len(mlps), dtype=torch.float64)
        samples: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(mlps))}
        gen = torch.Generator().manual_seed(0)

        def on_input(i: int, x: torch.Tensor) -> None:
            sel, mlp = selectors[i], mlps[i]
            u = F.linear(x, *_like(x, mlp.w_up, mlp.b_up)) if sel.needs_up else None
            score = sel.score(x, u)
            if rule == "mean-quantile":
                q = token_quantiles(score, [kept_rows(mlp.d_inter, k)])[0]
                sums[i] += float(q.double().sum())
            else:
                samples[i].append(pooled_sample(score, n_tokens, gen))
            counts[i] += score.shape[0]

        sparsify(model, method, k, mode="prac", artifacts=by_cut, scope="all")
        try:
            with torch.no_grad():
                stream_mlp_inputs(model, mlps, windows, on_input, progress=progress,
                                  desc=f"refining cuts k={k:g}", allow_patched=True)
        finally:
            unsparsify(model)
        for i, mlp in enumerate(mlps):
            if rule == "mean-quantile":
                cut = (sums[i] / counts[i].clamp_min(1)).float()
            else:
                cut = _pooled_cut(torch.cat(samples[i]), kept_rows(mlp.d_inter, k), mlp.d_inter)
            new[f"{sparsity_key(k)}/layer{i}/cut"] = cut
    return new


def refine_cuts_on_decode(model: nn.Module, artifacts: Artifacts, prompts: torch.Tensor, new_tokens: int = 64,
                          rounds: int = 2) -> dict[float, list[float]]:
    """Re-fit a predictor artifact's cuts, in place, on the *sparse* model's own decode steps.

    Cuts fitted on the dense model's activations (or refined on calibration text) can keep another
    fraction of rows on the sparse model's own greedy continuations: its activations drift (measured on
    a random-weight Llama-3.1-8B shape: Sparsity-Real 0.963 at k = 0.9, docs/decode.md). Per k and
    round: patch the model with the current cuts (masked path, prompt dense), generate ``new_tokens``
    greedily after every row of ``prompts [n, prompt_len]``, collect each layer's decode-step inputs
    x, and set the layer's cut to the k-quantile of the pooled scores of those steps (so that exactly a
    fraction 1 - k of (step, row) pairs scores above it). Only ``cut`` tensors change. Use prompts
    other than the ones you evaluate on.

    Returns ``{k: [Sparsity-Real of each round's generation]}``: how far each round's cuts were from k
    on the sparse model's own decode steps (the first entry is the artifact as given)."""
    from .decode import generate_fast
    from .sparse import sparsify, sparsity_real, state_of, unsparsify

    m = get_method(artifacts.method)
    if artifacts.kind not in ("lowrank", "ternary"):
        raise ValueError(f"refine_cuts_on_decode re-fits cuts of predictors scored from x alone (lowrank, "
                         f"ternary), got kind {artifacts.kind!r}")
    if prompts.dim() != 2 or prompts.shape[0] < 1:
        raise ValueError(f"prompts must be token ids [n, prompt_len], got shape {tuple(prompts.shape)}")
    mlps = require_gated_mlps(model)
    refuse_sharded(mlps, "refine_cuts_on_decode")  # a cut is a quantile over every row of a layer
    prompts = prompts.to(mlps[0].w_up.device)
    history: dict[float, list[float]] = {}
    for k in artifacts.sparsities:
        history[k] = []
        for _ in range(rounds):
            sparsify(model, m.name, k, mode="prac", artifacts=artifacts.with_selection("cut"), path="masked")
            selectors = [layer.selector for layer in state_of(model).layers]
            inputs: list[list[torch.Tensor]] = [[] for _ in selectors]
            hooks = [sel.register_forward_hook(lambda mod, args, out, i=i: inputs[i].append(args[0].detach()))
                     for i, sel in enumerate(selectors)]
            try:
                with torch.no_grad():
                    generate_fast(model, prompts, new_tokens, compile=False)
                    history[k].append(round(sparsity_real(model)["mean"], 4))
                    for i, (sel, xs) in enumerate(zip(selectors, inputs)):
                        score = sel.score(torch.cat(xs)).float().flatten()
                        rank = min(max(1, round(k * score.numel())), score.numel())
                        cut = score.kthvalue(rank).values
                        artifacts.tensors[f"{sparsity_key(k)}/layer{i}/cut"] = cut.reshape(()).cpu()
            finally:
                for h in hooks:
                    h.remove()
                unsparsify(model)
    artifacts.meta["decode_refit"] = {"rounds": rounds, "prompts": int(prompts.shape[0]),
                                      "prompt_len": int(prompts.shape[1]), "new_tokens": new_tokens,
                                      "sparsity_real_per_round": {f"{k:g}": v for k, v in history.items()}}
    return history


# --------------------------------------------------------------------------------------------
# Quality reports
# --------------------------------------------------------------------------------------------


def predictor_quality(model: nn.Module, tokenizer, artifacts, texts=None, num_tokens: int = 4096,
                      window: int = DEFAULT_WINDOW, progress: bool = True) -> dict:
    """Per-layer precision / recall / F1 of the SP-Prac keep masks against the SP-Ideal (oracle) mask
    of the artifact's method, and the fraction of rows they skip, on held-out text.

    texts: default :func:`countdown.data.eval_texts` (XSum; never the calibration text).
    Works for threshold artifacts too (the mask of ``indicator > tau``).
    Returns ``{"method", "kind", "selection", "num_tokens", "by_sparsity": {k: {"precision",
    "recall", "f1", "sparsity", "per_layer": [{"precision", "recall", "f1", "sparsity"}, ...]}}}``
    where the top-level figures are means over layers.
    """
    from .artifacts import load_artifacts, prac_selectors

    if not isinstance(artifacts, Artifacts):
        artifacts = load_artifacts(artifacts)
    if texts is None:
        from .data import eval_texts

        texts = eval_texts()
    m = get_method(artifacts.method)
    mlps = require_gated_mlps(model)
    ks = artifacts.sparsities
    selectors = {k: _on_devices(prac_selectors(artifacts, mlps, m, k), mlps) for k in ks}
    counts = torch.zeros(len(ks), len(mlps), 4, dtype=torch.float64)  # tp, fp, fn, kept
    rows = torch.zeros(len(mlps), dtype=torch.float64)
    windows = token_windows(tokenizer, list(texts), num_tokens, window)

    def on_input(i: int, x: torch.Tensor) -> None:
        mlp = mlps[i]
        u, g = mlp.parts(x)
        u, h = u.float(), mlp.act(g).float()
        oracle = oracle_masks(m.indicator(u, h), [kept_rows(mlp.d_inter, k) for k in ks])
        for j, k in enumerate(ks):
            pred = selectors[k][i](x, u, h)
            counts[j, i, 0] += float((pred & oracle[j]).sum())
            counts[j, i, 1] += float((pred & ~oracle[j]).sum())
            counts[j, i, 2] += float((~pred & oracle[j]).sum())
            counts[j, i, 3] += float(pred.sum())
        rows[i] += x.shape[0] * mlp.d_inter

    seen = stream_mlp_inputs(model, mlps, windows, on_input, progress=progress, desc="predictor quality")
    report = {"method": m.name, "kind": artifacts.kind, "selection": artifacts.selection,
              "num_tokens": seen, "by_sparsity": {}}
    for j, k in enumerate(ks):
        per_layer = []
        for i in range(len(mlps)):
            tp, fp, fn, kept = counts[j, i].tolist()
            precision = tp / max(tp + fp, 1)
            recall = tp / max(tp + fn, 1)
            f1 = 2 * precision * recall / max(precision + recall, 1e-12)
            per_layer.append({"precision": precision, "recall": recall, "f1": f1,
                              "sparsity": 1.0 - kept / max(float(rows[i]), 1)})
        summary = {key: sum(p[key] for p in per_layer) / len(per_layer)
                   for key in ("precision", "recall", "f1", "sparsity")}
        report["by_sparsity"][k] = {**summary, "per_layer": per_layer}
    return report
