"""The quality sweep: CSV contents, resuming after an interruption, the Table 1 averages and the
paper's orderings, all on a tiny random model and a five-item local task (no downloads)."""

import argparse
import csv
import random
from types import SimpleNamespace

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402
from test_lmeval import WORDS, _write_tiny_task, tiny_model, tiny_tokenizer  # noqa: E402

import countdown  # noqa: E402
import countdown.artifacts.prepare  # noqa: E402
from countdown.eval import sweep  # noqa: E402
from countdown.sparse_methods.registry import kept_rows  # noqa: E402

REQUIRED = ["model", "method", "mode", "sparsity", "sparsity_real", "task", "metric", "value", "limit", "seconds", "date"]
GRID = dict(methods=("dense", "mono", "dual"), modes=("ideal", "prac"), sparsities=(0.5,), tasks=("tiny_mc",))
# dense: tiny_mc + 2 perplexities; each of mono/dual x ideal/prac: those 3 + agreement
N_CELLS = 3 + 4 * 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    (root / "tasks").mkdir()
    manager = TaskManager(include_path=str(_write_tiny_task(root / "tasks")), include_defaults=False)
    tok = tiny_tokenizer()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(6)]
    return SimpleNamespace(root=root, manager=manager, tok=tok, model=tiny_model(len(tok)), texts=texts,
                           artifacts=root / "artifacts")


def _run(setup, out_dir, **overrides):
    kwargs = dict(GRID, out_dir=out_dir, ppl_tokens=60, ppl_window=16, ppl_texts=setup.texts,
                  agreement_prompts=["the cat sat", "one two three"], max_new_tokens=4,
                  artifacts_dir=setup.artifacts, artifact_options={"texts": setup.texts, "num_tokens": 64, "window": 16},
                  model=setup.model, tokenizer=setup.tok, task_manager=setup.manager, batch_size=4,
                  progress=False, log=lambda line: None)
    kwargs.update(overrides)
    return sweep.run_sweep("tiny", **kwargs)


@pytest.fixture(scope="module")
def full_run(setup):
    out = setup.root / "full"
    result = _run(setup, out)
    return result, sweep.read_rows(result["csv"])


def _comparable(rows):
    return [{k: v for k, v in r.items() if k not in ("seconds", "date")} for r in rows]


def test_sweep_writes_csv_with_required_columns(setup, full_run):
    result, rows = full_run
    with open(result["csv"], newline="") as fh:
        header = next(csv.reader(fh))
    assert all(column in header for column in REQUIRED)
    assert result["computed"] == N_CELLS and result["markdown"].is_file() and result["plot"].is_file()

    cells = {(r["method"], r["mode"], r["sparsity"], r["task"]) for r in rows}
    assert len(cells) == N_CELLS
    dense = [r for r in rows if r["method"] == "dense"]
    assert {r["mode"] for r in dense} == {""} and {r["sparsity"] for r in dense} == {""}  # one cell: no k, no mode
    assert {r["task"] for r in dense} == {"tiny_mc", "ppl_all", "ppl_decode"}  # no agreement of dense with itself
    assert {r["metric"] for r in rows if r["task"] == "agreement"} == set(sweep.AGREEMENT_METRICS)
    assert {r["limit"] for r in rows if r["task"] == "tiny_mc"} == {""}  # limit=None: all documents
    assert {r["n"] for r in rows if r["task"] == "tiny_mc"} == {"5"}

    # SP-Ideal skips exactly d_inter - kept_rows(d_inter, k) rows of every sparse token
    expected_real = 1 - kept_rows(97, 0.5) / 97
    for r in rows:
        if r["mode"] == "ideal":
            assert float(r["sparsity_real"]) == pytest.approx(expected_real, abs=1e-9)

    # both perplexity styles are what they say: computed here directly from the model
    model, tok = setup.model, setup.tok
    direct_dense_decode = countdown.perplexity(model, tok, setup.texts, max_tokens=60, window=16,
                                               prompt_fraction=0.5, progress=False)
    countdown.sparsify(model, "mono", 0.5, scope="all")
    try:
        direct_mono_all = countdown.perplexity(model, tok, setup.texts, max_tokens=60, window=16,
                                               prompt_fraction=0.0, progress=False)
    finally:
        countdown.unsparsify(model)

    def value(method, mode, task):
        (row,) = [r for r in rows if (r["method"], r["mode"], r["task"]) == (method, mode, task)]
        return float(row["value"])

    assert value("dense", "", "ppl_decode") == pytest.approx(direct_dense_decode, rel=1e-9)
    assert value("mono", "ideal", "ppl_all") == pytest.approx(direct_mono_all, rel=1e-9)
    assert value("mono", "ideal", "ppl_all") != pytest.approx(value("mono", "ideal", "ppl_decode"), rel=1e-3)

    # one cached artifact per SP-Prac method; the model is left dense
    assert sorted(p.name.split("-")[0] for p in setup.artifacts.glob("*.safetensors")) == ["dual", "mono"]
    assert not countdown.is_sparsified(model)
    text = result["markdown"].read_text()
    assert "| Dense | full |" in text and "tiny_mc: test split" in text and "countdown sweep --model tiny" in text


