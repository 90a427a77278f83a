"""Perplexity against a direct float64 computation, and the command line's error handling."""

import math

import pytest
import torch
import torch.nn.functional as F

import countdown
from countdown.cli import main
from countdown.eval.perplexity import token_windows
from conftest import tiny_model


class CharTokenizer:
    """Characters to ids 3..127, BOS = 1: enough of a tokenizer for perplexity."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) % 125) for c in text]}


TEXTS = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen liquor jugs " * 3]


def direct_ppl(model, rows, first):
    with torch.no_grad():
        logits = model(rows).logits.double()
    logp = torch.log_softmax(logits[:, first:-1], dim=-1)
    nll = -logp.gather(-1, rows[:, first + 1:, None]).squeeze(-1)
    return math.exp(nll.mean().item())


def test_windows_start_with_bos_and_hold_the_stream():
    tok = CharTokenizer()
    rows = token_windows(tok, TEXTS, max_tokens=100, window=21)
    assert rows.shape == (5, 21)
    assert (rows[:, 0] == 1).all()
    stream = tok(TEXTS[0] + "\n\n")["input_ids"]
    assert rows[0, 1:].tolist() == stream[:20]
    assert rows[1, 1:].tolist() == stream[20:40]


def test_dense_perplexity_matches_direct_computation():
    model = tiny_model("llama", torch.float64)
    tok = CharTokenizer()
    rows = token_windows(tok, TEXTS, max_tokens=115, window=24)
    got = countdown.perplexity(model, tok, TEXTS, max_tokens=115, window=24, batch_size=2, progress=False)
    assert got == pytest.approx(direct_ppl(model, rows, 0), rel=1e-9)


def test_decode_style_scores_only_the_sparse_second_half():
    model = tiny_model("gemma3", torch.float64)
    tok = CharTokenizer()
    rows = token_windows(tok, TEXTS, max_tokens=115, window=24)
    dense_half = countdown.perplexity(model, tok, TEXTS, max_tokens=115, window=24, prompt_fraction=0.5,
                                      progress=False)
    assert dense_half == pytest.approx(direct_ppl(model, rows, 11), rel=1e-9)
    countdown.sparsify(model, "dual", 0.8)
    sparse = countdown.perplexity(model, tok, TEXTS, max_tokens=115, window=24, metric="decode", progress=False)
    # Only the 12 sparse positions of each of the 5 windows were counted.
    assert countdown.patch.sparsify.state_of(model).layers[0].rows_total == 5 * 12 * 97
    with countdown.dense_prefix(model, 12):
        expected = direct_ppl(model, rows, 11)
    assert sparse == pytest.approx(expected, rel=1e-9)
    assert sparse != pytest.approx(dense_half, rel=1e-6)


def test_all_positions_sparse_differs_from_dense():
    model = tiny_model("phi3", torch.float64)
    tok = CharTokenizer()
    dense = countdown.perplexity(model, tok, TEXTS, max_tokens=92, window=24, progress=False)
    countdown.sparsify(model, "mono", 0.9, scope="all")
    sparse = countdown.perplexity(model, tok, TEXTS, max_tokens=92, window=24, progress=False)
    assert math.isfinite(sparse) and sparse != pytest.approx(dense, rel=1e-6)
    assert countdown.sparsity_real(model)["mean"] == pytest.approx(1 - 9 / 97)


def test_the_metric_is_what_is_asked_whatever_the_patch_scope():
    """metric "all" (the default) scores every position, sparse, on a model patched with scope "decode" too;
    "decode" is the same number as prompt_fraction 0.5, and an unknown metric names the choices."""
    model = tiny_model("llama", torch.float64)
    tok = CharTokenizer()
    rows = token_windows(tok, TEXTS, max_tokens=92, window=24)
    countdown.sparsify(model, "mono", 0.7)  # scope "decode"
    every = countdown.perplexity(model, tok, TEXTS, max_tokens=92, window=24, progress=False)
    with countdown.dense_prefix(model, 0):
        assert every == pytest.approx(direct_ppl(model, rows, 0), rel=1e-9)
    decode = countdown.perplexity(model, tok, TEXTS, max_tokens=92, window=24, metric="decode", progress=False)
    assert decode == countdown.perplexity(model, tok, TEXTS, max_tokens=92, window=24, prompt_fraction=0.5,
                                          progress=False)
    assert decode != pytest.approx(every, rel=1e-6)
    with pytest.raises(ValueError, match=r"metric must be one of \('all', 'decode'\)"):
        countdown.perplexity(model, tok, TEXTS, max_tokens=92, window=24, metric="prompt", progress=False)


def test_any_max_tokens_works():
    """Fewer tokens than one window: one shorter window, scored like the others; more: whole windows only."""
    model = tiny_model("llama", torch.float64)
    tok = CharTokenizer()
    stream = tok(TEXTS[0] + "\n\n")["input_ids"]
    short = countdown.perplexity(model, tok, TEXTS, max_tokens=10, window=24, progress=False)
    assert short == pytest.approx(direct_ppl(model, torch.tensor([[1] + stream[:10]]), 0), rel=1e-9)
    whole = countdown.perplexity(model, tok, TEXTS, max_tokens=46, window=24, progress=False)
    assert countdown.perplexity(model, tok, TEXTS, max_tokens=50, window=24, progress=False) == whole
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 2"):
        countdown.perplexity(model, tok, TEXTS, max_tokens=1, window=24, progress=False)


def test_too_little_text_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(CharTokenizer(), ["short"], max_tokens=100, window=64)
    # enough text but max_tokens below one window: the message names max_tokens, not the text
    with pytest.raises(ValueError, match=r"max_tokens=10 is less than one window of 63 tokens"):
        token_windows(CharTokenizer(), ["a long enough text " * 20], max_tokens=10, window=64)


@pytest.mark.parametrize("argv, message", [
    (["ppl", "--method", "topk"], "unknown method 'topk'"),
    (["ppl", "--sparsity", "1.5"], "--sparsity/-k: must be a number in (0, 1)"),
    (["generate", "--prompt", "hi", "--sparsity", "0"], "--sparsity/-k: must be a number in (0, 1)"),
    (["cost", "--d-model", "64"], "--d-inter"),
])
def test_cli_reports_bad_input_before_loading_anything(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_cost_json(capsys):
    assert main(["cost", "--d-model", "4096", "--d-inter", "14336", "--sparsity", "0.7", "--json"]) == 0
    import json

    table = json.loads(capsys.readouterr().out)["0.7"]
    assert table["dense"]["flops_m"] == pytest.approx(352.41, abs=0.005)
    assert table["mono"]["flops_m"] == pytest.approx(187.95, abs=0.005)
