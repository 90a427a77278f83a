"""`countdown bench` times dense and every configuration alternately, gives each speed-up with its spread over the
rounds, and recommends nothing whose spread reaches 1.0x. Timings are scripted here (never measured in a test)."""

import csv
import math

import pytest

import countdown
import countdown.bench.speedonly as speedonly
from conftest import tiny_model
from countdown.bench import operating
from countdown.bench.cli import main as bench_main
from countdown.bench.opreport import recommendation, recommended
from countdown.patch.state import state_of


def test_paired_speedups_hand_worked():
    # dense 100, then 121, then 100: the references of the two rounds are sqrt(100 * 121) = 110 and 110
    got = operating.paired_speedups([100.0, 121.0, 100.0], [[110.0, 99.0], [220.0, 231.0]])
    assert got[0] == pytest.approx({"decode_speedup": 0.95, "speedup_min": 0.9, "speedup_max": 1.0,
                                    "tokens_per_s": 104.5, "dense_tokens_per_s": 110.0, "samples": 2})
    assert got[1] == pytest.approx({"decode_speedup": 2.05, "speedup_min": 2.0, "speedup_max": 2.1,
                                    "tokens_per_s": 225.5, "dense_tokens_per_s": 110.0, "samples": 2})
    with pytest.raises(ValueError, match="3 timings of a configuration against 2 rounds"):
        operating.paired_speedups([1.0, 1.0, 1.0], [[1.0, 1.0, 1.0]])


@pytest.fixture
def scripted(monkeypatch):
    """Each timing in order: ("dense", None) or (spec label, k); the machine slows down by half at every dense
    timing, and each configuration runs at a fixed multiple of the dense speed of the moment."""
    model = tiny_model("llama")
    events, speed = [], {"dense": 1000.0}
    factor = {("mono[threshold]", 0.8): 0.9, ("mono[threshold]", 0.5): 1.25}
    current = {}
    real_retarget = speedonly.retarget

    def retarget(m, art, k):
        current["k"] = k
        return real_retarget(m, art, k)

    def timed(m, prompt, s, harness):
        if not countdown.is_sparsified(m):
            events.append(("dense", None))
            speed["dense"] /= 2
            return speed["dense"] * 2
        key = (state_of(m).spec.label, current["k"])
        events.append(key)
        # the dense speed now: between the last dense timing and the next one (geometric mean)
        return factor[key] * speed["dense"] * 2 / math.sqrt(2)

    monkeypatch.setattr(speedonly, "retarget", retarget)
    monkeypatch.setattr(operating, "_time", timed)
    return model, events


def test_dense_and_the_configurations_alternate_and_drift_cancels(scripted):
    model, events = scripted
    settings = operating.BenchSettings(specs=["mono"], ks=[0.5, 0.8], speed_only=True, new_tokens=4, prompt=6,
                                       samples=3)
    rows = operating.operating_points(model, None, settings, model_name="tiny", log=lambda m: None, progress=False)
    round_ = [("mono[threshold]", 0.8), ("mono[threshold]", 0.5)]
    assert events == [("dense", None)] + (round_ + [("dense", None)]) * 3
    dense, mono8, mono5 = rows
    # the machine halved its speed at every dense timing: timed once, first, dense would make mono 0.8 look
    # (0.9 / sqrt(2)) / 2 ** r of dense; paired with the dense timings around each round, it is 0.9 every time
    assert (mono8["method"], mono8["sparsity"]) == ("mono[threshold]", 0.8)
    assert mono8["decode_speedup"] == pytest.approx(0.9) and mono8["speedup_min"] == pytest.approx(0.9)
    assert mono8["speedup_max"] == pytest.approx(0.9) and mono5["decode_speedup"] == pytest.approx(1.25)
    assert mono8["samples"] == 3 and dense["samples"] == 4
    # dense: its four timings 1000, 500, 250, 125 over their median 375
    assert dense["tokens_per_s"] == pytest.approx(375.0)
    assert (dense["speedup_min"], dense["speedup_max"]) == pytest.approx((125 / 375, 1000 / 375))
    assert not countdown.is_sparsified(model)


