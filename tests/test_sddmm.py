"""The hand-scheduled CPU SDDMM (``dialects/native_sddmm.py``): S's pattern, every dtype, any K, any factor order."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.dialects.native.sddmm import sddmm_operands


def _operands(rng, dtype: str, k: int, rows: int = 50, cols: int = 40):
    s = sp.random(rows, cols, density=0.1, format="csr", random_state=1)
    s.data = (np.round(s.data * 10) + 1 if dtype.startswith("int") else s.data).astype(dtype)
    s = s.tolil()
    s[7, :] = 0  # an empty row
    s = s.tocsr()
    s.eliminate_zeros()
    draw = (lambda shape: rng.integers(-3, 4, shape)) if dtype.startswith("int") else rng.standard_normal
    return s, draw((rows, k)).astype(dtype), draw((k, cols)).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("k", [1, 7, 8, 16, 37, 64])
def test_sddmm_keeps_the_pattern_and_matches_scipy(dtype, k, rng):
    s, a, b = _operands(rng, dtype, k)
    kernel = sm.compile("C[i,j] = S[i,j] * A[i,k] * B[k,j]", formats={"S": "csr", "C": "csr"}, dtype=dtype)
    before = (a.copy(), b.copy(), s.data.copy())
    got = kernel(S=sm.SparseTensor.from_scipy(s), A=a, B=b).to_scipy()
    want = s.multiply(a.astype(np.float64) @ b.astype(np.float64))
    np.testing.assert_array_equal(got.indptr, s.indptr)
    np.testing.assert_array_equal(got.indices, s.indices)
    np.testing.assert_allclose(got.toarray(), want.toarray(), rtol=1e-5, atol=1e-5 * max(1, abs(want).max()))
    assert "linalg.generic" not in kernel.ir["input"] and "scf.parallel" in kernel.ir["input"]
    for was, now in zip(before, (a, b, s.data)):
        np.testing.assert_array_equal(was, now)


def test_factor_order_and_explicit_zeros(rng):
    s, a, b = _operands(rng, "float32", 16)
    s.data[::3] = 0.0  # stored zeros stay stored, with value 0
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j] * S[i,j]", formats={"S": "csr", "C": "csr"}, dtype="float32")
    got = kernel(S=sm.SparseTensor.from_scipy(s), A=a, B=b)
    assert got.nnz == s.nnz
    np.testing.assert_allclose(got.to_scipy().toarray(), s.multiply(a @ b).toarray(), rtol=1e-5, atol=1e-5)


def test_what_is_not_an_sddmm_is_left_to_the_sparsifier():
    def matched(expr: str, formats: dict) -> bool:
        kernel = sm.compile(expr, formats=formats, dtype="float32")
        return sddmm_operands(kernel.spec, kernel.spec.formats) is not None

    assert matched("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": "csr"})
    assert not matched("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "coo", "C": "coo"})
    assert not matched("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": "csr", "A": "csr"})
    assert not matched("C[i,j] = S[i,j] * A[i,k] * A[k,j]", {"S": "csr", "C": "csr"})  # one tensor twice
    assert not matched("C[i,j] = S[i,j] * (A[i,k] + B[k,j])", {"S": "csr", "C": "csr"})


def test_horizontal_sums_may_be_reassociated(rng):
    """Each entry's dot product ends in a horizontal sum of a vector; without ``reassoc`` LLVM emits it as one
    chain of dependent scalar adds (16 for a 512-bit float32 vector), slower than the FMAs before it."""
    s, a, b = _operands(rng, "float32", 64)
    kernel = sm.compile("C[i,j] = S[i,j] * A[i,k] * B[k,j]", formats={"S": "csr", "C": "csr"}, dtype="float32")
    kernel(S=sm.SparseTensor.from_scipy(s), A=a, B=b)
    sums = [line for line in kernel.ir["llvm"].splitlines() if "vector.reduce.fadd" in line]
    assert sums and all("reassoc" in line for line in sums)
