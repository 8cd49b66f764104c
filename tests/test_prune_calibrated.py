"""Calibrated pruning: Wanda and SparseGPT keep a layer's outputs closer than magnitude pruning does."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_mlir import prune
from sparse_mlir.errors import DTypeError, OperandError, PatternError, ShapeError

PATTERNS = [{"sparsity": 0.5}, {"pattern": "2:4"}, {"sparsity": 0.75, "block": (4, 4)}]


@pytest.fixture
def layer(rng):
    """A layer and inputs whose features have very different scales and are correlated (as in transformers)."""
    samples, features, outputs = 1024, 64, 32
    mix = rng.normal(size=(features, features)) * 0.3 + np.eye(features)
    x = (rng.normal(size=(samples, features)) @ mix) * np.exp(rng.normal(0, 1.0, features))
    return rng.normal(size=(outputs, features)).astype(np.float32), x


def _output_error(w, pruned, x):
    return np.linalg.norm(x @ w.T - x @ pruned.to_dense().T) / np.linalg.norm(x @ w.T)


def _magnitude(w, kw):
    if "pattern" in kw:
        return prune.n_m(w, 2, 4)
    if "block" in kw:
        return prune.block(w, kw["sparsity"], kw["block"])
    return prune.magnitude(w, kw["sparsity"], scope="row")


@pytest.mark.parametrize("kw", PATTERNS, ids=["50%", "2:4", "block4x4"])
def test_sparsegpt_beats_wanda_beats_magnitude_on_the_layer_outputs(layer, kw):
    w, x = layer
    before = w.copy()
    calibration = prune.Calibration.from_activations(x)
    errors = [_output_error(w, _magnitude(w, kw)[0], x),
              _output_error(w, prune.wanda(w, calibration, **kw)[0], x),
              _output_error(w, prune.sparsegpt(w, calibration, **kw)[0], x)]
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[1] < 0.8 * errors[0]
    np.testing.assert_array_equal(w, before)  # the caller's weights are never modified


@pytest.mark.parametrize("kw", PATTERNS, ids=["50%", "2:4", "block4x4"])
def test_the_pattern_holds_and_the_mask_is_what_is_stored(layer, kw):
    w, x = layer
    calibration = prune.Calibration.from_activations(x)
    for pruner in (prune.wanda, prune.sparsegpt, prune.admm):
        tensor, mask = pruner(w, calibration, **kw)
        dense = tensor.to_dense()
        assert tensor.nnz == mask.sum() and ((dense != 0) <= mask).all()
        if "pattern" in kw:
            assert tensor.format == prune.pattern_of(pattern="2:4").default_format()
            assert prune.satisfies_n_m(mask, 2, 4) and (mask.reshape(32, -1, 4).sum(2) == 2).all()
        elif "block" in kw:
            tiles = mask.reshape(8, 4, 16, 4)
            assert (tiles.all(axis=(1, 3)) == tiles.any(axis=(1, 3))).all()
            assert tiles.any(axis=(1, 3)).sum() == 32  # a quarter of the 128 tiles
        else:
            assert (mask.sum(1) == 32).all()  # per row, as in the paper


def test_wanda_keeps_the_weights_on_large_inputs():
    w = np.array([[1.0, 2.0, 3.0, 4.0]])
    x = np.array([[100.0, 10.0, 1.0, 0.1]] * 4)  # feature scales reverse the magnitude order
    _, mask = prune.wanda(w, prune.Calibration.from_activations(x), sparsity=0.5)
    assert mask.tolist() == [[True, True, False, False]]
    _, mask = prune.magnitude(w, 0.5)
    assert mask.tolist() == [[False, False, True, True]]


@pytest.mark.parametrize("kw", PATTERNS, ids=["50%", "2:4", "block4x4"])
def test_the_refit_gives_the_least_squares_weights_of_the_mask(layer, kw):
    """With the mask fixed, each row's kept weights are the least-squares fit of the dense row's outputs: what
    numpy's lstsq finds on the kept columns; the sweep's own one-pass updates fall short of it."""
    w, x = layer
    calibration = prune.Calibration.from_activations(x)
    tensor, mask = prune.sparsegpt(w, calibration, damp=1e-9, **kw)
    refitted = tensor.to_dense()
    want = x @ w.T.astype(np.float64)
    for row in range(0, w.shape[0], 7):
        kept = np.flatnonzero(mask[row])
        best = np.linalg.lstsq(x[:, kept], want[:, row], rcond=None)[0]
        np.testing.assert_allclose(refitted[row, kept], best, rtol=2e-3, atol=1e-4)
    swept = prune.sparsegpt(w, calibration, damp=1e-9, refit=False, **kw)[0]
    assert _output_error(w, tensor, x) < 0.95 * _output_error(w, swept, x)


@pytest.mark.parametrize("kw", [*PATTERNS, {"sparsity": 0.9}], ids=["50%", "2:4", "block4x4", "90%"])
def test_admm_chooses_masks_that_beat_sparsegpt(layer, kw):
    """ADMM revises its mask while the sparsity rises; with the same exact weights for the mask, its layer
    outputs are closer than SparseGPT's on the calibration data and on new inputs from the same distribution."""
    w, x = layer
    calibration = prune.Calibration.from_activations(x[:768])
    held = x[768:]
    errors = {name: (_output_error(w, pruner(w, calibration, **kw)[0], x[:768]),
                     _output_error(w, pruner(w, calibration, **kw)[0], held))
              for name, pruner in (("sparsegpt", prune.sparsegpt), ("admm", prune.admm))}
    assert errors["admm"][0] < errors["sparsegpt"][0] and errors["admm"][1] < errors["sparsegpt"][1], errors


