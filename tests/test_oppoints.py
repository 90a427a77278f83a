"""Operating points: decode-style quality in one pass, the resumable quality grid, the one-compile
decode harness, mask replay and the merge into results/operating_points (tiny models, CPU)."""

import csv

import pytest
import torch
import torch.nn.functional as F

import countdown
from conftest import tiny_model
from countdown.bench.quality import decode_quality, held_out, record_masks
from countdown.bench.qualitygrid import artifact_options, read_rows, run_quality_grid
from countdown.bench.specs import parse_spec, resolve_kind
from test_calibrate import CharTokenizer, word_texts

TOK = CharTokenizer()


def _calibrated(model, tmp_path, method="mono", ks=(0.5, 0.8)):
    return countdown.ensure_artifacts(model, TOK, method, list(ks), tmp_path / "arts", progress=False,
                                      texts=word_texts(0), num_tokens=256)


@torch.no_grad()
def test_decode_quality_matches_perplexity_and_a_float64_kl():
    model = tiny_model("llama")
    texts = word_texts(5)
    held = held_out(model, TOK, texts=texts, max_tokens=256, window=64)
    dense = countdown.perplexity(model, TOK, texts=texts, max_tokens=256, window=64, prompt_fraction=0.5,
                                 batch_size=1, progress=False)
    assert held.dense_ppl == pytest.approx(dense, rel=1e-6)
    countdown.sparsify(model, "cats", 0.7, mode="ideal", path="masked")
    try:
        q = decode_quality(model, held)
        sparse = countdown.perplexity(model, TOK, texts=texts, max_tokens=256, window=64, prompt_fraction=0.5,
                                      batch_size=1, progress=False)
        # independent KL: float64 model copies, dense vs sparse forward of every window, scored half only
        ref = []
        for row in held.rows.split(1):
            with countdown.dense_prefix(model, held.prompt):
                q_logits = model(row).logits[0, held.first:-1].double()
            ref.append((row, q_logits))
    finally:
        countdown.unsparsify(model)
    kls = []
    for row, q_logits in ref:
        p = F.log_softmax(model(row).logits[0, held.first:-1].double(), -1)
        kls.append(F.kl_div(F.log_softmax(q_logits, -1), p, log_target=True, reduction="none").sum(-1))
    assert q["ppl"] == pytest.approx(sparse, rel=1e-6)
    assert q["ppl_increase"] == pytest.approx(sparse / dense - 1, rel=1e-5)
    assert q["kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-4)
    assert q["tokens"] == held.scored == 4 * 32 and abs(q["sparsity_real"] - 0.7) < 0.02
    assert 0 < q["top1"] <= 1


def test_record_masks_are_the_masks_the_selectors_pick(tmp_path):
    model = tiny_model("llama")
    held = held_out(model, TOK, texts=word_texts(5), max_tokens=128, window=64)
    countdown.sparsify(model, "mono", 0.8, mode="ideal", path="masked")
    try:
        masks = record_masks(model, held, n_tokens=8)
    finally:
        countdown.unsparsify(model)
    assert masks.shape == (2, 8, 97) and masks.dtype == torch.bool
    assert (masks.sum(-1) == countdown.registry.kept_rows(97, 0.8)).all()  # SP-Ideal keeps exactly n rows


def test_artifact_options_are_spelled_as_the_sweep_spells_them():
    assert artifact_options(resolve_kind(parse_spec("dual"))) == {}
    assert artifact_options(resolve_kind(parse_spec("dual[shadow4]"))) == {}
    assert artifact_options(resolve_kind(parse_spec("dual[shadow3]"))) == {"kind": "shadow", "bits": 3}
    assert artifact_options(resolve_kind(parse_spec("dual[hybrid]"))) == {"kind": "hybrid"}
    assert artifact_options(resolve_kind(parse_spec("dejavu"))) == {}
    assert artifact_options(resolve_kind(parse_spec("mono"))) == {}
    from countdown.sweep.cells import parse_method_spec

    for label in ("dual", "dual[hybrid]", "dual[lowrank]", "dejavu", "cats"):
        assert artifact_options(resolve_kind(parse_spec(label))) == parse_method_spec(label).options


def test_quality_grid_resumes_and_skips_what_it_cannot_build(tmp_path):
    model = tiny_model("llama")
    logs = []
    kwargs = dict(specs="mono,cats,teal", ks=(0.5, 0.8), out_dir=tmp_path / "q", max_tokens=128, window=64,
                  artifacts_dir=tmp_path / "arts", model=model, tokenizer=TOK, texts=word_texts(5),
                  calib={"texts": word_texts(0), "num_tokens": 256}, log=logs.append)
    path = run_quality_grid("tiny", **kwargs)
    rows = read_rows(path)
    assert [(r["method"], r["sparsity"]) for r in rows] == [("dense", "0.0"), ("cats", "0.5"), ("cats", "0.8"),
                                                             ("mono", "0.5"), ("mono", "0.8")]
    assert any("skipping teal" in line for line in logs) or any(r["method"] == "teal" for r in rows)
    assert (tmp_path / "q" / "masks" / "tiny-mono-k0.8.pt").exists()
    saved = torch.load(tmp_path / "q" / "masks" / "tiny-mono-k0.8.pt")
    assert saved["shape"][0] == 2 and saved["method"] == "mono"
    # the mono k=0.8 row against a fresh measurement with the same (cached) artifact
    art = countdown.ensure_artifacts(model, TOK, "mono", [0.5, 0.8], tmp_path / "arts", progress=False,
                                     texts=word_texts(0), num_tokens=256)
    held = held_out(model, TOK, texts=word_texts(5), max_tokens=128, window=64)
    countdown.sparsify(model, "mono", 0.8, mode="prac", artifacts=art, path="masked")
    q = decode_quality(model, held)
    countdown.unsparsify(model)
    mono8 = next(r for r in rows if r["method"] == "mono" and r["sparsity"] == "0.8")
    assert float(mono8["ppl_increase"]) == pytest.approx(q["ppl_increase"])
    assert float(mono8["kl"]) == pytest.approx(q["kl"])
    logs.clear()
    run_quality_grid("tiny", **kwargs)  # resumed: nothing measured again
    assert not any("ppl" in line and "k=" in line for line in logs)
    assert len(read_rows(path)) == 5
