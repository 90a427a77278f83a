"""harness.int4quality (the sparse rows of benchmarks/int4_quality.py): the float twin computes the 4-bit
model's numbers, W_down^T rounding against a NumPy re-implementation of the format's min-max rounding along
d_model, and the bytes per layout against the arithmetic written out by hand."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import countdown
from conftest import tiny_model
from countdown.int4 import Int4Linear, unpack
from countdown.spec import parse_spec
from harness.int4quality import down_transposed, float_twin, mlp_bytes_fraction, mlp_bytes_per_weight

IDS = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(3))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_float_twin_computes_the_4bit_models_numbers():
    q = countdown.quantize(tiny_model("llama", intermediate_size=96), group=32)
    twin = float_twin(q)
    assert not any(isinstance(m, Int4Linear) for m in twin.modules())
    assert isinstance(q.model.layers[0].mlp.down_proj, Int4Linear)  # the 4-bit model is left as it was
    for name, module in q.named_modules():
        if isinstance(module, Int4Linear):
            # the format by hand: fl32(fl32(scale * q) + offset), per group of 32 columns
            g = module.in_features // module.scale.shape[1]
            codes = unpack(module.qweight).float()
            scale = module.scale.float().repeat_interleave(g, dim=1)
            offset = module.offset.float().repeat_interleave(g, dim=1)
            linear = twin.get_submodule(name)
            assert type(linear) is nn.Linear and torch.equal(linear.weight, scale * codes + offset)
    assert torch.equal(_logits(twin), _logits(q))
    for model in (q, twin):  # and sparse: the same masks from the same weights
        countdown.sparsify(model, "dual", 0.5, mode="ideal", scope="all", path="masked")
    assert torch.equal(_logits(twin), _logits(q))


def _rtn_along_rows(w: np.ndarray, group: int) -> np.ndarray:
    """Min-max RTN of w [d_model, d_inter] in groups of ``group`` consecutive rows (d_model), fp16 scale and
    offset, in float32 as the format does it: q = round((w - offset) / scale), w~ = fl32(fl32(scale q) + offset)."""
    d, n = w.shape
    out = np.empty_like(w)
    for start in range(0, d, group):
        block = w[start:start + group]  # [group, d_inter]: one group per column
        lo, hi = block.min(axis=0), block.max(axis=0)
        scale = np.float16((hi - lo) / np.float32(15)).astype(np.float32)
        offset = np.float16(lo).astype(np.float32)
        scale = np.where(scale > 0, scale, np.float32(1))
        q = np.clip(np.rint((block - offset) / scale), 0, 15).astype(np.float32)
        out[start:start + group] = (scale * q).astype(np.float32) + offset
    return out


@pytest.mark.parametrize("hidden, group, used", [(64, 128, 64), (96, 128, 32), (128, 128, 128), (128, 64, 64)])
def test_down_transposed_rounds_w_down_along_d_model(hidden, group, used):
    model = tiny_model("llama", hidden_size=hidden, intermediate_size=96)
    before = {i: layer.mlp.down_proj.weight.detach().clone() for i, layer in enumerate(model.model.layers)}
    gate = model.model.layers[0].mlp.gate_proj.weight.detach().clone()
    assert down_transposed(model, group) == used
    for i, layer in enumerate(model.model.layers):
        after = layer.mlp.down_proj.weight
        reference = torch.from_numpy(_rtn_along_rows(before[i].numpy(), used))
        assert torch.equal(after, reference)
        # along d_model: within a group of rows, each column holds at most 16 levels
        levels = after.reshape(hidden // used, used, -1).transpose(1, 2).reshape(-1, used)
        assert max(len(torch.unique(row)) for row in levels) <= 16
        assert not torch.equal(after, before[i])
    assert torch.equal(model.model.layers[0].mlp.gate_proj.weight, gate)  # only W_down changes
    q = countdown.quantize(copy.deepcopy(model), group=32)
    with pytest.raises(TypeError, match="float_twin"):
        down_transposed(q, group)


def test_mlp_bytes_per_weight():
    model = tiny_model("llama", intermediate_size=96)  # d_model 64: gate, up, down all 64 x 96
    assert mlp_bytes_per_weight(model) == 2.0
    assert mlp_bytes_per_weight(model, down_group=64) == pytest.approx((2 + 2 + 0.5 + 4 / 64) / 3)
    q = countdown.quantize(model, group=32)
    assert mlp_bytes_per_weight(q) == pytest.approx(0.5 + 4 / 32)  # codes + fp16 scale and offset per 32


def test_mlp_bytes_fraction_by_hand():
    d, n, elem, kept = 4096, 14336, 0.53125, 0.3
    dense = 3 * d * n * elem
    shadows = 2 * (n * d * 4 / 8 + n * (d / 64) * 2)  # dual[shadow4]: 4 bits, fp16 scale per 64 columns

    def f(spec, layout, ideal=False, e=elem):
        return mlp_bytes_fraction(parse_spec(spec), ideal, kept, e, d, n, layout)
    assert f("dense", "native") == 1.0
    assert f("dual", "downT", ideal=True) == pytest.approx((2 + kept) / 3)
    assert f("dual", "any", ideal=True) == pytest.approx((2 + kept) / 3)
    assert f("dual", "native", ideal=True) == 1.0  # W_down read in full: nothing saved
    assert math.isnan(f("mono", "downT", ideal=True))
    for method in ("mono", "cats"):
        assert f(method, "downT") == pytest.approx((1 + 2 * kept) / 3)
        assert f(method, "native") == pytest.approx((2 + kept) / 3)
        assert f(method, "any", e=2) == pytest.approx((1 + 2 * kept) / 3)
    assert f("dual[shadow4]", "downT") == pytest.approx(shadows / dense + kept)
    assert f("dual[shadow4]", "native") == pytest.approx(shadows / dense + (2 * kept + 1) / 3)
    assert f("dual[shadow4]", "any", e=2) == pytest.approx((shadows + 3 * d * n * 2 * kept) / (3 * d * n * 2))
    assert f("teal", "native") == 1.0 and math.isnan(f("teal", "downT"))
    assert f("teal", "any", e=2) == pytest.approx(kept)
    with pytest.raises(ValueError, match="layout"):
        f("mono", "rows")
