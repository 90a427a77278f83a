"""The one-compile decode harness (harness.slots, ``benchmarks/decode.py``'s default runner): every Gated-MLP behind
an opaque slot op, the step compiled once for dense and every method and k (Dynamo's eager backend on the CPU), the
tokens those of eager decoding; a folded layer's MLP half behind the slot too; the decoder's timing on a fake clock."""

import torch

import countdown
import countdown.kernels as K
import harness.slots as slot_harness
from _onetoken import one_token_on
from conftest import tiny_model
from countdown.decode.generate import generate_fast
from countdown.spec import parse_spec
from harness.checks import clear_dynamo_counts, dynamo_counts
from harness.slots import SLOTS, CapturedDecoder, SlotModel, ZeroMLP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The folded model of the block-route test: as tests/test_block.py's (two decode steps; d_inter odd and prime, small
# because mono's one-token kernel walks its rows a few at a time in the interpreter).
NEW, MODEL_D_INTER = 3, 37


def test_one_compiled_step_serves_dense_every_method_and_every_k():
    """The slot harness (Dynamo, eager backend on the CPU) against eager decoding of the patched model:
    same tokens for dense and each spec at each k, switched in place, and ONE graph for all of them."""
    from countdown.bench.speedonly import decode_prompts, fit_cuts_on_decode, private_copy, random_artifacts, retarget
    from countdown.model.gated_mlp import require_gated_mlps

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

        monkeypatch.setattr(slot_harness.time, "perf_counter", lambda: clock["t"])
        monkeypatch.setattr(dec, "prefill", prefill)
        monkeypatch.setattr(dec, "step", step)
        tokens, prefill_s, decode_s = dec.run(torch.ones(1, 3, dtype=torch.long), 6, prefills=3)
    assert (prefill_s, decode_s) == (20.0, 5.0) and tokens.tolist() == [[1, 2, 3, 4, 5, 6]]


def test_the_one_compile_slots_take_the_block_route():
    """In a folded layer (countdown.decode.layer) the slot takes h, so a sparsified MLP's block route runs behind the
    opaque op too (kernels.threshold_block: tests/test_block.py); the tokens are the folded model's own."""
    from countdown.decode import attention as fused_attention
    from countdown.decode import layer as folded_layer
    from countdown.decode.linears import route_linears
    from countdown.selectors.threshold import ThresholdSelector
    from countdown.patch.state import state_of

    torch.manual_seed(0)

    def patch(target):
        countdown.sparsify(target, "mono", 0.5, path="kernel")
        for layer in state_of(target).layers:
            layer.selector = ThresholdSelector(countdown.get_method("mono"), 0.05).to(DEVICE)

    hits = []  # a block launch: the one-token kernel given the norm
    block = lambda name, *args: hits.append(1) if name == "one_token" and args[2] is not None else None
    # as tests/test_block.py's tests: the one-token kernel (the chain's sum and add on the same kernels, off CUDA
    # too), outputs poisoned first
    with one_token_on("partial_sums", "residual_add"):
        model = tiny_model("llama", intermediate_size=MODEL_D_INTER).to(DEVICE)
        model.generation_config.eos_token_id = None
        prompt = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        fused_attention.fuse_attention(model)
        route_linears(model, ("qkv", "norm"))
        patch(model)
        ref = generate_fast(model, prompt, NEW, compile="eager")[0][:, 7:]
        countdown.unsparsify(model)
        library_half = folded_layer.mlp_half
        with SlotModel(model) as slots, K.overrides(on_launch=block):
            assert folded_layer.mlp_half is not library_half  # the slots' wrapper, while they are in
            patch(slots.holder)
            dec = CapturedDecoder(model, slots.holder, 1, 32, compile="eager-backend")
            assert torch.equal(dec.run(prompt, NEW)[0], ref)  # tokens only: Dynamo would trace a logits hook
            countdown.unsparsify(slots.holder)
    assert folded_layer.mlp_half is library_half
    assert len(hits) >= (NEW - 1) * model.config.num_hidden_layers  # the block launched from inside the slots
