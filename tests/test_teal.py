"""teal (TEAL input sparsity) on the tiny models: float64 references, layout round trip, calibration."""

import math

import pytest
import torch
import torch.nn.functional as F

import countdown
from countdown.artifacts.store import ArtifactError, ArtifactMismatchError, load_artifacts
from countdown.selectors.teal import TealThresholdSelector, _Layer, greedy_levels
from countdown.sparse_methods.registry import kept_rows
from countdown.patch.state import state_of
from conftest import tiny_model
from test_calibrate import TOK, word_texts

ACTS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels in Triton's interpreter (conftest)


def reference_teal(x, mlp, n_x=None, n_s=None, cut_x=None, cut_s=None):
    """Token by token in float64: keep the n_x largest |x| (or |x| > cut_x, compared in float32), compute
    s from the kept entries only, keep the n_s largest |s| (or |s| > cut_s), sum the kept W_down columns."""
    wg, wu, wd = (w.detach().double() for w in (mlp.w_gate, mlp.w_up, mlp.w_down))
    bias = [None if b is None else b.detach().double() for b in (mlp.b_gate, mlp.b_up, mlp.b_down)]
    act = ACTS[mlp.act_name]
    x = x.double()
    out = torch.zeros(x.shape[0], wd.shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        if n_x is not None:
            cols = sorted(range(x.shape[1]), key=lambda j: -abs(x[t, j].item()))[:n_x]
        else:
            cols = [j for j in range(x.shape[1]) if abs(x[t, j].item()) > cut_x]
        xm = torch.zeros_like(x[t])
        xm[cols] = x[t, cols]
        g, u = wg @ xm, wu @ xm
        if bias[0] is not None:
            g, u = g + bias[0], u + bias[1]
        s = u * act(g)
        if n_s is not None:
            rows = sorted(range(s.numel()), key=lambda i: -abs(s[i].item()))[:n_s]
        else:
            rows = [i for i in range(s.numel()) if abs(s[i].item()) > cut_s]
        for i in rows:
            out[t] += s[i] * wd[:, i]
        if bias[2] is not None:
            out[t] += bias[2]
    return out


def teal_artifact(model, ks=(0.5, 0.7), **options):
    return countdown.calibrate(model, TOK, "teal", list(ks), texts=word_texts(0), num_tokens=768, window=64,
                               progress=False, **options)


@pytest.mark.parametrize("path", ["masked", "gather"])
@pytest.mark.parametrize("k", [0.5, 0.9])
def test_ideal_matches_float64_reference(arch, k, path):
    model = tiny_model(arch, torch.float64)
    countdown.sparsify(model, "teal", k, scope="all", path=path)
    mlp = countdown.find_gated_mlps(model)[1]
    x = torch.randn(5, mlp.d_model, dtype=torch.float64)
    got = mlp.module(x)
    n_x, n_s = kept_rows(mlp.d_model, k), kept_rows(mlp.d_inter, k)
    torch.testing.assert_close(got, reference_teal(x, mlp, n_x=n_x, n_s=n_s), rtol=1e-9, atol=1e-9)
    # Sparsity-Real: the skipped share of the three matrices, (2 k_x + k_s) / 3
    want = 1 - (2 * n_x / mlp.d_model + n_s / mlp.d_inter) / 3
    assert countdown.sparsity_real(model)["per_layer"][1] == pytest.approx(want)


@pytest.mark.parametrize("path", ["masked", "gather"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_prac_matches_float64_reference(arch, path):
    model = tiny_model(arch)
    art = teal_artifact(model)
    model = model.double()
    countdown.sparsify(model, "teal", 0.7, mode="prac", artifacts=art, scope="all", path=path)
    for i, mlp in enumerate(countdown.find_gated_mlps(model)):
        cuts = art.layer_tensors(0.7, i)
        x = 2 * torch.randn(6, mlp.d_model, dtype=torch.float64)
        ref = reference_teal(x, mlp, cut_x=float(cuts["cut_x"]), cut_s=float(cuts["cut_s"]))
        torch.testing.assert_close(mlp.module(x), ref, rtol=1e-9, atol=1e-9)


def test_batch_tokens_use_their_own_masks_on_the_gather_path():
    model = tiny_model("llama", torch.float64)
    countdown.sparsify(model, "teal", 0.8, scope="all", path="gather")
    mlp = countdown.find_gated_mlps(model)[0]
    x = torch.randn(3, mlp.d_model, dtype=torch.float64)
    together = mlp.module(x)
    alone = torch.cat([mlp.module(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_unsparsify_restores_layout_and_logits_bit_for_bit(arch):
    """path="kernel" (the interpreter here) stores W_gate, W_up (phi3: the fused gate_up) and W_down
    transposed in place; unpatching gives back the original tensors, layout included."""
    pytest.importorskip("triton")
    model = tiny_model(arch).to(DEVICE)
    ids = torch.randint(3, 128, (2, 7), device=DEVICE)
    weights = {n: (p.detach().clone(), p.stride()) for n, p in model.named_parameters()}
    with torch.no_grad():
        before = model(ids).logits
        countdown.sparsify(model, "teal", 0.5, scope="all", path="kernel")
        mlp = countdown.find_gated_mlps(model)[0]
        assert mlp.w_gate.t().stride(1) == 1 and mlp.w_up.t().stride(1) == 1 and mlp.w_down.t().is_contiguous()
        sparse = model(ids).logits
        countdown.unsparsify(model)
        after = model(ids).logits
    assert not torch.allclose(sparse, before)
    assert torch.equal(after, before)
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n][0]) and p.stride() == weights[n][1], n


def test_unsparsify_gives_back_only_the_layouts_it_changed():
    """A weight that was column-major before patching (nothing to change for the kernels) stays so."""
    pytest.importorskip("triton")
    model = tiny_model("llama").to(DEVICE)
    gate = countdown.find_gated_mlps(model)[0].module.gate_proj.weight
    gate.data = gate.data.t().contiguous().t()
    countdown.sparsify(model, "teal", 0.5, path="kernel")
    countdown.unsparsify(model)
    assert gate.t().is_contiguous() and not gate.is_contiguous()
    assert countdown.find_gated_mlps(model)[0].w_up.is_contiguous()


@pytest.mark.parametrize("allocation", ["greedy", "uniform"])
def test_calibration_gives_sparsity_real_k_on_held_out_text(allocation):
    model = tiny_model("llama")
    art = teal_artifact(model, allocation=allocation)
    ids = torch.cat(countdown.selectors.stream.token_windows(TOK, word_texts(1), 2048, 64)[:16])
    for k in (0.5, 0.7):
        for i in range(2):
            levels = art.layer_tensors(k, i)
            assert (2 * float(levels["level_x"]) + float(levels["level_s"])) / 3 == pytest.approx(k, abs=1e-6)
            if allocation == "uniform":
                assert float(levels["level_x"]) == float(levels["level_s"]) == pytest.approx(k)
        countdown.sparsify(model, "teal", k, mode="prac", artifacts=art, scope="all")
        with torch.no_grad():
            model(ids)
        real = countdown.sparsity_real(model)
        countdown.unsparsify(model)
        assert real["mean"] == pytest.approx(k, abs=0.02)


def test_greedy_takes_the_free_sparsity_first():
    """Half of the input channels are always 0: skipping them costs nothing, so the walk reaches a layer
    Sparsity-Real of 0.32 by x alone (l_x = 3 x 0.32 / 2 = 0.48, all of it free) before it touches s."""
    model = tiny_model("llama")
    mlp = countdown.find_gated_mlps(model)[0]
    X = torch.randn(256, mlp.d_model)
    X[:, ::2] = 0.0
    layer = _Layer(mlp, X)
    levels = greedy_levels(layer, X, [0.32, 0.6], step=0.02)
    assert levels[0.32] == pytest.approx((0.48, 0.0))
    lx, ls = levels[0.6]
    assert (2 * lx + ls) / 3 == pytest.approx(0.6) and lx >= 0.48


def test_artifact_save_load_and_checks(tmp_path):
    model = tiny_model("llama")
    art = teal_artifact(model, ks=(0.6,), allocation="uniform")
    path = art.save(tmp_path / "teal.safetensors")
    loaded = load_artifacts(path)
    assert loaded.kind == "teal" and loaded.method == "teal" and loaded.meta["options"]["allocation"] == "uniform"
    x = torch.randn(1, 5, 64)
    outs = []
    for a in (art, loaded):
        countdown.sparsify(model, "teal", 0.6, mode="prac", artifacts=a, scope="all")
        with torch.no_grad():
            outs.append(countdown.find_gated_mlps(model)[0].module(x))
        assert isinstance(state_of(model).layers[0].selector, TealThresholdSelector)
        countdown.unsparsify(model)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ArtifactMismatchError, match="made for method 'teal'"):
        countdown.sparsify(model, "mono", 0.6, mode="prac", artifacts=loaded)
    del loaded.tensors["k=0.6/layer1/cut_s"]
    with pytest.raises(ArtifactError, match="lacks cut_s of layer 1"):
        countdown.sparsify(model, "teal", 0.6, mode="prac", artifacts=loaded)
    assert not countdown.is_sparsified(model)


def test_bad_input_is_a_clear_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown allocation 'best'"):
        teal_artifact(model, allocation="best")
    with pytest.raises(TypeError, match="takes no option"):
        teal_artifact(model, rule="pooled")
    with pytest.raises(ValueError, match=r"step must be a number in \(0, 0.25\]"):
        teal_artifact(model, step=0.5)
    with pytest.raises(ValueError, match="does not use a trained predictor"):
        countdown.train_predictors(model, TOK, "teal", 0.5)
    with pytest.raises(TypeError, match="no per-row indicator"):
        countdown.get_method("teal").indicator(None, None)
    with pytest.raises(ValueError, match="needs artifacts"):
        countdown.sparsify(model, "teal", 0.5, mode="prac")
    assert not countdown.is_sparsified(model)


def test_decode_scope_counts_only_generated_tokens_and_benchmark_fractions_agree():
    """A dense prompt is not counted; the decode benchmark's kept fractions (forward hooks on the
    selector) give the same Sparsity-Real as the layer's counters."""
    from countdown.bench.measure import kept_fractions

    model = tiny_model("llama")
    countdown.sparsify(model, "teal", 0.7, path="masked")
    prompt = torch.randint(3, 128, (1, 6))
    per_token, union = kept_fractions(model, prompt, steps=5)
    real = countdown.sparsity_real(model)["mean"]
    countdown.unsparsify(model)
    d_m, d_i = 64, 97
    want = 1 - (2 * kept_rows(d_m, 0.7) / d_m + kept_rows(d_i, 0.7) / d_i) / 3
    assert real == pytest.approx(want) and per_token == pytest.approx(1 - want) and union == pytest.approx(1 - want)


def test_kernel_path_matches_masked_path():
    pytest.importorskip("triton")
    from countdown import kernels

    calls = []  # the launches of TEAL's kernels, called directly (no CUDA graph of the route): one a layer
    direct = kernels.KernelOptions(eager_graphs=False)
    model = tiny_model("phi3")
    art = teal_artifact(model, ks=(0.6,))
    model = model.to(DEVICE)
    ids = torch.randint(3, 128, (3, 1), device=DEVICE)  # three sequences, one decode-sized token each
    outs = {}
    for path in ("masked", "kernel"):
        countdown.sparsify(model, "teal", 0.6, mode="prac", artifacts=art, scope="all", path=path,
                           kernel_options=direct)
        with torch.no_grad(), kernels.overrides(on_launch=lambda name, *a: calls.append(1) if name == "teal" else None):
            outs[path] = model(ids).logits
        countdown.unsparsify(model)
    torch.testing.assert_close(outs["kernel"], outs["masked"], rtol=1e-4, atol=1e-4)
    assert len(calls) == 2  # one per layer, on the kernel path only


def test_cli_calibrate_then_ppl(monkeypatch, tmp_path, capsys):
    import json

    from countdown.cli import commands as cli

    model = tiny_model("llama")
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, TOK))
    calib, held_out, out = tmp_path / "calib.txt", tmp_path / "held.txt", tmp_path / "teal.safetensors"
    calib.write_text("\n".join(word_texts(0)))
    held_out.write_text("\n".join(word_texts(1)))
    assert cli.main(["calibrate", "--method", "teal", "-k", "0.6", "--texts", str(calib), "--num-tokens", "512",
                     "--allocation", "uniform", "--out", str(out)]) == 0
    assert "teal teal" in capsys.readouterr().out
    assert cli.main(["ppl", "--method", "teal", "-k", "0.6", "--mode", "prac", "--artifacts", str(out),
                     "--texts", str(held_out), "--max-tokens", "512", "--window", "128", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"] > 1 and result["sparsity_real"] == pytest.approx(0.6, abs=0.03)
    assert math.isfinite(result["perplexity"])
