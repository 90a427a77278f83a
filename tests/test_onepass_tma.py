"""The one-token sparse kernel's indicator streamed by Hopper's tensor-memory accelerator (kernels/_onepass.py
IND_TMA, kernels/_indicator.py ``_tma_indicator``) against float64, as tests/test_kernels.py checks the others:
|out - ref64| <= 2 |out_torch - ref64| + atol, outputs poisoned with NaN first, thresholds in wide gaps.

Shapes whose rows are a multiple of 16 bytes (TMA's rule): d_model 72 walked in K steps of 32 (the last one
partial: the accelerator reads zeros past the row), d_inter 131 (the last chunk partly past the matrix), chunks
whose row blocks run into the next chunk's rows (slots the kernel must mask). Without CUDA under the interpreter.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _onepass  # noqa: E402

from _onetoken import gap_threshold, indicator_values, onepass_on, outputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D_MODEL, D_INTER = 72, 131
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    onepass_on(monkeypatch)
    torch.manual_seed(0)


def _weights(dtype, d_model=D_MODEL):
    x = torch.randn(1, d_model, device=DEVICE).to(dtype)
    wg, wu = ((torch.randn(D_INTER, d_model, device=DEVICE) / d_model**0.5).to(dtype) for _ in range(2))
    wdt = (torch.randn(D_INTER, d_model, device=DEVICE) / D_INTER**0.5).to(dtype)
    return x, wg, wu, wdt


CASES = [  # (op, dtype, activation, config)
    ("mono", torch.bfloat16, "silu", dict(ROWS="auto", RB=8, ISTAGES=3)),  # 44 rows a program: blocks cross chunks
    ("mono", torch.float16, "gelu_tanh", dict(ROWS=None, CHUNK=16, RB=4, ISTAGES=2)),  # 9 chunks, the last partial
    ("cats", torch.bfloat16, "silu", dict(ROWS=None, CHUNK=32, RB=8, ISTAGES=2, BLOCK_M=2)),
    ("dual", torch.float32, "gelu_tanh", dict(ROWS="auto", RB=4, ISTAGES=2, STAGES=2)),  # fp32 rows of B^T
]


@pytest.mark.parametrize("op,dtype,act,config", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-{c[2]}" for c in CASES])
def test_tma_indicator_matches_float64(op, dtype, act, config, monkeypatch):
    """The MLP with its indicator read by TMA tiles matches float64, and the TMA route is the one taken."""
    cfg = dict(config, IND="kernel", IND_TMA=32, W_EARLY=True)
    monkeypatch.setattr(_onepass, "CONFIGS", {m: {**c, **cfg} for m, c in _onepass.CONFIGS.items()})
    taken = []
    real = _onepass._tma_descriptor
    monkeypatch.setattr(_onepass, "_tma_descriptor", lambda w, rb, bk: taken.append((rb, bk)) or real(w, rb, bk))
    x, wg, wu, wdt = _weights(dtype)
    pa = (torch.randn(D_MODEL, 16, device=DEVICE) / D_MODEL**0.5).to(dtype)
    pb = (torch.randn(D_INTER, 16, device=DEVICE) / 4).to(dtype).t()  # B^T stored contiguous
    values = indicator_values(op, x, wg, wu, act, pa, pb)
    thr = gap_threshold(values, 0.7, gap=0.05)
    keep = (values > thr)[None, :]
    assert 0 < int(keep.sum()) < D_INTER
    out, out_torch = outputs(op, x, wg, wu, wdt, thr, act, pa, pb)
    assert taken == [(config["RB"], 32)], f"the TMA route was not taken: {taken}"
    ref = K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, act)
    assert not torch.isnan(out).any(), "an output element was not written"
    err = (out.double() - ref).abs()
    bound = 2 * (out_torch.double() - ref).abs() + ATOL[dtype] * max(1.0, ref.abs().max().item())
    assert (err <= bound).all(), f"max err {err.max().item():.3e}"


def test_tma_block_rules():
    """IND_TMA falls back to the register route where TMA cannot address the rows (not on 16 bytes) or no RB is
    set, and names a bad tile width."""
    w = torch.zeros(8, 72, dtype=torch.bfloat16)
    assert _onepass._tma_block(dict(IND_TMA=64), w, 4) == 64
    assert _onepass._tma_block(dict(IND_TMA=64), w, 0) == 0  # no RB: the whole-row routes
    assert _onepass._tma_block(dict(IND_TMA=64), torch.zeros(8, 67, dtype=torch.bfloat16), 4) == 0  # 134-byte rows
    assert _onepass._tma_block(dict(IND_TMA=64), torch.zeros(8, 73)[:, 1:], 4) == 0  # base off 16 bytes
    assert _onepass._tma_block({}, w, 4) == 0
    for bad in (24, 8, 512):
        with pytest.raises(ValueError, match="IND_TMA"):
            _onepass._tma_block(dict(IND_TMA=bad), w, 4)
