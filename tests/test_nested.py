"""The nested 8-bit format (countdown.int4.nested): a hand-worked group, the rounding and both planes' error bounds
against float64, the planes as ordinary 4-bit weights, the transposed low plane, the references; NestedLinear and a
model's MLPs converted in place (countdown.int4.nested_model)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from countdown.int4 import Int4Linear, dequantize, quantize, quantize_rtn, unpack
from countdown.int4.nested import (NestedWeight, low_columns_ref, low_rows_ref, nbytes, nested_linear_ref,
                                   quantize_nested)
from countdown.int4.nested_linear import NestedLinear
from countdown.int4.nested_model import nested_config, read_planes, restore, to_nested, convert
from countdown.model.gated_mlp import find_gated_mlps
from conftest import tiny_model

U32 = 2.0 ** -24
IDS = torch.randint(3, 120, (2, 10), generator=torch.Generator().manual_seed(5))


# ------------------------------------------------------------------------------------------ a hand-worked group
def test_a_hand_worked_group():
    """lo = 0, hi = 15 = 240 / 16: the step is 1/16 exactly, the high plane's scale 1 and offset 0 (4-bit RTN of the
    group: step 15 / 15), the low plane's offset -7.5 / 16."""
    w = torch.zeros(2, 32)
    w[0, :5] = torch.tensor([0.0, 15.0, 5.01, 1.03, 0.4])
    w[1] = 0.3  # a constant group
    nw = quantize_nested(w, group=32)
    assert nw.low_scale[0, 0].item() == 0.0625 and nw.high.scale[0, 0].item() == 1.0
    assert nw.high.offset[0, 0].item() == 0.0 and nw.low_offset[0, 0].item() == -0.46875
    # (w + 0.46875) * 16: 7.5 -> 8 and 247.5 -> 248 (half to even), 87.66 -> 88, 23.98 -> 24, 13.9 -> 14
    assert nw.codes()[0, :5].tolist() == [8, 248, 88, 24, 14]
    assert unpack(nw.high.qweight)[0, :5].tolist() == [0, 15, 5, 1, 0]  # round(w / 1): 4-bit RTN
    assert nw.dequantize("high")[0, :5].tolist() == [0.0, 15.0, 5.0, 1.0, 0.0]
    assert nw.dequantize("low")[0, :5].tolist() == [0.03125, 0.03125, 0.03125, 0.03125, 0.40625]
    assert nw.dequantize()[0, :5].tolist() == [0.03125, 15.03125, 5.03125, 1.03125, 0.40625]
    # the constant group: step 0, every code 0, the high offset the value as float16 stores it
    assert nw.low_scale[1, 0].item() == 0 and nw.codes()[1].abs().sum() == 0
    assert torch.equal(nw.dequantize()[1], torch.full((32,), torch.tensor(0.3).half().item()))


