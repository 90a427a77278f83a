"""generate_fast (static cache, one-token steps) against transformers' own generate, on CPU."""

import math

import pytest
import torch

import countdown
from conftest import tiny_model
from countdown.decode.generate import generate_fast, reset_decoders, sample_tokens

PROMPT_LEN = 7


def _model(arch="llama", seed=0):
    model = tiny_model(arch, seed=seed)
    model.generation_config.eos_token_id = None  # run every requested step, as generate_fast does
    return model


def _prompt(batch=2, seed=1, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, PROMPT_LEN), generator=g)


def _hf_greedy(model, ids, n):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)


@pytest.fixture(autouse=True)
def _fresh_decoders():
    yield
    reset_decoders()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_greedy_dense_equals_generate(arch):
    model, ids = _model(arch), _prompt()
    out, stats = generate_fast(model, ids, 12)
    assert torch.equal(out, _hf_greedy(model, ids, 12))
    assert stats["mode"] == "eager" and stats["new_tokens"] == 12 and stats["batch"] == 2
    assert stats["tokens_per_s"] > 0 and stats["decode_s"] > 0


@pytest.mark.parametrize("path", ["masked", "gather"])
def test_greedy_patched_equals_generate(path):
    """scope="decode": the prompt dense, generated tokens sparse, exactly as model.generate does it."""
    model, ids = _model(), _prompt()
    dense, _ = generate_fast(model, ids, 12)
    countdown.sparsify(model, "mono", 0.8, path=path)
    out, _ = generate_fast(model, ids, 12)
    assert torch.equal(out, _hf_greedy(model, ids, 12))
    assert not torch.equal(out, dense)  # the sparse MLPs really ran (the test would be vacuous otherwise)
    # the prompt is dense: the first new token comes from dense logits
    assert torch.equal(out[:, PROMPT_LEN], dense[:, PROMPT_LEN])
    real = countdown.sparsity_real(model)["mean"]
    assert abs(real - 0.8) < 0.05


def test_scope_all_keeps_the_prompt_sparse():
    model, ids = _model(), _prompt()
    countdown.sparsify(model, "dual", 0.9, scope="all", path="masked")
    out, _ = generate_fast(model, ids, 8)
    assert torch.equal(out, _hf_greedy(model, ids, 8))


def test_decoder_follows_patching():
    """A decoder built for the dense model is not reused once the model is patched (and back)."""
    model, ids = _model(), _prompt()
    dense, _ = generate_fast(model, ids, 10)
    countdown.sparsify(model, "cats", 0.9, path="gather")
    sparse, _ = generate_fast(model, ids, 10)
    countdown.unsparsify(model)
    again, _ = generate_fast(model, ids, 10)
    assert torch.equal(again, dense) and not torch.equal(sparse, dense)


def test_batch_rows_equal_single_rows():
    model, ids = _model(), _prompt(batch=3)
    countdown.sparsify(model, "mono", 0.7, path="gather")  # batch > 1: union of kept rows, masked per token
    out, stats = generate_fast(model, ids, 9)
    assert stats["batch"] == 3 and out.shape == (3, PROMPT_LEN + 9)
    for row in range(3):
        single, _ = generate_fast(model, ids[row:row + 1], 9)
        assert torch.equal(out[row:row + 1], single)


def test_sampling_is_reproducible_and_seeded():
    model, ids = _model(), _prompt()
    a, _ = generate_fast(model, ids, 16, temperature=1.5, top_k=20, seed=5)
    b, _ = generate_fast(model, ids, 16, temperature=1.5, top_k=20, seed=5)
    c, _ = generate_fast(model, ids, 16, temperature=1.5, top_k=20, seed=6)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # top_k = 1 leaves one candidate: sampling must reproduce greedy decoding
    one, _ = generate_fast(model, ids, 16, temperature=1.5, top_k=1, seed=5)
    assert torch.equal(one, _hf_greedy(model, ids, 16))


