"""SP-Prac artifacts (countdown.artifacts.store): round trip, checks, corruption, cache."""

import json
import struct
import sys

import pytest
import torch

import countdown
import countdown.artifacts.store as artifacts_mod
from countdown import calibrate, ensure_artifacts, train_predictors
from countdown.artifacts.store import (
    ArtifactError,
    ArtifactMismatchError,
    Artifacts,
    footprint,
    load_artifacts,
    model_fingerprint,
)
from countdown.selectors.base import selectors_for as prac_selectors
from conftest import tiny_model
from test_calibrate import TOK, word_texts

KW = dict(texts=word_texts(0), num_tokens=256, window=128, progress=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def mono(model):
    return calibrate(model, TOK, "mono", [0.7, 0.8, 0.9], **KW)


@pytest.fixture(scope="module")
def dual(model):
    return train_predictors(model, TOK, "dual", [0.7, 0.8], kind="lowrank", d_rank=8, epochs=1, **KW)


@pytest.mark.parametrize("which", ["mono", "dual"])
def test_round_trip_is_exact(which, request, tmp_path):
    art = request.getfixturevalue(which)
    path = art.save(tmp_path / "a.safetensors")
    back = load_artifacts(path)
    assert back.meta == art.meta
    assert back.tensors.keys() == art.tensors.keys()
    for name, t in art.tensors.items():
        assert back.tensors[name].dtype == t.dtype and torch.equal(back.tensors[name], t), name
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]  # no temporary file left behind


def test_metadata_records_what_made_the_artifact(mono, dual, model):
    for art in (mono, dual):
        meta = art.meta
        assert meta["version"] == countdown.__version__
        assert meta["model"]["fingerprint"] == model_fingerprint(countdown.find_gated_mlps(model))
        assert meta["data"]["num_tokens"] == 256 and "user texts" in meta["data"]["name"]
    assert mono.meta["kind"] == "threshold" and mono.meta["method"] == "mono"
    assert dual.meta["kind"] == "lowrank" and dual.meta["d_rank"] == 8 and dual.meta["selection"] == "cut"
    assert dual.meta["training"]["seed"] == 42


def test_repr_is_one_short_line(dual):
    text = repr(dual)
    n_bytes = sum(t.numel() * t.element_size() for t in dual.tensors.values())
    assert "\n" not in text and len(text) < 200  # never the tensors
    assert text.startswith("Artifacts(method='dual', kind='lowrank', d_rank=8, sparsities=[0.7, 0.8]")
    assert f"{len(dual.tensors)} tensors, {n_bytes / 2**20:.1f} MiB" in text


def test_one_file_many_sparsities_picks_the_right_one(mono, model, tmp_path):
    mlps = countdown.find_gated_mlps(model)
    path = mono.save(tmp_path / "mono.safetensors")
    for j, k in enumerate([0.7, 0.8, 0.9]):
        selectors = prac_selectors(path, mlps, "mono", k)
        for i, sel in enumerate(selectors):
            assert float(sel.threshold) == float(mono.tensors["thresholds"][j, i])
    taus = [float(prac_selectors(mono, mlps, "mono", k)[0].threshold) for k in (0.7, 0.8, 0.9)]
    assert taus == sorted(taus)  # a higher k cuts higher


def test_mismatches_are_refused_with_the_fix(mono, dual, model):
    mlps = countdown.find_gated_mlps(model)
    with pytest.raises(ArtifactMismatchError, match=r"made for method 'mono', not 'cats'.*build cats"):
        prac_selectors(mono, mlps, "cats", 0.8)
    with pytest.raises(ArtifactMismatchError, match=r"hold k in \[0.7, 0.8, 0.9\], not k=0.5.*k=0.5"):
        prac_selectors(mono, mlps, "mono", 0.5)
    other_weights = tiny_model("llama", seed=1)
    with pytest.raises(ArtifactMismatchError, match="other weights.*build artifacts for this model"):
        prac_selectors(dual, countdown.find_gated_mlps(other_weights), "dual", 0.8)
    other_shape = tiny_model("gemma3")
    other_shape_mlps = countdown.find_gated_mlps(other_shape)
    if other_shape_mlps[0].d_model == mlps[0].d_model:  # same shapes: the fingerprint catches it
        with pytest.raises(ArtifactMismatchError, match="build artifacts for this model"):
            prac_selectors(mono, other_shape_mlps, "mono", 0.8)
    with pytest.raises(ArtifactMismatchError, match="another model"):
        prac_selectors(mono, mlps[:1], "mono", 0.8)
    # and through the public entry point
    with pytest.raises(ArtifactMismatchError, match="not 'cats'"):
        countdown.sparsify(model, "cats", 0.8, mode="prac", artifacts=mono)
    assert not countdown.is_sparsified(model)


