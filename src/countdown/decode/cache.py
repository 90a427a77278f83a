"""The KV cache's keyword in a transformers forward call, across the 5.24 rename.

transformers 5.24 renamed the ``past_key_values`` argument and output field to ``cache`` (the old names stay
accepted, with a FutureWarning, until 5.40). countdown's own decode loops pass the cache through
:func:`cache_kwargs` and read it back with :func:`output_cache`, so they run warning-free on both sides of
the rename; the patched forwards (fused_attention, fused_layer) accept either name from their callers.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

# Read once, at import: torch.compile traces cache_kwargs inside the decode step, and an import or a
# version parse there would break its graph.
RENAMED = Version(transformers.__version__).release >= (5, 24)


def renamed() -> bool:
    """Whether the installed transformers calls the KV cache ``cache`` (5.24 and later)."""
    return RENAMED


def cache_kwargs(cache) -> dict:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, as the installed transformers names it."""
    return {"cache": cache} if renamed() else {"past_key_values": cache}


def output_cache(out):
    """The KV cache a model call returned (``out.cache`` or ``out.past_key_values``)."""
    return out.cache if renamed() else out.past_key_values
