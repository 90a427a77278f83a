"""Operating points: decode-style quality in one pass, the resumable quality grid, the one-compile
decode harness, mask replay and the merge into results/operating_points (tiny models, CPU)."""

import copy
import csv
import math

import pytest
import torch
import torch.nn.functional as F

import countdown
from conftest import tiny_model
from countdown.bench.quality import compare_held, decode_quality, held_out, record_masks
from countdown.bench.qualitygrid import read_rows, run_quality_grid
from countdown.spec import parse_spec
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
    kls, kls32, slack = [], [], []
    for row, q_logits in ref:
        logits = model(row).logits[0, held.first:-1]
        p, q64 = F.log_softmax(logits.double(), -1), F.log_softmax(q_logits, -1)
        kls.append(F.kl_div(q64, p, log_target=True, reduction="none").sum(-1))
        # decode_quality keeps log-probabilities in float32 (HeldOut.dense_logp) and sums the KL in float64:
        # the same float32 log_softmax of the same logits here (q_logits holds float32 values exactly)
        p32, q32 = (F.log_softmax(t.float(), -1).double() for t in (logits, q_logits))
        kls32.append(F.kl_div(q32, p32, log_target=True, reduction="none").sum(-1))
        # Per position sum_i P_i (p_i - q_i), sum_i P_i = 1: log-probabilities off by at most d (p32 vs p, q32 vs
        # q64) move it by at most 2 d + (e^d - 1) (max|p - q| + 2 d), the second term from P = e^p itself.
        d = max(float((p32 - p).abs().max()), float((q32 - q64).abs().max()))
        slack.append(2 * d + math.expm1(d) * (float((p - q64).abs().max()) + 2 * d))
    assert q["ppl"] == pytest.approx(sparse, rel=1e-6)
    # ppl_increase = ppl / dense_ppl - 1 is a difference of nearly equal numbers: each perplexity agrees to
    # rel 1e-6 above, so the ratio agrees to about 2e-6 of itself, an absolute bound on the increase (a relative
    # one multiplies each CPU path's last-bit differences by 1 / increase, ~250 here). A base off by 0.1 % fails.
    assert q["ppl_increase"] == pytest.approx(sparse / dense - 1, abs=3e-6 * sparse / dense)
    # KL(dense || sparse) is ~3e-4 here, an average of differences of nearly equal log-probabilities: the float32
    # rounding of each log-probability (~6e-8 of |log p| <= 6, and another on each CPU path) was 3.5e-5 of it under
    # AVX-512, so a relative 1e-4 against the float64 KL had a margin of 3. Checked instead: exactly decode_quality's
    # arithmetic (the same float32 log-probabilities; only the float64 summation order differs, ~1e-16 of terms of
    # ~1e-2), and the float64 KL within the bound that the measured float32 rounding implies (~1e-6 here).
    assert q["kl"] == pytest.approx(float(torch.cat(kls32).mean()), rel=1e-9)
    assert q["kl"] == pytest.approx(float(torch.cat(kls).mean()), abs=max(slack))
    assert q["tokens"] == held.scored == 4 * 32 and abs(q["sparsity_real"] - 0.7) < 0.02
    assert 0 < q["top1"] <= 1


