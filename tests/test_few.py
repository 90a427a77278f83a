"""kernels/sparse_mlp/few_tokens.py: the sparse Gated-MLP of 2-8 tokens in one launch (the union of their rows).

Against float64: partial c must be the sum over exactly chunk c's rows of s[t, i] w_down_t[i], with
each token's own kept rows (not the union's) and s rounded to the model's dtype, so the test checks
the split and the per-token masks, not only the total. Then the public ops route 2-8 tokens here and
still match float64 by the flash-attention rule. Runs under Triton's interpreter on CPU (small odd
shapes); on a GPU at the same shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

import countdown.kernels as K  # noqa: E402
from countdown.kernels import common  # noqa: E402
from countdown.kernels.config import launch_config  # noqa: E402
from countdown.kernels.sparse_mlp import few_tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture(autouse=True)
def _poison():
    with K.overrides(poison_outputs=True):
        torch.manual_seed(0)
        yield


def _weights(n_tok, d_model, d_inter, dtype):
    x = torch.randn(n_tok, d_model, device=DEVICE).to(dtype)
    wg = (torch.randn(d_inter, d_model, device=DEVICE) / d_model**0.5).to(dtype)
    wu = (torch.randn(d_inter, d_model, device=DEVICE) / d_model**0.5).to(dtype)
    wdt = (torch.randn(d_inter, d_model, device=DEVICE) / d_inter**0.5).to(dtype)
    return x, wg, wu, wdt


def _expected_partials(x, wg, wu, wdt, ind, keep, act, chunk, mode):
    """float64 [n_chunks, T, d_model]: chunk c's rows, each token's own kept rows only."""
    n_tok, d_inter = keep.shape
    x64, g64, u64, d64 = (t.double() for t in (x, wg, wu, wdt))
    g = ind.double() if mode == "abs_act" else x64 @ g64.t()
    u = ind.double() if mode == "abs" else x64 @ u64.t()
    a = torch.nn.functional.silu(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    s = torch.where(keep, (u * a).to(x.dtype).double(), 0.0)  # the kernel rounds s to the model's dtype
    n_chunks = -(-d_inter // chunk)
    out = torch.zeros(n_chunks, n_tok, wdt.shape[1], dtype=torch.float64, device=x.device)
    for c in range(n_chunks):
        rows = slice(c * chunk, min((c + 1) * chunk, d_inter))
        out[c] = s[:, rows] @ d64[rows]
    return out


CASES = [  # (mode, dtype, act, k, n_tok, d_model, d_inter, config)
    ("abs", torch.bfloat16, "silu", 0.9, 3, 67, 131, dict(ROWS="chunk", CHUNK=32, TILE=16, BK=32, BN=32)),
    ("abs", torch.float32, "gelu_tanh", 0.5, 2, 64, 200, dict(ROWS="chunk", CHUNK=64, BK=16, BN=64, STAGES=2)),
    ("abs_act", torch.float16, "silu", 0.7, 5, 67, 131, dict(ROWS="chunk", CHUNK=64, TILE=16, BK=64, BN=16)),
    ("gt", torch.bfloat16, "silu", 0.8, 8, 67, 131, dict(BK=32, BN=64)),  # ROWS "auto": 44 rows a program
    ("gt", torch.float32, "gelu_tanh", 0.3, 4, 48, 97, dict(TILE=16)),  # 2-3 tiles a program
    ("gt", torch.float16, "silu", 0.0, 2, 40, 50, dict(ROWS="chunk", CHUNK=16)),   # every row kept
    ("abs", torch.float32, "silu", 1.0, 3, 40, 50, {}),  # no row kept: zero partials, all written
]


@pytest.mark.parametrize("mode,dtype,act,k,n_tok,d_model,d_inter,config", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-k{c[3]}-t{c[4]}-{c[6]}" for c in CASES])
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar-thr", "per-row-thr"])
def test_partials_are_each_chunks_rows_with_each_tokens_mask(mode, dtype, act, k, n_tok, d_model, d_inter,
                                                             config, per_row):
    x, wg, wu, wdt = _weights(n_tok, d_model, d_inter, dtype)
    if mode == "abs":
        ind = x @ wu.t()
        values = ind.float().abs()
    elif mode == "abs_act":
        ind = x @ wg.t()
        values = common.act_torch(ind.float(), act).abs()
    else:
        ind = torch.randn(n_tok, d_inter, device=DEVICE).to(dtype)
        values = ind.float()
    if per_row:  # every row its own threshold: a random fraction 1 - k above it for token 0
        above = torch.rand(d_inter, device=DEVICE) >= k
        thr = torch.where(above, values[0] - 0.5 * values[0].abs() - 0.05, values[0] + 0.5 * values[0].abs() + 0.05)
        keep = values > thr[None, :]
        thr_t, thr_f = thr.float(), 0.0
    else:
        thr_f = float(values.max()) + 1.0 if k >= 1 else (float(values.min()) - 1.0 if k <= 0
                                                          else float(torch.quantile(values.double(), k)))
        keep = values > thr_f
        thr_t = None
    p = few_tokens.few_tokens_partials(x, ind, wg, wu, wdt, thr_t, thr_f, mode, act,
                                       gate=mode != "abs_act", up=mode != "abs", config=config)
    chunk, _, progs = few_tokens._split(x.device, d_inter, launch_config("few_tokens", x.device, extra=config))
    assert p.shape == (few_tokens.n_chunks(x.device, d_inter, config), n_tok, d_model) == (progs, n_tok, d_model)
    assert not torch.isnan(p).any(), "a partial was not written"
    want = _expected_partials(x, wg, wu, wdt, ind, keep, act, chunk, mode)
    scale = max(1.0, want.abs().max().item())
    assert (p.double() - want).abs().max().item() <= TOL[dtype] * scale
    if 0 < k < 1 and not per_row:  # the masks differ between tokens: the union is not every token's set
        assert (keep.any(0) & ~keep.all(0)).any()


def test_bad_arguments_are_named():
    x, wg, wu, wdt = _weights(3, 32, 48, torch.float32)
    with pytest.raises(ValueError, match="indicator must be"):
        few_tokens.few_tokens_partials(x, torch.zeros(2, 48), wg, wu, wdt, None, 0.0, "abs", "silu", gate=True,
                                       up=False)
    with pytest.raises(ValueError, match="per-row threshold"):
        few_tokens.few_tokens_partials(x, x @ wu.t(), wg, wu, wdt, torch.zeros(47), 0.0, "abs", "silu", gate=True,
                                       up=False)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        x9 = torch.randn(9, 32, device=wu.device)
        few_tokens.few_tokens_partials(x9, x9 @ wu.t(), wg, wu, wdt, None, 0.0, "abs", "silu", gate=True, up=False)


@pytest.mark.parametrize("n_tok", [2, 5, 8])
def test_public_ops_route_few_tokens_here(n_tok):
    """mono, cats and dual with 2-8 tokens run this kernel (one call each) and match float64; one token
    and nine tokens do not come here."""
    calls = []
    with K.overrides(cuda_routes=("few_tokens",),
                     on_launch=lambda name, *a: calls.append(a[0].shape[0]) if name == "few_tokens" else None):
        _route_case(n_tok, calls)


def _route_case(n_tok, calls):
    from test_kernels import _check, _threshold  # noqa: E402  (the shared float64 rule)

    dtype, act = torch.bfloat16, "silu"
    x, wg, wu, wdt = _weights(n_tok, 67, 131, dtype)
    dbl = [t.double() for t in (x, wg, wu, wdt)]

    thr = _threshold((x @ wu.t()).float().abs(), 0.8, gap=0.05)
    out = K.mono_gated_mlp(x, wg, wu, wdt, thr, act)
    _check(out, K.mono_gated_mlp_ref(x, wg, wu, wdt, thr, act),
           K.gated_mlp_masked_ref(*dbl, K.mono_keep(x, wu, thr), act))

    thr = _threshold(common.act_torch((x @ wg.t()).float(), act).abs(), 0.7, gap=0.05)
    out = K.cats_gated_mlp(x, wg, wu, wdt, thr, act)
    _check(out, K.cats_gated_mlp_ref(x, wg, wu, wdt, thr, act),
           K.gated_mlp_masked_ref(*dbl, K.cats_keep(x, wg, thr, act), act))

    pa = (torch.randn(67, 16, device=DEVICE) / 67**0.5).to(dtype)
    pb = (torch.randn(16, 131, device=DEVICE) / 4).to(dtype)
    cut = _threshold(K.dual_scores(x, pa, pb).float(), 0.9, gap=0.05)
    out = K.dual_gated_mlp(x, wg, wu, wdt, pa, pb, cut, act)
    _check(out, K.dual_gated_mlp_ref(x, wg, wu, wdt, pa, pb, cut, act),
           K.gated_mlp_masked_ref(*dbl, K.dual_keep(x, pa, pb, cut), act))
    assert calls == [n_tok] * 3

    calls.clear()
    for n in (1, 9):
        xo = torch.randn(n, 67, device=DEVICE).to(dtype)
        K.mono_gated_mlp(xo, wg, wu, wdt, 0.5, act)
    assert calls == []
