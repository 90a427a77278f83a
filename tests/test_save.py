"""Saving a sparsified model and loading it back: the same logits, through countdown.save and through
transformers' save_pretrained; the configuration in config.json's quantization_config; folders of earlier releases
(countdown.json versions 1 and 2, countdown_int4) still load; refusals before any write; the folder replaced whole or
not at all."""

import json

import pytest
import torch

import countdown
from countdown.model.hf_quantizer import CountdownHfQuantizer
from countdown.model.saving import ARTIFACTS_NAME, CONFIG_NAME, saved_config
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
    record = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert record == {"quant_method": "countdown", "format_version": 3, "countdown": countdown.__version__,
                      "spec": "dual[shadow4]", "method": "dual", "kind": "shadow", "options": {"bits": 4},
                      "mode": "prac", "k": 0.7, "scope": "decode", "path": "auto", "artifacts": ARTIFACTS_NAME,
                      "weights": None, "nested": None}
    assert (folder / ARTIFACTS_NAME).is_file() and not (folder / CONFIG_NAME).exists()
    back, _ = countdown.load_model(folder)
    assert countdown.is_sparsified(back) and countdown.Spec.of(back) == countdown.parse_spec("dual[shadow4]", 0.7, "decode")
    # transformers' face of the model's state: the quantizer that rebuilt it, the record as saved
    assert isinstance(back.hf_quantizer, CountdownHfQuantizer) and back.config.quantization_config.to_dict() == record
    got = _logits(back)
    assert torch.equal(got, want) and torch.equal(after_save, want)
    assert not torch.equal(got, dense)  # really sparse: the dense model gives other logits
    assert not any("countdown_sparse" in name for name in _saved_names(folder))  # only the model's own weights
    countdown.unsparsify(back)  # nothing of countdown left: a plain model, no stale record for a later save
    assert not hasattr(back.config, "quantization_config") and not back.is_quantized and not hasattr(back, "hf_quantizer")


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
    assert saved_config(tmp_path / "ideal")["spec"] == "mono" and countdown.Spec.of(back).scope == "all"
    assert not (tmp_path / "ideal" / ARTIFACTS_NAME).exists()
    countdown.save(model, tmp_path / "dense")  # a dense model saves as transformers does: no record
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    assert saved_config(tmp_path / "dense") is None
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
        assert not (tmp_path / "taken" / "keep.txt").exists() and saved_config(tmp_path / "taken")["k"] == 0.5
        state = countdown.patch.state.state_of(model)
        state.artifacts = None  # selectors that no artifact describes
        with pytest.raises(ValueError, match="did not come from an artifact"):
            countdown.save(model, tmp_path / "nope")
        assert not (tmp_path / "nope").exists()
        # no temporary folder left (the lock file a save holds, .<name>.lock, stays as every countdown lock does)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []
    finally:
        countdown.unsparsify(model)


def _as_released_in_c16ac8c(folder, version):
    """Rewrite a folder saved now into the shape the release of c16ac8c wrote: the record in countdown.json (format
    version 1: the sparsity; 2: also a 4-bit model's record, which config.json carried as countdown_int4), the spec
    of a plain method with its mode (SP-Prac mono was written "mono" with mode "prac")."""
    config = json.loads((folder / "config.json").read_text())
    new = config.pop("quantization_config")
    int4 = (new["weights"] or {}).get("record")
    old = {"format": "countdown-sparsified", "format_version": version, "countdown": "0.1.0",
           "spec": None if new["spec"] is None else new["method"] if new["kind"] in ("threshold", "teal") else new["spec"],
           "sparsity": new["k"], "mode": new["mode"], "scope": new["scope"], "path": new["path"],
           "artifacts": new["artifacts"]}
    if int4 is not None:
        config["countdown_int4"] = int4
        old["int4"] = int4
    (folder / "config.json").write_text(json.dumps(config))
    (folder / CONFIG_NAME).write_text(json.dumps(old))


@pytest.mark.parametrize("what", ["mono prac, version 1", "dual[shadow4], version 1", "4-bit mono ideal, version 2",
                                  "4-bit dense, version 2", "4-bit dense, save_pretrained"])
def test_folders_saved_by_the_previous_release_still_load(tmp_path, what):
    model = tiny_model("llama", intermediate_size=96)
    if "4-bit" in what:
        countdown.quantize(model, group=32)
    spec, art = None, None
    if "mono prac" in what:
        art = countdown.prepare(model, TOK, "mono[threshold]", 0.7, texts=word_texts(0), num_tokens=256, window=64,
                                progress=False)
        spec = "mono[threshold]"
    elif "shadow4" in what:
        art = countdown.prepare(model, TOK, "dual[shadow4]", 0.7, texts=word_texts(0), num_tokens=256, window=64,
                                progress=False)
        spec = "dual[shadow4]"
    elif "mono ideal" in what:
        spec = "mono"
    if spec is not None:
        countdown.sparsify(model, spec, 0.7, artifacts=art)
    want = _logits(model) if spec is not None else _logits_dense(model)
    folder = tmp_path / "old"
    if "save_pretrained" in what:  # c16ac8c: transformers' own save of a 4-bit model, countdown_int4 in config.json
        type(model).save_pretrained(model, folder)
        assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    else:
        countdown.save(model, folder)
        _as_released_in_c16ac8c(folder, 2 if "version 2" in what else 1)
    if "mono prac" in what:
        assert json.loads((folder / CONFIG_NAME).read_text())["spec"] == "mono"  # the plain method and its mode
    back, _ = countdown.load_model(folder)
    assert countdown.Spec.of(back) == countdown.Spec.of(model)  # spec, k, scope and weight format
    got = _logits(back) if spec is not None else _logits_dense(back)
    assert torch.equal(got, want)
    if spec is not None:
        countdown.unsparsify(model)
        assert not torch.equal(got, _logits_dense(model))  # the loaded model is sparse
    again = tmp_path / "again"  # saved again by this release: the record in config.json, nothing stale
    countdown.save(back, again)
    assert not (again / CONFIG_NAME).exists() and saved_config(again)["format_version"] == 3
    assert torch.equal(_logits(countdown.load_model(again)[0]) if spec is not None else
                       _logits_dense(countdown.load_model(again)[0]), want)
