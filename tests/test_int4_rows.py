"""The kept-rows kernels on 4-bit weights (kernels/int4/rows*.py, which dual[mixed] reuses) against a float64 reference,
under Triton's interpreter on CPU (on a GPU: the inline-asm dequantization at a Llama-3.1-8B MLP's shape); a sparsified
4-bit model decodes through its patch."""

from __future__ import annotations

import pytest
import torch

from countdown.int4 import quantize_rtn
import countdown.kernels as K
from countdown.kernels.config import launch_config
from countdown.kernels.int4 import gemv as _int4, rows as _int4_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _mlp(d_model, d_inter, group, seed=0):
    g = torch.Generator().manual_seed(seed)

    def weight(n, k):
        w = torch.randn(n, k, generator=g) * (1 + torch.rand(n, 1, generator=g)) / k ** 0.5
        w[:, : k // 3] += 0.3 / k ** 0.5  # groups off centre: the offsets' term matters
        return quantize_rtn(w, group)

    return weight(d_inter, d_model), weight(d_inter, d_model), weight(d_inter, d_model)  # gate, up, W_down^T


def _count_launches(calls: list):
    """A context recording the rule of every launch of the kept-rows kernels (their select kernel) in ``calls``."""
    return K.overrides(on_launch=lambda name, *a: calls.append(a[1]) if name == "int4_rows" else None)


def _on(w):
    return type(w)(w.qweight.to(DEV), w.scale.to(DEV), w.offset.to(DEV))


def _indicator(x, gate, up, mode):
    """The indicator GEMV's partials as a decode step computes them (kernels/int4/gemv.py): u, g, or [g; u] in slices."""
    def partials(w, max_cols):
        return _int4.launch(x.to(DEV), w.qweight.view(torch.int32).to(DEV), w.scale.to(DEV), w.offset.to(DEV),
                            None, {"MAX_COLS": max_cols})

    if mode == "abs":
        return partials(up, 4096)
    if mode == "abs_act":
        return partials(gate, 4096)
    g, u = partials(gate, 128), partials(up, 128)  # two slices each
    return torch.stack([g, u], 1)


def _decided(ind, mode):
    """The indicator's values the kernel thresholds: the partials' float32 sum (through act for cats and dual)."""
    total = ind.float().sum(0).cpu()
    silu = torch.nn.functional.silu
    return {"abs": lambda: total, "abs_act": lambda: silu(total), "dual": lambda: silu(total[0]) * total[1]}[mode]()


def _assert_same_decode(out, ref, steps, ref_steps, atol, rtol=0.0):
    """A greedy decode through rounding that differs from the reference's (fp16 products in the kept-rows kernel)
    against the reference: step by step, each step's logits within ``atol`` of the reference's while the tokens
    before it agree. Where the tokens first differ the logits are still compared (same prefix), which bounds the
    reference's own margin between the two tokens by 2 atol: a near tie that any rounding may flip; the steps after
    it have different prefixes and are not compared. (A tiny random model has such ties: SmolLM-size logits of a
    2-layer random model sit within 1e-3 of each other.)"""
    start = out.shape[1] - len(steps)
    assert out.shape == ref.shape and len(steps) == len(ref_steps) and torch.equal(out[:, :start], ref[:, :start])
    for i, (got, want) in enumerate(zip(steps, ref_steps)):
        torch.testing.assert_close(got[:, -1], want[:, -1], atol=atol, rtol=rtol, msg=lambda m: f"step {i}: {m}")
        if out[0, start + i] != ref[0, start + i]:
            break


def _down_bound(down_t, s, config=None):
    """The down kernel's rounding bound per column: each product c s' rounded once to fp16 and UR of them summed in
    fp16 (UR rows a tile), each step within 2**-11 of sum |s scale c| over the column's rows."""
    group = down_t.qweight.shape[1] * 2 // down_t.scale.shape[1]
    codes = down_t.dequantize(torch.float64) - down_t.offset.double().repeat_interleave(group, 1)  # scale c
    ur = launch_config("int4_rows", extra=config)["UR"]
    return (ur + 1) * 2.0 ** -11 * (codes.abs().t() @ s.abs())


def _threshold(values, k):
    """A threshold halfway between the two neighbours of |values| at the k-quantile (no row at a tie)."""
    v, _ = values.abs().double().sort()
    i = min(max(int(k * v.numel()) - 1, 0), v.numel() - 2)  # keeps the n - int(k n) largest
    return float((v[i] + v[i + 1]) / 2)


# launch shapes: the defaults, and small sets read in two chunks, the other GEMV's kept rows two sets a program in
# tiles of 4 over slices of 64 columns, three sets a down program (a flat walk across sets, packed), column slices
# of 32 words, tiles of 4, the lists read after the PDL wait (EARLY 0; the default reads them before it)
SHAPES = [None, {"CHUNK": 16, "SET": 32, "O_SUB": 2, "O_R": 4, "O_COLS": 64, "O_WARPS": 1, "SUB": 3,
                 "SLICE": 32, "UR": 4, "NW": 2, "AHEAD": 2, "EARLY": 0}]


@pytest.mark.parametrize("mode", ["abs", "abs_act", "dual"])
@pytest.mark.parametrize("d_model,d_inter,group,k", [(256, 200, 32, 0.5), (512, 384, 128, 0.8), (256, 96, 64, 0.0)])
@pytest.mark.parametrize("dtype,config", [(torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, SHAPES[1])])
def test_kept_rows_match_float64(mode, d_model, d_inter, group, k, dtype, config):
    """The partials' sum equals s W~d^T over the kept rows (float64, with s = u act(g) from the 4-bit GEMV's own u
    and g) within float32 rounding, and the float64 model's output within the GEMV's; the rows kept are those whose
    float32 indicator passes the threshold (k of them skipped), and the kernel counts them; k = 0 keeps every row
    (the dense MLP); under both launch shapes (``SHAPES``)."""
    gate, up, down_t = _mlp(d_model, d_inter, group)
    x = torch.randn(1, d_model, generator=torch.Generator().manual_seed(1)).to(dtype)
    ind = _indicator(x, gate, up, mode)
    thr = -1.0 if k == 0 else _threshold(_decided(ind, mode), k)
    ref, keep = _int4_rows.kept_rows_ref(x, gate, up, down_t, thr, mode, ind=ind)
    assert int(keep.sum()) == d_inter - int(k * d_inter)
    other = None if mode == "dual" else _on(gate if mode == "abs" else up)
    kept, rows = torch.zeros(1, dtype=torch.float64, device=DEV), torch.zeros((), dtype=torch.int64, device=DEV)
    out = _int4_rows.kept_rows(ind, x.to(DEV), other, _on(down_t), torch.tensor(thr), mode, count=(kept, rows),
                               config=config)
    assert out.dtype == torch.float32 and out.shape[1] == d_model
    y = out.sum(0).double().cpu()
    # s from u and g as the 4-bit GEMV computes them (float32, tested against float64 in test_int4_gemv.py), then the
    # kept rows' sum in float64. The kernel's other GEMV differs from that s by float32 rounding (1e-4 of the terms);
    # its W~d^T sum is in fp16 products per tile: (UR + 1) 2**-11 of sum |s scale c| a column bounds it (_down_bound)
    silu = torch.nn.functional.silu
    g32, u32 = (_indicator(x, w, w, "abs").sum(0).double().cpu() for w in (gate, up))
    s32 = torch.where(keep, u32 * silu(g32), torch.zeros((), dtype=torch.float64))
    wd = down_t.dequantize(torch.float64).t()
    terms = wd.abs() @ s32.abs()
    bound = _down_bound(down_t, s32, config) + 1e-4 * terms + 1e-6 * terms.max()
    err = (y - wd @ s32).abs()
    assert (err <= bound).all(), (err / bound).max()
    # the roundings are independent, so the error is far below the bound, and below what a 1 % error in s would make
    assert err.norm() < 3e-3 * (wd @ s32).norm()
    assert ((wd @ s32 - ref).abs() < 0.1 * terms).all()  # and the float64 model's output, within the GEMV's rounding
    assert int(rows) == d_inter and int(kept.item()) == int(keep.sum())  # Sparsity-Real: the rows it kept
    if k > 0:  # the norm check is far below what skipping changes: the dense MLP's output would fail it (the worst-case
        # bound at the default UR = 32, 33 2**-11 of a column's terms, need not see it at these sizes)
        gap = wd @ (u32 * silu(g32)) - wd @ s32
        assert gap.norm() > max(10 * err.norm(), 3e-3 * (wd @ s32).norm())


def test_kept_rows_dual_sums_the_kept_rows_of_w_down_t():
    """dual computes nothing but the W~d^T rows' sum: against float64 with the kernel's own s, within the fp16
    products' bound alone (nothing else rounds); at 2 rows a tile that bound is tight enough to see one kept row left
    out, and at the default's the error itself is a tenth of that row's (at most a fifth)."""
    gate, up, down_t = _mlp(256, 200, 32, seed=3)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ind = _indicator(x, gate, up, "dual")
    s = _decided(ind, "dual").double()
    thr = _threshold(s, 0.6)
    s = torch.where(s.abs() > thr, s, torch.zeros((), dtype=torch.float64))
    wd = down_t.dequantize(torch.float64).t()
    smallest = s.abs().masked_fill(s == 0, float("inf")).argmin()
    missing = wd @ torch.where(torch.arange(200) == smallest, torch.zeros((), dtype=torch.float64), s)
    for config in (None, {"UR": 2}):  # the default's UR rows a tile, and 2 (a tighter bound)
        out = _int4_rows.kept_rows(ind, x.to(DEV), None, _on(down_t), torch.tensor(thr), "dual",
                                   config=config).sum(0).double().cpu()
        bound = _down_bound(down_t, s, config) + 1e-6 * (wd.abs() @ s.abs())
        assert ((out - wd @ s).abs() <= bound).all()
        assert ((out - missing).abs() > bound).any() or config is None  # at UR = 32 the worst case hides one row
        assert (out - wd @ s).norm() < 0.2 * (out - missing).norm()  # in practice it is far below it (0.10 at UR 32)


@pytest.mark.parametrize("mode,config,with_bias", [("abs", None, True), ("dual", None, False),
                                                    ("abs_act", SHAPES[1], True)])
def test_kept_rows_add_the_residual_in_the_down_launch(mode, config, with_bias):
    """With a residual h the down launch's last program of each column slice writes h + the partials' sum (+ bias),
    rounded once to h's dtype: the same numbers as decode_add_partials on the partials (summed in the same order)
    and within one rounding of h's dtype of the float64 h + s W~d^T (+ bias); twice in a row (the slices' counters
    set back to 0 by each launch)."""
    from countdown.kernels.decode_step.rmsnorm import decode_add_partials

    gate, up, down_t = _mlp(256, 200, 32, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
    h = (4 * torch.randn(1, 256, generator=gen)).to(torch.bfloat16)
    bias = torch.randn(256, generator=gen).to(torch.bfloat16) if with_bias else None
    ind = _indicator(x, gate, up, mode)
    thr = _threshold(_decided(ind, mode), 0.5)
    other = None if mode == "dual" else _on(gate if mode == "abs" else up)

    def run(residual=None):
        return _int4_rows.kept_rows(ind, x.to(DEV), other, _on(down_t), torch.tensor(thr), mode, config=config,
                                    residual=None if residual is None else residual.to(DEV),
                                    bias=None if bias is None or residual is None else bias.to(DEV))

    partials = run()
    want = decode_add_partials(h.to(DEV), partials, None if bias is None else bias.to(DEV))
    for _ in range(2):
        got = run(h)
        assert got.dtype == h.dtype and got.shape == h.shape
        assert torch.equal(got.cpu(), want.cpu())
    exact = h.double() + partials.sum(0).double().cpu() + (0 if bias is None else bias.double())
    ulp = 2.0 ** -7 * exact.abs()  # bf16's spacing bounds a rounding to nearest by half of it
    assert ((got.double().cpu() - exact).abs() <= ulp + 1e-6 * partials.abs().sum(0).double().cpu()).all()
    assert (got.double().cpu() - h.double()).abs().max() > 0.1  # and the MLP's output is really in it
    with pytest.raises(ValueError, match="residual and bias"):
        run(torch.zeros(1, 128))

def test_kept_rows_rejects_bad_input():
    gate, up, down_t = _mlp(256, 96, 32)
    x = torch.randn(1, 256)
    u = torch.zeros(1, 96)
    with pytest.raises(ValueError, match="unknown mode"):
        _int4_rows.kept_rows(u, x, gate, down_t, torch.tensor(0.0), "topk")
    with pytest.raises(ValueError, match="the other weight"):
        _int4_rows.kept_rows(u, x, None, down_t, torch.tensor(0.0), "abs")
    with pytest.raises(ValueError, match="indicator partials"):
        _int4_rows.kept_rows(u.double(), x, gate, down_t, torch.tensor(0.0), "abs")
    with pytest.raises(ValueError, match="rows must match"):
        _int4_rows.kept_rows(u, x, quantize_rtn(torch.randn(96, 512), 32), down_t, torch.tensor(0.0), "abs")
    with pytest.raises(ValueError, match="AHEAD"):
        _int4_rows.kept_rows(u, x, gate, down_t, torch.tensor(0.0), "abs", config={"AHEAD": 3})
    with pytest.raises(ValueError, match="unknown kept-rows launch setting"):
        _int4_rows.kept_rows(u, x, gate, down_t, torch.tensor(0.0), "abs", config={"O_AHEAD": 2})
    with pytest.raises(ValueError, match="O_R"):
        _int4_rows.kept_rows(u, x, gate, down_t, torch.tensor(0.0), "abs", config={"O_R": 0})


@pytest.mark.skipif(DEV != "cuda", reason="the inline-asm path needs a GPU")
def test_kept_rows_at_the_8b_shape_on_the_gpu():
    """The Llama-3.1-8B MLP (4096 x 14336, G = 128), mono and dual at k = 0.7, on the asm path, at the default launch
    and with one tile of words in flight in down, two sets an other-GEMV program in tiles of 8 rows holding all of x;
    and h + the output from the down launch (the residual add in it)."""
    gate, up, down_t = _mlp(4096, 14336, 128, seed=5)
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for mode, config in (("abs", None), ("dual", None), ("abs", {"AHEAD": 1, "O_SUB": 2, "O_R": 8, "O_COLS": 4096})):
        ind = _indicator(x, gate, up, mode)
        thr = _threshold(_decided(ind, mode), 0.7)
        ref, keep = _int4_rows.kept_rows_ref(x, gate, up, down_t, thr, mode, ind=ind)
        out = _int4_rows.kept_rows(ind, x.to(DEV), _on(gate) if mode == "abs" else None, _on(down_t),
                                   torch.tensor(thr), mode, config=config).sum(0).double().cpu()
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (mode, rel)
        assert abs(keep.float().mean().item() - 0.3) < 0.01
        h = torch.randn(1, 4096, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        for _ in range(2):  # twice: the column slices' counters back at 0 after each launch
            got = _int4_rows.kept_rows(ind, x.to(DEV), _on(gate) if mode == "abs" else None, _on(down_t),
                                       torch.tensor(thr), mode, config=config, residual=h.to(DEV)).double().cpu()
            want = h.double() + ref
            assert ((got - want).norm() / ref.norm()).item() < 1e-2 + 2.0 ** -8 * want.norm() / ref.norm()


@pytest.mark.parametrize("order", ["sparsify first", "step first"])
def test_sparsified_4bit_model_decodes_through_its_patch(order):
    """countdown.sparsify on a 4-bit model, before or after its 4-bit step is set up (countdown.generate sets it up
    once): the folded layer runs the patch's own forward (no kept-rows kernel launches), giving the tokens of the same
    sparsified model on the reference path (never the dense model's), with its Sparsity-Real counters."""
    from conftest import captured_logits, tiny_model

    import countdown
    from countdown.bench.speedonly import decode_prompts, fit_cuts_on_decode, random_artifacts
    from countdown.decode.generate import generate_fast
    from countdown.decode.linears import fastest_step
    from countdown.int4 import use_backend

    model = countdown.quantize(tiny_model("llama", intermediate_size=128), group=32, lm_head=True).to(DEV)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4)).to(DEV)
    dense, _ = generate_fast(model, prompt, 5, compile=False)
    art = random_artifacts(model, "mono", [0.6])
    fit_cuts_on_decode(model, art, decode_prompts(128, 2, 9).to(DEV), new_tokens=8)
    if order == "step first":
        fastest_step(model)
    countdown.sparsify(model, "mono", 0.6, mode="prac", artifacts=art)
    use_backend(model, "reference")  # the reference: every MLP through the patch's own (gather) path
    with captured_logits(model) as ref_steps:
        ref, _ = generate_fast(model, prompt, 5, compile=False)
    ref_real = countdown.sparsity_real(model)["mean"]
    use_backend(model, "countdown")
    if order == "sparsify first":
        fastest_step(model)
    countdown.reset_sparsity_stats(model)
    calls = []
    with _count_launches(calls), captured_logits(model) as steps:
        out, _ = generate_fast(model, prompt, 5, compile=False)
    assert calls == []
    assert not torch.equal(ref, dense)
    _assert_same_decode(out, ref, steps, ref_steps, atol=2e-2)
    assert abs(countdown.sparsity_real(model)["mean"] - ref_real) < 0.05 and 0.3 < ref_real < 0.9
    fastest_step(model, on=False)
    countdown.unsparsify(model)


def test_down_scales_s_where_fp16_rounds_up():
    """The down kernel scales s scale into fp16 (s') per stream and group; a largest |s scale| just under a power of
    two rounds up to the top of that range in fp16, and -1024 s' must still be an fp16 (it overflowed once: NaN)."""
    from countdown.kernels.int4.rows_down import down

    d_inter, d_model, group = 16, 256, 32
    w = quantize_rtn(torch.randn(d_inter, d_model, generator=torch.Generator().manual_seed(7)), group)
    w = type(w)(w.qweight, torch.ones_like(w.scale), torch.zeros_like(w.offset))  # W~ = c: s scale = s
    s = torch.full((d_inter,), 0.25)
    s[0] = 2 - 2.0 ** -13  # rounds to 2.0 in fp16 once scaled
    s[1] = -(2 - 2.0 ** -13)
    cfg = launch_config("int4_rows", extra={"SET": 16, "SUB": 1, "CHUNK": 16})
    idx = torch.arange(d_inter, dtype=torch.int32, device=DEV)
    out = down(idx, s.to(DEV), torch.tensor([d_inter], dtype=torch.int32, device=DEV), None,
               w.qweight.view(torch.int32).to(DEV), w.scale.to(DEV), w.offset.to(DEV), cfg).sum(0).double().cpu()
    want = w.dequantize(torch.float64).t() @ s.double()
    assert torch.isfinite(out).all()
    assert ((out - want).abs() <= _down_bound(w, s.double(), cfg) + 1e-6).all()


def test_sparsify_on_4bit_weights_says_no_rows_are_skipped(capsys):
    """One line on stderr when sparsify patches 4-bit MLP weights (no 4-bit kernel skips rows; it names dual[mixed]),
    whatever the method; none on float weights."""
    import copy

    from conftest import tiny_model

    import countdown
    from countdown.bench.speedonly import random_artifacts

    base = tiny_model("llama", intermediate_size=128)
    for method, mode in (("mono", "prac"), ("dual", "ideal")):
        model = countdown.quantize(copy.deepcopy(base), group=32)
        art = random_artifacts(model, method, [0.6]) if mode == "prac" else None
        capsys.readouterr()
        countdown.sparsify(model, method, 0.6, mode=mode, artifacts=art)
        err = capsys.readouterr().err
        assert "no 4-bit kernel skips rows" in err and "dual[mixed]" in err, (method, err)
        countdown.unsparsify(model)
    countdown.sparsify(base, "dual", 0.6)
    assert "sparsify:" not in capsys.readouterr().err