def test_fingerprint_ignores_dtype_but_not_weights():
    a = tiny_model("llama")
    fp = model_fingerprint(countdown.find_gated_mlps(a))
    assert model_fingerprint(countdown.find_gated_mlps(tiny_model("llama", dtype=torch.bfloat16))) == fp
    with torch.no_grad():
        a.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0  # row 0 is one of the fingerprinted rows
    assert model_fingerprint(countdown.find_gated_mlps(a)) != fp


def _data_start(path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


def test_corrupt_and_foreign_files_are_refused(mono, tmp_path):
    path = mono.save(tmp_path / "mono.safetensors")
    raw = path.read_bytes()

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[: len(raw) - 7])
    with pytest.raises(ArtifactError, match="corrupt or truncated.*rebuild"):
        load_artifacts(truncated)

    flipped = bytearray(raw)
    flipped[_data_start(path) + 3] ^= 0xFF  # one byte of tensor data: still a valid safetensors file
    bad = tmp_path / "flipped.safetensors"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(ArtifactError, match="checksum.*rebuild"):
        load_artifacts(bad)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ArtifactError, match="not a countdown artifact.*text file"):  # not "corrupt: delete it"
        load_artifacts(garbage)

    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(3)}, str(foreign))
    with pytest.raises(ArtifactError, match="not a countdown artifact"):
        load_artifacts(foreign)

    with pytest.raises(ArtifactError, match="no artifact file"):
        load_artifacts(tmp_path / "missing.safetensors")


def test_ensure_artifacts_builds_once_then_loads(model, tmp_path, monkeypatch):
    first = ensure_artifacts(model, TOK, "mono", [0.7, 0.9], tmp_path, **KW)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and files[0].name.startswith("mono-")

    def no_build(*args, **kwargs):
        raise AssertionError("should have loaded from the cache")

    monkeypatch.setattr(sys.modules["countdown.artifacts.prepare"], "_build", no_build)  # (ensure_artifacts: prepare's alias)
    again = ensure_artifacts(model, TOK, "mono", 0.9, tmp_path, **KW)  # a subset of a cached file
    assert torch.equal(again.tensors["thresholds"], first.tensors["thresholds"])
    with pytest.raises(AssertionError, match="cache"):
        ensure_artifacts(model, TOK, "mono", 0.9, tmp_path, **{**KW, "num_tokens": 128})  # other options


def test_footprint_counts_one_sparsity(dual, model):
    fp = footprint(dual, model)
    mlps = countdown.find_gated_mlps(model)
    per_layer = 8 * (mlps[0].d_model + mlps[0].d_inter) + mlps[0].d_inter + 1  # A, B, bias, cut
    assert fp["params"] == per_layer * len(mlps)
    assert fp["share"] == pytest.approx(fp["params"] / sum(p.numel() for p in model.parameters()))


def test_sparsify_mono_prac_end_to_end(model, mono, tmp_path):
    path = mono.save(tmp_path / "m.safetensors")
    ids = torch.randint(3, 120, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    countdown.sparsify(model, "mono", 0.8, mode="prac", artifacts=path, scope="all")
    with torch.no_grad():
        sparse = model(input_ids=ids).logits
    real = countdown.sparsity_real(model)
    countdown.unsparsify(model)
    assert not torch.allclose(dense, sparse)
    assert 0.7 < real["mean"] < 0.9 and real["target"] == 0.8
