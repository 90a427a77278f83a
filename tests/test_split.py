"""kernels/_split.py: one token's sparse phase as a coefficient list, then the down projection by columns.

Against float64: y must be the sum over exactly the kept rows of s_r W_down^T[r] with s_r rounded to the
model's dtype, for every mode, threshold kind, odd shapes (chunks straddling d_inter, columns straddling
d_model), several chunks per program (the interpreter runs 3 programs), nothing kept and everything kept.
Runs under Triton's interpreter on CPU; on a GPU at the same shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _common, _onepass, _split  # noqa: E402
from test_balanced import _weights  # noqa: E402  (one token's random MLP)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)
    torch.manual_seed(0)


def _expected(x, wg, wu, wdt, ind, keep, act, mode):
    """float64 y: s rounded to x's dtype (as the kernels promise), times W_down^T rows, over kept rows."""
    x64, g64, u64 = x[0].double(), wg.double(), wu.double()
    g = ind.double() if mode == "abs_act" else g64 @ x64
    u = ind.double() if mode == "abs" else u64 @ x64
    a = torch.nn.functional.silu(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    s = (u * a).to(x.dtype).double() * keep.double()
    return s @ wdt.double()


CASES = [  # (mode, dtype, act, k, d_model, d_inter, config)
    ("abs", torch.bfloat16, "silu", 0.9, 67, 131, {}),
    ("abs", torch.float32, "gelu_tanh", 0.5, 64, 200, dict(CHUNK=16, BLOCK_M=2, BLOCK_C=32, BN=16, BT=16)),
    ("abs_act", torch.float16, "silu", 0.7, 67, 131, dict(CHUNK=32, BLOCK_M=1, BN=64, BT=8, STAGES=2)),
    ("gt", torch.bfloat16, "silu", 0.8, 67, 131, dict(CHUNK=16, BLOCK_C=16, C_STAGES=1, D_STAGES=1)),
    ("gt", torch.float32, "silu", 0.3, 33, 97, dict(CHUNK=8, BLOCK_M=8, BN=8, BT=32)),
    ("gt", torch.float16, "gelu_tanh", 0.0, 40, 50, dict(CHUNK=8, BT=16)),  # every row kept
    ("abs", torch.float32, "silu", 1.0, 40, 50, {}),                       # no row kept: y = 0, written
]


@pytest.mark.parametrize("mode,dtype,act,k,d_model,d_inter,config", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-k{c[3]}-{c[5]}-{'cfg' if c[6] else 'default'}" for c in CASES])
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar-thr", "per-row-thr"])
def test_split_is_the_sum_over_the_kept_rows(mode, dtype, act, k, d_model, d_inter, config, per_row):
    x, wg, wu, wdt = _weights(d_model, d_inter, dtype)
    if mode == "abs":
        ind = (x @ wu.t())[0]
        values = ind.float().abs()
    elif mode == "abs_act":
        ind = (x @ wg.t())[0]
        values = _common.act_torch(ind.float(), act).abs()
    else:
        ind = torch.randn(d_inter, device=DEVICE).to(dtype)
        values = ind.float()
    if per_row:  # every row its own threshold: a random fraction 1 - k above, the rest below
        above = torch.rand(d_inter, device=DEVICE) >= k
        thr = torch.where(above, values - 0.5 * values.abs() - 0.05, values + 0.5 * values.abs() + 0.05)
        keep, thr_t, thr_f = above, thr.float(), 0.0
    else:
        thr_f = float(values.max()) + 1.0 if k >= 1 else (float(values.min()) - 1.0 if k <= 0
                                                          else float(torch.quantile(values.double(), k)))
        keep, thr_t = values > thr_f, None
    y = _split.split_mlp(x, ind[None, :], wg, wu, wdt, thr_t, thr_f, mode, act,
                         gate=mode != "abs_act", up=mode != "abs", config=config)
    assert y.shape == (1, d_model) and y.dtype == dtype
    assert not torch.isnan(y).any(), "a column was not written"
    want = _expected(x, wg, wu, wdt, ind, keep, act, mode)
    # the output is rounded to the model's dtype once: one unit in its last place of the largest entry
    scale = max(1.0, want.abs().max().item())
    assert (y[0].double() - want).abs().max().item() <= TOL[dtype] * scale
    if 0 < k < 1 and not per_row:
        assert 0 < int(keep.sum()) < d_inter
    again = _split.split_mlp(x, ind[None, :], wg, wu, wdt, thr_t, thr_f, mode, act,
                             gate=mode != "abs_act", up=mode != "abs", config=config)
    assert torch.equal(y, again), "two calls on the same input differ: the sum is not in a fixed order"


def test_split_counts_kept_rows_across_chunks_and_programs():
    """A hand-made keep pattern: rows kept only in the first and the last chunk and one in the middle,
    so the coefficient list's places (counted before each chunk) decide which W_down^T rows are summed."""
    d_model, d_inter = 24, 70
    x, wg, wu, wdt = _weights(d_model, d_inter, torch.float32)
    ind = torch.zeros(d_inter, device=DEVICE)
    kept = [0, 3, 35, 64, 69]
    ind[kept] = torch.tensor([2.0, -3.0, 1.5, 4.0, -2.5], device=DEVICE)
    y = _split.split_mlp(x, ind[None, :], wg, wu, wdt, None, 1.0, "abs", "silu", True, False,
                         config=dict(CHUNK=8, BLOCK_C=16, BT=2, BN=8))
    g = wg.double() @ x[0].double()
    want = sum(ind[r].double() * torch.nn.functional.silu(g[r]) * wdt[r].double() for r in kept)
    assert torch.allclose(y[0].double(), want, atol=1e-5, rtol=1e-5)


def test_split_is_the_one_token_route_when_chosen(monkeypatch):
    """With SPARSE_KERNEL "split" the one-token mono and dual ops run this file's kernels and match float64."""
    from test_kernels import _check, _threshold  # noqa: E402  (the shared float64 rule)

    monkeypatch.setattr(_onepass, "ONEPASS", True)
    monkeypatch.setattr(_onepass, "ONEPASS_OFF_CUDA", True)
    monkeypatch.setattr(_onepass, "SPARSE_KERNEL", "split")
    monkeypatch.setattr(_onepass, "CONFIGS", {m: {**c, "IND": "torch"} for m, c in _onepass.CONFIGS.items()})
    calls = []
    real = _split.split_mlp
    monkeypatch.setattr(_split, "split_mlp", lambda *a, **kw: calls.append(a[7]) or real(*a, **kw))
    x, wg, wu, wdt = _weights(67, 131, torch.bfloat16)
    values = (x @ wu.t()).float().abs()[0]
    thr = _threshold(values, 0.8, gap=0.05)
    out = K.mono_gated_mlp(x, wg, wu, wdt, thr, "silu")
    keep = (values > thr)[None, :]
    _check(out, K.mono_gated_mlp_ref(x, wg, wu, wdt, thr, "silu"),
           K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, "silu"))
    pa = (torch.randn(67, 16, device=DEVICE) / 67**0.5).to(torch.bfloat16)
    pb = (torch.randn(131, 16, device=DEVICE) / 4).to(torch.bfloat16).t()
    scores = K.dual_scores(x, pa, pb).float()[0]
    cut = _threshold(scores, 0.7, gap=0.05)
    out = K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, cut, "silu")
    _check(out, K.dual_gated_mlp_ref(x, wg, wu, wdt, pa, pb, cut, "silu"),
           K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), (scores > cut)[None, :], "silu"))
    assert calls == ["abs", "gt"]


def test_split_names_bad_input():
    x, wg, wu, wdt = _weights(16, 40, torch.float32)
    with pytest.raises(ValueError, match="one token"):
        _split.split_mlp(torch.cat([x, x]), torch.zeros(1, 40), wg, wu, wdt, None, 0.5, "abs", "silu", True, False)
    with pytest.raises(ValueError, match="per-row threshold"):
        _split.split_mlp(x, torch.zeros(1, 40), wg, wu, wdt, torch.zeros(39), 0.0, "gt", "silu", True, True)
    with pytest.raises(ValueError, match="powers of two"):
        _split.split_mlp(x, torch.zeros(1, 40), wg, wu, wdt, None, 0.5, "abs", "silu", True, False,
                         config=dict(BN=24))
    with pytest.raises(ValueError, match="indicator must be"):
        _split.split_mlp(x, torch.zeros(1, 39), wg, wu, wdt, None, 0.5, "abs", "silu", True, False)
