"""Correctness of the Triton kernels (countdown.kernels) against float64 references.

flash-attention's rule: |out - ref64| <= 2 |out_torch - ref64| + atol, where ref64 is the same maths
in float64 (with the keep mask the op itself would use at the input precision) and out_torch the plain
PyTorch computation at the input precision. Every buffer a kernel must write is poisoned with NaN
first. Speed is never asserted here (benchmarks/mlp_kernels.py times them).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before Triton
is imported) on small odd shapes. On a GPU, COUNTDOWN_KERNEL_TEST_SHAPES=real runs the same checks at
Llama-3.1-8B's Gated-MLP shape (4096 x 14336).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

import countdown.kernels as K  # noqa: E402
from countdown.kernels import common  # noqa: E402
from countdown.kernels.route import ROUTES  # noqa: E402
from countdown.kernels.sparse_mlp import one_token, partial_sums  # noqa: E402

from _onetoken import gap_threshold as _threshold  # noqa: E402
from _onetoken import indicator_values, outputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REAL = os.environ.get("COUNTDOWN_KERNEL_TEST_SHAPES", "") == "real"
D_MODEL, D_INTER = (4096, 14336) if REAL else (67, 131)
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _poison():
    # one token on the chained kernels too (test_one_token covers the one-launch kernel, whose in-kernel
    # indicator has another summation order that may move a threshold tie)
    with K.overrides(poison_outputs=True, off=("one_token",)):
        torch.manual_seed(0)
        yield


def _indicator_routes(ind: str) -> dict:
    """mono's and cats' one-token indicator computed in the kernel ("kernel") or before it ("torch": the fixed GEMV
    on CUDA, PyTorch's matmul under the interpreter)."""
    return {(f"{m}_indicator", dev): (("in_kernel",) if ind == "kernel" else ROUTES[("cats_indicator", dev)][:1])
            + (None, None) for m in ("mono", "cats") for dev in ("cuda", "interpreter")}


def _mlp(batch, dtype, d_model=D_MODEL, d_inter=D_INTER, lead=None):
    shape = (batch, d_model) if lead is None else (*lead, d_model)
    x = torch.randn(shape, device=DEVICE).to(dtype)
    w_gate = (torch.randn(d_inter, d_model, device=DEVICE) / d_model**0.5).to(dtype)
    w_up = (torch.randn(d_inter, d_model, device=DEVICE) / d_model**0.5).to(dtype)
    w_down_t = (torch.randn(d_inter, d_model, device=DEVICE) / d_inter**0.5).to(dtype)
    return x, w_gate, w_up, w_down_t


def _f64(*ts):
    return [t.double() for t in ts]


def _check(out, out_torch, ref64):
    assert out.dtype == out_torch.dtype and out.shape == ref64.shape
    assert not torch.isnan(out).any(), "an output element was not written"
    err = (out.double() - ref64).abs()
    bound = 2 * (out_torch.double() - ref64).abs() + ATOL[out.dtype] * max(1.0, ref64.abs().max().item())
    worst = (err - bound).max().item()
    assert worst <= 0, f"max err {err.max().item():.3e} exceeds the bound by {worst:.3e}"


CASES = [  # (dtype, batch, activation, k)
    (torch.float32, 1, "silu", 0.5),
    (torch.float16, 3, "gelu_tanh", 0.9),
    (torch.bfloat16, 8, "silu", 0.99),
    (torch.bfloat16, 1, "gelu_tanh", 0.1),
    (torch.float16, 8, "silu", 0.7),
    (torch.float32, 3, "gelu_tanh", 0.95),
]
CASE_IDS = [f"{str(d)[6:]}-b{b}-{a}-k{k}" for d, b, a, k in CASES]


@pytest.mark.parametrize("dtype,batch,act,k", CASES, ids=CASE_IDS)
def test_mono(dtype, batch, act, k):
    x, wg, wu, wdt = _mlp(batch, dtype)
    thr = _threshold((x @ wu.t()).float().abs(), k)
    keep = K.mono_keep(x, wu, thr)
    out = K.mono_gated_mlp(x, wg, wu, wdt, thr, act)
    _check(out, K.mono_gated_mlp_ref(x, wg, wu, wdt, thr, act),
           K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, act))


