"""The one-pass de-quantization of a nested 8-bit weight (kernels/int4/nested_dequant.py) against the format's
reference (``NestedWeight.dequantize("both")``), both layouts of the low plane, and the nested Linear's calls of many
tokens through it; under Triton's interpreter on CPU (on a GPU: compiled, where a fused multiply-add would show)."""

from __future__ import annotations

import pytest
import torch

from countdown.int4.nested import quantize_nested
from countdown.kernels.int4 import nested_dequant

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, group, scale_dtype, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (0.02 + torch.rand(n, 1, generator=g))
    w[:, : k // 3] += 0.05  # groups off centre: both offsets matter
    return quantize_nested(w, group, scale_dtype, low_transposed=transposed)


def _to(weight, device):
    import dataclasses

    high = dataclasses.replace(weight.high, **{f: getattr(weight.high, f).to(device)
                                               for f in ("qweight", "scale", "offset")})
    return dataclasses.replace(weight, high=high, low_qweight=weight.low_qweight.to(device),
                               low_scale=weight.low_scale.to(device), low_offset=weight.low_offset.to(device))


@pytest.mark.parametrize("n,k,group", [(38, 544, 32), (16, 256, 128), (6, 320, 64)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_both_planes_in_one_pass_are_the_formats_bits(n, k, group, transposed, scale_dtype, dtype):
    """W8 = fl32(W~h) + fl32(W~l) rounded once to the dtype, for tiles cut at both edges (rows past a multiple of
    the tile, bytes past a multiple of its width): the same bits as NestedWeight.dequantize("both")."""
    weight = _weight(n, k, group, scale_dtype, transposed)
    got = nested_dequant.dequantize_both(_to(weight, DEV), dtype).cpu()
    want = weight.dequantize("both", dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, want)
    # the low plane is in the sum: the high plane alone differs
    assert not torch.equal(got, weight.dequantize("high", dtype))


def test_a_dtype_it_cannot_write_is_refused():
    with pytest.raises(ValueError, match="writes one of"):
        nested_dequant.dequantize_both(_to(_weight(4, 64, 32, torch.float16, False), DEV), torch.float64)


@pytest.mark.parametrize("read", ["both", "high"])
def test_a_nested_linears_prompt_call_gives_the_references_numbers(read):
    """A nested Linear's call of many tokens through the one-pass de-quantization (what the module takes on CUDA;
    called directly here on CPU) equals F.linear of the reference's weight, bit for bit: the same weight bits and
    the same F.linear."""
    from countdown.int4.nested_linear import NestedLinear, _run_many

    lin = torch.nn.Linear(192, 40, bias=True)
    module = NestedLinear.from_linear(lin, group=64).to(DEV)
    module.read = read
    x = torch.randn(7, 192, generator=torch.Generator().manual_seed(3)).to(DEV)
    want = torch.nn.functional.linear(x, module.nested.dequantize(read, x.dtype), module.bias)
    assert torch.equal(_run_many(x, module), want)
    assert torch.equal(module(x), want)  # on CUDA the module's own forward takes the kernel
