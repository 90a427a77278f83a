"""The one-pass 4-bit de-quantization (kernels/int4/dequant.py) against the format's reference, and the 4-bit
Linear's calls of many tokens through it (int4/backends.py), under Triton's interpreter on CPU (on a GPU: compiled,
where a fused multiply-add would show)."""

from __future__ import annotations

import pytest
import torch

from countdown.int4 import Int4Linear, backends, quantize_rtn
from countdown.int4.format import dequantize, pack
from countdown.int4.linear import int4_linear_ref
from countdown.kernels.int4 import dequant as _int4_dequant

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _codes(n, k, group, scale_dtype, seed=0):
    """Packed codes, scales with full fp32 mantissas where the dtype allows (a fused multiply-add would round
    them differently from the format's multiply then add) and offsets of both signs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-4).to(scale_dtype)
    offset = (torch.randn(n, k // group, generator=g) * 0.1).to(scale_dtype)
    return pack(q), scale, offset


@pytest.mark.parametrize("n,k,group", [(37, 544, 32), (16, 256, 128), (5, 320, 64), (3, 4096, 128)])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_the_formats_bit_for_bit(n, k, group, scale_dtype, dtype):
    """W~ = fl32(fl32(scale q) + offset) rounded to the dtype, for tiles cut at both edges (rows past a multiple of
    16, bytes past a multiple of 128) and every group size: the same bits as format.dequantize."""
    qweight, scale, offset = _codes(n, k, group, scale_dtype)
    got = _int4_dequant.dequantize(qweight.to(DEV), scale.to(DEV), offset.to(DEV), dtype).cpu()
    want = dequantize(qweight, scale, offset, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, want)


def test_dequantize_names_the_dtypes_it_writes():
    qweight, scale, offset = _codes(4, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="writes one of"):
        _int4_dequant.dequantize(qweight, scale, offset, torch.int8)


@pytest.mark.parametrize("transposed", [False, True])
def test_many_token_calls_give_the_reference(transposed):
    """A prompt's call (many tokens) of a 4-bit Linear, with its bias, W or W^T held: F.linear of the one-pass
    de-quantization gives int4_linear_ref's output bit for bit (the same W~, the same F.linear); on CUDA the module's
    own forward takes this route, the reference backend does not."""
    g = torch.Generator().manual_seed(1)
    n, k = 64, 256
    w = torch.randn(n, k, generator=g)
    weight = quantize_rtn(w.t().contiguous() if transposed else w, 32)
    module = Int4Linear.from_weight(weight, bias=torch.randn(n, generator=g), dtype=torch.bfloat16,
                                    transposed=transposed).to(DEV, torch.bfloat16)
    x = torch.randn(2, 7, k, generator=g).to(torch.bfloat16).to(DEV)
    w_ref = dequantize(module.qweight, module.scale, module.offset, x.dtype)
    want = torch.nn.functional.linear(x, w_ref.t() if transposed else w_ref, module.bias)
    if not transposed:
        assert torch.equal(want, int4_linear_ref(x, module.qweight, module.scale, module.offset, module.bias))
    assert torch.equal(backends._run_many(x, module), want)
    assert backends._applies_many(x, module) == (DEV == "cuda")
    assert torch.equal(module(x), want)
    module.backend = "reference"
    assert not backends._applies_many(x, module)
