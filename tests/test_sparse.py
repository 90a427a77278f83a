"""SP-Ideal sparsification against an independent float64 reference, on every architecture."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import countdown
from countdown.sparse_methods.registry import kept_rows
from conftest import ARCHS, tiny_model

SPARSE_METHODS = ["cats", "mono", "dual", "dejavu"]


def reference_mlp(x, w_gate, w_up, w_down, act, method, k):
    """Token by token in float64: score rows, keep the top int(d_inter (1-k)), sum kept W_down columns."""
    x, w_gate, w_up, w_down = (t.double() for t in (x, w_gate, w_up, w_down))
    d_inter = w_up.shape[0]
    n_keep = max(1, int(d_inter * (1 - k) + 1e-9))
    out = torch.zeros(x.shape[0], w_down.shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        u = w_up @ x[t]
        h = act(w_gate @ x[t])
        score = {"cats": h.abs(), "mono": u.abs(), "dual": (u * h).abs(), "dejavu": h}[method]
        keep = sorted(range(d_inter), key=lambda i: -score[i].item())[:n_keep]
        for i in keep:
            out[t] += u[i] * h[i] * w_down[:, i]
    return out


def _acts():
    return {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.mark.parametrize("path", ["masked", "gather"])
@pytest.mark.parametrize("k", [0.5, 0.8, 0.9])
@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_gated_mlp_matches_float64_reference(arch, method, k, path):
    model = tiny_model(arch, torch.float64)
    countdown.sparsify(model, method, k, scope="all", path=path)
    mlp = countdown.find_gated_mlps(model)[1]
    assert mlp.d_inter == 97
    x = torch.randn(5, mlp.d_model, dtype=torch.float64)
    got = mlp.module(x)
    ref = reference_mlp(x, mlp.w_gate, mlp.w_up, mlp.w_down, _acts()[mlp.act_name], method, k)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
    # Exactly int(d_inter (1 - k)) rows were used per token.
    assert countdown.sparsity_real(model)["mean"] == pytest.approx(1 - kept_rows(97, k) / 97)


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_masked_and_gather_paths_agree_in_fp32(method):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        countdown.sparsify(model, method, 0.8, scope="all", path="masked")
        masked = model(ids).logits
        countdown.unsparsify(model)
        countdown.sparsify(model, method, 0.8, scope="all", path="gather")
        gathered = model(ids).logits
        # One token at a time: the gather path then reads only that token's kept rows.
        mlp = countdown.find_gated_mlps(model)[0]
        x = torch.randn(1, 3, mlp.d_model)
        one = mlp.module(x)
        countdown.unsparsify(model)
        countdown.sparsify(model, method, 0.8, scope="all", path="masked")
        one_masked = mlp.module(x)
    torch.testing.assert_close(gathered, masked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, one_masked, rtol=1e-5, atol=1e-5)


def test_fp32_model_close_to_float64_reference(arch):
    model = tiny_model(arch)
    countdown.sparsify(model, "mono", 0.7, scope="all")
    mlp = countdown.find_gated_mlps(model)[0]
    x = torch.randn(4, mlp.d_model)
    with torch.no_grad():
        got = mlp.module(x)
    ref = reference_mlp(x, mlp.w_gate, mlp.w_up, mlp.w_down, _acts()[mlp.act_name], "mono", 0.7)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_unsparsify_restores_bit_identical_logits(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
        keys_before = list(model.state_dict())
        countdown.sparsify(model, "dual", 0.9, scope="all")
        sparse = model(ids).logits
        countdown.unsparsify(model)
        after = model(ids).logits
    assert not torch.allclose(sparse, before)
    assert torch.equal(after, before)
    assert list(model.state_dict()) == keys_before
    assert not countdown.is_sparsified(model)


def test_dense_method_equals_unpatched(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (1, 7))
    with torch.no_grad():
        before = model(ids).logits
        countdown.sparsify(model, "dense", scope="all")
        dense = model(ids).logits
    assert torch.equal(dense, before)


def test_decode_scope_keeps_prompt_dense_and_sparsifies_generated_tokens():
    model = tiny_model("llama")
    prompt = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        dense_out = model(prompt).logits
        countdown.sparsify(model, "mono", 0.8)  # default scope: decode
        prompt_out = model(prompt).logits  # no cache: this is a prompt, so dense
        assert torch.equal(prompt_out, dense_out)
        assert math.isnan(countdown.sparsity_real(model)["mean"])
        new = 5
        out = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert out.shape[1] == prompt.shape[1] + new
    layer = countdown.patch.sparsify.state_of(model).layers[0]
    # The prefill is dense; the new-1 decode steps after it were sparse, one token each.
    assert layer.rows_total == (new - 1) * 97
    assert countdown.sparsity_real(model)["mean"] == pytest.approx(1 - kept_rows(97, 0.8) / 97)


def test_dense_prefix_per_row():
    model = tiny_model("qwen2")
    countdown.sparsify(model, "dual", 0.8, scope="all")
    mlp = countdown.find_gated_mlps(model)[0]
    x = torch.randn(2, 6, mlp.d_model)
    with torch.no_grad():
        sparse = mlp.module(x)
        with countdown.dense_prefix(model, torch.tensor([2, 4])):
            mixed = mlp.module(x)
        with countdown.dense_prefix(model, 6):
            all_dense = mlp.module(x)
        dense = mlp.reference(x)
    torch.testing.assert_close(all_dense, dense)
    torch.testing.assert_close(mixed[0, :2], dense[0, :2])
    torch.testing.assert_close(mixed[0, 2:], sparse[0, 2:])
    torch.testing.assert_close(mixed[1, :4], dense[1, :4])
    torch.testing.assert_close(mixed[1, 4:], sparse[1, 4:])
    assert not torch.allclose(sparse, dense)


def test_gate_and_up_are_found_by_structure_not_by_name():
    class Swapped(nn.Module):
        """A Gated-MLP whose attribute names lie: 'up' is really the gate."""

        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 13, bias=False)
            self.gate = nn.Linear(8, 13, bias=False)
            self.out = nn.Linear(13, 8, bias=True)
            self.nonlinearity = nn.GELU(approximate="tanh")

        def forward(self, x):
            return self.out(self.nonlinearity(self.up(x)) * self.gate(x))

    model = nn.Sequential(Swapped())
    (found,) = countdown.find_gated_mlps(model)
    assert (found.gate, found.up, found.down, found.act_name) == ("up", "gate", "out", "gelu_tanh")
    x = torch.randn(3, 8)
    torch.testing.assert_close(found.reference(x), model(x))


def test_plain_mlp_and_attention_are_not_gated_mlps():
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    assert countdown.find_gated_mlps(plain) == []
    model = tiny_model("llama")
    names = [m.name for m in countdown.find_gated_mlps(model)]
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]


def test_bias_is_kept_in_sparse_computation():
    model = nn.Sequential(nn.Module())
    block = model[0]
    block.gate_proj = nn.Linear(6, 11)
    block.up_proj = nn.Linear(6, 11)
    block.down_proj = nn.Linear(11, 6)
    block.act_fn = nn.SiLU()
    block.forward = lambda x: block.down_proj(block.act_fn(block.gate_proj(x)) * block.up_proj(x))
    model = model.double()
    countdown.sparsify(model, "mono", 0.5, scope="all", path="gather")
    x = torch.randn(1, 6, dtype=torch.float64)
    got = model(x)
    u = block.up_proj(x)[0]
    h = F.silu(block.gate_proj(x))[0]
    keep = u.abs().topk(kept_rows(11, 0.5)).indices
    ref = block.down_proj.bias + (u[keep] * h[keep]) @ block.down_proj.weight[:, keep].T
    torch.testing.assert_close(got[0], ref)


# ------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing half-patched
# ------------------------------------------------------------------------------------------


def _assert_untouched(model):
    assert not countdown.is_sparsified(model)
    assert not any(hasattr(m, "countdown_sparse") for m in model.modules())


def test_unknown_method_lists_the_valid_ones():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown method 'topk'.*cats.*mono.*dual.*dejavu"):
        countdown.sparsify(model, "topk", 0.5)
    _assert_untouched(model)


def test_paper_names_are_aliases():
    assert countdown.get_method("M-CountDown").name == "mono"
    assert countdown.get_method("d-countdown").name == "dual"
    assert countdown.methods() == ["dense", "cats", "mono", "dual", "dejavu", "teal"]


@pytest.mark.parametrize("k, error", [(0, ValueError), (1, ValueError), (-0.1, ValueError), (1.5, ValueError),
                                      (float("nan"), ValueError), ("high", TypeError), (None, TypeError)])
def test_sparsity_outside_unit_interval(k, error):
    model = tiny_model("llama")
    with pytest.raises(error, match="sparsity"):
        countdown.sparsify(model, "mono", k)
    _assert_untouched(model)


def test_model_without_gated_mlp():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    with pytest.raises(countdown.NoGatedMLPError, match="no Gated-MLP"):
        countdown.sparsify(model, "mono", 0.5)
    _assert_untouched(model)


def test_patching_twice_is_refused_and_unpatching_an_unpatched_model_too():
    model = tiny_model("llama")
    countdown.sparsify(model, "mono", 0.5)
    with pytest.raises(countdown.AlreadySparsifiedError, match="unsparsify"):
        countdown.sparsify(model, "cats", 0.5)
    countdown.unsparsify(model)
    with pytest.raises(countdown.NotSparsifiedError):
        countdown.unsparsify(model)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(mode="fast"), "unknown mode"),
    (dict(scope="prompt"), "unknown scope"),
    (dict(path="sparse"), "unknown path"),
    (dict(mode="prac"), "needs artifacts"),
])
def test_bad_options(kwargs, pattern):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=pattern):
        countdown.sparsify(model, "mono", 0.5, **kwargs)
    _assert_untouched(model)


def test_kept_rows_hand_examples():
    assert kept_rows(1000, 0.7) == 300  # 1000 * 0.3 is 299.99999999999994 in floating point
    assert kept_rows(97, 0.5) == 48
    assert kept_rows(97, 0.9) == 9
    assert kept_rows(14336, 0.9) == 1433
    assert kept_rows(10, 0.99) == 1


def test_dense_prefix_with_padding_end_is_dense_and_uncounted():
    model = tiny_model("llama")
    countdown.sparsify(model, "mono", 0.5, scope="all")
    mlp = countdown.find_gated_mlps(model)[0]
    x = torch.randn(2, 5, mlp.d_model)
    with torch.no_grad():
        sparse = mlp.module(x)
        countdown.reset_sparsity_stats(model)
        with countdown.dense_prefix(model, torch.tensor([1, 2]), end=torch.tensor([4, 5])):
            mixed = mlp.module(x)
        dense = mlp.reference(x)
    # Row 0: position 0 prompt, 1-3 sparse, 4 padding; row 1: 0-1 prompt, 2-4 sparse.
    torch.testing.assert_close(mixed[0, 1:4], sparse[0, 1:4])
    torch.testing.assert_close(mixed[0, 4], dense[0, 4])
    torch.testing.assert_close(mixed[1, :2], dense[1, :2])
    torch.testing.assert_close(mixed[1, 2:], sparse[1, 2:])
    assert countdown.patch.sparsify.state_of(model).layers[0].rows_total == 6 * 97
