"""transformers' own generate on a sparsified model: the decode hook reads no cache, and a static-cache,
full-graph compiled generate decodes the same tokens as eager."""

import pytest
import torch
from transformers import CompileConfig

import countdown
from countdown.patch.state import is_prompt_pass
from conftest import tiny_model


class _UnreadableCache:
    """A KV cache whose length must not be read (reading a static cache's length is a host sync)."""

    def get_seq_length(self):
        raise AssertionError("the decode hook read the cache length on a one-token step")


def test_one_new_token_with_a_cache_is_a_decode_step_without_reading_the_cache():
    one, many = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)
    assert is_prompt_pass((), {"input_ids": one, "past_key_values": _UnreadableCache()}) is False
    assert is_prompt_pass((one,), {"cache": _UnreadableCache()}) is False  # transformers >= 5.24 spelling
    assert is_prompt_pass((), {"input_ids": many, "past_key_values": None}) is True
    assert is_prompt_pass((), {"inputs_embeds": torch.zeros(1, 1, 8)}) is True  # no cache: a prompt


@pytest.mark.parametrize("method", ["mono", "dual"])
def test_static_cache_fullgraph_compiled_generate_matches_eager(method):
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    dense = torch.stack(model.generate(ids, **kw).logits)
    countdown.sparsify(model, method, 0.5, path="masked")
    try:
        eager = model.generate(ids, **kw)
        countdown.reset_sparsity_stats(model)
        model.generation_config.cache_implementation = "static"
        # AOT autograd without Inductor's C++ code generation (which does not build under ATEN_CPU_CAPABILITY=default):
        # the graph capture and the functionalized buffer updates are what this test is about
        config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        config._compile_all_devices = True  # transformers compiles generate's decode steps on CUDA only otherwise
        model.generation_config.compile_config = config
        compiled = model.generate(ids, **kw)
        real = countdown.sparsity_real(model)["mean"]
    finally:
        countdown.unsparsify(model)
        torch._dynamo.reset()
    assert compiled.sequences.tolist() == eager.sequences.tolist()
    eager_logits, compiled_logits = torch.stack(eager.logits), torch.stack(compiled.logits)
    # every step's logits: the first from the (dense) prompt, equal to dense; the decode steps' sparse MLPs move
    # them far more than the compiled graph's rounding does
    assert torch.equal(eager_logits[0], dense[0])
    sparse_shift = (eager_logits[1:] - dense[1:]).abs().max()
    assert sparse_shift > 1e-2
    assert (compiled_logits - eager_logits).abs().max() < 1e-3 * sparse_shift
    assert real == pytest.approx(0.5, abs=0.02)  # the decode steps were sparse (the prompt is not counted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel route's CUDA graphs need a GPU")
@pytest.mark.parametrize("method", ["mono[threshold]", "dual[shadow4]"])
def test_eager_generate_replays_each_layers_kernel_route_from_a_cuda_graph(method):
    """transformers' eager generate on CUDA: each sparse MLP's decode step is captured once and replayed,
    giving the logits of the uncaptured kernel route (the same kernels) and of the masked path (same rows)."""
    from countdown.patch.state import state_of
    from test_calibrate import TOK, word_texts

    model = tiny_model("llama")
    art = countdown.prepare(model, TOK, method, 0.7, texts=word_texts(0), num_tokens=256, window=64, progress=False)
    model = model.cuda()
    ids = torch.randint(3, 120, (1, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    runs = {}
    for path in ("masked", "kernel"):
        countdown.sparsify(model, method, 0.7, artifacts=art, path=path)
        try:
            runs[path] = model.generate(ids, **kw)
            graphs = [len(getattr(layer, "_graphs", {})) for layer in state_of(model).layers]
        finally:
            countdown.unsparsify(model)
        if path == "kernel":
            assert graphs == [1] * len(graphs)  # one graph per layer (batch 1, one token), replayed every step
    assert runs["kernel"].sequences.tolist() == runs["masked"].sequences.tolist()
    torch.testing.assert_close(torch.stack(runs["kernel"].logits), torch.stack(runs["masked"].logits),
                               rtol=1e-3, atol=1e-3)