@pytest.mark.parametrize("dtype,batch,act,k", CASES, ids=CASE_IDS)
def test_cats(dtype, batch, act, k):
    x, wg, wu, wdt = _mlp(batch, dtype)
    thr = _threshold(common.act_torch((x @ wg.t()).float(), act).abs(), k)
    keep = K.cats_keep(x, wg, thr, act)
    out = K.cats_gated_mlp(x, wg, wu, wdt, thr, act)
    _check(out, K.cats_gated_mlp_ref(x, wg, wu, wdt, thr, act),
           K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, act))


@pytest.mark.parametrize("dtype,batch,act,k", CASES, ids=CASE_IDS)
def test_dual(dtype, batch, act, k):
    x, wg, wu, wdt = _mlp(batch, dtype)
    rank = 16 if not REAL else 512
    pa = (torch.randn(D_MODEL, rank, device=DEVICE) / D_MODEL**0.5).to(dtype)
    pb = (torch.randn(rank, D_INTER, device=DEVICE) / rank**0.5).to(dtype)
    cut = _threshold(K.dual_scores(x, pa, pb).float(), k)
    keep = K.dual_keep(x, pa, pb, cut)
    out = K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, cut, act)
    _check(out, K.dual_gated_mlp_ref(x, wg, wu, wdt, pa, pb, cut, act),
           K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, act))


@pytest.mark.parametrize("dtype,batch,act,k", CASES, ids=CASE_IDS)
def test_masked(dtype, batch, act, k):
    x, wg, wu, wdt = _mlp(batch, dtype)
    keep = torch.rand(batch, D_INTER, device=DEVICE) >= k
    out = K.masked_gated_mlp(x, wg, wu, wdt, keep, act)
    _check(out, K.masked_gated_mlp_ref(x, wg, wu, wdt, keep, act),
           K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, act))


@pytest.mark.parametrize("dtype,batch,act,k", CASES, ids=CASE_IDS)
def test_sparse_down_proj(dtype, batch, act, k):
    _, _, _, wdt = _mlp(batch, dtype)
    s = torch.randn(batch, D_INTER, device=DEVICE).to(dtype)
    keep = torch.rand(batch, D_INTER, device=DEVICE) >= k
    _check(K.sparse_down_proj(s, keep, wdt), K.sparse_down_proj_ref(s, keep, wdt),
           K.sparse_down_proj_ref(s.double(), keep, wdt.double()))


@pytest.mark.parametrize("kept", ["none", "all"])
@pytest.mark.parametrize("op", ["mono", "cats", "dual", "masked", "down"])
def test_all_or_none_kept(op, kept):
    dtype, batch, act = torch.bfloat16, 3, "silu"
    x, wg, wu, wdt = _mlp(batch, dtype)
    thr = float("inf") if kept == "none" else float("-inf")
    keep = torch.full((batch, D_INTER), kept == "all", device=DEVICE)
    ref64 = K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, act)
    if op == "mono":
        out, out_torch = (f(x, wg, wu, wdt, thr, act) for f in (K.mono_gated_mlp, K.mono_gated_mlp_ref))
    elif op == "cats":
        out, out_torch = (f(x, wg, wu, wdt, thr, act) for f in (K.cats_gated_mlp, K.cats_gated_mlp_ref))
    elif op == "dual":
        pa, pb = torch.randn(D_MODEL, 8, device=DEVICE).to(dtype), torch.randn(8, D_INTER, device=DEVICE).to(dtype)
        out, out_torch = (f(x, wg, wu, wdt, pa, pb, thr, act) for f in (K.dual_gated_mlp, K.dual_gated_mlp_ref))
    elif op == "masked":
        out, out_torch = (f(x, wg, wu, wdt, keep, act) for f in (K.masked_gated_mlp, K.masked_gated_mlp_ref))
    else:
        s = torch.randn(batch, D_INTER, device=DEVICE).to(dtype)
        out, out_torch = K.sparse_down_proj(s, keep, wdt), K.sparse_down_proj_ref(s, keep, wdt)
        ref64 = K.sparse_down_proj_ref(s.double(), keep, wdt.double())
    _check(out, out_torch, ref64)
    if kept == "none":
        assert (out == 0).all()


