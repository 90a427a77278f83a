"""The sparse Gated-MLP: rows of d_inter skipped where a keep rule says so, only kept rows of the weights read.

    reference.py     the PyTorch references and keep rules (no Triton)
    ops.py           the user functions (mono, cats, dual, masked, hybrid, the down projection, a folded layer's
                     MLP half), each asking route.py which kernel runs (no Triton)
    one_token.py     one token's whole MLP in one persistent launch (and with the RMSNorm inside: the block)
    few_tokens.py    2-8 tokens in one launch (the union of their kept rows)
    chain.py         more tokens, and the masked op: the gate / up kernel of kept rows, then down.py
    down.py          the masked down projection
    select.py        a kernel that scores its own rows (4-bit shadows, the hybrid predictor), keeps those over a
                     cut and computes them
    partial_sums.py  the sum of the kernels' fp32 partials (optionally with the residual add)

Each Triton file holds, in this order, its @triton.jit kernels, its launcher and its ops' registration
(``torch.ops.countdown.*``); the ``@triton.jit`` helpers shared with other families are jit_helpers.py.
"""

from .ops import (block_input, cats_gated_mlp, dual_block, dual_gated_mlp, hybrid_gated_mlp, masked_gated_mlp,
                  mono_gated_mlp, sparse_down_proj, threshold_block)
from .reference import (block_ref, cats_gated_mlp_ref, cats_keep, dual_gated_mlp_ref, dual_keep, dual_scores,
                        gated_mlp_masked_ref, hybrid_gated_mlp_ref, hybrid_keep, masked_gated_mlp_ref,
                        mono_gated_mlp_ref, mono_keep, sparse_down_proj_ref)

__all__ = ["block_input", "cats_gated_mlp", "dual_block", "dual_gated_mlp", "hybrid_gated_mlp", "masked_gated_mlp",
           "mono_gated_mlp", "sparse_down_proj", "threshold_block", "block_ref", "cats_gated_mlp_ref", "cats_keep",
           "dual_gated_mlp_ref", "dual_keep", "dual_scores", "gated_mlp_masked_ref", "hybrid_gated_mlp_ref",
           "hybrid_keep", "masked_gated_mlp_ref", "mono_gated_mlp_ref", "mono_keep", "sparse_down_proj_ref"]
