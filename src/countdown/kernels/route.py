"""Which kernel runs: one table for every public op, by kind, device and token count.

Each public op asks :func:`route` once (where the kernels cannot run here, no Triton or a CPU tensor without
``TRITON_INTERPRET=1``, the answer is "reference": the op's PyTorch reference) and runs what it names:

    one_token     sparse_mlp/one_token.py: a whole sparse Gated-MLP in one persistent launch
    few_tokens    sparse_mlp/few_tokens.py: the union of 2-8 tokens' kept rows in one launch
    chain         sparse_mlp/chain.py then sparse_mlp/down.py: gate/up of the kept rows, the masked down projection
    select        sparse_mlp/select.py: a kernel that scores its own rows (shadows, hybrid) and keeps those over a cut
    scores_chain  the shadows' scores (select.py), the cut in PyTorch, then the chain
    teal          teal/kernels.py
    down          sparse_mlp/down.py alone
    shadow_gemv   shadow/gemv.py: the shadows' one-token scores (x in int8, integer dot products)
    in_kernel     the one-token kernel computes its indicator itself (from x and the indicator's rows)
    linear        decode_step/linear.py: the fixed GEMV (an indicator, a predictor's factors, a decode projection)
    torch         PyTorch's own operation (a matmul, a sum, an add)
    partial_sums  sparse_mlp/partial_sums.py: the fp32 partials' sum (with the residual add where given)
    residual_add  decode_step/rmsnorm.py's decode_add
    None          the route does not serve (the caller runs the parts itself)

Devices: "cuda", and "interpreter" (the CPU under TRITON_INTERPRET=1, where the one-launch kernels are not taken:
their in-kernel indicators may differ from PyTorch's in the last bit at a threshold tie, and the tests pick them
explicitly with ``config.overrides(cuda_routes=...)``).
"""

from __future__ import annotations

import torch

from .common import available
from .config import active

FEW_TOKENS = 8  # the most tokens a sparse kernel route serves (a batched decode step): the second column below

