"""What every patched Gated-MLP shares, whatever one keep decision skips.

:func:`countdown.sparsify` hangs one :class:`PatchedMLP` on each Gated-MLP module and points the
module's ``forward`` at it. This base holds the layer's view, the shared state, its selector and the
Sparsity-Real counters, and routes each forward: dense where the state says so (the prompt with
``scope="decode"``), the Triton kernels where they apply, else the ``gather`` or ``masked`` path.
The subclasses say what is skipped: :class:`countdown.patch.sparsify.SparseGatedMLP` rows of d_inter,
:class:`countdown.sparse_methods.teal.InputSparseGatedMLP` entries of the projections' inputs (TEAL).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..kernels.route import FEW_TOKENS as KERNEL_MAX_TOKENS  # the kernels are GEMV-shaped: batch 1 to 8
from ..model.gated_mlp import GatedMLP
from .state import SparsityState


class PatchedMLP(nn.Module):
    """Replaces the forward of one Gated-MLP module while it is patched.

    Subclasses implement ``_masked``, ``_gather``, ``_kernel``, ``_selector_has_kernel`` and
    ``_kernel_layout``. Sparsity-Real is ``1 - kept_total / rows_total``: a subclass adds, per
    sparse token, its kept share in ``kept_total`` and the token's whole in ``rows_total``; on the kernel
    route it hands both to the kernels (:meth:`counters`), which add them on the device (kernels/jit_helpers.py).
    """

    def __init__(self, mlp: GatedMLP, selector: nn.Module | None, state: SparsityState, index: int):
        super().__init__()
        self.selector = selector
        self.index = index
        # Plain attributes (not submodules): the GatedMLP view refers back to the module we hang on.
        object.__setattr__(self, "mlp", mlp)
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "original_forward", None)
        # Device-side counters updated in place: no host sync per layer, and nothing for
        # torch.compile to guard on (a Python number here would recompile every token).
        # kept_total is [1], not 0-dim: torch.compile (AOT autograd) drops in-place updates of a 0-dim float64
        # buffer (torch 2.13 CPU), so a compiled decode would report no row kept.
        device = mlp.w_down.device
        self.register_buffer("kept_total", torch.zeros(1, dtype=torch.float64, device=device), persistent=False)
        self.register_buffer("rows_total", torch.zeros((), dtype=torch.int64, device=device), persistent=False)

    def reset_stats(self) -> None:
        self.kept_total.zero_()
        self.rows_total.zero_()

    def counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept_total, rows_total): the ``count`` the kernel route's ops add this layer's kept rows to."""
        return self.kept_total, self.rows_total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.selector is None:
            return self.original_forward(x)
        sparse = self.state.sparse_positions(x)
        if sparse is False:
            return self.original_forward(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        token_sparse = None if sparse is True else sparse.reshape(-1)
        path = self.state.path
        if path in ("auto", "kernel") and token_sparse is None and self._kernel_ready(x2, path):
            return self.mlp.finish(self._kernel_call(x2)).reshape(shape)
        if path == "gather" or (path == "auto" and not x2.is_cuda and x2.shape[0] <= KERNEL_MAX_TOKENS):
            # CPU decode steps: reading only the kept rows is the faster CPU path (results/decode_cpu.md)
            y = self._gather(x2, token_sparse)
        else:
            y = self._masked(x2, token_sparse)
        y = self.mlp.finish(y)  # tensor parallel: the ranks' partial outputs summed (once)
        return y.reshape(*shape[:-1], y.shape[-1])

    def _kernel_call(self, x2: torch.Tensor) -> torch.Tensor:
        """The kernel route. Called eagerly on CUDA (transformers' own generate), it is replayed from a CUDA
        graph captured on this layer's first call of the shape: at batch 1 launching the route's few kernels
        from Python costs more than running them, and one replay is cheaper than the dense MLP's launches
        (``KernelOptions.eager_graphs``, the sparsified model's ``kernel_options``). Under torch.compile or inside a
        capture the kernels are called directly (the caller graphs them)."""
        if not (self.state.kernel_options.eager_graphs and x2.is_cuda) or torch.compiler.is_compiling() \
                or torch.cuda.is_current_stream_capturing():
            return self._kernel(x2)
        # the graph reads the selector's buffers and the MLP's weights and adds to the counters where they were at
        # the capture: a weight moved since (int4.stack makes the 4-bit step's parts views of one tensor) captures
        # again (the old graph would read freed memory: NaN, found on the GPU)
        tensors = (*self.selector.buffers(), *self.counters(), *self._projection_tensors())
        key = (tuple(x2.shape), x2.dtype, tuple(b.data_ptr() for b in tensors))
        graphs = self.__dict__.setdefault("_graphs", {})
        entry = graphs.get(key[:2])
        if entry is None or entry[0] != key:
            entry = (key, _capture(self._kernel, x2, self.state, self.counters()))
            graphs[key[:2]] = entry
        captured = entry[1]
        if captured is None:  # the route could not be captured: run it directly
            return self._kernel(x2)
        graph, x_in, y_out = captured
        x_in.copy_(x2)
        graph.replay()
        return y_out.clone()  # the next replay overwrites y_out

    def _projection_tensors(self) -> list[torch.Tensor]:
        """The weights (and biases, 4-bit buffers) of the MLP's own projections: their direct tensors only, read on
        every eager kernel call."""
        mlp = self.mlp
        parts = [getattr(mlp.module, n) for n in (mlp.gate, mlp.up, mlp.fused, mlp.down) if n]
        return [t for m in parts for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]

    def block_forward(self, h: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``h + module(RMSNorm(h))`` (weight ``norm_w``, ``eps``) where a kernel route computes the norm and
        the residual add with the MLP (a folded layer's batch-1 decode step: countdown.decode.layer.mlp_half,
        kernels.threshold_block / dual_block), else None: the caller runs the norm, this module and the add itself."""
        if self.selector is None or self.mlp.tp is not None or self.state.sparse_positions(h) is not True:
            return None
        path = self.state.path
        h2 = h.reshape(-1, h.shape[-1])
        if path not in ("auto", "kernel") or not self._kernel_ready(h2, path):
            return None
        out = self._block(h2, norm_w, eps)
        return None if out is None else out.reshape(h.shape)

    def _block(self, h2: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor | None:
        return None  # the subclasses whose selectors have a block route say so

    def _kernel_ready(self, x2: torch.Tensor, path: str) -> bool:
        """Kernels serve decode-sized batches of an SP-Prac selector on a bias-free SiLU/GELU MLP."""
        if not self._selector_has_kernel() or x2.shape[0] > KERNEL_MAX_TOKENS:
            return False
        if path == "auto" and not x2.is_cuda:
            return False
        mlp = self.mlp
        if mlp.act_name not in ("silu", "gelu_tanh") or any(
                b is not None for b in (mlp.b_gate, mlp.b_up, mlp.b_down)):
            return False
        return kernels.available(x2)

    def _selector_has_kernel(self) -> bool:
        raise NotImplementedError

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _masked(self, x2: torch.Tensor, token_sparse: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _gather(self, x2: torch.Tensor, token_sparse: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _kernel_layout(self, path: str) -> list[torch.Tensor]:
        """The weights the kernels read transposed, where ``path`` may take them here (else none)."""
        raise NotImplementedError

    def store_for_kernels(self, path: str, on: bool) -> None:
        """Lay the weights out as the kernels read them (``on``, at patch time) or, at unpatch time
        (``on=False``), give the ones this layer changed their original layout back, bit for bit."""
        if on:
            changed = [w for w in self._kernel_layout(path) if not _column_major(w)]
            for weight in changed:
                store_transposed(weight, True)
            object.__setattr__(self, "relaid", changed)
        else:
            for weight in getattr(self, "relaid", ()):
                store_transposed(weight, False)
            object.__setattr__(self, "relaid", [])


def _capture(fn, x: torch.Tensor, state: SparsityState, counters: tuple[torch.Tensor, ...]):
    """(graph, static input, static output) of ``fn`` on a copy of ``x``, or None if the route cannot be
    captured. The layers of one model share a memory pool (they replay in the order they were captured).
    ``counters`` (the layer's Sparsity-Real, which ``fn`` adds to) are given back their values after the
    warm-up runs: the token is counted once, by the replay (or the direct run) that follows."""
    x_in = x.clone()
    saved = [c.clone() for c in counters]
    try:
        stream = torch.cuda.Stream(device=x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):  # warm-up off the capture stream: Triton compiles, the allocator settles
            for _ in range(2):
                fn(x_in)
        torch.cuda.current_stream(x.device).wait_stream(stream)
        if state.graph_pool is None:
            state.graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=state.graph_pool):
            y_out = fn(x_in)
    except RuntimeError as err:  # an op that cannot be captured: say so once, keep the direct calls
        import warnings

        warnings.warn(f"countdown: the sparse MLP's kernel route could not be captured in a CUDA graph ({err}); "
                      "it runs launch by launch", stacklevel=3)
        return None
    finally:
        for counter, value in zip(counters, saved):
            counter.copy_(value)
    return graph, x_in, y_out


def _column_major(weight: torch.Tensor) -> bool:
    return weight.t().is_contiguous() and not weight.is_contiguous()


def store_transposed(weight: torch.Tensor, transposed: bool) -> None:
    """Lay a 2-D weight out column-major (its ``.t()`` contiguous, as the kernels read it) or back.

    The logical tensor, and so every dense computation, is unchanged, and no copy sits beside the
    original: the storage is replaced, which is what keeps an 8B model from growing by 3.8 GB.
    """
    if transposed and not _column_major(weight):
        weight.data = weight.data.t().contiguous().t()
    elif not transposed and not weight.is_contiguous():
        weight.data = weight.data.contiguous()
