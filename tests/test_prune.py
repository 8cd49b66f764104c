"""Pruning: unstructured (global and per row), N:M, block; masks and their application."""

from __future__ import annotations

import numpy as np
import pytest

import sparse_mlir as sm
from sparse_mlir import prune
from sparse_mlir.errors import PatternError, ShapeError


@pytest.fixture
def weights(rng):
    return rng.standard_normal((16, 32)).astype(np.float32)


def test_global_magnitude(weights):
    before = weights.copy()
    tensor, mask = prune.magnitude(weights, 0.75)
    assert mask.sum() == weights.size // 4 and tensor.format == sm.CSR and tensor.nnz == mask.sum()
    assert np.abs(weights[mask]).min() >= np.abs(weights[~mask]).max()
    np.testing.assert_array_equal(tensor.to_dense(), np.where(mask, weights, 0))
    np.testing.assert_array_equal(weights, before)


def test_per_row_magnitude(weights):
    _, mask = prune.magnitude(weights, 0.5, scope="row", format="coo")
    assert (mask.sum(1) == 16).all()


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (2, 8), (3, 8)])
def test_n_m(weights, n, m):
    tensor, mask = prune.n_m(weights, n, m)
    assert tensor.format == sm.NM(n, m)
    assert prune.satisfies_n_m(tensor, n, m) and prune.satisfies_n_m(mask, n, m)
    assert (mask.reshape(16, -1, m).sum(2) == n).all()
    np.testing.assert_array_equal(tensor.to_dense(), np.where(mask, weights, 0))


def test_block(weights):
    tensor, mask = prune.block(weights, 0.75, (4, 8))
    assert tensor.format == sm.BSR(4, 8)
    blocks = mask.reshape(4, 4, 4, 8).any(axis=(1, 3))
    assert blocks.sum() == 4 and (mask.reshape(4, 4, 4, 8).all(axis=(1, 3)) == blocks).all()


def test_apply_mask_to_new_weights(weights, rng):
    _, mask = prune.n_m(weights, 2, 4)
    new = rng.standard_normal(weights.shape).astype(np.float32)
    tensor = prune.apply_mask(new, mask, "2:4")
    np.testing.assert_array_equal(tensor.to_dense(), np.where(mask, new, 0))


def test_satisfies_n_m():
    assert prune.satisfies_n_m(np.array([[1, 0, 0, 2]]), 2, 4)
    assert not prune.satisfies_n_m(np.array([[1, 1, 0, 2]]), 2, 4)
    assert not prune.satisfies_n_m(np.ones((2, 6)), 2, 4)


@pytest.mark.parametrize("call,error", [
    (lambda w: prune.magnitude(w, 1.0), PatternError),
    (lambda w: prune.magnitude(w, -0.1), PatternError),
    (lambda w: prune.magnitude(w, 0.5, scope="col"), PatternError),
    (lambda w: prune.n_m(w, 5, 4), PatternError),
    (lambda w: prune.n_m(w[:, :30], 2, 4), PatternError),
    (lambda w: prune.block(w, 0.5, (5, 4)), PatternError),
    (lambda w: prune.magnitude(w[0], 0.5), ShapeError),
    (lambda w: prune.apply_mask(w, np.ones((2, 2), bool)), ShapeError),
])
def test_bad_parameters(weights, call, error):
    with pytest.raises(error):
        call(weights)


def test_pruned_weights_run_in_the_linear_orientation(weights, rng):
    tensor, mask = prune.n_m(weights, 2, 4)
    x = rng.standard_normal((5, 32)).astype(np.float32)
    y = sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={"W": "2:4"}, dtype="float32")(X=x, W=tensor)
    np.testing.assert_allclose(y, x @ np.where(mask, weights, 0).T, rtol=1e-5, atol=1e-5)
