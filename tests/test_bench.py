"""countdown.bench: specs, roofline bytes, speed-only artifacts and `countdown bench` on tiny random models (CPU).
Speeds are printed by the benchmarks, never asserted here. The harness's step bytes and breakdown: tests/harness/."""

import csv
import math

import pytest
import torch

import countdown
from conftest import tiny_model
from countdown.bench import operating
from countdown.bench.cli import main as bench_main
from countdown.bench.speedonly import decode_prompts, fit_cuts_on_decode, private_copy, random_artifacts, retarget
from countdown.eval.cost import mlp_weight_bytes
from countdown.decode.generate import generate_fast
from countdown.artifacts.prepare import ensure_artifacts
from countdown.spec import parse_spec
from test_calibrate import CharTokenizer, word_texts


class Tok(CharTokenizer):
    """The tests' character tokenizer, with the decode that agreement() prints answers with."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) for i in ids)


TOK = Tok()


def test_bench_parses_with_the_one_grammar(capsys, tmp_path):
    # a spec the library cannot run is refused before any model is loaded, listing the valid ones
    assert bench_main(["--model", "tiny", "--methods", "mono,dual[nosuch]", "--out", str(tmp_path)]) == 2
    assert "no SP-Prac kind 'nosuch'; dual takes dual[hybrid<d_rank>], " in capsys.readouterr().err


def test_roofline_bytes_hand_worked_at_the_llama_8b_shape():
    d, i, e = 4096, 14336, 2
    full = d * i * e  # one matrix: 117,440,512 bytes
    assert mlp_weight_bytes("dense", d, i, 0.1) == 3 * full == 352_321_536
    assert mlp_weight_bytes("mono", d, i, 0.1) == pytest.approx(full * 1.2)  # W_up + 10 % of two matrices
    # A, B in bf16, bias and cut in fp32, 3 x 10 % rows
    assert mlp_weight_bytes("lowrank", d, i, 0.1, d_rank=512) == pytest.approx((d + i) * 512 * e + 8 * i + 0.3 * full)
    assert mlp_weight_bytes("hybrid", d, i, 0.1, d_rank=128) == pytest.approx(full + (d + i) * 128 * e + 0.2 * full)
    # 4-bit shadows of two matrices, one fp16 scale per group of 64 weights of each, plus 3 x 10 % rows
    assert mlp_weight_bytes("shadow", d, i, 0.1, bits=4, group=64) == pytest.approx(
        2 * (d * i // 2 + i * (d // 64) * 2) + 0.3 * full)
    assert mlp_weight_bytes("teal", d, i, 0.5, kept_in=0.25) == pytest.approx(0.5 * full + 0.5 * full)
    with pytest.raises(ValueError, match="unknown roofline kind"):
        mlp_weight_bytes("magic", d, i, 0.1)


@pytest.mark.parametrize("label", ["mono", "dual[hybrid]"])
def test_speed_only_cuts_hit_k_on_the_models_own_decode_steps(label):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    spec = parse_spec(label)
    art = random_artifacts(model, spec, [0.8, 0.5])
    prompts = decode_prompts(128, 4, 8)
    fit_cuts_on_decode(model, art, prompts, new_tokens=16, rounds=2)
    # an independent re-run on the same prompts, the masked path counting every row
    countdown.sparsify(model, spec.method, 0.8, mode="prac", artifacts=art, path="masked")
    generate_fast(model, prompts, 16, compile=False)
    assert countdown.sparsity_real(model)["mean"] == pytest.approx(0.8, abs=0.06)
    countdown.unsparsify(model)


def test_retarget_computes_what_a_fresh_patch_at_that_k_computes():
    model = tiny_model("llama")
    art = random_artifacts(model, parse_spec("dual[lowrank]"), [0.8, 0.5])
    fit_cuts_on_decode(model, art, decode_prompts(128, 4, 8), new_tokens=8, rounds=1)
    ids = torch.randint(0, 128, (2, 12))
    for path in ("masked", "gather"):
        countdown.sparsify(model, "dual", 0.5, mode="prac", artifacts=art, path=path, scope="all")
        want = model(ids).logits
        countdown.unsparsify(model)
        countdown.sparsify(model, "dual", 0.8, mode="prac", artifacts=private_copy(art), path=path, scope="all")
        retarget(model, art, 0.5)
        got = model(ids).logits
        countdown.unsparsify(model)
        assert torch.equal(got, want)


def test_recommendation_and_pareto():
    row = lambda m, k, inc, sp: {"method": m, "sparsity": k, "sparsity_real": k, "ppl_increase": inc,  # noqa: E731
                                 "decode_speedup": sp}
    rows = [row("dense", 0.0, 0.0, 1.0), row("mono", 0.5, 0.04, 1.3), row("dual[hybrid]", 0.5, 0.02, 1.2),
            row("mono", 0.8, 0.30, 1.9), row("cats", 0.5, 0.06, 1.25)]
    assert operating.recommendation(rows, 0.05).startswith("for at most 5 % perplexity increase, use mono at k=0.5 (+4.0 %")
    assert "1.30x faster" in operating.recommendation(rows, 0.05)
    assert "no configuration stays within 1 %" in operating.recommendation(rows, 0.01)
    assert [r["method"] for r in operating.pareto(rows)] == ["dense", "mono", "dual[hybrid]", "mono"]


def _bench_inputs(monkeypatch, tmp_path, **changes):
    """A tiny Llama (``changes`` to its configuration) that countdown.load_model returns, and the held-out and
    calibration text files: (model, held-out path, calibration path)."""
    model = tiny_model("llama", **changes)
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, TOK))
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(word_texts(1)))
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(word_texts(0)))
    return model, str(held_out), str(calib)


@pytest.fixture
def tiny_llama(monkeypatch, tmp_path):
    return _bench_inputs(monkeypatch, tmp_path)


def test_countdown_bench_end_to_end(tiny_llama, tmp_path, capsys):
    model, held_out, calib = tiny_llama
    out = tmp_path / "out"
    argv = ["--model", "tiny", "--methods", "mono,dual[lowrank],teal", "-k", "0.5,0.8", "--texts", held_out,
            "--calib-texts", calib, "--calib-tokens", "256", "--ppl-tokens", "256", "--window", "64",
            "--new-tokens", "6", "--prompt", "8", "--samples", "1",
            "--artifacts-dir", str(tmp_path / "arts"), "--out", str(out), "--no-progress"]
    assert bench_main(argv) == 0
    printed = capsys.readouterr()
    assert "skipping" not in printed.err and "perplexity increase" in printed.out
    rows = list(csv.DictReader(open(out / "tiny.csv")))
    assert list(rows[0])[:9] == ["model", "method", "sparsity", "sparsity_real", "ppl_increase", "kl",
                                 "decode_speedup", "device", "date"]
    # SP-Prac rows, each labelled with its spec (which names the kind: mono[threshold], teal[teal])
    assert [(r["method"], r["sparsity"]) for r in rows] == [("dense", "0.0"), ("mono[threshold]", "0.8"),
                                                              ("mono[threshold]", "0.5"), ("dual[lowrank]", "0.8"),
                                                              ("dual[lowrank]", "0.5"), ("teal[teal]", "0.8"),
                                                              ("teal[teal]", "0.5")]
    assert [abs(float(r["sparsity_real"]) - float(r["sparsity"])) < 0.05 for r in rows[-2:]] == [True, True]
    assert (out / "tiny.md").exists() and (out / "tiny.png").stat().st_size > 0
    # quality columns against an independent recomputation with the cached artifact
    texts = countdown.load_texts(held_out)
    dense = countdown.perplexity(model, TOK, texts=texts, max_tokens=256, window=64, prompt_fraction=0.5, progress=False)
    art = ensure_artifacts(model, TOK, "mono", [0.5, 0.8], tmp_path / "arts", progress=False,
                                               texts=countdown.load_texts(calib), num_tokens=256)
    countdown.sparsify(model, "mono", 0.8, mode="prac", artifacts=art, path="masked")
    sparse = countdown.perplexity(model, TOK, texts=texts, max_tokens=256, window=64, prompt_fraction=0.5, progress=False)
    countdown.unsparsify(model)
    mono8 = rows[1]
    # countdown.perplexity batches 4 windows per forward, the bench one: equal up to float32 rounding
    assert float(rows[0]["ppl"]) == pytest.approx(dense, rel=1e-5)
    assert float(mono8["ppl_increase"]) == pytest.approx(sparse / dense - 1, abs=1e-5)
    assert 0 < float(mono8["sparsity_real"]) < 1 and float(mono8["kl"]) >= 0
    assert float(mono8["decode_speedup"]) == pytest.approx(float(mono8["tokens_per_s"]) / float(mono8["dense_tokens_per_s"]))
    assert not countdown.is_sparsified(model)


def test_countdown_bench_int4_row(tiny_llama, tmp_path, capsys):
    """--int4: after the rows of the model as loaded (weights float32), the dense row of the same model quantized to
    4 bits (weights int4), its perplexity increase and KL against the model as loaded equal to an independent
    recomputation on a 4-bit copy, its speed over the same dense row; named "dense (int4)" in the printed and
    Markdown tables, with the bits its dense step reads per MLP weight. No spec runs on the 4-bit copy (skipping on
    4-bit weights left the product)."""
    import copy

    model, held_out, calib = tiny_llama
    reference = copy.deepcopy(model)
    out = tmp_path / "out"
    assert bench_main(["--model", "tiny", "--methods", "mono", "-k", "0.5", "--texts", held_out, "--calib-texts", calib,
                       "--calib-tokens", "256", "--ppl-tokens", "256", "--window", "64", "--new-tokens", "4",
                       "--prompt", "6", "--samples", "1", "--artifacts-dir", str(tmp_path / "arts"), "--out", str(out),
                       "--no-progress", "--int4"]) == 0
    printed = capsys.readouterr()
    assert "4-bit weights" in printed.err and "dense (int4)" in printed.out
    rows = list(csv.DictReader(open(out / "tiny.csv")))
    assert [(r["method"], r["weights"]) for r in rows] == [("dense", "float32"), ("mono[threshold]", "float32"),
                                                           ("dense", "int4")]
    texts = countdown.load_texts(held_out)
    dense = countdown.perplexity(reference, TOK, texts=texts, max_tokens=256, window=64, prompt_fraction=0.5,
                                 progress=False)
    countdown.quantize(reference, group=64, lm_head=True)  # --int4 alone: groups of 64 (dual[mixed]'s default)
    int4 = countdown.perplexity(reference, TOK, texts=texts, max_tokens=256, window=64, prompt_fraction=0.5,
                                progress=False)
    assert float(rows[2]["ppl_increase"]) == pytest.approx(int4 / dense - 1, abs=1e-5)
    assert int4 != dense and float(rows[2]["kl"]) > 0 and 0 < float(rows[2]["top1"]) <= 1
    assert float(rows[2]["decode_speedup"]) == pytest.approx(float(rows[2]["tokens_per_s"]) / float(rows[2]["dense_tokens_per_s"]))
    assert "| dense (int4) |" in (out / "tiny.md").read_text()
    # d_inter 97 takes no group: W_down stays float32 (4 bytes a weight), gate and up 4.5 bits a weight
    assert float(rows[2]["mlp_bits"]) == pytest.approx((2 * 4.5 + 32) / 3) and float(rows[0]["mlp_bits"]) == 32


@pytest.fixture
def tiny_llama128(monkeypatch, tmp_path):
    """tiny_llama with d_inter 128: a width the nested format's groups of 64 divide."""
    return _bench_inputs(monkeypatch, tmp_path, intermediate_size=128)


