"""The one-token shadow GEMV (kernels/_gemv.py): fp16x2 dequantization, x kept in registers.

Against float64: u~ = x w~_up^T and g~ = x w~_gate^T of the dequantized shadows, within the kernel's
error bound (fp16 products and lane sums: |err| <= 5 * 2**-11 * (|x| |w~|^T), plus the float32
sums); the indicator |u~ act(g~)| against the same computed in float64 from the kernel's own u~, g~;
its op (countdown::shadow_gemv) against the launch; the indicator fed to _onepass.py's sparse kernel
against the float64 MLP on the rows it keeps, and those rows against float64's keep mask wherever a
score is farther from the cut than its error bound. (The routes' one-token shadow GEMV is _gemv_i8.py's.) Under TRITON_INTERPRET=1 the portable path runs;
on a GPU both paths (inline asm and portable) are checked.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _common, _gemv, _onepass  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U16 = 2.0**-11


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)


def _shadows(d_model, d_inter, group, bits, dtype, seed):
    torch.manual_seed(seed)
    wg = torch.randn(d_inter, d_model) * d_model**-0.5
    wu = torch.randn(d_inter, d_model) * d_model**-0.5 * torch.rand(d_inter, 1)
    qg, sg = K.quantize_rtn(wg.to(dtype), bits, group)
    qu, su = K.quantize_rtn(wu.to(dtype), bits, group)
    prep = {k: v.to(DEV) for k, v in K.prepare_shadow(qg, sg, qu, su, bits).items()}
    return (qg, sg, qu, su), prep


def _bound(x64, deq64, d_model, n_groups):
    """The kernel's error bound for x . deq rows (module docstring of _gemv.py)."""
    mag = x64.abs() @ deq64.abs().t()
    return (5 * U16 + (d_model + n_groups + 8) * 2.0**-24) * mag * 1.01 + 1e-30


def _paths():
    return [False, True] if DEV == "cuda" else [False]


CASES = [  # (x dtype, d_model, d_inter, group, bits, x scale)
    (torch.float32, 128, 96, 64, 4, 1.0),
    (torch.bfloat16, 192, 37, 32, 4, 3.0),
    (torch.float16, 256, 50, 128, 4, 0.1),
    (torch.bfloat16, 640, 21, 64, 4, 1e4),   # 10 groups (not a power of two); x past fp16's range
    (torch.float32, 128, 33, 32, 8, 1e-6),   # x far below fp16's normal range
    (torch.bfloat16, 192, 40, 64, 8, 1.0),
]


@pytest.mark.parametrize("dtype,d_model,d_inter,group,bits,xs", CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}x{c[2]}-g{c[3]}-w{c[4]}" for c in CASES])
def test_gemv_against_float64(dtype, d_model, d_inter, group, bits, xs):
    (qg, sg, qu, su), prep = _shadows(d_model, d_inter, group, bits, dtype, seed=d_model + bits)
    x = (torch.randn(1, d_model) * xs).to(dtype)
    x[0, 5] = 0.0
    x64 = x.double()
    dg, du = K.dequantize(qg, sg, torch.float64), K.dequantize(qu, su, torch.float64)
    u64, g64 = x64 @ du.t(), x64 @ dg.t()
    eu, eg = _bound(x64, du, d_model, d_model // group), _bound(x64, dg, d_model, d_model // group)
    for asm in _paths():
        o = _gemv.launch(x.to(DEV), prep["q"], prep["scale"], None, dict(ASM=asm)).cpu()
        assert o.shape == (2, 1, d_inter) and o.dtype == torch.float32 and not o.isnan().any()
        assert ((o[0].double() - u64).abs() <= eu).all(), f"asm={asm}: u~ off by {(o[0].double() - u64).abs().max()}"
        assert ((o[1].double() - g64).abs() <= eg).all(), f"asm={asm}: g~ off by {(o[1].double() - g64).abs().max()}"
        for act in ("silu", "gelu_tanh"):
            s = _gemv.launch(x.to(DEV), prep["q"], prep["scale"], act, dict(ASM=asm)).cpu()
            assert s.shape == (1, d_inter) and not s.isnan().any()
            ref = (o[0].double() * _common.act_torch(o[1].double(), act)).abs()
            assert ((s.double() - ref).abs() <= 1e-5 * ref + 1e-30 * ref.max()).all()


@pytest.fixture(scope="module")
def default_schedule():
    """The shadows, x, and the default schedule's outputs (u~ and g~; the SiLU scores) the variants below are
    compared with: launched once for all of them (outputs poisoned first, as in every test here)."""
    (qg, sg, qu, su), prep = _shadows(192, 45, 64, 4, torch.bfloat16, seed=9)
    x = torch.randn(1, 192).bfloat16().to(DEV)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_common, "POISON_OUTPUTS", True)
        base = {act: _gemv.launch(x, prep["q"], prep["scale"], act).cpu() for act in (None, "silu")}
    return prep, x, base


@pytest.mark.parametrize("config", [dict(AHEAD=2, PIN=True, R=2), dict(PREFETCH=False, R=4),
                                    dict(PIN=True, R=8)])
