"""The shared-prompt path scores every request as today's lm-eval adapter does, configuration by
configuration: the reference is CountdownLM (one patched forward of context + continuation per
request, dense prefix) run separately for each configuration."""

import random

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
from conftest import tiny_model as arch_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from test_lmeval import REQUESTS, WORDS, _write_tiny_task, tiny_model, tiny_tokenizer  # noqa: E402

import countdown  # noqa: E402
from countdown.eval.lmeval import CountdownLM, evaluate  # noqa: E402
from countdown.eval.shared_prompt import EvalConfig, evaluate_configs, score_requests, split_request  # noqa: E402

# float32 rounding: prompt and continuation run in two calls (attention sums in another order)
ATOL = 1e-4


def _requests():
    long_context = " ".join(WORDS[:30])
    return REQUESTS + [(long_context, " sun moon"), (long_context + " one", " two three four"),
                       ("the cat sat on the", " mat"),  # a duplicate request
                       ("the cat sat on the", " mat and")]  # same prompt, a continuation sharing a prefix


def _reference(model, tok, config, encoded, max_length):
    lm = CountdownLM(pretrained=model, tokenizer=tok, method=config.method, sparsity=config.sparsity,
                     mode=config.mode, artifacts=config.artifacts, batch_size=3, max_length=max_length)
    try:
        if config.method != "dense":
            countdown.reset_sparsity_stats(model)
        answers = lm._loglikelihood_tokens([(None, c, k) for c, k in encoded], disable_tqdm=True)
        real = countdown.sparsity_real(model)["mean"] if config.method != "dense" else None
    finally:
        lm.restore()
    return answers, real


@pytest.fixture(scope="module")
def prac_artifacts():
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(6)]
    mono = countdown.calibrate(model, tok, "mono", [0.6], texts=texts, num_tokens=64, window=16, progress=False)
    dual = countdown.train_predictors(model, tok, "dual", [0.6], texts=texts, num_tokens=64, window=16,
                                      progress=False)
    return model, tok, {"mono": mono, "dual": dual}


@pytest.mark.parametrize("max_length", [64, 12])  # 12: lm-eval's left truncation cuts the long prompts
def test_every_configuration_equals_the_per_configuration_adapter(prac_artifacts, max_length):
    model, tok, arts = prac_artifacts
    configs = [EvalConfig("dense"), EvalConfig("mono", "ideal", 0.5), EvalConfig("cats", "ideal", 0.8),
               EvalConfig("dual", "ideal", 0.7), EvalConfig("dejavu", "ideal", 0.6),
               EvalConfig("mono", "prac", 0.6, arts["mono"]), EvalConfig("dual", "prac", 0.6, arts["dual"])]
    lm = CountdownLM(pretrained=model, tokenizer=tok, method=None, max_length=max_length)
    encoded = [lm._encode_pair(c, k) for c, k in _requests()]
    # chunk 3: prompts of different lengths in one left-padded batch (chunk 1 in the test below)
    shared, real = score_requests(model, encoded, configs, max_length, chunk=3, batch_tokens=6)  # several batches
    if True:
        for c, config in enumerate(configs):
            ref, ref_real = _reference(model, tok, config, encoded, max_length)
            for (ll, greedy), (ref_ll, ref_greedy) in zip(shared[c], ref):
                assert ll == pytest.approx(ref_ll, abs=ATOL)
                assert greedy == ref_greedy
            if ref_real is None:
                assert real[c] is None
            else:  # the same sparse positions, each counted once: the same Sparsity-Real
                assert real[c] == pytest.approx(ref_real, abs=1e-12)
    assert not countdown.is_sparsified(model)
    # the sparse configurations really differ from dense (the test is not comparing dense with itself)
    assert max(abs(a[0] - b[0]) for a, b in zip(shared[0], shared[1])) > 1e-2


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_other_architectures(arch):
    """Biases (Qwen2) and sliding-window layers with their own cache type (Gemma-3)."""
    model = arch_model(arch)
    gen = torch.Generator().manual_seed(1)
    encoded = [(torch.randint(3, 128, (n,), generator=gen).tolist(), torch.randint(3, 128, (m,), generator=gen).tolist())
               for n, m in [(9, 3), (9, 1), (5, 4), (14, 2), (5, 4)]]
    tok = tiny_tokenizer()  # only its pad id is read by the reference
    configs = [EvalConfig("dense"), EvalConfig("mono", "ideal", 0.6), EvalConfig("dual", "ideal", 0.5)]
    shared, _ = score_requests(model, encoded, configs, 64, chunk=1 if arch == "qwen2" else 4)
    for c, config in enumerate(configs):
        ref, _ = _reference(model, tok, config, encoded, 64)
        for (ll, greedy), (ref_ll, ref_greedy) in zip(shared[c], ref):
            assert ll == pytest.approx(ref_ll, abs=ATOL)
            assert greedy == ref_greedy


