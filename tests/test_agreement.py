"""Agreement metrics of a sparse model with its dense self, and the optional judge client."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

import countdown
from countdown.eval.agreement import (agreement, default_prompts, greedy_continuation, judge_win_rate, kl_and_top1,
                                 match_stats)

WORDS = "the a cat dog sat ran on mat red blue big small is and then it sun moon star tree sea sky".split()
PROMPTS = ["the cat sat on the", "a big red dog", "sun and moon and", "it is blue"]


@pytest.fixture(scope="module")
def tiny():
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                        bos_token="[BOS]", eos_token="[EOS]")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=97, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return AutoModelForCausalLM.from_config(cfg).eval(), tokenizer


def test_match_stats_hand_worked():
    assert match_stats([1, 2, 3, 4], [1, 2, 3, 4]) == {"exact": 1.0, "prefix": 1.0, "token": 1.0}
    assert match_stats([1, 2, 3, 4], [1, 2, 9, 4]) == {"exact": 0.0, "prefix": 0.5, "token": 0.75}
    assert match_stats([1, 2, 3, 4], [1, 2]) == {"exact": 0.0, "prefix": 0.5, "token": 0.5}
    assert match_stats([5, 6], [7, 6, 8]) == {"exact": 0.0, "prefix": 0.0, "token": 0.5}


def test_kl_and_top1_against_hand_computation():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]], dtype=torch.float64)
    kl, top1 = kl_and_top1(p.log(), q.log())
    expected = [0.7 * math.log(0.7 / 0.6) + 0.2 * math.log(0.2 / 0.3), 0.25 * math.log(0.5) + 0.5 * math.log(2.0)]
    assert kl.tolist() == pytest.approx(expected, abs=1e-12)
    assert top1.tolist() == [True, False]


def test_sparse_equal_to_dense_agrees_perfectly(tiny):
    model, tok = tiny
    res = agreement(model, tok, "dense", prompts=PROMPTS, max_new_tokens=8, chat=False)
    assert res["exact_match"] == res["prefix_match"] == res["token_match"] == res["top1"] == 1.0
    assert res["kl"] == pytest.approx(0.0, abs=1e-12)
    assert res["n_prompts"] == len(PROMPTS)
    assert not countdown.is_sparsified(model)


def test_sparse_metrics_match_an_independent_decode(tiny):
    """KL and top-1 recomputed from an unpatched dense forward and a prefill-then-cached sparse forward."""
    model, tok = tiny
    res = agreement(model, tok, "mono", 0.8, prompts=PROMPTS, max_new_tokens=8, chat=False)
    assert not countdown.is_sparsified(model)
    assert res["kl"] > 1e-4 and 0.0 <= res["top1"] <= 1.0
    assert res["sparsity_real"] == pytest.approx(1 - countdown.kept_rows(97, 0.8) / 97, abs=1e-9)
    kls, top1s = [], []
    for prompt, row in zip(PROMPTS, res["per_prompt"]):
        x = tok(prompt)["input_ids"]
        y = row["dense_ids"]
        with torch.no_grad():
            dense = model(input_ids=torch.tensor([x + y])).logits[0, len(x):]
            assert greedy_continuation(model, torch.tensor(x), 8, {tok.eos_token_id}) == y
            countdown.sparsify(model, "mono", 0.8)
            try:
                first = model(input_ids=torch.tensor([x]), use_cache=True)  # prompt: dense prefill
                sparse = model(input_ids=torch.tensor([y]), past_key_values=first.past_key_values).logits[0]
                assert greedy_continuation(model, torch.tensor(x), 8, {tok.eos_token_id}) == row["sparse_ids"]
            finally:
                countdown.unsparsify(model)
        log_p, log_q = torch.log_softmax(dense.double(), -1), torch.log_softmax(sparse.double(), -1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
        top1s.append(dense.argmax(-1) == sparse.argmax(-1))
        assert row["exact"] == float(row["sparse_ids"] == y)
    assert res["kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-4, abs=1e-7)
    assert res["top1"] == pytest.approx(float(torch.cat(top1s).double().mean()))
    assert res["n_sparse_positions"] == sum(len(r["dense_ids"]) for r in res["per_prompt"])


def test_default_prompts_ship_with_the_package():
    prompts = default_prompts()
    assert 15 <= len(prompts) <= 30 and all(isinstance(p, str) and p for p in prompts)


def test_refuses_a_patched_model(tiny):
    model, tok = tiny
    countdown.sparsify(model, "mono", 0.5)
    try:
        with pytest.raises(ValueError, match="unsparsify"):
            agreement(model, tok, "mono", 0.5, prompts=PROMPTS)
    finally:
        countdown.unsparsify(model)


class _Judge(BaseHTTPRequestHandler):
    """Prefers whichever response contains 'good'; records what it was sent."""

    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Judge.seen.append((self.path, self.headers.get("Authorization"), body))
        text = body["messages"][-1]["content"]
        a = text.split("[Response A]\n", 1)[1].split("\n\n[Response B]", 1)[0]
        if "confuse" in text:
            verdict = "I cannot tell."
        else:
            verdict = "A" if "good" in a else "B"
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": verdict}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture()
def judge_url():
    server = HTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Judge.seen = []
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()
    server.server_close()


def test_judge_both_orders(judge_url):
    prompts = ["p1", "p2", "p3", "p4"]
    dense = ["good answer", "bad answer", "same", "confuse me"]
    sparse = ["bad answer", "good answer", "same", "also confuse"]
    res = judge_win_rate(prompts, dense, sparse, url=judge_url, model="judge-x", api_key="k123")
    # p1: sparse loses twice (0, 0); p2: wins twice (1, 1); p3 identical (0.5, 0.5, no call);
    # p4: unparsable replies (0.5, 0.5)
    assert res["win_rate"] == pytest.approx((0 + 0 + 1 + 1 + 0.5 + 0.5 + 0.5 + 0.5) / 8)
    assert res["n_judgments"] == 8 and res["identical"] == 1 and res["unparsed"] == 2
    assert res["chose_a"] == pytest.approx(0.5)  # a judge that follows content has no position bias
    assert len(_Judge.seen) == 6
    path, auth, body = _Judge.seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer k123" and body["model"] == "judge-x"
    first, second = _Judge.seen[0][2]["messages"][-1]["content"], _Judge.seen[1][2]["messages"][-1]["content"]
    assert "[Response A]\ngood answer" in first and "[Response A]\nbad answer" in second  # orders swapped


def test_judge_errors_are_clear(judge_url):
    with pytest.raises(RuntimeError, match="unreachable"):
        judge_win_rate(["p"], ["a"], ["b"], url="http://127.0.0.1:9/v1", model="m", timeout=2)
    with pytest.raises(ValueError, match="same length"):
        judge_win_rate(["p"], ["a", "b"], ["c"], url=judge_url, model="m")