def _row(method, k, inc, speedup, low=None, high=None):
    row = {"method": method, "sparsity": k, "sparsity_real": k, "ppl_increase": inc, "decode_speedup": speedup}
    if low is not None:
        row.update(speedup_min=low, speedup_max=high, samples=3)
    return row


def test_nothing_whose_spread_reaches_one_is_recommended():
    rows = [_row("dense", 0.0, 0.0, 1.0, 0.97, 1.02), _row("mono", 0.5, 0.04, 1.30, 0.95, 1.40),
            _row("dual[shadow4]", 0.5, 0.02, 1.10, 1.02, 1.15), _row("cats", 0.5, 0.30, 1.5, 1.4, 1.6)]
    assert recommended(rows, 0.05)["method"] == "dual[shadow4]"  # not mono: one of its rounds was slower than dense
    line = recommendation(rows, 0.05)
    assert line.startswith("for at most 5 % perplexity increase, use dual[shadow4] at k=0.5 (+2.0 %")
    assert line.endswith("1.10x (1.02-1.15x over 3 rounds) faster")
    rows[2].update(speedup_min=0.99)
    assert recommended(rows, 0.05) is None
    line = recommendation(rows, 0.05)
    assert "no configuration is faster than dense beyond the run-to-run spread" in line and "stay dense" in line
    assert "mono at k=0.5 (+4.0 %), runs 1.30x (0.95-1.40x over 3 rounds)" in line
    # speed only: the same rule
    speed = [{**r, "ppl_increase": ""} for r in rows]
    assert recommended(speed, 0.05)["method"] == "cats"
    speed[3].update(speedup_min=0.8)
    assert recommended(speed, 0.05) is None
    assert "no configuration is faster than the dense decoder beyond the run-to-run spread" in recommendation(speed)
    # one timing, no spread: the value itself decides (a merged table's rows)
    assert recommended([_row("dense", 0.0, 0.0, 1.0), _row("mono", 0.5, 0.01, 0.98)], 0.05) is None


def test_the_bench_prints_and_writes_each_ratio_with_its_spread(scripted, monkeypatch, tmp_path, capsys):
    model, events = scripted
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, None))  # speed only
    out = tmp_path / "out"
    assert bench_main(["--model", "tiny-shape", "--methods", "mono", "-k", "0.5,0.8", "--new-tokens", "4",
                       "--prompt", "6", "--samples", "2", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "speed-up (min-max)" in printed and "1.25x (1.25-1.25)" in printed
    assert "the fastest is mono[threshold] at k=0.5: 1.25x (1.25-1.25x over 2 rounds) the dense decoder" in printed
    rows = list(csv.DictReader(open(out / "tiny-shape.csv")))
    assert [(r["method"], r["samples"]) for r in rows] == [("dense", "3"), ("mono[threshold]", "2"), ("mono[threshold]", "2")]
    assert float(rows[1]["speedup_min"]) == pytest.approx(0.9) == float(rows[1]["speedup_max"])
    assert "| 1.25x (1.25-1.25x, 2 rounds) |" in (out / "tiny-shape.md").read_text()


def test_a_table_of_an_earlier_release_keeps_its_rows(scripted, monkeypatch, tmp_path):
    """A bench table written before the mlp_bits column is taken as one (not refused as another file): its rows stay,
    with that column empty, and this run's rows follow with theirs."""
    model, _ = scripted
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, None))  # speed only
    out = tmp_path / "out"
    out.mkdir()
    old = [c for c in operating.COLUMNS if c not in operating.NEW_COLUMNS] + ["run"]
    with open(out / "tiny-shape.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=old)
        writer.writeheader()
        writer.writerow({"model": "tiny-shape", "method": "dense", "sparsity": "0.0", "run": "earlier"})
    assert bench_main(["--model", "tiny-shape", "--methods", "mono", "-k", "0.5", "--new-tokens", "4", "--prompt", "6",
                       "--samples", "1", "--out", str(out), "--no-progress"]) == 0
    rows = list(csv.DictReader(open(out / "tiny-shape.csv")))
    assert [(r["run"], r["method"]) for r in rows][0] == ("earlier", "dense") and rows[0]["mlp_bits"] == ""
    assert [r["method"] for r in rows[1:]] == ["dense", "mono[threshold]"] and float(rows[1]["mlp_bits"]) == 32.0
