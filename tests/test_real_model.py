"""The real default model once: load, one sparse forward, finite perplexity, exact restore."""

import math

import pytest
import torch

import countdown

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return countdown.load_model("smollm2-135m")


def test_default_model_sparse_forward_and_perplexity(smollm2):
    model, tok = smollm2
    mlps = countdown.find_gated_mlps(model)
    assert len(mlps) == 30 and {(m.d_model, m.d_inter, m.act_name) for m in mlps} == {(576, 1536, "silu")}
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        dense = model(ids).logits
        countdown.sparsify(model, "dual", 0.8, scope="all")
        sparse = model(ids).logits
        assert torch.isfinite(sparse).all() and not torch.equal(sparse, dense)
        texts = countdown.load_texts("xsum", limit=20)
        ppl = countdown.perplexity(model, tok, texts, max_tokens=1024, progress=False)
        assert math.isfinite(ppl) and 1 < ppl < 1000
        assert countdown.sparsity_real(model)["mean"] == pytest.approx(1 - countdown.kept_rows(1536, 0.8) / 1536)
        countdown.unsparsify(model)
        assert torch.equal(model(ids).logits, dense)
