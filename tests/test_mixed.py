"""dual[mixed] (countdown.selectors.mixed, countdown.patch.mixed_mlp): the mixed MLP against its float64 reference on both paths
and both selection rules, the SP-Ideal and float-kept variants, the user's path (prepare converts, sparsify on a
fresh model converts, a failed check puts the float Linears back, unsparsify leaves the 8-bit model), the spec
grammar, the bytes, and countdown.save / load_model."""

import json

import pytest
import torch
import torch.nn.functional as F

import countdown
from countdown.int4.nested_linear import NestedLinear
from countdown.int4.nested_model import nested_config, to_nested
from countdown.patch.mixed_mlp import MixedGatedMLP, mixed_mlp_ref
from countdown.selectors.base import get_kind
from conftest import tiny_model
from test_calibrate import TOK, word_texts

KS = [0.5, 0.8]
IDS = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(3))


def _prepare(spec="dual[mixed]", arch="llama", **kwargs):
    model = tiny_model(arch, intermediate_size=128)
    art = countdown.prepare(model, TOK, spec, KS, texts=word_texts(0), num_tokens=256, window=64, progress=False,
                            **kwargs)
    return model, art


@pytest.fixture(scope="module")
def prepared():
    return _prepare()


def _logits(model, prompt=None):
    with torch.no_grad():
        if prompt is None or not countdown.is_sparsified(model):
            return model(IDS).logits
        with countdown.dense_prefix(model, prompt):
            return model(IDS).logits


def _planes64(mlp):
    """{(role, plane): float64 [out, in]} of a nested MLP."""
    return {(role, which): getattr(mlp.module, getattr(mlp, role)).nested.dequantize(which).double()
            for role in ("gate", "up", "down") for which in ("high", "low")}


def _keep64(score, cut, n_keep, selection):
    if selection == "topk":
        idx = score.topk(n_keep, dim=-1).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)
    return score > cut


@pytest.mark.parametrize("selection", ["cut", "topk"])
@pytest.mark.parametrize("path", ["masked", "gather"])
def test_the_mixed_mlp_is_its_float64_reference(prepared, selection, path):
    model, art = prepared
    countdown.sparsify(model, "dual[mixed]", 0.5, artifacts=art.with_selection(selection), scope="all", path=path)
    try:
        mlp = countdown.find_gated_mlps(model)[1]
        layer = mlp.module.countdown_sparse
        assert isinstance(layer, MixedGatedMLP)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            got = mlp.module(x[None])[0]
        p = _planes64(mlp)
        x64 = x.double()
        score = ((x64 @ p["up", "high"].t()) * F.silu(x64 @ p["gate", "high"].t())).abs()
        keep = _keep64(score, layer.selector.cut.double(), layer.selector.n_keep, selection)
        assert 0 < keep.sum() < keep.numel()
        nested = [getattr(mlp.module, getattr(mlp, r)).nested for r in ("gate", "up", "down")]
        want = mixed_mlp_ref(x, *nested, F.silu, keep)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        # nothing skipped: the 4-bit rows count, the output is neither the 8-bit MLP's nor the high planes'
        eight = (x64 @ (p["up", "high"] + p["up", "low"]).t()) * F.silu(x64 @ (p["gate", "high"] + p["gate", "low"]).t())
        assert (got.double() - eight @ (p["down", "high"] + p["down", "low"]).t()).abs().max() > 1e-4
        if selection == "topk":
            assert (keep.sum(-1) == layer.selector.n_keep).all()
    finally:
        countdown.unsparsify(model)


def test_prompt_positions_are_the_8bit_model_and_the_paths_agree(prepared):
    model, art = prepared
    dense = _logits(model)  # the 8-bit model (prepare converted it)
    countdown.sparsify(model, "dual[mixed]", 0.8, artifacts=art, path="masked")
    try:
        masked = _logits(model, prompt=6)
        countdown.reset_sparsity_stats(model)
        torch.testing.assert_close(masked[:, :6], dense[:, :6], rtol=1e-5, atol=1e-5)
        assert (masked[:, 6:] - dense[:, 6:]).abs().max() > 1e-4
        model._countdown_state.path = "gather"
        torch.testing.assert_close(_logits(model, prompt=6), masked, rtol=1e-4, atol=1e-4)
        real = countdown.sparsity_real(model)["mean"]
        assert 0.5 < real < 1.0  # the share of rows left at 4 bits, near k on this text
    finally:
        countdown.unsparsify(model)


