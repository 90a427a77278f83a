"""Triton kernels that turn skipped Gated-MLP rows into real speed, each beside its PyTorch reference.

Public ops (x [..., d_model]; w_gate, w_up [d_inter, d_model]; w_down_t = W_down^T [d_inter, d_model]):

    mono_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation)   keep |x W_up^T| > tau
    cats_gated_mlp(x, w_gate, w_up, w_down_t, threshold, activation)   keep |act(x W_gate^T)| > tau
    masked_gated_mlp(x, w_gate, w_up, w_down_t, keep, activation)      keep given [..., d_inter]
    threshold_block(h, norm_w, eps, w_gate, w_up, w_down_t, threshold, method, activation)
                                        h + mono / cats MLP of RMSNorm(h), one token, two launches, or None
                                        where that route does not serve (_block.py); the other one-token
                                        routes take residual=h after block_input(h, norm_w, eps)
    dual_gated_mlp(x, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation)  keep (x A) B > cut
    dual_block(h, norm_w, eps, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation)
                                        h + dual_gated_mlp of RMSNorm(h), one token, the norm folded into
                                        the predictor's first GEMV (which also writes x), or None (dual.py)
    sparse_down_proj(s, keep, w_down_t)                                y = masked s @ w_down_t
    shadow_dual_gated_mlp(x, prepared, cut, w_gate, w_up, w_down_t, activation)
                                        keep |u~ act(g~)| > cut, u~, g~ from 4-bit shadows (shadow.py)
    hybrid_gated_mlp(x, u, latent, bt, bias, cut, w_gate, w_down_t, activation)
                                        keep |u| |act(latent bt^T + bias)| > cut, u given (hybrid.py)
    teal_gated_mlp(x, w_gate_t, w_up_t, w_down_t, thr_x, thr_s, activation)
                                        TEAL: keep x entries |x| > tau_x, s entries |s| > tau_s; the gate
                                        and up weights transposed [d_model, d_inter] (teal.py)

The shadows' format (RTN quantization, packing, float32 references) is ``quant.py``; it needs no Triton.

activation is "silu" or "gelu_tanh"; thresholds are Python floats or 0-dim tensors (read on the
device, no host sync). The MLP ops take ``count=(kept, rows)``, a patched layer's Sparsity-Real counters:
the kernel that keeps the rows adds them in place, without a launch more (``_count.py``; ``count_keep`` adds
a keep mask computed in PyTorch the same way). All are torch custom ops (``torch.ops.countdown.*``):
torch.compile with fullgraph=True and CUDA-graph capture work. Where ``available(x)`` is False (no Triton,
or a CPU tensor without TRITON_INTERPRET=1) they run their ``*_ref`` PyTorch reference instead.
"""

from ._block import block_input, threshold_block
from ._common import available, count_keep
from .down_proj import sparse_down_proj, sparse_down_proj_ref
from .dual import dual_block, dual_gated_mlp, dual_gated_mlp_ref, dual_keep, dual_scores
from .masked import gated_mlp_masked_ref, masked_gated_mlp, masked_gated_mlp_ref
from .hybrid import hybrid_gated_mlp, hybrid_gated_mlp_ref, hybrid_keep
from .quant import (dequantize, pack_bits, quantize_rtn, shadow_bytes, shadow_dual_gated_mlp_ref,
                    shadow_keep_ref, shadow_scores_ref, unpack_bits)
from .shadow import prepare_shadow, shadow_dual_gated_mlp, shadow_scores, unpack_prepared
from .teal import teal_gated_mlp, teal_gated_mlp_ref, teal_keep_x, teal_masked_ref
from .threshold import (cats_gated_mlp, cats_gated_mlp_ref, cats_keep, mono_gated_mlp, mono_gated_mlp_ref,
                        mono_keep)

__all__ = [
    "available", "count_keep",
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
