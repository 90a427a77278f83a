"""The shadows: low-bit copies of W_gate and W_up that score rows for dual[shadow], and their GEMVs.

    format.py    the format (RTN quantization, packing) and the float32 references (no Triton)
    ops.py       the kernels' layout (``prepare_shadow``) and the user functions, ``shadow_scores`` and
                 ``shadow_dual_gated_mlp``, by route.py's table (no Triton)
    dequant.py   @triton.jit: the words dequantized to fp32 without conversions (sparse_mlp/select.py's phase 1)
    gemv.py      the one-token shadow GEMV with x in int8 (dp4a), its launcher and op (``countdown::shadow_gemv_i8``)

The sparse MLP on the rows the shadows keep runs on sparse_mlp's kernels (one_token.py, select.py, the chain).
"""

from .format import (BITS, dequantize, pack_bits, quantize_rtn, shadow_bytes, shadow_dual_gated_mlp_ref,
                     shadow_keep_ref, shadow_score, shadow_scores_ref, unpack_bits)
from .ops import gpu_layout, prepare_shadow, shadow_dual_gated_mlp, shadow_scores, unpack_prepared

__all__ = ["BITS", "dequantize", "pack_bits", "quantize_rtn", "shadow_bytes", "shadow_dual_gated_mlp_ref",
           "shadow_keep_ref", "shadow_score", "shadow_scores_ref", "unpack_bits", "gpu_layout", "prepare_shadow",
           "shadow_dual_gated_mlp", "shadow_scores", "unpack_prepared"]
