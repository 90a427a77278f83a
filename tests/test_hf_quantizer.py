"""countdown's transformers quantizer: in a fresh process, ``import countdown`` then
``AutoModelForCausalLM.from_pretrained(folder)`` gives the model ``countdown.save`` wrote (the same greedy tokens
and the same logits at every step: the prompt's, dense on a scope="decode" model, and each decode step's) for a
sparsified SP-Prac model, a 4-bit one, a 4-bit sparsified one and a dual[mixed] one (nested 8-bit MLPs); what transformers alone does with such a folder;
``save_pretrained`` of a loaded model writes the same record; the quantizer's side effects (``is_quantized``,
``.half()``) and what sparsify / unsparsify make of them; the artifact found beside the weights or on the hub."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import countdown
from countdown.model.hf_quantizer import CountdownConfig, CountdownHfQuantizer
from countdown.model.saving import ARTIFACTS_NAME
from conftest import tiny_model
from test_calibrate import TOK, word_texts

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [[1, 17, 4, 99, 23, 56, 8, 71, 30]]
KINDS = ("dual[shadow4]", "int4", "int4 + dual[shadow4]", "dual[mixed]")

# Greedy tokens and the logits of every step (the prompt's first), as the fresh process computes them.
DECODE = """
def decode(model):
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)
"""
exec(DECODE)


def _build(kind: str):
    model = tiny_model("llama", intermediate_size=128)
    if "int4" in kind:
        countdown.quantize(model, group=32)
    if "shadow4" in kind:
        art = countdown.prepare(model, TOK, "dual[shadow4]", 0.5, texts=word_texts(0), num_tokens=256, window=64,
                                progress=False)
        countdown.sparsify(model, "dual[shadow4]", 0.5, artifacts=art)
    if "mixed" in kind:  # nested 8-bit MLPs (made by prepare), kept rows at 8 bits, the rest at 4
        art = countdown.prepare(model, TOK, "dual[mixed]", 0.5, texts=word_texts(0), num_tokens=256, window=64,
                                progress=False)
        countdown.sparsify(model, "dual[mixed]", 0.5, artifacts=art)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: (folder, tokens, logits of the model as saved)}, and the dense float model's under "dense"."""
    root = tmp_path_factory.mktemp("hf")
    out = {"dense": (None, *decode(tiny_model("llama", intermediate_size=128)))}
    for kind in KINDS:
        model = _build(kind)
        folder = root / kind.replace(" + ", "-").replace("[", "-").replace("]", "")
        countdown.save(model, folder)
        out[kind] = (folder, *decode(model))
    return out


def _fresh(script: str, folders: dict, countdown_imported: bool):
    """Run ``script`` in a new Python process (countdown's src on the path; imported only where asked; this
    process's torch thread count, so that its matrix products split and round as ours) with ``folders``; returns
    (its results, its stderr)."""
    head = "import sys, json, torch\n" + f"torch.set_num_threads({torch.get_num_threads()})\n" + \
        ("import countdown\n" if countdown_imported else "") + \
        "from transformers import AutoModelForCausalLM\n" + f"PROMPT = {PROMPT!r}\n" + DECODE
    tail = "\nresults = {}\nfor kind, folder in json.loads(sys.argv[1]).items():\n" + \
           "\n".join("    " + line for line in script.strip().splitlines()) + "\ntorch.save(results, sys.argv[2])\n"
    result = Path(os.environ.get("TMPDIR", "/tmp")) / f"hf_fresh_{os.getpid()}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", head + tail, json.dumps({k: str(v) for k, v in folders.items()}),
                           str(result)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    try:
        return torch.load(result), done.stderr
    finally:
        result.unlink()


