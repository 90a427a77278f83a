"""Method specs, paired significance and what the report makes of it, on hand-made numbers."""

import math
import random

import numpy as np
import pytest

from countdown.eval import sweep
from countdown.eval.sweep import column_label, parse_methods, plan_cells, split_list
from countdown.eval.sweep.stats import PairedTests, paired_bootstrap, stderr
from countdown.eval.sweep.store import decode_outcomes, encode_outcomes


def test_method_specs_as_the_csv_labels_them():
    """The sweep parses with countdown.spec; its method column keeps its spelling: the plain method for the
    method's default kind (dual = dual[shadow4]), the canonical label otherwise."""
    assert column_label("dual[lowrank]") == "dual[lowrank]" and column_label("dual[shadow3]") == "dual[shadow3]"
    # dual's default kind (4-bit shadows) is plain dual, however it is written
    assert column_label("dual[shadow]") == column_label("dual[shadow4]") == column_label("dual[shadow4g64]") == "dual"
    assert column_label(" dejavu[ternary] ") == "dejavu[ternary]" and column_label("dejavu[lowrank]") == "dejavu"
    assert column_label("dual[hybrid]") == "dual[hybrid]" and column_label("d-countdown[hybrid64]") == "dual[hybrid64]"
    assert column_label("mono") == column_label("mono[threshold]") == "mono" and column_label("dense") == "dense"
    assert column_label("teal[uniform]") == "teal[allocation=uniform]"
    # one configuration per CSV label: dual and dual[shadow4] are one, order kept
    assert [s.label for s in parse_methods(["dual", "mono", "dual[shadow4]", "dual[shadow3]"])] == \
        ["dual", "mono", "dual[shadow3]"]
    with pytest.raises(ValueError, match=r"no SP-Prac kind 'fancy'; dual takes .*dual\[lowrank<d_rank>\]"):
        parse_methods(["dual[fancy]"])
    with pytest.raises(ValueError, match=r"kind 'lowrank' serves dual and dejavu only; mono takes mono\[threshold\]"):
        parse_methods(["mono[lowrank]"])
    with pytest.raises(ValueError, match="kind ternary takes no number"):
        parse_methods(["dual[ternary3]"])
    with pytest.raises(ValueError, match="cannot read the method spec"):
        parse_methods(["dual["])
    with pytest.raises(ValueError, match="unknown method 'nosuch'.*valid specs: dense, cats, mono, dual"):
        parse_methods(["nosuch"])
    assert split_list("dense, dual[shadow4],mono") == ["dense", "dual[shadow4]", "mono"]

    # SP-Ideal has no kinds: a kinded spec adds SP-Prac configurations only
    cells = plan_cells(["dense", "dual", "dual[lowrank]", "dual[shadow4]"], ["ideal", "prac"], [0.8], ["t"],
                       "limit=5", None, None)
    assert [(c.method, c.mode) for c in cells] == [("dense", ""), ("dual", "ideal"), ("dual", "prac"),
                                                   ("dual[lowrank]", "prac")]


def test_outcome_encoding_round_trip():
    samples = [(0, 1.0), (1, 0.0), (2, 1.0)]
    ids, values = encode_outcomes(samples)
    assert (ids, values) == ("0-2", "1 0 1")
    assert decode_outcomes({"doc_ids": ids, "values": values}) == ([0, 1, 2], [1.0, 0.0, 1.0])
    ids, values = encode_outcomes([(3, -1.25), (7, 2.5)])
    assert decode_outcomes({"doc_ids": ids, "values": values}) == ([3, 7], [-1.25, 2.5])


def _outcomes(rng, p, n):
    return {i: float(rng.random() < p) for i in range(n)}


def test_paired_bootstrap_against_closed_forms():
    a, b, dense = ("a", "ideal", 0.8), ("b", "ideal", 0.8), ("dense", "", None)
    # hand-worked: a right on every document, b on none: the difference is exactly 1 in every resample
    sure = {a: {"t": {i: 1.0 for i in range(20)}}, b: {"t": {i: 0.0 for i in range(20)}}}
    res = paired_bootstrap(sure, a, b, ["t"])
    assert (res["diff"], res["lo"], res["hi"], res["p"]) == (1.0, 1.0, 1.0, 0.0)
    assert paired_bootstrap(sure, a, a, ["t"])["hi"] == 0.0  # a configuration against itself: no difference

    # large n: the bootstrap interval of a paired mean difference matches the normal one, +-1.96 se
    rng = random.Random(0)
    n = 2000
    base = _outcomes(rng, 0.6, n)
    flipped = {i: (1.0 - v if rng.random() < 0.1 else v) for i, v in base.items()}
    out = {a: {"t": base}, b: {"t": flipped}}
    d = np.array([base[i] - flipped[i] for i in range(n)])
    se = d.std(ddof=1) / math.sqrt(n)
    res = paired_bootstrap(out, a, b, ["t"], iters=4000)
    assert res["diff"] == pytest.approx(d.mean())
    assert res["lo"] == pytest.approx(d.mean() - 1.96 * se, abs=0.25 * se)
    assert res["hi"] == pytest.approx(d.mean() + 1.96 * se, abs=0.25 * se)

    # the standard error of an average over two tasks: sqrt(se1^2 + se2^2) / 2
    two = {dense: {"t": base, "u": flipped}}
    se1 = np.std(list(base.values()), ddof=1) / math.sqrt(n)
    se2 = np.std(list(flipped.values()), ddof=1) / math.sqrt(n)
    assert stderr(two, dense, ["t", "u"]) == pytest.approx(math.sqrt(se1 ** 2 + se2 ** 2) / 2)
    assert stderr(two, dense, ["t", "v"]) is None and paired_bootstrap(two, dense, a, ["t"]) is None


