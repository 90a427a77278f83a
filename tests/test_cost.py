import json

import pytest

from countdown import kept_rows
from countdown.eval.cost import cost_table, format_cost_table

LLAMA = dict(d_model=4096, d_inter=14336, d_rank=512)

# The paper's efficiency table (Llama-3.1-8B-Instruct): (k, method) -> (FLOPs(M), Mem.(MB)).
PAPER = {
    (0.7, "cats"): (188.00, 89.746), (0.7, "mono"): (187.95, 89.719), (0.7, "dual"): (124.59, 59.480),
    (0.8, "cats"): (164.52, 78.550), (0.8, "mono"): (164.46, 78.522), (0.8, "dual"): (89.37, 42.684),
    (0.9, "cats"): (141.02, 67.345), (0.9, "mono"): (140.96, 67.318), (0.9, "dual"): (54.11, 25.877),
}


@pytest.mark.parametrize("k", [0.7, 0.8, 0.9])
def test_dense_matches_paper(k):
    dense = cost_table(**LLAMA, sparsity=k)["dense"]
    assert round(dense["flops_m"], 2) == 352.41
    assert round(dense["mem_mb"], 3) == 168.121


@pytest.mark.parametrize("k, method", sorted(PAPER))
def test_flops_match_paper_to_printed_precision(k, method):
    assert round(cost_table(**LLAMA, sparsity=k)[method]["flops_m"], 2) == PAPER[k, method][0]


@pytest.mark.parametrize("k, method", sorted(PAPER))
def test_memory_matches_paper(k, method):
    mem = cost_table(**LLAMA, sparsity=k)[method]["mem_mb"]
    if method == "dual":
        # The paper prints D-CountDown's memory 0.005-0.011 below its own formula (docs/cost.md).
        assert 0.0 < mem - PAPER[k, method][1] <= 0.011
    else:
        assert round(mem, 3) == PAPER[k, method][1]


@pytest.mark.parametrize("k", [0.7, 0.8, 0.9])
def test_dual_memory_gap_is_d_inter_minus_two_s(k):
    # The printed D-CountDown figures equal the formula minus (d_i - 2 s) elements, to printed precision.
    entry = cost_table(**LLAMA, sparsity=k)["dual"]
    s = entry["kept_rows"]
    assert round((entry["mem_elements"] - (14336 - 2 * s)) / 2**20, 3) == PAPER[k, "dual"][1]


def test_d_rank_512_is_the_one_the_paper_used():
    for d_rank in (128, 256, 1024):
        assert round(cost_table(4096, 14336, d_rank, 0.7)["dual"]["flops_m"], 2) != 124.59


def test_kept_rows_is_the_kept_count_not_the_skipped_one():
    assert [kept_rows(14336, k) for k in (0.7, 0.8, 0.9)] == [4300, 2867, 1433]
    assert kept_rows(1000, 0.7) == 300  # 1000 * (1 - 0.7) = 299.99999999999994
    assert kept_rows(10, 0.99) == 1


