"""Sparsity-Real counted inside the sparse kernels: each adds what it kept to its caller's two counters.

A patched Gated-MLP (countdown.patched.PatchedMLP) counts Sparsity-Real = 1 - kept / rows in two device
tensors: ``kept`` ([1] float64) and ``rows`` (one int64 value). Per sparse token the row methods add the
rows they keep to ``kept`` and d_inter to ``rows``; teal adds its kept share of the MLP's weights,
``(2 n_x / d_model + n_s / d_inter) / 3``, to ``kept`` and 1 to ``rows`` (countdown.teal). The gather
and masked paths add a PyTorch mask's sum; the kernel route's ops take the pair as ``count=(kept, rows)``
and the kernel that decides the rows adds them itself, so the route costs no launch more and no host sync:

* every program adds the kept entries it decided (each token's own rows, never the batch's union), summed
  over all the blocks it walked, with one float64 atomic (integers: exact in any order);
* one program of the grid (``lead``) adds the rows of the whole call.

The ops declare both tensors mutated (``mutates_args``), so torch.compile keeps the updates, and a CUDA
graph replays the atomics with the kernel. Without a count the kernels compile without these lines.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_count(KEPT, ROWS, kept, rows, lead):
    """KEPT[0] += kept (as float64) in the calling program; ROWS[0] += rows (as int64) where ``lead``."""
    tl.atomic_add(KEPT, tl.cast(kept, tl.float64), sem="relaxed")
    if lead:
        tl.atomic_add(ROWS, tl.cast(rows, tl.int64), sem="relaxed")
