"""The tiled CPU SpMM reads whole vectors of B's rows; B may start anywhere (numpy aligns to 16 bytes, a slice
anywhere): B off a cache line is copied to one when that pays (``spmm.aligned_b``).  Whatever B's address, row
length, dtype or reuse, the result is the same as from an aligned B, and B is not modified."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from sparse_mlir.dialects.native.spmm import B_ALIGNMENT, COPY_REUSE
from support.data import prune_nm, random_sparse

import sparse_mlir as sm


def _at_offset(b: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``b`` whose data starts ``offset`` elements past a ``B_ALIGNMENT``-byte boundary."""
    spare = B_ALIGNMENT // b.itemsize
    buffer = np.empty(b.size + 2 * spare, b.dtype)
    start = (-buffer.ctypes.data % B_ALIGNMENT) // b.itemsize + offset
    view = buffer[start:start + b.size].reshape(b.shape)
    view[...] = b
    assert view.ctypes.data % B_ALIGNMENT == offset * b.itemsize
    return view


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("cols", [128, 100])  # rows a whole number of lines (copied when off one), or not
@pytest.mark.parametrize("density", [0.3, 0.5 * COPY_REUSE / 64])  # reused enough to copy, or too little
def test_every_offset_of_b_gives_the_aligned_result(rng, dtype, cols, density):
    a = sp.csr_array(random_sparse(rng, (48, 64), density, dtype))
    b = rng.standard_normal((64, cols)).astype(dtype)
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype=dtype)
    expected = kernel(A=a, B=_at_offset(b, 0))
    np.testing.assert_allclose(expected, a @ b, rtol=1e-4 if dtype == "float32" else 1e-12, atol=1e-5)
    for offset in range(1, B_ALIGNMENT // np.dtype(dtype).itemsize):
        shifted = _at_offset(b, offset)
        np.testing.assert_array_equal(kernel(A=a, B=shifted), expected)
        np.testing.assert_array_equal(shifted, b)  # read, never written


def test_nm_rows_and_a_bias_with_b_off_a_line(rng):
    dense = prune_nm(rng.standard_normal((32, 64)).astype(np.float32), 2, 4)
    a = sm.SparseTensor.from_dense(dense, "2:4")
    b, bias = rng.standard_normal((64, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j] + bias[j]", formats={"A": "2:4"}, dtype="float32")
    expected = kernel(A=a, B=_at_offset(b, 0), bias=bias)
    np.testing.assert_allclose(expected, dense @ b + bias, rtol=1e-4, atol=1e-5)
    for offset in (1, 4, 12):
        np.testing.assert_array_equal(kernel(A=a, B=_at_offset(b, offset), bias=bias), expected)


def test_bsr_blocks_with_b_off_a_line(rng):
    blocks = (rng.random((16, 16)) < 0.3).astype(np.float32)
    dense = np.kron(blocks, np.ones((4, 4), np.float32)) * rng.standard_normal((64, 64)).astype(np.float32)
    a = sm.SparseTensor.from_dense(dense, sm.BSR(4, 4))
    b = rng.standard_normal((64, 64)).astype(np.float32)
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": a.format}, dtype="float32")
    expected = kernel(A=a, B=_at_offset(b, 0))
    np.testing.assert_allclose(expected, dense @ b, rtol=1e-4, atol=1e-5)
    for offset in range(1, 16):
        np.testing.assert_array_equal(kernel(A=a, B=_at_offset(b, offset)), expected)


@pytest.mark.parametrize("fmt", ["csr", "2:4"])
@pytest.mark.parametrize("rows", [0, 1, 9, 203])
def test_any_thread_count_gives_the_one_thread_result(rng, fmt, rows):
    """The tiled SpMM hands ranges of rows to threads from a counter, each thread with its own aligned copy of B
    (``spmm._work_queue``): more threads than ranges, ranges cut short by the last row, no rows at all."""
    from sparse_mlir.runtime import threads

    dense = rng.standard_normal((rows, 64)).astype(np.float32)
    dense = prune_nm(dense, 2, 4) if fmt == "2:4" else dense * (rng.random(dense.shape) < 0.4)
    a = sm.SparseTensor.from_dense(dense, fmt)
    b = _at_offset(rng.standard_normal((64, 64)).astype(np.float32), 4)  # off a line: copied by each thread
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": fmt}, dtype="float32")
    with threads.fixed(1):
        expected = kernel(A=a, B=b)
    np.testing.assert_allclose(expected, dense @ b, rtol=1e-4, atol=1e-4)
    for count in (2, 3, 8):
        with threads.fixed(count):
            np.testing.assert_array_equal(kernel(A=a, B=b), expected)
