"""Fault injection, third round (issue 59): every file read back is verified, and a result that is not a number is an
error naming the likely cause, never a result.

What c16ac8c did, each named in its test: a ``train --checkpoint`` layer file damaged between two runs was loaded on
the resume and built into an artifact with a fresh, valid checksum; a model cache entry damaged inside its tensors
(sizes and header intact) gave ``perplexity nan`` and exit 0; NaN log-likelihoods, KL and logits came back as
results; a damaged text cache was read as it was; a damaged sweep meta file was dropped in silence.
"""

import json
import math
import struct
from pathlib import Path

import pytest
import torch

import countdown
from countdown.cli import commands as cli
from countdown.nonfinite import NonFiniteError
from conftest import tiny_model
from test_calibrate import TOK, word_texts
from test_faults import calib, loads, model, train_argv  # noqa: F401
from test_faults_os import _fake_catalogue, one_error_line


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path / "countdown-cache"))
    monkeypatch.delenv("COUNTDOWN_VERIFY_CACHE", raising=False)


def damage_tensor(path: Path, name: str | None = None, fill: bytes = b"\xff") -> str:
    """Overwrite the bytes of one tensor of a safetensors file (the first, or ``name``) in place; the header and the
    file's size stay as they were (0xff bytes are NaN in fp32, bf16 and fp16). Returns the tensor's name."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = name or next(k for k in sorted(header) if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    raw[8 + n + start:8 + n + end] = fill * (end - start)
    path.write_bytes(bytes(raw))
    return name


# --------------------------------------------------------------------------------------------
# Checkpoint layers carry checksums
# --------------------------------------------------------------------------------------------


def test_a_checkpoint_layer_damaged_between_runs_is_fitted_again(calib, tmp_path, loads, capsys):
    """c16ac8c: the damaged layer was loaded on the resume and its damage built into the artifact, under a fresh
    checksum. Now it fails its checksum, is named, fitted again, and the artifact is the undamaged run's."""
    ckpt = tmp_path / "ckpt"
    assert cli.main(train_argv(calib, tmp_path / "first.safetensors", ckpt)) == 0
    first = countdown.load_artifacts(tmp_path / "first.safetensors")
    layer = ckpt / "layer001.safetensors"
    damage_tensor(layer, fill=b"\x3f")  # finite garbage: 0x3f3f3f3f is 0.747 in fp32
    capsys.readouterr()
    assert cli.main(train_argv(calib, tmp_path / "second.safetensors", ckpt)) == 0
    err = capsys.readouterr().err
    assert f"checkpoint layer {layer} is not used: damaged" in err and "fitting layer 1 again" in err
    second = countdown.load_artifacts(tmp_path / "second.safetensors")
    assert second.tensors.keys() == first.tensors.keys()
    for name, tensor in first.tensors.items():
        assert torch.equal(second.tensors[name], tensor), name


def test_checkpoint_layers_without_a_checksum_or_of_another_layer_are_not_used(tmp_path, capsys):
    from safetensors.torch import save_file

    from countdown.selectors.capture import load_checkpoint, save_layer

    config = {"test": 1}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"A": torch.ones(3)}, str(folder / "layer000.safetensors"))  # as c16ac8c wrote them: no checksum
    save_layer({"A": torch.ones(3)}, folder / "layer001.safetensors", layer=2, config=config)  # layer 2's, misnamed
    save_layer({"A": torch.ones(3)}, folder / "layer002.safetensors", layer=2, config=config)
    save_layer({"A": torch.ones(3)}, folder / "layer003.safetensors", layer=3, config={"test": 2})  # another run's
    done = load_checkpoint(folder, config, 4)
    assert list(done) == [2]
    err = capsys.readouterr().err
    assert "layer000.safetensors is not used: it carries no checksum" in err
    assert "layer001.safetensors is not used: it belongs to another layer" in err
    assert "layer003.safetensors is not used: it belongs to another layer or another run" in err
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "layer002.safetensors"]


# --------------------------------------------------------------------------------------------
# Non-finite results
# --------------------------------------------------------------------------------------------


@pytest.fixture
def nan_model():
    """The tiny Llama with one weight of its last MLP NaN, as a damaged file loads (every logit is then NaN)."""
    m = tiny_model("llama")
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    return m


HINT = "COUNTDOWN_VERIFY_CACHE=sha256"


