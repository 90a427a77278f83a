"""The lm-eval adapter scores continuations as decoding would: prompt dense, continuation sparse.

The reference for every log-likelihood is computed without the adapter and without dense_prefix:
the patched model (scope="decode") runs the context alone as a prefill with an empty KV cache
(dense), then the continuation through the cache (sparse), one request at a time.
"""

import json
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402

import countdown  # noqa: E402
from countdown.eval.lmeval import CountdownLM, evaluate, main  # noqa: E402

WORDS = ("the a cat dog sat ran on mat rug fast slow red blue big small is was and then it "
         "question answer yes no bird fish sky sea green tree house car road sun moon star "
         "one two three four five six seven eight nine ten").split()

TINY_TASK = [
    {"question": "the cat sat on the", "choices": ["mat", "red rug", "sky"], "label": 0},
    {"question": "a dog ran", "choices": ["fast", "slow and then sat", "on the road"], "label": 1},
    {"question": "the sky is blue and the sea is", "choices": ["green", "blue", "big"], "label": 1},
    {"question": "one two three", "choices": ["four", "four five six", "ten"], "label": 0},
    {"question": "is it a bird", "choices": ["yes", "no", "fish"], "label": 2},
]


def tiny_tokenizer():
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   bos_token="[BOS]", eos_token="[EOS]")


def tiny_model(vocab_size):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=97, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_tokenizer()
    return tiny_model(len(tok)), tok


def decode_reference(model, context_ids, continuation_ids):
    """log p(continuation | context), prefill then cached steps (the model's decode scope decides)."""
    with torch.no_grad():
        first = model(input_ids=torch.tensor([context_ids]), use_cache=True)
        logits = [first.logits[0, -1:]]
        if len(continuation_ids) > 1:
            rest = model(input_ids=torch.tensor([continuation_ids[:-1]]), past_key_values=first.past_key_values,
                         use_cache=True)
            logits.append(rest.logits[0])
    logp = torch.log_softmax(torch.cat(logits).double(), -1)
    target = torch.tensor(continuation_ids)
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


REQUESTS = [("the cat sat on the", " mat"), ("the cat sat on the", " red rug"),
            ("a dog ran", " slow and then sat"), ("one two three four five six seven", " eight nine ten"),
            ("sun", " moon star"), ("the sky is blue and the sea is", " green"), ("is it", " a big red car")]


def _loglikelihoods(lm, requests):
    return lm.loglikelihood([Instance("loglikelihood", {}, req, i) for i, req in enumerate(requests)],
                            disable_tqdm=True)


@pytest.mark.parametrize("method,k", [("dense", None), ("mono", 0.5), ("dual", 0.7), ("cats", 0.8)])
def test_loglikelihood_matches_decode_reference(tiny, method, k):
    model, tok = tiny
    lm = CountdownLM(pretrained=model, tokenizer=tok, method=method, sparsity=k, batch_size=3)
    try:
        got = _loglikelihoods(lm, REQUESTS)
        for (context, continuation), (ll, greedy) in zip(REQUESTS, got):
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            ref_ll, ref_greedy = decode_reference(model, ctx_ids, cont_ids)
            assert ll == pytest.approx(ref_ll, abs=1e-4)
            assert greedy == ref_greedy
        if method != "dense":
            # the dense prefix matters: scoring with every position sparse gives other numbers
            all_sparse = []
            for context, continuation in REQUESTS:
                ctx_ids, cont_ids = lm._encode_pair(context, continuation)
                ids = torch.tensor([ctx_ids + cont_ids[:-1]])
                with torch.no_grad(), countdown.dense_prefix(model, 0):
                    logp = torch.log_softmax(model(input_ids=ids).logits[0, len(ctx_ids) - 1:].double(), -1)
                all_sparse.append(float(logp.gather(-1, torch.tensor(cont_ids)[:, None]).sum()))
            assert max(abs(a - b) for a, b in zip(all_sparse, [g[0] for g in got])) > 1e-3
    finally:
        lm.restore()
    assert not countdown.is_sparsified(model)


def test_sparse_differs_from_dense(tiny):
    model, tok = tiny
    scores = {}
    for method, k in [("dense", None), ("mono", 0.8)]:
        lm = CountdownLM(pretrained=model, tokenizer=tok, method=method, sparsity=k, batch_size=4)
        scores[method] = [ll for ll, _ in _loglikelihoods(lm, REQUESTS)]
        lm.restore()
    assert max(abs(a - b) for a, b in zip(scores["dense"], scores["mono"])) > 1e-2


def test_batch_size_and_truncation(tiny):
    """Rows of one padded batch each get their own dense prefix, also after left truncation."""
    model, tok = tiny
    long_context = " ".join(WORDS[:30])
    requests = REQUESTS + [(long_context, " sun moon"), (long_context + " one", " two three four")]
    lm = CountdownLM(pretrained=model, tokenizer=tok, method="mono", sparsity=0.6, batch_size=1, max_length=12)
    try:
        one = _loglikelihoods(lm, requests)
        lm.batch_size_per_gpu = 4
        four = _loglikelihoods(lm, requests)
        for (context, continuation), (ll1, _), (ll4, _) in zip(requests, one, four):
            assert ll4 == pytest.approx(ll1, abs=1e-4)
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            # lm-eval keeps the last max_length + 1 tokens; what remains of the context is dense
            kept = (ctx_ids + cont_ids)[-13:]
            ref_ll, _ = decode_reference(model, kept[:-len(cont_ids)], cont_ids)
            assert ll4 == pytest.approx(ref_ll, abs=1e-4)
        assert len(lm._encode_pair(long_context, " sun moon")[0]) > 12  # truncation did happen
    finally:
        lm.restore()


