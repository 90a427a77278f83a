"""One token's sparse Gated-MLP for the kernel tests: each method's indicator values and its kernel output next
to its plain PyTorch output (tests/test_kernels.py's test_onepass, tests/test_onepass_tma.py)."""

import torch

import countdown.kernels as K
from countdown.kernels import _common


def indicator_values(op: str, x, wg, wu, act: str, pa=None, pb=None) -> torch.Tensor:
    """The values each method thresholds, fp32 [d_inter]: |u| (mono), |act(g)| (cats), the predictor's scores (dual)."""
    if op == "dual":
        return K.dual_scores(x, pa, pb).float()[0]
    if op == "mono":
        return (x @ wu.t()).float().abs()[0]
    return _common.act_torch((x @ wg.t()).float(), act).abs()[0]


def outputs(op: str, x, wg, wu, wdt, thr, act: str, pa=None, pb=None):
    """(the kernel's output, PyTorch's output at the input precision) of the method's sparse MLP."""
    if op == "mono":
        return tuple(f(x, wg, wu, wdt, thr, act) for f in (K.mono_gated_mlp, K.mono_gated_mlp_ref))
    if op == "cats":
        return tuple(f(x, wg, wu, wdt, thr, act) for f in (K.cats_gated_mlp, K.cats_gated_mlp_ref))
    return tuple(f(x, wg, wu, wdt, pa, pb, thr, act) for f in (K.dual_gated_mlp, K.dual_gated_mlp_ref))
