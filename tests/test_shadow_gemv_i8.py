"""The one-token shadow GEMV with int8 x and integer dot products (kernels/shadow/gemv.py).

Against float64: u~ = x w~_up^T and g~ = x w~_gate^T of the dequantized shadows, within the kernel's
bound (x rounded to int8 per weight group: |err| <= sum_g (xs_g / 2) sum_{j in g} |w~_j|, plus float32
sums); and exactly against a float64 model of the same arithmetic (x rounded as the kernel rounds it,
the integer dot products, the scales), which any wrong nibble, byte or group would miss by far more
than float32's rounding. Under TRITON_INTERPRET=1 the portable path runs; on a GPU the inline-asm
(dp4a) path must give the portable path's outputs bit for bit.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels import common as _common  # noqa: E402
from countdown.kernels.config import launch_config  # noqa: E402
from countdown.kernels.shadow import gemv as _gemv_i8  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison():
    with K.overrides(poison_outputs=True):
        yield


def _shadows(d_model, d_inter, group, bits, dtype, seed):
    torch.manual_seed(seed)
    wg = torch.randn(d_inter, d_model) * d_model**-0.5
    wu = torch.randn(d_inter, d_model) * d_model**-0.5 * torch.rand(d_inter, 1)
    qg, sg = K.quantize_rtn(wg.to(dtype), bits, group)
    qu, su = K.quantize_rtn(wu.to(dtype), bits, group)
    prep = {k: v.to(DEV) for k, v in K.prepare_shadow(qg, sg, qu, su, bits).items()}
    return (qg, sg, qu, su), prep


def _x_int8(x, group):
    """x rounded as the kernel rounds it: per group xs = max|x| / 127, xq = round(x / xs), halves away
    from zero (float32 arithmetic, as the kernel's), as float64 (xs [G], xq [d_model])."""
    xf = x.float().reshape(-1, group)
    amax = xf.abs().amax(1)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    v = (xf * inv[:, None]).clamp(-127, 127)
    xq = torch.where(v >= 0, v + 0.5, v - 0.5).to(torch.int32)
    xs = torch.where(amax > 0, amax / 127.0, torch.zeros_like(amax))
    tie = ((v.abs() - v.abs().floor()) - 0.5).abs() < 1e-4  # float32 may round these either way
    return xs.double(), xq.reshape(-1).double(), tie.reshape(-1)


def _model(x, q, s, group):
    """float64 model of the kernel: sum_g s_g xs_g sum_{j in g} q_j xq_j for each row, and the slack for
    values of x within float32's rounding of a tie (one step of xq either way)."""
    xs, xq, tie = _x_int8(x, group)
    d_inter, d_model = q.shape
    dots = (q.double().reshape(d_inter, -1, group) * xq.reshape(1, -1, group)).sum(-1)  # exact integers
    slack = (q.double().abs() * tie.double()).reshape(d_inter, -1, group).sum(-1)
    return (dots * s.double() * xs[None]).sum(-1), (slack * s.double().abs() * xs[None]).sum(-1)


def _bound(x, deq64, group):
    """The kernel's error bound against x . deq rows (module docstring), plus the float32 sums."""
    xs, _, _ = _x_int8(x, group)
    per_group = deq64.abs().reshape(deq64.shape[0], -1, group).sum(-1)        # [N, G]
    mag = x.double().abs() @ deq64.abs().t()
    return 1.001 * (per_group * xs[None] / 2).sum(-1) + 4e-6 * mag + 1e-30


def _paths():
    return [False, True] if DEV == "cuda" else [False]


CASES = [  # (x dtype, d_model, d_inter, group, bits, x scale)
    (torch.float32, 128, 48, 64, 4, 1.0),    # 6 blocks of R = 8 rows, none partial: 2 a persistent program
    (torch.bfloat16, 192, 37, 32, 4, 3.0),
    (torch.float16, 256, 26, 128, 4, 0.1),
    (torch.bfloat16, 640, 21, 64, 4, 1e4),   # 10 groups (not a power of two)
    (torch.float32, 128, 33, 32, 8, 1e-6),
    (torch.bfloat16, 192, 40, 64, 8, 1.0),
]


@pytest.mark.parametrize("dtype,d_model,d_inter,group,bits,xs", CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}x{c[2]}-g{c[3]}-w{c[4]}" for c in CASES])
def test_gemv_i8_against_float64(dtype, d_model, d_inter, group, bits, xs):
    (qg, sg, qu, su), prep = _shadows(d_model, d_inter, group, bits, dtype, seed=d_model + bits)
    x = (torch.randn(1, d_model) * xs).to(dtype)
    x[0, 5] = 0.0
    x[0, -1] = 40 * xs  # an outlier: only its own group's rounding coarsens
    x64 = x.double()
    dg, du = K.dequantize(qg, sg, torch.float64), K.dequantize(qu, su, torch.float64)
    u64, g64 = x64 @ du.t(), x64 @ dg.t()
    (mu, su_), (mg, sg_) = _model(x, qu, su, group), _model(x, qg, sg, group)
    eu, eg = _bound(x, du, group), _bound(x, dg, group)
    assert ((mu - u64).abs() <= eu).all() and ((mg - g64).abs() <= eg).all()  # the bound holds for the model
    outs = []
    for asm, xpre in [(a, p) for a in _paths() for p in (False, True)]:  # XPRE: x prepared by its own kernel
        cfg = dict(ASM=asm, XPRE=xpre, PER_SM=0 if xpre else launch_config("shadow_gemv")["PER_SM"])
        o = _gemv_i8.launch(x.to(DEV), prep["q"], prep["scale"], None, cfg).cpu()
        assert o.shape == (2, 1, d_inter) and o.dtype == torch.float32 and not o.isnan().any()
        assert ((o[0].double() - u64).abs() <= eu).all(), f"asm={asm}: u~ off by {(o[0].double() - u64).abs().max()}"
        assert ((o[1].double() - g64).abs() <= eg).all(), f"asm={asm}: g~ off by {(o[1].double() - g64).abs().max()}"
        tol_u = 1e-5 * (x64.abs() @ du.abs().t())[0] + su_ + 1e-30
        tol_g = 1e-5 * (x64.abs() @ dg.abs().t())[0] + sg_ + 1e-30
        assert ((o[0, 0].double() - mu).abs() <= tol_u).all(), f"asm={asm}: not the kernel's own arithmetic"
        assert ((o[1, 0].double() - mg).abs() <= tol_g).all()
        for act in ("silu", "gelu_tanh"):
            s = _gemv_i8.launch(x.to(DEV), prep["q"], prep["scale"], act, cfg).cpu()
            assert s.shape == (1, d_inter) and not s.isnan().any()
            ref = (o[0].double() * _common.act_torch(o[1].double(), act)).abs()
            assert ((s.double() - ref).abs() <= 1e-5 * ref + 1e-12 * ref.max()).all()  # fp32 act of far-negative g
        outs.append(o)
    for o in outs[1:]:  # the same integers and sums whichever path and wherever x is prepared
        assert torch.equal(outs[0], o), "the dp4a path must give the portable path's integers"


def test_gemv_i8_error_is_much_smaller_than_the_shadows_own():
    """At a real model's scale of rows the int8 rounding of x moves u~ far less than the 4-bit shadow
    differs from the weight it stands for (what decides which rows are kept)."""
    d_model, d_inter, group = 512, 64, 64
    torch.manual_seed(4)
    w = torch.randn(d_inter, d_model) * d_model**-0.5
    q, s = K.quantize_rtn(w, 4, group)
    prep = {k: v.to(DEV) for k, v in K.prepare_shadow(q, s, q, s, 4).items()}
    x = torch.randn(1, d_model)
    o = _gemv_i8.launch(x.to(DEV), prep["q"], prep["scale"], None).cpu()[0, 0].double()
    deq = K.dequantize(q, s, torch.float64)
    err_x = (o - (x.double() @ deq.t())[0]).norm()
    err_w = ((x.double() @ w.double().t())[0] - (x.double() @ deq.t())[0]).norm()
    assert 0 < err_x < 0.2 * err_w


@pytest.fixture(scope="module")
def default_schedule():
    """The shadows, x, and the default schedule's outputs (u~ and g~; the SiLU scores) the variants below are
    compared with: launched once for all of them (outputs poisoned first, as in every test here)."""
    _, prep = _shadows(192, 29, 64, 4, torch.bfloat16, seed=9)  # 29 rows: a partial last block for every R
    x = torch.randn(1, 192).bfloat16().to(DEV)
    with K.overrides(poison_outputs=True):
        base = {act: _gemv_i8.launch(x, prep["q"], prep["scale"], act).cpu() for act in (None, "silu")}
    return prep, x, base


@pytest.mark.parametrize("config", [dict(PREFETCH=False, R=4), dict(R=8), dict(R=2, PER_SM=5),
                                    dict(XPRE=True, PER_SM=0, R=2), dict(XPRE=True, PREFETCH=False, R=4),
                                    dict(XPRE=True, PREFETCH=False, STAGES=3, R=4),
                                    dict(XPRE=True, XPRE_GB=1, XPRE_WARPS=1), dict(XPRE=True, XPRE_GB=2)])
def test_gemv_i8_launch_variants(config, default_schedule):
    """Other schedules give the same values (the same integers; the float32 sums in the same order)."""
    prep, x, base = default_schedule
    for act in (None, "silu"):
        other = _gemv_i8.launch(x, prep["q"], prep["scale"], act, config).cpu()
        assert torch.allclose(base[act], other, rtol=1e-6, atol=1e-7 * base[act].abs().max().item())


def test_gemv_i8_zero_rows_and_bad_input():
    (qg, sg, qu, su), prep = _shadows(128, 24, 64, 4, torch.float32, seed=3)
    o = _gemv_i8.launch(torch.zeros(1, 128, device=DEV), prep["q"], prep["scale"], None).cpu()
    assert torch.equal(o, torch.zeros_like(o))
    qg[7] = 0
    prep = {k: v.to(DEV) for k, v in K.prepare_shadow(qg, sg, qu, su, 4).items()}
    o = _gemv_i8.launch(torch.randn(1, 128, device=DEV), prep["q"], prep["scale"], None).cpu()
    assert o[1, 0, 7].item() == 0.0 and (o[1, 0, :7] != 0).all()
    with pytest.raises(ValueError, match="one-token int8"):
        _gemv_i8.launch(torch.randn(2, 128, device=DEV), prep["q"], prep["scale"], None)


def test_one_token_route_takes_it():
    """The shadow MLP's one-token indicator and shadow_scores come from this kernel; the MLP is exact on the rows
    it keeps."""
    d_model, d_inter = 128, 96
    (qg, sg, qu, su), prep = _shadows(d_model, d_inter, 64, 4, torch.bfloat16, seed=11)
    torch.manual_seed(12)
    x = torch.randn(1, d_model).bfloat16()
    wg, wu, wdt = ((torch.randn(d_inter, d_model) * d_model**-0.5).bfloat16() for _ in range(3))
    calls = []
    # the one-token kernel as on CUDA; the spy records each launch's activation (None: the scores, not |u~ act(g~)|)
    with K.overrides(cuda_routes=("one_token",),
                     on_launch=lambda name, *a: calls.append(a[1]) if name == "shadow_gemv" else None):
        u, g = K.shadow_scores(x.to(DEV), prep)
        assert calls == [None]
        ind = (u * torch.nn.functional.silu(g)).abs().cpu()
        cut = torch.quantile(ind.double(), 0.7).item()
        out = K.shadow_dual_gated_mlp(x.to(DEV), prep, torch.tensor(cut, device=DEV), wg.to(DEV), wu.to(DEV),
                                      wdt.to(DEV), "silu").cpu()
    assert calls == [None, "silu"]
    keep = ind > cut
    ref64 = K.gated_mlp_masked_ref(x.double(), wg.double(), wu.double(), wdt.double(), keep, "silu")
    ref_t = K.gated_mlp_masked_ref(x, wg, wu, wdt, keep, "silu")
    err = (out.double() - ref64).abs()
    assert (err <= 2 * (ref_t.double() - ref64).abs() + 1e-2 * ref64.abs().max()).all()
