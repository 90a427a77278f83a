"""kernels/_balanced.py: one token's sparse phase with the kept rows split evenly over the programs.

Against float64: every program's partial sum must be the sum over exactly the kept rows of global rank
lo <= j < hi (lo = p n // PROGS), so the test checks the split itself, not only the total. Runs under
Triton's interpreter on CPU (3 programs, small odd shapes); on a GPU at the same shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _balanced, _common, _onepass  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)
    torch.manual_seed(0)


def _weights(d_model, d_inter, dtype):
    x = torch.randn(1, d_model, device=DEVICE).to(dtype)
    wg = (torch.randn(d_inter, d_model, device=DEVICE) / d_model**0.5).to(dtype)
    wu = (torch.randn(d_inter, d_model, device=DEVICE) / d_model**0.5).to(dtype)
    wdt = (torch.randn(d_inter, d_model, device=DEVICE) / d_inter**0.5).to(dtype)
    return x, wg, wu, wdt


def _expected_partials(x, wg, wu, wdt, ind, keep, act, progs, mode):
    """float64 partial sums per program: kept rows split by rank as the kernel promises."""
    rows = torch.nonzero(keep).flatten().tolist()  # ascending: rank order
    n = len(rows)
    x64, g64, u64, d64 = (t.double() for t in (x[0], wg, wu, wdt))
    out = torch.zeros(progs, wdt.shape[1], dtype=torch.float64, device=x.device)
    for p in range(progs):
        for r in rows[(p * n) // progs: ((p + 1) * n) // progs]:
            g = ind[r].double() if mode == "abs_act" else g64[r] @ x64
            u = ind[r].double() if mode == "abs" else u64[r] @ x64
            a = torch.nn.functional.silu(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
            s = (u * a).to(x.dtype).double()  # the kernel rounds s to the model's dtype
            out[p] += s * d64[r]
    return out


CASES = [  # (mode, dtype, act, k, d_model, d_inter, config)
    ("abs", torch.bfloat16, "silu", 0.9, 67, 131, {}),
    ("abs", torch.float32, "gelu_tanh", 0.5, 64, 200, dict(PREFETCH=False, BM=2)),
    ("abs_act", torch.float16, "silu", 0.7, 67, 131, dict(BM=1, BLOCK_R=16, LOOP_R=32)),
    ("gt", torch.bfloat16, "silu", 0.8, 67, 131, dict(BLOCK_R=32)),
    ("gt", torch.float32, "silu", 0.3, 33, 97, dict(PREFETCH=False, BM=8, BLOCK_R=16, LOOP_R=16)),
    ("gt", torch.float16, "gelu_tanh", 0.0, 40, 50, {}),  # every row kept
    ("abs", torch.float32, "silu", 1.0, 40, 50, {}),      # no row kept: zero partials, all written
]


@pytest.mark.parametrize("mode,dtype,act,k,d_model,d_inter,config", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-k{c[3]}-{c[5]}-{'cfg' if c[6] else 'default'}" for c in CASES])
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar-thr", "per-row-thr"])
def test_partials_are_the_rank_split_of_the_kept_rows(mode, dtype, act, k, d_model, d_inter, config, per_row):
    x, wg, wu, wdt = _weights(d_model, d_inter, dtype)
    if mode == "abs":
        ind = (x @ wu.t())[0]
        values = ind.float().abs()
    elif mode == "abs_act":
        ind = (x @ wg.t())[0]
        values = _common.act_torch(ind.float(), act).abs()
    else:
        ind = (torch.randn(d_inter, device=DEVICE)).to(dtype)
        values = ind.float()
    if per_row:  # every row its own threshold: a random fraction 1 - k above, the rest below
        above = torch.rand(d_inter, device=DEVICE) >= k
        thr = torch.where(above, values - 0.5 * values.abs() - 0.05, values + 0.5 * values.abs() + 0.05)
        keep = above
        thr_t, thr_f = thr.float(), 0.0
    else:
        thr_f = float(values.max()) + 1.0 if k >= 1 else (float(values.min()) - 1.0 if k <= 0
                                                          else float(torch.quantile(values.double(), k)))
        keep = values > thr_f
        thr_t = None
    p = _balanced.balanced_partials(x, ind[None, :], wg, wu, wdt, thr_t, thr_f, mode, act,
                                    gate=mode != "abs_act", up=mode != "abs", config=config)
    progs = _balanced.n_programs(x.device, d_inter, config)
    assert p.shape == (progs, d_model) and progs > 1
    assert not torch.isnan(p).any(), "a partial was not written"
    want = _expected_partials(x, wg, wu, wdt, ind, keep, act, progs, mode)
    scale = max(1.0, want.abs().max().item())
    assert (p.double() - want).abs().max().item() <= TOL[dtype] * scale
    if 0 < k < 1 and not per_row:
        assert 0 < int(keep.sum()) < d_inter


def test_balanced_is_the_one_token_route_when_chosen(monkeypatch):
    """With SPARSE_KERNEL "balanced" the one-token mono / cats / dual ops run this kernel (not
    _onepass.py's) and still match float64; the op's declared output rows match what it returns."""
    from test_kernels import _check, _threshold  # noqa: E402  (the shared float64 rule)

    monkeypatch.setattr(_onepass, "ONEPASS", True)
    monkeypatch.setattr(_onepass, "ONEPASS_OFF_CUDA", True)
    monkeypatch.setattr(_onepass, "SPARSE_KERNEL", "balanced")
    monkeypatch.setattr(_onepass, "CONFIGS", {m: {**c, "IND": "torch"} for m, c in _onepass.CONFIGS.items()})
    calls = []
    real = _balanced.balanced_partials
    monkeypatch.setattr(_balanced, "balanced_partials", lambda *a, **kw: calls.append(kw or a[7]) or real(*a, **kw))
    x, wg, wu, wdt = _weights(67, 131, torch.bfloat16)
    values = (x @ wu.t()).float().abs()[0]
    thr = _threshold(values, 0.8, gap=0.05)
    out = K.mono_gated_mlp(x, wg, wu, wdt, thr, "silu")
    ref = K.mono_gated_mlp_ref(x, wg, wu, wdt, thr, "silu")
    keep = (values > thr)[None, :]
    _check(out, ref, K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, "silu"))
    pa = (torch.randn(67, 16, device=DEVICE) / 67**0.5).to(torch.bfloat16)
    pb = (torch.randn(131, 16, device=DEVICE) / 4).to(torch.bfloat16).t()
    scores = K.dual_scores(x, pa, pb).float()[0]
    cut = _threshold(scores, 0.7, gap=0.05)
    out = K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, cut, "silu")
    ref = K.dual_gated_mlp_ref(x, wg, wu, wdt, pa, pb, cut, "silu")
    _check(out, ref, K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), (scores > cut)[None, :], "silu"))
    assert len(calls) == 2
    p = torch.ops.countdown.gated_balanced(x, x @ wu.t(), wg, wu, wdt, None, thr, "abs", "silu", True, False)
    assert p.shape[0] == _balanced.n_programs(x.device, 131)
    assert len(calls) == 3  # the op runs this kernel


def test_balanced_names_bad_input():
    x, wg, wu, wdt = _weights(16, 40, torch.float32)
    with pytest.raises(ValueError, match="one token"):
        _balanced.balanced_partials(torch.cat([x, x]), torch.zeros(1, 40), wg, wu, wdt, None, 0.5, "abs", "silu",
                                    True, False)
    with pytest.raises(ValueError, match="per-row threshold"):
        _balanced.balanced_partials(x, torch.zeros(1, 40), wg, wu, wdt, torch.zeros(39), 0.0, "gt", "silu",
                                    True, True)
