"""Operating points of ``countdown bench``: decode-style quality in one pass, speed-only stand-ins and the
recommendation (tiny models, CPU). The harness's quality grid, mask replay and merge: tests/harness/."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import countdown
from conftest import tiny_model
from countdown.bench.quality import compare_held, decode_quality, held_out
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


def test_shadow_stand_in_is_the_librarys_quantization_with_cuts_fitted_on_decode():
    from countdown.bench.speedonly import decode_prompts, fit_cuts_on_decode, random_artifacts
    from countdown.decode.generate import generate_fast

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    art = random_artifacts(model, parse_spec("dual[shadow4]"), [0.8, 0.5])
    from countdown.selectors.shadow import fit_shadow_layer
    from countdown.model.gated_mlp import require_gated_mlps
    from countdown.sparse_methods.registry import get_method

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
