"""TEAL's Gated-MLP (input entries kept where |x| > tau_x, intermediate entries where |s| > tau_s):

    ops.py       the references, the keep rules, the Sparsity-Real share, the user function (no Triton)
    kernels.py   the @triton.jit kernels (gate/up over the kept channels, the finish, the down projection), their
                 launcher and the op (``torch.ops.countdown.teal_partials``)
"""

from .ops import (count_teal, kept_weight_fraction, teal_gated_mlp, teal_gated_mlp_ref, teal_keep_x,
                  teal_masked_ref)

__all__ = ["count_teal", "kept_weight_fraction", "teal_gated_mlp", "teal_gated_mlp_ref", "teal_keep_x",
           "teal_masked_ref"]
