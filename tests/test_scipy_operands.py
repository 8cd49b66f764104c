"""scipy operands: zero-copy in their own layout, bounds checked on every call, order taken from scipy's flag."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import random_sparse, random_values

import sparse_mlir as sm
from sparse_mlir.errors import InvalidIndicesError
from sparse_mlir.runtime.operands import sparse_operand
from sparse_mlir.tensor.host import share_scipy

SPMV = "y[i] = A[i,k] * x[k]"
SPGEMM = "C[i,j] = A[i,k] * B[k,j]"


def _index_buffers(matrix):
    return (matrix.row, matrix.col) if matrix.format == "coo" else (matrix.indptr, matrix.indices)


@pytest.mark.parametrize("kind, fmt", [("csr_matrix", sm.CSR), ("csr_array", sm.CSR), ("csc_array", sm.CSC),
                                       ("csc_matrix", sm.CSC), ("bsr_array", sm.BSR(2, 3)), ("coo_array", sm.COO)])
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_own_layout_is_shared_at_its_index_width(rng, kind, fmt, index):
    dense = random_sparse(rng, (8, 9), 0.4, "float64")
    matrix = getattr(sp, kind)(dense, blocksize=(2, 3)) if kind.startswith("bsr") else getattr(sp, kind)(dense)
    matrix.sum_duplicates()  # sorted and duplicate-free, and scipy's flag says so
    if kind.startswith("coo"):
        matrix.coords = tuple(b.astype(index) for b in _index_buffers(matrix))
    else:
        matrix.indptr, matrix.indices = (b.astype(index) for b in _index_buffers(matrix))
    assert matrix.has_canonical_format and _index_buffers(matrix)[0].dtype == index
    tensor = sparse_operand("A", matrix, fmt, np.dtype("float64"), "cpu")
    width = np.dtype(index).itemsize * 8
    assert tensor.format == fmt.with_widths(width, width)
    for buffer in (*_index_buffers(matrix), matrix.data):
        assert any(np.shares_memory(buffer, b) for b in tensor.buffers), "copied instead of shared"
    assert all(b.flags.writeable for b in (*_index_buffers(matrix), matrix.data))  # the user's arrays untouched
    x = random_values(rng, 9, "float64")
    np.testing.assert_array_equal(sm.compile(SPMV, formats={"A": fmt})(A=matrix, x=x), dense @ x)


def test_unsorted_and_duplicate_entries_are_summed_in_a_copy(rng):
    dense = random_sparse(rng, (6, 7), 0.5, "float64")
    canonical = sp.csr_array(dense)
    indices, data = [], []
    for r in range(6):  # every entry twice, the second half of each row reversed: unsorted, with duplicates
        lo, hi = canonical.indptr[r], canonical.indptr[r + 1]
        indices += [canonical.indices[lo:hi], canonical.indices[lo:hi][::-1]]
        data += [canonical.data[lo:hi] / 2, canonical.data[lo:hi][::-1] / 2]
    matrix = sp.csr_array((np.concatenate(data), np.concatenate(indices), 2 * canonical.indptr), shape=(6, 7))
    assert not matrix.has_canonical_format
    before = [b.copy() for b in (matrix.indptr, matrix.indices, matrix.data)]
    x = random_values(rng, 7, "float64")
    np.testing.assert_array_equal(sm.compile(SPMV, formats={"A": "csr"})(A=matrix, x=x), dense @ x)
    for old, new in zip(before, (matrix.indptr, matrix.indices, matrix.data)):
        np.testing.assert_array_equal(old, new)


def test_unsorted_matrix_is_not_shared_but_converted(rng):
    matrix = sp.csr_array((np.array([1.0, 2.0]), np.array([3, 1], np.int32), np.array([0, 2, 2], np.int32)),
                          shape=(2, 4))
    assert share_scipy(matrix, sm.CSR) is None  # scipy says it is not canonical
    tensor = sparse_operand("A", matrix, sm.CSR, np.dtype("float64"), "cpu")
    np.testing.assert_array_equal(tensor.buffer("crd1"), [1, 3])
    np.testing.assert_array_equal(matrix.indices, [3, 1])  # the caller's order is left as it was


def _lying(rng):
    """A canonical CSR matrix whose scipy flag was cached, then whose indices were reordered in place."""
    dense = random_sparse(rng, (30, 20), 0.4, "float64")
    matrix = sp.csr_array(dense)
    assert matrix.has_canonical_format  # scipy caches its flag
    for r in range(30):
        lo, hi = matrix.indptr[r], matrix.indptr[r + 1]
        matrix.indices[lo:hi] = matrix.indices[lo:hi][::-1].copy()
        matrix.data[lo:hi] = matrix.data[lo:hi][::-1].copy()
    return dense, matrix


def test_lying_flag_only_changes_the_order_spmv(rng):
    dense, matrix = _lying(rng)
    assert matrix.has_canonical_format  # still cached: the flag lies
    x = random_values(rng, 20, "float64")  # small integers: every summation order is exact
    np.testing.assert_array_equal(sm.compile(SPMV, formats={"A": "csr"})(A=matrix, x=x), dense @ x)


def test_lying_flag_with_duplicates_sums_them_as_scipy_does(rng):
    _, matrix = _lying(rng)
    row = int(np.argmax(np.diff(matrix.indptr)))
    lo = matrix.indptr[row]
    matrix.indices[lo + 1] = matrix.indices[lo]  # a duplicate, in range
    x = random_values(rng, 20, "float64")
    np.testing.assert_array_equal(sm.compile(SPMV, formats={"A": "csr"})(A=matrix, x=x), matrix @ x)


def test_lying_flag_sparse_output_runs_in_bounds(rng):
    dense, matrix = _lying(rng)
    other = sp.csr_array(random_sparse(rng, (20, 10), 0.4, "float64"))
    result = sm.compile(SPGEMM, formats={"A": "csr", "B": "csr", "C": "csr"})(A=matrix, B=other)
    # every coordinate the kernel wrote is in range; the values are the product (in some order)
    coords, _ = result.to_coo()
    assert coords.size == 0 or (coords[0].max() < 30 and coords[1].max() < 10)
    np.testing.assert_allclose(result.to_dense(), dense @ other.toarray())


@pytest.mark.parametrize("corrupt, message", [
    (lambda m: m.indices.__setitem__(3, 20), "index 20 is out of range"),
    (lambda m: m.indices.__setitem__(3, -1), "index -1 is out of range"),
    (lambda m: m.indptr.__setitem__(5, m.indptr[6] + 1), "monotone"),
    (lambda m: m.indptr.__setitem__(0, 1), "start at 0"),
    (lambda m: m.indptr.__setitem__(-1, m.indptr[-1] - 1), "nnz mismatch"),
])
def test_out_of_bounds_is_refused_even_when_the_flag_says_canonical(rng, corrupt, message):
    dense = random_sparse(rng, (30, 20), 0.4, "float64")
    matrix = sp.csr_array(dense)
    assert matrix.has_canonical_format
    corrupt(matrix)
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    with pytest.raises(InvalidIndicesError, match=message):
        kernel(A=matrix, x=np.ones(20))


def test_coo_out_of_bounds_and_length_mismatch_are_refused():
    coo = sp.coo_array((np.ones(2), (np.array([0, 1]), np.array([0, 1]))), shape=(2, 2))
    coo.sum_duplicates()
    coo.col[1] = 5
    with pytest.raises(InvalidIndicesError, match="column index 5 is out of range"):
        sm.compile(SPMV, formats={"A": "coo"})(A=coo, x=np.ones(2))


def test_other_layouts_are_converted(rng):
    dense = random_sparse(rng, (7, 5), 0.4, "float64")
    x = random_values(rng, 5, "float64")
    for matrix in (sp.csr_array(dense), sp.lil_array(dense), sp.dia_array(dense)):
        np.testing.assert_array_equal(sm.compile(SPMV, formats={"A": "csc"})(A=matrix, x=x), dense @ x)


def test_a_matrix_passed_again_is_checked_again(rng):
    dense = random_sparse(rng, (30, 20), 0.4, "float64")
    matrix = sp.csr_array(dense)
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    x = random_values(rng, 20, "float64")
    np.testing.assert_array_equal(kernel(A=matrix, x=x), dense @ x)
    matrix.data *= 2  # values changed in place: the zero-copy operand sees them
    np.testing.assert_array_equal(kernel(A=matrix, x=x), 2 * dense @ x)
    matrix.indices[0] = 25  # an index changed in place after a call: refused on the next one
    with pytest.raises(InvalidIndicesError, match="index 25 is out of range"):
        kernel(A=matrix, x=x)
    other = sp.csr_array(dense[:, ::-1])
    matrix.indptr, matrix.indices, matrix.data = other.indptr, other.indices, other.data  # new arrays: new wrapper
    np.testing.assert_array_equal(kernel(A=matrix, x=x), dense[:, ::-1] @ x)


@pytest.mark.parametrize("kind", ["csr", "csc", "bsr", "coo"])
def test_big_endian_indices_are_copied_not_read_as_native(kind):
    """numpy reads a big-endian index right, so scipy and the bounds checks accept it; a kernel reads its bytes:
    shared, index 256 was 65536 (a wrong sum here, a read far outside a shorter ``x``)."""
    n = (512 << 8) + 1
    matrix = sp.csr_matrix((np.array([2.0, 3.0]), np.array([256, 512], np.int32), np.array([0, 2], np.int32)),
                           shape=(1, n))
    matrix = matrix.asformat(kind, copy=True) if kind != "bsr" else matrix.tobsr(blocksize=(1, 1))
    matrix.sum_duplicates()
    if kind == "coo":
        matrix.coords = tuple(b.astype(">i4") for b in matrix.coords)
    else:
        matrix.indices = matrix.indices.astype(">i4")
    x = np.zeros(n)
    x[256], x[512], x[256 << 8], x[512 << 8] = 1.0, 10.0, 1000.0, 10000.0  # the indices and them byte-swapped
    fmt = {"csr": sm.CSR, "csc": sm.CSC, "bsr": sm.BSR(1, 1), "coo": sm.COO}[kind]
    assert share_scipy(matrix, fmt) is None
    if kind in ("csr", "bsr", "coo"):
        np.testing.assert_array_equal(sm.compile(SPMV, formats={"A": fmt})(A=matrix, x=x), [32.0])
    tensor = sm.SparseTensor.from_scipy(matrix)
    assert all(b.dtype.isnative for b in tensor.buffers)
    np.testing.assert_array_equal(tensor.to_dense(), matrix.toarray())


@pytest.mark.parametrize("kind", ["csr", "csc", "bsr"])
@pytest.mark.parametrize("to", [None, "csr", "csc", "coo"])
def test_mixed_index_widths_convert(rng, kind, to):
    """int64 positions with int32 coordinates (scipy computes with them) made scipy's ``tocoo`` raise a bare
    ``ValueError`` in ``from_scipy``'s copy."""
    dense = random_sparse(rng, (8, 9), 0.4, "float64")
    matrix = sp.csr_matrix(dense).asformat(kind) if kind != "bsr" else sp.bsr_matrix(dense, blocksize=(2, 3))
    matrix.indptr = matrix.indptr.astype(np.int64)
    assert matrix.indices.dtype == np.int32
    tensor = sm.SparseTensor.from_scipy(matrix, to)
    np.testing.assert_array_equal(tensor.to_dense(), dense)
