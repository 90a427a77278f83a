"""The sparse Gated-MLP's user functions (no Triton): each checks its arguments, asks route.py which kernel runs and
calls it (the reference where the kernels cannot run: reference.py).

    mono_gated_mlp    keep |u| > tau           u = x W_up^T (the indicator), the gate GEMV of kept rows only
    cats_gated_mlp    keep |act(g)| > tau      g = x W_gate^T (the indicator), the up GEMV of kept rows only
    dual_gated_mlp    keep (x A) B > cut       a low-rank predictor; both GEMVs of kept rows only
    masked_gated_mlp  keep given               both GEMVs of kept rows only
    hybrid_gated_mlp  keep |u| |act(g^)| > cut u given, g^ = latent Bt^T + bias; the gate GEMV of kept rows only
    sparse_down_proj  y = masked s @ w_down_t
    threshold_block, dual_block, block_input   a folded decode layer's MLP half: h + mlp(RMSNorm(h))

Bytes read for mono / cats: d_model d_inter (the indicator's matrix) + 2 d_model n_kept (+ vectors); dual: the
predictor d_model r + r d_inter + 3 d_model n_kept. ``count`` = (kept, rows): the kernel that keeps the rows adds
them to a patched layer's Sparsity-Real counters (jit_helpers.add_count); a reference path counts its mask.
``residual`` (a folded layer's h, x's shape and dtype): residual + y, the add inside the partials' sum where the
one-token route runs. Thresholds and cuts are floats, 0-dim tensors (read on the device, no host sync) or, for
dual, one per row ([d_inter]: a trained predictor's ``cut - bias``).

Store a predictor's A and B as the transposed views of contiguous A^T [r, d_model] and B^T [d_inter, r]: for one
token both GEMVs then run on decode_step/linear.py's fixed GEMV, which reads rows.
"""

from __future__ import annotations

import torch

from ..common import (check_mlp_args, count_keep, op_counters, plus, split_threshold, threshold_value)
from ..route import route
from .reference import (cats_keep, dual_keep, dual_scores, gated_mlp_masked_ref, hybrid_gated_mlp_ref, mono_keep,
                        sparse_down_proj_ref)

# kind -> (keep rule, the GEMVs of kept rows: gate, up)
_RULES = {"mono": ("abs", True, False), "cats": ("abs_act", False, True), "dual": ("gt", True, True)}


def _gemv(x2, w_rows, choice: str):
    """x2 [1, K] @ w_rows [N, K]^T in x2's dtype: on the fixed GEMV where ``choice`` is "linear" and w_rows is a
    contiguous weight of x2's dtype (an opaque op with one launch configuration per shape, which torch.compile
    cannot fuse with the norm before it and re-tune per compile), else a plain matrix product (any view)."""
    if choice == "linear" and w_rows.is_contiguous() and x2.dtype == w_rows.dtype:
        from ..decode_step import linear  # noqa: F401  (registers countdown::decode_linear; Triton)

        return torch.ops.countdown.decode_linear(x2, w_rows, None, None)
    return x2 @ w_rows.t()


def _one_token_indicator(kind, x2, w_gate, w_up, pred_a, pred_b) -> dict:
    """What the one-token kernel reads as its indicator: its rows (``w_ind``, computed inside it) or the indicator
    itself (``ind``, computed before it: route.py's "<kind>_indicator" and "predictor")."""
    if kind == "dual":
        choice = route("predictor", x2)
        return dict(ind=_gemv(_gemv(x2.to(pred_a.dtype), pred_a.t(), choice), pred_b.t(), choice))
    w_ind = w_up if kind == "mono" else w_gate
    choice = route(f"{kind}_indicator", x2)
    return dict(w_ind=w_ind) if choice == "in_kernel" else dict(ind=_gemv(x2, w_ind, choice))


def _chain(x2, w_gate, w_up, w_down_t, rule, activation, per_token, count, thr_t=None, thr_f=0.0, keep=None,
           pred_a=None, pred_b=None):
    from . import chain  # noqa: F401  (registers countdown::sparse_mlp_chain; Triton)

    kept, rows = op_counters(count, x2.device)
    return torch.ops.countdown.sparse_mlp_chain(x2, w_gate, w_up, w_down_t, keep, pred_a, pred_b, thr_t, thr_f, rule,
                                                activation, per_token, kept, rows)