def test_interrupted_sweep_resumes_to_the_same_csv(setup, full_run, monkeypatch, tmp_path):
    _, full_rows = full_run
    calls = {"n": 0, "fail_at": 3}

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:
                raise KeyboardInterrupt("injected after the 2nd measurement")
            return fn(*args, **kwargs)
        return wrapper

    for name in ("measure_task_shared", "measure_lmeval", "measure_ppl", "measure_agreement"):
        monkeypatch.setattr(sweep.measure, name, counted(getattr(sweep.measure, name)))
    builds = []
    monkeypatch.setattr(countdown.artifacts.prepare, "_build", lambda *a, **k: builds.append("build"))  # a cache miss

    out = tmp_path / "resumed"
    lines = []
    with pytest.raises(KeyboardInterrupt):
        _run(setup, out, log=lines.append)
    partial = sweep.read_rows(out / "tiny.csv")
    # measurement 1: the tiny_mc pass of all 5 configurations; 2: dense ppl_all; 3 interrupted
    assert {(r["method"], r["mode"], r["task"]) for r in partial if r["task"] != "tiny_mc"} == {("dense", "", "ppl_all")}
    assert len({(r["method"], r["mode"]) for r in partial if r["task"] == "tiny_mc"}) == 5
    assert not countdown.is_sparsified(setup.model)
    said = "\n".join(lines)
    assert "interrupted. 6 of 19 cells are saved" in said and "countdown sweep --model tiny" in said

    # --report-only: the report of the measured cells, nothing computed, no model needed
    calls.update(n=0, fail_at=-1)
    report = _run(setup, out, report_only=True, model=None, tokenizer=None)
    assert calls["n"] == 0 and report["computed"] == 0
    text = (out / "tiny.md").read_text()
    assert "**Partial**: 6 of 19 cells" in text and "dense" in text
    assert sweep.read_rows(out / "tiny.csv") == partial

    result = _run(setup, out)
    assert calls["n"] == N_CELLS - 6 and result["computed"] == N_CELLS - 6 and result["skipped"] == 6
    assert _comparable(sweep.read_rows(out / "tiny.csv")) == _comparable(full_rows)
    assert builds == []  # SP-Prac artifacts came from the cache of the first sweep

    calls["n"] = 0
    again = _run(setup, out)
    assert calls["n"] == 0 and again["computed"] == 0

    # another limit is another setting: its cells are measured, not taken from the limit=None ones
    calls["n"] = 0
    _run(setup, out, methods=("dense",), limit=2, ppl_tokens=0)
    assert calls["n"] == 1
    limited = [r for r in sweep.read_rows(out / "tiny.csv") if r["setting"] == "limit=2"]
    assert {r["n"] for r in limited} == {"2"} and {r["limit"] for r in limited} == {"2"}


