"""Same command, same environment, same numbers: perplexity repeated and under another thread
count, and the demo's resume reusing only cells of the same environment."""

import pytest
import torch

import countdown
import countdown.eval.grid as ppl_grid
from conftest import tiny_model
from test_perplexity import TEXTS, CharTokenizer


def _sparse_ppl(model, tok, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        countdown.sparsify(model, "cats", 0.8, scope="all")
        try:
            return countdown.perplexity(model, tok, TEXTS * 3, max_tokens=240, window=48, batch_size=2,
                                        progress=False)
        finally:
            countdown.unsparsify(model)
    finally:
        torch.set_num_threads(before)


def test_sparse_perplexity_is_bitwise_repeatable_and_thread_count_free():
    model, tok = tiny_model("llama"), CharTokenizer()
    first = _sparse_ppl(model, tok, threads=2)
    assert _sparse_ppl(model, tok, threads=2) == first  # exactly, not approximately
    # Another thread count is another environment (demo.run_environment keys on it): ATen and the BLAS may split a
    # reduction across threads, the same float32 sums in another order. Under ATEN_CPU_CAPABILITY=default with MKL
    # held to AVX2 that moved this perplexity by 1.3e-7 of itself (bitwise equal on the other CPU paths here).
    # Reordered float32 sums (2^-24 a rounding) moved the logits (|logit| <= 1.03) by 2.4e-7 at most there; a
    # log-softmax moves by at most twice its inputs' largest change, so the mean log-likelihood, hence the
    # perplexity's relative value, by < 5e-7: rel 1e-6. A 1 % error fails.
    assert _sparse_ppl(model, tok, threads=1) == pytest.approx(first, rel=1e-6, abs=0)
    dense = countdown.perplexity(model, tok, TEXTS * 3, max_tokens=240, window=48, progress=False)
    assert first != dense  # the sparse model really differs: the equalities above are not vacuous


def test_demo_resume_reuses_only_cells_of_the_same_environment(tmp_path, monkeypatch):
    model, tok = tiny_model("qwen2"), CharTokenizer()
    configs = [("dense", "ideal", None), ("mono", "ideal", 0.8)]
    grid = dict(texts=TEXTS * 3, max_tokens=600, styles=("all",), log=lambda *a: None)
    first = ppl_grid.run_grid(model, tok, "tiny", configs, out_csv=tmp_path / "a.csv", **grid)
    second = ppl_grid.run_grid(model, tok, "tiny", configs, out_csv=tmp_path / "b.csv", **grid)
    assert [c.ppl for c in first] == [c.ppl for c in second] and len(first) == 2
    env = ppl_grid.environment_key()
    assert {c.env for c in ppl_grid.read_cells(tmp_path / "a.csv")} == {env}

    # Same environment: resumed without recomputing. Another one (here: another thread count, as a
    # second machine would have): every cell is computed again and the file holds only the new ones.
    seen = []
    real_ppl = countdown.eval.perplexity.perplexity
    monkeypatch.setattr(countdown.eval.perplexity, "perplexity", lambda *a, **k: seen.append(1) or real_ppl(*a, **k))
    assert [c.ppl for c in ppl_grid.run_grid(model, tok, "tiny", configs, out_csv=tmp_path / "a.csv", **grid)] == [
        c.ppl for c in first] and not seen
    real_env = ppl_grid.run_environment
    monkeypatch.setattr(ppl_grid, "run_environment", lambda: {**real_env(), "threads": 99})
    again = ppl_grid.run_grid(model, tok, "tiny", configs, out_csv=tmp_path / "a.csv", **grid)
    assert len(seen) == 2 and [c.ppl for c in again] == [c.ppl for c in first]
    assert {c.env for c in ppl_grid.read_cells(tmp_path / "a.csv")} == {ppl_grid.environment_key()} != {env}
