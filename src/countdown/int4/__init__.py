"""4-bit weights for every Linear of a decoder (docs/int4.md).

    format.py       the format: codes, group scales and offsets; pack / unpack, RTN, dequantize, bytes
    gguf_blocks.py  GGUF's Q4_0 / Q4_1 / Q4_K blocks as the format, exactly
    gguf_file.py    a model's Linear tensors in its GGUF file (names, row order, the cached .gguf)
    linear.py       Int4Linear (an nn.Linear) and int4_linear, the one call a GPU kernel plugs into
    quantize.py     quantize(model, group, source): the in-place transform
    loading.py      a saved 4-bit folder loaded back with the same modules
    backends.py     the one-token GEMV of each Int4Linear: ours (kernels/int4/gemv.py), torch's int4, gemlite's
"""

from .format import Int4Weight, dequantize, pack, quantize_rtn, unpack
from .linear import Int4Linear, int4_linear, int4_linear_ref, register_kernel, stack
from .backends import BACKENDS, use_backend
from .quantize import int4_config, quantize

__all__ = ["BACKENDS", "Int4Linear", "Int4Weight", "dequantize", "int4_config", "int4_linear", "int4_linear_ref", "pack",
           "quantize", "quantize_rtn", "register_kernel", "stack", "unpack",
           "use_backend"]
