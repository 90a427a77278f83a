"""Sparsity-Real on the kernel route: the kernels count the rows they keep, as the gather path counts its mask.

Each method's SP-Prac artifact is built on a tiny model; the same decode-sized batch then runs through
``path="gather"`` and ``path="kernel"`` (Triton's interpreter on the CPU) and every layer's counters must
agree: the row methods exactly (both count integers, and both compare the same float32 indicator with the cut,
or one summed in another order, which could flip a row only within a few ulps of the cut: none of these
seeded inputs is), teal to 1e-12 (its kept share of the weights, ``(2 n_x / d_model + n_s / d_inter) / 3``, is
summed in another order of float64 additions). On CUDA the one-token routes compute some indicators in the
kernel (mono's u, the 4-bit shadows' scores from x rounded to int8), which may flip a row at the cut: there
the counts may differ by a few rows.
"""

import contextlib

import pytest
import torch

import countdown
from countdown import kernels
from countdown.kernels import common
from countdown.patch.patched_mlp import PatchedMLP
from countdown.patch.state import state_of
from conftest import tiny_model
from test_calibrate import TOK, word_texts

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)
K = 0.6
KW = dict(texts=word_texts(0), num_tokens=256, window=64, refine=False, progress=False)

# method spec -> (method, how its artifact is built)
BUILD = {
    "mono": ("mono", lambda m: countdown.calibrate(m, TOK, "mono", K, **KW)),
    "cats": ("cats", lambda m: countdown.calibrate(m, TOK, "cats", K, **KW)),
    "dual[shadow4]": ("dual", lambda m: countdown.train_predictors(m, TOK, "dual", K, kind="shadow", group=32, **KW)),
    "dual[lowrank]": ("dual", lambda m: countdown.train_predictors(m, TOK, "dual", K, kind="lowrank", d_rank=8,
                                                                   epochs=1, **KW)),
    "dejavu": ("dejavu", lambda m: countdown.train_predictors(m, TOK, "dejavu", K, kind="lowrank", d_rank=8,
                                                              epochs=1, selection="logit", **KW)),
    "dual[hybrid]": ("dual", lambda m: countdown.train_predictors(m, TOK, "dual", K, kind="hybrid", d_rank=8, **KW)),
    "dual[ternary]": ("dual", lambda m: countdown.train_predictors(m, TOK, "dual", K, kind="ternary", epochs=1,
                                                                   **KW)),
    "teal": ("teal", lambda m: countdown.calibrate(m, TOK, "teal", K, **KW)),
}
# the kernel deciding the rows (its launcher's name in the spy hook), per method, on the CPU's routes
CPU_KERNEL = {"dual[shadow4]": "select", "dual[hybrid]": "select", "teal": "teal"}
ONE_LAUNCH = ("mono", "cats", "dual[lowrank]", "dejavu")  # what sparse_mlp/one_token.py and few_tokens.py serve
DIRECT = kernels.KernelOptions(eager_graphs=False)  # the kernel route called directly, not from a CUDA graph


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").to(DEVICE)


@pytest.fixture(scope="module")
def artifacts(model):
    cache = {}

    def get(spec):
        if spec not in cache:
            cache[spec] = BUILD[spec][1](model)
        return cache[spec]
    return get


@contextlib.contextmanager
def _spy(kernel: str, **routes):
    """Record the launches of ``kernel`` (the launch that decides the rows: the overrides' spy hook), with the
    overrides ``routes`` (e.g. cuda_routes) in force."""
    calls = []
    with kernels.overrides(on_launch=lambda name, *a: calls.append(1) if name == kernel else None, **routes):
        yield calls


def _counts(model, spec, art, path, run, options=DIRECT):
    """Every layer's (kept_total, rows_total) after ``run(model)`` on ``path`` (the kernel route called directly:
    its CUDA graph is tested in test_captured_route_counts_each_token_once)."""
    countdown.sparsify(model, BUILD[spec][0], K, mode="prac", artifacts=art, scope="all", path=path,
                       kernel_options=options)
    try:
        with torch.no_grad():
            run(model)
        return [(float(layer.kept_total), int(layer.rows_total)) for layer in state_of(model).layers]
    finally:
        countdown.unsparsify(model)


def _assert_same_counts(kernel, gather, spec, rows_apart=0):
    for (kept_k, rows_k), (kept_g, rows_g) in zip(kernel, gather, strict=True):
        assert rows_k == rows_g > 0
        real = 1 - kept_k / rows_k
        assert 0 < real < 1  # something kept, something skipped: a count that is there
        if spec == "teal":
            assert kept_k == pytest.approx(kept_g, rel=1e-12, abs=1e-12)
        else:
            assert abs(kept_k - kept_g) <= rows_apart


