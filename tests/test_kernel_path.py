"""The patched model's kernel path (Triton, interpreted on CPU here) against its masked path."""

import pytest
import torch

import countdown
from countdown import kernels
from countdown.selectors.base import RowSelector
from countdown.selectors.threshold import ThresholdSelector
from countdown.patch.state import state_of
from conftest import tiny_model

pytest.importorskip("triton")


# These tests count the kernel route's launches: on CUDA, no CUDA graph of it (whose capture launches it three times
# and whose replays not at all; tests/test_hf_generate.py checks the captured route).
DIRECT = kernels.KernelOptions(eager_graphs=False)


def _chain_rules(calls: list):
    """The spy hook recording the keep rule of each launch of the kernel that computes the kept rows' gate / up
    (mono: "abs", cats: "abs_act", a predictor's scores: "gt", a mask: "mask"): the chain's gate / up kernel, or on
    CUDA for 2-8 tokens the few-token kernel (kernels/route.py), which takes the same rules."""
    return lambda name, *a: calls.append(a[1]) if name in ("chain_gate_up", "few_tokens") else None


class FirstRowsSelector(RowSelector):
    """A stand-in predictor: keeps rows whose (fixed, random) linear score of x is positive."""

    def __init__(self, d_model, d_inter):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(d_model, d_inter), requires_grad=False)

    def forward(self, x, u, h):
        return (x.float() @ self.proj) > 0.5


def _swap_selectors(model, make):
    for layer in state_of(model).layers:
        layer.selector = make(layer.mlp)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
@pytest.mark.parametrize("kind", ["mono", "cats", "predictor"])
def test_kernel_path_matches_masked_path(arch, kind):
    calls = []
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)
    model = tiny_model(arch).to(device)
    ids = torch.randint(3, 128, (3, 1), device=device)  # three sequences, one decode-sized token each

    def make(mlp):
        if kind == "predictor":
            torch.manual_seed(1)
            return FirstRowsSelector(mlp.d_model, mlp.d_inter).to(mlp.w_up.device)
        return ThresholdSelector(countdown.get_method(kind), 0.05).to(mlp.w_up.device)

    outs = {}
    for path in ("masked", "kernel"):
        countdown.sparsify(model, kind if kind != "predictor" else "dual", 0.5, scope="all", path=path,
                           kernel_options=DIRECT)
        _swap_selectors(model, make)
        with torch.no_grad(), kernels.overrides(on_launch=_chain_rules(calls)):
            outs[path] = model(ids).logits
        countdown.unsparsify(model)
    torch.testing.assert_close(outs["kernel"], outs["masked"], rtol=1e-4, atol=1e-4)
    expected = {"mono": "abs", "cats": "abs_act", "predictor": "mask"}[kind]  # mono's, cats', the masked op's
    assert calls == [expected] * 2  # one call per layer, on the kernel path only


@pytest.mark.parametrize("method,selection", [("dual", "cut"), ("dejavu", "logit")])
def test_trained_lowrank_predictor_runs_inside_the_dual_kernel(method, selection):
    """A trained low-rank predictor (bias and cut folded into a per-row threshold on x A B) takes the
    fused dual kernel on decode steps and keeps the rows the masked path keeps."""
    from countdown import train_predictors
    from test_calibrate import TOK, word_texts

    calls = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("llama")
    art = train_predictors(model, TOK, method, 0.7, texts=word_texts(0), num_tokens=256, window=64,
                           kind="lowrank", d_rank=8, epochs=1, selection=selection, progress=False)
    model = model.to(device)
    ids = torch.randint(3, 120, (2, 1), device=device, generator=None)
    outs = {}
    for path in ("masked", "kernel"):
        countdown.sparsify(model, method, 0.7, mode="prac", artifacts=art, scope="all", path=path,
                           kernel_options=DIRECT)
        with torch.no_grad(), kernels.overrides(on_launch=_chain_rules(calls)):
            outs[path] = model(ids).logits
        countdown.unsparsify(model)
    torch.testing.assert_close(outs["kernel"], outs["masked"], rtol=1e-4, atol=1e-4)
    assert calls == ["gt"] * len(countdown.find_gated_mlps(model))  # dual's scores in the kernel, not a mask


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["mono", "cats", "dual"])
def test_one_token_decode_takes_the_one_launch_kernel(arch, kind):
    """A patched model's single-token forward (a decode step at batch 1) runs each Gated-MLP as the
    one-launch kernel (kernels/sparse_mlp/one_token.py) and gives the masked path's logits; dual with a trained
    low-rank predictor (per-row cuts)."""
    launches, gemvs = [], []

    def spy(name, *a):
        if name == "one_token":
            launches.append(a[1])  # the keep rule
        elif name == "linear":
            gemvs.append(1)

    # the one-token kernel and the indicator's GEMV on decode_step/linear.py, as on CUDA
    as_cuda = lambda: kernels.overrides(cuda_routes=("one_token", "linear"), on_launch=spy)  # noqa: E731
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(arch)
    art = None
    if kind == "dual":
        from countdown import train_predictors
        from test_calibrate import TOK, word_texts

        art = train_predictors(model, TOK, "dual", 0.7, texts=word_texts(0), num_tokens=256, window=64,
                               kind="lowrank", d_rank=8, epochs=1, progress=False)
    model = model.to(device)
    ids = torch.randint(3, 120, (1, 1), device=device)
    outs = {}
    for path in ("masked", "kernel"):
        if kind == "dual":
            countdown.sparsify(model, "dual", 0.7, mode="prac", artifacts=art, scope="all", path=path,
                               kernel_options=DIRECT)
        else:
            countdown.sparsify(model, kind, 0.5, scope="all", path=path, kernel_options=DIRECT)
            _swap_selectors(model, lambda mlp: ThresholdSelector(countdown.get_method(kind), 0.05).to(mlp.w_up.device))
        with torch.no_grad(), as_cuda():
            outs[path] = model(ids).logits
        countdown.unsparsify(model)
    torch.testing.assert_close(outs["kernel"], outs["masked"], rtol=1e-4, atol=1e-4)
    mode = {"mono": "abs", "cats": "abs_act", "dual": "gt"}[kind]
    assert launches == [mode] * len(countdown.find_gated_mlps(model))
    # the GEMVs before the kernel: the indicator where it is computed outside (not mono's u), and dual's x A
    per_mlp = int(kind != "mono") + (kind == "dual")
    assert len(gemvs) == per_mlp * len(launches)