def _row_mlp(kind, x, w_gate, w_up, w_down_t, threshold, activation, per_token, residual, count, pred_a=None,
             pred_b=None):
    """mono, cats or dual: the reference, the one-token kernel, the few-token kernel or the chain (route.py)."""
    d_model = x.shape[-1]
    x2 = x.reshape(-1, d_model)
    kernel = route(kind, x2, per_token)
    if kernel == "reference":
        keep = (mono_keep(x, w_up, threshold) if kind == "mono" else cats_keep(x, w_gate, threshold, activation)
                if kind == "cats" else dual_keep(x, pred_a, pred_b, threshold))
        count_keep(count, keep)
        return plus(gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation), residual)
    thr_t, thr_f = split_threshold(threshold)
    rule, gate, up = _RULES[kind]
    if kernel == "one_token":  # the whole MLP in one launch, the residual add in the partials' sum
        from . import one_token

        y = one_token.one_token_mlp(x2, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, gate, up,
                                    residual=residual, count=count,
                                    **_one_token_indicator(kind, x2, w_gate, w_up, pred_a, pred_b))
        return y.reshape(x.shape)
    from . import partial_sums

    if kernel == "few_tokens":  # 2-8 tokens: the indicator in PyTorch, then the union's rows in one launch
        from . import few_tokens

        ind = dual_scores(x2, pred_a, pred_b) if kind == "dual" else x2 @ (w_up if kind == "mono" else w_gate).t()
        y = few_tokens.few_tokens_mlp(x2, ind, w_gate, w_up, w_down_t, thr_t, thr_f, rule, activation, gate, up,
                                      count=count)
    else:  # "chain": the op computes the indicator, the gate / up kernel, the masked down projection
        y = _chain(x2, w_gate, w_up, w_down_t, rule, activation, per_token, count, thr_t, thr_f, pred_a=pred_a,
                   pred_b=pred_b)
    return partial_sums.add_residual(y, residual).reshape(x.shape)


def mono_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu",
                   per_token: bool = False, residual=None, count=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]: M-CountDown, rows kept where |u| > threshold (see the module
    docstring for ``residual`` and ``count``; ``per_token``: each token its own rows, on the chain)."""
    check_mlp_args(x, w_gate, w_up, w_down_t)
    return _row_mlp("mono", x, w_gate, w_up, w_down_t, threshold, activation, per_token, residual, count)


def cats_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation: str = "silu",
                   per_token: bool = False, residual=None, count=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]: CATS, rows kept where |act(g)| > threshold."""
    check_mlp_args(x, w_gate, w_up, w_down_t)
    return _row_mlp("cats", x, w_gate, w_up, w_down_t, threshold, activation, per_token, residual, count)


def _check_predictor(pred_a, pred_b, d_model: int, d_inter: int) -> None:
    if pred_a.dim() != 2 or pred_a.shape[0] != d_model or pred_b.dim() != 2 \
            or pred_b.shape != (pred_a.shape[1], d_inter):
        raise ValueError(f"predictor must be A [{d_model}, r] and B [r, {d_inter}], got "
                         f"{tuple(pred_a.shape)} and {tuple(pred_b.shape)}")


def dual_gated_mlp(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation: str = "silu",
                   per_token: bool = False, residual=None, count=None) -> torch.Tensor:
    """x [..., d_model] -> y [..., d_model]: D-CountDown with its low-rank predictor, rows kept where
    (x A) B > cut (the kernels read the scores and apply the cut themselves: no mask is written)."""
    d_model, d_inter = check_mlp_args(x, w_gate, w_up, w_down_t)
    _check_predictor(pred_a, pred_b, d_model, d_inter)
    return _row_mlp("dual", x, w_gate, w_up, w_down_t, cut, activation, per_token, residual, count, pred_a, pred_b)


