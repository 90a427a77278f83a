"""The decode step countdown.generate prepares (countdown.decode.prepared.PreparedStep): installed, described,
checked and undone in one place, and keyed on what it depends on.

generate prepares it on CUDA only; here it is installed directly (its kernels in Triton's interpreter on the CPU; on
the GPU, make gpu-test, on CUDA, where countdown.generate prepares it itself). For each
change a user can make after a step was prepared (quantize, sparsify, unsparsify, another artifact,
countdown.int4.use_backend, .to(dtype), .to(device)) the step's key tells the change, ``check`` refuses the stale
step, and the next decode prepares it again and gives exactly the logits of a twin model changed before its step was
first prepared (on c16ac8c the step prepared first was kept: a model quantized after decoding kept its float
attention weights).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown  # noqa: E402
from countdown.decode.generate import _DECODERS, generate_fast, reset_decoders  # noqa: E402
from countdown.decode.prepared import PreparedStep, StaleStepError, StepKey, current_step  # noqa: E402
from conftest import captured_logits, tiny_model  # noqa: E402
from test_calibrate import TOK, word_texts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Narrow (the interpreter runs each kernel's programs one by one) and 4-bit-able (widths multiples of 32).
NARROW = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96)
NEW = 3  # two decode steps, the second reading the cache the first wrote
PROMPT = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(8)).to(DEV)


def _model():
    return tiny_model("llama", **NARROW).to(DEV)


@pytest.fixture(autouse=True)
def _fresh_decoders():
    yield
    reset_decoders()


def _decode(model):
    """Greedy tokens and every forward's logits of an eager decode (generate's loop, as on the CPU)."""
    with captured_logits(model) as logits:
        tokens, _ = generate_fast(model, PROMPT, NEW, compile=False)
    return tokens, logits


def _same(got, want):
    """The same tokens and logits (the same kernels on the same weights: equal on the CPU; on the GPU within a
    reduction order, far below what a stale step moves them: 5e-3 for float q/k/v kept on a 4-bit model)."""
    (tokens, logits), (want_tokens, want_logits) = got, want
    assert torch.equal(tokens, want_tokens) and len(logits) == len(want_logits) == NEW
    for step, (g, w) in enumerate(zip(logits, want_logits)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")


def test_the_step_is_installed_described_checked_and_undone_in_one_place():
    model = _model()
    implementation = model.config._attn_implementation
    before = {name: t.clone() for name, t in model.state_dict().items()}
    plain = _decode(model)  # transformers' own forwards
    step = PreparedStep.install(model)
    assert PreparedStep.of(model) is step and step.stale() == [] and step.key == StepKey.of(model)
    assert step.swaps == [
        "decode/attention.py: 2 attention modules fused (q/k/v as views of one stacked weight)",
        "decode/linears.py: 2 fused QKV projections on the fixed GEMV",
        "decode/linears.py: 8 Linears (down, gate/up, o_proj) on the fixed GEMV",
        "decode/layer.py: 2 decoder layers folded (norms and residual adds on our kernels; PDL on)",
        "decode/hf_attention.py: attention implementation switched to 'countdown_decode'"]
    text = step.describe()
    assert text.startswith(f"decode step prepared on LlamaForCausalLM ({DEV}{':0' if DEV == 'cuda' else ''}, "
                           "torch.float32); current")
    assert all(line in text for line in step.swaps) and "sparsity dense" in text
    prepared = _decode(model)
    assert torch.equal(prepared[0], plain[0])  # the same tokens; the logits within float32 rounding of our kernels
    for g, w in zip(prepared[1], plain[1]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert PreparedStep.of(model) is step  # a fitting step is kept (and its decoder)
    step.check()
    step.undo()
    assert PreparedStep.of(model) is None and step.stale() == ["it was undone"]
    for layer in model.model.layers:
        assert "forward" not in layer.__dict__ and "forward" not in layer.self_attn.__dict__
        assert all("forward" not in m.__dict__ for m in layer.mlp.children())
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    assert model.config._attn_implementation == implementation
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    _same(_decode(model), plain)  # transformers' own forwards again, bit for bit


@pytest.fixture(scope="module")
def artifacts():
    """Two mono[threshold] artifacts of the narrow model at k = 0.5, calibrated on different text."""
    model = _model()
    return [countdown.prepare(model, TOK, "mono[threshold]", 0.5, texts=word_texts(i), num_tokens=256, window=64,
                              progress=False) for i in (0, 1)]


def _setup(model, change, arts):
    """The model as it is before ``change``."""
    if change in ("unsparsify", "another artifact"):
        countdown.sparsify(model, "mono[threshold]", 0.5, artifacts=arts[0])
    if change == "use_backend":
        countdown.quantize(model, group=32)


def _change(model, change, arts):
    if change == "quantize":
        countdown.quantize(model, group=32)
    elif change == "sparsify":
        countdown.sparsify(model, "mono[threshold]", 0.5, artifacts=arts[0])
    elif change == "unsparsify":
        countdown.unsparsify(model)
    elif change == "another artifact":
        countdown.unsparsify(model)
        countdown.sparsify(model, "mono[threshold]", 0.5, artifacts=arts[1])
    elif change == "use_backend":
        countdown.int4.use_backend(model, "reference")
    elif change == "to(dtype)":
        model.to(torch.float64)


CHANGES = {
    "quantize": r"its weights were replaced or moved .*its weight format changed \(countdown.quantize\)",
    "sparsify": r"it was sparsified \(countdown.sparsify\)",
    "unsparsify": r"it was unsparsified \(countdown.unsparsify\)",
    "another artifact": r"its sparsity patch changed \(mono\[threshold\] -> mono\[threshold\]",
    "use_backend": r"its 4-bit backend changed \(countdown.int4.use_backend\)",
    "to(dtype)": r"its dtype changed \(torch.float32 -> torch.float64\)",
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_the_step_was_prepared_prepares_it_again(change, artifacts):
    twin = _model()  # changed before its step is prepared: what the model must decode like
    _setup(twin, change, artifacts)
    _change(twin, change, artifacts)
    PreparedStep.install(twin)
    want = _decode(twin)

    model = _model()
    _setup(model, change, artifacts)
    step = PreparedStep.install(model)
    _decode(model)  # the step and its decoder in use
    _change(model, change, artifacts)
    assert StepKey.of(model) != step.key
    with pytest.raises(StaleStepError, match=CHANGES[change]):
        step.check()
    got = _decode(model)  # the decode prepares the step again, and its decoder: never the stale one
    again = PreparedStep.of(model)
    assert again is not None and again is not step and step.undone and again.stale() == []
    assert _DECODERS[model].key == again.key
    _same(got, want)
    if change == "quantize":  # the 4-bit step now: q/k/v one stacked 4-bit GEMV, the MLPs' gate/up stacked
        assert any("of them 4-bit" in line for line in again.swaps)
        assert any("4-bit Gated-MLPs stacked" in line for line in again.swaps)


def test_a_model_moved_where_no_kernel_runs_gets_its_step_undone():
    model = _model()
    step = PreparedStep.install(model)
    model.to("meta")
    assert f"its device changed ({step.key.device} -> meta)" in step.stale()
    assert current_step(model) == StepKey.of(model) and step.undone
    assert PreparedStep.of(model) is None  # undone, not prepared again
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_generate_prepares_on_cuda_only_and_never_runs_a_stale_step():
    """countdown.generate itself (eager here: no compile in a test): on CUDA it prepares the step, on the CPU it
    decodes with transformers' forwards; a model quantized after its first generate decodes as a twin quantized
    before it (issue 59: on the H200 it kept its float attention)."""
    twin = _model()
    countdown.quantize(twin, group=32)
    if DEV == "cpu":
        PreparedStep.install(twin)
    with captured_logits(twin) as want:
        want_tokens = countdown.generate(twin, PROMPT, NEW, eos_token_id=[], compile=False)
    model = _model()
    countdown.generate(model, PROMPT, NEW, eos_token_id=[], compile=False)
    assert (PreparedStep.of(model) is not None) == (DEV == "cuda")
    step = PreparedStep.of(model) or PreparedStep.install(model)
    countdown.quantize(model, group=32)
    with captured_logits(model) as got:
        tokens = countdown.generate(model, PROMPT, NEW, eos_token_id=[], compile=False)
    assert step.undone and PreparedStep.of(model).stale() == []  # prepared again for the 4-bit model
    _same((tokens, got), (want_tokens, want))


def test_a_decoder_follows_a_dtype_change_without_a_step():
    """No step prepared: the decoder (its static cache) is built again for a model moved to another dtype."""
    model = _model()
    generate_fast(model, PROMPT, NEW, compile=False)
    model.to(torch.float64)
    twin = _model().to(torch.float64)
    _same(_decode(model), _decode(twin))
    assert _DECODERS[model].cache.layers[0].keys.dtype == torch.float64
