"""4-bit weights' kernels (the format of ``countdown.int4``), each file in the order: @triton.jit helpers and kernel,
launcher, op registration where the op is ours here (the dense ops are registered by countdown.int4.backends):

    words.py        the fp16x2 dot products of 4-bit words (lop3 dequantization), shared by the GEMVs
    gemv.py         one token through a 4-bit Linear, split over slices of K (optionally act(g) * u in, or the norm)
    dequant.py      a 4-bit weight de-quantized in one pass (a prompt's F.linear)
    rows.py         the kept rows of a 4-bit Gated-MLP for one token: the select kernel, the op, the reference
    rows_other.py   the other GEMV on the kept rows only
    rows_down.py    the down projection of the kept rows of W_down^T (with the residual add)
    rows_list.py    the select kernel's compacted row lists, walked in tiles
    nested_rows.py  the mixed Gated-MLP on nested 8-bit weights (dual[mixed]): the kept rows' low planes, the op
    nested_down.py  its last launch: the kept rows of W_down's transposed low plane, q and the residual added
"""