CASES = ([(spec, "default", n) for spec in BUILD for n in (1, 3)]
         + [(spec, "one-launch", 1) for spec in ONE_LAUNCH] + [(spec, "few", 3) for spec in ONE_LAUNCH])


@pytest.mark.parametrize("spec,route,n_tok", CASES)
def test_kernel_route_counts_what_the_gather_path_counts(model, artifacts, spec, route, n_tok):
    """Per method and route, a forward on the kernel route leaves every layer the gather path's counters."""
    art = artifacts(spec)
    if route == "one-launch":  # the whole MLP in one launch (one_token.py), as one token on CUDA
        expected, routes = "one_token", dict(cuda_routes=("one_token",))
    elif route == "few":  # 2-8 tokens in one launch (few_tokens.py), as on CUDA
        expected, routes = "few_tokens", dict(cuda_routes=("few_tokens",))
    else:  # the interpreter's default: the chain's gate / up kernel unless the method has its own
        expected, routes = CPU_KERNEL.get(spec, "chain_gate_up"), {}
    ids = torch.randint(3, 128, (n_tok, 1), generator=torch.Generator().manual_seed(n_tok)).to(DEVICE)
    gather = _counts(model, spec, art, "gather", lambda m: m(ids))
    with _spy(expected, **routes) as calls:
        kernel = _counts(model, spec, art, "kernel", lambda m: m(ids))
    if DEVICE == "cpu":
        assert len(calls) == len(gather)  # one launch a layer: the route asked for
    apart = 0 if DEVICE == "cpu" else (3 if spec == "dual[shadow4]" else 1)
    _assert_same_counts(kernel, gather, spec, apart)


