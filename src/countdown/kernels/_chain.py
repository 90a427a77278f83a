"""The fused gate/up kernel followed by the masked down projection.

The GLU kernel clears the down projection's fp32 accumulator on its way, so the chain needs no memset:
GLU kernel, down kernel (fp32 atomics), cast to x's dtype.
"""

from __future__ import annotations

from ._down import DownPlan, sparse_down
from ._glu import sparse_glu


def gated_chain(x, w_gate, w_up, w_down_t, *, ind=None, dense=None, thr_t=None, thr_f=0.0,
                mode: str, activation: str, gate: bool, up: bool, per_token: bool = False):
    n_tok, d_model = x.shape
    plan = DownPlan(n_tok, w_down_t.shape[0], d_model, per_token)
    work = plan.workspace(x.device, zeroed=False) if plan.atomic else None
    s = sparse_glu(x, w_gate, w_up, ind, thr_t, thr_f, mode, activation, gate=gate, up=up,
                   per_token=per_token, dense=dense, zero=work)
    return sparse_down(s, None, w_down_t, per_token=per_token, plan=plan, workspace=work)
