"""One token's sparse Gated-MLP for the kernel tests: the one-launch kernel switched on for them, each method's
indicator values, a threshold in a gap between them, and the kernel's output next to its plain PyTorch output
(tests/test_kernels.py, tests/test_block.py, tests/test_block_norm.py)."""

import torch

import countdown.kernels as K
from countdown.kernels import common


def one_token_on(*more: str):
    """A context: the one-token kernel for one token on any device (the CUDA routes of ``more`` kernels too, e.g.
    "partial_sums", "residual_add", "linear"), its outputs poisoned with NaN first."""
    return K.overrides(poison_outputs=True, cuda_routes=("one_token", *more))


def gap_threshold(values: torch.Tensor, k: float, gap: float = 1e-4) -> float:
    """A threshold near the k-quantile of ``values`` that sits in a gap between distinct values, so
    that float32 rounding differences (Triton's vs PyTorch's activation) cannot flip a row."""
    v = torch.unique(values.double().flatten())  # sorted
    i = min(max(int(k * v.numel()), 1), v.numel() - 1)
    for j in sorted(range(1, v.numel()), key=lambda j: abs(j - i)):
        lo, hi = v[j - 1].item(), v[j].item()
        if hi - lo > gap * max(abs(hi), 1e-6):
            return (lo + hi) / 2
    return (v[i - 1].item() + v[i].item()) / 2


def indicator_values(op: str, x, wg, wu, act: str, pa=None, pb=None) -> torch.Tensor:
    """The values each method thresholds, fp32 [d_inter]: |u| (mono), |act(g)| (cats), the predictor's scores (dual)."""
    if op == "dual":
        return K.dual_scores(x, pa, pb).float()[0]
    if op == "mono":
        return (x @ wu.t()).float().abs()[0]
    return common.act_torch((x @ wg.t()).float(), act).abs()[0]


def outputs(op: str, x, wg, wu, wdt, thr, act: str, pa=None, pb=None):
    """(the kernel's output, PyTorch's output at the input precision) of the method's sparse MLP."""
    if op == "mono":
        return tuple(f(x, wg, wu, wdt, thr, act) for f in (K.mono_gated_mlp, K.mono_gated_mlp_ref))
    if op == "cats":
        return tuple(f(x, wg, wu, wdt, thr, act) for f in (K.cats_gated_mlp, K.cats_gated_mlp_ref))
    return tuple(f(x, wg, wu, wdt, pa, pb, thr, act) for f in (K.dual_gated_mlp, K.dual_gated_mlp_ref))
