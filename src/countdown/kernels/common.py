"""What every kernel family shares in Python: availability, activations in PyTorch, thresholds, counters, outputs.

Nothing here imports Triton, so ``import countdown.kernels`` works without it (a base install: every op runs its
PyTorch reference); the Triton modules are imported where a route takes them. The shared ``@triton.jit`` helpers
are ``jit_helpers.py``; the launch tables, PDL and the overrides context ``config.py``; which kernel runs
``route.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from .config import active, interpreting  # noqa: F401  (interpreting: the kernels' import of it)

ACTIVATIONS = ("silu", "gelu_tanh")
GELU_TANH_C = math.sqrt(2.0 / math.pi)  # gelu_tanh(g) = g * sigmoid(2 c (g + 0.044715 g^3))


def new_output(shape, dtype, device) -> torch.Tensor:
    """An uninitialised output buffer; filled with NaN (integers: -1) first under ``overrides(poison_outputs=True)``,
    which proves that a kernel writes every element it must."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if active().poison_outputs:
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def act_code(activation: str) -> int:
    """0 = SiLU, 1 = GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return ACTIVATIONS.index(activation)


def act_torch(g: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation in plain PyTorch at g's own precision (what a dense model computes)."""
    if act_code(activation) == 0:
        return torch.nn.functional.silu(g)
    return torch.nn.functional.gelu(g, approximate="tanh")


def gap_cut(values: torch.Tensor, k: float, gap: float = 3e-2) -> float:
    """A cut near the k-quantile of ``values`` in a gap between neighbours at least ``gap`` (relative)
    wide, so that rounding differences between a kernel and PyTorch cannot flip an entry (used by the
    kernel tests and benchmarks to compare two implementations under the same mask)."""
    v = torch.unique(values.double().flatten().cpu())
    i = min(max(int(k * v.numel()), 1), v.numel() - 1)
    for j in sorted(range(1, v.numel()), key=lambda j: abs(j - i)):
        lo, hi = v[j - 1].item(), v[j].item()
        if hi - lo > gap * max(abs(hi), 1e-6):
            return (lo + hi) / 2
    raise AssertionError(f"no gap of relative width {gap} between the values near their {k}-quantile")


_HAS_TRITON = importlib.util.find_spec("triton") is not None


def has_triton() -> bool:
    """Whether Triton is installed (``overrides(triton=False)``: as if it were not)."""
    return _HAS_TRITON and active().triton


def available(t: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernels can run on tensor ``t`` (CUDA, or CPU under TRITON_INTERPRET=1).

    With ``t=None`` it says whether they can run at all here. The public ops fall back to their
    PyTorch ``*_ref`` when this is False, so callers need not check it for correctness, only for speed.
    """
    if not has_triton():
        return False
    if t is None:
        return torch.cuda.is_available() or interpreting()
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and interpreting()


def split_threshold(threshold) -> tuple[torch.Tensor | None, float]:
    """A threshold given as a Python number, a one-value tensor or a per-row vector ``[d_inter]``
    -> (tensor or None, float).

    A tensor stays on the device and is read inside the kernel (no ``.item()``, no host sync); a
    vector gives row ``i`` the threshold ``threshold[i]``."""
    if isinstance(threshold, torch.Tensor):
        if threshold.numel() == 1:
            return threshold.reshape(()), 0.0
        if threshold.dim() != 1:
            raise ValueError(f"a threshold tensor holds one value or one per row ([d_inter]), "
                             f"got shape {tuple(threshold.shape)}")
        return threshold.float().contiguous(), 0.0
    return None, float(threshold)


def threshold_value(thr_t: torch.Tensor | None, thr_f: float, like: torch.Tensor):
    """The threshold as something comparable with a float32 tensor on ``like``'s device."""
    if thr_t is None:
        return thr_f
    return thr_t.to(device=like.device, dtype=torch.float32)


def counters(count, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A Sparsity-Real ``count`` = (kept [1] float64, rows one int64 value) on ``device`` (a patched layer's
    kept_total and rows_total, see jit_helpers.add_count) as the ops' two arguments, or (None, None) for no count."""
    if count is None:
        return None, None
    kept, rows = count
    if kept.dtype != torch.float64 or kept.numel() != 1 or rows.dtype != torch.int64 or rows.numel() != 1 \
            or kept.device != torch.device(device) or rows.device != torch.device(device):
        raise ValueError(f"count must be (kept: one float64, rows: one int64) on {device}, got "
                         f"({kept.dtype} {tuple(kept.shape)} {kept.device}, {rows.dtype} {tuple(rows.shape)} "
                         f"{rows.device})")
    return kept, rows


@functools.lru_cache(maxsize=None)
def _no_count(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(0, dtype=torch.float64, device=device), torch.zeros(0, dtype=torch.int64, device=device)


def op_counters(count, device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`counters` as a custom op's two arguments: empty tensors for no count, never None. (A None equal to
    the schema's default is dropped from the arguments the dispatcher hands back, and torch 2.11's
    ADInplaceOrView kernel then indexes a mutated argument past their end.)"""
    kept, rows = counters(count, device)
    return _no_count(torch.device(device)) if kept is None else (kept, rows)


def op_count(kept: torch.Tensor | None, rows: torch.Tensor | None):
    """A custom op's two Sparsity-Real arguments (see :func:`op_counters`) back as the ``count`` its kernels take."""
    return None if kept is None or kept.numel() == 0 else (kept, rows)


def count_keep(count, keep: torch.Tensor) -> None:
    """Add a keep mask ``[tokens, d_inter]`` computed in PyTorch to ``count`` (where a route decides its rows
    outside the kernels: the reference paths), as the kernels add theirs."""
    if count is not None:
        count[0].add_(keep.sum(dtype=torch.float64))
        count[1].add_(keep.numel())


def plus(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + y in residual's shape (the public ops' ``residual`` where they fall back to PyTorch), or y."""
    return y if residual is None else residual + y.reshape(residual.shape)


def check_mlp_args(x, w_gate, w_up, w_down_t):
    d_model = x.shape[-1]
    if w_up.dim() != 2 or w_up.shape[1] != d_model:
        raise ValueError(f"w_up must be [d_inter, d_model={d_model}], got {tuple(w_up.shape)}")
    d_inter = w_up.shape[0]
    for name, w in (("w_gate", w_gate), ("w_down_t", w_down_t)):
        if tuple(w.shape) != (d_inter, d_model):
            raise ValueError(f"{name} must be [d_inter={d_inter}, d_model={d_model}] "
                             f"(w_down_t is W_down transposed), got {tuple(w.shape)}")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name} dtype {w.dtype} differs from x dtype {x.dtype}")
    return d_model, d_inter