def _rows_and_docs(truth, n=300):
    """Rows and side-file rows for configurations whose per-document correctness is drawn at the given rates."""
    rng = random.Random(1)
    rows, docs = [], []
    for (method, mode, k), p in truth.items():
        outcomes = [(i, float(rng.random() < p)) for i in range(n)]
        mean = sum(v for _, v in outcomes) / n
        key = {"model": "m", "method": method, "mode": mode, "sparsity": "" if k is None else f"{k:g}",
               "task": "A", "setting": "limit=300", "artifacts": ""}
        rows.append({**key, "sparsity_real": "", "metric": "acc", "value": repr(mean), "limit": "300", "n": str(n),
                     "seconds": "1", "date": "2026-11-23"})
        ids, values = encode_outcomes(outcomes)
        docs.append({**key, "metric": "acc", "n": str(n), "doc_ids": ids, "values": values})
    return rows, docs


def test_report_bolds_only_significant_and_names_what_is_not(tmp_path):
    truth = {("dense", "", None): 0.70, ("dual", "ideal", 0.8): 0.69, ("mono", "ideal", 0.8): 0.67,
             ("cats", "ideal", 0.8): 0.40, ("dejavu", "ideal", 0.8): 0.38,
             ("dual", "ideal", 0.9): 0.60, ("mono", "ideal", 0.9): 0.30}
    rows, docs = _rows_and_docs(truth)
    text = sweep.write_report(rows, tmp_path / "m.md", tmp_path / "m.png", "m", tasks=["A"], doc_rows=docs)
    table = text.split("## Average score over tasks")[1].split("\n\n")[1].splitlines()
    ideal = {line.split("|")[2].strip(): line.split("|")[3:5] for line in table if "SP-Ideal" in line}
    # k=0.9: dual 0.60 against mono 0.30 on 300 documents: significant, bold
    assert "**" in ideal["dual"][1]
    # k=0.8: dual and mono are about 0.02 apart on 300 documents: not significant, nothing bold
    assert not any("**" in cells[0] for cells in ideal.values())
    assert "±" in ideal["dual"][0]  # standard errors per cell
    # the ordering check names the comparisons that are not significant
    line = next(l for l in text.splitlines() if l.startswith("- **SP-Ideal: dual > mono > cats > dejavu**"))
    assert "not significant at 95 %" in line and "k=0.8 dual vs mono" in line
    assert "k=0.9 dual vs mono" not in line
    assert "### Difference from dense" in text
    # without per-document scores the report says there is nothing to test
    plain = sweep.write_report(rows, tmp_path / "p.md", tmp_path / "p.png", "m", tasks=["A"])
    assert "No per-document scores" in plain

    tests = PairedTests(sweep.stats.doc_outcomes(docs, rows, ["A"]), ["A"])
    assert tests.better(("dual", "ideal", 0.9), ("mono", "ideal", 0.9)) is True
    assert tests.better(("dual", "ideal", 0.8), ("mono", "ideal", 0.8)) is False


def test_a_within_claim_is_tested_against_its_margin_and_says_so():
    """mono SP-Prac half a point below SP-Ideal on 2,000 documents (0.505 vs 0.500: the two differ on
    10 documents, -1 each). The 3 % margin is -0.01515; the bootstrap's 95 % interval of the mean
    difference is about [-0.008, -0.002] (10 +- 2 sqrt(10) differing documents), above the margin:
    significant, and the text reads the interval against the margin (no p-value against 0). The
    same 10 differing documents among 100 would not be: a count of about 10 +- 6 of 100."""
    from countdown.eval.sweep.orderings import orderings

    ideal, prac = ("mono", "ideal", 0.8), ("mono", "prac", 0.8)

    def check(n, n_ideal, n_prac):
        out = {ideal: {"t": {i: float(i < n_ideal) for i in range(n)}},
               prac: {"t": {i: float(i < n_prac) for i in range(n)}}}
        checks = orderings({ideal: n_ideal / n, prac: n_prac / n}, tests=PairedTests(out, ["t"]), beyond_paper=False)
        return next(c for c in checks if c["check"].startswith("mono SP-Prac within"))

    within = check(2000, 1010, 1000)
    assert within["status"] == "holds"
    assert "against the margin -0.015: significant" in within["details"][0] and " p " not in within["details"][0]
    assert within["significance"].startswith("every comparison significant")
    assert check(100, 51, 50)["significance"].startswith("not significant")  # the same claim, too few documents
    # a loss of 3.5 points (beyond 3 % of 0.505): fails, and significantly so
    within = check(2000, 1010, 940)
    assert within["status"] == "fails" and "against the margin -0.015: significant" in within["details"][0]
