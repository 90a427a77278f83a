"""Weights quantized by another tool are refused by sparsify and quantize in one line naming what was found.

torchao, bitsandbytes, AutoGPTQ and AutoAWQ are not installed here: the fakes below are named and placed (their
``__module__``) as the real classes are, and otherwise behave as float Linears / tensors, so that without the check
countdown would patch them without a word (the real ones then fail inside ``generate``)."""

import pytest
import torch
from torch import nn

import countdown
from countdown.cli import commands as cli
from countdown.model.foreign_weights import ForeignQuantizationError, find_foreign_quantization
from conftest import tiny_model
from test_calibrate import TOK

GATE = "model.layers.0.mlp.gate_proj"


class AffineQuantizedTensor(torch.Tensor):
    """torchao's tensor subclass (``torchao.quantize_(model, Int8WeightOnlyConfig())`` puts one in each weight)."""


AffineQuantizedTensor.__module__ = "torchao.dtypes.affine_quantized_tensor"


def _linear_class(name: str, module: str) -> type:
    cls = type(name, (nn.Linear,), {})
    cls.__module__ = module
    return cls


def _swap(model, name: str, cls: type):
    old = model.get_submodule(name)
    new = cls(old.in_features, old.out_features, bias=old.bias is not None)
    new.load_state_dict(old.state_dict())
    model.set_submodule(name, new)
    return model


def torchao_model():
    model = tiny_model("llama")
    linear = model.get_submodule(GATE)
    linear.weight = nn.Parameter(linear.weight.detach().as_subclass(AffineQuantizedTensor), requires_grad=False)
    assert type(linear.weight) is AffineQuantizedTensor
    return model


FOREIGN = {
    "torchao": (torchao_model, f"torchao's tensor subclass AffineQuantizedTensor as the parameter {GATE}.weight"),
    "bitsandbytes 4-bit": (lambda: _swap(tiny_model("llama"), GATE, _linear_class("Linear4bit", "bitsandbytes.nn.modules")),
                           f"bitsandbytes's Linear4bit at {GATE}"),
    "bitsandbytes 8-bit": (lambda: _swap(tiny_model("llama"), GATE, _linear_class("Linear8bitLt", "bitsandbytes.nn.modules")),
                           f"bitsandbytes's Linear8bitLt at {GATE}"),
    "GPTQ": (lambda: _swap(tiny_model("llama"), GATE,
                           _linear_class("QuantLinear", "auto_gptq.nn_modules.qlinear.qlinear_cuda_old")),
             f"AutoGPTQ's QuantLinear at {GATE}"),
    "GPTQModel": (lambda: _swap(tiny_model("llama"), GATE,
                                _linear_class("TorchQuantLinear", "gptqmodel.nn_modules.qlinear.torch")),
                  f"GPTQModel's TorchQuantLinear at {GATE}"),
    "AWQ": (lambda: _swap(tiny_model("llama"), GATE, _linear_class("WQLinear_GEMM", "awq.modules.linear.gemm")),
            f"AutoAWQ's WQLinear_GEMM at {GATE}"),
    "a vendored QuantLinear": (lambda: _swap(tiny_model("llama"), GATE, _linear_class("QuantLinear", "mytool.layers")),
                               f"a quantization tool's QuantLinear at {GATE}"),
}


@pytest.mark.parametrize("tool", list(FOREIGN))
def test_sparsify_and_quantize_refuse_foreign_weights_in_one_line(tool):
    build, found = FOREIGN[tool]
    model = build()
    assert find_foreign_quantization(model) == found
    ids = torch.tensor([[1, 5, 17, 42, 9]])
    with torch.no_grad():
        before = model(ids).logits
    for call, what in ((lambda: countdown.sparsify(model, "mono", 0.8), "countdown.sparsify"),
                       (lambda: countdown.quantize(model), "countdown.quantize")):
        with pytest.raises(ForeignQuantizationError) as error:
            call()
        message = str(error.value)
        assert message.startswith(f"{what}: this model holds weights quantized by another tool ({found})")
        assert "\n" not in message and "countdown.quantize(model)" in message
    # refused before anything changed
    assert not countdown.is_sparsified(model) and not any(type(m).__name__ == "Int4Linear" for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_the_fakes_would_pass_without_the_check(monkeypatch):
    """The refusal is the check's, not a failure of the fakes: with it off, countdown patches every one of them."""
    import countdown.patch.sparsify as sparse

    monkeypatch.setattr(sparse, "refuse_foreign_quantization", lambda model, what: None)
    for build, _ in FOREIGN.values():
        model = build()
        countdown.sparsify(model, "mono", 0.8)
        assert countdown.is_sparsified(model)
        countdown.unsparsify(model)


@pytest.mark.parametrize("config, refused", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "torchao", "quant_type": "int8_weight_only"}, "torchao"),
    ({"quant_method": "fp8", "dequantize": True}, None),  # de-quantized at load: float weights
    ({"quant_method": "gguf"}, None),  # a de-quantized GGUF file (kept blocks are GgufLinear modules)
    ({"quant_method": "countdown"}, None),  # countdown's own
])
def test_a_foreign_quantization_config_is_refused_unless_its_weights_are_float(config, refused):
    model = tiny_model("llama")
    model.config.quantization_config = config
    found = find_foreign_quantization(model)
    if refused is None:
        assert found is None
        countdown.sparsify(model, "mono", 0.8)
        countdown.unsparsify(model)
        return
    assert found == f"a transformers quantization config of method {refused!r} (model.hf_quantizer / config.quantization_config)"
    with pytest.raises(ForeignQuantizationError, match=f"method '{refused}'"):
        countdown.sparsify(model, "mono", 0.8)


def test_transformers_quantizer_object_is_read_too():
    from transformers import BitsAndBytesConfig

    class Quantizer:  # what from_pretrained(..., quantization_config=BitsAndBytesConfig(...)) attaches
        quantization_config = BitsAndBytesConfig(load_in_4bit=True)

    model = tiny_model("llama")
    model.hf_quantizer = Quantizer()
    assert "method 'bitsandbytes'" in find_foreign_quantization(model)


def test_gguf_blocks_kept_by_transformers_are_found():
    model = _swap(tiny_model("llama"), GATE, _linear_class("GgufLinear", "transformers.integrations.gguf.utils"))
    model.config.quantization_config = {"quant_method": "gguf", "dequantize": False}
    assert find_foreign_quantization(model) == f"a quantization tool's GgufLinear at {GATE}"


def test_countdowns_own_models_pass():
    model = tiny_model("llama")
    assert find_foreign_quantization(model) is None
    countdown.quantize(model)
    assert find_foreign_quantization(model) is None
    countdown.sparsify(model, "mono", 0.8)
    assert find_foreign_quantization(model) is None
    countdown.unsparsify(model)


def test_the_command_line_says_it_in_one_line(monkeypatch, capsys):
    model = torchao_model()
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, TOK))
    assert cli.main(["ppl", "--method", "mono", "-k", "0.8", "--max-tokens", "256", "--window", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("countdown ppl: error: countdown.sparsify: this model holds weights "
                                               "quantized by another tool (torchao's tensor subclass")