def test_admm_aims_at_the_targets_and_raises_the_sparsity_gradually(layer, rng):
    from sparse_mlir.prune.calibrated import _gradual_mask, pattern_of

    w, x = layer
    perturbed = x + rng.normal(size=x.shape) * x.std(0) * 0.3
    toward = prune.admm(w, prune.Calibration(x.shape[1]).update(perturbed, target=x), sparsity=0.5)[0].to_dense()
    unaware = prune.admm(w, prune.Calibration.from_activations(perturbed), sparsity=0.5)[0].to_dense()
    errors = [np.linalg.norm(perturbed @ m.T - x @ w.T) for m in (unaware, toward)]
    assert errors[1] < 0.9 * errors[0], errors
    scores = rng.random((8, 16)) + 0.1
    two_four = pattern_of(pattern="2:4")
    halfway = _gradual_mask(scores, two_four, 0.5)
    assert halfway.sum(1).tolist() == [12] * 8  # a quarter of the weights gone: half of 2:4's removals
    assert (halfway >= prune.calibrated.select(scores, two_four)).all()  # the pattern's own choice stays
    assert prune.satisfies_n_m(_gradual_mask(scores, two_four, 1.0), 2, 4)
    assert _gradual_mask(scores, pattern_of(sparsity=0.5), 0.5).sum() == 8 * 12


def test_sparsegpt_keeps_the_outputs_when_inputs_span_few_directions(rng):
    """Inputs of rank 8 in 32 features: half the weights can go with almost no change to the outputs."""
    x = rng.normal(size=(512, 8)) @ rng.normal(size=(8, 32))
    w = rng.normal(size=(16, 32))
    tensor, _ = prune.sparsegpt(w, prune.Calibration.from_activations(x), sparsity=0.5, damp=1e-6)
    assert _output_error(w, tensor, x) < 1e-3


def test_statistics_accumulate_batch_by_batch(layer):
    w, x = layer
    whole = prune.Calibration.from_activations(x)
    batched = prune.Calibration(x.shape[1])
    for part in np.array_split(x.reshape(4, -1, x.shape[1]), 4):  # (batch, seq, features) batches flatten
        batched.update(part)
    assert batched.samples == whole.samples == x.shape[0]
    np.testing.assert_allclose(batched.gram, whole.gram, rtol=1e-12)
    np.testing.assert_array_equal(prune.wanda(w, batched, sparsity=0.5)[1], prune.wanda(w, whole, sparsity=0.5)[1])


def test_torch_activations_are_accepted(layer):
    torch = pytest.importorskip("torch")
    _, x = layer
    calibration = prune.Calibration.from_activations(torch.from_numpy(x))
    np.testing.assert_allclose(calibration.gram, x.T @ x, rtol=1e-10)


def test_features_never_seen_are_pruned_first(layer):
    w, x = layer
    x = x.copy()
    x[:, :8] = 0.0
    for pruner in (prune.wanda, prune.sparsegpt, prune.admm):
        _, mask = pruner(w, prune.Calibration.from_activations(x), sparsity=0.5)
        assert not mask[:, :8].any()