def test_threshold_tensor_and_leading_dims():
    """A 0-dim tensor threshold is read on the device; x may carry leading dims [2, 2, d_model]."""
    dtype, act = torch.float16, "gelu_tanh"
    x, wg, wu, wdt = _mlp(0, dtype, lead=(2, 2))
    thr = torch.tensor(_threshold((x @ wu.t()).float().abs(), 0.8), device=DEVICE)
    keep = K.mono_keep(x, wu, thr)
    out = K.mono_gated_mlp(x, wg, wu, wdt, thr, act)
    assert out.shape == x.shape
    _check(out, K.mono_gated_mlp_ref(x, wg, wu, wdt, thr, act),
           K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, act))


@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 1), (torch.float16, 5)], ids=["bfloat16-b1", "float16-b5"])
def test_dual_per_row_cut(dtype, batch):
    """A cut per row ([d_inter]: a trained predictor's ``cut - bias``): row i is kept where
    (x A B)[i] > cut[i]. Reference: the mask computed by hand in float32 from the same scores."""
    x, wg, wu, wdt = _mlp(batch, dtype)
    pa = (torch.randn(D_MODEL, 16, device=DEVICE) / D_MODEL**0.5).to(dtype)
    pb = (torch.randn(D_INTER, 16, device=DEVICE) / 4).to(dtype).t()
    scores = K.dual_scores(x, pa, pb).float()
    # each row keeps a random number of the batch's tokens; the cut sits in a gap wide enough that
    # another summation order cannot move a score across it
    gen = torch.Generator().manual_seed(1)
    cut = torch.empty(D_INTER)
    for i in range(D_INTER):
        v = scores[:, i].sort().values.cpu()
        m = int(torch.randint(0, batch + 1, (1,), generator=gen))
        if 0 < m < batch and v[m] - v[m - 1] > 0.02 * max(float(v.abs().max()), 1e-3):
            cut[i] = (v[m - 1] + v[m]) / 2
        else:
            cut[i] = v[0] - 1 if m < batch / 2 else v[-1] + 1
    cut = cut.to(DEVICE)
    keep = scores > cut
    assert 0 < int(keep.sum()) < keep.numel()
    out = K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, cut, "silu")
    _check(out, K.dual_gated_mlp_ref(x, wg, wu, wdt, pa, pb, cut, "silu"),
           K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, "silu"))
    with pytest.raises(ValueError, match="one per row"):
        K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, cut[None, :], "silu")


ONE_TOKEN_CASES = [  # (op, dtype, activation, config, per-row thresholds): odd shapes, several chunks
    ("mono", torch.bfloat16, "silu", {}, False),  # per program
    ("mono", torch.float32, "gelu_tanh", dict(CHUNK=16, BLOCK_M=4, ROWS=None), False),
    ("cats", torch.float16, "gelu_tanh", {}, False),
    ("cats", torch.bfloat16, "silu", dict(BLOCK_M=1), False),
    ("cats", torch.float32, "silu", dict(CHUNK=16), False),
    ("dual", torch.bfloat16, "silu", {}, False),
    ("dual", torch.bfloat16, "silu", {}, True),
    ("dual", torch.float16, "gelu_tanh", dict(CHUNK=32, BLOCK_M=8), True),
    ("mono", torch.bfloat16, "silu", dict(ROWS="auto", BLOCK_M=4), False),  # 131 rows over 3 programs: 44 a chunk
    ("dual", torch.float32, "silu", dict(ROWS="auto", BLOCK_M=2), True),
    ("cats", torch.float16, "silu", dict(STAGES=2, BLOCK_M=2), False),  # the tile loop software-pipelined
    # the kernel's indicator RB rows a step (ind-kernel; ignored with ind-torch): 9 chunks of 16, a partial last step
    ("mono", torch.bfloat16, "silu", dict(RB=4, ISTAGES=2, CHUNK=16, W_EARLY=True), False),  # early: 1st chunk
    ("cats", torch.float16, "gelu_tanh", dict(RB=2, CHUNK=32, BLOCK_M=2), False),
    ("mono", torch.bfloat16, "silu", dict(ROWS="auto", RB=8, ISTAGES=3, BLOCK_M=4), False),  # 48 rows a program
    ("dual", torch.bfloat16, "gelu_tanh", dict(ROWS="auto", STAGES=2), True),
]
# mono and cats take their indicator given (computed before the launch) or computed in the kernel; dual's scores
# always come from the predictor's GEMVs before it
ONE_TOKEN_RUNS = [(case, ind) for case in ONE_TOKEN_CASES for ind in ("torch", "kernel")
                if case[0] != "dual" or ind == "torch"]