# ------------------------------------------------------------------------------------------------
# Report arithmetic on hand-made CSVs
# ------------------------------------------------------------------------------------------------


def _row(method, mode, k, task, metric, value, real=""):
    return {"model": "m", "method": method, "mode": mode, "sparsity": "" if k is None else f"{k:g}",
            "sparsity_real": str(real), "task": task, "metric": metric, "value": str(value), "limit": "10", "n": "10",
            "setting": "limit=10", "artifacts": "", "seconds": "1.0", "date": "2026-11-21"}


def _hand_made_rows():
    rows = []
    # task A reports acc and acc_norm (acc_norm is the score), task B only acc
    table = {  # (method, mode, k): (A acc, A acc_norm, B acc, sparsity_real)
        ("dense", "", None): (0.9, 0.80, 0.60, 0.0),
        ("cats", "ideal", 0.7): (0.1, 0.50, 0.40, 0.70),
        ("mono", "ideal", 0.7): (0.1, 0.70, 0.60, 0.70),
        ("mono", "ideal", 0.8): (0.1, 0.40, 0.30, 0.80),
        ("mono", "prac", 0.7): (0.1, 0.60, 0.50, 0.68),
    }
    for (method, mode, k), (a_acc, a_norm, b_acc, real) in table.items():
        rows += [_row(method, mode, k, "A", "acc", a_acc, real), _row(method, mode, k, "A", "acc_norm", a_norm, real),
                 _row(method, mode, k, "A", "acc_norm_stderr", 0.05, real),
                 _row(method, mode, k, "B", "acc", b_acc, real + 0.02 if real else real)]
    rows.append(_row("mono", "prac", 0.8, "A", "acc_norm", 0.99, 0.81))  # task B missing: no average
    rows.append(_row("mono", "ideal", 0.7, "ppl_decode", "perplexity", 12.0, 0.7))  # not a task score
    return rows


def test_markdown_average_table_on_hand_made_csv(tmp_path):
    path = tmp_path / "m.csv"
    sweep.write_rows_atomic(path, _hand_made_rows())
    rows = sweep.read_rows(path)  # through the file: what a resumed sweep reads back

    avg = sweep.average_scores(rows, ["A", "B"])
    expected = {("dense", "", None): (0.80 + 0.60) / 2, ("cats", "ideal", 0.7): (0.50 + 0.40) / 2,
                ("mono", "ideal", 0.7): (0.70 + 0.60) / 2, ("mono", "ideal", 0.8): (0.40 + 0.30) / 2,
                ("mono", "prac", 0.7): (0.60 + 0.50) / 2}
    assert avg.keys() == expected.keys()
    for config, value in expected.items():
        assert avg[config] == pytest.approx(value)

    real = sweep.mean_sparsity_real(rows, ["A", "B"])
    assert real[("mono", "prac", 0.7)] == pytest.approx((0.68 + 0.70) / 2)

    lines = sweep.table1_markdown(avg, sparsity_real=real).splitlines()
    assert lines[0] == "| mode | method | k=0.7 | k=0.8 |"
    assert lines[2] == "| Dense | full | 0.700 | 0.700 |"
    assert lines[3] == "| SP-Ideal | cats | 0.450 (0.710) | — |"  # rows in the paper's order: cats before mono
    assert lines[4] == "| SP-Ideal | mono | **0.650** (0.710) | 0.350 (0.810) |"  # alone at k=0.8: no bold
    assert lines[5] == "| SP-Prac | mono | 0.550 (0.690) | — |"  # single method in its mode: nothing to bold
    assert len(lines) == 6

    # stderr of an average: sqrt(se_A^2 + se_B^2) / 2, and none while a task has no stderr
    dense = ("dense", "", None)
    assert sweep.average_stderr(rows, ["A", "B"], dense) is None
    rows.append(_row("dense", "", None, "B", "acc_stderr", 0.03))
    assert sweep.average_stderr(rows, ["A", "B"], dense) == pytest.approx((0.05 ** 2 + 0.03 ** 2) ** 0.5 / 2)

    per_task_b = {c: per["B"] for c, per in sweep.task_scores(rows).items() if "B" in per}
    assert per_task_b[("mono", "ideal", 0.8)] == pytest.approx(0.30)