def test_model_input_and_dense_prefix_length(tiny):
    model, tok = tiny
    lm = CountdownLM(pretrained=model, tokenizer=tok, method="dense", max_length=6)
    try:
        assert lm._model_input([1, 2, 3], [4, 5]) == ((1, 2, 3, 4), 3)
        assert lm._model_input([1, 2, 3, 4, 5, 6, 7], [8, 9]) == ((3, 4, 5, 6, 7, 8), 5)  # 9 - 7 tokens kept
        with pytest.raises(ValueError, match="longer than max_length"):
            lm._model_input([1], list(range(7)))
    finally:
        lm.restore()


def _write_tiny_task(folder):
    data = folder / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in TINY_TASK))
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(data))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


def test_tiny_task_through_lm_eval(tiny, tmp_path):
    model, tok = tiny
    manager = TaskManager(include_path=str(_write_tiny_task(tmp_path)), include_defaults=False)
    lm = CountdownLM(pretrained=model, tokenizer=tok, method="mono", sparsity=0.5, batch_size=4)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"], task_manager=manager, log_samples=True,
                                      bootstrap_iters=0)
        samples = out["samples"]["tiny_mc"]
        assert len(samples) == len(TINY_TASK)
        correct = []
        for sample in samples:
            doc = sample["doc"]
            refs = []
            for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
                ctx_ids, cont_ids = lm._encode_pair(context, continuation)
                refs.append(decode_reference(model, ctx_ids, cont_ids)[0])
                assert resp[0][0] == pytest.approx(refs[-1], abs=1e-4)
            correct.append(float(max(range(len(refs)), key=refs.__getitem__) == doc["label"]))
        assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    finally:
        lm.restore()

    # evaluate(): the same numbers through the sweep's entry point, and the model comes back dense
    res = evaluate(model, tok, ["tiny_mc"], method="mono", sparsity=0.5, batch_size=2, task_manager=manager)
    assert res["tasks"]["tiny_mc"]["acc"] == pytest.approx(sum(correct) / len(correct))
    assert set(res["tasks"]["tiny_mc"]) == {"acc", "acc_stderr"}
    assert res["n_samples"]["tiny_mc"] == len(TINY_TASK)
    assert 0.45 < res["sparsity_real"] < 0.55
    assert not countdown.is_sparsified(model)


def test_generate_until_prompt_dense_generation_sparse(tiny):
    from countdown.eval.agreement import greedy_continuation

    model, tok = tiny
    context = "the cat sat on the"
    lm = CountdownLM(pretrained=model, tokenizer=tok, method="mono", sparsity=0.7, batch_size=1)
    try:
        request = Instance("generate_until", {}, (context, {"until": ["[UNK] [UNK]"], "max_gen_toks": 6,
                                                            "do_sample": False}), 0)
        text = lm.generate_until([request], disable_tqdm=True)[0]
        ids = torch.tensor(lm.tok_encode(context))
        tokens = greedy_continuation(model, ids, 6, {tok.eos_token_id})
        assert text == tok.decode(tokens, skip_special_tokens=True)
    finally:
        lm.restore()


def test_command_line_registers_countdown(tiny, tmp_path, monkeypatch, capsys):
    model, tok = tiny
    folder = tmp_path / "tiny-model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (tmp_path / "tasks").mkdir()
    tasks = _write_tiny_task(tmp_path / "tasks")
    assert lm_eval.api.registry.get_model("countdown") is CountdownLM
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    main(["--model", "countdown", "--model_args", f"pretrained={folder},method=mono,sparsity=0.5",
          "--tasks", "tiny_mc", "--include_path", str(tasks), "--batch_size", "2"])
    printed = capsys.readouterr().out
    assert "tiny_mc" in printed and "acc" in printed


def test_clear_errors(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="tokenizer"):
        CountdownLM(pretrained=model, tokenizer=None)
    with pytest.raises(ValueError):  # HFLM rejects the batch size after the model was patched
        CountdownLM(pretrained=model, tokenizer=tok, method="mono", sparsity=0.5, batch_size="many")
    assert not countdown.is_sparsified(model)
    countdown.sparsify(model, "mono", 0.5)
    try:
        with pytest.raises(ValueError, match="already sparsified"):
            CountdownLM(pretrained=model, tokenizer=tok, method="mono", sparsity=0.5)
    finally:
        countdown.unsparsify(model)


def test_command_line_adds_offline_tasks_to_include_path(tmp_path, monkeypatch):
    import lm_eval.__main__

    import countdown.eval.tasks

    seen = {}
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.setdefault("argv", list(sys.argv)))
    monkeypatch.setattr(countdown.eval.tasks, "write_task_yamls", lambda names: seen.setdefault("names", names) and tmp_path)
    main(["--model", "countdown", "--tasks", "arc_easy,my_task", "mmlu_anatomy", "--limit", "5"])
    assert seen["names"] == ["arc_easy", "mmlu_anatomy"]
    assert seen["argv"][-2:] == ["--include_path", str(tmp_path)]
    seen.clear()
    main(["--model", "countdown", "--tasks=piqa", "--include_path", "/mine"])
    assert "names" not in seen and seen["argv"].count("--include_path") == 1
