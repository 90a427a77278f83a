"""The public API says what it does: its names, one builder (and its deprecated aliases), strict arguments, one
registry of kinds."""

import math
import os

import pytest
import torch

import countdown
from countdown.artifacts.store import sparsity_key
from countdown.selectors.base import RowSelector, SelectorKind, register_kind, KINDS
from countdown.selectors.capture import fit_by_capture
from conftest import tiny_model
from test_calibrate import TOK, word_texts

KW = dict(texts=word_texts(0), num_tokens=256, window=128, progress=False)


def test_the_public_names_and_the_aliases_beside_them():
    assert len(countdown.__all__) <= 25 and all(hasattr(countdown, name) for name in countdown.__all__)
    deprecated = ("calibrate", "train_predictors", "ensure_artifacts", "generate_fast")
    assert not set(deprecated) & set(countdown.__all__) and all(callable(getattr(countdown, n)) for n in deprecated)
    for name in deprecated:  # each says what it is an alias of
        assert "alias" in getattr(countdown, name).__doc__.lower()
    model = tiny_model("llama")
    art = countdown.prepare(model, TOK, "mono", 0.8, **KW)  # a plain method builds its default kind
    assert art.kind == "threshold" and art.sparsities == [0.8] and art.tensors["thresholds"].shape == (1, 2)
    with pytest.warns(DeprecationWarning, match="countdown.calibrate is a deprecated alias of countdown.prepare"):
        same = countdown.calibrate(model, TOK, "mono", 0.8, **KW)
    assert torch.equal(same.tensors["thresholds"], art.tensors["thresholds"])


@pytest.mark.parametrize("bad, error", [("0.8", TypeError), (True, TypeError), (float("nan"), ValueError),
                                        (None, TypeError), (1.0, ValueError)])
def test_sparsity_must_be_a_real_number(bad, error):
    model = tiny_model("llama")
    with pytest.raises(error, match="sparsity"):
        countdown.sparsify(model, "mono", bad)
    assert not countdown.is_sparsified(model)
    with pytest.raises(error, match="sparsity"):
        countdown.prepare(model, TOK, "mono", bad, **KW)
    with pytest.raises(error, match="sparsity"):
        countdown.prepare(model, TOK, "mono", [0.7, bad], **KW)


def test_numpy_and_tensor_sparsities_are_numbers():
    import numpy as np

    model = tiny_model("llama")
    for k in (np.float32(0.8), torch.tensor(0.8)):
        countdown.sparsify(model, "mono", float(k) if isinstance(k, torch.Tensor) else k)
        assert countdown.sparsity_real(model)["target"] == pytest.approx(0.8, abs=1e-6)
        countdown.unsparsify(model)


def test_an_ideal_spec_with_artifacts_is_an_error_that_names_the_prac_spec():
    model = tiny_model("llama")
    art = countdown.prepare(model, TOK, "mono", 0.8, **KW)
    with pytest.raises(ValueError, match=r"'mono' is SP-Ideal .*\('mono\[threshold\]' for this artifact\)"):
        countdown.sparsify(model, "mono", 0.8, artifacts=art)
    with pytest.raises(ValueError, match=r"'mono' is SP-Ideal"), pytest.warns(DeprecationWarning, match="mode='ideal'"):
        countdown.sparsify(model, "mono", 0.8, mode="ideal", artifacts=art)
    assert not countdown.is_sparsified(model)


def test_kernel_path_where_no_kernel_can_run_says_why(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="path='kernel' cannot run here"):
        countdown.sparsify(model, "mono", 0.8, path="kernel")
    assert not countdown.is_sparsified(model)


def test_unknown_kind_and_kind_for_another_method_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown selector kind 'mlp'"):
        countdown.prepare(model, TOK, "dual", 0.8, kind="mlp", **KW)
    with pytest.raises(ValueError, match="applies to cats and mono only"):
        countdown.prepare(model, TOK, "dual", 0.8, kind="threshold", **KW)
    with pytest.raises(TypeError, match="takes no option"):
        countdown.prepare(model, TOK, "mono", 0.8, d_rank=4, **KW)


class SignOfFirstInput(RowSelector):
    """A toy kind's run-time rule: keep rows i with |x[0] * w[i]| above the layer's cut."""

    def __init__(self, w, cut):
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("cut", cut.reshape(()))

    def score(self, x, mlp=None):
        return (x[:, :1].float() * self.w[None, :]).abs()

    def forward(self, x, u, h):
        return self.score(x) > self.cut


class ToyKind(SelectorKind):
    """Adding a kind is one class and one register_kind call: everything else is shared machinery."""

    name = "toy-first-input"
    methods = ("dual",)
    selections = ("cut",)
    default_selection = "cut"
    defaults = {"cut_rule": "pooled"}

    def fit(self, ctx):
        def fit_layer(method, mlp, layer, X, ks, opts, progress=False):
            w = torch.linspace(0.5, 1.5, mlp.d_inter)
            score = (X[:, :1] * w[None, :]).abs().flatten()
            out = {f"shared/layer{layer}/w": w}
            for k in ks:
                out[f"{sparsity_key(k)}/layer{layer}/cut"] = torch.quantile(score.double(), k).float()
            return out

        return fit_by_capture(ctx, fit_layer, desc="toy")

    def selectors(self, artifacts, mlps, method, k):
        return [SignOfFirstInput(artifacts.layer_tensors(k, i)["w"], artifacts.layer_tensors(k, i)["cut"])
                for i in range(len(mlps))]


@pytest.fixture
def toy_kind():
    kind = register_kind(ToyKind())
    yield kind
    del KINDS[kind.name]


def test_a_new_kind_is_one_class_and_one_registry_line(toy_kind, tmp_path):
    model = tiny_model("llama")
    art = countdown.prepare(model, TOK, "dual", [0.6, 0.9], kind="toy-first-input", **KW)
    path = art.save(tmp_path / "toy.safetensors")
    ids = torch.randint(3, 120, (2, 33), generator=torch.Generator().manual_seed(0))
    for k in (0.6, 0.9):
        countdown.sparsify(model, "dual[toy-first-input]", k, artifacts=path, scope="all")
        with torch.no_grad():
            model(input_ids=ids)
        real = countdown.sparsity_real(model)["mean"]
        countdown.unsparsify(model)
        assert abs(real - k) < 0.15  # refined cuts on other text: near k, and clearly k-dependent
    with pytest.raises(countdown.ArtifactError, match="unknown selector kind"):
        del KINDS[toy_kind.name]
        try:
            countdown.sparsify(model, "dual", 0.6, mode="prac", artifacts=path)
        finally:
            KINDS[toy_kind.name] = toy_kind
