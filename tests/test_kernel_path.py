"""The patched model's kernel path (Triton, interpreted on CPU here) against its masked path."""

import pytest
import torch

import countdown
from countdown import patched
from countdown.prac.base import RowSelector
from countdown.prac.threshold import ThresholdSelector
from countdown.state import state_of
from conftest import tiny_model

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _kernel_calls_uncaptured(monkeypatch):
    """These tests count the kernel route's Python calls: on CUDA, no CUDA graph of it (whose capture calls it
    three times and whose replays not at all; tests/test_hf_generate.py checks the captured route)."""
    monkeypatch.setattr(patched, "EAGER_GRAPHS", False)


class FirstRowsSelector(RowSelector):
    """A stand-in predictor: keeps rows whose (fixed, random) linear score of x is positive."""

    def __init__(self, d_model, d_inter):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(d_model, d_inter), requires_grad=False)

    def forward(self, x, u, h):
        return (x.float() @ self.proj) > 0.5


def _swap_selectors(model, make):
    for layer in state_of(model).layers:
        layer.selector = make(layer.mlp)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
@pytest.mark.parametrize("kind", ["mono", "cats", "predictor"])
def test_kernel_path_matches_masked_path(arch, kind, monkeypatch):
    from countdown import kernels

    calls = []
    for name in ("mono_gated_mlp", "cats_gated_mlp", "masked_gated_mlp"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)
    model = tiny_model(arch).to(device)
    ids = torch.randint(3, 128, (3, 1), device=device)  # three sequences, one decode-sized token each

    def make(mlp):
        if kind == "predictor":
            torch.manual_seed(1)
            return FirstRowsSelector(mlp.d_model, mlp.d_inter).to(mlp.w_up.device)
        return ThresholdSelector(countdown.get_method(kind), 0.05).to(mlp.w_up.device)

    outs = {}
    for path in ("masked", "kernel"):
        countdown.sparsify(model, kind if kind != "predictor" else "dual", 0.5, scope="all", path=path)
        _swap_selectors(model, make)
        with torch.no_grad():
            outs[path] = model(ids).logits
        countdown.unsparsify(model)
    torch.testing.assert_close(outs["kernel"], outs["masked"], rtol=1e-4, atol=1e-4)
    expected = {"mono": "mono_gated_mlp", "cats": "cats_gated_mlp", "predictor": "masked_gated_mlp"}[kind]
    assert calls == [expected] * 2  # one call per layer, on the kernel path only


@pytest.mark.parametrize("method,selection", [("dual", "cut"), ("dejavu", "logit")])
def test_trained_lowrank_predictor_runs_inside_the_dual_kernel(method, selection, monkeypatch):
    """A trained low-rank predictor (bias and cut folded into a per-row threshold on x A B) takes the
    fused dual kernel on decode steps and keeps the rows the masked path keeps."""
    from countdown import kernels
    from countdown import train_predictors
    from test_calibrate import TOK, word_texts

    calls = []
    for name in ("dual_gated_mlp", "masked_gated_mlp"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("llama")
    art = train_predictors(model, TOK, method, 0.7, texts=word_texts(0), num_tokens=256, window=64,
                           kind="lowrank", d_rank=8, epochs=1, selection=selection, progress=False)
    model = model.to(device)
    ids = torch.randint(3, 120, (2, 1), device=device, generator=None)
    outs = {}
    for path in ("masked", "kernel"):
        countdown.sparsify(model, method, 0.7, mode="prac", artifacts=art, scope="all", path=path)
        with torch.no_grad():
            outs[path] = model(ids).logits
        countdown.unsparsify(model)
    torch.testing.assert_close(outs["kernel"], outs["masked"], rtol=1e-4, atol=1e-4)
    assert calls == ["dual_gated_mlp"] * len(countdown.find_gated_mlps(model))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["mono", "cats", "dual"])
def test_one_token_decode_takes_the_one_launch_kernel(arch, kind, monkeypatch):
    """A patched model's single-token forward (a decode step at batch 1) runs each Gated-MLP as the
    one-launch kernel (kernels/_onepass.py) and gives the masked path's logits; dual with a trained
    low-rank predictor (per-row cuts)."""
    from countdown.kernels import _onepass

    from countdown.kernels import _linear

    monkeypatch.setattr(_onepass, "ONEPASS_OFF_CUDA", True)
    monkeypatch.setattr(_onepass, "IND_GEMV_OFF_CUDA", True)  # the indicator's GEMV on kernels/_linear.py
    launches, gemvs = [], []
    real = _onepass.onepass_partials
    monkeypatch.setattr(_onepass, "onepass_partials", lambda *a, **k: launches.append(a[7]) or real(*a, **k))
    real_linear = _linear.decode_linear
    monkeypatch.setattr(_linear, "decode_linear", lambda *a, **k: gemvs.append(1) or real_linear(*a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(arch)
    art = None
    if kind == "dual":
        from countdown import train_predictors
        from test_calibrate import TOK, word_texts

        art = train_predictors(model, TOK, "dual", 0.7, texts=word_texts(0), num_tokens=256, window=64,
                               kind="lowrank", d_rank=8, epochs=1, progress=False)
    model = model.to(device)
    ids = torch.randint(3, 120, (1, 1), device=device)
    outs = {}
    for path in ("masked", "kernel"):
        if kind == "dual":
            countdown.sparsify(model, "dual", 0.7, mode="prac", artifacts=art, scope="all", path=path)
        else:
            countdown.sparsify(model, kind, 0.5, scope="all", path=path)
            _swap_selectors(model, lambda mlp: ThresholdSelector(countdown.get_method(kind), 0.05).to(mlp.w_up.device))
        with torch.no_grad():
            outs[path] = model(ids).logits
        countdown.unsparsify(model)
    torch.testing.assert_close(outs["kernel"], outs["masked"], rtol=1e-4, atol=1e-4)
    mode = {"mono": "abs", "cats": "abs_act", "dual": "gt"}[kind]
    assert launches == [mode] * len(countdown.find_gated_mlps(model))
    # the GEMVs before the kernel: the indicator where it is computed outside (not mono's u), and dual's x A
    per_mlp = int(_onepass.indicator_outside(mode)) + (kind == "dual")
    assert len(gemvs) == per_mlp * len(launches)
