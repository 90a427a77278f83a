"""Sweep configurations on weights of their own (countdown.eval.sweep.weights): dense@mlp4g64 (the MLP Linears 4-bit,
other Linears as loaded) and dual[mixed] (the nested 8-bit MLPs, the prompt the 8-bit model's). Their log-likelihoods
against independent references (float64 with the de-quantized weights; the per-configuration adapter on a fresh
model), the model put back bit for bit after each group, and the sweep end to end on a tiny task, resumed."""

import copy
import random

import pytest
import torch
from torch import nn

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402
from conftest import tiny_model  # noqa: E402
from test_lmeval import WORDS, _write_tiny_task, decode_reference, tiny_tokenizer  # noqa: E402

import countdown  # noqa: E402
from countdown.eval import sweep  # noqa: E402
from countdown.eval.scoring import EvalConfig, score_requests  # noqa: E402
from countdown.eval.sweep.weights import (MlpWeights, group_weights, model_weights, parse_weights,  # noqa: E402
                                          weights_key)
from countdown.int4.linear import Int4Linear  # noqa: E402
from countdown.int4.nested_linear import NestedLinear  # noqa: E402
from countdown.spec import parse_spec  # noqa: E402

TOK = tiny_tokenizer()
RNG = random.Random(0)
TEXTS = [" ".join(RNG.choice(WORDS) for _ in range(60)) for _ in range(6)]
ART_OPTIONS = {"texts": TEXTS, "num_tokens": 128, "window": 32}
# (context, continuation) token ids; several continuations share a prompt, as a multiple-choice item's do
REQUESTS = [((2, 5, 9, 14, 7), (20, 21)), ((2, 5, 9, 14, 7), (33,)), ((2, 5, 9, 14, 7), (40, 41, 42, 43)),
            ((2, 11, 12), (6, 8, 30)), ((2, 30, 31, 32, 33, 34, 35), (36, 37))]


def _model():
    return tiny_model("llama", intermediate_size=128, max_position_embeddings=64)  # 64 and 128: groups of 64 fit


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[2, 5, 9, 14, 7, 20, 21]])).logits


def _ll64(model, requests):
    """Float64 log p(continuation | context): one forward of context + continuation[:-1] (no cache)."""
    out = []
    with torch.no_grad():
        for ctx, cont in requests:
            logits = model(torch.tensor([list(ctx) + list(cont[:-1])])).logits[0].double()
            logp = torch.log_softmax(logits, -1)[len(ctx) - 1:]
            out.append(float(logp.gather(-1, torch.tensor(cont)[:, None]).sum()))
    return torch.tensor(out, dtype=torch.float64)


def _rtn64(w, group):
    """Min-max 4-bit RTN of ``w`` [N, K] in groups of ``group``, de-quantized in float64, written out here from the
    format's definition (scale (hi - lo) / 15 in float32 and offset lo rounded to float16, codes
    round((w - lo) / scale) in float32)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).to(torch.float16).double()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    offset = lo.to(torch.float16).double()
    q = torch.round((wg - offset.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).double()
    return (q * scale[..., None] + offset[..., None]).reshape(n, k)


def _reference_4bit(model, group):
    """A float64 copy of ``model`` whose MLP weights are their de-quantized 4-bit RTN."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        for mlp in countdown.find_gated_mlps(ref):
            for role in ("gate", "up", "down"):
                linear = getattr(mlp.module, getattr(mlp, role))
                linear.weight.copy_(_rtn64(linear.weight.float(), group))
    return ref


def test_parse_weights_and_keys():
    assert parse_weights("mlp4g64") == MlpWeights(4, 64) and MlpWeights(4, 128).label == "mlp4g128"
    specs = sweep.parse_methods("dense, dense@mlp4g64,dual[mixed],dual[mixed,kept=float],dual")
    assert [sweep.column_label(s) for s in specs] == ["dense", "dense@mlp4g64", "dual[mixed]",
                                                      "dual[mixed,kept=float]", "dual"]
    assert [weights_key(s, "prac") for s in specs] == ["", "@mlp4g64", "dual[mixed]", "", ""]
    assert weights_key(parse_spec("dual[mixed]"), "ideal") == ""  # SP-Ideal dual runs on the weights as loaded
    for bad, says in [("mono@mlp4g64", "only dense takes @weights"), ("dense@mlp8g64", "only 4-bit"),
                      ("dense@mlp4g48", "group must be one of"), ("dense@", "nothing after '@'"),
                      ("dense@int4", "unknown weights")]:
        with pytest.raises(ValueError, match=says):
            sweep.parse_methods(bad)