def test_tiny_hand_worked_example():
    # d_m=2, d_i=4, d_r=1, k=0.5 -> s=2, c_act=5.
    t = cost_table(2, 4, 1, 0.5)
    # dense: 6*2*4 + 5*4 + 4 = 72
    # cats : 2*2*4 + 5*4 + 2*4 + 2*2*2 + 2 + 2*2*2 = 16+20+8+8+2+8 = 62
    # mono : 2*2*4 + 2*4 + 2*2*2 + 5*2 + 2 + 2*2*2 = 16+8+8+10+2+8 = 52
    # dual : 2*2*1 + 2*1*4 + 4 + 4*2*2 + 5*2 + 2 + 2*2*2 = 4+8+4+16+10+2+8 = 52
    # teal (s_x = 1 kept input): 2*2 + 4*4*1 + 5*4 + 4 + 2*4 + 2*2*2 = 4+16+20+4+8+8 = 60
    assert {m: e["flops"] for m, e in t.items()} == {"dense": 72, "cats": 62, "mono": 52, "dual": 52, "teal": 60}
    # dense: 2*8 + 2*2 + 2*4 + 4 + 4 + 2*4 + 4 + 8 + 4 + 2 = 62
    # cats : 8 + 2 + 7*4 + 2*2 + 2 + 2 + 4 + 4 + 2*2 + 4 + 2 = 64 (more than dense at this size)
    # mono : 8 + 2 + 5*4 + 2*2 + 2 + 2 + 4 + 4 + 2*2 + 4 + 2 = 56
    # dual : 2 + 2 + 1 + 4 + 1 + 3*4 + 2*2*2 + 2 + 4 + 4 + 2*2 + 4 + 2 = 50
    # teal : 3*2 (x, sparse x) + 2*4*1 (kept columns of W_gate, W_up) + 8*4 (gate, up, inter, sparse
    #        inter) + 2*2 (kept columns of W_down) + 2 (y) = 6+8+32+4+2 = 52
    assert {m: e["mem_elements"] for m, e in t.items()} == {"dense": 62, "cats": 64, "mono": 56, "dual": 50,
                                                            "teal": 52}
    assert t["dense"]["kept_rows"] == 4 and t["dual"]["kept_rows"] == 2
    assert t["teal"]["kept_rows"] == 2 and t["teal"]["kept_inputs"] == 1
    assert t["cats"]["flops_m"] == pytest.approx(62e-6)
    assert t["mono"]["mem_mb"] == pytest.approx(56 / 2**20)


def test_c_act_only_scales_activation_terms():
    a, b = cost_table(2, 4, 1, 0.5, c_act=0), cost_table(2, 4, 1, 0.5, c_act=5)
    # the activation runs on all d_i rows for dense, cats and teal, on the s kept rows for mono and dual
    assert {m: b[m]["flops"] - a[m]["flops"] for m in a} == {"dense": 20, "cats": 20, "mono": 10, "dual": 10,
                                                             "teal": 20}
    assert all(a[m]["mem_elements"] == b[m]["mem_elements"] for m in a)


def test_dtype_bytes_gives_real_traffic():
    t = cost_table(**LLAMA, sparsity=0.7, dtype_bytes=2)
    assert t["dense"]["mem_bytes"] == 2 * t["dense"]["mem_elements"]
    assert round(t["dense"]["mem_mib"], 3) == 336.242
    assert "mem_bytes" not in cost_table(**LLAMA, sparsity=0.7)["dense"]


def test_format_and_json():
    t = cost_table(**LLAMA, sparsity=0.7, dtype_bytes=2)
    text = format_cost_table(t, title="k=0.7")
    lines = text.splitlines()
    assert lines[0] == "k=0.7" and "FLOPs(M)" in lines[1]
    assert len(lines) == 3 + 5  # dense, cats, mono, dual, teal
    dual = next(line for line in lines if line.startswith("dual"))
    assert "124.59" in dual and "59.485" in dual and "0.354" in dual
    assert json.loads(json.dumps(t))["mono"]["mem_elements"] == t["mono"]["mem_elements"]


@pytest.mark.parametrize("k", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_sparsity_outside_open_interval_errors(k):
    with pytest.raises(ValueError, match="sparsity"):
        cost_table(**LLAMA, sparsity=k)


@pytest.mark.parametrize("dims", [(0, 4, 1), (2, -4, 1), (2, 4, 0), (2.5, 4, 1), (True, 4, 1)])
def test_non_positive_or_non_integer_dims_error(dims):
    with pytest.raises((ValueError, TypeError), match="must be an integer >= 1"):  # countdown.options' range
        cost_table(*dims, 0.5)


def test_bad_c_act_and_dtype_bytes_error():
    with pytest.raises(ValueError, match="c_act"):
        cost_table(2, 4, 1, 0.5, c_act=-1)
    with pytest.raises(ValueError, match="dtype_bytes"):
        cost_table(2, 4, 1, 0.5, dtype_bytes=0)
