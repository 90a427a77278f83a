"""The SP-Prac commands of the CLI (calibrate, train, quality) end to end on a tiny model."""

import json

import pytest

import countdown
from countdown.cli import commands as cli
from countdown.artifacts.store import load_artifacts
from conftest import tiny_model
from test_calibrate import TOK, word_texts


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """``countdown.load_model`` answers with one tiny Llama and the character tokenizer."""
    model = tiny_model("llama")
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, TOK))
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(word_texts(0)))
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(word_texts(1)))
    return model, str(calib), str(held_out)


def test_calibrate_then_ppl_with_the_artifact(tiny, tmp_path, capsys):
    model, calib, held_out = tiny
    out = tmp_path / "mono.safetensors"
    assert cli.main(["calibrate", "--method", "mono", "-k", "0.6,0.8", "--texts", calib, "--num-tokens", "512",
                     "--out", str(out)]) == 0
    art = load_artifacts(out)
    assert art.method == "mono" and art.sparsities == [0.6, 0.8] and art.meta["data"]["num_tokens"] == 512
    assert "wrote" in capsys.readouterr().out
    assert cli.main(["ppl", "--method", "mono[threshold]", "-k", "0.8", "--artifacts", str(out),
                     "--texts", held_out, "--max-tokens", "512", "--window", "128", "--json"]) == 0
    printed = capsys.readouterr()
    result = json.loads(printed.out)
    assert result["mode"] == "prac" and result["method"] == "mono[threshold]" and result["perplexity"] > 1
    assert "deprecated" not in printed.err  # no --mode: no deprecation
    assert result["sparsity_real"] == pytest.approx(0.8, abs=0.05)  # fresh text from the same distribution
    assert not countdown.is_sparsified(model) or countdown.unsparsify(model)


def train_lowrank_dual(calib: str, out, k: str, *extra: str) -> int:
    return cli.main(["train", "--method", "dual", "-k", k, "--kind", "lowrank", "--d-rank", "8", "--epochs", "1",
                     "--texts", calib, "--num-tokens", "256", *extra, "--out", str(out)])


def test_train_then_quality(tiny, tmp_path, capsys):
    _, calib, held_out = tiny
    out = tmp_path / "dual.safetensors"
    assert train_lowrank_dual(calib, out, "0.7", "--cut-rule", "pooled") == 0
    art = load_artifacts(out)
    assert art.kind == "lowrank" and art.meta["d_rank"] == 8 and art.meta["training"]["cut_rule"] == "pooled"
    capsys.readouterr()
    assert cli.main(["quality", "--artifacts", str(out), "--texts", held_out, "--num-tokens", "256", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    r = report["by_sparsity"]["0.7"]
    assert 0 < r["f1"] <= 1 and 0.5 < r["sparsity"] < 0.9
    assert report["footprint"]["share"] > 0


def test_train_with_refine_on_decode(tiny, tmp_path, capsys):
    _, calib, _ = tiny
    out = tmp_path / "dual.safetensors"
    assert train_lowrank_dual(calib, out, "0.8", "--refine-on-decode", "2") == 0
    printed = capsys.readouterr().out
    assert "k=0.8: Sparsity-Real of the model's own decode steps per round" in printed
    refit = load_artifacts(out).meta["decode_refit"]
    assert refit["rounds"] == 2 and refit["prompts"] == 8 and refit["prompt_len"] == 32
    assert len(refit["sparsity_real_per_round"]["0.8"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--method", "dual"], "countdown train"),
    (["train", "--method", "mono"], "countdown calibrate"),
    (["calibrate", "--method", "dual[lowrank]"], "kind 'lowrank' is gradient-trained: use `countdown train`"),
    (["calibrate", "--method", "mono", "-k", "1.5"], "sparsity"),
])
def test_wrong_method_or_sparsity_is_a_clear_error(tiny, argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
