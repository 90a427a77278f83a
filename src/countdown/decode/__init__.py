"""The compiled decode step: static-cache generation, the fused attention, routed linears, folded layers.

``generate.py`` is the entry point (``countdown.generate_fast``); ``decoder.py`` its per-shape state;
``linears.py`` routes projections to the fixed GEMV (``fastest_step``); ``attention.py`` fuses the attention
block; ``layer.py`` folds a decoder layer's norms and adds; ``hf_attention.py`` registers the decode-attention
kernel with transformers; ``cache.py`` names the KV cache across transformers versions.
"""