@pytest.mark.parametrize("spec", ["mono", "cats", "dual[lowrank]", "dual[shadow4]"])
def test_block_route_counts_what_the_gather_path_counts(model, artifacts, spec):
    """A folded decode layer's MLP half (norm, sparse MLP and residual add in the route's kernels) counts the rows
    the gather path keeps for RMSNorm(h): mono's block kernel (the norm inside the one-launch kernel), dual's
    (the norm folded into the predictor's GEMV), and the routes after the norm kernel (cats; the shadows: on the
    CPU their selecting kernel with float32 scores, on CUDA the one-launch kernel)."""
    shadow = spec == "dual[shadow4]"
    # the one-token kernel as on CUDA (not for the shadows: their selecting kernel on the CPU), dual_block's GEMVs
    routes = dict(cuda_routes=("linear",) if shadow else ("linear", "one_token"))
    art = artifacts(spec)
    norms = [layer.post_attention_layernorm for layer in model.model.layers]
    h = torch.randn(len(norms), 1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def gather(m):
        for layer, norm, hi in zip(state_of(m).layers, norms, h):
            layer.mlp.module(kernels.block_input(hi.reshape(1, -1), norm.weight, norm.variance_epsilon)[None])

    def block(m):
        for layer, norm, hi in zip(state_of(m).layers, norms, h):
            assert layer.block_forward(hi, norm.weight, norm.variance_epsilon) is not None

    expected = gather_counts = _counts(model, spec, art, "gather", gather)
    with _spy("select" if shadow and DEVICE == "cpu" else "one_token", **routes) as calls:
        got = _counts(model, spec, art, "kernel", block)
    assert len(calls) == len(norms)
    _assert_same_counts(got, expected, spec, 0 if DEVICE == "cpu" else 3)  # CUDA: shadows' int8 scores
    assert gather_counts[0][1] == model.config.intermediate_size  # one token a layer


@pytest.mark.parametrize("route,n_tok", [("default", 2), ("one-launch", 1), ("few", 2), ("block", 1)])
def test_counts_survive_torch_compile_and_add_up(model, artifacts, route, n_tok):
    """The ops declare the counters mutated: a full-graph compile keeps the in-kernel additions (the one-launch,
    few-token and folded-layer block ops among them), and every call adds (no reset, no host read)."""
    as_cuda = ("one_token",) if route in ("one-launch", "block") else ("few_tokens",) if route == "few" else ()
    countdown.sparsify(model, "mono", K, mode="prac", artifacts=artifacts("mono"), scope="all", path="kernel",
                       kernel_options=DIRECT)
    try:
        layer = state_of(model).layers[0]
        x = torch.randn(n_tok, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        if route == "block":
            norm = model.model.layers[0].post_attention_layernorm
            fn = lambda v: layer.block_forward(v, norm.weight, norm.variance_epsilon)  # noqa: E731
            with kernels.overrides(cuda_routes=as_cuda):
                assert fn(x) is not None
        else:
            fn = layer.mlp.module
        with kernels.overrides(cuda_routes=as_cuda):
            once = _counts_of_calls(layer, lambda: fn(x))
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
            twice = _counts_of_calls(layer, lambda: (compiled(x), compiled(x)))
    finally:
        countdown.unsparsify(model)
    assert twice == (2 * once[0], 2 * once[1]) and 0 < once[0] < once[1] == n_tok * model.config.intermediate_size


def _counts_of_calls(layer, fn):
    layer.reset_stats()
    with torch.no_grad():
        fn()
    return float(layer.kept_total), int(layer.rows_total)


def test_ops_count_each_token_own_rows_and_refuse_bad_counters():
    """At the op: kept = each token's own kept rows (not the batch's union), rows = tokens x d_inter."""
    x, *w = _op_inputs(2, 3)[:4]
    count = (torch.zeros(1, dtype=torch.float64, device=DEVICE), torch.zeros((), dtype=torch.int64, device=DEVICE))
    kernels.mono_gated_mlp(x, *w, 0.5, count=count)
    keep = kernels.mono_keep(x, w[1], 0.5)
    assert keep.any(0).sum() < keep.sum() < 3 * 97  # rows several tokens keep: the union would count fewer
    assert (float(count[0]), int(count[1])) == (float(keep.sum()), 3 * 97)
    with pytest.raises(ValueError, match="count must be"):
        kernels.mono_gated_mlp(x, *w, 0.5, count=(count[0].float(), count[1]))


def test_shadow_one_launch_counts_the_rows_its_int8_scores_keep(model, artifacts):
    """One token on CUDA: the shadows' scores come from x rounded to int8 (kernels/shadow/gemv.py), then the
    one-launch kernel keeps the rows over the cut; it counts exactly those."""
    from countdown.selectors.base import selectors_for

    mlps = countdown.find_gated_mlps(model)
    mlp, sel = mlps[0], selectors_for(artifacts("dual[shadow4]"), mlps, "dual", K)[0]
    x = torch.randn(1, mlp.d_model, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    prepared = sel._prepare()
    count = (torch.zeros(1, dtype=torch.float64, device=DEVICE), torch.zeros((), dtype=torch.int64, device=DEVICE))
    with _spy("one_token", cuda_routes=("one_token",)) as calls:  # the one-token kernel as on CUDA
        kernels.shadow_dual_gated_mlp(x, prepared, sel.cut, mlp.w_gate, mlp.w_up, mlp.w_down.t().contiguous(),
                                      mlp.act_name, count=count)
    ind = torch.ops.countdown.shadow_gemv_i8(x, prepared["q"], prepared["scale"], mlp.act_name, True)
    assert calls == [1]
    assert (float(count[0]), int(count[1])) == (float((ind > sel.cut).sum()), mlp.d_inter)
    assert 0 < float(count[0]) < mlp.d_inter


@pytest.mark.skipif(DEVICE != "cuda", reason="the eager kernel route replays a CUDA graph only on CUDA")
def test_captured_route_counts_each_token_once(model, artifacts):
    """transformers' own generate on CUDA: the route is captured on its first call (two warm-up runs, then the
    capture) and replayed; the warm-ups are not counted, each forward counts once."""
    graphs = kernels.KernelOptions(eager_graphs=True)
    ids = torch.randint(3, 128, (1, 1), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for spec in ("mono", "dual[shadow4]", "teal"):
        art = artifacts(spec)
        gather = _counts(model, spec, art, "gather", lambda m: [m(ids) for _ in range(3)], graphs)
        kernel = _counts(model, spec, art, "kernel", lambda m: [m(ids) for _ in range(3)], graphs)
        _assert_same_counts(kernel, gather, spec, 3 if spec == "dual[shadow4]" else 1)


def test_counters_check_dtype_and_device():
    kept, rows = torch.zeros(1, dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    assert common.counters(None, "cpu") == (None, None)
    assert common.counters((kept, rows), "cpu") == (kept, rows)
    for bad in ((kept.float(), rows), (kept, rows.int()), (torch.zeros(2, dtype=torch.float64), rows)):
        with pytest.raises(ValueError, match="count must be"):
            common.counters(bad, "cpu")
    assert PatchedMLP.counters.__doc__


def test_reference_paths_count_as_the_kernels_do():
    """Where the kernels cannot run (no Triton) each public op counts its PyTorch reference's mask, as its kernels
    count theirs (the shadows' non-GPU widths take that path on the kernel route too)."""
    from countdown.kernels.shadow import format as quant

    x, wg, wu, wd, pa, pb, keep = _op_inputs(0, 3)
    (qg, sg), (qu, su) = quant.quantize_rtn(wg, 4, 32), quant.quantize_rtn(wu, 4, 32)
    prepared = kernels.prepare_shadow(qg, sg, qu, su, 4)
    ops = {
        "mono": lambda c: kernels.mono_gated_mlp(x, wg, wu, wd, 0.5, count=c),
        "cats": lambda c: kernels.cats_gated_mlp(x, wg, wu, wd, 0.2, count=c),
        "dual": lambda c: kernels.dual_gated_mlp(x, wg, wu, wd, pa, pb, 0.1, count=c),
        "masked": lambda c: kernels.masked_gated_mlp(x, wg, wu, wd, keep, count=c),
        "hybrid": lambda c: kernels.hybrid_gated_mlp(x, x @ wu.t(), x @ pa, pb.t().contiguous(), None, 0.1, wg, wd,
                                                     count=c),
        "shadow": lambda c: kernels.shadow_dual_gated_mlp(x, prepared, 0.1, wg, wu, wd, count=c),
        "teal": lambda c: kernels.teal_gated_mlp(x, wg.t(), wu.t(), wd, 0.5, 0.05, count=c),
    }

    def counted(op):
        c = (torch.zeros(1, dtype=torch.float64, device=DEVICE), torch.zeros((), dtype=torch.int64, device=DEVICE))
        op(c)
        return float(c[0]), int(c[1])

    with_kernels = {name: counted(op) for name, op in ops.items()}
    for name, op in ops.items():
        with kernels.overrides(triton=False):  # as if Triton were not installed
            kept, rows = counted(op)
        kept_k, rows_k = with_kernels[name]
        assert rows == rows_k == (3 if name == "teal" else 3 * 97)
        assert 0 < kept < rows and kept == pytest.approx(kept_k, rel=1e-12)


def test_ops_declare_the_counters_they_add_to():
    """Every op whose kernel counts declares ``kept`` and ``rows`` mutated (torch.library.opcheck's schema test
    fails on an undeclared mutation; torch.compile would be free to drop or reorder it), and its fake gives the
    real output's shape."""
    from countdown.kernels.shadow import format as quant
    from countdown.kernels.sparse_mlp import chain, few_tokens, one_token, select  # noqa: F401  (register the ops)
    from countdown.kernels.teal import kernels as teal_kernels  # noqa: F401

    x3, wg, wu, wd, pa, pb, keep = _op_inputs(1, 3)
    x1 = x3[:1].clone()
    (qg, sg), (qu, su) = quant.quantize_rtn(wg, 4, 32), quant.quantize_rtn(wu, 4, 32)
    shadow = kernels.prepare_shadow(qg, sg, qu, su, 4)
    ops = torch.ops.countdown
    cases = [
        (ops.sparse_mlp_one_token, (x1, wu, None, wg, wu, wd, None, 0.5, "abs", "silu", True, False)),
        (ops.sparse_mlp_few_tokens, (x3, x3 @ wu.t(), wg, wu, wd, None, 0.5, "abs", "silu", True, False)),
        (ops.sparse_mlp_block, (x1, torch.ones(64, device=DEVICE), 1e-5, wg, wu, wd, None, 0.5, "abs", "silu")),
        (ops.sparse_mlp_chain, (x3, wg, wu, wd, None, None, None, None, 0.5, "abs", "silu", False)),  # mono
        (ops.sparse_mlp_chain, (x3, wg, wu, wd, None, None, None, None, 0.2, "abs_act", "silu", False)),  # cats
        (ops.sparse_mlp_chain, (x3, wg, wu, wd, None, pa, pb, None, 0.1, "gt", "silu", False)),  # dual
        (ops.sparse_mlp_chain, (x3, wg, wu, wd, keep, None, None, None, 0.0, "mask", "silu", False)),  # masked
        (ops.select_one_token, (x1, shadow["q"], shadow["scale"], None, None, None, None, None, 0.1, wg, wu, wd,
                                "silu")),
        (ops.select_few_tokens, (x3, None, None, x3 @ wu.t(), x3 @ pa, pb.t().contiguous(), None, None, 0.1, wg,
                                 None, wd, "silu")),
        (ops.teal_partials, (x3, wg.t().contiguous(), wu.t().contiguous(), wd, None, 0.5, None, 0.05, "silu")),
    ]
    for op, args in cases:
        kept = torch.zeros(1, dtype=torch.float64, device=DEVICE)
        rows = torch.zeros((), dtype=torch.int64, device=DEVICE)
        torch.library.opcheck(op, (*args, kept, rows), test_utils=("test_schema", "test_faketensor"))


def _op_inputs(seed: int, n_tok: int):
    """x [n_tok, 64], W_gate, W_up, W_down^T [97, 64], a predictor A [64, 8], B [8, 97] and a keep mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, 64, generator=g)
    wg, wu, wd = (torch.randn(97, 64, generator=g) / 8 for _ in range(3))
    pa, pb = torch.randn(64, 8, generator=g) / 8, torch.randn(8, 97, generator=g) / 3
    keep = torch.rand(n_tok, 97, generator=g) > 0.4
    return tuple(t.to(DEVICE) for t in (x, wg, wu, wd, pa, pb, keep))
