"""kernels/_overlap.py: one token's sparse MLP whose sparse rows load while the indicator's GEMV streams
(producers publish each chunk's indicators through a counter, consumers run the chunk once it is complete).

Against float64: the partials' sum equals the MLP over exactly the rows the indicator keeps (the indicator
itself rounded to its input's dtype, as a GEMV returns it), for mono / cats / dual, scalar and per-row
thresholds, odd shapes (a last chunk and a last producer step cut short), several chunks per consumer
(the interpreter runs 2 producers and 3 consumers); the counters are back to zero after every launch; the
mono and dual ops take this kernel when SPARSE_KERNEL is "overlap". Runs under Triton's interpreter on CPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _common, _onepass, _overlap  # noqa: E402
from test_balanced import _weights  # noqa: E402  (one token's random MLP)
from test_kernels import _check, _threshold  # noqa: E402  (the shared float64 rule)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)
    if DEVICE == "cuda":  # the counters are made once per device, before compiling or capturing
        _overlap.prepare(torch.device(DEVICE))
    torch.manual_seed(0)


CASES = [  # (method, dtype, act, k, d_model, d_inter, config)
    ("mono", torch.bfloat16, "silu", 0.9, 67, 131, {}),
    ("mono", torch.float32, "gelu_tanh", 0.5, 64, 200, dict(RB=8, CHUNK=16, BLOCK_M=2)),
    ("cats", torch.float16, "silu", 0.7, 67, 131, dict(RB=2, CHUNK=32, STAGES=2)),
    ("dual", torch.bfloat16, "silu", 0.8, 67, 131, dict(RB=1, CHUNK=8, PSTAGES=1)),
    ("dual", torch.float32, "gelu_tanh", 0.3, 33, 97, dict(CHUNK=8, BLOCK_M=8)),
    ("mono", torch.bfloat16, "silu", 0.8, 67, 131, dict(PUBLISH="chunk", CHUNK=32, RB=8, PSTAGES=2)),
    ("dual", torch.float16, "silu", 0.6, 40, 70, dict(PUBLISH="chunk", CHUNK=16, RB=2)),
    ("mono", torch.float32, "silu", 0.7, 40, 150, dict(EVERY=3, RB=2, CHUNK=8)),  # a last group cut short
]


@pytest.mark.parametrize("method,dtype,act,k,d_model,d_inter,config", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-k{c[3]}-{c[5]}-{'cfg' if c[6] else 'default'}" for c in CASES])
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar-thr", "per-row-thr"])
def test_overlap_is_the_mlp_over_the_rows_its_indicator_keeps(method, dtype, act, k, d_model, d_inter, config,
                                                              per_row):
    x, wg, wu, wdt = _weights(d_model, d_inter, dtype)
    if method == "dual":
        v = torch.randn(1, 16, device=DEVICE).to(dtype)
        w_ind = (torch.randn(d_inter, 16, device=DEVICE) / 4).to(dtype)
    else:
        v, w_ind = x, (wu if method == "mono" else wg)
    ind = (v.double() @ w_ind.double().t()).to(dtype)[0]  # as the GEMV returns it, from float64
    values = {"mono": ind.float().abs(), "cats": _common.act_torch(ind.float(), act).abs(), "dual": ind.float()}[method]
    if per_row:  # every row its own threshold, well away from its value
        above = torch.rand(d_inter, device=DEVICE) >= k
        thr_t = torch.where(above, values - 0.5 * values.abs() - 0.05, values + 0.5 * values.abs() + 0.05).float()
        thr_f, keep = 0.0, above
    else:
        thr_t, thr_f = None, _threshold(values, k, gap=0.05)
        keep = values > thr_f
    mode = {"mono": "abs", "cats": "abs_act", "dual": "gt"}[method]
    p = _overlap.overlap_partials(x, v, w_ind, wg, wu, wdt, thr_t, thr_f, mode, act, gate=method != "cats",
                                  up=method != "mono", config=config)
    assert p.shape == (_overlap.programs(x.device, config)[1], d_model)
    n_chunks = -(-d_inter // {**_overlap.CONFIG, **config}["CHUNK"])
    assert int(_overlap.counters(x.device)[:n_chunks].abs().sum()) == 0, "a chunk counter was left set"
    y = p.sum(0, keepdim=True).to(dtype)
    # float64 on the kept rows; mono's u and cats' g are the rounded indicator itself
    x64, g64, u64, d64 = x[0].double(), wg.double(), wu.double(), wdt.double()
    g = ind.double() if method == "cats" else g64 @ x64
    u = ind.double() if method == "mono" else u64 @ x64
    a = torch.nn.functional.silu(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    want = ((u * a).to(dtype).double() * keep.double()) @ d64
    scale = max(1.0, want.abs().max().item())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]
    assert (y[0].double() - want).abs().max().item() <= tol * scale
    if 0 < k < 1 and not per_row:
        assert 0 < int(keep.sum()) < d_inter


def test_overlap_is_the_one_token_route_when_chosen(monkeypatch):
    monkeypatch.setattr(_onepass, "ONEPASS_OFF_CUDA", True)
    monkeypatch.setattr(_onepass, "SPARSE_KERNEL", "overlap")
    calls = []
    real = _overlap.overlap_partials
    monkeypatch.setattr(_overlap, "overlap_partials", lambda *a, **kw: calls.append(a[8]) or real(*a, **kw))
    x, wg, wu, wdt = _weights(67, 131, torch.bfloat16)
    values = (x @ wu.t()).float().abs()[0]
    thr = _threshold(values, 0.8, gap=0.05)
    out = K.mono_gated_mlp(x, wg, wu, wdt, thr, "silu")
    keep = (values > thr)[None, :]
    _check(out, K.mono_gated_mlp_ref(x, wg, wu, wdt, thr, "silu"),
           K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), keep, "silu"))
    pa = (torch.randn(67, 16, device=DEVICE) / 67**0.5).to(torch.bfloat16)
    pbt = (torch.randn(131, 16, device=DEVICE) / 4).to(torch.bfloat16)  # B^T rows contiguous, as a predictor holds it
    scores = K.dual_scores(x, pa, pbt.t()).float()[0]
    cut = _threshold(scores, 0.7, gap=0.05)
    out = K.dual_gated_mlp(x, wg, wu, wdt, pa, pbt.t(), cut, "silu")
    _check(out, K.dual_gated_mlp_ref(x, wg, wu, wdt, pa, pbt.t(), cut, "silu"),
           K.gated_mlp_masked_ref(*(t.double() for t in (x, wg, wu, wdt)), (scores > cut)[None, :], "silu"))
    assert calls == ["abs", "gt"]


def test_overlap_names_bad_input():
    x, wg, wu, wdt = _weights(16, 40, torch.float32)
    with pytest.raises(ValueError, match="one token"):
        _overlap.overlap_partials(torch.cat([x, x]), x, wu, wg, wu, wdt, None, 0.5, "abs", "silu", True, False)
    with pytest.raises(ValueError, match="indicator input"):
        _overlap.overlap_partials(x, x[:, :8], wu, wg, wu, wdt, None, 0.5, "abs", "silu", True, False)
    with pytest.raises(ValueError, match="multiple of RB"):
        _overlap.overlap_partials(x, x, wu, wg, wu, wdt, None, 0.5, "abs", "silu", True, False, config=dict(RB=3))
