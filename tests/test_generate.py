"""countdown.generate, the one-call path: the same tokens as transformers' generate (greedy, EOS, padding
after EOS, batch), a streamer that gets exactly the generated text, and nucleus sampling against a float64
reference. On CPU it decodes eagerly (the CUDA step preparation is checked by make gpu-test's decode files)."""

import math

import pytest
import torch

import countdown
from conftest import tiny_model
from countdown.decode.decoder import sample_tokens
from countdown.decode.generate import reset_decoders

PROMPT = 7


@pytest.fixture(autouse=True)
def _fresh_decoders():
    yield
    reset_decoders()


def _prompt(batch=1, seed=1):
    return torch.randint(3, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def _hf(model, ids, n, eos=None):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)


@pytest.mark.parametrize("method", [None, "mono", "dual"])
def test_greedy_matches_transformers_generate(method):
    model, ids = tiny_model("llama"), _prompt(batch=2)
    model.generation_config.eos_token_id = None
    dense = countdown.generate(model, ids, 10)
    if method:
        countdown.sparsify(model, method, 0.7, path="gather")
    out = countdown.generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 10)
    assert torch.equal(out, _hf(model, ids, 10))
    assert out.shape == (2, PROMPT + 10)
    assert method is None or not torch.equal(out, dense)  # the sparse MLPs ran


def test_eos_stops_and_pads_as_transformers_does():
    model, ids = tiny_model("llama"), _prompt(batch=2, seed=3)
    model.generation_config.eos_token_id = None
    free = countdown.generate(model, ids, 30)
    eos = int(free[0, PROMPT + 2])  # row 0 stops after 3 tokens; row 1 whenever it meets that token
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    out = countdown.generate(model, ids, 30)
    ref = _hf(model, ids, 30, eos=eos)
    assert torch.equal(out, ref)
    assert torch.equal(countdown.generate(model, ids, 30, eos_token_id=[]), free)  # [] never stops early


def test_no_eos_means_no_host_reads_during_the_decode(monkeypatch):
    """generate_fast with eos_token_id None or []: the tokens are not looked at until the end (a look waits for the
    device, which then runs dry); with an EOS, once every 16 steps."""
    from countdown.decode import decoder
    from countdown.decode.generate import generate_fast

    looks = []
    real = decoder._all_finished
    monkeypatch.setattr(decoder, "_all_finished", lambda i, new, eos: looks.append(i) or real(i, new, eos))
    model, ids = tiny_model("llama"), _prompt()
    for eos in (None, []):
        generate_fast(model, ids, 40, eos_token_id=eos, compile=False)
    assert looks == []
    out, _ = generate_fast(model, ids, 40, eos_token_id=[1], compile=False)  # a token the tiny model never picks
    assert len(looks) == 39 and out.shape[1] == PROMPT + 40


def test_streamer_receives_exactly_the_generated_tokens():
    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    model, ids = tiny_model("llama"), _prompt()
    rec = Recorder()
    free = countdown.generate(model, ids, 40, eos_token_id=[], streamer=rec)
    assert rec.ended and rec.puts[0] == ids[0].tolist()  # the prompt first, as transformers' streamers expect
    assert [len(p) for p in rec.puts[1:]] == [17, 16, 7]  # as they were generated (a read every 16 steps)
    assert sum(rec.puts[1:], []) == free[0, PROMPT:].tolist()
    gen = free[0, PROMPT:].tolist()
    eos = next(t for i, t in enumerate(gen) if i >= 2 and t not in gen[:i])
    rec = Recorder()
    out = countdown.generate(model, ids, 40, eos_token_id=eos, streamer=rec)
    assert out[0, -1] == eos and sum(rec.puts[1:], []) == out[0, PROMPT:].tolist()  # nothing after the EOS


def test_sampling_is_seeded_and_padded_prompts_are_refused():
    model, ids = tiny_model("llama"), _prompt()
    a = countdown.generate(model, ids, 12, do_sample=True, temperature=1.3, top_p=0.9, seed=4, eos_token_id=[])
    b = countdown.generate(model, ids, 12, do_sample=True, temperature=1.3, top_p=0.9, seed=4, eos_token_id=[])
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="padded"):
        countdown.generate(model, {"input_ids": ids, "attention_mask": torch.tensor([[0] + [1] * (PROMPT - 1)])}, 4)
    with pytest.raises(ValueError, match="temperature"):
        countdown.generate(model, ids, 4, do_sample=True, temperature=0)


def test_a_left_padded_batch_without_its_mask_is_warned_about():
    """As transformers warns: rows that start with the pad token (some rows, not all: a left-padded batch) and no
    attention mask. The batch is decoded as given; with its mask it is refused (padded prompts), and a batch whose
    every row starts with the pad token (a pad that is also BOS) is no sign of padding."""
    model, ids = tiny_model("llama"), _prompt(batch=2)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    padded = ids.clone()
    padded[0, :2] = 0
    with pytest.warns(UserWarning, match=r"rows \[0\] of the batch start with the pad token \(0\).*left-padded"):
        out = countdown.generate(model, padded, 3)
    assert torch.equal(out, _hf(model, padded, 3))  # decoded as given, every position a token of the prompt
    with pytest.raises(ValueError, match="padded"):
        countdown.generate(model, {"input_ids": padded, "attention_mask": (padded != 0).long()}, 3)
    import warnings

    both = ids.clone()
    both[:, 0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        countdown.generate(model, ids, 3)
        countdown.generate(model, both, 3)


def test_one_generate_gives_its_statistics_on_request():
    """generate_fast is generate with the benchmarks' defaults: the same tokens, the same statistics' keys."""
    from countdown.decode.generate import generate_fast

    model, ids = tiny_model("llama"), _prompt()
    model.generation_config.eos_token_id = None
    tokens, stats = countdown.generate(model, ids, 6, return_stats=True, compile=False)
    fast, fast_stats = generate_fast(model, ids, 6)
    assert torch.equal(tokens, fast) and stats.keys() == fast_stats.keys()
    assert stats["mode"] == "eager" and stats["new_tokens"] == 6 and stats["prompt_tokens"] == PROMPT
    assert "generate_fast" not in countdown.__all__ and countdown.generate_fast is not countdown.generate


def test_top_p_draws_from_the_nucleus():
    """Nucleus sampling against float64: the smallest set of most likely tokens whose mass reaches p."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    temperature, top_p, n = 0.8, 0.75, 40000
    noise = torch.empty(n, 6).exponential_(generator=torch.Generator().manual_seed(0))
    draws = sample_tokens(logits.expand(n, 6), noise, torch.tensor(1 / temperature), None, top_p)
    freq = torch.bincount(draws, minlength=6).double() / n
    p = torch.softmax(logits[0].double() / temperature, 0)
    order = p.argsort(descending=True)
    mass, keep = 0.0, []
    for i in order.tolist():  # by hand: add tokens until the mass reaches top_p
        keep.append(i)
        mass += float(p[i])
        if mass >= top_p:
            break
    ref = torch.zeros(6, dtype=torch.float64)
    ref[keep] = p[keep] / p[keep].sum()
    assert len(keep) == 3 and freq[ref == 0].sum() == 0
    assert torch.allclose(freq, ref, atol=4 * math.sqrt(0.25 / n))
