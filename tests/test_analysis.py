import json
import math

import pytest
import torch
import torch.nn.functional as F

from countdown.eval.analysis import (
    collect_indicator_stats,
    format_indicator_stats,
    indicator_counts,
    indicator_factors,
    plot_tornado,
    top_mask,
)

# Two tokens, d_inter = 4. Token 2 has negative entries: masks rank by magnitude.
U = torch.tensor([[4.0, 3.0, 1.0, 0.5], [-3.0, 0.2, 2.0, 1.0]])
H = torch.tensor([[0.5, 2.0, 3.0, 1.0], [0.6, 4.0, -0.1, 1.5]])
S = U * H  # [[2, 6, 3, 0.5], [-1.8, 0.8, -0.2, 1.5]]


def test_top_mask_keeps_largest_magnitudes():
    assert top_mask(S, 0.5).tolist() == [[False, True, True, False], [True, False, False, True]]
    assert top_mask(U, 0.75).tolist() == [[True, False, False, False], [True, False, False, False]]
    assert top_mask(H, 0.75).tolist() == [[False, False, True, False], [False, True, False, False]]


def test_hand_worked_k_half():
    # k = 0.5 keeps 2 of 4 rows.  S = {1,2} | {0,3};  U = {0,1} | {0,2};  H = {1,2} | {1,3}.
    # |S| = |~S| = 4.
    # u alive: S&~H = {} | {0} -> 1;  & U -> {0} -> 1.
    # h alive: S&~U = {2} | {3} -> 2;  & H -> {2} | {3} -> 2.
    # u dead : ~S&H = {} | {1} -> 1;  & ~U -> {1} -> 1.
    # h dead : ~S&U = {0} | {2} -> 2;  & ~H -> {0} | {2} -> 2.
    f = indicator_factors(U, H, S, [0.5])[0.5]
    assert f["u"] == {"cif_alive": 0.25, "cif_dead": 0.25, "caf_alive": 0.25, "caf_dead": 0.25}
    assert f["h"] == {"cif_alive": 0.5, "cif_dead": 0.5, "caf_alive": 0.5, "caf_dead": 0.5}


def test_hand_worked_k_three_quarters():
    # k = 0.75 keeps 1 row.  S = {1} | {0};  U = {0} | {0};  H = {2} | {1}.  |S| = 2, |~S| = 6.
    # u alive: S&~H = {1} | {0} -> 2;  & U -> {} | {0} -> 1.
    # h alive: S&~U = {1} | {} -> 1;  & H -> {} -> 0.
    # u dead : ~S&H = {2} | {1} -> 2;  & ~U -> {2} | {1} -> 2.
    # h dead : ~S&U = {0} | {} -> 1;  & ~H -> {0} -> 1.
    counts = indicator_counts(U, H, S, 0.75)
    assert counts == {"alive": 2, "dead": 6,
                      "u_cif_alive": 2, "u_caf_alive": 1, "u_cif_dead": 2, "u_caf_dead": 2,
                      "h_cif_alive": 1, "h_caf_alive": 0, "h_cif_dead": 1, "h_caf_dead": 1}
    f = indicator_factors(U, H, S, 0.75)[0.75]
    assert f["u"] == pytest.approx({"cif_alive": 1.0, "caf_alive": 0.5, "cif_dead": 1 / 3, "caf_dead": 1 / 3})
    assert f["h"] == pytest.approx({"cif_alive": 0.5, "caf_alive": 0.0, "cif_dead": 1 / 6, "caf_dead": 1 / 6})


def test_identities_on_random_data():
    gen = torch.Generator().manual_seed(0)
    u, g = torch.randn(50, 64, generator=gen), torch.randn(50, 64, generator=gen)
    h = F.silu(g)
    for k in (0.5, 0.7, 0.9):
        c = indicator_counts(u, h, u * h, k)
        kept = 50 * int(64 * (1 - k) + 1e-9)
        assert c["alive"] == kept and c["alive"] + c["dead"] == 50 * 64
        for v in ("u", "h"):
            # equal-size masks: |S & ~H| = |H & ~S|, and CAF never exceeds CIF
            assert c[f"{v}_cif_alive"] == c[f"{v}_cif_dead"]
            assert c[f"{v}_caf_alive"] <= c[f"{v}_cif_alive"]
            assert c[f"{v}_caf_dead"] <= c[f"{v}_cif_dead"]


def test_signal_equal_to_s_gets_all_agreement():
    # If u's mask is s's mask, u agrees with s wherever h disagrees, and h never agrees against u.
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(20, 32, generator=gen)
    h = torch.ones_like(u) + 1e-3 * torch.rand(20, 32, generator=gen)  # nearly constant: S == U
    s = u * h
    assert torch.equal(top_mask(s, 0.7), top_mask(u, 0.7))
    f = indicator_factors(u, h, s, [0.7])[0.7]
    assert f["u"]["caf_alive"] == f["u"]["cif_alive"] > 0
    assert f["u"]["caf_dead"] == f["u"]["cif_dead"] > 0
    assert f["h"]["cif_alive"] == f["h"]["caf_alive"] == 0.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        indicator_counts(U, H, S[:, :3], 0.5)
    for k in (0.0, 1.0, -0.2):
        with pytest.raises(ValueError, match="sparsity"):
            indicator_factors(U, H, S, [k])


