"""harness.mlpbench / kerneltable: the kernel-timing harness of benchmarks/mlp_kernels.py, few.py and shadow.py
(CPU, tiny shapes; speeds are never asserted)."""

import csv

import torch

from countdown.kernels.config import launch_config
from harness import mlpbench
from harness.kerneltable import write_outputs


def test_gap_threshold_sits_between_two_distinct_values_near_the_quantile():
    v = torch.tensor([0.0, 1.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0])
    cut = mlpbench.gap_threshold(v, 0.5)
    distinct = torch.unique(v.double())
    assert not (distinct == cut).any()  # never on a value: an ulp cannot flip a tied row
    below, above = distinct[distinct < cut].max(), distinct[distinct > cut].min()
    assert (below + above) / 2 == cut
    assert abs(float((v > cut).float().mean()) - 0.5) <= 1 / len(v) + 1e-9


def test_problem_thresholds_keep_about_one_minus_k():
    p = mlpbench.Problem(32, 200, "silu", batch=2, rank=8, seed=0)
    assert len(p.xs) == mlpbench.NSLOTS and len(p.sets) == mlpbench.NSETS
    assert p.w(mlpbench.NSETS) is p.sets[0]  # weights rotate with the slot
    masks, _ = p.masks(0.8)
    for name, ms in masks.items():
        kept = torch.stack([m.float().mean() for m in ms]).mean().item()
        assert abs(kept - 0.2) < 0.02, name
    x, w = p.xs[0], p.w(0)
    y = mlpbench.dense_chain(x, w["wg"], w["wu"], w["wd"], "silu")
    assert y.shape == (2, 32)


def test_patched_changes_every_bucket_for_the_block():
    before = {b: launch_config("chain_down", bucket=b) for b in (1, 16)}
    with mlpbench.patched("chain_down", CHUNK=64):
        assert all(launch_config("chain_down", bucket=b) == {**before[b], "CHUNK": 64} for b in (1, 16))
    assert {b: launch_config("chain_down", bucket=b) for b in (1, 16)} == before


def test_safe_time_gives_nan_for_a_failing_variant(capsys):
    def boom():
        raise RuntimeError("no such kernel")

    assert mlpbench.safe_time("broken", [boom]) != mlpbench.safe_time("broken", [boom])  # NaN
    assert "FAILED broken" in capsys.readouterr().out


def test_write_outputs_writes_the_table(tmp_path):
    rows = [dict(device="cpu", shape="tiny", method=m, sparsity=k, batch=1, us=us, roofline_us=2.0, dense_us=8.0,
                 speedup=8.0 / us, bytes=100, kept_frac=1 - k, union_frac=1 - k, note="")
            for m, k, us in (("dense", 0.0, 8.0), ("mono", 0.8, 4.0))]
    meta = dict(device="cpu", date="2026-01-01", command="x", bw=1e12, torch="t", triton="t", rank=8)
    write_outputs(rows, str(tmp_path), meta)
    got = list(csv.DictReader(open(tmp_path / "kernels.csv")))
    assert [r["method"] for r in got] == ["dense", "mono"]
    md = (tmp_path / "kernels.md").read_text()
    assert "| tiny | mono | 0.80 | 4.0 | 2.0 | 2.00 | 2.00 | 0.200 (0.200) |" in md