def test_a_nan_perplexity_is_an_error_naming_the_cause(nan_model, tmp_path, monkeypatch, capsys):
    """c16ac8c: ``perplexity nan``, exit 0."""
    with pytest.raises(NonFiniteError, match=f"perplexity is nan.*{HINT}"):
        countdown.perplexity(nan_model, TOK, texts=word_texts(0), max_tokens=128, window=64, progress=False)
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (nan_model, TOK))
    texts = tmp_path / "t.txt"
    texts.write_text("\n".join(word_texts(0)))
    assert cli.main(["ppl", "--method", "dense", "--texts", str(texts), "--max-tokens", "128", "--window", "64",
                     "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and HINT in one_error_line(out.err, "perplexity is nan")


def test_generate_checks_its_logits_once_per_call(nan_model, monkeypatch):
    """c16ac8c: tokens of a NaN model came back as a result. The check reads the prompt's logits once, after the
    last step (the decode's own steps read nothing more)."""
    import countdown.nonfinite as nonfinite

    calls = []
    import countdown.decode.generate as generate

    monkeypatch.setattr(generate, "check_finite_logits", lambda logits, what: calls.append(tuple(logits.shape))
                        or nonfinite.check_finite_logits(logits, what), raising=False)
    with pytest.raises(NonFiniteError, match=f"generate: the model's logits are not finite.*{HINT}"):
        countdown.generate(nan_model, torch.tensor([[1, 5, 9]]), 8)
    assert calls == [(1, 128)]
    calls.clear()
    assert countdown.generate(tiny_model("llama"), torch.tensor([[1, 5, 9]]), 8).shape == (1, 11)
    assert calls == [(1, 128)]


def test_nan_log_likelihoods_are_errors(nan_model):
    from countdown.eval.scoring import EvalConfig, score_requests

    with pytest.raises(NonFiniteError, match=f"log-likelihoods of dense.*1 of 1 are not finite.*{HINT}"):
        score_requests(nan_model, [([1, 5, 9], [7, 8])], [EvalConfig("dense")], 64)
    good, _ = score_requests(tiny_model("llama"), [([1, 5, 9], [7, 8])], [EvalConfig("dense")], 64)
    assert math.isfinite(good[0][0][0])


def test_nan_log_likelihoods_of_lm_eval_and_a_nan_kl_are_errors():
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from countdown.eval.agreement import agreement
    from countdown.eval.lmeval import CountdownLM
    from test_lmeval import tiny_model as lm_model, tiny_tokenizer

    tok = tiny_tokenizer()
    m = lm_model(len(tok))
    with torch.no_grad():
        m.model.norm.weight[0] = float("inf")
    lm = CountdownLM(pretrained=m, tokenizer=tok, method="dense", batch_size=2)
    with pytest.raises(NonFiniteError, match="lm-eval's log-likelihoods: 2 of 2 are not finite"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("the cat sat", " on"), i) for i in range(2)],
                         disable_tqdm=True)
    lm.restore()
    with pytest.raises(NonFiniteError, match=f"the KL divergence from the dense model is nan.*{HINT}"):
        agreement(m, tok, "mono", 0.8, prompts=["the cat sat on the"], max_new_tokens=3, chat=False)


def test_a_nan_training_loss_is_an_error(model):
    from countdown.selectors.train import train_bce

    X, Y = torch.randn(16, 4), torch.ones(16, 3)
    X[3, 1] = float("nan")
    with pytest.raises(NonFiniteError, match="the training loss is nan"):
        train_bce(torch.nn.Linear(4, 3), X, Y, epochs=1, batch_size=8, lr=1e-2, weight_decay=0.0, pos_weight=None,
                  generator=torch.Generator().manual_seed(0), progress=False, desc="layer 0 k=0.7")


def test_a_model_cache_damaged_inside_its_tensors_is_found_and_rebuilt(tmp_path, monkeypatch):
    """c16ac8c: the damaged entry (sizes and header intact) loaded, and perplexity came back nan. Now the nan is an
    error naming COUNTDOWN_VERIFY_CACHE=sha256, and with it the entry is found damaged and rebuilt."""
    state, folder = _fake_catalogue(monkeypatch, tmp_path / "cache")
    model, _ = countdown.load_model("smollm2-135m")
    ppl = countdown.perplexity(model, TOK, texts=word_texts(0), max_tokens=128, window=64, progress=False)
    damage_tensor(folder / "model.safetensors", "model.layers.0.mlp.down_proj.weight")
    model, _ = countdown.load_model("smollm2-135m")  # sizes and header intact: not seen without the sha256 check
    assert state["builds"] == 1
    with pytest.raises(NonFiniteError, match=HINT):
        countdown.perplexity(model, TOK, texts=word_texts(0), max_tokens=128, window=64, progress=False)
    monkeypatch.setenv("COUNTDOWN_VERIFY_CACHE", "sha256")  # the fix the message names
    model, _ = countdown.load_model("smollm2-135m")
    assert state["builds"] == 2
    assert countdown.perplexity(model, TOK, texts=word_texts(0), max_tokens=128, window=64, progress=False) == ppl


# --------------------------------------------------------------------------------------------
# Caches and tables read back
# --------------------------------------------------------------------------------------------


def test_a_damaged_text_cache_is_fetched_again(tmp_path, monkeypatch, capsys):
    """c16ac8c: a text file of the cache cut short was read as it was (fewer articles, another perplexity)."""
    import countdown.data.texts as texts

    fetches = []

    def fetch(folder):
        fetches.append(folder)
        for source in texts.TEXT_SOURCES.values():
            target = folder / source.member[len(texts._MEMBER_PREFIX):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("".join(json.dumps({source.field: f"{source.name} text {i}"}) + "\n" for i in range(50)))

    monkeypatch.setattr(texts, "_fetch_data_files", fetch)
    assert len(countdown.load_texts("xsum")) == 50 and len(fetches) == 1
    path = texts.source_file("xsum")
    path.write_bytes(path.read_bytes()[:200])  # cut short, as a full disk or a bad copy leaves it
    assert len(countdown.load_texts("xsum")) == 50 and len(fetches) == 2
    assert "the cached text" in capsys.readouterr().err
    assert len(countdown.load_texts("wiki")) == 50 and len(fetches) == 2  # sound: not fetched again


def test_a_damaged_sweep_meta_file_is_named_not_dropped(tmp_path):
    from countdown.eval.sweep.store import SweepStore

    store = SweepStore(tmp_path, "tiny")
    store.add(meta_update=lambda meta: meta["runs"].append({"command": "first"}))
    assert store.meta()["runs"] == [{"command": "first"}]
    store.meta_path.write_text('{"runs": [{"command": "fir')  # cut short
    with pytest.raises(ValueError, match=r"tiny\.meta\.json is damaged"):
        store.add(meta_update=lambda meta: meta["runs"].append({"command": "second"}))
    assert store.meta_path.read_text() == '{"runs": [{"command": "fir'  # not replaced by a fresh one