def _values(**kw):
    """{(method, mode, k): value} from keywords like mono_ideal_7=0.5."""
    out = {}
    for key, value in kw.items():
        if key == "dense":
            out[("dense", "", None)] = value
            continue
        method, mode, k = key.split("_")
        out[(method, mode, int(k) / 10)] = value
    return out


def _status(checks):
    return [c["status"] for c in checks]


def test_orderings_on_hand_made_numbers(tmp_path):
    # k=0.7: dual > mono > cats > dejavu; k=0.8: mono beats dual, so the SP-Ideal ordering fails
    values = _values(dense=0.60,
                     dual_ideal_7=0.58, mono_ideal_7=0.55, cats_ideal_7=0.50, dejavu_ideal_7=0.30,
                     dual_ideal_8=0.50, mono_ideal_8=0.52, cats_ideal_8=0.45, dejavu_ideal_8=0.30,
                     mono_prac_7=0.54, cats_prac_7=0.50, mono_prac_8=0.50, cats_prac_8=0.45,
                     dual_prac_8=0.49)
    checks = sweep.orderings(values)
    assert [c["check"] for c in checks][:3] == ["SP-Ideal: dual > mono > cats > dejavu", "SP-Prac: mono > cats",
                                                "mono SP-Prac within 3% (relative) of mono SP-Ideal"]
    # mono prac vs ideal: k=0.7 loses 1/55 = 1.8% (holds), k=0.8 loses 2/52 = 3.8% (fails)
    # dual prac 0.49 < mono prac 0.50 at k=0.8; best prac at k=0.8 is mono, 0.50 / 0.60 = 83% of dense
    assert _status(checks) == ["fails", "holds", "fails", "fails", "fails"]
    assert checks[0]["details"][0].endswith("holds") and checks[0]["details"][1].endswith("fails")
    assert "loss 1.8%" in checks[2]["details"][0] and "loss 3.8%" in checks[2]["details"][1]
    assert "83.3% of dense" in checks[4]["details"][0]

    # all hold; the same numbers read as perplexities (lower is better) reverse every verdict
    good = _values(dense=0.60, dual_ideal_8=0.59, mono_ideal_8=0.55, cats_ideal_8=0.50, dejavu_ideal_8=0.30,
                   mono_prac_8=0.54, cats_prac_8=0.49, dual_prac_8=0.58)
    assert _status(sweep.orderings(good)) == ["holds"] * 5
    assert _status(sweep.orderings(good, higher_is_better=False, beyond_paper=False)) == ["fails", "fails", "holds"]

    # missing methods: verdicts only on what was measured
    partial = _values(dual_ideal_8=0.5, mono_ideal_8=0.4)
    assert _status(sweep.orderings(partial)) == ["holds where measured", "not measured", "not measured",
                                                 "not measured", "not measured"]
    assert _status(sweep.orderings(_values(dual_ideal_8=0.4, mono_ideal_8=0.4)))[0] == "fails"  # a tie is not "better"

    # from a hand-made CSV, end to end through the averages and the Markdown
    rows = [_row(m, mode, k, t, "acc", v) for (m, mode, k), v in values.items() for t in ("A", "B")]
    path = tmp_path / "m.csv"
    sweep.write_rows_atomic(path, rows)
    text = sweep.write_report(sweep.read_rows(path), tmp_path / "m.md", tmp_path / "m.png", "m", tasks=["A", "B"])
    assert "- **SP-Ideal: dual > mono > cats > dejavu**: fails" in text
    assert "  - k=0.8: dual 0.5 > mono 0.52 > cats 0.45 > dejavu 0.3: fails" in text
    assert "- **SP-Prac: mono > cats**: holds" in text
    assert (tmp_path / "m.png").stat().st_size > 0


