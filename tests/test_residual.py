"""kernels/_residual.py: a folded layer's residual added by its MLP's last kernel (the partials' sum of a
sparse MLP, the routed down projection of a dense one) instead of a launch of its own.

The sum with the residual must equal PyTorch's add of h and the plain sum (itself checked against float64
in test_kernels.py) bit for bit; a slot is taken once, only by a matching output, and closed in order; a
folded, sparsified model decodes the same tokens with and without the fold of the add, taking it once per
layer and step; a dense one with the down projection routed gives the same greedy tokens.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
pytest.importorskip("triton")

from countdown.kernels import _psum, _residual  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,d,dtype", [(7, 50, torch.bfloat16), (224, 67, torch.float16), (30, 33, torch.float32)])
def test_sum_with_the_residual_is_pytorchs_add_of_the_sum(rows, d, dtype):
    gen = torch.Generator().manual_seed(rows)
    p = (torch.randn(rows, d, generator=gen) * torch.logspace(-3, 2, d)[None, :]).to(DEVICE)
    h = (torch.randn(1, d, generator=gen) * 10).to(dtype).to(DEVICE)
    got = _psum.sum_partials(p, dtype, h)
    assert got.dtype == dtype and got.shape == (1, d)
    assert torch.equal(got, h + _psum.sum_partials(p, dtype))
    assert torch.equal(torch.ops.countdown.sum_partials_add(p, h), got)
    with pytest.raises(ValueError, match="residual must be"):
        _psum.sum_partials(p, dtype, h[:, :-1])


def test_a_slot_is_taken_once_by_a_matching_output(monkeypatch):
    monkeypatch.setattr(_psum, "OFF_CUDA", True)
    monkeypatch.setattr(_residual, "ENABLED", True)
    p = torch.randn(12, 40).to(DEVICE)
    like = torch.empty(1, 40, dtype=torch.bfloat16, device=DEVICE)
    h = torch.randn(1, 40).to(torch.bfloat16).to(DEVICE)
    plain = _psum.reduce(p, like)  # no slot open: the plain sum
    slot = _residual.open_slot(h)
    try:
        assert _psum.reduce(p, torch.empty(1, 40, dtype=torch.float16, device=DEVICE)).dtype == torch.float16
        assert not slot.used  # another dtype: not taken
        assert _psum.reduce(torch.randn(12, 3, 40).to(DEVICE), like).shape == (3, 40)
        assert not slot.used  # a few tokens' partials: not taken
        first = _psum.reduce(p, like)
        assert slot.used and torch.equal(first, h + plain)
        assert torch.equal(_psum.reduce(p, like), plain)  # taken already
    finally:
        _residual.close_slot(slot)
    assert torch.equal(_psum.reduce(p, like), plain)  # closed
    outer, inner = _residual.open_slot(h), _residual.open_slot(h)
    with pytest.raises(RuntimeError, match="order"):
        _residual.close_slot(outer)
    _residual.close_slot(inner)
    _residual.close_slot(outer)


def _folded_model(route_down: bool):
    from countdown import fused_attention
    from countdown.decode_gemv import route_linears
    from conftest import tiny_model

    model = tiny_model("llama").to(DEVICE)
    fused_attention.fuse_attention(model)
    route_linears(model, ("qkv", "down", "norm") if route_down else ("qkv", "norm"))
    return model


def _counting(monkeypatch, name):
    calls = []
    real = getattr(torch.ops.countdown, name)
    monkeypatch.setattr(torch.ops.countdown, name, lambda *a: calls.append(1) or real(*a))
    return calls


def test_sparse_folded_decode_adds_the_residual_in_the_sum(monkeypatch):
    import countdown
    from countdown.decode import generate_fast
    from countdown.kernels import _onepass

    monkeypatch.setattr(_onepass, "ONEPASS_OFF_CUDA", True)
    monkeypatch.setattr(_psum, "OFF_CUDA", True)
    model = _folded_model(route_down=False)
    n_layers = model.config.num_hidden_layers
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    countdown.sparsify(model, "mono", 0.5, path="kernel")
    from test_kernel_path import ThresholdSelector, _swap_selectors  # a practical selector: the kernel path serves

    _swap_selectors(model, lambda mlp: ThresholdSelector(countdown.get_method("mono"), 0.05).to(mlp.w_up.device))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(_residual, "ENABLED", on)
        fused, adds = _counting(monkeypatch, "sum_partials_add"), _counting(monkeypatch, "decode_add")
        out[on], _ = generate_fast(model, prompt, 5, compile=False)
        assert len(fused) == (4 * n_layers if on else 0)  # 4 decode steps, one per layer; none for the prompt
        assert len(adds) == (0 if on else 4 * n_layers)
    assert torch.equal(out[True], out[False])  # the same rounding: h + round(sum), rounded once more


def test_dense_folded_decode_adds_the_residual_in_the_down_gemv(monkeypatch):
    from countdown.decode import generate_fast

    model = _folded_model(route_down=True)
    n_layers = model.config.num_hidden_layers
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = {}
    real_add = torch.ops.countdown.decode_add
    for on in (False, True):
        monkeypatch.setattr(_residual, "ENABLED", on)
        adds = _counting(monkeypatch, "decode_add")
        out[on], _ = generate_fast(model, prompt, 5, compile=False)
        assert len(adds) == (0 if on else 4 * n_layers)
    # one rounding of h + y instead of two: greedy tokens of a tiny model agree
    assert torch.equal(out[True], out[False])
    monkeypatch.setattr(_residual, "ENABLED", True)
    monkeypatch.setattr(torch.ops.countdown, "decode_add", real_add)  # Dynamo traces the op, not a wrapper
    compiled, _ = generate_fast(model, prompt, 5, compile=True, compile_options={"backend": "aot_eager"})
    assert torch.equal(compiled, out[True])  # Dynamo takes the slot as the eager code does
    hook = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: None)
    adds = _counting(monkeypatch, "decode_add")
    generate_fast(model, prompt, 2, compile=False)
    assert len(adds) == 1  # the hooked layer's MLP output is its own: the add stays outside
    hook.remove()


def test_the_benchmarks_opaque_mlp_slots_take_the_residual(monkeypatch):
    """bench/slots.py: behind a slot the MLP runs at run time, so the slot op itself takes the residual and
    returns h + mlp(x), the add done by the MLP's last kernel (here the routed down GEMV): same tokens."""
    from countdown.bench import slots as bench_slots
    from countdown.decode import generate_fast

    model = _folded_model(route_down=True)
    n_layers = model.config.num_hidden_layers
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    monkeypatch.setattr(_residual, "ENABLED", True)
    want, _ = generate_fast(model, prompt, 5, compile=False)
    taken, adds = _counting(monkeypatch, "decode_linear"), _counting(monkeypatch, "decode_add")
    with bench_slots.SlotModel(model):
        got, _ = generate_fast(model, prompt, 5, compile=False)
    assert torch.equal(got, want)
    assert adds == []  # every layer's add done inside its MLP's down GEMV
    monkeypatch.setattr(_residual, "ENABLED", False)
    with bench_slots.SlotModel(model):
        generate_fast(model, prompt, 5, compile=False)
    assert len(adds) == 4 * n_layers and len(taken) > 0