def test_sample_tokens_follows_softmax_with_top_k():
    """The exponential race draws from softmax(logits / T) restricted to the top k (float64 reference)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    temperature, top_k, n = 0.7, 4, 40000
    g = torch.Generator().manual_seed(0)
    noise = torch.empty(n, 6).exponential_(generator=g)
    draws = sample_tokens(logits.expand(n, 6), noise, torch.tensor(1 / temperature), top_k)
    freq = torch.bincount(draws, minlength=6).double() / n
    ref = torch.zeros(6, dtype=torch.float64)
    top = logits[0].double().topk(top_k).indices
    ref[top] = torch.softmax(logits[0, top].double() / temperature, dim=0)
    assert freq[ref == 0].sum() == 0
    assert torch.allclose(freq, ref, atol=4 * math.sqrt(0.25 / n))
    assert torch.equal(sample_tokens(logits, None, None, None), torch.tensor([0]))  # greedy


def test_eos_stops_once_every_row_is_done():
    model, ids = _model(), _prompt(batch=1)
    free, _ = generate_fast(model, ids, 40)
    eos = int(free[0, PROMPT_LEN + 2])
    out, stats = generate_fast(model, ids, 40, eos_token_id=eos)
    assert PROMPT_LEN + 3 <= out.shape[1] < PROMPT_LEN + 40
    assert torch.equal(out, free[:, :out.shape[1]])
    assert stats["new_tokens"] == out.shape[1] - PROMPT_LEN


def test_sparsity_real_counts_the_users_tokens_only():
    """The compiled decoder's warm-up steps (a throw-away run before the first call) are not counted: after a
    compiled call each layer has counted exactly the rows of the eager call's decode steps (11 steps of 2 rows,
    the dense prompt none), and the same kept rows, since both decode the same tokens."""
    model, ids = _model(), _prompt()
    countdown.sparsify(model, "mono", 0.8)
    layers = countdown.patch.sparsify.state_of(model).layers
    eager, _ = generate_fast(model, ids, 12)
    counted = [(layer.kept_total.clone(), layer.rows_total.clone()) for layer in layers]
    d_inter = model.config.intermediate_size
    assert all(int(rows) == 2 * 11 * d_inter for _, rows in counted)
    countdown.reset_sparsity_stats(model)
    torch._dynamo.reset()
    compiled, stats = generate_fast(model, ids, 12, compile=True, compile_options={"backend": "aot_eager"})
    assert stats["setup_s"] > 0 and torch.equal(compiled, eager)  # the warm-up ran, then the user's call
    for layer, (kept, rows) in zip(layers, counted):
        assert int(layer.rows_total) == int(rows)
        torch.testing.assert_close(layer.kept_total, kept, rtol=0, atol=0.5)  # whole rows, summed as float64


def test_compiled_step_is_one_graph():
    """torch.compile(fullgraph=True) of the step: no graph break, and no recompilation per token or
    per call (Dynamo's eager backend here; on CUDA the same graph goes to Inductor + CUDA graphs)."""
    model, ids = _model(), _prompt()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    reference, _ = generate_fast(model, ids, 10)
    torch._dynamo.reset()
    first, stats = generate_fast(model, ids, 10, compile=True, compile_options={"backend": backend})
    second, _ = generate_fast(model, ids, 10, compile=True, compile_options={"backend": backend})
    assert stats["mode"] == "compile" and stats["setup_s"] > 0
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert len(graphs) == 1


def test_a_decoded_model_can_still_be_freed():
    """The cached decoder (static cache, compiled step) must not keep the model alive."""
    import gc
    import weakref

    model = _model()
    generate_fast(model, _prompt(), 3)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_bad_input_is_rejected_clearly():
    model, ids = _model(), _prompt()
    with pytest.raises(ValueError, match="LongTensor"):
        generate_fast(model, ids[0], 4)
    with pytest.raises(ValueError, match="temperature"):
        generate_fast(model, ids, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_fast(model, ids, 0)
    with pytest.raises(ValueError, match="max_cache_len"):
        generate_fast(model, ids, 8, max_cache_len=10)
    with pytest.raises(ValueError, match="top_k"):
        generate_fast(model, ids, 4, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="CUDA"):
        generate_fast(model, ids, 4, compile="cudagraph")
    with pytest.raises(ValueError, match="compile"):
        generate_fast(model, ids, 4, compile="fast")


def test_cache_kwargs_trace_in_one_graph():
    """The decode step calls cache_kwargs inside torch.compile(fullgraph=True): it must not break the graph
    (run AN, 2026-11-25: an import inside it did, and every compiled decode failed)."""
    import torch._dynamo

    from countdown.decode.cache import cache_kwargs, renamed

    def step(x, cache):
        (name, value), = cache_kwargs(cache).items()
        return x + value if name == ("cache" if renamed() else "past_key_values") else x - value

    torch._dynamo.reset()
    x, cache = torch.zeros(3), torch.arange(3.0)
    assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(x, cache), cache)