def test_bad_input_fails_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        sweep.run_sweep("tiny", modes=("fast",), out_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown task"):
        sweep.run_sweep("tiny", tasks=("no_such_task",), out_dir=tmp_path)
    with pytest.raises(ValueError, match="limit must be an integer >= 1"):
        sweep.run_sweep("tiny", limit=0, out_dir=tmp_path)
    with pytest.raises(ValueError, match="sparsity"):
        sweep.run_sweep("tiny", sparsities=(1.5,), out_dir=tmp_path)
    (tmp_path / "old.csv").write_text("model,method,ppl\nm,dense,3.0\n")
    with pytest.raises(ValueError, match="missing columns"):
        sweep.read_rows(tmp_path / "old.csv")
    assert not any(tmp_path.glob("*.md"))


def test_command_line_arguments(monkeypatch):
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    args = parser.parse_args(["--model", "smollm2-135m", "--methods", "dense,cats,mono,dual,dejavu",
                              "--modes", "ideal,prac", "--sparsity", "0.7,0.8,0.9",
                              "--tasks", "arc_easy,arc_challenge,hellaswag,piqa,winogrande,openbookqa", "--limit", "20"])
    seen = {}
    monkeypatch.setattr(sweep.command, "run_sweep", lambda name, **kw: seen.update(name=name, **kw))
    assert sweep.sweep_from_args(args) == 0
    assert seen["name"] == "smollm2-135m" and seen["limit"] == 20
    with pytest.raises(SystemExit):  # the parse refuses it (countdown.options.sparsities), before any work
        parser.parse_args(["--sparsity", "0.7,fast"])
    assert seen["methods"] == ["dense", "cats", "mono", "dual", "dejavu"] and seen["modes"] == ["ideal", "prac"]
    assert seen["sparsities"] == [0.7, 0.8, 0.9] and len(seen["tasks"]) == 6


def test_kinded_method_spec_and_per_document_side_file(setup, tmp_path):
    out = tmp_path / "kinds"
    result = _run(setup, out, methods=("dense", "dual[lowrank]"), modes=("prac",), ppl_tokens=0, agreement_prompts=0)
    rows = sweep.read_rows(result["csv"])
    assert {(r["method"], r["mode"]) for r in rows} == {("dense", ""), ("dual[lowrank]", "prac")}
    meta = __import__("json").loads((out / "tiny.meta.json").read_text())
    assert meta["artifacts"]["dual[lowrank]"]["kind"] == "lowrank"
    # the side file: one row per (cell, per-document metric), five 0/1 outcomes averaging to the cell's acc
    docs = sweep.read_rows(result["docs"], sweep.store.DOC_FIELDS)
    for method in ("dense", "dual[lowrank]"):
        (doc,) = [d for d in docs if d["method"] == method and d["metric"] == "acc"]
        ids, values = sweep.store.decode_outcomes(doc)
        (acc,) = [float(r["value"]) for r in rows if r["method"] == method and r["metric"] == "acc"]
        assert ids == list(range(5)) and set(values) <= {0.0, 1.0} and sum(values) / 5 == pytest.approx(acc)
    # one configuration per pass: the same numbers, saved pass by pass
    single = _run(setup, tmp_path / "single", methods=("dense", "dual[lowrank]"), modes=("prac",), ppl_tokens=0,
                  agreement_prompts=0, pass_configs=1)
    assert _comparable(sweep.read_rows(single["csv"])) == _comparable(rows)
    with pytest.raises(ValueError, match=r"no SP-Prac kind 'fancy'; dual takes dual\[hybrid<d_rank>\]"):
        _run(setup, out, methods=("dual[fancy]",))