def test_countdown_bench_measures_mixed_beside_dense_4bit_and_skipping(tiny_llama128, tmp_path, capsys):
    """dual[mixed] beside dual[shadow4] and the dense 4-bit model, on the user's model: dense (float32), the skipping
    rows on the model as loaded, the dense 4-bit row (countdown.quantize, groups of 64 as dual[mixed]'s), then the
    mixed rows on a copy with nested MLPs and every other Linear 4-bit. Each row's bits read per MLP weight are the
    kinds' arithmetic at its Sparsity-Real (worked by hand here); the mixed rows' perplexity lies between the 8-bit
    model's and the 4-bit model's (the same 4-bit non-MLP Linears in all three) and equals the user's path recomputed
    (prepare, quantize, sparsify); every speed is over the loaded dense."""
    import copy

    from countdown.int4.nested_model import to_nested

    model, held_out, calib = tiny_llama128
    reference = copy.deepcopy(model)
    out = tmp_path / "out"
    arts = tmp_path / "arts"
    assert bench_main(["--model", "tiny", "--methods", "dual[shadow4],dual[mixed]", "-k", "0.5,0.8", "--texts",
                       held_out, "--calib-texts", calib, "--calib-tokens", "256", "--ppl-tokens", "256", "--window",
                       "64", "--new-tokens", "4", "--prompt", "6", "--samples", "1", "--artifacts-dir", str(arts),
                       "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert "skipping" not in printed.err and "nested 8-bit MLPs, the other Linears 4-bit" in printed.err
    assert "bits/MLP w" in printed.out and "dual[mixed] (other Linears int4)" in printed.out
    rows = list(csv.DictReader(open(out / "tiny.csv")))
    assert [(r["method"], r["sparsity"], r["weights"]) for r in rows] == [
        ("dense", "0.0", "float32"), ("dual[shadow4]", "0.8", "float32"), ("dual[shadow4]", "0.5", "float32"),
        ("dense", "0.0", "int4"), ("dual[mixed]", "0.8", "nested8+int4"), ("dual[mixed]", "0.5", "nested8+int4")]
    dense, shadow8, shadow5, int4, mixed8, mixed5 = rows
    assert not countdown.is_sparsified(model) and isinstance(model.model.layers[0].mlp.up_proj, torch.nn.Linear)
    # bits read per MLP weight (d_model 64, d_inter 128, float32 weights, 4-bit planes with fp16 scale and offset
    # per 64 weights: 4 + 32 / 64 = 4.5 bits)
    d, i = 64, 128
    assert float(dense["mlp_bits"]) == 32.0 and float(int4["mlp_bits"]) == pytest.approx(4.5)
    for row in (mixed8, mixed5):  # the high planes of all three, the low planes of the refined share
        refined = 1 - float(row["sparsity_real"])
        assert 0 < refined < 1 and float(row["mlp_bits"]) == pytest.approx(4.5 * (1 + refined), rel=1e-6)
    for row in (shadow8, shadow5):  # two 4-bit shadows (W_gate, W_up; an fp16 scale per 64 weights: 4.25 bits), then
        kept = 1 - float(row["sparsity_real"])  # the kept rows of three fp32 matrices
        assert float(row["mlp_bits"]) == pytest.approx((2 * 4.25 * d * i + 32 * 3 * d * i * kept) / (3 * d * i),
                                                       rel=1e-6)
    assert float(mixed8["mlp_bits"]) < float(mixed5["mlp_bits"]) < 2 * 4.5
    # quality: every row against the loaded model's dense perplexity on the same windows
    texts = countdown.load_texts(held_out)

    def ppl(m):
        return countdown.perplexity(m, TOK, texts=texts, max_tokens=256, window=64, prompt_fraction=0.5,
                                    progress=False)

    assert float(dense["ppl"]) == pytest.approx(ppl(reference), rel=1e-5)
    ppl4 = ppl(countdown.quantize(copy.deepcopy(reference), group=64, lm_head=True))
    ppl8 = ppl(countdown.quantize(to_nested(copy.deepcopy(reference), 64), group=64, lm_head=True))
    assert float(int4["ppl"]) == pytest.approx(ppl4, rel=1e-5)
    for row in (mixed8, mixed5):  # (this random model's MLP is too weak for k to order them: 136.70 / 136.75)
        assert ppl8 < float(row["ppl"]) < ppl4
    for row in rows[1:]:
        assert float(row["ppl_increase"]) == pytest.approx(float(row["ppl"]) / float(dense["ppl"]) - 1, rel=1e-6)
        assert float(row["decode_speedup"]) == pytest.approx(float(row["tokens_per_s"]) / float(row["dense_tokens_per_s"]))
    # the user's path, as the usage lines give it, with the bench's cached artifact: the mixed row's numbers
    user = copy.deepcopy(reference)
    art = countdown.prepare(user, TOK, "dual[mixed]", [0.5, 0.8], texts=countdown.load_texts(calib), num_tokens=256,
                            cache_dir=arts, progress=False)
    countdown.quantize(user, group=64, lm_head=True)
    countdown.sparsify(user, "dual[mixed]", 0.8, artifacts=art, path="masked")
    assert float(mixed8["ppl"]) == pytest.approx(ppl(user), rel=1e-5)
    table = (out / "tiny.md").read_text()
    assert "bits read / MLP weight" in table and "| dual[mixed] (other Linears int4) | 0.8 |" in table


def test_the_recommendation_weighs_mixed_dense_4bit_and_skipping_on_one_scale():
    """The dense 4-bit row is a configuration like any other (only the loaded model's dense row is the reference);
    the line names the winner's bits read per MLP weight, and the usage lines rebuild it."""
    from countdown.bench.cli import usage_lines

    def row(method, k, inc, speedup, bits, weights="bfloat16", **more):
        return {"method": method, "sparsity": k, "sparsity_real": k, "ppl_increase": inc, "decode_speedup": speedup,
                "speedup_min": speedup - 0.02, "speedup_max": speedup + 0.02, "samples": 3, "mlp_bits": bits,
                "weights": weights, **more}

    rows = [row("dense", 0.0, 0.0, 1.0, 16.0), row("dual[shadow4]", 0.5, 0.04, 1.12, 10.2),
            row("dense", 0.0, 0.08, 1.60, 4.5, "int4", group=64), row("dual[mixed]", 0.9, 0.03, 1.45, 4.95, "nested8+int4")]
    line = operating.recommendation(rows, 0.05)
    assert line.startswith("for at most 5 % perplexity increase, use dual[mixed] (other Linears int4) at k=0.9 "
                           "(+3.0 %, Sparsity-Real 0.900, 4.95 bits read per MLP weight): 1.45x")
    lines = usage_lines(rows, 0.05, "tiny")
    assert 'countdown.prepare(model, tokenizer, "dual[mixed]", 0.9)' in lines[0]
    assert "countdown.quantize(model, group=64, lm_head=True)" in lines[1]
    assert 'countdown.sparsify(model, "dual[mixed]", 0.9, artifacts=art)' in lines[2]
    line = operating.recommendation(rows, 0.10)  # dense 4-bit is faster still, within 10 %
    assert line.startswith("for at most 10 % perplexity increase, use dense (int4) (+8.0 %, 4.50 bits read per MLP "
                           "weight): 1.60x")
    assert usage_lines(rows, 0.10, "tiny")[0] == "  Python: countdown.quantize(model, group=64, lm_head=True)"
    assert [r["method"] for r in operating.pareto(rows)] == ["dense", "dense", "dual[mixed]"]
    rows[2].update(speedup_min=0.97)  # its spread reaches 1.0x: never recommended, whatever its median
    assert operating.recommendation(rows, 0.10).startswith("for at most 10 % perplexity increase, use dual[mixed]")
    assert "dual[shadow4] at k=0.5" in operating.recommendation(rows[:2], 0.05)


def test_countdown_bench_speed_only(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert bench_main(["--model", "tiny", "--methods", "cats", "-k", "0.7", "--speed-only", "--new-tokens", "4",
                       "--prompt", "6", "--samples", "1", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "speed only" in printed
    rows = list(csv.DictReader(open(out / "tiny.csv")))
    assert rows[1]["method"] == "cats[threshold]" and rows[1]["ppl_increase"] == "" and rows[1]["kl"] == ""
    assert math.isfinite(float(rows[1]["decode_speedup"]))
    assert bench_main(["--model", "tiny", "--methods", "dual[", "--out", str(out)]) == 2


def test_countdown_bench_on_a_random_weight_shape_reports_speed_only(monkeypatch, tmp_path, capsys):
    from countdown.cli import commands as cli

    model = tiny_model("llama")
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, None))  # a *-shape: no tokenizer
    out = tmp_path / "out"
    assert cli.main(["bench", "--model", "tiny-shape", "--methods", "mono,dual[shadow4]", "-k", "0.8",
                     "--new-tokens", "4", "--prompt", "6", "--samples", "1", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "speed only (random weights" in printed and "quality not measured" in printed
    rows = list(csv.DictReader(open(out / "tiny-shape.csv")))
    assert [r["method"] for r in rows] == ["dense", "mono[threshold]", "dual[shadow4]"]
    assert all(r["ppl_increase"] == "" for r in rows[1:]) and abs(float(rows[2]["sparsity_real"]) - 0.8) < 0.15


def test_countdown_bench_speed_only_runs_mixed_on_a_random_weight_shape(monkeypatch, tmp_path, capsys):
    """A *-shape (no tokenizer): dual[mixed] is built by the library on the model's own greedy text (its patch ranks
    inside the MLP, so its Sparsity-Real comes from the patch's counters), beside the dense 4-bit row; no quality."""
    from countdown.cli import commands as cli

    model = tiny_model("llama", intermediate_size=128)
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, None))
    out = tmp_path / "out"
    assert cli.main(["bench", "--model", "tiny-shape", "--methods", "dual[mixed]", "-k", "0.9", "--new-tokens", "4",
                     "--prompt", "6", "--samples", "1", "--out", str(out), "--no-progress"]) == 0
    assert "skipping" not in capsys.readouterr().err
    rows = list(csv.DictReader(open(out / "tiny-shape.csv")))
    assert [(r["method"], r["weights"]) for r in rows] == [("dense", "float32"), ("dense", "int4"),
                                                           ("dual[mixed]", "nested8+int4")]
    real = float(rows[2]["sparsity_real"])
    assert abs(real - 0.9) < 0.15 and rows[2]["ppl_increase"] == ""
    assert float(rows[2]["mlp_bits"]) == pytest.approx(4.5 * (2 - real), rel=1e-6)
