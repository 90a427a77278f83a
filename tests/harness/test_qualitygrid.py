"""The operating points' harness on tiny models (CPU): masks recorded from the selectors (harness.maskreplay), the
resumable quality grid (harness.qualitygrid), mask replay, and the merge of quality and speed (harness.merge)."""

import csv
import json

import pytest
import torch

import countdown
from conftest import tiny_model
from countdown.bench.quality import decode_quality, held_out
from harness.maskreplay import contiguous_like, load_masks, random_like, record_masks, replay, tile_masks
from harness.merge import OP_COLUMNS, merge_operating_points
from harness.qualitygrid import QUALITY_COLUMNS, _save_masks, read_rows, run_quality_grid
from harness.report import write_csv
from test_calibrate import CharTokenizer, word_texts

TOK = CharTokenizer()


def test_record_masks_are_the_masks_the_selectors_pick(tmp_path):
    model = tiny_model("llama")
    held = held_out(model, TOK, texts=word_texts(5), max_tokens=128, window=64)
    countdown.sparsify(model, "mono", 0.8, path="masked")
    try:
        masks = record_masks(model, held, n_tokens=8)
    finally:
        countdown.unsparsify(model)
    assert masks.shape == (2, 8, 97) and masks.dtype == torch.bool
    assert (masks.sum(-1) == countdown.sparse_methods.registry.kept_rows(97, 0.8)).all()  # SP-Ideal keeps exactly n rows


def test_quality_grid_resumes_and_skips_what_it_cannot_build(tmp_path):
    model = tiny_model("llama")
    logs = []
    kwargs = dict(specs="mono,cats,teal", ks=(0.5, 0.8), out_dir=tmp_path / "q", max_tokens=128, window=64,
                  artifacts_dir=tmp_path / "arts", model=model, tokenizer=TOK, texts=word_texts(5),
                  calib={"texts": word_texts(0), "num_tokens": 256}, log=logs.append)
    path = run_quality_grid("tiny", **kwargs)
    rows = read_rows(path)
    assert [(r["method"], r["sparsity"]) for r in rows] == [("dense", "0.0"), ("cats[threshold]", "0.5"),
                                                             ("cats[threshold]", "0.8"), ("mono[threshold]", "0.5"),
                                                             ("mono[threshold]", "0.8"), ("teal[teal]", "0.5"),
                                                             ("teal[teal]", "0.8")]
    assert not (tmp_path / "q" / "masks" / "tiny-teal_teal_-k0.8.pt").exists()  # input masks are not replayed
    assert (tmp_path / "q" / "masks" / "tiny-mono_threshold_-k0.8.pt").exists()
    saved = torch.load(tmp_path / "q" / "masks" / "tiny-mono_threshold_-k0.8.pt")
    assert saved["shape"][0] == 2 and saved["method"] == "mono[threshold]"
    # the mono k=0.8 row against a fresh measurement with the same (cached) artifact
    art = countdown.ensure_artifacts(model, TOK, "mono", [0.5, 0.8], tmp_path / "arts", progress=False,
                                     texts=word_texts(0), num_tokens=256)
    held = held_out(model, TOK, texts=word_texts(5), max_tokens=128, window=64)
    countdown.sparsify(model, "mono", 0.8, mode="prac", artifacts=art, path="masked")
    q = decode_quality(model, held)
    countdown.unsparsify(model)
    mono8 = next(r for r in rows if r["method"] == "mono[threshold]" and r["sparsity"] == "0.8")
    assert float(mono8["ppl_increase"]) == pytest.approx(q["ppl_increase"])
    assert float(mono8["kl"]) == pytest.approx(q["kl"])
    logs.clear()
    run_quality_grid("tiny", **kwargs)  # resumed: nothing measured again
    assert not any("ppl" in line and "k=" in line for line in logs)
    assert len(read_rows(path)) == 7


def test_mask_replay_keeps_the_kept_counts(tmp_path):
    gen = torch.Generator().manual_seed(0)
    masks = torch.rand(3, 5, 40, generator=gen) < torch.linspace(0.1, 0.6, 5)[None, :, None]
    _save_masks(tmp_path / "m.pt", masks, {"model": "tiny", "method": "mono", "sparsity": 0.8})
    loaded, meta = load_masks(str(tmp_path / "m.pt"))
    assert torch.equal(loaded, masks) and meta["method"] == "mono"
    big = tile_masks(masks, 4, 97)
    assert big.shape == (4, 5, 97)
    assert torch.equal(big[3, :, 45], masks[0, :, 5]) and torch.equal(big[1, 2, :40], masks[1, 2])
    for other in (random_like(big), contiguous_like(big)):
        assert torch.equal(other.sum(-1), big.sum(-1)) and not torch.equal(other, big)
    assert contiguous_like(big)[0, 0, :int(big[0, 0].sum())].all()
    w = [(torch.randn(97, 16), torch.randn(97, 16), torch.randn(97, 16)) for _ in range(2)]
    assert replay(w, [torch.randn(1, 16) for _ in range(2)], big[:2, :1], "silu", reps=1) > 0  # runs (Triton interpreted)


