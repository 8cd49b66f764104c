"""Sparsified kernels whose outer loop walks a compressed level (DCSR, CSF) with a dense result run threaded.

The sparsifier's ``any-storage-outer-loop`` strategy makes that loop an
``scf.parallel`` over the stored entries of the outer level: each iteration
writes its own rows of the result, so the results must equal one thread's,
at two threads too, on inputs large enough that ``threads.for_work`` forks.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.runtime.threads import fixed, openmp_library

pytestmark = pytest.mark.skipif(openmp_library() is None, reason="no OpenMP runtime: kernels are serial")


def _dcsr_rows(rng: np.random.Generator, rows: int, cols: int) -> sp.csr_array:
    """Every other row empty (what DCSR leaves out), the rest 5% dense, small integers (exact sums)."""
    a = sp.random_array((rows, cols), density=0.05, format="csr", rng=rng, dtype=np.float64)
    a.data = rng.integers(1, 5, size=a.nnz).astype(np.float64)
    a = sp.csr_array(a.toarray() * (np.arange(rows) % 2 == 0)[:, None])
    return a


@pytest.mark.parametrize("threads", [1, 2])
def test_a_dcsr_spmm_is_threaded_and_exact(rng, threads):
    a = _dcsr_rows(rng, 1200, 900)
    b = rng.integers(-3, 4, size=(900, 64)).astype(np.float64)
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "dcsr"}, dtype="float64")
    with fixed(threads):
        got = kernel(A=sm.SparseTensor.from_scipy(a, "dcsr"), B=b)
    np.testing.assert_array_equal(got, a @ b)
    assert "omp.wsloop" in kernel.ir["mapped"]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_dcsr_times_a_dense_matrix_elementwise_is_threaded_and_exact(rng, threads):
    a = _dcsr_rows(rng, 2000, 1500)
    d = rng.integers(-3, 4, size=(2000, 1500)).astype(np.float64)
    kernel = sm.compile("C[i,j] = A[i,j] * D[i,j] + D[i,j]", formats={"A": "dcsr"}, dtype="float64")
    with fixed(threads):
        got = kernel(A=sm.SparseTensor.from_scipy(a, "dcsr"), D=d)
    np.testing.assert_array_equal(got, a.toarray() * d + d)
    assert "omp.wsloop" in kernel.ir["mapped"]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_csf_contraction_is_threaded_and_exact(rng, threads):
    dense = rng.integers(1, 5, size=(60, 50, 40)).astype(np.float64) * (rng.random((60, 50, 40)) < 0.1)
    dense[::3] = 0  # empty slices at the outer level
    x = rng.integers(-3, 4, size=40).astype(np.float64)
    kernel = sm.compile("C[i,j] = A[i,j,k] * x[k]", formats={"A": "csf"}, dtype="float64")
    with fixed(threads):
        got = kernel(A=sm.SparseTensor.from_dense(dense, "csf"), x=x)
    np.testing.assert_array_equal(got, dense @ x)
    assert "omp.wsloop" in kernel.ir["mapped"]