# ------------------------------------------------------------------------------------------ bounds in float64
def _bounds(w64, nw):
    """Per element: the 8-bit and the high plane's bounds of nested.py's docstring, in float64."""
    n, k = w64.shape
    g = nw.group
    wg = w64.reshape(n, k // g, g)
    lo = wg.amin(-1)
    s = nw.low_scale.double()
    o = nw.high.offset.double() + nw.low_offset.double()
    off = (o - (lo - 7.5 * s)).abs() + U32 * o.abs()  # |d|: the offsets' roundings, and O's float32 one
    e_low = (nw.low_offset.double() + 7.5 * s).abs()
    expand = lambda t: t[..., None].expand(n, k // g, g).reshape(n, k)  # noqa: E731
    w8, wh = nw.dequantize().double(), nw.dequantize("high").double()
    rounding = 4 * U32 * (wh.abs() + nw.dequantize("low").double().abs() + 16 * expand(s) * 15)
    return expand(s * (0.5 + 1e-5) + off) + rounding, expand(8 * s + e_low + off) + rounding, w8, wh


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_both_planes_within_their_bounds_against_float64(group, dtype, scale_dtype):
    gen = torch.Generator().manual_seed(group)
    w = 0.05 * torch.randn(24, 256, generator=gen)
    w[0, :group] = 0.3  # a constant group
    w[1, :group] *= 1e-3  # a step that is an fp16 subnormal (< 2**-14)
    w[2, group:2 * group] += 3.0  # an offset far from 0
    w = w.to(dtype)
    nw = quantize_nested(w, group, scale_dtype)
    w64 = w.double()
    b8, bh, w8, wh = _bounds(w64, nw)
    assert ((w8 - w64).abs() <= b8).all()
    assert ((wh - w64).abs() <= bh).all()
    if scale_dtype == torch.float16:
        assert nw.low_scale[1, 0] < 2.0 ** -14  # the subnormal case was exercised
    # the step is stored rounded up: the codes reach the group's max (float32's subtract and divide aside)
    wg = w64.reshape(24, -1, group)
    assert (nw.low_scale.double() * 240 >= (wg.amax(-1) - wg.amin(-1)) * (1 - 4 * U32)).all()
    # an 8-bit weight is only as far as half a step from w where nothing clamps: the codes are the nearest
    s = nw.low_scale.double().repeat_interleave(group, dim=1)
    inside = (nw.codes() > 0) & (nw.codes() < 255)
    assert ((w8 - w64).abs()[inside] <= (s * (0.5 + 1e-5) + 8 * U32 * (w8.abs() + 1))[inside]).all()


def test_codes_are_the_float64_rounding_against_the_stored_values():
    w = 0.02 * torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    nw = quantize_nested(w, 64)
    o = (nw.high.offset.double() + nw.low_offset.double()).repeat_interleave(64, dim=1)
    s = nw.low_scale.double().repeat_interleave(64, dim=1)
    exact = ((w.double() - o) / s)
    want = torch.round(exact).clamp(0, 255)
    tie = ((exact - exact.floor()) - 0.5).abs() < 1e-4  # float32's division may break an exact tie otherwise
    assert torch.equal(nw.codes()[~tie].double(), want[~tie])


@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_high_plane_is_the_groups_4bit_rtn(group):
    w = 0.05 * torch.randn(32, 256, generator=torch.Generator().manual_seed(group))
    nw, rtn = quantize_nested(w, group), quantize_rtn(w, group)
    assert torch.equal(nw.high.offset, rtn.offset)  # both store lo
    torch.testing.assert_close(nw.high.scale.float(), rtn.scale.float(), rtol=2.0 ** -9, atol=0)
    exact = ((w.double() - rtn.offset.double().repeat_interleave(group, 1)) /
             (nw.high.scale.double().repeat_interleave(group, 1)))
    tie = ((exact - exact.floor()) - 0.5).abs() < 0.02  # the offsets' and steps' roundings move ties a little
    assert torch.equal(unpack(nw.high.qweight)[~tie], unpack(rtn.qweight)[~tie]) and tie.float().mean() < 0.05


def test_the_planes_are_ordinary_4bit_weights_that_sum_to_the_8bit_weight():
    w = 0.03 * torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    nw = quantize_nested(w, 64)
    high, low = nw.high, nw.low
    assert torch.equal(high.scale.float(), 16 * low.scale.float())  # 16 S exact
    assert torch.equal(dequantize(high.qweight, high.scale, high.offset), nw.dequantize("high"))
    assert torch.equal(dequantize(low.qweight, low.scale, low.offset), nw.dequantize("low"))
    assert torch.equal(nw.dequantize(), nw.dequantize("high") + nw.dequantize("low"))
    # in float64: O_h + O_l + S c, within float32's roundings of the planes' values
    c = nw.codes().double()
    s = low.scale.double().repeat_interleave(64, dim=1)
    o = (high.offset.double() + low.offset.double()).repeat_interleave(64, dim=1)
    torch.testing.assert_close(nw.dequantize().double(), o + s * c, rtol=0, atol=1e-8)
    # the high plane is read at its bucket's middle, 16 h + 7.5, up to the float16 rounding of O_l = -7.5 S
    h = unpack(high.qweight).double()
    middle = o + s * (16 * h + 7.5)
    e_low = (low.offset.double() + 7.5 * low.scale.double()).abs().repeat_interleave(64, dim=1)
    assert (e_low <= 7.5 * s * 2.0 ** -11).all()
    assert ((nw.dequantize("high").double() - middle).abs() <= e_low + 1e-8).all()
    assert nbytes(8, 128, 64) * 8 / (8 * 128) == 9.0 and nw.nbytes == nbytes(8, 128, 64)


def test_a_transposed_low_plane_holds_the_same_values_column_by_column():
    w = 0.03 * torch.randn(12, 128, generator=torch.Generator().manual_seed(3))
    plain, t = quantize_nested(w, 32), quantize_nested(w, 32, low_transposed=True)
    assert t.low_qweight.shape == (128, 6) and t.low_scale.shape == (4, 12)
    assert torch.equal(t.low_scale, plain.low_scale.t()) and torch.equal(t.codes(), plain.codes())
    assert torch.equal(t.dequantize(), plain.dequantize()) and torch.equal(t.dequantize("low"), plain.dequantize("low"))
    rows = torch.tensor([0, 31, 32, 100, 127])
    assert torch.equal(t.dequantize_low_rows(rows), plain.dequantize("low")[:, rows].t())
    assert torch.equal(t.low.dequantize(), plain.low.dequantize())  # laid out as the format again
    with pytest.raises(ValueError, match="transposed low plane"):
        t.rows(rows)


def test_references_against_float64():
    gen = torch.Generator().manual_seed(4)
    w = 0.03 * torch.randn(40, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    nw = quantize_nested(w, 32)
    for planes in ("both", "high", "low"):
        want = x.double() @ nw.dequantize(planes).double().t()
        torch.testing.assert_close(nested_linear_ref(x, nw, planes).double(), want, rtol=1e-5, atol=1e-6)
    rows = torch.tensor([3, 7, 39])
    want = x.double() @ nw.dequantize("low").double()[rows].t()
    torch.testing.assert_close(low_rows_ref(x, nw, rows).double(), want, rtol=1e-5, atol=1e-6)
    down = quantize_nested(0.03 * torch.randn(64, 96, generator=gen), 32, low_transposed=True)
    cols = torch.tensor([0, 50, 95])
    s = torch.randn(3, 3, generator=gen)
    want = s.double() @ down.dequantize("low").double()[:, cols].t()
    torch.testing.assert_close(low_columns_ref(s, down, cols).double(), want, rtol=1e-5, atol=1e-6)
    plain = quantize_nested(down.dequantize(), 32)  # the same columns of a plane held as the high one
    torch.testing.assert_close(low_columns_ref(s, plain, cols).double(),
                               s.double() @ plain.dequantize("low").double()[:, cols].t(), rtol=1e-5, atol=1e-6)


def test_refusals():
    w = torch.randn(6, 64)
    with pytest.raises(ValueError, match="group must be one of"):
        quantize_nested(w, 48)
    with pytest.raises(ValueError, match="multiple of group=128"):
        quantize_nested(w, 128)
    with pytest.raises(ValueError, match="N even"):
        quantize_nested(torch.randn(5, 64), 32, low_transposed=True)
    with pytest.raises(ValueError, match="does not fit torch.float16"):
        quantize_nested(torch.tensor([[0.0, 1e7] * 16]), 32)
    nw = quantize_nested(w, 32)
    with pytest.raises(ValueError, match="low plane of a nested"):
        NestedWeight(nw.high, nw.low_qweight[:, :4], nw.low_scale, nw.low_offset)


# ------------------------------------------------------------------------------------------ NestedLinear
@pytest.mark.parametrize("bias", [False, True])
def test_nested_linear_against_float64(bias):
    gen = torch.Generator().manual_seed(6)
    linear = torch.nn.Linear(64, 24, bias=bias)
    x = torch.randn(2, 5, 64, generator=gen)
    m = NestedLinear.from_linear(linear, group=32)
    assert isinstance(m, torch.nn.Linear) and m.read == "both"
    b = None if not bias else linear.bias.double()
    for read in ("both", "high"):
        m.read = read
        w = m.nested.dequantize(read).double()
        torch.testing.assert_close(m(x).double(), F.linear(x.double(), w, b), rtol=1e-5, atol=1e-6)
        assert torch.equal(m.weight, m.nested.dequantize(read))
    with pytest.raises(AttributeError, match="two 4-bit planes"):
        m.weight = linear.weight.detach().clone()
    with pytest.raises(ValueError, match="read must be one of"):
        m.read = "low"
    m.to(torch.bfloat16)
    assert m.high_scale.dtype == torch.float16 and m.compute_dtype == torch.bfloat16 and m.weight.dtype == torch.bfloat16
    assert sorted(m.state_dict()) == sorted(["high_qweight", "high_scale", "high_offset", "low_qweight", "low_scale",
                                             "low_offset"] + (["bias"] if bias else []))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _twin(model, reference, planes):
    """A float copy of ``reference`` whose MLP weights are the nested model's ``planes`` weights, in nn.Linear."""
    twin = copy.deepcopy(reference)
    for mlp, nested in zip(find_gated_mlps(twin), find_gated_mlps(model)):
        for role in ("gate", "up", "down"):
            src = getattr(nested.module, getattr(nested, role))
            getattr(mlp.module, getattr(mlp, role)).weight.data = src.nested.dequantize(planes)
    return twin


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_to_nested_converts_the_mlps_and_reads_either_plane(arch):
    reference = tiny_model(arch, intermediate_size=128)
    model = to_nested(copy.deepcopy(reference), group=32)
    record = nested_config(model)
    assert record["group"] == 32 and len(record["modules"]) == 3 * model.config.num_hidden_layers
    assert all(name.endswith("down_proj") for name in record["low_transposed"])
    mlp = find_gated_mlps(model)[0]
    assert isinstance(mlp.module.down_proj, NestedLinear) and mlp.module.down_proj.low_transposed
    assert not isinstance(model.model.layers[0].self_attn.q_proj, NestedLinear)  # MLP only
    assert torch.allclose(_logits(model), _logits(_twin(model, reference, "both")), atol=1e-5, rtol=1e-5)
    read_planes(model, "high")
    high = _logits(model)
    assert torch.allclose(high, _logits(_twin(model, reference, "high")), atol=1e-5, rtol=1e-5)
    read_planes(model, "both")
    assert to_nested(model, group=32) is model  # converted already: nothing changes
    assert not torch.allclose(high, _logits(model))


def test_conversion_refusals_and_restore():
    with pytest.raises(ValueError, match="does not divide the MLP input widths \\[97\\]"):
        to_nested(tiny_model("llama"), group=32)  # d_inter 97
    with pytest.raises(ValueError, match="fused gate_up"):
        to_nested(tiny_model("phi3", intermediate_size=128), group=32)
    with pytest.raises(ValueError, match="4-bit already"):
        to_nested(quantize(tiny_model("llama", intermediate_size=128), group=32), group=32)
    model = to_nested(tiny_model("llama", intermediate_size=128), group=32)
    with pytest.raises(ValueError, match="nested already"):
        to_nested(model, group=64)
    read_planes(model, "high")
    with pytest.raises(ValueError, match="high plane alone"):
        to_nested(model, group=32)
    plain = tiny_model("llama", intermediate_size=128)
    before = _logits(plain)
    replaced = convert(plain, find_gated_mlps(plain), 32)
    assert not torch.equal(_logits(plain), before)
    restore(plain, replaced)
    assert torch.equal(_logits(plain), before) and nested_config(plain) is None
    assert not any(isinstance(m, (NestedLinear, Int4Linear)) for m in plain.modules())