#  kind                               1 token        2-8 tokens     more tokens
ROUTES: dict[tuple[str, str], tuple[str | None, str | None, str | None]] = {
    # the sparse Gated-MLP's public ops (sparse_mlp/ops.py, shadow/ops.py, teal/ops.py)
    ("mono", "cuda"):                 ("one_token",  "few_tokens", "chain"),
    ("mono", "interpreter"):          ("chain",      "chain",      "chain"),
    ("cats", "cuda"):                 ("one_token",  "few_tokens", "chain"),
    ("cats", "interpreter"):          ("chain",      "chain",      "chain"),
    ("dual", "cuda"):                 ("one_token",  "few_tokens", "chain"),         # a predictor's (x A) B
    ("dual", "interpreter"):          ("chain",      "chain",      "chain"),
    ("masked", "cuda"):               ("chain",      "chain",      "chain"),         # the keep mask given
    ("masked", "interpreter"):        ("chain",      "chain",      "chain"),
    ("shadow", "cuda"):               ("one_token",  "select",     "scores_chain"),  # dual[shadow]
    ("shadow", "interpreter"):        ("select",     "select",     "scores_chain"),
    ("hybrid", "cuda"):               ("select",     "select",     "reference"),     # dual[hybrid]
    ("hybrid", "interpreter"):        ("select",     "select",     "reference"),
    ("teal", "cuda"):                 ("teal",       "teal",       "teal"),
    ("teal", "interpreter"):          ("teal",       "teal",       "teal"),
    ("down", "cuda"):                 ("down",       "down",       "down"),          # sparse_down_proj
    ("down", "interpreter"):          ("down",       "down",       "down"),
    # a trained low-rank predictor (countdown.selectors.lowrank): its scores into the dual kernels, or its mask computed
    # in PyTorch and the masked kernels ("masked": benchmarks/decode.py --predictor-route compares them)
    ("lowrank", "cuda"):              ("dual",       "dual",       "dual"),
    ("lowrank", "interpreter"):       ("dual",       "dual",       "dual"),
    # a folded decode layer's MLP half with the norm (and the add) in the MLP's own launches, else None
    ("threshold_block", "cuda"):      ("one_token",  None,         None),            # mono: the norm in the kernel
    ("threshold_block", "interpreter"): (None,       None,         None),
    ("dual_block", "cuda"):           ("one_token",  None,         None),            # the norm in the predictor's GEMV
    ("dual_block", "interpreter"):    (None,         None,         None),
    # the indicator the one-token kernel reads (more tokens: computed in PyTorch, or by the chain's op itself)
    ("mono_indicator", "cuda"):       ("in_kernel",  None,         None),            # u streamed inside the kernel
    ("mono_indicator", "interpreter"): ("in_kernel", None,         None),
    ("cats_indicator", "cuda"):       ("linear",     None,         None),
    ("cats_indicator", "interpreter"): ("torch",     None,         None),
    ("predictor", "cuda"):            ("linear",     None,         None),            # x A, then (x A) B
    ("predictor", "interpreter"):     ("torch",      None,         None),
    ("shadow_scores", "cuda"):        ("shadow_gemv", "select",    "select"),        # where the words fit its layout
    ("shadow_scores", "interpreter"): ("shadow_gemv", "select",    "select"),
    # after the kernels that leave fp32 partial sums: their sum (eager calls; PyTorch's while torch.compile traces,
    # which fuses it into what follows) and the residual add of a folded layer
    ("partial_sums", "cuda"):         ("partial_sums", "partial_sums", "partial_sums"),
    ("partial_sums", "interpreter"):  ("torch",      "torch",      "torch"),
    ("residual_add", "cuda"):         ("residual_add", "residual_add", "residual_add"),
    ("residual_add", "interpreter"):  ("torch",      "torch",      "torch"),
    # the dense decode step's projections (countdown.decode.linears, the fused attention's QKV): its launch
    # configurations are tuned for one token; a routed step of several was slower than Inductor's GEMVs
    ("linear", "cuda"):               ("linear",     "torch",      "torch"),
    ("linear", "interpreter"):        ("linear",     "torch",      "torch"),
}


def tokens(x: torch.Tensor) -> int:
    """The rows of ``x [..., d]`` (0 for an empty tensor)."""
    return x.numel() // x.shape[-1] if x.numel() else 0


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the kernels compute in (float64: the references)


def route(kind: str, x: torch.Tensor, per_token: bool = False) -> str | None:
    """The kernel that runs ``kind`` for ``x [..., d]`` here (see the module docstring), "reference" where the
    kernels cannot run (no Triton here, or a dtype outside :data:`KERNEL_DTYPES`). ``per_token``: each token its own
    rows (the chain's option), so not the few-token kernel, which reads the batch's union. ``config.overrides`` may replace entries (``routes``), take the CUDA column on
    the CPU interpreter (``cuda_routes``) or switch a kernel off (``off``: its bucket's interpreter route)."""
    if not available(x) or x.dtype not in KERNEL_DTYPES:
        return "reference"
    n = tokens(x)
    bucket = 0 if n == 1 else 1 if 2 <= n <= FEW_TOKENS else 2
    ov = active()
    on_cuda = ov.routes.get((kind, "cuda"), ROUTES[(kind, "cuda")])[bucket]
    on_cpu = ov.routes.get((kind, "interpreter"), ROUTES[(kind, "interpreter")])[bucket]
    if x.is_cuda or ov.cuda_routes is True or (on_cuda is not None and on_cuda in ov.cuda_routes):
        choice = on_cuda
    else:
        choice = on_cpu
    if choice is not None and choice in ov.off:
        choice = on_cpu
    if per_token and choice == "few_tokens":
        choice = "chain"
    return choice


def decode_gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear layer's input ``x [..., K]`` takes decode_step/linear.py's GEMV (countdown.decode.linears,
    the fused attention's QKV, a folded layer): its route (one row, on a tensor the kernels run on) and no gradient
    wanted; every other call keeps ``F.linear``."""
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return not wants_grad and route("linear", x) == "linear"
