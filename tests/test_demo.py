"""countdown demo's headline on a tiny model: the table, CSV and plot it writes, and the sums behind them."""

import csv

import pytest
import torch

import countdown
import countdown.data.texts as texts_module
from countdown.cli import headline
from conftest import tiny_model
from test_calibrate import word_texts
from test_readme import ReadmeTokenizer


def test_headline_compares_dense_with_the_recommended_configuration(monkeypatch, tmp_path):
    model = tiny_model("llama")
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, ReadmeTokenizer()))
    monkeypatch.setattr(texts_module, "eval_texts", lambda *a, **k: word_texts(1))
    monkeypatch.setattr(texts_module, "calibration_texts", lambda *a, **k: word_texts(0))
    monkeypatch.setattr(texts_module, "cache_root", lambda: tmp_path / "cache")
    logs = []
    result = headline.run_headline("tiny", out_dir=tmp_path / "out", max_tokens=512, new_tokens=6, speed_tokens=4,
                                   repeats=1, log=logs.append)
    dense, sparse = result["rows"]
    assert (dense["config"], sparse["config"]) == ("dense", "dual[shadow4] k=0.5")
    assert sparse["ppl_increase"] == pytest.approx(sparse["ppl_decode"] / dense["ppl_decode"] - 1, abs=1e-3)
    assert sparse["vs_dense"] == pytest.approx(sparse["tokens_per_s"] / dense["tokens_per_s"], abs=2e-3)
    assert abs(sparse["sparsity_real"] - 0.5) < 0.1 and dense["sparsity_real"] == 0
    # the perplexities are the library's own decode-style ones (no second way of computing them)
    assert dense["ppl_decode"] == pytest.approx(countdown.perplexity(model, ReadmeTokenizer(), word_texts(1),
                                                                     max_tokens=512, metric="decode",
                                                                     progress=False), rel=1e-3)
    rows = list(csv.DictReader(open(result["csv"])))
    assert [r["config"] for r in rows] == ["dense", "dual[shadow4] k=0.5"] and rows[1]["vs_dense"]
    text = result["markdown"].read_text()
    assert "| dual[shadow4] k=0.5 |" in text and "## Generation" in text
    # no dated GPU run in the output: the demo says where the measured GPU figure is
    assert "On a GPU: the README and docs/results.md" in text and "2026-" not in text and "H200 (" not in text
    assert result["plot"].read_bytes()[:4] == b"\x89PNG"
    assert not countdown.is_sparsified(model)
    assert (tmp_path / "cache" / "artifacts").is_dir()  # the artifact is cached for the next run
