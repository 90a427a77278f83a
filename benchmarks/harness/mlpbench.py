"""The Gated-MLP kernel-timing harness: random problems at real shapes, CUDA-graph timing, kernel tables.

Shared by ``benchmarks/mlp_kernels.py`` (the kernel table, :mod:`harness.kerneltable`),
``benchmarks/few.py`` (2-8 tokens) and ``benchmarks/shadow.py`` (the shadow indicator):

* :class:`Problem`: NSETS weight sets and NSLOTS inputs of one shape and batch (more than 1 GB per shape,
  far past L2), with the indicators (u, act(g), a rank-``rank`` predictor's scores) and per-k thresholds;
* :func:`safe_time`: ``time_graph`` (the median over CUDA-graph replays of NSLOTS back-to-back calls, weights
  rotating with the slot), NaN and a log line when a variant fails to compile or run;
* :func:`dense_chain` (the cuBLAS baseline), :func:`gap_threshold` (a cut between two distinct values, so an
  ulp of difference in an activation cannot flip a row tied with the cut);
* :func:`patched`: a launch table's entries changed for a block (``countdown.kernels.overrides``);
  ``GLU_SWEEP`` / ``DOWN_SWEEP``: the candidate launch configurations ``--sweep`` compares (the compiled kernel
  of each launch, its registers and spills: :mod:`harness.launches`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import countdown.kernels as K
from countdown.kernels import common as _common

from .timing import time_graph

SHAPES = {  # name: (d_model, d_inter, activation)
    "Llama-3.1-8B": (4096, 14336, "silu"),
    "Qwen2.5-14B": (5120, 13824, "silu"),
    "gemma-2-9b": (3584, 14336, "gelu_tanh"),
    "phi-4": (5120, 17920, "silu"),
    "tiny": (67, 131, "silu"),  # CPU smoke test of the scripts (TRITON_INTERPRET=1), never by default
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
MAIN = "Llama-3.1-8B"
NSETS, NSLOTS = 4, 8  # weight sets, inputs per graph (slot i uses weight set i % NSETS)
DTYPE = torch.bfloat16
E = 2  # bytes per bf16 element

# Candidate launch configurations of sparse_mlp/chain.py / down.py (launch tables "chain_gate_up" / "chain_down")
# compared by benchmarks/mlp_kernels.py --sweep (small on purpose: each costs a compile).
# BLOCK_K = 0: whole rows in one step. Batch 1 uses the FMA path, batch > 1 the tensor-core path.
GLU_SWEEP = {
    1: [
        dict(CHUNK=16, BLOCK_M=4, BLOCK_K=0, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=16, BLOCK_M=4, BLOCK_K=0, USE_DOT=False, num_warps=8, num_stages=1),
        dict(CHUNK=32, BLOCK_M=8, BLOCK_K=0, USE_DOT=False, num_warps=8, num_stages=1),
        dict(CHUNK=8, BLOCK_M=2, BLOCK_K=0, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=32, BLOCK_M=4, BLOCK_K=0, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=16, BLOCK_M=4, BLOCK_K=1024, USE_DOT=False, num_warps=4, num_stages=1),
    ],
    8: [
        dict(CHUNK=16, BLOCK_M=16, BLOCK_K=512, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=32, BLOCK_M=16, BLOCK_K=512, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=16, BLOCK_M=16, BLOCK_K=1024, USE_DOT=True, num_warps=8, num_stages=2),
        dict(CHUNK=64, BLOCK_M=16, BLOCK_K=256, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=32, BLOCK_M=32, BLOCK_K=256, USE_DOT=True, num_warps=4, num_stages=4),
    ],
}
DOWN_SWEEP = {
    1: [
        dict(CHUNK=128, BLOCK_M=16, BLOCK_N=512, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=64, BLOCK_M=8, BLOCK_N=1024, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=64, BLOCK_M=8, BLOCK_N=512, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=32, BLOCK_M=4, BLOCK_N=1024, USE_DOT=False, num_warps=4, num_stages=1),
        dict(CHUNK=128, BLOCK_M=16, BLOCK_N=1024, USE_DOT=False, num_warps=8, num_stages=1),
        dict(CHUNK=256, BLOCK_M=32, BLOCK_N=512, USE_DOT=False, num_warps=8, num_stages=1),
    ],
    8: [
        dict(CHUNK=256, BLOCK_M=16, BLOCK_N=256, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=32, BLOCK_M=16, BLOCK_N=256, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=64, BLOCK_M=32, BLOCK_N=256, USE_DOT=True, num_warps=4, num_stages=3),
        dict(CHUNK=32, BLOCK_M=16, BLOCK_N=512, USE_DOT=True, num_warps=8, num_stages=3),
        dict(CHUNK=64, BLOCK_M=16, BLOCK_N=128, USE_DOT=True, num_warps=4, num_stages=3),
    ],
}


def patched(op: str, **kv):
    """A context in which every bucket of launch table ``op`` (countdown.kernels.config.LAUNCH) has ``kv``."""
    return K.overrides(launch={op: kv})


def log(*a):
    print(*a, flush=True)

def safe_time(label, calls) -> float:
    """time_graph, or NaN (logged) when the variant fails to compile or run."""
    try:
        return time_graph(calls)
    except Exception as e:  # noqa: BLE001
        log(f"FAILED {label}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        return float("nan")


class Problem:
    """NSETS weight sets and NSLOTS inputs of one shape and batch, with per-k thresholds."""

    def __init__(self, d_model, d_inter, act, batch, rank, seed=0):
        torch.manual_seed(seed)
        self.d_model, self.d_inter, self.act, self.batch, self.rank = d_model, d_inter, act, batch, rank
        dev = DEV
        self.sets = []
        for _ in range(NSETS):
            wg = (torch.randn(d_inter, d_model, device=dev) * d_model**-0.5).to(DTYPE)
            wu = (torch.randn(d_inter, d_model, device=dev) * d_model**-0.5).to(DTYPE)
            wdt = (torch.randn(d_inter, d_model, device=dev) * d_inter**-0.5).to(DTYPE)
            wd = wdt.t().contiguous()  # nn.Linear layout for the dense baseline
            pa = (torch.randn(d_model, rank, device=dev) * d_model**-0.5).to(DTYPE)
            pbt = (torch.randn(d_inter, rank, device=dev) * rank**-0.5).to(DTYPE)  # B^T, rows contiguous
            self.sets.append(dict(wg=wg, wu=wu, wdt=wdt, wd=wd, pa=pa, pb=pbt.t().contiguous(), pbt=pbt))
        self.xs = [torch.randn(batch, d_model, device=dev).to(DTYPE) for _ in range(NSLOTS)]
        self.u, self.h, self.score = [], [], []
        for i, x in enumerate(self.xs):
            w = self.sets[i % NSETS]
            self.u.append(x @ w["wu"].t())
            g = x @ w["wg"].t()
            self.h.append(_common.act_torch(g.float(), act))
            self.score.append(K.dual_scores(x, w["pa"], w["pb"]))

    def w(self, i):
        return self.sets[i % NSETS]

    def thresholds(self, k):
        q = lambda ts: torch.quantile(torch.cat([t.float().abs().flatten() for t in ts]), k).item()
        cut = torch.quantile(torch.cat([t.float().flatten() for t in self.score]), k).item()
        return dict(mono=q(self.u), cats=q(self.h), dual=cut)

    def masks(self, k):
        t = self.thresholds(k)
        return dict(
            mono=[u.float().abs() > t["mono"] for u in self.u],
            cats=[h.abs() > t["cats"] for h in self.h],
            dual=[s.float() > t["dual"] for s in self.score],
        ), t


def dense_chain(x, wg, wu, wd, act):
    return F.linear(_common.act_torch(F.linear(x, wg), act) * F.linear(x, wu), wd)


def gap_threshold(values: torch.Tensor, k: float) -> float:
    """The midpoint between the two distinct values around the k-quantile."""
    v = torch.unique(values.double().flatten())
    i = min(max(int(k * v.numel()), 1), v.numel() - 1)
    return ((v[i - 1] + v[i]) / 2).item()


