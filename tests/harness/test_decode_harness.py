"""The decode harness's arithmetic on tiny models (CPU): the weight bytes a step reads (harness.weightbytes), the
dense step per operation and its report (harness.breakdown, harness.report), the kernel classes of a profile, the
4-bit step's critical path (harness.int4profile) and the 4-bit bound's narrow width (harness.int4bound). Times are
never asserted."""

import pytest

import countdown
from conftest import tiny_model
from harness.breakdown import kernel_class, op_breakdown
from harness.int4bound import kept_width
from harness.report import _breakdown_sections, _mlp_section
from harness.timing import spread, time_graph
from harness.weightbytes import step_weight_bytes


def test_step_bytes_are_the_parameters_read():
    model = tiny_model("llama")
    mlps = countdown.find_gated_mlps(model)
    mlp_ids = {id(p) for m in mlps for p in m.module.parameters()}
    emb = model.get_input_embeddings().weight
    other = sum(p.numel() * 4 for p in model.parameters() if id(p) not in mlp_ids and p is not emb)
    assert step_weight_bytes(model, "dense", 1.0, batch=2) == other + 2 * 64 * 4 + sum(3 * 64 * 97 * 4 for _ in mlps)
    kept = 0.25
    want = other + 64 * 4 + len(mlps) * (64 * 97 * 4 + 2 * kept * 64 * 97 * 4)
    assert step_weight_bytes(model, "mono", kept) == int(want)


