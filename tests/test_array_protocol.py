"""SparseTensor as an array (scipy's sparray habits) and the keyword-only kernel call."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.errors import DTypeError, OperandError, ShapeError


@pytest.fixture
def pair():
    a = sp.random(12, 9, density=0.3, format="csr", dtype=np.float32, random_state=5)
    return a, sm.SparseTensor.from_scipy(a)


def test_matmul_dispatches_to_cached_kernels(pair, rng):
    a, t = pair
    x, b = rng.standard_normal(9).astype(np.float32), rng.standard_normal((9, 4)).astype(np.float32)
    np.testing.assert_allclose(t @ x, a @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t @ b, a @ b, rtol=1e-5, atol=1e-6)
    y, c = rng.standard_normal(12).astype(np.float32), rng.standard_normal((3, 12)).astype(np.float32)
    np.testing.assert_allclose(y @ t, y @ a.toarray(), rtol=1e-5, atol=1e-6)  # numpy defers to __rmatmul__
    np.testing.assert_allclose(c @ t, c @ a.toarray(), rtol=1e-5, atol=1e-6)
    product = t @ t.T
    assert isinstance(product, sm.SparseTensor) and product.format == "csr"
    np.testing.assert_allclose(product.toarray(), (a @ a.T).toarray(), rtol=1e-5, atol=1e-6)
    with pytest.raises(DTypeError):  # float64 operand, float32 tensor: never cast
        t @ x.astype(np.float64)
    with pytest.raises(ShapeError):
        t @ np.ones((9, 2, 2), np.float32)


def test_transpose_astype_toarray_and_format_names(pair):
    a, t = pair
    assert t.format == "csr" and t.format != "csc" and t.T.format == "csc" and t.T.T.format == "csr"
    assert np.shares_memory(t.T.buffers[0], t.buffers[0])  # a CSR transpose: a CSC view of the same buffers
    np.testing.assert_array_equal(t.T.toarray(), a.toarray().T)
    coo = sm.SparseTensor.from_scipy(a, "coo")
    np.testing.assert_array_equal(coo.T.toarray(), a.toarray().T)
    assert coo.T.format == "coo"
    wide = t.astype(np.float64)
    assert wide.dtype == np.float64 and np.shares_memory(wide.buffers[1], t.buffers[1]) and t.astype(np.float32) is t
    np.testing.assert_array_equal(t.todense(), a.toarray())
    assert sm.CSR.with_widths(64, 64) == "csr" and sm.CSR.with_widths(64, 64) != sm.CSR
    assert t.format != "no such format" and sm.NM(2, 4) == "2:4"


def test_to_scipy_gives_sparse_arrays_unless_asked_for_matrices(pair):
    _, t = pair
    assert isinstance(t.to_scipy(), sp.csr_array) and isinstance(t.T.to_scipy(), sp.csc_array)
    assert isinstance(t.to_scipy(kind="matrix"), sp.csr_matrix)
    with pytest.raises(Exception, match="array.*matrix"):
        t.to_scipy(kind="list")


def test_positional_operands_are_refused_with_the_keyword_signature(pair):
    _, t = pair
    spmv = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}, dtype="float32")
    with pytest.raises(OperandError, match=r"kernel\(A=\.\.\., x=\.\.\., out=None\)"):
        spmv(t, np.ones(9, np.float32))
