"""The shadow indicator's format (kernels/quant.py) and its kernels (shadow.py, hybrid.py, _select.py).

Format: hand-worked RTN examples, round trips, packing at every bit width. Kernels (Triton's
interpreter on CPU, small odd shapes): shadow scores against the float64 product of x and the
dequantized shadows; keep masks equal to the float64 reference's (the cut sits in a gap between scores
wider than the float32 error bound, checked); outputs against float64 with the flash-attention rule
(|out - ref64| <= 2 |torch_same_precision - ref64| + atol), every output poisoned with NaN first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels import common as _common  # noqa: E402
from countdown.kernels.shadow import format as quant  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# ------------------------------------------------------------------------------------ the format
def test_quantize_hand_example():
    w = torch.tensor([[0.7, -0.35, 0.0, 0.0], [1.0, 0.5, -2.0, 0.1]])
    q, s = K.quantize_rtn(w, bits=4, group=2)
    # scales: fp16(0.7 / 7), an all-zero group -> 1, fp16(1 / 7), fp16(2 / 7)
    assert s.dtype == torch.float16
    assert s.float().tolist() == [[0.0999755859375, 1.0], [0.142822265625, 0.28564453125]]
    # 0.7 / 0.09998 = 7.002 -> 7; -0.35 / 0.09998 = -3.5009 -> -4; 0.5 / 0.14282 = 3.5009 -> 4;
    # -2 / 0.28564 = -7.0017 -> -7; 0.1 / 0.28564 = 0.35 -> 0
    assert q.dtype == torch.int8 and q.tolist() == [[7, -4, 0, 0], [7, 4, -7, 0]]
    assert K.dequantize(q, s)[0, 1].item() == pytest.approx(-4 * 0.0999755859375, abs=0)
    q2, s2 = K.quantize_rtn(w, bits=2, group=4)  # qmax 1: scale = amax, q = round(w / amax)
    assert s2.float().tolist() == [[torch.tensor(0.7).half().item()], [2.0]]
    assert q2.tolist() == [[1, 0, 0, 0], [0, 0, -1, 0]]  # 0.35 / 0.7 = 0.5 rounds to even: 0


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantize_round_trip(bits):
    torch.manual_seed(bits)
    w = torch.randn(37, 96) * torch.rand(37, 1) * 3
    w[3, 32:64] = 0.0
    q, s = K.quantize_rtn(w.bfloat16(), bits, 32)
    qmax = 2 ** (bits - 1) - 1
    assert q.abs().max().item() == qmax and s.shape == (37, 3)
    deq = K.dequantize(q, s, torch.float64)
    scale = s.double().repeat_interleave(32, dim=1)
    wb = w.bfloat16().double()
    assert ((deq - wb).abs() <= scale / 2 * (1 + 1e-3) + 1e-12).all()  # round to nearest
    assert s[3, 1].item() == 1.0 and (q[3, 32:64] == 0).all()
    assert (q.reshape(37, 3, 32).abs().amax(-1)[s != 1] == qmax).all()  # each group's max hits qmax


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="multiple of group"):
        K.quantize_rtn(torch.randn(4, 96), 4, 64)
    with pytest.raises(ValueError, match="bits must be one of"):
        K.quantize_rtn(torch.randn(4, 64), 5, 32)
    with pytest.raises(ValueError, match="whole number of bytes"):
        K.pack_bits(torch.zeros(2, 4, dtype=torch.int8), 3)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack(bits):
    torch.manual_seed(0)
    qmax = 2 ** (bits - 1) - 1
    q = torch.randint(-qmax, qmax + 1, (5, 48), dtype=torch.int8)
    p = K.pack_bits(q, bits)
    assert p.dtype == torch.uint8 and p.shape == (5, 48 * bits // 8)
    assert torch.equal(K.unpack_bits(p, bits, 48), q)
    # independent: the row's bit stream as one Python integer, value k at bits [k bits, (k + 1) bits)
    stream = sum((int(v) + 2 ** (bits - 1)) << (bits * k) for k, v in enumerate(q[2].tolist()))
    assert p[2].tolist() == [(stream >> (8 * b)) & 0xFF for b in range(p.shape[1])]


def test_pack_4bit_hand_example():
    q = torch.tensor([[-7, 7, 0, 1, -1, 2, 3, -3]], dtype=torch.int8)
    # n = q + 8 = 1, 15, 8, 9, 7, 10, 11, 5; byte b = n[2b] | n[2b + 1] << 4
    assert K.pack_bits(q, 4).tolist() == [[0xF1, 0x98, 0xA7, 0x5B]]
    assert quant.shadow_bytes(14336, 4096, 4, 64) == 2 * (14336 * 2048 + 14336 * 64 * 2)


# ------------------------------------------------------------------------------------ the kernels
@pytest.fixture(autouse=True)
def _poison():
    launch = {}
    if not torch.cuda.is_available():  # the interpreter: fewer, larger programs (each op costs the same)
        launch = {"select": dict(ROWS=32, TILE_W=64, BLOCK_M=16),
                  ("select", ("shadow", 8)): dict(TILE_W=16)}  # several tiles per row
    with K.overrides(poison_outputs=True, launch=launch):
        yield


CASES = [  # (dtype, batch, activation, d_model, d_inter, group, bits)
    (torch.float32, 1, "silu", 128, 96, 64, 4),
    (torch.bfloat16, 1, "gelu_tanh", 192, 320, 32, 4),
    (torch.bfloat16, 2, "silu", 64, 131, 32, 4),
    (torch.float32, 5, "gelu_tanh", 128, 200, 64, 4),
    (torch.bfloat16, 5, "silu", 192, 97, 64, 8),
    (torch.float32, 1, "silu", 64, 100, 32, 8),
]
IDS = [f"{str(d)[6:]}-b{b}-{a}-{dm}x{di}-g{g}-w{bits}" for d, b, a, dm, di, g, bits in CASES]


def _problem(dtype, batch, d_model, d_inter, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(batch, d_model).to(dtype)
    ws = [(torch.randn(d_inter, d_model) * s).to(dtype) for s in (d_model**-0.5, d_model**-0.5, d_inter**-0.5)]
    return x, *ws


def _gap_cut(score64: torch.Tensor, margin: torch.Tensor, k: float) -> float:
    """A cut near the k-quantile of the scores with no score within its error margin."""
    order = score64.flatten().argsort()
    v, m = score64.flatten()[order], margin.flatten()[order]
    i0 = int(k * v.numel())
    for j in sorted(range(1, v.numel()), key=lambda j: abs(j - i0)):
        mid = (v[j - 1] + v[j]) / 2
        if (v[j - 1] + m[j - 1] < mid) and (v[j] - m[j] > mid):
            return mid.item()
    raise AssertionError("no gap wide enough for a cut")


def _check(out, out_torch, ref64):
    assert out.dtype == out_torch.dtype and out.shape == ref64.shape
    assert not torch.isnan(out).any(), "an output element was not written"
    err = (out.double() - ref64).abs()
    bound = 2 * (out_torch.double() - ref64).abs() + ATOL[out.dtype] * max(1.0, ref64.abs().max().item())
    assert (err - bound).max().item() <= 0, f"max err {err.max().item():.3e}"


@pytest.mark.parametrize("dtype,batch,act,d_model,d_inter,group,bits", CASES, ids=IDS)
def test_shadow_kernel(dtype, batch, act, d_model, d_inter, group, bits):
    # one token: the fp32 shadow GEMVs (sparse_mlp/select.py), whose tight bound lets a cut clear every score's
    # error, instead of the int8 x GEMV, which has its own tests (tests/test_shadow_gemv_i8.py, the route included)
    fp32 = {("shadow_scores", dev): ("select", "select", "select") for dev in ("cuda", "interpreter")}
    with K.overrides(routes=fp32):
        _shadow_case(dtype, batch, act, d_model, d_inter, group, bits)


def _shadow_case(dtype, batch, act, d_model, d_inter, group, bits):
    x, wg, wu, wdt = _problem(dtype, batch, d_model, d_inter)
    qg, sg = K.quantize_rtn(wg, bits, group)
    qu, su = K.quantize_rtn(wu, bits, group)
    prep = K.prepare_shadow(qg, sg, qu, su, bits)
    assert prep["q"].dtype == torch.int32  # the kernel's layout, not the reference fallback
    # float64 references of the shadow GEMVs, and the float32 error bound of any summation order
    x64, dg, du = x.double(), K.dequantize(qg, sg, torch.float64), K.dequantize(qu, su, torch.float64)
    u64, g64 = x64 @ du.t(), x64 @ dg.t()
    gamma = 2 * d_model * 2.0**-24
    eu, eg = gamma * (x64.abs() @ du.abs().t()), gamma * (x64.abs() @ dg.abs().t())
    ut, gt = K.shadow_scores(x, prep)
    assert ut.dtype == torch.float32 and ut.shape == (batch, d_inter)
    assert ((ut.double() - u64).abs() <= eu + 1e-30).all()
    assert ((gt.double() - g64).abs() <= eg + 1e-30).all()
    # the cut: about 80 % of the rows skipped, no row's score within its float32 error of the cut
    a64 = _common.act_torch(g64, act)
    score64 = (u64 * a64).abs()
    margin = eu * a64.abs() + u64.abs() * 1.2 * eg + 1e-6 * score64
    cut = _gap_cut(score64, margin, 0.8)
    keep64 = score64 > cut
    assert torch.equal(K.shadow_keep_ref(x, qg, sg, qu, su, cut, act), keep64)
    skipped = 1 - keep64.float().mean().item()
    assert 0.7 <= skipped <= 0.9
    cut_t = torch.tensor(cut, dtype=torch.float32)
    out = K.shadow_dual_gated_mlp(x, prep, cut_t, wg, wu, wdt, act)
    out_torch = K.shadow_dual_gated_mlp_ref(x, qg, sg, qu, su, cut_t, wg, wu, wdt, act)
    ref64 = K.gated_mlp_masked_ref(x64, wg.double(), wu.double(), wdt.double(), keep64, act)
    _check(out, out_torch, ref64)
    if batch > 1:  # each token's own rows: the union's extra rows must contribute nothing
        assert not torch.equal(keep64[0], keep64.any(0))


@pytest.mark.parametrize("dtype,batch,act", [(torch.float32, 1, "silu"), (torch.bfloat16, 1, "gelu_tanh"),
                                             (torch.bfloat16, 5, "silu"), (torch.float32, 2, "gelu_tanh")])
def test_hybrid_kernel(dtype, batch, act):
    d_model, d_inter, rank = 96, 210, 24
    x, wg, wu, wdt = _problem(dtype, batch, d_model, d_inter, seed=1)
    a = (torch.randn(d_model, rank) * d_model**-0.5).to(dtype)
    bt = (torch.randn(d_inter, rank) * rank**-0.5).to(dtype)
    bias = 0.3 * torch.randn(d_inter)
    u, latent = x @ wu.t(), x @ a
    # g^ is rounded to latent's dtype after a float32 sum: the margin covers both roundings
    gh32 = (latent.float() @ bt.float().t())
    gh = gh32.to(dtype).double() + bias.double()
    score = u.double().abs() * _common.act_torch(gh, act).abs()
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
    margin = score * 1e-5 + u.double().abs() * 1.2 * (gh32.double().abs() * ulp + 1e-4)
    cut = _gap_cut(score, margin, 0.8)
    keep64 = score > cut
    assert torch.equal(K.hybrid_keep(u, latent, bt, bias, cut, act), keep64)
    cut_t = torch.tensor(cut, dtype=torch.float32)
    out = K.hybrid_gated_mlp(x, u, latent, bt, bias, cut_t, wg, wdt, act)
    out_torch = K.hybrid_gated_mlp_ref(x, u, latent, bt, bias, cut_t, wg, wdt, act)
    s64 = u.double() * _common.act_torch(x.double() @ wg.double().t(), act)
    ref64 = torch.where(keep64, s64, 0.0) @ wdt.double()
    _check(out, out_torch, ref64)


def test_shadow_reference_path_and_errors():
    """3 bits take the reference path (int8 layout) and agree with quant.py's reference; bad input
    is refused with a message naming the problem."""
    x, wg, wu, wdt = _problem(torch.float32, 2, 64, 40)
    qg, sg = K.quantize_rtn(wg, 3, 32)
    qu, su = K.quantize_rtn(wu, 3, 32)
    prep = K.prepare_shadow(qg, sg, qu, su, 3)
    assert prep["q"].dtype == torch.int8
    out = K.shadow_dual_gated_mlp(x, prep, 0.05, wg, wu, wdt, "silu")
    assert torch.equal(out, K.shadow_dual_gated_mlp_ref(x, qg, sg, qu, su, 0.05, wg, wu, wdt, "silu"))
    with pytest.raises(ValueError, match="d_inter"):
        K.shadow_dual_gated_mlp(x, prep, 0.05, wg[:39], wu[:39], wdt[:39], "silu")
    with pytest.raises(ValueError, match="prepare_shadow"):
        K.shadow_dual_gated_mlp(x, {"q": qg, "scale": sg}, 0.05, wg, wu, wdt, "silu")