def test_merge_reads_speed_at_the_real_models_sparsity(tmp_path):
    speed = tmp_path / "speed"
    speed.mkdir()
    base = {"run": "R", "batch": 1, "new_tokens": 512, "device": "GPU", "date": "2026-11-23", "config": "shape"}
    write_csv([{**base, "method": "dense", "harness": "compile-cdt", "tokens_per_s": 200, "decode_tokens_per_s": 200,
                "sparsity": "", "sparsity_real": ""},
               {**base, "method": "dense", "harness": "one-compile", "tokens_per_s": 190, "decode_tokens_per_s": 190, "kernel_us": 100,
                "sparsity": "", "sparsity_real": ""},
               {**base, "method": "mono", "harness": "one-compile", "sparsity": 0.5, "sparsity_real": 0.5,
                "tokens_per_s": 220, "decode_tokens_per_s": 220, "kernel_us": 60, "mlp_speedup": 100 / 60},
               {**base, "method": "mono", "harness": "one-compile", "sparsity": 0.7, "sparsity_real": 0.7,
                "tokens_per_s": 260, "decode_tokens_per_s": 260, "kernel_us": 40, "mlp_speedup": 2.5}], str(speed / "decode.csv"))
    (speed / "decode_meta.json").write_text(json.dumps([{**base, "command": "decode.py"}]))
    quality = tmp_path / "quality"
    quality.mkdir()
    q = {"model": "tiny", "dense_ppl": 10.0, "top1": 1, "date": "2026-11-23"}
    with open(quality / "tiny.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=QUALITY_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows([{**q, "method": "dense", "sparsity": 0, "sparsity_real": 0, "ppl": 10, "ppl_increase": 0, "kl": 0},
                     {**q, "method": "mono", "sparsity": 0.6, "sparsity_real": 0.6, "ppl": 10.3, "ppl_increase": 0.03,
                      "kl": 0.1},
                     {**q, "method": "mono", "sparsity": 0.8, "sparsity_real": 0.75, "ppl": 13, "ppl_increase": 0.3,
                      "kl": 0.5}])
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    with open(sweep / "tiny.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["model", "method", "mode", "sparsity", "task", "metric", "value", "setting"])
        w.writeheader()
        w.writerows([{"model": "tiny", "method": "dense", "mode": "", "sparsity": "", "task": "arc_easy", "metric": "acc",
                      "value": 0.6, "setting": "limit=30"},
                     {"model": "tiny", "method": "mono", "mode": "prac", "sparsity": "0.6", "task": "arc_easy",
                      "metric": "acc", "value": 0.5, "setting": "limit=30"}])
    (sweep / "tiny.meta.json").write_text(json.dumps({"artifacts": {"mono": {"kind": "threshold"}}}))
    out = tmp_path / "op"
    written = merge_operating_points([str(speed)], str(quality), str(out), str(sweep), log=lambda m: None)
    rows = list(csv.DictReader(open(out / "tiny.csv")))
    assert list(rows[0]) == OP_COLUMNS
    dense, mono6, mono8 = rows
    assert float(dense["decode_speedup"]) == 1.0 and float(dense["task_score"]) == pytest.approx(0.6)
    # halfway between 1.10x (220 / 200) and 1.30x (260 / 200): against the fastest compiled dense decoder
    assert float(mono6["decode_speedup"]) == pytest.approx(1.2)
    assert float(mono6["kernel_us"]) == pytest.approx(50) and float(mono6["task_score"]) == pytest.approx(0.5)
    assert mono8["decode_speedup"] == "" and "outside the timed range" in mono8["speed_note"]
    line = written["tiny"]["recommendation"]
    assert line.startswith("for at most 5 % perplexity increase, use mono at k=0.6 (+3.0 %") and "1.20x faster" in line
    assert (out / "tiny.md").read_text().count("| mono |") == 2 and (out / "tiny.png").stat().st_size > 0
