"""The compiled decode step: static-cache generation, the fused attention, routed linears, folded layers.

``generate.py`` is the entry point (``countdown.generate``); ``decoder.py`` its per-shape state; ``prepared.py`` the
step ``generate`` prepares on a model (:class:`~countdown.decode.prepared.PreparedStep`: what it swaps, what it is
keyed on, how it is undone);
``linears.py`` routes projections to the fixed GEMV (``fastest_step``); ``attention.py`` fuses the attention
block; ``layer.py`` folds a decoder layer's norms and adds; ``hf_attention.py`` registers the decode-attention
kernel with transformers; ``cache.py`` names the KV cache across transformers versions.
"""
