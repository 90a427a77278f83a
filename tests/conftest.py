"""Tiny randomly initialised models of every supported architecture, built offline."""

import contextlib
import os
import sys
from pathlib import Path

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. Triton reads this
# when a kernel module is first imported, so it is set before any test imports one.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

# The measurement harness (benchmarks/harness) is imported as ``harness`` by its tests (tests/harness/), as
# benchmarks/*.py import it (their folder is on sys.path when they run). Only the package itself is registered: putting
# benchmarks/ on sys.path would expose every script as a top-level module, and transformers probes optional packages
# by importing their names (a script named like one would be taken for it).
def _register_harness() -> None:
    import importlib.util

    init = Path(__file__).resolve().parent.parent / "benchmarks" / "harness" / "__init__.py"
    spec = importlib.util.spec_from_file_location("harness", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["harness"] = module
    spec.loader.exec_module(module)


_register_harness()

# Under pytest-xdist (`make test` runs two workers on CI's two cores) each worker keeps to one thread: the
# interpreter's kernels are single-threaded Python, and two workers of two torch threads each would fight over
# two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
import transformers
from transformers import AutoModelForCausalLM


def _list_the_interpreters_builtins_once():
    """Speed only, under the interpreter: Triton's interpreter patches triton.language around every launch and
    every call of a @triton.jit helper, each time listing all the members of tl, tl.core, tl.tensor, tl.math
    and tl.core.tensor_descriptor_base (inspect.getmembers) to find the builtins it replaces: about a fifth of
    the interpreter's time in the decode tests. Those names do not change, so they are listed here once, before
    any launch (nothing is patched yet); each patch still takes only a member that is a builtin at the time, as
    Triton's own function does. Nothing changes where the interpreter is off or its function is not the one
    replaced (another Triton: the suite is slower, not different)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    own = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(getattr(tl, "core", None), "is_builtin", None)
    if own is None or patch_attr is None or is_builtin is None or \
            list(inspect.signature(own).parameters) != ["pkg", "builder", "scope"]:
        return
    packages = [tl, tl.core, tl.tensor, tl.core.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)]
    names = {id(pkg): (pkg, [name for name, member in inspect.getmembers(pkg) if is_builtin(member)])
             for pkg in packages if pkg is not None}

    def _patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None or listed[0] is not pkg:  # a package not listed above: Triton's own way
            return own(pkg, builder, scope)
        for name in listed[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin


_list_the_interpreters_builtins_once()

# d_inter = 97 is odd and prime on purpose: no method may assume divisibility.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=97, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(cls, **fixed):
    """The tiny configuration of ``cls``; keyword arguments override its entries."""
    return lambda **changes: cls(**{**_COMMON, **fixed, **changes})


TINY_CONFIGS = {
    "llama": _config(transformers.LlamaConfig),
    "mistral": _config(transformers.MistralConfig),
    "qwen2": _config(transformers.Qwen2Config),
    "qwen3": _config(transformers.Qwen3Config, head_dim=16),
    "gemma2": _config(transformers.Gemma2Config, head_dim=16),
    "gemma3": _config(transformers.Gemma3TextConfig, head_dim=16),
    "phi3": _config(transformers.Phi3Config),
}

ARCHS = list(TINY_CONFIGS)


def tiny_model(arch: str, dtype=torch.float32, seed: int = 0, **changes):
    """``changes`` override the tiny configuration's entries (e.g. a smaller ``intermediate_size`` for a decode
    test whose kernels run in the interpreter, where the shape is not what the test is about)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](**changes))
    # Random init leaves some norms at exactly 1 and biases at 0: perturb every parameter so that
    # gate and up, and every layer, differ and no computation is accidentally trivial.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.to(dtype).eval()


@contextlib.contextmanager
def captured_logits(model):
    """The logits of every forward of ``model`` inside the block, as float32 CPU tensors: for an eager decode,
    the prompt's and then one per step. (Not around a compiled decode: Dynamo traces the hook and guards on the
    length of the list, so each step would compile again.)

    A decode's greedy tokens alone say little in a tiny random model (the default tiny Llama, its MLPs' outputs
    zeroed, gave the same 6 greedy tokens after a 9-token prompt); the logits of each step tell a 1 % error in
    an MLP's output."""
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(out.detach().float().cpu()))
    try:
        yield seen
    finally:
        hook.remove()


def assert_same_logits(got, want, atol=1e-4, rtol=1e-4):
    """A decode's logits (``captured_logits``) as the reference decode's ``want``, step by step (each forward's
    last position: the one the next token comes from), within float32 rounding."""
    assert len(got) == len(want) > 1, (len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g[:, -1], w[:, -1], atol=atol, rtol=rtol, msg=lambda m: f"step {step}: {m}")


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


_BF16_FLASH_ATTENTION_WORKS = None


@pytest.fixture
def working_bf16_attention():
    """The test runs with SDPA's math backend where, and only where, PyTorch's CPU flash attention fails in
    bfloat16. From 64 tokens on that kernel packs its operands (pack_vnni2) whenever oneDNN offers AVX-512 BF16 or
    AMX, but the packing is compiled into ATen's AVX-512 kernels only: on such a CPU under
    ATEN_CPU_CAPABILITY=default or avx2 (oneDNN not held to AVX2) every call raises "pack_vnni2 is only supported
    when avx512 is supported". A real AVX2 machine has no AMX for oneDNN either; elsewhere nothing changes."""
    global _BF16_FLASH_ATTENTION_WORKS
    if _BF16_FLASH_ATTENTION_WORKS is None:
        q = torch.zeros(1, 1, 64, 16, dtype=torch.bfloat16)
        try:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            _BF16_FLASH_ATTENTION_WORKS = True
        except RuntimeError as error:
            if "pack_vnni2" not in str(error):
                raise
            _BF16_FLASH_ATTENTION_WORKS = False
    if _BF16_FLASH_ATTENTION_WORKS:
        yield
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            yield