def test_from_pretrained_in_a_fresh_process_rebuilds_what_save_wrote(saved):
    """The same tokens; the same logits within float32 rounding as loaded, and bit for bit once the loaded tensors
    are copied into fresh memory: transformers' own save / load round trip of a dense model moves this tiny model's
    logits by about 1e-7 (its matrix products on the loaded, file-backed tensors round differently), nothing
    else does."""
    got, _ = _fresh("""
model = AutoModelForCausalLM.from_pretrained(folder)
assert "countdown" in sys.modules and type(model.hf_quantizer).__name__ == "CountdownHfQuantizer"
as_loaded = decode(model)
with torch.no_grad():
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
results[kind] = (*as_loaded, decode(model)[1], repr(countdown.Spec.of(model)))
""", {kind: saved[kind][0] for kind in KINDS}, countdown_imported=True)
    _, dense_tokens, dense_logits = saved["dense"]
    for kind in KINDS:
        _, tokens, logits = saved[kind]
        assert torch.equal(got[kind][0], tokens), kind
        torch.testing.assert_close(got[kind][1], logits, atol=1e-6, rtol=0, msg=kind)  # every step
        assert torch.equal(got[kind][2], logits), kind  # bit for bit in fresh memory
        # the decode steps are not the dense model's: far beyond the tolerance
        assert (logits[1:] - dense_logits[1:]).abs().amax() > 1e-3, kind
    assert torch.equal(saved["dual[shadow4]"][2][0], dense_logits[0])  # the prompt forward is dense (scope decode)
    assert (saved["int4"][2][0] - dense_logits[0]).abs().amax() > 1e-3  # 4-bit weights: every forward differs
    assert got["int4 + dual[shadow4]"][3] == "Spec('dual[shadow4]', k=0.5, scope='decode', weights='int4 (groups " \
                                            "of 32, float16 scales)')"


def test_transformers_alone_warns_and_loads_the_weights_alone(saved):
    """Without import countdown: transformers' own warning, then the sparsified folder dense and the 4-bit one with
    fresh random Linears (its codes unexpected, its weights missing)."""
    got, err = _fresh("""
model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
assert "countdown" not in sys.modules
results[kind] = (*decode(model), sorted(info["missing_keys"])[:1], sorted(info["unexpected_keys"])[:1])
""", {kind: saved[kind][0] for kind in ("dual[shadow4]", "int4")}, countdown_imported=False)
    assert "Unknown quantization type, got countdown" in err and "skip the quantization" in err
    _, dense_tokens, dense_logits = saved["dense"]
    torch.testing.assert_close(got["dual[shadow4]"][1], dense_logits, atol=1e-6, rtol=0)  # the dense model
    assert got["dual[shadow4]"][2:] == ([], [])
    assert got["int4"][2][0].endswith("_proj.weight") and got["int4"][3][0].endswith((".offset", ".qweight", ".scale"))
    assert (got["int4"][1][0] - saved["int4"][2][0]).abs().amax() > 1e-3  # random Linears


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_of_a_loaded_model_writes_the_same_record(saved, tmp_path, kind):
    folder, tokens, logits = saved[kind]
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "again")
    record = json.loads((folder / "config.json").read_text())["quantization_config"]
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    assert written["quantization_config"] == record and "countdown_int4" not in written  # one record
    assert (tmp_path / "again" / ARTIFACTS_NAME).is_file() == ("shadow4" in kind or "mixed" in kind)  # an SP-Prac artifact
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert torch.equal(decode(back)[0], tokens)
    assert torch.equal(decode(back)[1], decode(model)[1])  # loaded the same way: bit for bit


def test_a_loaded_model_is_quantized_for_transformers_until_nothing_of_countdown_is_left(saved):
    folder = saved["dual[shadow4]"][0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert model.is_quantized and isinstance(model.config.quantization_config, CountdownConfig)
    for cast in (model.half, model.float):  # transformers' rule for a quantized model: load at the dtype wanted
        with pytest.raises(ValueError, match="not supported for quantized model"):
            cast()
    # loading at bf16 is sparsifying the bf16 model: the selectors are built at that dtype (a cast would round them)
    want = countdown.unsparsify(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16))
    countdown.sparsify(want, "dual[shadow4]", 0.5, artifacts=folder / ARTIFACTS_NAME)
    assert torch.equal(decode(model)[1], decode(want)[1])
    countdown.unsparsify(model)  # float weights, nothing of countdown left: a plain model again
    assert not model.is_quantized and not hasattr(model.config, "quantization_config")
    assert model.half().dtype == torch.float16

    both = AutoModelForCausalLM.from_pretrained(saved["int4 + dual[shadow4]"][0])
    countdown.unsparsify(both)  # still 4-bit: the quantizer stays, its record says what the model is now
    assert both.is_quantized and both.config.quantization_config.spec is None
    assert both.config.quantization_config.weights == json.loads(
        (saved["int4"][0] / "config.json").read_text())["quantization_config"]["weights"]
    countdown.sparsify(both, "mono", 0.7)
    assert (both.config.quantization_config.spec, both.config.quantization_config.k) == ("mono", 0.7)


