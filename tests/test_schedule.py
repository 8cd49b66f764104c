"""schedule="auto": variants timed on the caller's matrix, sparse at 99%, dense BLAS at 10%."""

from __future__ import annotations

import numpy as np
import pytest

import sparse_mlir as sm
from sparse_mlir.runtime.schedule import einsum_plan


@pytest.fixture(scope="module")
def auto():
    return sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32", schedule="auto")


def operands(sparsity: float):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((512, 512)) * (rng.random((512, 512)) >= sparsity)).astype(np.float32)
    return a, sm.SparseTensor.from_dense(a, "csr"), rng.standard_normal((512, 256)).astype(np.float32)


def test_sparse_chosen_when_sparse_and_dense_when_not(auto):
    for sparsity, expected in ((0.99, "sparse"), (0.10, "dense")):
        a, A, B = operands(sparsity)
        np.testing.assert_allclose(auto(A=A, B=B), a @ B, rtol=1e-4, atol=1e-3)
        assert auto.schedule["choice"].startswith(expected), auto.schedule
        assert set(auto.schedule["seconds"]) >= {"sparse", "dense"}


def test_decision_is_cached_per_tensor(auto):
    a, A, B = operands(0.99)
    auto(A=A, B=B)
    first = auto.schedule
    out = np.empty((512, 256), np.float32)
    assert auto(A=A, B=B, out=out) is out and auto.schedule is first


def test_einsum_plan_only_for_sums_of_products():
    from sparse_mlir.dsl import plan

    assert einsum_plan(plan("C[i,j] = A[i,k] * B[k,j] * 2", {"A": "csr"}))[0] == "ac,cb->ab"
    assert einsum_plan(plan("C[i,j] = relu(A[i,k] * B[k,j])", {"A": "csr"})) is None
    assert einsum_plan(plan("C[i,j] = A[i,j] + B[i,j]", {"A": "csr", "B": "csr", "C": "csr"})) is None
    with pytest.raises(sm.errors.DSLError):
        sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}, schedule="fast")