def test_op_breakdown_counts_each_ops_bytes():
    model = tiny_model("llama")
    rows = {r["op"]: r for r in op_breakdown(model, batch=1, cache_len=16, filled=5)}
    layers = model.model.layers
    qkv = sum(p.numel() * 4 for l in layers for m in (l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)
              for p in m.parameters())
    assert rows["QKV projections"]["bytes"] == qkv and rows["QKV projections"]["calls"] == len(layers)
    assert rows["lm_head"]["bytes"] == model.lm_head.weight.numel() * 4
    assert rows["attention (SDPA)"]["bytes"] == len(layers) * 2 * 2 * 16 * 16 * 4  # K and V: 2 heads x 16 x 16
    assert all(r["us"] > 0 for r in rows.values())
    assert time_graph([lambda: None]) >= 0
    assert spread([3.0, 1.0, float("nan"), 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    ops = list(rows.values())
    timed = "\n".join(_breakdown_sections({"copy_gbps": 100.0, "breakdown": {"1": {"ops": ops, "step_ms": 2.0}}}))
    assert "against the compiled step's 2.00 ms" in timed and "lm_head" in timed
    untimed = "\n".join(_breakdown_sections({"copy_gbps": 100.0, "breakdown": {"1": {"ops": ops, "step_ms": None}}}))
    assert "(no compiled step timed)" in untimed and "lm_head" in untimed


def test_profile_classes_name_every_kernel_of_a_decode_step():
    """Kernel names of a profiled decode step (ours: their @triton.jit functions' names), each in its class."""
    seen = {"linear_kernel": "countdown fixed GEMV (projections, indicators)",
            "rmsnorm_kernel": "countdown norms and residual adds", "add_kernel": "countdown norms and residual adds",
            "partial_sums_kernel": "countdown sparse kernels", "one_token_kernel": "countdown sparse kernels",
            "teal_gate_up_kernel": "countdown sparse kernels", "shadow_gemv_kernel": "countdown shadow GEMV",
            "x_prepare_kernel": "countdown shadow GEMV", "rope_split_kernel": "attention",
            "rope_combine_kernel": "attention", "triton_red_fused__unsafe_view_argmax_mm_select_7": "sampling (argmax)",
            "triton_red_fused__to_copy_add_mean_mm_mul_pow_rsqrt_t_view_6": "RMSNorm (+ fused GEMV)",
            "Memcpy DtoD (Device -> Device)": "copy / index", "some_new_kernel": "other"}
    assert {name: kernel_class(name) for name in seen} == seen


def test_profile_classes_know_every_kernel_of_the_library():
    """Every @triton.jit kernel of countdown.kernels (a profile names it by its function) falls in one of our classes
    or attention, not in "other" or Inductor's classes; the 4-bit prompt's de-quantization is no decode step's."""
    import importlib
    import pkgutil

    import countdown.kernels
    from triton.runtime.jit import KernelInterface

    names = set()
    for info in pkgutil.walk_packages(countdown.kernels.__path__, "countdown.kernels."):
        module = importlib.import_module(info.name)
        names |= {name for name, value in vars(module).items()
                  if isinstance(value, KernelInterface) and name.endswith("_kernel")}
    assert {"one_token_kernel", "int4_gemv_kernel", "rows_other_kernel", "teal_down_kernel"} <= names
    prompt_only = {"dequant_kernel", "nested_dequant_kernel"}  # a prompt's de-quantization (4-bit, nested 8-bit)
    classes = {name: kernel_class(name) for name in names - prompt_only}
    assert {name: c for name, c in classes.items() if not (c.startswith("countdown ") or c == "attention")} == {}
    assert all(kernel_class(name) == "other" for name in prompt_only)


def test_report_gives_each_rows_mlp_time_in_the_step_from_the_floor():
    """Hand-worked: a 2.0 ms step over a 1.2 ms floor of 32 layers is (2.0 - 1.2) / 32 ms = 25.0 us a
    layer; the cap is the floor's tokens/s over the dense reference's (800 / 250 = 3.20x)."""
    rows = [dict(method="dense", harness="compile-cdt", sparsity="", kernel_us="", tokens_per_s="250",
                 speedup_vs_compiled="1.0", ms_per_step="4.0"),
            dict(method="mono", harness="one-compile", sparsity="0.9", kernel_us="44.0", kernel_roofline_us="33.0",
                 kernel_sparsity_real="0.9", mlp_speedup="2.2", tokens_per_s="480", speedup_vs_compiled="1.92",
                 ms_per_step="2.0", dense_compiled_tokens_per_s="250")]
    text = "\n".join(_mlp_section(rows, {"floor": {"ms_per_step": 1.2, "tokens_per_s": 800.0, "layers": 32}}))
    assert "| mono | 0.9 | 0.9 | 44.0 | 33.0 | 1.33x | 2.20x | 25.0 |" in text
    assert "1.200 ms" in text and "(250.0 tokens/s) no MLP method can pass 3.20x" in text
    assert "| 2.20x | - |" in "\n".join(_mlp_section(rows, {}))  # no floor measured: no in-step figure


def test_step_profile_charges_each_kernel_its_cost_to_the_critical_path():
    """Hand-worked: a 0-10, b 5-12 (overlapping a: charged 10-12), idle 12-15, a 15-20; c 16-18 inside a: charged
    nothing; idle 20-21, b 21-22; each gap is named by the kernel that ends it; two steps halve everything."""
    from harness.int4profile import charge

    got = {name: (calls, us) for name, calls, us in charge([(15, 20, "a"), (0, 10, "a"), (5, 12, "b"),
                                                           (16, 18, "c"), (21, 22, "b")], 2)}
    assert got == {"a": (1.0, 7.5), "b": (1.0, 1.5), "<idle> before a": (0.5, 1.5), "c": (0.5, 0.0),
                   "<idle> before b": (0.5, 0.5)}


def test_bound_kept_width_rounds_down_to_whole_slices():
    """The bound's narrow model (harness.int4bound): (1 - k) d_inter rounded down to whole 1,024-column
    slices (fewer rows than k keeps: a generous bound), one group's columns on a small model, k in [0, 1)."""
    assert kept_width(14336, 0.7) == 4096  # 4,300.8 rows kept -> 4 slices
    assert kept_width(14336, 0.5) == 7168 and kept_width(14336, 0.9) == 1024 and kept_width(14336, 0.0) == 14336
    assert kept_width(14336, 0.99) == 1024  # at least one slice
    assert kept_width(512, 0.7) == 128  # under 8 slices: whole groups
    with pytest.raises(ValueError, match=r"in \[0, 1\); got 1.0"):
        kept_width(14336, 1.0)