def test_more_rows_refined_means_closer_to_the_8bit_model():
    model, art = _prepare(selection="topk")
    dense = _logits(model)
    errors = []
    for k in KS:
        countdown.sparsify(model, "dual[mixed]", k, artifacts=art, scope="all")
        errors.append((_logits(model) - dense).abs().mean().item())
        countdown.unsparsify(model)
    countdown.int4.nested_model.read_planes(model, "high")
    errors.append((_logits(model) - dense).abs().mean().item())  # every row at 4 bits
    assert 0 < errors[0] < errors[1] < errors[2]


def test_the_ideal_variant_ranks_by_the_exact_8bit_score():
    model, art = _prepare("dual[mixed,rank=exact]", selection="topk")
    countdown.sparsify(model, "dual[mixed,rank=exact]", 0.5, artifacts=art, scope="all")
    mlp = countdown.find_gated_mlps(model)[0]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(8))
    p = _planes64(mlp)
    x64 = x.double()
    score = ((x64 @ (p["up", "high"] + p["up", "low"]).t()) * F.silu(x64 @ (p["gate", "high"] + p["gate", "low"]).t())).abs()
    keep = _keep64(score, None, mlp.module.countdown_sparse.selector.n_keep, "topk")
    nested = [getattr(mlp.module, getattr(mlp, r)).nested for r in ("gate", "up", "down")]
    with torch.no_grad():
        got = mlp.module(x[None])[0]
    torch.testing.assert_close(got.double(), mixed_mlp_ref(x, *nested, F.silu, keep), rtol=1e-4, atol=1e-5)