@pytest.mark.parametrize("op,dtype,act,config,per_row,ind", [(*c, ind) for c, ind in ONE_TOKEN_RUNS],
                         ids=[f"{o}-{str(d)[6:]}-{a}-{'cfg' if c else 'default'}{'-per-row' if r else ''}-ind-{i}"
                              for (o, d, a, c, r), i in ONE_TOKEN_RUNS])
def test_one_token(op, dtype, act, config, per_row, ind):
    """The one-launch kernel for a single token (decode steps): indicator, compaction, kept GEMVs
    and down projection in one persistent grid, fp32 partials summed outside; the indicator given
    (computed by torch) or computed in the kernel, RB rows a step (RB 2 where the case gives none).
    Thresholds sit in wide gaps (the kernel's own indicator has another summation order); per-row thresholds
    (dual: a trained predictor's ``cut - bias``) give every row its own value."""
    rb = {"RB": 2} if ind == "kernel" else {}  # (mono's own RB is 2; the case's RB where it gives one)
    with K.overrides(off=(), cuda_routes=("one_token",), launch={"one_token": {**rb, **config}},
                     routes=_indicator_routes(ind)):
        _one_launch_case(op, dtype, act, per_row)


def _one_launch_case(op, dtype, act, per_row):
    x, wg, wu, wdt = _mlp(1, dtype)
    pa = (torch.randn(D_MODEL, 16, device=DEVICE) / D_MODEL**0.5).to(dtype)
    pb = (torch.randn(D_INTER, 16, device=DEVICE) / 4).to(dtype).t()  # B^T stored contiguous
    values = indicator_values(op, x, wg, wu, act, pa, pb)
    if per_row:  # 30 % of rows get a threshold well below their score, the rest well above
        gen = torch.Generator().manual_seed(2)
        above = torch.rand(D_INTER, generator=gen).to(DEVICE) < 0.3
        thr = torch.where(above, values - 0.5 * values.abs() - 0.05, values + 0.5 * values.abs() + 0.05)
    else:
        thr = _threshold(values, 0.7, gap=0.05)
    keep = (values > thr)[None, :]
    out, out_torch = outputs(op, x, wg, wu, wdt, thr, act, pa, pb)
    assert 0 < int(keep.sum()) < keep.numel()
    mode = {"mono": "abs", "cats": "abs_act", "dual": "gt"}[op]
    assert one_token.n_programs(x.device, D_INTER, mode) > 1 or REAL
    _check(out, out_torch, K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, act))


@pytest.mark.parametrize("rows,d,dtype", [(7, 50, torch.bfloat16), (224, 67, torch.float16), (600, 33, torch.float32)])
def test_sum_partials_matches_float64(rows, d, dtype):
    """sparse_mlp/partial_sums.py: the column sums of fp32 partials, rounded once to the model's dtype (600 rows:
    more than one load per program); the custom op gives the same and names a wrong input."""
    gen = torch.Generator().manual_seed(rows)
    p = (torch.randn(rows, d, generator=gen) * torch.logspace(-3, 2, d)[None, :]).to(DEVICE)
    exact = p.double().sum(0, keepdim=True)
    got = partial_sums.sum_partials(p, dtype)
    assert got.dtype == dtype and got.shape == (1, d)
    # fp32 accumulation of `rows` terms, then one rounding to dtype (half an ulp)
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]
    bound = ulp * exact.abs() + rows * 2.0**-24 * p.double().abs().sum(0, keepdim=True)
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(torch.ops.countdown.sum_partials(p, torch.empty(1, dtype=dtype)), got)
    with pytest.raises(ValueError, match="fp32"):
        partial_sums.sum_partials(p.to(torch.bfloat16), dtype)