def masked_gated_mlp(x, w_gate, w_up, w_down_t, keep, activation: str = "silu",
                     per_token: bool = False, count=None) -> torch.Tensor:
    """x [..., d_model], keep bool [..., d_inter] -> y [..., d_model] in x's dtype: only kept rows of the three
    matrices are read (the chain: the gate / up kernel, then the masked down projection)."""
    d_model, d_inter = check_mlp_args(x, w_gate, w_up, w_down_t)
    if keep.shape[-1] != d_inter or keep.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"keep must be [..., {d_inter}] matching x, got {tuple(keep.shape)}")
    keep = keep.to(torch.bool)
    x2 = x.reshape(-1, d_model)
    if route("masked", x2) == "reference":
        count_keep(count, keep)
        return gated_mlp_masked_ref(x, w_gate, w_up, w_down_t, keep, activation)
    return _chain(x2, w_gate, w_up, w_down_t, "mask", activation, per_token, count,
                  keep=keep.reshape(-1, d_inter)).reshape(x.shape)


def hybrid_gated_mlp(x, u, latent, bt, bias, cut, w_gate, w_down_t, activation: str = "silu",
                     count=None) -> torch.Tensor:
    """D-CountDown's hybrid kind: x [..., d_model], u = x W_up^T [..., d_inter] (x's dtype, a dense GEMV before),
    latent = x A [..., r], bt = B^T [d_inter, r] contiguous, bias [d_inter] float32 or None, cut a 0-dim float32
    tensor or a float, w_gate and w_down_t [d_inter, d_model] -> y [..., d_model] in x's dtype. The selecting
    kernel computes g^ = round(latent . Bt[i]) + bias[i] for every row, keeps |u| |act(g^)| > cut and reads only
    the kept rows of W_gate and W_down (W_up is not read again)."""
    d_model = x.shape[-1]
    d_inter = w_gate.shape[0]
    if w_gate.shape != (d_inter, d_model) or w_down_t.shape != (d_inter, d_model):
        raise ValueError(f"w_gate and w_down_t must be [d_inter, d_model={d_model}], got "
                         f"{tuple(w_gate.shape)} and {tuple(w_down_t.shape)}")
    if u.shape != (*x.shape[:-1], d_inter) or bt.dim() != 2 or bt.shape[0] != d_inter \
            or latent.shape != (*x.shape[:-1], bt.shape[1]):
        raise ValueError(f"need u [..., {d_inter}], latent [..., r] and bt [{d_inter}, r] matching x "
                         f"{tuple(x.shape)}; got {tuple(u.shape)}, {tuple(latent.shape)}, {tuple(bt.shape)}")
    if bias is not None and bias.shape != (d_inter,):
        raise ValueError(f"bias must be [{d_inter}], got {tuple(bias.shape)}")
    x2 = x.reshape(-1, d_model)
    if route("hybrid", x2) == "reference":
        return hybrid_gated_mlp_ref(x, u, latent, bt, bias, cut, w_gate, w_down_t, activation, count)
    cut_t, cut_f = split_threshold(cut)
    if cut_t is not None and cut_t.dim() != 0:
        raise ValueError("the hybrid cut is one value per layer (a 0-dim tensor or a float)")
    from . import partial_sums, select  # noqa: F401  (select registers its ops; Triton)

    n_tok = x2.shape[0]
    args = (x2, None, None, u.reshape(n_tok, d_inter), latent.reshape(n_tok, -1), bt, bias, cut_t, cut_f, w_gate,
            None, w_down_t, activation, *op_counters(count, x.device))
    if n_tok == 1:  # the partial sums of one launch, reduced outside it
        return partial_sums.reduce(torch.ops.countdown.select_one_token(*args), x2).reshape(x.shape)
    return torch.ops.countdown.select_few_tokens(*args).reshape(x.shape)


