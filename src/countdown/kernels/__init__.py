"""Triton kernels that turn skipped Gated-MLP rows into real speed, each beside its PyTorch reference.

By op family (docs/kernels.md): ``sparse_mlp/`` (the sparse Gated-MLP), ``shadow/`` (the shadows and their
GEMVs), ``teal/``, ``decode_step/`` (the dense decode step: attention, the fixed GEMV, RMSNorm), ``int4/`` (4-bit
weights); shared: ``common.py`` (no Triton), ``jit_helpers.py`` (@triton.jit helpers, PDL), ``config.py`` (the
user's options, every launch table, the overrides context), ``route.py`` (which kernel runs, one table).

Public ops (x [..., d_model]; w_gate, w_up [d_inter, d_model]; w_down_t = W_down^T [d_inter, d_model]):

    mono_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation)   keep |x W_up^T| > tau
    cats_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation)   keep |act(x W_gate^T)| > tau
    masked_gated_mlp(x, w_gate, w_up, w_down_t, keep, activation)      keep given [..., d_inter]
    dual_gated_mlp(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation)  keep (x A) B > cut
    threshold_block(h, norm_w, eps, w_gate, w_up, w_down_t, threshold, method, activation)
    dual_block(h, norm_w, eps, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation)
                                        h + the MLP of RMSNorm(h) for one token with the norm inside the route's
                                        launches, or None where that route does not serve (the caller then takes
                                        block_input(h, norm_w, eps) and the op with residual=h)
    sparse_down_proj(s, keep, w_down_t)                                y = masked s @ w_down_t
    shadow_dual_gated_mlp(x, prepared, cut, w_gate, w_up, w_down_t, activation)
                                        keep |u~ act(g~)| > cut, u~, g~ from 4-bit shadows (shadow/)
    hybrid_gated_mlp(x, u, latent, bt, bias, cut, w_gate, w_down_t, activation)
                                        keep |u| |act(latent bt^T + bias)| > cut, u given
    teal_gated_mlp(x, w_gate_t, w_up_t, w_down_t, thr_x, thr_s, activation)
                                        TEAL: keep x entries |x| > tau_x, s entries |s| > tau_s; the gate
                                        and up weights transposed [d_model, d_inter] (teal/)

activation is "silu" or "gelu_tanh"; thresholds are Python floats or 0-dim tensors (read on the device, no host
sync). The MLP ops take ``count=(kept, rows)``, a patched layer's Sparsity-Real counters: the kernel that keeps
the rows adds them in place, without a launch more (``count_keep`` adds a keep mask computed in PyTorch the same
way). All are torch custom ops (``torch.ops.countdown.*``): torch.compile with fullgraph=True and CUDA-graph capture
work. Where ``available(x)`` is False (no Triton, or a CPU tensor without TRITON_INTERPRET=1) they run their
``*_ref`` PyTorch reference. ``import countdown.kernels`` needs no Triton: the Triton modules load where a route
takes them.
"""

from .common import available, count_keep
from .config import KernelOptions, overrides
from .shadow import (dequantize, pack_bits, prepare_shadow, quantize_rtn, shadow_bytes, shadow_dual_gated_mlp,
                     shadow_dual_gated_mlp_ref, shadow_keep_ref, shadow_scores, shadow_scores_ref, unpack_bits,
                     unpack_prepared)
from .sparse_mlp import (block_input, cats_gated_mlp, cats_gated_mlp_ref, cats_keep, dual_block, dual_gated_mlp,
                         dual_gated_mlp_ref, dual_keep, dual_scores, gated_mlp_masked_ref, hybrid_gated_mlp,
                         hybrid_gated_mlp_ref, hybrid_keep, masked_gated_mlp, masked_gated_mlp_ref, mono_gated_mlp,
                         mono_gated_mlp_ref, mono_keep, sparse_down_proj, sparse_down_proj_ref, threshold_block)
from .teal import teal_gated_mlp, teal_gated_mlp_ref, teal_keep_x, teal_masked_ref

__all__ = [
    "available", "count_keep", "KernelOptions", "overrides",
    "mono_gated_mlp", "mono_gated_mlp_ref", "mono_keep",
    "cats_gated_mlp", "cats_gated_mlp_ref", "cats_keep",
    "masked_gated_mlp", "masked_gated_mlp_ref", "gated_mlp_masked_ref", "threshold_block", "block_input",
    "dual_block", "dual_gated_mlp", "dual_gated_mlp_ref", "dual_keep", "dual_scores",
    "sparse_down_proj", "sparse_down_proj_ref",
    "quantize_rtn", "dequantize", "pack_bits", "unpack_bits", "shadow_bytes",
    "shadow_scores_ref", "shadow_keep_ref", "shadow_dual_gated_mlp_ref",
    "prepare_shadow", "unpack_prepared", "shadow_scores", "shadow_dual_gated_mlp",
    "hybrid_gated_mlp", "hybrid_gated_mlp_ref", "hybrid_keep",
    "teal_gated_mlp", "teal_gated_mlp_ref", "teal_keep_x", "teal_masked_ref",
]