def test_split_request_follows_lm_eval_truncation():
    assert split_request([1, 2, 3], [4, 5], 6) == ((1, 2, 3), (4,))
    assert split_request([1, 2, 3, 4, 5, 6, 7], [8, 9], 6) == ((3, 4, 5, 6, 7), (8,))  # 9 - 7 tokens kept
    assert split_request([1, 2], [3], 6) == ((1, 2), ())
    with pytest.raises(ValueError, match="longer than max_length"):
        split_request([1], list(range(7)), 6)


def test_evaluate_configs_equals_evaluate_per_configuration(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    manager = TaskManager(include_path=str(_write_tiny_task(tmp_path)), include_defaults=False)
    configs = [EvalConfig("dense"), EvalConfig("mono", "ideal", 0.5)]
    shared = evaluate_configs(model, tok, "tiny_mc", configs, batch_size=2, task_manager=manager)
    for config, res in zip(configs, shared):
        ref = evaluate(model, tok, ["tiny_mc"], method=config.method, sparsity=config.sparsity, batch_size=2,
                       task_manager=manager)
        assert res["tasks"]["tiny_mc"] == pytest.approx(ref["tasks"]["tiny_mc"])
        assert res["n_samples"] == ref["n_samples"]
        assert (res["sparsity_real"] is None) == (ref["sparsity_real"] is None)
        if ref["sparsity_real"] is not None:
            assert res["sparsity_real"] == pytest.approx(ref["sparsity_real"], abs=1e-12)
        # per-document outcomes: one per document, in document order, averaging to lm-eval's acc
        assert [d for d, _ in res["samples"]] == list(range(5))
        assert sum(per["acc"] for _, per in res["samples"]) / 5 == pytest.approx(ref["tasks"]["tiny_mc"]["acc"])
    assert not countdown.is_sparsified(model)


def test_sliding_window_shorter_than_the_prompts():
    """Gemma-3's sliding-window layers with prompts longer than the window (Gemma-3-270m: window 512,
    BoolQ prompts up to ~780 tokens): the cached prompt keeps every position, the mask applies the window."""
    import transformers
    from conftest import _COMMON

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=4,
                                           layer_types=["sliding_attention", "full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(2)
    encoded = [(torch.randint(3, 128, (n,), generator=gen).tolist(), torch.randint(3, 128, (m,), generator=gen).tolist())
               for n, m in [(11, 3), (7, 6), (3, 4), (14, 2), (9, 1)]]
    tok = tiny_tokenizer()
    configs = [EvalConfig("dense"), EvalConfig("dual", "ideal", 0.5)]
    shared, _ = score_requests(model, encoded, configs, 64, chunk=3, batch_tokens=12)
    for c, config in enumerate(configs):
        ref, _ = _reference(model, tok, config, encoded, 64)
        for (ll, greedy), (ref_ll, ref_greedy) in zip(shared[c], ref):
            assert ll == pytest.approx(ref_ll, abs=ATOL)
            assert greedy == ref_greedy