def test_the_artifact_is_found_in_a_hub_snapshot_or_fetched_as_transformers_fetches(saved, tmp_path, monkeypatch):
    """A hub id: the weights in the hub cache's snapshot, the artifact beside them or fetched with the snapshot's
    repository, revision, subfolder and cache; missing, a FileNotFoundError before the weights load."""
    import transformers.utils

    folder = saved["dual[shadow4]"][0]
    logits = decode(AutoModelForCausalLM.from_pretrained(folder))[1]  # the local folder's model, loaded the same way
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--me--tiny"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for name in ("config.json", "model.safetensors"):
        (snapshot / name).write_bytes((folder / name).read_bytes())
    asked = []

    def fetch(name, filename, **kwargs):
        asked.append((name, filename, kwargs["cache_dir"], kwargs["revision"], kwargs["subfolder"]))
        return str(folder / filename) if fetched else None

    monkeypatch.setattr(transformers.utils, "cached_file", fetch)
    fetched = True
    model = AutoModelForCausalLM.from_pretrained("me/tiny", cache_dir=tmp_path, local_files_only=True)
    assert asked == [("me/tiny", ARTIFACTS_NAME, str(tmp_path), revision, "")]
    assert torch.equal(decode(model)[1], logits)
    fetched = False
    with pytest.raises(FileNotFoundError, match=f"{ARTIFACTS_NAME} beside its weights"):
        AutoModelForCausalLM.from_pretrained("me/tiny", cache_dir=tmp_path, local_files_only=True)
    (snapshot / ARTIFACTS_NAME).write_bytes((folder / ARTIFACTS_NAME).read_bytes())
    asked.clear()
    model = AutoModelForCausalLM.from_pretrained("me/tiny", cache_dir=tmp_path, local_files_only=True)
    assert asked == [] and torch.equal(decode(model)[1], logits)  # beside the weights: nothing fetched


def test_a_record_this_release_cannot_rebuild_is_refused_before_the_load(saved, tmp_path, monkeypatch):
    import countdown.int4.loading as loading

    folder = saved["int4"][0]
    for change, message in (({"format_version": 4}, "newer countdown"), ({"weights": {"bits": 8}}, "8-bit"),
                            ({"spec": "dual[shadow4]", "mode": "prac", "k": 0.5, "scope": "decode", "path": "auto",
                              "artifacts": None}, "names no artifact")):
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        copy.mkdir()
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(change)
        (copy / "config.json").write_text(json.dumps(config))
        (copy / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        monkeypatch.setattr(loading, "int4_headers", lambda files: pytest.fail("read the weights' headers"))
        with pytest.raises(ValueError, match=message):
            AutoModelForCausalLM.from_pretrained(copy)


def test_registration_is_once_and_survives_a_reimport():
    from transformers.quantizers import auto, register_quantizer

    import countdown.model.hf_quantizer as module

    assert auto.AUTO_QUANTIZER_MAPPING["countdown"] is CountdownHfQuantizer
    with pytest.raises(ValueError, match="already registered"):  # what transformers does with a second one
        register_quantizer("countdown")(CountdownHfQuantizer)
    module.register()  # countdown's guard: nothing raised, nothing changed
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["countdown"] is CountdownConfig
    try:
        reloaded = importlib.reload(module)
        reloaded.register()  # a re-imported module: its new classes take the place of the old ones
        assert auto.AUTO_QUANTIZER_MAPPING["countdown"] is reloaded.CountdownHfQuantizer is not CountdownHfQuantizer
    finally:
        auto.AUTO_QUANTIZER_MAPPING["countdown"] = CountdownHfQuantizer
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING["countdown"] = CountdownConfig
