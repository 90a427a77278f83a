"""The TEAL Triton kernel (countdown.kernels.teal_gated_mlp) against a float64 reference.

flash-attention's rule, as in test_kernels.py: |out - ref64| <= 2 |out_torch - ref64| + atol, with ref64
the same maths in float64 under the masks the op keeps, and out_torch the plain PyTorch op at the
input precision. Outputs are poisoned with NaN first. Without CUDA it runs in Triton's interpreter on
small odd shapes; COUNTDOWN_KERNEL_TEST_SHAPES=real runs Llama-3.1-8B's MLP shape on a GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

import countdown.kernels as K  # noqa: E402
from countdown.kernels import common as _common  # noqa: E402
from countdown.kernels.teal import kernels as _teal  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REAL = os.environ.get("COUNTDOWN_KERNEL_TEST_SHAPES", "") == "real"
D_MODEL, D_INTER = (4096, 14336) if REAL else (67, 131)
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _poison():
    with K.overrides(poison_outputs=True):
        torch.manual_seed(0)
        yield


def _weights(dtype, fused=False, d_model=D_MODEL, d_inter=D_INTER):
    """W_gate^T, W_up^T [d_model, d_inter] (as views of one [d_model, 2 d_inter] matrix when ``fused``,
    the layout of a transposed Phi-3 gate_up) and W_down^T [d_inter, d_model]."""
    if fused:
        both = (torch.randn(d_model, 2 * d_inter, device=DEVICE) / d_model**0.5).to(dtype)
        wg_t, wu_t = both[:, :d_inter], both[:, d_inter:]
    else:
        wg_t = (torch.randn(d_model, d_inter, device=DEVICE) / d_model**0.5).to(dtype)
        wu_t = (torch.randn(d_model, d_inter, device=DEVICE) / d_model**0.5).to(dtype)
    wd_t = (torch.randn(d_inter, d_model, device=DEVICE) / d_inter**0.5).to(dtype)
    return wg_t, wu_t, wd_t


def _cuts(x, wg_t, wu_t, act, k):
    cut_x = _common.gap_cut(x.float().abs(), k, 1e-3)
    xt = torch.where(x.float().abs() > cut_x, x.double(), 0.0)
    s = (xt @ wu_t.double()) * _common.act_torch(xt @ wg_t.double(), act)
    # half precision rounds g and u differently in the kernel (fp32) and in PyTorch: a wide gap
    return cut_x, _common.gap_cut(s.abs(), k, 3e-2 if x.dtype != torch.float32 else 1e-4)


def _check(out, out_torch, ref64):
    assert out.dtype == out_torch.dtype and out.shape == ref64.shape
    assert not torch.isnan(out).any(), "an output element was not written"
    err = (out.double() - ref64).abs()
    bound = 2 * (out_torch.double() - ref64).abs() + ATOL[out.dtype] * max(1.0, ref64.abs().max().item())
    assert (err - bound).max().item() <= 0, f"max err {err.max().item():.3e}"


CASES = [  # (dtype, batch, activation, k, fused layout)
    (torch.float32, 1, "silu", 0.5, False),
    (torch.bfloat16, 1, "gelu_tanh", 0.7, True),
    (torch.float16, 1, "silu", 0.9, False),
    (torch.float32, 3, "gelu_tanh", 0.4, True),
    (torch.bfloat16, 8, "silu", 0.5, False),
    (torch.float16, 5, "silu", 0.8, True),
]


@pytest.mark.parametrize("dtype,batch,act,k,fused", CASES,
                         ids=[f"{str(c[0])[6:]}-b{c[1]}-{c[2]}-k{c[3]}{'-fused' if c[4] else ''}" for c in CASES])
def test_teal_kernel(dtype, batch, act, k, fused):
    x = torch.randn(batch, D_MODEL, device=DEVICE).to(dtype)
    wg_t, wu_t, wd_t = _weights(dtype, fused)
    cut_x, cut_s = _cuts(x, wg_t, wu_t, act, k)
    out = K.teal_gated_mlp(x, wg_t, wu_t, wd_t, torch.tensor(cut_x, device=DEVICE), cut_s, act)
    out_torch, keep_x, keep_s = K.teal_gated_mlp_ref(x, wg_t, wu_t, wd_t, cut_x, cut_s, act, return_masks=True)
    assert 0 < keep_x.float().mean() < 1 and 0 < keep_s.float().mean() < 1
    ref64 = K.teal_masked_ref(x.double(), wg_t.double(), wu_t.double(), wd_t.double(), keep_x, keep_s, act)
    _check(out, out_torch, ref64)


@pytest.mark.parametrize("kept", ["all", "none", "one token none"])
def test_all_or_nothing_kept(kept):
    x = torch.randn(3, D_MODEL, device=DEVICE)
    wg_t, wu_t, wd_t = _weights(torch.float32)
    cut_x, cut_s = {"all": (-1.0, -1.0), "none": (1e9, -1.0)}.get(kept, (-1.0, -1.0))
    if kept == "one token none":
        x[1] = 0.0  # |0| > 0 is false: this token keeps no input entry
        cut_x = 0.0
    out = K.teal_gated_mlp(x, wg_t, wu_t, wd_t, cut_x, cut_s, "silu")
    ref, keep_x, keep_s = K.teal_gated_mlp_ref(x, wg_t, wu_t, wd_t, cut_x, cut_s, "silu", return_masks=True)
    _check(out, ref, K.teal_masked_ref(*(t.double() for t in (x, wg_t, wu_t, wd_t)), keep_x, keep_s, "silu"))
    if kept == "none":
        assert torch.equal(out, torch.zeros_like(out))


def test_leading_dims_and_fallback():
    x = torch.randn(2, 1, D_MODEL, device=DEVICE)
    wg_t, wu_t, wd_t = _weights(torch.float32)
    out = K.teal_gated_mlp(x, wg_t, wu_t, wd_t, 0.3, 0.01)
    assert out.shape == x.shape
    with K.overrides(triton=False):  # the reference, as without Triton
        torch.testing.assert_close(K.teal_gated_mlp(x, wg_t, wu_t, wd_t, 0.3, 0.01), out, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_clear_errors():
    x = torch.randn(1, D_MODEL, device=DEVICE)
    wg_t, wu_t, wd_t = _weights(torch.float32)
    with pytest.raises(ValueError, match="w_gate_t must be W_gate transposed"):
        K.teal_gated_mlp(x, wg_t.t(), wu_t, wd_t, 0.1, 0.1)
    with pytest.raises(ValueError, match="w_down_t must be"):
        K.teal_gated_mlp(x, wg_t, wu_t, wd_t.t(), 0.1, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        K.teal_gated_mlp(x.half(), wg_t.half(), wu_t.half(), wd_t, 0.1, 0.1)
    with pytest.raises(ValueError, match="thr_s must be one value"):
        K.teal_gated_mlp(x, wg_t, wu_t, wd_t, 0.1, torch.ones(3))
    with pytest.raises(ValueError, match="activation"):
        K.teal_gated_mlp(x, wg_t, wu_t, wd_t, 0.1, 0.1, "relu")


def test_torch_compile_fullgraph():
    x = torch.randn(1, D_MODEL, device=DEVICE)
    wg_t, wu_t, wd_t = _weights(torch.float32)
    cx, cs = torch.tensor(0.5, device=DEVICE), torch.tensor(0.01, device=DEVICE)
    eager = K.teal_gated_mlp(x, wg_t, wu_t, wd_t, cx, cs)
    compiled = torch.compile(lambda v: K.teal_gated_mlp(v, wg_t, wu_t, wd_t, cx, cs), fullgraph=True,
                             backend="eager" if DEVICE == "cpu" else "inductor")
    torch.testing.assert_close(compiled(x), eager, rtol=1e-5, atol=1e-6)


# Small launch configurations, so that the small shapes run several input-channel splits, column
# blocks and intermediate blocks, with tiles that do not divide the kept counts. The shapes are smaller
# than the other tests' (the interpreter's time goes with the programs: 9 a launch, not 25), still prime and
# still 3 of each, the last one partial: d_model 47 = 3 splits of KS 16 (16, 16, 15) and 3 down column
# blocks of BN2 16; d_inter 67 = 3 gate/up column blocks of BN 32 (32, 32, 3) and 3 blocks of FB 32.
SMALL = dict(KS=16, BN=32, BM=4, BN2=16, BM2=4)
SMALL_D_MODEL, SMALL_D_INTER = 47, 67
SMALL_CASES = [  # (dtype, batch, k, kept: "some" / "all" / "none")
    (torch.float32, 1, 0.5, "some"),
    (torch.bfloat16, 1, 0.9, "some"),
    (torch.float16, 3, 0.7, "some"),
    (torch.bfloat16, 3, 0.5, "some"),
    (torch.float32, 17, 0.6, "some"),  # two token groups
    (torch.float32, 1, 0.0, "all"),
    (torch.float32, 3, 0.0, "all"),
    (torch.bfloat16, 1, 0.0, "none"),
    (torch.float32, 3, 0.0, "none"),
]


@pytest.mark.skipif(DEVICE == "cuda", reason="tiles this small (a dot over fewer than 16 rows) compile only "
                    "for the interpreter; the GPU's configurations are checked by the other tests")
@pytest.mark.parametrize("fuse", [False, True], ids=["finish-kernel", "finish-fused"])
@pytest.mark.parametrize("dtype,batch,k,kept", SMALL_CASES,
                         ids=[f"{str(c[0])[6:]}-b{c[1]}-k{c[2]}-{c[3]}" for c in SMALL_CASES])
def test_small_tiles_splits_and_blocks(dtype, batch, k, kept, fuse):
    """Both ways of finishing s: its own kernel, or inside each down program (config FUSE)."""
    with K.overrides(launch={"teal": dict(FB=32)}):
        _small_case(dtype, batch, k, kept, fuse)


def _small_case(dtype, batch, k, kept, fuse):
    x = torch.randn(batch, SMALL_D_MODEL, device=DEVICE).to(dtype)
    wg_t, wu_t, wd_t = _weights(dtype, fused=batch == 3, d_model=SMALL_D_MODEL, d_inter=SMALL_D_INTER)
    if kept == "some":
        cut_x, cut_s = _cuts(x, wg_t, wu_t, "silu", k)
    else:
        cut_x, cut_s = (-1.0, -1.0) if kept == "all" else (1e9, 1e9)
    out = _teal.teal_mlp(x, wg_t, wu_t, wd_t, torch.tensor(cut_x, device=DEVICE), 0.0, None, cut_s, "silu",
                         config={**SMALL, "FUSE": fuse})
    out_torch, keep_x, keep_s = K.teal_gated_mlp_ref(x, wg_t, wu_t, wd_t, cut_x, cut_s, "silu", return_masks=True)
    if kept == "all":
        assert keep_x.all()
    if kept == "none":
        assert not keep_x.any()
        assert torch.equal(out, torch.zeros_like(out))
    ref64 = K.teal_masked_ref(x.double(), wg_t.double(), wu_t.double(), wd_t.double(), keep_x, keep_s, "silu")
    _check(out, out_torch, ref64)


def test_partials_shape_matches_fake():
    """The op's partial sums have the shape its fake (torch.compile's view of it) announces."""
    x = torch.randn(2, D_MODEL, device=DEVICE)
    wg_t, wu_t, wd_t = _weights(torch.float32)
    p = _teal.teal_partials(x, wg_t, wu_t, wd_t, None, 0.3, None, 0.01, "silu")
    assert p.shape == (_teal.n_parts(D_INTER), 2, D_MODEL) and p.dtype == torch.float32
