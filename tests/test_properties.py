"""Hypothesis property tests against scipy/numpy.

Shapes come from a small pool so the number of distinct compiles (one per
sparse shape, format and dtype) stays bounded and CI stays fast.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparse_mlir as sm

SHAPES = [(1, 1), (4, 6), (8, 8), (0, 3)]
FORMATS = ["csr", "csc", "coo", "dcsr"]
DTYPES = ["float64", "int64"]
COMMON = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sparse_matrices(draw, shape=None):
    shape = shape or draw(st.sampled_from(SHAPES))
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    dense = rng.integers(-5, 6, size=shape) * (rng.random(shape) < density)
    if shape[0] > 1 and draw(st.booleans()):
        dense[rng.integers(shape[0])] = 0  # an empty row
    return dense


@COMMON
@given(dense=sparse_matrices(), fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 1000))
def test_spmv_matches_numpy(dense, fmt, dtype, seed):
    a = dense.astype(dtype)
    x = np.random.default_rng(seed).integers(-3, 4, size=a.shape[1]).astype(dtype)
    y = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": fmt}, dtype=dtype)(A=sm.SparseTensor.from_dense(a, fmt), x=x)
    np.testing.assert_array_equal(y, a @ x)


@COMMON
@given(dense=sparse_matrices(), fmt=st.sampled_from(FORMATS), n=st.sampled_from([1, 3, 16]))
def test_spmm_matches_numpy(dense, fmt, n):
    a = dense.astype("float64")
    b = np.arange(a.shape[1] * n, dtype="float64").reshape(a.shape[1], n) % 7 - 3
    C = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": fmt})(A=sm.SparseTensor.from_dense(a, fmt), B=b)
    np.testing.assert_array_equal(C, a @ b)


@COMMON
@given(data=st.data(), fmt=st.sampled_from(["csr", "dcsr", "coo"]))
def test_sparse_add_matches_scipy(data, fmt):
    shape = data.draw(st.sampled_from(SHAPES))
    a, b = data.draw(sparse_matrices(shape)), data.draw(sparse_matrices(shape))
    add = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": fmt, "B": fmt, "C": fmt}, dtype="int64")
    C = add(A=sm.SparseTensor.from_dense(a, fmt), B=sm.SparseTensor.from_dense(b, fmt))
    np.testing.assert_array_equal(C.to_dense(), (sp.csr_matrix(a) + sp.csr_matrix(b)).toarray())


@COMMON
@given(data=st.data())
def test_spgemm_matches_scipy(data):
    m, k, n = (data.draw(st.sampled_from([1, 5, 8])) for _ in range(3))
    a, b = data.draw(sparse_matrices((m, k))), data.draw(sparse_matrices((k, n)))
    mul = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="int64")
    C = mul(A=sm.SparseTensor.from_dense(a, "csr"), B=sm.SparseTensor.from_dense(b, "csr"))
    np.testing.assert_array_equal(C.to_dense(), (sp.csr_matrix(a) @ sp.csr_matrix(b)).toarray())


@COMMON
@given(nnz=st.integers(0, 30), seed=st.integers(0, 2**16), fmt=st.sampled_from(FORMATS + ["bsr2x2"]))
def test_from_coo_with_duplicates_and_unsorted_matches_scipy(nnz, seed, fmt):
    rng = np.random.default_rng(seed)
    shape = (6, 4)
    rows, cols = rng.integers(0, 6, nnz), rng.integers(0, 4, nnz)  # duplicates likely, never sorted
    vals = rng.integers(-5, 6, nnz).astype(np.float64)
    t = sm.SparseTensor.from_coo(np.vstack([rows, cols]), vals, shape, fmt)
    np.testing.assert_array_equal(t.to_dense(), sp.coo_matrix((vals, (rows, cols)), shape=shape).toarray())
    np.testing.assert_array_equal(sm.SparseTensor.from_buffers(t.format, t.shape, t.buffers).to_dense(),
                                  t.to_dense())