def test_format_and_tornado(tmp_path):
    stats = indicator_factors(U, H, S, [0.5, 0.75])
    text = format_indicator_stats(stats)
    lines = text.splitlines()
    assert "CIF(u,alive)" in lines[0] and "CAF(h,dead)" in lines[0] and len(lines) == 3
    assert lines[2].split()[:3] == ["0.75", "1.000", "0.500"]
    path = plot_tornado(stats, tmp_path / "sub" / "tornado.png", title="hand-built")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(stats))["0.75"]["u"]["caf_alive"] == 0.5


# --- model-level driver on a tiny random Llama ----------------------------------------------------

class ByteTokenizer:
    """Stands in for a HF tokenizer: one token per byte, folded into a 128-word vocabulary."""

    def __call__(self, text, return_tensors="pt"):
        return {"input_ids": torch.tensor([[b % 128 for b in text.encode()]])}


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config).to(torch.float64).eval()


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Sparse activation skips rows.", "unused text"]


def _direct_float64(model, texts, max_tokens, ks):
    """Reference: MLP inputs captured on each layer's .mlp, u/h/s from the raw weights in float64."""
    inputs = {i: [] for i in range(len(model.model.layers))}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0].reshape(-1, 64)))
             for i, layer in enumerate(model.model.layers)]
    tokens = 0
    with torch.no_grad():
        for text in texts:
            ids = ByteTokenizer()(text)["input_ids"][:, : max_tokens - tokens]
            if ids.numel() == 0:
                break
            model(input_ids=ids)
            tokens += ids.shape[1]
    for h in hooks:
        h.remove()
    out = {}
    for i, layer in enumerate(model.model.layers):
        x = torch.cat(inputs[i]).double()
        u = x @ layer.mlp.up_proj.weight.double().T
        h = F.silu(x @ layer.mlp.gate_proj.weight.double().T)
        out[i] = {k: indicator_counts(u, h, u * h, k) for k in ks}
    return tokens, out


def test_driver_matches_direct_float64(tiny_llama):
    ks = [0.5, 0.7, 0.9]
    max_tokens = 60  # the first text (44 bytes) whole, the second cut to 16
    stats = collect_indicator_stats(tiny_llama, ByteTokenizer(), TEXTS, ks, max_tokens=max_tokens)
    tokens, ref = _direct_float64(tiny_llama, TEXTS, max_tokens, ks)
    assert stats["tokens"] == tokens == 60 and stats["texts"] == 2
    assert stats["sparsities"] == ks
    assert list(stats["layers"]) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for i, name in enumerate(stats["layers"]):
        for k in ks:
            got = stats["layers"][name][k]
            c = ref[i][k]
            for v in ("u", "h"):
                for f, denom in (("cif_alive", "alive"), ("caf_alive", "alive"),
                                 ("cif_dead", "dead"), ("caf_dead", "dead")):
                    assert got[v][f] == pytest.approx(c[f"{v}_{f}"] / c[denom], abs=1e-12)
    # overall pools both layers' counts; each layer has the same number of tokens and rows
    for k in ks:
        for v in ("u", "h"):
            mean = sum(stats["layers"][n][k][v]["cif_alive"] for n in stats["layers"]) / 2
            assert stats["overall"][k][v]["cif_alive"] == pytest.approx(mean, abs=1e-12)
    # a real model gives non-trivial, bounded factors
    assert all(0.0 < stats["overall"][k]["u"]["cif_alive"] < 1.0 for k in ks)
    json.dumps(stats)


def test_driver_leaves_no_hooks_and_rejects_empty(tiny_llama):
    before = [len(layer.mlp._forward_pre_hooks) for layer in tiny_llama.model.layers]
    with pytest.raises(ValueError, match="holds no text"):  # a blank text: refused before the model runs
        collect_indicator_stats(tiny_llama, ByteTokenizer(), [""], [0.7])
    collect_indicator_stats(tiny_llama, ByteTokenizer(), ["hello"], [0.7], max_tokens=3)  # a list: the text
    assert [len(layer.mlp._forward_pre_hooks) for layer in tiny_llama.model.layers] == before


def test_driver_refuses_a_sparsified_model(tiny_llama):
    import countdown

    countdown.sparsify(tiny_llama, "mono", 0.5)
    try:
        with pytest.raises(ValueError, match="unsparsify"):
            collect_indicator_stats(tiny_llama, ByteTokenizer(), TEXTS, [0.7])
    finally:
        countdown.unsparsify(tiny_llama)


def test_driver_runs_in_bfloat16(tiny_llama):
    import copy

    model = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    stats = collect_indicator_stats(model, ByteTokenizer(), TEXTS, [0.7], max_tokens=40)
    f = stats["overall"][0.7]
    assert stats["tokens"] == 40
    assert all(0.0 <= f[v][name] <= 1.0 for v in ("u", "h") for name in f[v])
