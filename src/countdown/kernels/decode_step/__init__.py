"""The dense decode step's kernels (one token a row, a fixed launch configuration each, opaque to Inductor):

    reference.py        the PyTorch references (no Triton)
    attention.py        one query token's attention over a static KV cache, split along the keys
    rope_attention.py   the rotary embedding, the KV-cache write and that attention in two launches
    linear.py           the fixed GEMV (a projection, an indicator, a predictor's factor), optionally with the
                        RMSNorm before it folded in
    rmsnorm.py          transformers' RMSNorm and the residual adds (decode_add, with fp32 partials, with the norm)

The ops they register (``torch.ops.countdown.decode_*``) and their callers: countdown.decode (attention.py and
hf_attention.py register the two attention ops). Programmatic dependent launch chains them: jit_helpers.py.
"""

from .reference import decode_linear_ref, rms_norm_ref

__all__ = ["decode_linear_ref", "rms_norm_ref"]
