"""The mixed Gated-MLP's one-token kernels (kernels/int4/nested_rows.py) against the float64 reference
(``patch.mixed_mlp.mixed_mlp_ref``), under Triton's interpreter on CPU (on a GPU: the inline-asm dequantization).

Tolerance from the arithmetic: the 4-bit GEMVs' fp16x2 lanes err by at most about 5 * 2**-11 of the sum of
|scale (c - 8) x| a row (words.py), the low planes' corrections the same with their own codes; g and u carry that
error into s through act' and act, W_down's two planes then add theirs (the high plane's GEMV again 5 * 2**-11 of
|scale (c - 8) s|, the transposed low plane fp32). The bound below is that first-order propagation, doubled."""

from __future__ import annotations

import pytest
import torch

from countdown.int4.format import unpack
from countdown.int4.nested import quantize_nested
from countdown.kernels.common import act_torch
from countdown.kernels.int4 import gemv, nested_rows
from countdown.patch.mixed_mlp import act_grad

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U = 2.0 ** -11


def _weights(d_model, d_inter, group, seed=0):
    g = torch.Generator().manual_seed(seed)

    def weight(n, k):
        w = torch.randn(n, k, generator=g) * (1 + torch.rand(n, 1, generator=g)) / k ** 0.5
        w[:, : k // 3] += 0.3 / k ** 0.5  # groups off centre: the offsets' term matters
        return w

    gate = quantize_nested(weight(d_inter, d_model), group)
    up = quantize_nested(weight(d_inter, d_model), group)
    down = quantize_nested(weight(d_model, d_inter), group, low_transposed=True)
    return gate, up, down


def _words(w):
    return w.qweight.view(torch.int32).to(DEV), w.scale.to(DEV), w.offset.to(DEV)


def _args(gate, up, down):
    high = type(gate.high)(*(torch.cat([getattr(gate.high, n), getattr(up.high, n)]) for n in
                             ("qweight", "scale", "offset")))
    return (_words(high), _words(gate.low), _words(up.low), _words(down.high),
            (down.low_qweight.to(DEV), down.low_scale.to(DEV), down.low_offset.to(DEV)))


def _lane_terms(w, x):
    """sum over k of |scale (c - 8) x| a row (float64): what the fp16x2 lanes' error scales with."""
    c = unpack(w.qweight).double() - 8
    n, k = c.shape
    sc = w.scale.double().repeat_interleave(k // w.scale.shape[1], 1)
    return (sc * c).abs() @ x.abs()


def _bound(x, gate, up, down, keep, act_name):
    x = x.reshape(-1).double()
    k = keep.double()
    eg = 5 * U * (_lane_terms(gate.high, x) + k * _lane_terms(gate.low, x))
    eu = 5 * U * (_lane_terms(up.high, x) + k * _lane_terms(up.low, x))
    pl = {(n, p): w.dequantize(p).double() for n, w in (("gate", gate), ("up", up), ("down", down))
          for p in ("high", "low")}
    g = pl["gate", "high"] @ x + k * (pl["gate", "low"] @ x)
    u = pl["up", "high"] @ x + k * (pl["up", "low"] @ x)
    s = u * act_torch(g, act_name)
    es = act_grad(act_name, g).abs() * u.abs() * eg + act_torch(g, act_name).abs() * eu
    full = pl["down", "high"] + pl["down", "low"] * k[None, :]
    ey = full.abs() @ es + 5 * U * _lane_terms(down.high, s) + 1e-6 * (full.abs() @ s.abs())
    return 2 * ey + 1e-6


@pytest.mark.parametrize("act_name", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("keep_share", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("slices", [1, 4])
def test_mixed_mlp_matches_the_float64_reference(act_name, keep_share, slices):
    """slices: K in that many slices, for the high planes' GEMV and the low planes' corrections alike (each slice's
    correction added to the GEMV's partial sums of the same slice)."""
    import countdown.kernels as K

    d_model, d_inter, group = 256, 512, 64
    with K.overrides(launch={("int4_gemv", (2 * d_inter, d_model)): dict(MAX_COLS=d_model // slices)}):
        _mixed_against_reference(act_name, keep_share, {"L_COLS": d_model // slices}, d_model, d_inter, group)


LOW_DOWN = [  # nested_down.py's knobs: tiles of 1 to 16 rows (kept counts not a multiple of the tile), 1 set a
    # program to every set in one (one program a column slice: its own last), 1 or 2 tiles ahead (a program with fewer
    # tiles than are requested ahead), column slices of 16 to 128 bytes, the walk before or after the PDL wait
    dict(D_T=1, D_SUB=1, D_CB=16, D_WARPS=1, D_AHEAD=2),
    dict(D_T=4, D_SUB=1, D_CB=32, D_WARPS=2, D_AHEAD=1, D_EARLY=0),
    dict(D_T=16, D_SUB=4, D_CB=128, D_WARPS=4, D_AHEAD=2),
    dict(D_T=8, D_SUB=3, D_CB=64, D_WARPS=2, D_AHEAD=1),
]


@pytest.mark.parametrize("keep_share", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("low_down", range(len(LOW_DOWN)))
def test_low_down_configurations_match_the_float64_reference(keep_share, low_down):
    """Each D_* configuration: the partials' sum against float64 (0 kept rows, some, all), and with a residual the
    launch's own sum (h + partials + bias, the last program of each column slice)."""
    d_model, d_inter, group = 256, 512, 64
    cfg = LOW_DOWN[low_down]
    _mixed_against_reference("silu", keep_share, cfg, d_model, d_inter, group)
    gate, up, down = _weights(d_model, d_inter, group, seed=1)
    x = torch.randn(1, d_model, generator=torch.Generator().manual_seed(2)).to(DEV)
    h = torch.randn(1, d_model, generator=torch.Generator().manual_seed(5)).to(DEV)
    bias = torch.randn(d_model, generator=torch.Generator().manual_seed(6)).to(DEV)
    cut = torch.tensor(0.02 if keep_share else 1e9).to(DEV)
    partials = nested_rows.mixed_mlp(x, *_args(gate, up, down), cut, "silu", config=cfg)
    out = nested_rows.mixed_mlp(x, *_args(gate, up, down), cut, "silu", config=cfg, residual=h, bias=bias)
    torch.testing.assert_close(out, h + partials.sum(0) + bias, atol=1e-5, rtol=1e-5)


def test_low_down_reads_fp32_scales_as_pairs_too():
    """A nested weight stored with fp32 scales and offsets: low_down reads them as int64 pairs of columns."""
    d_model, d_inter, group = 128, 256, 64
    g = torch.Generator().manual_seed(9)
    gate, up, down = (quantize_nested(torch.randn(n, k, generator=g) / k ** 0.5, group, torch.float32, **kw)
                      for n, k, kw in ((d_inter, d_model, {}), (d_inter, d_model, {}),
                                       (d_model, d_inter, dict(low_transposed=True))))
    x = torch.randn(1, d_model, generator=torch.Generator().manual_seed(10))
    _, idx, cnt = nested_rows.mixed_mlp(x.to(DEV), *_args(gate, up, down), torch.tensor(0.01).to(DEV), "silu",
                                        lists=True)
    y = nested_rows.mixed_mlp(x.to(DEV), *_args(gate, up, down), torch.tensor(0.01).to(DEV), "silu")
    keep = nested_rows.keep_of_lists(idx, cnt, d_inter, nested_rows._config(None, DEV)[0]["SET"])
    assert 0 < int(keep.sum()) < d_inter
    ref = nested_rows.mixed_mlp_kernel_ref(x, gate, up, down, keep, "silu")
    assert ((y.sum(0).double().cpu() - ref).abs() <= _bound(x, gate, up, down, keep, "silu")).all()


def _mixed_against_reference(act_name, keep_share, config, d_model, d_inter, group):
    gate, up, down = _weights(d_model, d_inter, group, seed=1)
    x = torch.randn(1, d_model, generator=torch.Generator().manual_seed(2))
    args = _args(gate, up, down)
    # the cut: the share of rows over it in the float64 high-plane score (the kernel decides on its own fp32 sums)
    score = ((up.high.dequantize().double() @ x.reshape(-1).double())
             * act_torch(gate.high.dequantize().double() @ x.reshape(-1).double(), act_name)).abs()
    cut = torch.tensor(-1.0 if keep_share == 1.0 else float(score.quantile(1 - keep_share)) if keep_share else 1e9)
    kept, rows = torch.zeros(1, dtype=torch.float64, device=DEV), torch.zeros((), dtype=torch.int64, device=DEV)
    partials, idx, cnt = nested_rows.mixed_mlp(x.to(DEV), *args, cut.to(DEV), act_name, count=(kept, rows),
                                               config=config, lists=True)
    keep = nested_rows.keep_of_lists(idx, cnt, d_inter, nested_rows._config(None, DEV)[0]["SET"])
    want_share = {0.0: 0, 1.0: d_inter}.get(keep_share, round(keep_share * d_inter))
    assert abs(int(keep.sum()) - want_share) <= 2
    assert float(kept) == int(keep.sum()) and int(rows) == d_inter
    y = partials.sum(0).double().cpu()
    ref = nested_rows.mixed_mlp_kernel_ref(x, gate, up, down, keep, act_name)
    bound = _bound(x, gate, up, down, keep, act_name)
    assert ((y - ref).abs() <= bound).all(), float(((y - ref).abs() / bound).max())
    # the worst case above sums every row's error with one sign; the error seen is far below what refining the
    # kept rows changes, so a correction missed or put on the wrong rows would show
    if 0 < keep_share < 1:
        four_bit = nested_rows.mixed_mlp_kernel_ref(x, gate, up, down, torch.zeros_like(keep), act_name)
        assert (y - ref).abs().max() < 0.05 * (four_bit - ref).abs().max()


@pytest.mark.parametrize("act_name", ["silu", "gelu_tanh"])
def test_the_error_rule_keeps_the_rows_of_the_expected_refinement(act_name):
    """consts given: the select keeps the rows whose rank=error score (patch.mixed_mlp.row_score, here in float64 on
    the high planes' sums) is over the cut; the refined output is the float64 mixed MLP of those rows."""
    from countdown.patch.mixed_mlp import row_score

    d_model, d_inter, group = 256, 512, 64
    gate, up, down = _weights(d_model, d_inter, group, seed=11)
    x = torch.randn(1, d_model, generator=torch.Generator().manual_seed(12))
    args = _args(gate, up, down)
    hi = lambda w: w.dequantize("high").double()  # noqa: E731
    full = lambda w: w.dequantize("both").double()  # noqa: E731
    consts = torch.stack([(full(up) - hi(up)).pow(2).mean(1).sqrt(), (full(gate) - hi(gate)).pow(2).mean(1).sqrt(),
                          hi(down).pow(2).sum(0).sqrt(), (full(down) - hi(down)).pow(2).sum(0).sqrt()])
    x64 = x.double()
    u, g = x64 @ hi(up).t(), x64 @ hi(gate).t()
    score = row_score("error", lambda v: act_torch(v, act_name), act_name, x64, u, g, consts).reshape(-1)
    cut = score.quantile(0.75)
    _, idx, cnt = nested_rows.mixed_mlp(x.to(DEV), *args, cut.float().to(DEV), act_name, lists=True,
                                        consts=consts.float().to(DEV))
    keep = nested_rows.keep_of_lists(idx, cnt, d_inter, nested_rows._config(None, DEV)[0]["SET"])
    differ = (keep != (score > cut)).nonzero().reshape(-1)
    assert len(differ) <= 2 and all(abs(score[i] / cut - 1) < 1e-3 for i in differ), differ
    # a ranking of its own: not |act(g) u|'s top quarter
    plain = (u * act_torch(g, act_name)).abs().reshape(-1)
    assert (keep != (plain > plain.quantile(0.75))).sum() > 8
    y = nested_rows.mixed_mlp(x.to(DEV), *args, cut.float().to(DEV), act_name, consts=consts.float().to(DEV))
    ref = nested_rows.mixed_mlp_kernel_ref(x, gate, up, down, keep, act_name)
    assert ((y.sum(0).double().cpu() - ref).abs() <= _bound(x, gate, up, down, keep, act_name)).all()
    with pytest.raises(ValueError, match="consts"):
        nested_rows.mixed_mlp(x.to(DEV), *args, cut.float().to(DEV), act_name, consts=consts[:3].float().to(DEV))


def test_the_residual_add_and_bias_in_the_last_launch():
    d_model, d_inter, group = 128, 384, 64
    gate, up, down = _weights(d_model, d_inter, group, seed=3)
    x = torch.randn(1, d_model, generator=torch.Generator().manual_seed(4))
    h = torch.randn(1, d_model, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    bias = torch.randn(d_model, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    args = _args(gate, up, down)
    cut = torch.tensor(0.05)
    partials = nested_rows.mixed_mlp(x.to(DEV), *args, cut.to(DEV), "silu")
    for _ in range(2):  # the counters set back to 0: the same numbers on every launch
        out = nested_rows.mixed_mlp(x.to(DEV), *args, cut.to(DEV), "silu", residual=h.to(DEV), bias=bias.to(DEV))
        want = (h.float() + partials.sum(0).cpu() + bias.float()).to(torch.bfloat16)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.cpu(), want, atol=0, rtol=2 ** -7)


def test_the_op_counts_the_refined_rows():
    d_model, d_inter, group = 128, 256, 64
    gate, up, down = _weights(d_model, d_inter, group, seed=7)
    x = torch.randn(1, d_model, generator=torch.Generator().manual_seed(8)).to(DEV)
    args = _args(gate, up, down)
    kept, rows = torch.zeros(1, dtype=torch.float64, device=DEV), torch.zeros((), dtype=torch.int64, device=DEV)
    flat = [t for w in args for t in w]
    h = torch.zeros(1, d_model, device=DEV)
    y = torch.ops.countdown.int4_nested_mixed_mlp(x, *flat, torch.tensor([0.02], device=DEV), "silu", kept, rows, h,
                                                  None)
    _, idx, cnt = nested_rows.mixed_mlp(x, *args, torch.tensor(0.02, device=DEV), "silu", lists=True)
    assert int(rows) == d_inter and float(kept) == int(cnt.sum())
    torch.testing.assert_close(y, nested_rows.mixed_mlp(x, *args, torch.tensor(0.02, device=DEV), "silu",
                                                        residual=h), atol=0, rtol=0)


def _launches(calls):
    import countdown.kernels as K

    # the decode step's two kept-rows launches (the prompt's one-pass de-quantization, int4_nested_dequant on a GPU,
    # is not a decode launch)
    decode = ("int4_nested_low_gate_up", "int4_nested_low_down")
    return K.overrides(on_launch=lambda name, *a: calls.append(name) if name in decode else None)


@pytest.mark.parametrize("spec", ["dual[mixed]", "dual[mixed,rank=error]"])
def test_the_4bit_step_takes_the_mixed_kernels(spec):
    """A model whose MLPs are nested (to_nested) and whose other Linears are 4-bit (quantize), dual[mixed] with
    calibrated cuts (ranked as the patch ranks: |act(g~) u~| or rank=error's expected refinement): the folded 4-bit
    step (fastest_step, as countdown.generate prepares it) runs each MLP on the mixed kernels, counts the refined
    rows, and decodes as the patch's own forward does within the kernels' rounding; unsparsified, the same kernels
    read the 8-bit MLP whole (every row refined)."""
    from conftest import captured_logits, tiny_model
    from test_calibrate import TOK, word_texts

    import countdown
    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import fastest_step
    from countdown.int4.nested_model import to_nested

    model = to_nested(tiny_model("llama", intermediate_size=128))
    countdown.quantize(model, group=32, lm_head=True)
    art = countdown.prepare(model, TOK, spec, [0.8], texts=word_texts(0), num_tokens=256, window=64, progress=False)
    countdown.sparsify(model, spec, 0.8, artifacts=art, path="masked")  # the patch's own forward
    model = model.to(DEV)
    prompt = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(4)).to(DEV)
    with captured_logits(model) as want:
        ref, _ = generate_fast(model, prompt, 4, compile=False)
    countdown.unsparsify(model)
    with captured_logits(model) as want8:
        ref8, _ = generate_fast(model, prompt, 4, compile=False)  # the 8-bit model's own forward
    countdown.sparsify(model, spec, 0.8, artifacts=art)
    fastest_step(model)
    n_layers = model.config.num_hidden_layers
    try:
        calls = []
        countdown.reset_sparsity_stats(model)
        with _launches(calls), captured_logits(model) as got:
            out, _ = generate_fast(model, prompt, 4, compile=False)
        assert calls == ["int4_nested_low_gate_up", "int4_nested_low_down"] * 3 * n_layers  # 3 decode steps
        assert 0.5 < countdown.sparsity_real(model)["mean"] < 0.95
        for g, w in zip(got[1:], want[1:]):
            torch.testing.assert_close(g[:, -1], w[:, -1], atol=5e-2, rtol=5e-2)
        countdown.unsparsify(model)
        fastest_step(model)
        calls.clear()
        with _launches(calls), captured_logits(model) as got8:
            out8, _ = generate_fast(model, prompt, 4, compile=False)
        assert len(calls) == 2 * 3 * n_layers
        for g, w in zip(got8[1:], want8[1:]):
            torch.testing.assert_close(g[:, -1], w[:, -1], atol=5e-2, rtol=5e-2)
    finally:
        fastest_step(model, on=False)
