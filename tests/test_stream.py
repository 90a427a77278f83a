"""The streaming sparse phase (kernels/_stream.py) and the kept-row lists it reads (_gemv.py with a cut).

Lists: every row whose GEMV score (the same kernel's score output) is above the cut appears exactly
once, in its program's list, in visit order; counts say how many. The sparse phase: the sum of its
partials against the float64 MLP on the listed rows, for several launch configurations, shapes that
are not powers of two, nothing kept and everything kept; whole route against the onepass route.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels import _common, _gemv, _onepass, _stream, shadow  # noqa: E402
from test_shadow_gemv import _shadows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)  # unwritten outputs read as NaN / garbage


def _problem(d_model, d_inter, dtype, seed):
    (qg, sg, qu, su), prep = _shadows(d_model, d_inter, 64 if d_model % 64 == 0 else 32, 4, dtype, seed=seed)
    torch.manual_seed(seed + 1)
    x = torch.randn(1, d_model).to(dtype)
    wg, wu = (K.dequantize(q, s, torch.float32) + 0.01 * torch.randn(d_inter, d_model) for q, s in ((qg, sg), (qu, su)))
    wdt = torch.randn(d_inter, d_model) * d_inter**-0.5
    return x, prep, wg.to(dtype), wu.to(dtype), wdt.to(dtype)


def _listed(lists, counts, cap):
    return [lists[p * cap: p * cap + int(c)].tolist() for p, c in enumerate(counts.tolist())]


# Each block size R once, each kind of cut (read on the device / passed by value) at least once: the two are
# separate constexprs of the kernel (R the rows a step, CUT_PTR where the cut comes from), not one branch.
@pytest.mark.parametrize("config,cut_as_tensor", [(dict(R=4), False), (dict(R=2), True), (dict(R=8), True)],
                         ids=["R4-float", "R2-tensor", "R8-tensor"])
def test_lists_hold_exactly_the_rows_above_the_cut(config, cut_as_tensor):
    d_model, d_inter = 128, 150
    x, prep, *_ = _problem(d_model, d_inter, torch.bfloat16, seed=3)
    score = _gemv.launch(x.to(DEV), prep["q"], prep["scale"], "silu", config).cpu()[0]
    cut = torch.quantile(score, 0.7).item()
    lists, counts = _gemv.launch(x.to(DEV), prep["q"], prep["scale"], "silu", config,
                                 cut=torch.tensor(cut, device=DEV) if cut_as_tensor else cut)
    lists, counts = lists.cpu(), counts.cpu()
    progs = _gemv.n_programs(torch.device(DEV), d_inter, config)
    cap = _gemv.list_capacity(d_inter, progs, config)
    assert counts.shape == (progs,) and lists.shape == (progs * cap,)
    per = _listed(lists, counts, cap)
    R = config["R"]
    for p, rows in enumerate(per):
        assert rows == sorted(rows)  # visit order: blocks p, p + progs, ... ascending
        assert all((r // R) % progs == p for r in rows)  # only rows of the blocks this program visits
    got = sorted(r for rows in per for r in rows)
    assert got == torch.nonzero(score > cut).flatten().tolist()
    assert 0.2 < len(got) / d_inter < 0.4


def _ref(x, wg, wu, wdt, rows, act):
    keep = torch.zeros(1, wg.shape[0], dtype=torch.bool)
    keep[0, rows] = True
    return (K.gated_mlp_masked_ref(x.double(), wg.double(), wu.double(), wdt.double(), keep, act),
            K.gated_mlp_masked_ref(x, wg, wu, wdt, keep, act))


@pytest.mark.parametrize("config", [dict(BM=2, PREFETCH=True), dict(BM=1, PREFETCH=False), dict(BM=4, PREFETCH=True),
                                    dict(BM=8, PREFETCH=False)], ids=str)
@pytest.mark.parametrize("d_model,d_inter,dtype,act", [(128, 160, torch.bfloat16, "silu"),
                                                       (96, 77, torch.float32, "gelu_tanh")])
def test_stream_partials_against_float64(config, d_model, d_inter, dtype, act):
    x, prep, wg, wu, wdt = _problem(d_model, d_inter, dtype, seed=d_inter)
    torch.manual_seed(5)
    # lists of uneven lengths, some empty, rows in any order: the kernel only follows them
    n_lists, cap = 5, 40
    rows = torch.randperm(d_inter)[: d_inter // 3]
    counts = torch.tensor([len(rows) - 20, 0, 8, 12, 0], dtype=torch.int32)
    assert int(counts.sum()) == len(rows)
    lists = torch.full((n_lists * cap,), -7, dtype=torch.int32)  # unused slots hold garbage
    start = 0
    for p, c in enumerate(counts.tolist()):
        lists[p * cap: p * cap + c] = rows[start: start + c].int()
        start += c
    P = _stream.stream_partials(x.to(DEV), lists.to(DEV), counts.to(DEV), cap, wg.to(DEV), wu.to(DEV), wdt.to(DEV),
                                act, config).cpu()
    assert P.shape == (_stream.n_programs(torch.device(DEV), config), d_model) and not P.isnan().any()
    y = P.sum(0, keepdim=True).to(dtype)
    ref64, ref_t = _ref(x, wg, wu, wdt, rows, act)
    atol = (1e-2 if dtype == torch.bfloat16 else 1e-5) * max(1.0, ref64.abs().max().item())
    assert ((y.double() - ref64).abs() <= 2 * (ref_t.double() - ref64).abs() + atol).all()


def test_stream_nothing_and_everything_kept():
    d_model, d_inter = 64, 48
    x, prep, wg, wu, wdt = _problem(d_model, d_inter, torch.float32, seed=9)
    args = [t.to(DEV) for t in (wg, wu, wdt)]
    empty = _stream.stream_partials(x.to(DEV), torch.zeros(4, dtype=torch.int32, device=DEV),
                                    torch.zeros(2, dtype=torch.int32, device=DEV), 2, *args, "silu").cpu()
    assert torch.equal(empty, torch.zeros_like(empty))
    lists = torch.arange(d_inter, dtype=torch.int32)
    full = _stream.stream_partials(x.to(DEV), lists.to(DEV), torch.tensor([d_inter], dtype=torch.int32, device=DEV),
                                   d_inter, *args, "silu").cpu().sum(0, keepdim=True)
    dense = (wu.double() @ x.double().t()).t() * _common.act_torch((wg.double() @ x.double().t()).t(), "silu")
    assert torch.allclose(full.double(), dense @ wdt.double(), atol=1e-5, rtol=1e-5)


def test_stream_bad_input():
    x = torch.randn(2, 64, device=DEV)
    w = torch.randn(32, 64, device=DEV)
    c = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="one token"):
        _stream.stream_partials(x, torch.zeros(8, dtype=torch.int32, device=DEV), c, 4, w, w, w, "silu")
    with pytest.raises(ValueError, match="lists of 4 slots"):
        _stream.stream_partials(x[:1], torch.zeros(7, dtype=torch.int32, device=DEV), c, 4, w, w, w, "silu")
    with pytest.raises(ValueError, match="d_inter, d_model"):
        _stream.stream_partials(x[:1], torch.zeros(8, dtype=torch.int32, device=DEV), c, 4, w, w, w[:, :32], "silu")


@pytest.mark.parametrize("dtype,act", [(torch.bfloat16, "silu"), (torch.float32, "gelu_tanh")])
def test_stream_route_matches_the_onepass_route(dtype, act, monkeypatch):
    """Same indicator kernel, same rows kept: the two routes differ only in the order of the fp32 sums."""
    monkeypatch.setattr(_onepass, "ONEPASS_OFF_CUDA", True)
    monkeypatch.setattr(shadow, "ONE_TOKEN_GEMV", "fp16x2")  # the stream route's lists come from _gemv.py
    d_model, d_inter = 128, 100  # (the interpreter runs _gemv.py's row blocks one by one: three launches here)
    x, prep, wg, wu, wdt = _problem(d_model, d_inter, dtype, seed=21)
    score = _gemv.launch(x.to(DEV), prep["q"], prep["scale"], act).cpu()[0]
    cut = torch.tensor(torch.quantile(score, 0.8).item(), device=DEV)
    dev = [t.to(DEV) for t in (wg, wu, wdt)]
    out = {}
    for route in ("stream", "onepass"):
        monkeypatch.setattr(shadow, "ONE_TOKEN_ROUTE", route)
        calls = []
        real = _stream.stream_partials
        monkeypatch.setattr(_stream, "stream_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
        out[route] = K.shadow_dual_gated_mlp(x.to(DEV), prep, cut, *dev, act).cpu()
        assert len(calls) == (route == "stream")
    ref64, ref_t = _ref(x, wg, wu, wdt, torch.nonzero(score > cut.item()).flatten(), act)
    atol = (1e-2 if dtype == torch.bfloat16 else 1e-5) * max(1.0, ref64.abs().max().item())
    for route, y in out.items():
        assert y.dtype == dtype and ((y.double() - ref64).abs() <= 2 * (ref_t.double() - ref64).abs() + atol).all(), route


def test_pdl_is_off_unless_asked_and_never_under_the_interpreter(monkeypatch):
    from countdown.kernels import _pdl

    x = torch.zeros(1, 8, device=DEV)
    monkeypatch.setattr(_pdl, "ENABLED", False)
    assert not _pdl.active(x) and _pdl.launch_kwargs(False) == {}
    monkeypatch.setattr(_pdl, "ENABLED", True)
    if not torch.cuda.is_available():  # CPU / TRITON_INTERPRET: the grid-dependency ops do not exist there
        assert not _pdl.active(x)
    assert _pdl.launch_kwargs(True) == {"launch_pdl": True}
    monkeypatch.setattr(_pdl, "active", lambda t: True)
    for trigger, code in (("start", 1), ("end", 2)):
        monkeypatch.setattr(_pdl, "TRIGGER", trigger)
        assert _pdl.mode(x, "linear") == code
    monkeypatch.setattr(_pdl, "KERNELS", frozenset({"onepass"}))  # COUNTDOWN_PDL_KERNELS=onepass
    assert _pdl.mode(x, "onepass") == 2 and _pdl.mode(x, "linear") == 0
    with pytest.raises(ValueError, match="unknown kernel 'lienar'"):
        _pdl.mode(x, "lienar")
    monkeypatch.setattr(_pdl, "TRIGGER", "middle")
    with pytest.raises(ValueError, match="'start' or 'end'"):
        _pdl.mode(x, "onepass")


def test_weights_early_only_for_grids_that_fit_at_once(monkeypatch):
    """W_EARLY "auto": the fixed GEMV loads its first weight tile before the wait only when all its programs
    are resident at once: 132 SMs x min(32, 64 // warps) programs (8 warps: 1056; 1 warp: 4224)."""
    from types import SimpleNamespace

    from countdown.kernels import _common, _pdl

    monkeypatch.setattr(_common, "_sm_count", lambda index: 132)
    t = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(_pdl, "W_EARLY", "auto")
    assert _pdl.weights_early(t, 1056, 8) and not _pdl.weights_early(t, 1057, 8)
    assert _pdl.weights_early(t, 4224, 1) and not _pdl.weights_early(t, 4225, 1)
    assert not _pdl.weights_early(t, 6144, 8)  # Llama-3.1-8B's QKV GEMV: many waves
    assert _pdl.weights_early(t, 512, 8) and _pdl.weights_early(t, 3584, 1)  # the predictor's x A, (x A) B
    for forced in (True, False):
        monkeypatch.setattr(_pdl, "W_EARLY", forced)
        assert _pdl.weights_early(t, 6144, 8) is forced and _pdl.weights_early(t, 1, 1) is forced


@pytest.mark.parametrize("value, expect", [("stream", "stream"), ("", "onepass"), ("bogus", None)])
def test_route_from_the_environment(value, expect):
    """COUNTDOWN_SHADOW_ROUTE picks the route for a whole run; a wrong name stops the import naming the fix."""
    import subprocess
    import sys

    env = {**os.environ, "COUNTDOWN_SHADOW_ROUTE": value}
    code = "from countdown.kernels import shadow; print(shadow.ONE_TOKEN_ROUTE)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if expect is not None:
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == expect
    else:
        assert run.returncode != 0
        assert "COUNTDOWN_SHADOW_ROUTE" in run.stderr and "expected fused, onepass or stream" in run.stderr