@pytest.mark.parametrize("group", [64, 32])
def test_4bit_mlp_log_likelihoods_are_the_float64_dequantized_model(group):
    model = _model()
    before = _logits(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    with model_weights(model, MlpWeights(4, group)):
        held = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, Int4Linear))}
        assert {n for n, m in held.items() if isinstance(m, Int4Linear)} == \
            {n for n in linears if n.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")}
        assert all(held[n] is m for n, m in linears.items() if "mlp" not in n)  # attention, lm_head as loaded
        (got,), _ = score_requests(model, REQUESTS, [EvalConfig("dense")], max_length=64)
    got = torch.tensor([lp for lp, _ in got], dtype=torch.float64)
    want = _ll64(_reference_4bit(model, group), REQUESTS)
    float_model = _ll64(copy.deepcopy(model).double(), REQUESTS)
    tol = 1e-6 * want.abs().clamp(min=1)  # float32 sums over a 64-wide, 2-layer model (measured: < 1e-6 absolute)
    assert torch.all((got - want).abs() <= tol), (got, want)
    assert (float_model - want).abs().max() > 100 * tol.max()  # the 4-bit weights really change the answers
    for name, module in model.named_modules():  # put back: the very modules, the same logits bit for bit
        if name in linears:
            assert module is linears[name]
    assert torch.equal(_logits(model), before)


def test_mixed_group_prompts_on_the_8bit_model_and_puts_the_float_mlps_back(tmp_path):
    """Inside dual[mixed]'s group the log-likelihoods are the per-configuration adapter's on a fresh model (prompt
    on the 8-bit model, continuation mixed: prefill then cached steps), a cached artifact converting nothing by
    itself; after it, the float MLPs and the logits as before, the nested record gone."""
    built_on = _model()
    art = countdown.prepare(built_on, TOK, "dual[mixed]", [0.5], cache_dir=tmp_path, progress=False, **ART_OPTIONS)
    model = _model()
    before, linears = _logits(model), [m for m in model.modules() if isinstance(m, nn.Linear)]
    with group_weights(model, None, lambda: {"dual[mixed]": art}) as arts:
        assert isinstance(model.model.layers[0].mlp.down_proj, NestedLinear)
        (got,), _ = score_requests(model, REQUESTS, [EvalConfig("dual", "prac", 0.5, arts["dual[mixed]"])],
                                   max_length=64)
    fresh = _model()
    countdown.sparsify(fresh, "dual[mixed]", 0.5, artifacts=art, scope="decode", path="masked")
    want = [decode_reference(fresh, list(ctx), list(cont))[0] for ctx, cont in REQUESTS]
    # float32, the sums in another order (measured: < 1e-6); 100x that still tells the 8-bit prompt from the float one
    assert [lp for lp, _ in got] == pytest.approx(want, rel=0, abs=1e-5)
    countdown.unsparsify(fresh)  # the 8-bit model: its prompt is what the group's prompt pass computed
    float_prompt = [decode_reference(_model(), list(ctx), list(cont[:1]))[0] for ctx, cont in REQUESTS]
    eight_bit = [decode_reference(fresh, list(ctx), list(cont[:1]))[0] for ctx, cont in REQUESTS]
    assert max(abs(a - b) for a, b in zip(float_prompt, eight_bit)) > 5e-4  # so the prompt's weights are seen
    assert [m for m in model.modules() if isinstance(m, nn.Linear)] == linears
    assert not any(isinstance(m, NestedLinear) for m in model.modules())
    assert getattr(model.config, "countdown_nested", None) is None
    assert torch.equal(_logits(model), before)


def test_sweep_runs_the_three_configurations_and_resumes(tmp_path):
    (tmp_path / "tasks").mkdir()
    manager = TaskManager(include_path=str(_write_tiny_task(tmp_path / "tasks")), include_defaults=False)
    model = _model()
    before = _logits(model)
    kwargs = dict(methods="dense,dense@mlp4g64,dual[mixed]".split(","), modes=("prac",), sparsities=(0.5,),
                  tasks=("tiny_mc",), out_dir=tmp_path / "out", ppl_tokens=60, ppl_window=16, ppl_texts=TEXTS,
                  agreement_prompts=["the cat sat"], max_new_tokens=3, artifacts_dir=tmp_path / "art",
                  artifact_options=ART_OPTIONS, model=model, tokenizer=TOK, task_manager=manager, batch_size=4,
                  progress=False, log=lambda line: None)
    result = sweep.run_sweep("tiny", **kwargs)
    rows = sweep.read_rows(result["csv"])
    cells = {(r["method"], r["mode"], r["sparsity"], r["task"]) for r in rows}
    assert cells == {("dense", "", "", t) for t in ("tiny_mc", "ppl_all", "ppl_decode")} | \
        {("dense@mlp4g64", "", "", t) for t in ("tiny_mc", "ppl_all", "ppl_decode")} | \
        {("dual[mixed]", "prac", "0.5", t) for t in ("tiny_mc", "ppl_all", "ppl_decode", "agreement")}
    ppl = {r["method"]: float(r["value"]) for r in rows if r["task"] == "ppl_all"}
    assert len(set(ppl.values())) == 3  # three different models
    real = {r["method"]: r["sparsity_real"] for r in rows if r["task"] == "tiny_mc" and r["metric"] == "acc"}
    assert real["dense"] == real["dense@mlp4g64"] == "0.0" and 0.4 < float(real["dual[mixed]"]) < 0.6
    docs = sweep.read_rows(result["docs"], sweep.store.DOC_FIELDS)
    assert {d["method"] for d in docs if d["metric"] == "acc"} == {"dense", "dense@mlp4g64", "dual[mixed]"}
    text = result["markdown"].read_text()
    assert "| Dense | dense@mlp4g64 |" in text and "### Difference from dense@mlp4g64" in text
    assert "On weights of their own (countdown.eval.sweep.weights; each in a pass of its own, its prompts on those " \
           "weights): dense@mlp4g64, dual[mixed]" in text
    assert torch.equal(_logits(model), before)  # every group put the model back
    assert sweep.run_sweep("tiny", **kwargs)["computed"] == 0  # resumed: nothing left
    with pytest.raises(ValueError, match="weights of their own"):
        sweep.run_sweep("tiny", **{**kwargs, "out_dir": tmp_path / "other", "export": tmp_path / "job"})
