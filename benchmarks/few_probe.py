"""Where the few-token kernel's time goes with nothing kept and at k = 0.9 (T = 4, Llama-3.1-8B MLP, bf16):
each phase alone (PHASES 1 = gate/up, 2 = down), pipelining depth, tile shapes. Timing experiment only.

    cd benchmarks && PYTHONPATH=../src:. python few_probe.py
"""
import torch

from countdown.kernels import _few
from kernels import Problem, log, safe_time  # noqa: E402

p = Problem(4096, 14336, "silu", 4, 512)
n = len(p.xs)
base = dict(ROWS="auto", TILE=64, BK=128, BN=256, STAGES=3, num_warps=8, PER_SM=1)
variants = [{}, dict(PHASES=1), dict(PHASES=2), dict(PHASES=0), dict(STAGES=1), dict(STAGES=2), dict(STAGES=4, BK=64),
            dict(BK=64, BN=128, STAGES=4, num_warps=4), dict(num_warps=4), dict(TILE=32), dict(TILE=16, num_warps=4)]
for k in (1.0, 0.9):
    thr = 1e30 if k >= 1 else p.thresholds(k)["dual"]
    for v in variants:
        cfg = {**base, **v}
        us = safe_time(str(v), [lambda i=i: _few.few_partials(p.xs[i], p.score[i], p.w(i)["wg"], p.w(i)["wu"], p.w(i)["wdt"],
                                                              None, thr, "gt", "silu", True, True, config=cfg)
                                for i in range(n)])
        kern = _few.LAST_KERNEL
        log(f"k={k} {str(v):60s} {us:8.2f} us  regs {getattr(kern, 'n_regs', None)} smem {getattr(kern.metadata, 'shared', None) if kern else None}")