def test_the_float_kept_variant_keeps_the_model_as_loaded():
    model, art = _prepare("dual[mixed,kept=float]", selection="topk")
    assert nested_config(model) is None and not any(isinstance(m, NestedLinear) for m in model.modules())
    dense = _logits(model)
    countdown.sparsify(model, "dual[mixed,kept=float]", 0.5, artifacts=art, scope="all")
    mlp = countdown.find_gated_mlps(model)[0]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    planes = mlp.module.countdown_sparse.selector.planes
    high = {r: planes.high(r).double() for r in ("gate", "up", "down")}
    full = {r: getattr(mlp, "w_" + r).double() for r in ("gate", "up", "down")}
    x64 = x.double()
    score = ((x64 @ high["up"].t()) * F.silu(x64 @ high["gate"].t())).abs()
    keep = _keep64(score, None, mlp.module.countdown_sparse.selector.n_keep, "topk")
    u = torch.where(keep, x64 @ full["up"].t(), x64 @ high["up"].t())
    s = u * F.silu(torch.where(keep, x64 @ full["gate"].t(), x64 @ high["gate"].t()))
    want = torch.where(keep, 0, s) @ high["down"].t() + torch.where(keep, s, 0) @ full["down"].t()
    with torch.no_grad():
        got = mlp.module(x[None])[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    countdown.unsparsify(model)
    assert torch.equal(_logits(model), dense)  # nothing of the model changed


def test_sparsify_converts_a_fresh_model_and_a_failed_check_puts_it_back(prepared):
    model, art = prepared
    assert isinstance(model.model.layers[0].mlp.down_proj, NestedLinear)  # prepare converted the model
    countdown.sparsify(model, "dual[mixed]", 0.8, artifacts=art)
    want = _logits(model, prompt=6)
    countdown.unsparsify(model)
    fresh = tiny_model("llama", intermediate_size=128)
    countdown.sparsify(fresh, "dual[mixed]", 0.8, artifacts=art)
    assert torch.equal(_logits(fresh, prompt=6), want)
    countdown.unsparsify(fresh)  # leaves the 8-bit model
    assert isinstance(fresh.model.layers[1].mlp.gate_proj, NestedLinear)
    assert torch.equal(_logits(fresh), _logits(to_nested(tiny_model("llama", intermediate_size=128))))
    other = tiny_model("llama", intermediate_size=128, seed=1)
    before = _logits(other)
    with pytest.raises(countdown.ArtifactMismatchError, match="other weights"):
        countdown.sparsify(other, "dual[mixed]", 0.8, artifacts=art)
    assert type(other.model.layers[0].mlp.up_proj) is torch.nn.Linear and nested_config(other) is None
    assert torch.equal(_logits(other), before) and not countdown.is_sparsified(other)


def test_prepare_converts_the_model_on_a_cached_artifact_too(tmp_path):
    """prepare with a cache folder leaves the model nested whether it builds the artifact or reads it back (so that
    quantize after prepare, the user's path to 4-bit other Linears, leaves the MLPs nested), and the cached artifact
    then sparsifies that model as the built one does."""
    built_on, read_on = (tiny_model("llama", intermediate_size=128) for _ in range(2))
    options = dict(texts=word_texts(0), num_tokens=256, window=64, progress=False, cache_dir=tmp_path)
    built = countdown.prepare(built_on, TOK, "dual[mixed]", KS, **options)
    read = countdown.prepare(read_on, TOK, "dual[mixed]", KS, **options)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1  # the second call read the first one's file
    for model in (built_on, read_on):
        assert isinstance(model.model.layers[1].mlp.down_proj, NestedLinear)
        countdown.quantize(model, group=64, lm_head=True)  # the other Linears 4-bit; the nested MLPs stay
        assert isinstance(model.model.layers[1].mlp.up_proj, NestedLinear)
    countdown.sparsify(built_on, "dual[mixed]", 0.8, artifacts=built)
    countdown.sparsify(read_on, "dual[mixed]", 0.8, artifacts=read)
    assert torch.equal(_logits(read_on, prompt=6), _logits(built_on, prompt=6))


def test_spec_grammar_options_and_refusals(prepared):
    _, art = prepared
    assert countdown.parse_spec("dual[mixed]").label == "dual[mixed]"
    assert countdown.parse_spec("dual[mixedg64, rank=shadow]").label == "dual[mixed]"
    assert countdown.parse_spec("dual[mixedg128,kept=float]").label == "dual[mixedg128,kept=float]"
    with pytest.raises(ValueError, match="rank=best is not one of shadow, exact"):
        countdown.parse_spec("dual[mixed,rank=best]")
    with pytest.raises(countdown.ArtifactMismatchError, match="dual\\[mixed\\]"):
        countdown.sparsify(tiny_model("llama", intermediate_size=128), "dual[mixed,rank=exact]", 0.8, artifacts=art)
    with pytest.raises(ValueError, match="group=64 does not divide d_model and d_inter \\[64, 97\\]"):
        countdown.prepare(tiny_model("llama"), TOK, "dual[mixed]", 0.5, texts=word_texts(0), num_tokens=64,
                          window=64, progress=False)
    with pytest.raises(ValueError, match="choose 32"):
        countdown.prepare(tiny_model("llama", intermediate_size=96), TOK, "dual[mixed]", 0.5, texts=word_texts(0),
                          num_tokens=64, window=64, progress=False)


def test_bytes_a_decode_step_reads():
    kind = get_kind("mixed")
    d, di = 4096, 14336
    plane = d * di * (0.5 + 2 * 2 / 64)  # 4 bits + an fp16 scale and offset per 64 weights
    assert kind.weight_bytes(d, di, 0.1, 2, {"group": 64}) == pytest.approx(3 * plane * 1.1)
    assert kind.weight_bytes(d, di, 0.1, 2, {"group": 64, "kept": "float"}) == pytest.approx(3 * plane + 0.6 * d * di)


@pytest.mark.parametrize("how", ["sparsified", "8-bit model", "bf16"])
def test_save_and_load_round_trip(prepared, tmp_path, how):
    model, art = prepared
    if how != "8-bit model":
        countdown.sparsify(model, "dual[mixed]", 0.8, artifacts=art)
    try:
        want = _logits(model, prompt=6)
        countdown.save(model, tmp_path / "m")
    finally:
        if countdown.is_sparsified(model):
            countdown.unsparsify(model)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"]["nested"]["group"] == 64  # the record transformers' quantizer rebuilds
    dtype = torch.bfloat16 if how == "bf16" else torch.float32
    back, _ = countdown.load_model(tmp_path / "m", dtype=dtype)
    assert countdown.is_sparsified(back) == (how != "8-bit model")
    if how != "8-bit model":
        assert config["quantization_config"]["spec"] == "dual[mixed]"
    for name, module in model.named_modules():
        if isinstance(module, NestedLinear):
            mine = back.get_submodule(name)
            assert isinstance(mine, NestedLinear) and mine.low_transposed == module.low_transposed
            assert all(torch.equal(a, b) for a, b in zip(mine.buffers(), module.buffers()))
    if how == "bf16":
        assert back.model.layers[0].mlp.up_proj.compute_dtype == torch.bfloat16
        assert (_logits(back, prompt=6).float() - want).abs().max() < 0.1
    else:
        assert torch.equal(_logits(back, prompt=6), want)


def test_generate_takes_the_mixed_step_on_the_cpu(prepared):
    model, art = prepared
    countdown.sparsify(model, "dual[mixed]", 0.8, artifacts=art)
    try:
        ids = IDS[:1, :8]
        want = model.generate(ids, max_new_tokens=6, do_sample=False)  # transformers' own, through the patch
        countdown.reset_sparsity_stats(model)
        got = countdown.generate(model, ids, max_new_tokens=6)
        assert torch.equal(got, want)
        assert 0.6 < countdown.sparsity_real(model)["mean"] < 1.0  # the decode steps were mixed
    finally:
        countdown.unsparsify(model)


@pytest.mark.parametrize("name", ["silu", "gelu_tanh", "gelu", "relu"])
def test_act_grad_is_the_activations_derivative(name):
    from countdown.patch.mixed_mlp import act_grad
    from countdown.model.gated_mlp import KNOWN_ACTIVATIONS

    g = torch.linspace(-6, 6, 241, dtype=torch.float64).requires_grad_(True)
    (want,) = torch.autograd.grad(KNOWN_ACTIVATIONS[name](g).sum(), g)
    torch.testing.assert_close(act_grad(name, g.detach()), want, rtol=1e-9, atol=1e-12)


def test_the_error_ranking_against_float64():
    """rank=error: per row sqrt(|x|^2 (sig_up^2 act(g~)^2 + sig_gate^2 (u~ act'(g~))^2) |W~h_down col|^2
    + s~^2 |Delta_down col|^2), the sigmas the low planes' RMS a row."""
    model, art = _prepare("dual[mixed,rank=error]", selection="topk")
    countdown.sparsify(model, "dual[mixed,rank=error]", 0.5, artifacts=art, scope="all")
    mlp = countdown.find_gated_mlps(model)[1]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10)).double()
    p = _planes64(mlp)
    g = (x @ p["gate", "high"].t()).requires_grad_(True)
    h = F.silu(g)
    (dh,) = torch.autograd.grad(h.sum(), g)
    g, h = g.detach(), h.detach()
    u = x @ p["up", "high"].t()
    sig_up, sig_gate = p["up", "low"].pow(2).mean(1).sqrt(), p["gate", "low"].pow(2).mean(1).sqrt()
    ds2 = x.pow(2).sum(-1, keepdim=True) * ((sig_up * h) ** 2 + (sig_gate * u * dh) ** 2)
    score = (ds2 * p["down", "high"].pow(2).sum(0) + (u * h) ** 2 * p["down", "low"].pow(2).sum(0)).sqrt()
    sel = mlp.module.countdown_sparse.selector
    torch.testing.assert_close(sel.score(x.float(), mlp).double(), score, rtol=1e-4, atol=1e-7)
    keep = _keep64(score, None, sel.n_keep, "topk")
    assert not torch.equal(keep, _keep64((u * h).abs(), None, sel.n_keep, "topk"))  # not the shadow ranking
    nested = [getattr(mlp.module, getattr(mlp, r)).nested for r in ("gate", "up", "down")]
    with torch.no_grad():
        got = mlp.module(x.float()[None])[0]
    torch.testing.assert_close(got.double(), mixed_mlp_ref(x, *nested, F.silu, keep), rtol=1e-4, atol=1e-5)