def test_sum_partials_of_a_few_tokens_and_the_route(monkeypatch):
    """3-D partials [rows, tokens, d] (the few-token and TEAL kernels') sum to [tokens, d] against float64;
    the route takes the op when the call runs eagerly and PyTorch's sum while torch.compile traces it (where
    Inductor fuses it)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(96, 3, 40, generator=gen).to(DEVICE)
    exact = p.double().sum(0)
    got = partial_sums.sum_partials(p, torch.bfloat16)
    assert got.shape == (3, 40) and got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= 2.0**-8 * exact.abs() + 96 * 2.0**-24 * p.double().abs().sum(0)).all()
    like = torch.empty(1, dtype=torch.bfloat16, device=DEVICE)
    taken = []
    with K.overrides(cuda_routes=("partial_sums",),
                     on_launch=lambda name, *a: taken.append(a[0].shape) if name == "partial_sums" else None):
        for compiling in (False, True):
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda c=compiling: c)
            taken.clear()
            y = partial_sums.reduce(p, like)
            assert bool(taken) == (not compiling)
            assert y.shape == (3, 40) and torch.equal(y, p.sum(0).to(torch.bfloat16) if compiling else got)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        assert partial_sums.reduce(p[:, 0], like).shape == (1, 40)  # one token's 2-D partials keep the row dim


@pytest.mark.parametrize("op", ["mono", "dual"])
def test_one_token_indicator_on_the_fixed_gemv(op):
    """The one-token indicator given to the kernel (mono's u computed before it; dual's x A and (x A) B, A and B
    held as views of contiguous A^T and B^T) runs on decode_step/linear.py's GEMV, once per GEMV, and the MLP
    still matches float64; a predictor whose A is a plain contiguous [d_model, r] falls back to x @ A."""
    calls = []
    # the one-token kernel, the fixed GEMV and the partials summed by sparse_mlp/partial_sums.py, as on CUDA
    with K.overrides(off=(), cuda_routes=("one_token", "linear", "partial_sums", "residual_add"),
                     routes=_indicator_routes("torch"),
                     on_launch=lambda name, *a: calls.append(tuple(a[1].shape)) if name == "linear" else None):
        _indicator_case(op, calls)


def _indicator_case(op, calls):
    x, wg, wu, wdt = _mlp(1, torch.bfloat16)
    if op == "dual":
        pa = (torch.randn(D_MODEL, 16, device=DEVICE) / D_MODEL**0.5).to(torch.bfloat16).t().contiguous().t()
        pb = (torch.randn(D_INTER, 16, device=DEVICE) / 4).to(torch.bfloat16).t()
        values = K.dual_scores(x, pa, pb).float()[0]
    else:
        values = (x @ wu.t()).float().abs()[0]
    thr = _threshold(values, 0.7, gap=0.05)
    keep = (values > thr)[None, :]
    if op == "dual":
        out, out_torch = (f(x, wg, wu, wdt, pa, pb, thr, "silu") for f in (K.dual_gated_mlp, K.dual_gated_mlp_ref))
        assert calls == [(16, D_MODEL), (D_INTER, 16)]
        calls.clear()
        K.dual_gated_mlp(x, wg, wu, wdt, pa.contiguous(), pb, thr, "silu")  # A not a view of A^T
        assert calls == [(D_INTER, 16)]
    else:
        out, out_torch = (f(x, wg, wu, wdt, thr, "silu") for f in (K.mono_gated_mlp, K.mono_gated_mlp_ref))
        assert calls == [(D_INTER, D_MODEL)]
    _check(out, out_torch, K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, "silu"))


def test_one_token_really_runs():
    """The single-token ops take the one-launch kernel when it applies, and only then."""
    calls = []
    with K.overrides(off=(), cuda_routes=("one_token",),
                     on_launch=lambda name, *a: calls.append(a[0].shape[0]) if name == "one_token" else None):
        for batch in (1, 2):
            x, wg, wu, wdt = _mlp(batch, torch.bfloat16)
            K.mono_gated_mlp(x, wg, wu, wdt, 0.5, "silu")
    assert calls == [1]
    real = one_token.one_token_partials
    with pytest.raises(ValueError, match="one token"):
        real(x, wu, wg, wu, wdt, None, 0.5, "abs", "silu", True, False)
    x = x[:1]
    for rb in (3, 0):  # the in-kernel indicator streams a power of two of rows a step
        with pytest.raises(ValueError, match="RB"):
            real(x, wu, wg, wu, wdt, None, 0.5, "abs", "silu", True, False, config=dict(RB=rb))
    with pytest.raises(ValueError, match="indicator's rows"):
        real(x, wu[:, :-1], wg, wu, wdt, None, 0.5, "abs", "silu", True, False)


VARIANTS = [  # kernel options the benchmark compares; each must be right too
    dict(glu=dict(USE_DOT=True, CHUNK=16, BLOCK_K=32), down=dict(USE_DOT=True), per_token=False),
    dict(glu=dict(USE_DOT=False, CHUNK=16, BLOCK_M=4, BLOCK_K=32), down=dict(USE_DOT=False, CHUNK=32),
         per_token=False),
    dict(glu=dict(USE_DOT=False, BLOCK_K=0), down=dict(USE_DOT=False, CHUNK=64, BLOCK_N=32), per_token=True),
]


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_variants(variant, dtype):
    v = VARIANTS[variant]
    batch, act = 5, "silu"
    x, wg, wu, wdt = _mlp(batch, dtype)
    keep = torch.rand(batch, D_INTER, device=DEVICE) >= 0.8
    with K.overrides(launch={"chain_gate_up": v["glu"], "chain_down": v["down"]}):
        out = K.masked_gated_mlp(x, wg, wu, wdt, keep, act, per_token=v["per_token"])
    _check(out, K.masked_gated_mlp_ref(x, wg, wu, wdt, keep, act),
           K.gated_mlp_masked_ref(*_f64(x, wg, wu, wdt), keep, act))


def test_available_and_fallback():
    x, wg, wu, wdt = _mlp(2, torch.float32)
    assert K.available(x)
    with K.overrides(triton=False):  # as if Triton were not installed
        assert not K.available(x)
        thr = _threshold((x @ wu.t()).abs(), 0.5)  # falls back to the PyTorch reference
        torch.testing.assert_close(K.mono_gated_mlp(x, wg, wu, wdt, thr), K.mono_gated_mlp_ref(x, wg, wu, wdt, thr))


def test_torch_compile_fullgraph():
    """The ops are custom ops with fake impls: dynamo traces them with no graph break."""
    dtype = torch.bfloat16
    x, wg, wu, wdt = _mlp(2, dtype)
    pa, pb = torch.randn(D_MODEL, 8, device=DEVICE).to(dtype), torch.randn(8, D_INTER, device=DEVICE).to(dtype)
    thr = torch.tensor(_threshold((x @ wu.t()).float().abs(), 0.7), device=DEVICE)

    def mlp(x):
        y = K.mono_gated_mlp(x, wg, wu, wdt, thr, "silu")
        return y + K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, 0.5, "silu")

    torch._dynamo.reset()
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    compiled = torch.compile(mlp, fullgraph=True, backend=backend)
    # on a GPU Inductor fuses the partial sums into the add: bf16 roundings may differ by one unit
    tol = dict(atol=2e-3, rtol=2e-2) if DEVICE == "cuda" else {}
    torch.testing.assert_close(compiled(x), mlp(x), **tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    dtype = torch.bfloat16
    x, wg, wu, wdt = _mlp(1, dtype)
    thr = torch.tensor(_threshold((x @ wu.t()).float().abs(), 0.9), device=DEVICE)
    eager = K.mono_gated_mlp(x, wg, wu, wdt, thr)  # warm-up: compiles, allocates the counters
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = K.mono_gated_mlp(x, wg, wu, wdt, thr)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager)
