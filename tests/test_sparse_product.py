"""The hand-scheduled CPU elementwise product (``dialects/native/sparse_add.py``, ``native_sparse_product``):
CSR .* CSR -> CSR against scipy's ``multiply``.

What every result must be: the intersection of the operands' patterns,
columns sorted and unique within each row, values ``A * B`` (exact for the
small integers used here), whatever the dtype, index widths, thread count,
row lengths (one row much longer than the other, equal patterns, empty
rows) and size, from one shape-generic build.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import DTYPES

import sparse_mlir as sm
from sparse_mlir.dsl.patterns import threads_sparse_output
from sparse_mlir.formats import CSR
from sparse_mlir.runtime.threads import fixed

EXPRESSION = "C[i,j] = A[i,j] * B[i,j]"


def _random(rng, shape, density, dtype) -> sp.csr_array:
    m = sp.random_array(shape, density=density, format="csr", rng=rng)
    m.data = rng.integers(1, 5, size=m.nnz) * rng.choice([-1, 1], size=m.nnz)
    return m.astype(dtype)


def _check(got: sm.SparseTensor, a: sp.csr_array, b: sp.csr_array) -> None:
    c = got.to_scipy()
    want = sp.csr_array(a.multiply(b))
    want.sort_indices()
    assert c.has_sorted_indices and c.nnz == want.nnz  # structural: no product here cancels to zero
    np.testing.assert_array_equal(c.indptr, want.indptr)
    np.testing.assert_array_equal(c.indices, want.indices)
    np.testing.assert_array_equal(c.data, want.data)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_scipy_at_every_size_and_thread_count_from_one_build(rng, dtype):
    kernel = sm.compile(EXPRESSION, formats={"A": "csr", "B": "csr", "C": "csr"}, dtype=dtype)
    # compile() hands out one Kernel per process: an earlier test may have loaded (and the table of loaded
    # libraries since evicted) its build, so count the loads from here
    loads = kernel.stats["specializations"]
    for shape, da, db in [((1, 1), 1.0, 1.0), ((5, 7), 0.5, 0.5), ((300, 200), 0.05, 0.3), ((40, 50), 0.0, 0.4),
                          ((2000, 3000), 0.01, 0.01), ((60, 100000), 0.01, 0.0005), ((20000, 30), 0.2, 0.2)]:
        a, b = _random(rng, shape, da, dtype), _random(rng, shape, db, dtype)
        for threads in (1, 2):
            with fixed(threads):
                _check(kernel(A=sm.SparseTensor.from_scipy(a), B=sm.SparseTensor.from_scipy(b)), a, b)
                _check(kernel(A=sm.SparseTensor.from_scipy(b), B=sm.SparseTensor.from_scipy(a)), b, a)
    assert kernel.shape_generic and kernel.stats["specializations"] - loads <= 1 and len(kernel.specializations) == 1


def test_equal_patterns_a_long_row_against_a_short_one_and_scipy_operands(rng):
    kernel = sm.compile(EXPRESSION, formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64")
    a = _random(rng, (500, 4000), 0.01, "float64")
    same = a.copy()
    same.data = rng.integers(1, 5, size=a.nnz).astype(np.float64)
    dense_row = a.copy().tolil()
    dense_row[3, :] = 2.0  # row 3 of B holds every column: probed by A's few
    for b in (same, sp.csr_array(dense_row), _random(rng, (500, 4000), 0.5, "float64")):
        with fixed(2):
            _check(kernel(A=a, B=sp.csr_array(b)), a, sp.csr_array(b))


@pytest.mark.parametrize("widths", [(64, 64), (16, 8), (32, 16)])
def test_index_widths(rng, widths):
    fmt = CSR.with_widths(*widths)
    a, b = _random(rng, (100, 120), 0.2, "float32"), _random(rng, (100, 120), 0.3, "float32")
    kernel = sm.compile(EXPRESSION, formats={"A": fmt, "B": fmt, "C": fmt}, dtype="float32")
    _check(kernel(A=sm.SparseTensor.from_scipy(a, fmt), B=sm.SparseTensor.from_scipy(b, fmt)), a, b)


def test_threaded_and_hand_scheduled(rng):
    kernel = sm.compile(EXPRESSION, formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64")
    assert threads_sparse_output(kernel.spec, kernel.spec.formats)
    a = _random(rng, (50, 40), 0.2, "float64")
    kernel(A=a, B=a)
    assert "linalg.generic" not in kernel.ir["input"]
