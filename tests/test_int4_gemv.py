"""The 4-bit GEMV (kernels/int4/gemv.py) and the 4-bit decode step (decode/int4_step.py) against float64 references,
under Triton's interpreter on CPU (on a GPU: the inline-asm dequantization at the Llama-3.1-8B shapes, and the
baseline backends against the same weights)."""

from __future__ import annotations

import pytest
import torch

from countdown.int4 import Int4Linear, quantize_rtn, stack, use_backend
import countdown.kernels as K
from countdown.kernels.config import LAUNCH
from countdown.kernels.int4 import gemv as _int4

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U = 2.0 ** -11  # fp16's unit roundoff: the dot products' lanes are fp16x2 sums of four products


def _bound(x: torch.Tensor, w) -> torch.Tensor:
    """The kernel's error bound per output (module docstring of kernels/int4/words.py): six fp16 roundings of the
    signed-nibble products' magnitudes (four in a lane, x rounded to fp16, one spare), plus float32 sums."""
    codes = torch.stack([w.qweight & 15, w.qweight >> 4], -1).reshape(w.qweight.shape[0], -1).double()
    n, k = codes.shape
    scale = w.scale.double().repeat_interleave(k // w.scale.shape[1], 1)
    terms = (scale * (codes - 8)).abs() @ x.double().abs().reshape(-1)
    full = w.dequantize(torch.float64).abs() @ x.double().abs().reshape(-1)
    return 6 * U * terms + 1e-6 * full + 1e-30


def _weight(n, k, group, scale_dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (1 + torch.rand(n, 1, generator=g))  # rows of different ranges
    w[:, : k // 3] += 0.3  # groups off centre: the asymmetric offsets matter
    return quantize_rtn(w, group, scale_dtype)


@pytest.mark.parametrize("n,k,group,max_cols,ahead", [(37, 256, 32, 4096, 1), (16, 512, 128, 256, 1),
                                                      (20, 1024, 64, 256, 1), (5, 384, 128, 128, 1),
                                                      (200, 256, 32, 4096, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_matches_float64(n, k, group, max_cols, ahead, dtype):
    """Partial sums over K's slices add up to x W~^T (W~ the format's de-quantized weight) within the bound; the
    slice count divides the groups and keeps each slice within max_cols; requests one or two blocks ahead (200 rows:
    each of the interpreter's 3 programs walks several blocks)."""
    w = _weight(n, k, group)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = _int4.launch(x.to(DEV), w.qweight.view(torch.int32).to(DEV), w.scale.to(DEV), w.offset.to(DEV), None,
                       {"MAX_COLS": max_cols, "AHEAD": ahead})
    splits = _int4.split_for(k // group, group, max_cols)
    assert out.shape == (splits, n) and out.dtype == torch.float32
    assert (k // group) % splits == 0 and k // splits <= max(max_cols, group)
    ref = x.double() @ w.dequantize(torch.float64).T
    err = (out.sum(0).double().cpu() - ref[0]).abs()
    bound = _bound(x, w)
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0 or dtype != torch.float32  # the fp16 lanes do round: the bound is what is tested


def test_gemv_takes_the_glu_input_and_float32_scales():
    """GLU input: the down projection's x is act(g) * u of the fp32 [2, K] gate/up output (SiLU and GELU-tanh), also
    given as partial sums [S, 2, K] that the kernel adds;
    float32 scales and offsets (GGUF Q4_K's) read as stored."""
    torch.manual_seed(0)
    n, k = 24, 512
    w = _weight(n, k, 64, torch.float32)
    gu = torch.randn(2, k)
    for act in ("silu", "gelu_tanh"):
        g = gu[0].double()
        a = torch.nn.functional.silu(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
        x = (a * gu[1].double()).reshape(1, -1)
        part = torch.randn(2, k)  # the same input as two partial sums (the gate/up GEMV's slices of K)
        for given in (gu, torch.stack([part, gu - part])):
            out = _int4.launch(given.to(DEV), w.qweight.view(torch.int32).to(DEV), w.scale.to(DEV),
                               w.offset.to(DEV), act)
            err = (out.sum(0).double().cpu() - (x @ w.dequantize(torch.float64).T)[0]).abs()
            assert (err <= _bound(x, w) + 1e-5 * x.abs().sum()).all()


def test_gemv_names_bad_input():
    w = _weight(8, 256, 32)
    words = w.qweight.view(torch.int32)
    with pytest.raises(ValueError, match="one token"):
        _int4.launch(torch.randn(2, 256), words, w.scale, w.offset)
    with pytest.raises(ValueError, match="gate and up"):
        _int4.launch(torch.randn(1, 256), words, w.scale, w.offset, "silu")
    assert [_int4.split_for(g, 128, 4096) for g in (32, 112, 1)] == [1, 4, 1]
    assert _int4.split_for(9, 64, 256) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_partials_rounds_once(dtype):
    """decode_add_partials: h + the sum of fp32 partials (+ bias) as float64 gives it, rounded once to h's dtype,
    within half a unit of h's dtype plus the fp32 sums' roundings."""
    from countdown.kernels.decode_step.rmsnorm import decode_add_partials

    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, 1, 3000, generator=g).to(dtype)
    parts, bias = torch.randn(3, 3000, generator=g), torch.randn(3000, generator=g).to(dtype)
    for b in (None, bias):
        want = h.double().reshape(-1) + parts.double().sum(0) + (0 if b is None else b.double())
        got = decode_add_partials(h.to(DEV), parts.to(DEV), None if b is None else b.to(DEV)).cpu()
        assert got.shape == h.shape and got.dtype == dtype
        size = h.double().abs().reshape(-1) + parts.double().abs().sum(0) + (0 if b is None else b.double().abs())
        bound = torch.finfo(dtype).eps / 2 * want.abs() + 4 * 2.0 ** -24 * size  # one rounding + the fp32 sums
        assert ((got.reshape(-1).double() - want).abs() <= bound).all()
    with pytest.raises(ValueError, match="fp32 partials"):
        decode_add_partials(h, parts.to(torch.bfloat16))


def test_norm_folded_into_the_final_gemv_and_the_add():
    """The layer's input RMSNorm folded into the q/k/v GEMV (final: bf16 out, bias) and decode_add_norm (the residual
    add of partials and the post-attention norm in one launch) against transformers' RMSNorm (rms_norm_ref) and
    float64: the normed input is the module's to one bf16 unit (the fp32 sum of squares in another order)."""
    from countdown.kernels.decode_step.reference import rms_norm_ref
    from countdown.kernels.decode_step.rmsnorm import decode_add_norm, decode_add_partials

    g = torch.Generator().manual_seed(5)
    k, n = 256, 40
    w = _weight(n, k, 32)
    h = (3 * torch.randn(1, k, generator=g)).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    x = rms_norm_ref(h, nw, 1e-5)
    out = _int4.launch(h.to(DEV), w.qweight.view(torch.int32).to(DEV), w.scale.to(DEV), w.offset.to(DEV), None,
                       final=True, bias=bias.to(DEV), norm=(nw.to(DEV), 1e-5)).cpu()
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    want = (x.double() @ w.dequantize(torch.float64).T)[0] + bias.double()
    one_unit = (w.dequantize(torch.float64).abs() @ (x.double().abs()[0] * 2.0 ** -8))  # x off by one bf16 unit
    err = (out[0].double() - want).abs()
    assert (err <= _bound(x, w) + one_unit + 2.0 ** -8 * want.abs()).all()  # + the output's own bf16 rounding
    plain = _int4.launch(x.to(DEV), w.qweight.view(torch.int32).to(DEV), w.scale.to(DEV), w.offset.to(DEV), None,
                         final=True, bias=bias.to(DEV)).cpu()  # the same GEMV on the module's normed input
    same = (out == plain).float().mean()
    assert same >= 0.9 and (out - plain).double().norm() <= 4e-3 * plain.double().norm(), same  # rare 1-unit flips
    parts = torch.randn(3, k, generator=g)
    y, xn = decode_add_norm(h.to(DEV), parts.to(DEV), None, nw.to(DEV), 1e-5)
    assert torch.equal(y.cpu(), decode_add_partials(h.to(DEV), parts.to(DEV)).cpu())
    ref = rms_norm_ref(y.cpu(), nw, 1e-5)
    assert ((xn.cpu().double() - ref.double()).abs() <= 2.0 ** -7 * ref.double().abs()).all()
    with pytest.raises(ValueError, match="folded norm"):
        _int4.launch(h, w.qweight.view(torch.int32), w.scale, w.offset, None, norm=(nw, 1e-5))


def test_stack_views_the_parts():
    """stack: one module whose rows are the parts' rows; the parts then view its buffers (no memory added) and
    compute as before."""
    parts = [Int4Linear.from_weight(_weight(n, 64, 32, seed=n)) for n in (8, 4, 4)]
    x = torch.randn(3, 64)
    before = [p(x) for p in parts]
    whole = stack(parts)
    assert whole.out_features == 16 and whole.stacked_from == tuple(parts)
    torch.testing.assert_close(whole(x), torch.cat(before, -1), rtol=0, atol=0)
    for p, b in zip(parts, before):
        assert p.qweight.untyped_storage().data_ptr() == whole.qweight.untyped_storage().data_ptr()
        torch.testing.assert_close(p(x), b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one input size"):
        stack([parts[0], Int4Linear.from_weight(_weight(4, 128, 32))])


def test_4bit_model_decodes_through_the_gemvs():
    """fastest_step on a 4-bit model: q/k/v and gate/up stacked, every one-token Linear on the 4-bit GEMV
    (attention fused, down reading act(g) * u from the gate/up GEMV, each layer folded: norms and residual adds on
    our kernels, the adds summing the GEMVs' partials), the same greedy tokens as the reference
    (de-quantize + F.linear) with each step's logits within the kernels' rounding; an MLP and the head compile
    whole; the prompt's layers and batch 2 keep the reference; on=False restores the modules; backend "reference" bypasses it."""
    from conftest import captured_logits, tiny_model

    import countdown
    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import fastest_step

    model = countdown.quantize(tiny_model("llama", intermediate_size=128), group=32, lm_head=True).to(DEV)
    prompt = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEV)
    use_backend(model, "reference")
    with captured_logits(model) as ref_steps:
        ref, _ = generate_fast(model, prompt[:1], 3, compile=False)
    ref2, _ = generate_fast(model, prompt, 3, compile=False)
    use_backend(model, "countdown")  # the default
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    # every launch of the 4-bit GEMV, by its weight's rows
    with K.overrides(on_launch=lambda name, *a: calls.append(a[1].shape[0]) if name == "int4_gemv" else None):
        assert fastest_step(model) == []
        from countdown.decode.layer import is_folded

        assert all(is_folded(layer) for layer in model.model.layers)  # norms and adds on our kernels, partials summed
        with captured_logits(model) as steps:
            out, _ = generate_fast(model, prompt[:1], 3, compile=False)
        assert torch.equal(out, ref)
        for got, want in zip(steps, ref_steps):
            torch.testing.assert_close(got[:, -1], want[:, -1], atol=2e-3, rtol=2e-3)
        h, kv, inter, vocab = 64, 2 * 2 * 16, 128, 128
        per_step = [h + kv, h, 2 * inter, h] * model.config.num_hidden_layers + [vocab]
        # the prompt's head (its last position only: one token), then two decode steps: qkv, o, gate/up, down per
        # layer and the head; the prompt's layers (9 tokens) keep the reference
        assert calls == [vocab] + per_step * 2
        calls.clear()
        out2, _ = generate_fast(model, prompt, 3, compile=False)
        assert torch.equal(out2, ref2) and calls == []  # batch 2: the reference
        mlp, head = model.model.layers[0].mlp, model.lm_head  # compiled whole (fullgraph): the op's fake shape holds
        x = torch.randn(1, 1, 64, device=DEV)
        for module in (mlp, head):
            torch._dynamo.reset()
            compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
            torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)
            x = torch.randn(1, 1, 64, device=DEV)
        use_backend(model, "reference")
        calls.clear()
        generate_fast(model, prompt[:1], 3, compile=False)
        assert calls == []
    use_backend(model, "countdown")
    assert fastest_step(model, on=False) == []
    assert not any(is_folded(layer) for layer in model.model.layers)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.qweight.untyped_storage().data_ptr() != attn.q_proj.qweight.untyped_storage().data_ptr()
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="backend must be one of"):
        use_backend(model, "marlin")


def test_shape_launch_overrides_name_unknown_keys():
    """A shape's launch configuration changed through the overrides (the benchmark's --gemv-config) merges into the
    shape's entry of the launch table and names a key it does not know, with the ones it does, before changing
    anything."""
    assert _int4.config_for(64, 32) == LAUNCH["int4_gemv"]["default"]
    with K.overrides(launch={("int4_gemv", (64, 32)): {"R": 4}}):
        with K.overrides(launch={("int4_gemv", (64, 32)): {"R": 4, "MAX_COLS": 32}}):
            assert _int4.config_for(64, 32) == {**LAUNCH["int4_gemv"]["default"], "R": 4, "MAX_COLS": 32}
            assert _int4.splits(64, 32, 16) == 1 and _int4.splits(64, 64, 16) == 1
            with K.overrides(launch={("int4_gemv", (64, 64)): {"MAX_COLS": 32}}):
                assert _int4.splits(64, 64, 16) == 2
        with pytest.raises(ValueError, match=r"unknown launch configuration keys \['PERSM'\] for 'int4_gemv'; give"):
            with K.overrides(launch={("int4_gemv", (64, 32)): {"PERSM": 2}}):
                pass
        assert _int4.config_for(64, 32) == {**LAUNCH["int4_gemv"]["default"], "R": 4}
    assert _int4.config_for(64, 32) == LAUNCH["int4_gemv"]["default"]


def test_traced_gemv_holds_its_slice_count():
    """The slices of K are an argument of the op, read from the shape's configuration when the call is traced: the
    graph traced under one configuration differs in its code from the graph under another (torch.compile's on-disk
    cache keys on that code, not on the launch table: a graph of 4 slices reused after --gemv-config made it 1
    failed the output's shape check once), and each output has the fake's shape."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from countdown.int4.backends import gemv_partials

    w = _weight(24, 256, 32)
    module = Int4Linear.from_weight(w).to(DEV)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).to(DEV)
    codes = []
    for max_cols in (64, 256):
        with K.overrides(launch={("int4_gemv", (24, 256)): {"MAX_COLS": max_cols}}):
            graph = make_fx(lambda x: gemv_partials(x, module), tracing_mode="fake", _allow_non_fake_inputs=True)(x)
            codes.append(graph.code)
            out = gemv_partials(x, module)
        assert out.shape == (256 // max_cols, 24)
        fake = [n.meta["val"].shape for n in graph.graph.nodes if n.op == "call_function"]
        assert tuple(fake[-1]) == tuple(out.shape)
        err = (out.sum(0).double().cpu() - (x.double().cpu() @ w.dequantize(torch.float64).T)[0]).abs()
        assert (err <= _bound(x.cpu(), w)).all()
    assert codes[0] != codes[1] and "64" in codes[0] and "256" in codes[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the inline-asm path and the baselines need a GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_gemv_and_baselines_at_the_8b_shapes(n, k):
    """On the GPU: the asm dequantization within the bound at the Llama-3.1-8B shapes; torch's int4 (tinygemm) and
    gemlite (where installed) compute the same weights (their scales rounded to bf16: checked as a relative RMS error
    at bf16's precision, where a wrong layout or nibble order gives about 1)."""
    w = _weight(n, k, 128)
    lin = Int4Linear.from_weight(w, dtype=torch.bfloat16).cuda()
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = (x.double() @ w.dequantize(torch.float64).T)[0]
    out = _int4.launch(x.cuda(), lin.qweight.view(torch.int32), lin.scale, lin.offset)
    assert ((out.sum(0).double().cpu() - ref).abs() <= _bound(x, w)).all()
    backends = ["countdown", "torch"]
    try:
        import gemlite  # noqa: F401
        backends.append("gemlite")
    except ImportError:
        pass
    for backend in backends:
        lin.backend = backend
        y = lin(x.cuda()).double().cpu()[0]
        # bf16 output and (baselines) bf16 scales: about 2**-8 relative (gemlite's A16W4 sums in fp16/bf16 too:
        # a few 1e-3 at K = 14336); a wrong layout or nibble order: about 1
        assert (y - ref).norm() / ref.norm() < 3e-2, (backend, float((y - ref).norm() / ref.norm()))
