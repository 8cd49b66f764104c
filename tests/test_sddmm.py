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


def test_dot_products_are_summed_by_shuffles_not_one_horizontal_sum_each(rng):
    """A horizontal sum per entry is log2(lanes) dependent shuffle-and-add steps, and cost more than the FMAs
    before it; the entries of a group are summed together by a transposed reduction (``loops.lane_sums``)."""
    s, a, b = _operands(rng, "float32", 64)
    kernel = sm.compile("C[i,j] = S[i,j] * A[i,k] * B[k,j]", formats={"S": "csr", "C": "csr"}, dtype="float32")
    kernel(S=sm.SparseTensor.from_scipy(s), A=a, B=b)
    llvm = kernel.ir["llvm"]
    assert "vector.reduce.fadd" not in llvm and "llvm.shufflevector" in llvm


def _rows_of_every_length(rng, dtype: str, rows: int = 48, cols: int = 64) -> sp.csr_matrix:
    """Row ``r`` holds ``r`` entries: full groups of 16 and every remainder, and an empty row."""
    dense = np.zeros((rows, cols))
    for r in range(rows):
        dense[r, rng.choice(cols, size=r, replace=False)] = rng.integers(1, 5, r)
    return sp.csr_matrix(dense.astype(dtype))


def _at_line_offset(matrix: np.ndarray, offset: int) -> np.ndarray:
    """A C-contiguous copy of ``matrix`` starting ``offset`` bytes past a 64-byte line."""
    buffer = np.empty(matrix.size * matrix.itemsize + 128, dtype=np.uint8)
    start = (offset - buffer.ctypes.data) % 64
    placed = buffer[start:start + matrix.size * matrix.itemsize].view(matrix.dtype).reshape(matrix.shape)
    placed[...] = matrix
    assert placed.ctypes.data % 64 == offset and placed.flags.c_contiguous
    return placed


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("k", [16, 37, 64, 65])
@pytest.mark.parametrize("expression", ["C[i,j] = S[i,j] * A[i,k] * B[k,j]", "C[i,j] = S[i,j] * A[i,k] * B[j,k]"])
def test_every_row_length_with_b_either_way_round(expression, dtype, k, rng):
    """Groups of a row's entries (16, then the rest's binary digits) and ``B`` as ``[K, N]`` or ``[N, K]``."""
    s = _rows_of_every_length(rng, dtype)
    draw = (lambda shape: rng.integers(-3, 4, shape)) if dtype.startswith("int") else rng.standard_normal
    a, b = draw((s.shape[0], k)).astype(dtype), draw((k, s.shape[1])).astype(dtype)
    operand = b if "B[k,j]" in expression else np.ascontiguousarray(b.T)
    kernel = sm.compile(expression, formats={"S": "csr", "C": "csr"}, dtype=dtype)
    got = kernel(S=sm.SparseTensor.from_scipy(s), A=a, B=operand).to_scipy()
    want = s.multiply(a.astype(np.float64) @ b.astype(np.float64))
    np.testing.assert_array_equal(got.indices, s.indices)
    np.testing.assert_allclose(got.toarray(), want.toarray(), rtol=1e-5, atol=1e-5 * max(1, abs(want).max()))


@pytest.mark.parametrize("offset", [0, 16, 48])
@pytest.mark.parametrize("density", [0.02, 0.5])  # B's rows read about once (left in place) or 24 times (copied)
@pytest.mark.parametrize("dtype", ["float32", "float64"])  # rows of 2 and 4 lines: 8 or 16 lanes a vector
def test_b_by_rows_on_or_off_a_line_is_read_in_place_or_copied(offset, density, dtype, rng):
    """``B[j,k]`` needs no transpose; off a cache line, with its rows whole lines and reused, it is copied onto
    one first (rows in parallel).  Either way the result is the same and ``B`` is not modified."""
    rows, cols, k = 64, 48, 32
    s = sp.random(rows, cols, density=density, format="csr", dtype=dtype, random_state=2)
    a = rng.standard_normal((rows, k)).astype(dtype)
    b_rows = _at_line_offset(rng.standard_normal((cols, k)).astype(dtype), offset)
    before = b_rows.copy()
    kernel = sm.compile("C[i,j] = S[i,j] * A[i,k] * B[j,k]", formats={"S": "csr", "C": "csr"}, dtype=dtype)
    got = kernel(S=sm.SparseTensor.from_scipy(s), A=a, B=b_rows).to_scipy()
    np.testing.assert_allclose(got.toarray(), s.multiply(a @ before.T).toarray(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(b_rows, before)


@pytest.mark.parametrize("expression", ["C[i,j] = S[i,j] * A[i,k] * B[k,j]", "C[i,j] = S[i,j] * A[i,k] * B[j,k]"])
@pytest.mark.parametrize("density", [0.002, 0.05])  # B read about 4 times a row in all (one shared copy) or 100
def test_two_threads_share_one_copy_of_b_or_make_their_own(expression, density, rng):
    """On two threads the copy the dot products read (``B^T``, or ``B[j,k]`` moved onto lines) is made once and
    shared when each thread would read its rows only a few times, else by each thread for itself
    (``_ReadCopy``); the shared one is filled before any thread reads it (``loops.in_phases``)."""
    from sparse_mlir.runtime import threads

    rows, cols, k = 1500, 2048, 64
    s = sp.random(rows, cols, density=density, format="csr", dtype=np.float32, random_state=3)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    b = rng.standard_normal((k, cols)).astype(np.float32)
    operand = b if "B[k,j]" in expression else _at_line_offset(np.ascontiguousarray(b.T), 16)
    kernel = sm.compile(expression, formats={"S": "csr", "C": "csr"}, dtype="float32")
    want = s.multiply(a.astype(np.float64) @ b.astype(np.float64)).toarray()
    tensor = sm.SparseTensor.from_scipy(s)
    with threads.fixed(2):
        for _ in range(5):
            got = kernel(S=tensor, A=a, B=operand).to_scipy()
            np.testing.assert_allclose(got.toarray(), want, rtol=1e-4, atol=1e-4)