def _other_model(model):
    """The same tiny model with every MLP weight moved a little: a second dense reference (as a 4-bit copy is)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if "mlp" in name:
                param.add_(0.5 * param.abs().mean() * torch.randn(param.shape, generator=gen))
    return other


def _float64_scores(reference_logits, logits):
    """KL(reference || row) and top-1 agreement per position, from logits in float64 (independent of
    decode_quality's float32 log-probabilities)."""
    p, q = F.log_softmax(reference_logits.double(), -1), F.log_softmax(logits.double(), -1)
    kl = F.kl_div(q, p, log_target=True, reduction="none").sum(-1)
    return kl, (reference_logits.argmax(-1) == logits.argmax(-1))


@torch.no_grad()
def test_decode_quality_scores_against_other_references_in_the_same_pass():
    model = tiny_model("llama")
    other = _other_model(model)
    texts = word_texts(5)
    held = held_out(model, TOK, texts=texts, max_tokens=256, window=64)
    held_other = held_out(other, TOK, texts=texts, max_tokens=256, window=64)
    assert held_other.dense_ppl != held.dense_ppl
    countdown.sparsify(model, "cats", 0.7, mode="ideal", path="masked")
    try:
        both = decode_quality(model, held, others=[held_other])
        alone = decode_quality(model, held)
        against_other = decode_quality(model, held_other)
        sparse_logits = []
        for row in held.rows.split(1):
            with countdown.dense_prefix(model, held.prompt):
                sparse_logits.append(model(row).logits[0, held.first:-1])
        short = held_out(other, TOK, texts=texts, max_tokens=128, window=64)
        with pytest.raises(ValueError, match="different windows"):
            decode_quality(model, held, others=[short])
    finally:
        countdown.unsparsify(model)
    # one pass gives exactly what a pass per reference gives
    assert {key: value for key, value in both.items() if key != "others"} == alone
    assert both["others"] == [{key: against_other[key] for key in ("ppl_increase", "kl", "top1")}]
    # and the scores against the other model are those of float64 log-probabilities of its own logits
    kls, agree = zip(*(_float64_scores(other(row).logits[0, held.first:-1], logits)
                       for row, logits in zip(held.rows.split(1), sparse_logits)))
    assert both["others"][0]["kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-4, abs=1e-7)
    assert both["others"][0]["top1"] == pytest.approx(float(torch.cat(agree).double().mean()), abs=1.5 / held.scored)
    assert both["others"][0]["ppl_increase"] == pytest.approx(both["ppl"] / held_other.dense_ppl - 1, abs=1e-12)


@torch.no_grad()
def test_compare_held_scores_one_dense_model_against_another_without_a_forward():
    model = tiny_model("llama")
    other = _other_model(model)
    texts = word_texts(5)
    held = held_out(model, TOK, texts=texts, max_tokens=256, window=64)
    held_other = held_out(other, TOK, texts=texts, max_tokens=256, window=64)
    scores = compare_held(held, held_other)
    kls, agree = zip(*(_float64_scores(model(row).logits[0, held.first:-1], other(row).logits[0, held.first:-1])
                       for row in held.rows.split(1)))
    assert scores["kl"] > 1e-4  # the two models differ
    assert scores["kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-4, abs=1e-7)
    assert scores["top1"] == pytest.approx(float(torch.cat(agree).double().mean()), abs=1.5 / held.scored)
    assert scores["ppl"] == held_other.dense_ppl and scores["tokens"] == held.scored
    assert scores["ppl_increase"] == pytest.approx(held_other.dense_ppl / held.dense_ppl - 1, abs=1e-12)
    assert compare_held(held, held) == {"ppl": held.dense_ppl, "ppl_increase": 0.0, "kl": 0.0, "top1": 1.0,
                                        "tokens": held.scored}
    # the other model patched with "dense" and scored against the first: the same figures
    countdown.sparsify(other, "dense")
    try:
        patched = decode_quality(other, held)
    finally:
        countdown.unsparsify(other)
    for key in ("ppl_increase", "kl", "top1"):
        assert patched[key] == pytest.approx(scores[key], rel=1e-5, abs=1e-9)


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


def test_one_compiled_step_serves_dense_every_method_and_every_k():
    """The slot harness (Dynamo, eager backend on the CPU) against eager decoding of the patched model:
    same tokens for dense and each spec at each k, switched in place, and ONE graph for all of them."""
    from countdown.bench.measure import clear_dynamo_counts, dynamo_counts
    from countdown.bench.runner import private_copy
    from countdown.bench.slots import SLOTS, CapturedDecoder, SlotModel, ZeroMLP
    from countdown.bench.speedonly import decode_prompts, fit_cuts_on_decode, random_artifacts, retarget
    from countdown.decode.generate import generate_fast
    from countdown.mlp import require_gated_mlps

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompt = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    arts = {}
    for label in ("mono", "dual[lowrank]"):
        spec = parse_spec(label)
        art = random_artifacts(model, spec, [0.8, 0.4])
        fit_cuts_on_decode(model, art, decode_prompts(128, 2, 7), new_tokens=8, rounds=1)
        arts[label] = (spec, art)
    refs = {"dense": generate_fast(model, prompt, 12, compile="eager")[0][:, 7:]}
    for label, (spec, art) in arts.items():
        for k in (0.8, 0.4):
            countdown.sparsify(model, spec.method, k, mode="prac", artifacts=art, path="auto")
            refs[(label, k)] = generate_fast(model, prompt, 12, compile="eager")[0][:, 7:]
            countdown.unsparsify(model)
    assert not torch.equal(refs["dense"], refs[("mono", 0.8)])  # sparsity changes the tokens: the check can fail
    zero = [g.module for g in require_gated_mlps(model)]
    for m in zero:  # the floor's reference: every MLP's output zero, eager
        m.forward = lambda x: torch.zeros_like(x)
    refs["zero"] = generate_fast(model, prompt, 12, compile="eager")[0][:, 7:]
    for m in zero:
        del m.forward
    assert not torch.equal(refs["dense"], refs["zero"])
    torch._dynamo.reset()
    clear_dynamo_counts()
    params = dict(model.named_parameters())
    with SlotModel(model) as slots:
        assert len(slots.holder.mlps) == 2 and all(SLOTS[p[3].slot] is p[2] for p in slots.places)
        dec = CapturedDecoder(model, slots.holder, 1, 32, compile="eager-backend")
        assert torch.equal(dec.run(prompt, 12)[0], refs["dense"])
        for label, (spec, art) in arts.items():
            countdown.sparsify(slots.holder, spec.method, 0.8, mode="prac", artifacts=private_copy(art), path="auto")
            for k in (0.8, 0.4):
                retarget(slots.holder, art, k)
                assert torch.equal(dec.run(prompt, 12)[0], refs[(label, k)]), (label, k)
            countdown.unsparsify(slots.holder)
        with slots.replaced(lambda m: ZeroMLP()):
            assert torch.equal(dec.run(prompt, 12)[0], refs["zero"])
        assert torch.equal(dec.run(prompt, 12)[0], refs["dense"])
    assert dynamo_counts() == {"unique_graphs": 1, "graph_breaks": 0}
    assert dict(model.named_parameters()).keys() == params.keys()  # the MLPs are back where they were


def test_captured_decoder_times_the_median_prefill_and_the_decode_after_the_last(monkeypatch):
    """Hand-worked on a fake clock: prefills of 10, 30 and 20 s, then 5 steps of 1 s: prefill 20, decode 5."""
    from countdown.bench import slots
    from countdown.bench.slots import CapturedDecoder, SlotModel

    model = tiny_model("llama")
    with SlotModel(model) as slot_model:
        dec = CapturedDecoder(model, slot_model.holder, 1, 16, compile=None)
        clock = {"t": 0.0}
        prefill_costs = iter([10.0, 30.0, 20.0])

        def prefill(ids):
            clock["t"] += next(prefill_costs)
            return torch.ones(1, 1, dtype=torch.long)

        def step(token, position):
            clock["t"] += 1.0
            return token + 1

        monkeypatch.setattr(slots.time, "perf_counter", lambda: clock["t"])
        monkeypatch.setattr(dec, "prefill", prefill)
        monkeypatch.setattr(dec, "step", step)
        tokens, prefill_s, decode_s = dec.run(torch.ones(1, 3, dtype=torch.long), 6, prefills=3)
    assert (prefill_s, decode_s) == (20.0, 5.0) and tokens.tolist() == [[1, 2, 3, 4, 5, 6]]


def test_report_gives_each_rows_mlp_time_in_the_step_from_the_floor():
    """Hand-worked: a 2.0 ms step over a 1.2 ms floor of 32 layers is (2.0 - 1.2) / 32 ms = 25.0 us a
    layer; the cap is the floor's tokens/s over the dense reference's (800 / 250 = 3.20x)."""
    from countdown.bench.report import _mlp_section

    rows = [dict(method="dense", harness="compile-cdt", sparsity="", kernel_us="", tokens_per_s="250",
                 speedup_vs_compiled="1.0", ms_per_step="4.0"),
            dict(method="mono", harness="one-compile", sparsity="0.9", kernel_us="44.0", kernel_roofline_us="33.0",
                 kernel_sparsity_real="0.9", mlp_speedup="2.2", tokens_per_s="480", speedup_vs_compiled="1.92",
                 ms_per_step="2.0", dense_compiled_tokens_per_s="250")]
    text = "\n".join(_mlp_section(rows, {"floor": {"ms_per_step": 1.2, "tokens_per_s": 800.0, "layers": 32}}))
    assert "| mono | 0.9 | 0.9 | 44.0 | 33.0 | 1.33x | 2.20x | 25.0 |" in text
    assert "1.200 ms" in text and "(250.0 tokens/s) no MLP method can pass 3.20x" in text
    assert "| 2.20x | - |" in "\n".join(_mlp_section(rows, {}))  # no floor measured: no in-step figure


def test_mask_replay_keeps_the_kept_counts(tmp_path):
    from countdown.bench.maskreplay import contiguous_like, load_masks, random_like, replay, tile_masks
    from countdown.bench.qualitygrid import _save_masks

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
    import json

    from countdown.bench.merge import OP_COLUMNS, merge_operating_points
    from countdown.bench.qualitygrid import QUALITY_COLUMNS
    from countdown.bench.report import write_csv

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


def test_shadow_stand_in_is_the_librarys_quantization_with_cuts_fitted_on_decode():
    from countdown.bench.speedonly import decode_prompts, fit_cuts_on_decode, random_artifacts
    from countdown.decode.generate import generate_fast

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    art = random_artifacts(model, parse_spec("dual[shadow4]"), [0.8, 0.5])
    from countdown.prac.shadow import fit_shadow_layer
    from countdown.mlp import require_gated_mlps
    from countdown.registry import get_method

    mlps = require_gated_mlps(model)
    ref = fit_shadow_layer(get_method("dual"), mlps[1], 1, torch.randn(8, 64), [0.8], {"bits": 4, "group": 64,
                                                                                       "cut_rule": "mean-quantile"})
    for name in ("gate_q", "up_q", "gate_scale", "up_scale"):
        assert torch.equal(art.tensors[f"shared/layer1/{name}"], ref[f"shared/layer1/{name}"])
    prompts = decode_prompts(128, 4, 8)
    history = fit_cuts_on_decode(model, art, prompts, new_tokens=16, rounds=1)
    assert history[0.8] == history[0.5] == [0.0]  # one shared dense round served both k
    countdown.sparsify(model, "dual", 0.8, mode="prac", artifacts=art, path="masked")
    generate_fast(model, prompts, 16, compile=False)
    assert countdown.sparsity_real(model)["mean"] == pytest.approx(0.8, abs=0.06)
    countdown.unsparsify(model)


def test_recommendation_names_a_configuration_within_the_bound_even_without_its_speed():
    from countdown.bench.opreport import recommendation

    rows = [{"method": "dense", "sparsity": 0.0, "sparsity_real": 0.0, "ppl_increase": 0.0, "decode_speedup": 1.0},
            {"method": "dual[shadow4]", "sparsity": 0.5, "sparsity_real": 0.514, "ppl_increase": 0.042,
             "decode_speedup": None},
            {"method": "mono", "sparsity": 0.7, "sparsity_real": 0.7, "ppl_increase": 0.3, "decode_speedup": 1.3}]
    line = recommendation(rows, 0.05)
    assert line.startswith("for at most 5 % perplexity increase: dual[shadow4] at k=0.5 (+4.2 %")
    assert "no decode speed was measured" in line
    rows[1]["decode_speedup"] = 1.04
    assert recommendation(rows, 0.05).endswith("1.04x faster")