def sparse_down_proj(s: torch.Tensor, keep, w_down_t: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """y [..., d_model] = masked s [..., d_inter] @ w_down_t (keep a bool mask of s's shape, or None: rows with
    s != 0, what the gate / up kernels leave); fp32 accumulation, y in s's dtype; only kept rows are read."""
    d_inter, d_model = w_down_t.shape
    if s.shape[-1] != d_inter:
        raise ValueError(f"s has {s.shape[-1]} rows, w_down_t has {d_inter}")
    if s.dtype != w_down_t.dtype:
        raise ValueError(f"s dtype {s.dtype} differs from w_down_t dtype {w_down_t.dtype}")
    if keep is not None and keep.shape != s.shape:
        raise ValueError(f"keep shape {tuple(keep.shape)} differs from s shape {tuple(s.shape)}")
    if route("down", s) == "reference":
        return sparse_down_proj_ref(s, keep, w_down_t)
    from . import down  # noqa: F401  (registers countdown::sparse_down_proj; Triton)

    lead = s.shape[:-1]
    k2 = None if keep is None else keep.reshape(-1, d_inter).to(torch.bool)
    y = torch.ops.countdown.sparse_down_proj(s.reshape(-1, d_inter), k2, w_down_t, per_token)
    return y.reshape(*lead, d_model)


def threshold_block(h, norm_w, eps: float, w_gate, w_up, w_down_t, threshold, method: str,
                    activation: str, count=None) -> torch.Tensor | None:
    """h + mlp(RMSNorm(h)) for h [..., d_model] of one token in two launches (the norm computed by every program
    of the one-token kernel, which computes its indicator itself; the residual added by the partials' sum),
    ``method`` "mono" or "cats" with its threshold; None where that route does not serve (route.py's
    "threshold_block" and the method's indicator computed in the kernel): the caller then runs the norm
    (:func:`block_input`), the MLP with ``residual=h`` and so the add."""
    mode = {"mono": "abs", "cats": "abs_act"}.get(method)
    if mode is None:
        raise ValueError(f"threshold_block serves 'mono' or 'cats', got {method!r}")
    d_model, _ = check_mlp_args(h, w_gate, w_up, w_down_t)
    h2 = h.reshape(-1, d_model)
    if route("threshold_block", h2) != "one_token" or route(f"{method}_indicator", h2) != "in_kernel":
        return None
    from . import one_token  # noqa: F401  (registers countdown::sparse_mlp_block; Triton)

    thr_t, thr_f = split_threshold(threshold)
    kept, rows = op_counters(count, h2.device)
    out = torch.ops.countdown.sparse_mlp_block(h2, norm_w, float(eps), w_gate, w_up, w_down_t, thr_t, thr_f, mode,
                                               activation, kept, rows)
    return out.reshape(h.shape)


def dual_block(h, norm_w, eps: float, w_gate, w_up, w_down_t, pred_a, pred_b, cut,
               activation: str = "silu", count=None) -> torch.Tensor | None:
    """h + dual_gated_mlp(RMSNorm(h)) for one token of a folded decode layer, in four launches and none of them a
    norm: the predictor's first GEMV with the norm folded in, which also writes x = RMSNorm(h) for the sparse kernel
    (decode_step/linear.py ``decode_norm_linear_x``), the scores latent B^T, then the one-token kernel and its
    partials' sum with the add. None where that route does not serve (route.py's "dual_block" and the predictor
    on the fixed GEMV; A^T and B^T contiguous in h's dtype): the caller then runs the norm (:func:`block_input`)
    and ``dual_gated_mlp(..., residual=h)``."""
    d_model, d_inter = check_mlp_args(h, w_gate, w_up, w_down_t)
    _check_predictor(pred_a, pred_b, d_model, d_inter)
    h2 = h.reshape(-1, d_model)
    at, bt = pred_a.t(), pred_b.t()
    if not (route("dual_block", h2) == "one_token" and route("predictor", h2) == "linear" and at.is_contiguous()
            and bt.is_contiguous() and at.dtype == bt.dtype == h2.dtype == norm_w.dtype):
        return None
    from ..decode_step import linear  # noqa: F401  (registers the fixed GEMV's ops; Triton)
    from . import one_token

    cut_t, cut_f = split_threshold(cut)
    latent, x2 = torch.ops.countdown.decode_norm_linear_x(h2, norm_w, float(eps), at)
    ind = torch.ops.countdown.decode_linear(latent, bt, None, None)
    return one_token.one_token_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation, True, True,
                                   ind=ind, residual=h2, count=count).reshape(h.shape)


def block_input(h, norm_w, eps: float) -> torch.Tensor:
    """RMSNorm(h) on the folded layer's norm kernel (decode_step/rmsnorm.py), for the routes whose MLP needs x
    itself (a GEMV before the sparse kernel); they then take ``residual=h`` for the add."""
    from ..decode_step import rmsnorm  # noqa: F401  (registers countdown::decode_rms_norm; Triton)

    return torch.ops.countdown.decode_rms_norm(h, norm_w, float(eps))