def test_gemv_launch_variants(config, default_schedule):
    """The kernel's other schedules (prefetch two blocks ahead or none, loads pinned, other block sizes)
    compute the same values as the default one (the same products; on a GPU the float32 sums may be
    grouped differently)."""
    prep, x, base = default_schedule
    for act in (None, "silu"):
        other = _gemv.launch(x, prep["q"], prep["scale"], act, config).cpu()
        assert torch.allclose(base[act], other, rtol=1e-5, atol=1e-6 * base[act].abs().max().item())


def test_gemv_zero_and_tiny_rows():
    """x = 0 gives exact zeros; a row whose shadow is all zero gives 0 for any x."""
    (qg, sg, qu, su), prep = _shadows(128, 24, 64, 4, torch.float32, seed=3)
    o = _gemv.launch(torch.zeros(1, 128, device=DEV), prep["q"], prep["scale"], None).cpu()
    assert torch.equal(o, torch.zeros_like(o))
    qg[7] = 0
    sg[7] = 1.0
    prep = {k: v.to(DEV) for k, v in K.prepare_shadow(qg, sg, qu, su, 4).items()}
    o = _gemv.launch(torch.randn(1, 128, device=DEV), prep["q"], prep["scale"], None).cpu()
    assert o[1, 0, 7].item() == 0.0 and (o[1, 0, :7] != 0).all()


def test_gemv_bad_input():
    _, prep = _shadows(64, 8, 32, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="one-token"):
        _gemv.launch(torch.randn(2, 64, device=DEV), prep["q"], prep["scale"], None)


def test_the_op_is_the_launch():
    """countdown::shadow_gemv (an opaque op, torch.compile-able): (u~, g~) or the indicator, as the launch gives
    them, and within the kernel's bound of float64."""
    (qg, sg, qu, su), prep = _shadows(128, 40, 32, 4, torch.bfloat16, seed=5)
    x = torch.randn(1, 128).bfloat16()
    o = torch.ops.countdown.shadow_gemv(x.to(DEV), prep["q"], prep["scale"], "silu", False)
    assert o.shape == (2, 1, 40) and torch.equal(o, _gemv.launch(x.to(DEV), prep["q"], prep["scale"], None))
    ind = torch.ops.countdown.shadow_gemv(x.to(DEV), prep["q"], prep["scale"], "silu", True)
    assert ind.shape == (1, 40) and torch.equal(ind, _gemv.launch(x.to(DEV), prep["q"], prep["scale"], "silu"))
    du = K.dequantize(qu, su, torch.float64)
    assert ((o[0].cpu().double() - x.double() @ du.t()).abs() <= _bound(x.double(), du, 128, 4)).all()


@pytest.mark.parametrize("dtype,act", [(torch.bfloat16, "silu"), (torch.float32, "gelu_tanh")])
def test_indicator_into_the_sparse_kernel(dtype, act):
    """The indicator from _gemv.py into _onepass.py's sparse kernel. Exact MLP on the rows the indicator keeps;
    those rows are float64's wherever the score is clear of the cut."""
    d_model, d_inter = 128, 160
    (qg, sg, qu, su), prep = _shadows(d_model, d_inter, 64, 4, dtype, seed=11)
    torch.manual_seed(12)
    x = torch.randn(1, d_model).to(dtype)
    wg, wu = (K.dequantize(q, s, torch.float32) + 0.01 * torch.randn(d_inter, d_model) for q, s in ((qg, sg), (qu, su)))
    wg, wu = wg.to(dtype), wu.to(dtype)
    wdt = (torch.randn(d_inter, d_model) * d_inter**-0.5).to(dtype)
    x64 = x.double()
    dg, du = K.dequantize(qg, sg, torch.float64), K.dequantize(qu, su, torch.float64)
    u64, g64 = x64 @ du.t(), x64 @ dg.t()
    a64 = _common.act_torch(g64, act)
    score64 = (u64 * a64).abs()
    cut = torch.quantile(score64, 0.8).item()
    ind = _gemv.launch(x.to(DEV), prep["q"], prep["scale"], act).cpu()
    keep = ind > cut
    # where the score is farther from the cut than its error, the kernel keeps exactly float64's rows
    slope = 1.2 * (a64.abs() * _bound(x64, du, d_model, 2) + u64.abs() * _bound(x64, dg, d_model, 2))
    clear = (score64 - cut).abs() > slope + 1e-5 * score64
    assert clear.float().mean() > 0.5 and torch.equal(keep[clear], (score64 > cut)[clear])
    out = _onepass.onepass_mlp(x.to(DEV), wg.to(DEV), wu.to(DEV), wdt.to(DEV), torch.tensor(cut, device=DEV), 0.0,
                               "gt", act, gate=True, up=True, ind=ind.to(DEV)).cpu()
    ref64 = K.gated_mlp_masked_ref(x64, wg.double(), wu.double(), wdt.double(), keep, act)
    ref_t = K.gated_mlp_masked_ref(x, wg, wu, wdt, keep, act)
    err = (out.double() - ref64).abs()
    atol = (1e-2 if dtype == torch.bfloat16 else 1e-5) * max(1.0, ref64.abs().max().item())
    assert out.dtype == dtype and (err <= 2 * (ref_t.double() - ref64).abs() + atol).all()