@pytest.mark.parametrize(("call", "error"), [
    (lambda w, c: prune.wanda(w, c), PatternError),  # nothing to prune by
    (lambda w, c: prune.wanda(w, c, sparsity=0.5, pattern="2:4"), PatternError),
    (lambda w, c: prune.wanda(w, c, pattern="2:4", block=(4, 4)), PatternError),
    (lambda w, c: prune.wanda(w, c, pattern="5:4"), PatternError),
    (lambda w, c: prune.wanda(w, c, pattern="two:four"), PatternError),
    (lambda w, c: prune.wanda(w, c, sparsity=1.0), PatternError),
    (lambda w, c: prune.wanda(w[:, :30], c, sparsity=0.5), ShapeError),
    (lambda w, c: prune.wanda(w, prune.Calibration(64), sparsity=0.5), ShapeError),  # no samples
    (lambda w, c: prune.sparsegpt(w.astype(np.int32), c, sparsity=0.5), DTypeError),
    (lambda w, c: prune.sparsegpt(w, c, sparsity=0.5, damp=0.0), PatternError),
    (lambda w, c: prune.sparsegpt(w, c, sparsity=0.5, block_columns=0), PatternError),
    (lambda w, c: prune.sparsegpt(w, c, sparsity=0.5, block=(3, 4)), PatternError),
    (lambda w, c: prune.admm(w.astype(np.int32), c, sparsity=0.5), DTypeError),
    (lambda w, c: prune.admm(w, c, sparsity=0.5, gradual=50, iterations=40), PatternError),
    (lambda w, c: prune.admm(w, c, sparsity=0.5, rho=0.0), PatternError),
    (lambda w, c: prune.admm(w, c, pattern="3:8", sparsity=0.5), PatternError),
    (lambda w, c: c.update(np.ones((4, 63))), ShapeError),
    (lambda w, c: c.update(np.full((4, 64), np.nan)), ShapeError),
    (lambda w, c: prune.Calibration.from_activations(np.zeros((0, 64))), ShapeError),
])
def test_bad_parameters_raise_clearly(layer, call, error):
    w, x = layer
    with pytest.raises(error):
        call(w, prune.Calibration.from_activations(x))


def test_collect_gathers_each_linear_layers_inputs_with_hooks(rng):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batches = [torch.from_numpy(rng.normal(size=(5, 8)).astype(np.float32)) for _ in range(3)]
    calibrations = prune.collect(model, lambda m: [m(b) for b in batches])
    assert sorted(calibrations) == ["0", "2"]
    x = torch.cat(batches).double()
    np.testing.assert_allclose(calibrations["0"].gram, (x.T @ x).numpy(), rtol=1e-5)
    hidden = torch.relu(model[0](torch.cat(batches))).double()
    np.testing.assert_allclose(calibrations["2"].gram, (hidden.T @ hidden).detach().numpy(), rtol=1e-4, atol=1e-5)
    assert calibrations["2"].samples == 15
    assert not model[0]._forward_pre_hooks  # the hooks are gone afterwards
    only = prune.collect(model, lambda m: m(batches[0]), include=lambda name, _: name == "2")
    assert list(only) == ["2"]
    with pytest.raises(OperandError, match="no Linear"):
        prune.collect(torch.nn.ReLU(), lambda m: None)


def test_targets_equal_to_the_inputs_change_nothing_and_other_targets_are_fitted(layer, rng):
    """SparseGPT with dense-model targets: T = X is plain SparseGPT; for perturbed inputs X it fits W T."""
    w, x = layer
    plain = prune.sparsegpt(w, prune.Calibration.from_activations(x), sparsity=0.5)[0].to_dense()
    same = prune.Calibration(x.shape[1]).update(x, target=x)
    np.testing.assert_allclose(prune.sparsegpt(w, same, sparsity=0.5)[0].to_dense(), plain, rtol=1e-5, atol=1e-6)
    perturbed = x + rng.normal(size=x.shape) * x.std(0) * 0.3  # what pruned layers before it would feed it
    toward = prune.Calibration(x.shape[1]).update(perturbed, target=x)
    fitted = prune.sparsegpt(w, toward, sparsity=0.5)[0].to_dense()
    unaware = prune.sparsegpt(w, prune.Calibration.from_activations(perturbed), sparsity=0.5)[0].to_dense()
    want = x @ w.T
    errors = [np.linalg.norm(perturbed @ m.T - want) for m in (unaware, fitted)]
    assert errors[1] < 0.9 * errors[0], errors
    with pytest.raises(ShapeError, match="every batch"):
        toward.update(x)
    with pytest.raises(ShapeError, match="target"):
        prune.Calibration(x.shape[1]).update(x, target=x[:10])
