"""The shadow kind of dual: low-bit copies of W_gate / W_up rank rows, the MLP stays exact."""

import pytest
import torch

import countdown
from countdown.artifacts.store import Artifacts
from countdown.selectors.base import get_kind, selectors_for
from conftest import tiny_model
from test_calibrate import TOK, captured_inputs, word_texts

KW = dict(texts=word_texts(0), num_tokens=512, window=128, progress=False)


def rtn64(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """An independent float64 RTN: symmetric, per group along the input dim, fp16-rounded scale."""
    qmax = 2 ** (bits - 1) - 1
    wg = w.double().reshape(w.shape[0], -1, group)
    scale = (wg.abs().amax(-1, keepdim=True).float() / qmax).half().double()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((wg / scale).round().clamp(-qmax, qmax) * scale).reshape(w.shape)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def shadow(model):
    return countdown.train_predictors(model, TOK, "dual", [0.7, 0.9], kind="shadow", group=32, refine=False, **KW)


def test_masks_equal_a_float64_reference_of_the_dequantized_shadows(model, shadow):
    mlps, xs = captured_inputs(model, TOK, word_texts(1), 256)
    for k in (0.7, 0.9):
        selectors = selectors_for(shadow, mlps, "dual", k)
        for i, mlp in enumerate(mlps):
            x = xs[i]
            wg, wu = rtn64(mlp.w_gate.detach(), 4, 32), rtn64(mlp.w_up.detach(), 4, 32)
            ref = ((x.double() @ wu.T) * torch.nn.functional.silu(x.double() @ wg.T)).abs()
            cut = float(shadow.layer_tensors(k, i)["cut"])
            got = selectors[i](x, None, None)
            margin = (ref - cut).abs() > 1e-4 * ref.abs().max()  # ignore exact ties at float32 rounding
            assert torch.equal(got[margin], (ref > cut)[margin])
            assert margin.float().mean() > 0.99


def test_the_cut_skips_about_k_of_the_calibration_rows(model, shadow):
    mlps, xs = captured_inputs(model, TOK, word_texts(0), 512)
    for k in (0.7, 0.9):
        skipped = [1 - float(sel(xs[i], None, None).float().mean())
                   for i, sel in enumerate(selectors_for(shadow, mlps, "dual", k))]
        assert sum(skipped) / len(skipped) == pytest.approx(k, abs=0.03)


def test_sparse_output_is_the_exact_mlp_on_the_kept_rows(model, shadow, tmp_path):
    path = shadow.save(tmp_path / "shadow.safetensors")
    ids = torch.randint(3, 120, (2, 24), generator=torch.Generator().manual_seed(0))
    outs = {}
    for route in ("masked", "gather"):
        countdown.sparsify(model, "dual", 0.9, mode="prac", artifacts=path, scope="all", path=route)
        with torch.no_grad():
            outs[route] = model(input_ids=ids).logits
        countdown.unsparsify(model)
    torch.testing.assert_close(outs["gather"], outs["masked"], rtol=1e-4, atol=1e-4)
    # one MLP by hand: kept rows from the reference mask, full-precision weights
    mlps = countdown.find_gated_mlps(model)
    mlp, sel = mlps[0], selectors_for(shadow, mlps, "dual", 0.9)[0]
    x = torch.randn(5, mlp.d_model, generator=torch.Generator().manual_seed(3))
    keep = sel(x, None, None)
    u, g = x.double() @ mlp.w_up.double().T, x.double() @ mlp.w_gate.double().T
    expected = (torch.where(keep, u * torch.nn.functional.silu(g), 0.0)) @ mlp.w_down.double().T
    countdown.sparsify(model, "dual", 0.9, mode="prac", artifacts=path, scope="all")
    with torch.no_grad():
        got = mlp.module(x)
    countdown.unsparsify(model)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_artifact_records_bits_and_is_smaller_at_fewer_bits(model, shadow):
    assert shadow.meta["bits"] == 4 and shadow.meta["group"] == 32 and shadow.kind == "shadow"
    three = countdown.calibrate(model, TOK, "dual", 0.8, kind="shadow", bits=3, group=32, refine=False, **KW)
    assert three.num_bytes() < shadow.num_bytes()
    mlps = countdown.find_gated_mlps(model)
    per_layer = 2 * (97 * 64 * 4 // 8 + 97 * 2 * 2) + 4  # packed q, fp16 scales, one cut
    assert shadow.num_bytes() == per_layer * len(mlps)


def test_bad_shadow_requests_and_artifacts_are_refused(model, shadow):
    with pytest.raises(ValueError, match="group=48 does not divide d_model"):
        countdown.calibrate(model, TOK, "dual", 0.8, kind="shadow", group=48, **KW)
    with pytest.raises(ValueError, match="bits must be one of"):
        countdown.calibrate(model, TOK, "dual", 0.8, kind="shadow", bits=5, **KW)
    with pytest.raises(ValueError, match="applies to dual only"):
        countdown.calibrate(model, TOK, "mono", 0.8, kind="shadow", **KW)
    mlps = countdown.find_gated_mlps(model)
    relabelled = Artifacts({**shadow.meta, "bits": 8}, dict(shadow.tensors))  # tensors are 4-bit
    with pytest.raises(countdown.ArtifactError, match="bits 8"):
        selectors_for(relabelled, mlps, "dual", 0.7)
    with pytest.raises(countdown.ArtifactMismatchError, match="not k=0.8"):
        selectors_for(shadow, mlps, "dual", 0.8)
    with pytest.raises(countdown.ArtifactMismatchError, match="other weights"):
        selectors_for(shadow, countdown.find_gated_mlps(tiny_model("llama", seed=1)), "dual", 0.7)
    # Llama-3.1-8B MLP at k = 0.9: 2 x 29.4 MB of packed shadows + 2 x 1.8 MB of fp16 scales + 3 x 11.7 MB of
    # kept bf16 rows (the 94 MB leaves the scales out)
    assert get_kind("shadow").weight_bytes(4096, 14336, 0.1, 2, {"bits": 4, "group": 64}) == pytest.approx(
        97.6e6, rel=0.001)
