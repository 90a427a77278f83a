"""kernels/route.py's table, kernels/config.py's launch tables and overrides, and docs/kernels.md kept true to them.

No kernel runs here: the route a public op takes is what route() answers (the ops' own tests run the kernels)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import countdown.kernels as K
from countdown.kernels import config
from countdown.kernels.route import FEW_TOKENS, ROUTES, route

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "src" / "countdown" / "kernels"
DOC = (ROOT / "docs" / "kernels.md").read_text()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def test_the_doc_names_exactly_the_kernel_files():
    files = {str(p.relative_to(KERNELS)) for p in KERNELS.rglob("*.py") if p.name != "__init__.py"}
    table = DOC.split("## Files, by op family")[1].split("\n## ")[0]
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", table, flags=re.M))
    assert named == files, (sorted(files - named), sorted(named - files))


def test_the_doc_shows_the_route_table():
    table = DOC.split("## Which kernel runs")[1].split("\n## ")[0]
    rows = re.findall(r"^\| (\w+) \| (cuda|interpreter) \| (\S+) \| (\S+) \| (\S+) \|$", table, flags=re.M)
    shown = {(kind, dev): tuple(None if c == "-" else c for c in cols) for kind, dev, *cols in rows}
    assert shown == ROUTES


@pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(), reason="the CPU interpreter's routes")
def test_routes_by_token_count_and_the_overrides():
    x = {n: torch.zeros(n, 8) for n in (1, 2, FEW_TOKENS, FEW_TOKENS + 1)}
    assert [route("mono", x[n]) for n in x] == ["chain"] * 4  # the interpreter's column
    assert [route("shadow", x[n]) for n in x] == ["select", "select", "select", "scores_chain"]
    with K.overrides(cuda_routes=True):  # the CUDA column on the interpreter
        assert [route("mono", x[n]) for n in x] == ["one_token", "few_tokens", "few_tokens", "chain"]
        assert route("mono", x[2], per_token=True) == "chain"  # each token its own rows: not the union's kernel
        with K.overrides(off=("one_token",)):  # a kernel switched off: its bucket's interpreter route
            assert route("mono", x[1]) == "chain" and route("shadow", x[1]) == "select"
            assert route("threshold_block", x[1]) is None
    with K.overrides(cuda_routes=("few_tokens",)):  # only the named kernels take their CUDA route
        assert route("mono", x[1]) == "chain" and route("mono", x[2]) == "few_tokens"
    with K.overrides(routes={("lowrank", "interpreter"): ("masked",) * 3}):
        assert route("lowrank", x[1]) == "masked" and route("mono", x[1]) == "chain"
    assert route("lowrank", x[1]) == "dual"  # back outside the block
    with K.overrides(triton=False):
        assert not K.available(x[1]) and route("mono", x[1]) == "reference"
    assert route("linear", torch.zeros(1, 1, 8)) == "linear" and route("linear", torch.zeros(0, 8)) == "torch"
    # float64 (a model moved to it): the references, on CUDA too (the kernels compute in fp32 at most)
    with K.overrides(cuda_routes=True):
        assert route("linear", torch.zeros(1, 1, 8, dtype=torch.float64)) == "reference"
        assert route("mono", torch.zeros(1, 1, 8, dtype=torch.float64)) == "reference"


def test_launch_configurations_and_their_overrides():
    base = config.launch_config("one_token", bucket="abs")
    assert base == config.LAUNCH["one_token"]["abs"] and base is not config.LAUNCH["one_token"]["abs"]
    assert config.launch_config("one_token", "cpu", "abs")["PROGRAMS"] == 3  # the interpreter's programs
    assert config.launch_config("int4_gemv", bucket=(1, 1)) == config.LAUNCH["int4_gemv"]["default"]
    assert config.launch_config("int4_gemv", bucket=(4096, 4096))["R"] == 16  # the shape's entry over the default
    with K.overrides(launch={"one_token": dict(CHUNK=16), ("one_token", "gt"): dict(BLOCK_M=8)}):
        assert config.launch_config("one_token", bucket="abs")["CHUNK"] == 16
        assert config.launch_config("one_token", bucket="gt")["BLOCK_M"] == 8
        assert config.launch_config("one_token", bucket="abs")["BLOCK_M"] == base["BLOCK_M"]
        assert config.launch_config("one_token", bucket="abs", extra=dict(CHUNK=32))["CHUNK"] == 32
    assert config.launch_config("one_token", bucket="abs") == base
    with pytest.raises(ValueError, match=r"unknown launch configuration keys \['CHUNKS'\] for 'one_token'"):
        with K.overrides(launch={"one_token": dict(CHUNKS=16)}):
            pass
    with pytest.raises(ValueError, match="unknown kernel op 'onepass'"):
        with K.overrides(launch={"onepass": {}}):
            pass
    with pytest.raises(TypeError, match="overrides takes no ONEPASS"):
        with K.overrides(ONEPASS=False):
            pass
    assert config.active() == config.Overrides()  # nothing left behind by the failures


def test_the_spy_hook_sees_every_launch_and_only_inside_its_block():
    seen = []
    with K.overrides(on_launch=lambda name, *a: seen.append(name)):
        config.launching("one_token", 1, 2)
        with K.overrides(poison_outputs=True):  # nested: the outer block's hook still set
            config.launching("partial_sums")
    config.launching("chain_down")
    assert seen == ["one_token", "partial_sums"]


def test_kernel_options_are_a_frozen_documented_object():
    opts = K.KernelOptions()
    assert opts.eager_graphs is True and "eager_graphs" in K.KernelOptions.__doc__
    with pytest.raises(Exception):
        opts.eager_graphs = False


def test_the_package_imports_without_triton():
    """A base install has no Triton: importing countdown.kernels (and countdown) must not import it, and every
    op then routes to its reference."""
    code = ("import sys\n"
            "sys.modules['triton'] = None  # import triton fails, importlib.util.find_spec('triton') is None\n"
            "import torch, countdown, countdown.kernels as K\n"
            "from countdown.kernels.route import route\n"
            "assert sys.modules['triton'] is None\n"
            "x = torch.randn(2, 8); w = torch.randn(5, 8)\n"
            "assert route('mono', x) == 'reference'\n"
            "torch.testing.assert_close(K.mono_gated_mlp(x, w, w, w, 0.1), K.mono_gated_mlp_ref(x, w, w, w, 0.1))\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_attention_function_sends_float64_to_sdpa():
    """transformers' attention function of ours (decode/hf_attention.py): a one-token float64 decode (a model moved
    to float64) runs PyTorch's SDPA, not the decode kernel (which computes in fp32 at most and does not compile for
    float64 on a GPU); in float32 it runs the kernel. Both equal SDPA in float64 to the kernel's rounding."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from countdown.decode.hf_attention import decode_attention_forward

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, n, 16, generator=g, dtype=torch.float64).to(dev) for n in (1, 7, 7))
    mask = torch.ones(1, 1, 1, 7, dtype=torch.bool, device=dev)
    want = sdpa(q, k, v).transpose(1, 2)
    for dtype, launches in ((torch.float64, []), (torch.float32, ["attention"])):
        calls = []
        with K.overrides(on_launch=lambda name, *a: calls.append(name)):
            out, _ = decode_attention_forward(None, q.to(dtype), k.to(dtype), v.to(dtype), mask)
        assert calls == launches and out.dtype == dtype
        torch.testing.assert_close(out.double(), want, atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=1e-5)
