"""Saving a sparsified model and loading it back: the same logits, through countdown.save and through
transformers' save_pretrained; refusals before any write; the folder replaced whole or not at all."""

import json

import pytest
import torch

import countdown
from countdown.saving import ARTIFACTS_NAME, CONFIG_NAME
from conftest import tiny_model
from test_calibrate import TOK, word_texts

IDS = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(3))


def _logits(model):
    with torch.no_grad(), countdown.dense_prefix(model, 6):  # a dense prompt, then sparse positions
        return model(IDS).logits


@pytest.fixture(scope="module")
def shadow():
    model = tiny_model("llama")
    return model, countdown.prepare(model, TOK, "dual[shadow4]", [0.5, 0.7], texts=word_texts(0), num_tokens=256,
                                    window=64, progress=False)


@pytest.mark.parametrize("how", ["countdown.save", "save_pretrained", "artifact given as a path"])
def test_a_saved_sparsified_model_loads_back_the_same(shadow, tmp_path, how):
    model, art = shadow
    if how == "artifact given as a path":  # the model then holds the path, and the save reads the file again
        art = art.save(tmp_path / "a.safetensors")
    countdown.sparsify(model, "dual[shadow4]", 0.7, artifacts=art)
    try:
        want = _logits(model)
        folder = tmp_path / "saved"
        if how == "save_pretrained":
            model.save_pretrained(folder)
        else:
            countdown.save(model, folder)
        after_save = _logits(model)  # the model is still the sparsified one
    finally:
        countdown.unsparsify(model)
    dense = _logits_dense(model)
    record = json.loads((folder / CONFIG_NAME).read_text())
    assert (record["spec"], record["sparsity"], record["mode"]) == ("dual[shadow4]", 0.7, "prac")
    assert (folder / ARTIFACTS_NAME).is_file()
    back, _ = countdown.load_model(folder)
    assert countdown.is_sparsified(back)
    got = _logits(back)
    assert torch.equal(got, want) and torch.equal(after_save, want)
    assert not torch.equal(got, dense)  # really sparse: the dense model gives other logits
    assert not any("countdown_sparse" in name for name in _saved_names(folder))  # only the model's own weights


def _logits_dense(model):
    with torch.no_grad():
        return model(IDS).logits


def _saved_names(folder):
    from safetensors import safe_open

    names = []
    for path in folder.glob("*.safetensors"):
        if path.name != ARTIFACTS_NAME:
            with safe_open(path, "pt") as f:
                names += list(f.keys())
    return names


def test_ideal_and_dense_saves_round_trip(tmp_path):
    model = tiny_model("qwen2")
    countdown.sparsify(model, "mono", 0.6, scope="all")
    want = _logits(model)
    countdown.save(model, tmp_path / "ideal")
    countdown.unsparsify(model)
    back, _ = countdown.load_model(tmp_path / "ideal")
    assert countdown.sparsity_real(back)["target"] == 0.6 and torch.equal(_logits(back), want)
    assert not (tmp_path / "ideal" / ARTIFACTS_NAME).exists()
    countdown.save(model, tmp_path / "dense")  # a dense model saves as transformers does, no countdown.json
    assert not (tmp_path / "dense" / CONFIG_NAME).exists()
    again, _ = countdown.load_model(tmp_path / "dense")
    assert not countdown.is_sparsified(again) and torch.equal(_logits_dense(again), _logits_dense(model))


def test_refusals_come_before_any_write(shadow, tmp_path):
    model, art = shadow
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    countdown.sparsify(model, "dual[shadow4]", 0.5, artifacts=art)
    try:
        with pytest.raises(FileExistsError, match="overwrite=True"):
            countdown.save(model, tmp_path / "taken")
        assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
        countdown.save(model, tmp_path / "taken", overwrite=True)  # replaced whole
        assert not (tmp_path / "taken" / "keep.txt").exists() and (tmp_path / "taken" / CONFIG_NAME).exists()
        state = countdown.state.state_of(model)
        state.artifacts = None  # selectors that no artifact describes
        with pytest.raises(ValueError, match="did not come from an artifact"):
            countdown.save(model, tmp_path / "nope")
        assert not (tmp_path / "nope").exists()
        # no temporary folder left (the lock file a save holds, .<name>.lock, stays as every countdown lock does)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []
    finally:
        countdown.unsparsify(model)
