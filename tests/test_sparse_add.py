"""The hand-scheduled CPU sparse add (``dialects/native/sparse_add.py``): CSR + CSR -> CSR against scipy.

What every result must be: the union of the operands' patterns (a sum that
cancels to zero stays stored, as the sparsifier's kernel stores it; scipy
drops it), columns sorted and unique within each row, values
``alpha * A + beta * B`` equal to scipy's (exactly for the small integers
used here), whatever the dtype, index widths, thread count, row lengths,
coefficients and operand order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.data import DTYPES, random_sparse

import sparse_mlir as sm
import sparse_mlir.data
from sparse_mlir.dialects.native.sparse_add import STAMP_COLUMNS, STAMP_ENTRIES
from sparse_mlir.dsl.patterns import sparse_sum_operands, threads_sparse_output
from sparse_mlir.errors import DTypeError, InvalidIndicesError, ShapeError
from sparse_mlir.formats import CSR
from sparse_mlir.io import read_matrix
from sparse_mlir.runtime.threads import fixed, openmp_library

EXPRESSION = "C[i,j] = A[i,j] + B[i,j]"
SUITESPARSE = Path("/work/shared/data/suitesparse")


def _kernel(dtype: str = "float64", a="csr", b="csr", c="csr", expression: str = EXPRESSION):
    return sm.compile(expression, formats={"A": a, "B": b, "C": c}, dtype=dtype)


def _pattern(m: sp.csr_array) -> sp.csr_array:
    """The stored entries of ``m`` as ones (explicit zeros included)."""
    return sp.csr_array((np.ones(m.nnz), m.indices, m.indptr), shape=m.shape)


def _check(got: sm.SparseTensor, a: sp.csr_array, b: sp.csr_array, alpha: float = 1, beta: float = 1) -> None:
    """``got`` holds the union of ``a``'s and ``b``'s patterns with ``alpha * a + beta * b`` there, rows sorted."""
    c = got.to_scipy()
    assert got.shape == a.shape
    structure = _pattern(a) + _pattern(b)
    structure.sort_indices()
    np.testing.assert_array_equal(c.indptr, structure.indptr)
    np.testing.assert_array_equal(c.indices, structure.indices)  # sorted and unique: scipy's sort_indices order
    expected = alpha * a.astype(np.float64) + beta * b.astype(np.float64)
    # the expected values at the union's positions, explicit zeros included
    dense_at = np.asarray(expected.toarray()[np.repeat(np.arange(a.shape[0]), np.diff(c.indptr)), c.indices])
    if np.issubdtype(c.dtype, np.integer):
        np.testing.assert_array_equal(c.data, dense_at.astype(c.dtype))
    else:
        np.testing.assert_allclose(c.data, dense_at, rtol=1e-6 if c.dtype == np.float32 else 1e-13, atol=0)


def _random(rng: np.random.Generator, shape: tuple[int, int], density: float, dtype: str) -> sp.csr_array:
    return sp.csr_array(random_sparse(rng, shape, density, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_sums_match_scipy(dtype, rng):
    a, b = _random(rng, (70, 90), 0.1, dtype), _random(rng, (70, 90), 0.15, dtype)
    kernel = _kernel(dtype)
    before = [x.copy() for x in (a.data, a.indices, a.indptr, b.data, b.indices, b.indptr)]
    _check(kernel(A=sm.SparseTensor.from_scipy(a), B=sm.SparseTensor.from_scipy(b)), a, b)
    _check(kernel(A=a, B=b), a, b)  # scipy operands in place
    for was, now in zip(before, (a.data, a.indices, a.indptr, b.data, b.indices, b.indptr)):
        np.testing.assert_array_equal(was, now)  # the operands are only read
    assert kernel.shape_generic
    assert "linalg.generic" not in kernel.ir["input"] and "scf.parallel" in kernel.ir["input"]
    if openmp_library() is not None:  # threaded: both passes become OpenMP loops (the count pass in two forms:
        assert kernel.ir["mapped"].count("omp.wsloop") == 3  # by workers with column stamps, or by chunks)


@pytest.mark.parametrize("expression, alpha, beta", [
    ("C[i,j] = A[i,j] - B[i,j]", 1, -1),
    ("C[i,j] = 2*A[i,j] + B[i,j]*3", 2, 3),
    ("C[i,j] = -(A[i,j] - 3*B[i,j])", -1, 3),
    ("C[i,j] = B[i,j] + A[i,j]", 1, 1),
    ("C[i,j] = -B[i,j] - A[i,j]", -1, -1),
])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_differences_and_scaled_forms(expression, alpha, beta, dtype, rng):
    a, b = _random(rng, (50, 40), 0.2, dtype), _random(rng, (50, 40), 0.2, dtype)
    kernel = _kernel(dtype, expression=expression)
    assert sparse_sum_operands(kernel.spec, kernel.spec.formats) is not None
    _check(kernel(A=a, B=b), a, b, alpha, beta)


def test_fractional_coefficients(rng):
    a, b = _random(rng, (30, 30), 0.3, "float64"), _random(rng, (30, 30), 0.3, "float64")
    _check(_kernel(expression="C[i,j] = 0.5*A[i,j] - B[i,j]*0.25")(A=a, B=b), a, b, 0.5, -0.25)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, density", [((300, 200), 0.01), ((300, 200), 0.3), ((2000, 3000), 0.004),
                                            ((5, 100_000), 0.002)])
def test_sizes_densities_and_threads(shape, density, threads, rng):
    a, b = (sp.random(*shape, density=density, format="csr", random_state=s, dtype=np.float32) for s in (1, 2))
    a, b = sp.csr_array(a), sp.csr_array(b)
    with fixed(threads):
        _check(_kernel("float32")(A=a, B=b), a, b)


# (shape, density of A, density of B): the count pass by stamps (at least STAMP_ENTRIES operand entries, the largest
# column at most their entries and STAMP_COLUMNS), or by merging (product: a bitmap) because of few entries, more
# columns than entries, or more than STAMP_COLUMNS
COUNT_CASES = {"stamps": ((1200, 3000), 0.02, 0.01), "merge: few entries": ((400, 3000), 0.02, 0.01),
               "merge: more columns than entries": ((400, 9000), 0.0005, 0.001),
               "merge: many columns": ((300, STAMP_COLUMNS + 5), 0.0008, 0.0001)}


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("expression", [EXPRESSION, "C[i,j] = A[i,j] * B[i,j]"])
def test_stamped_and_merged_counts_agree_with_scipy(case, threads, expression, rng):
    """Both ways of counting a row's entries of ``C`` (the two rows' shared columns by per-worker stamps, or a
    merge / a bitmap per chunk) size ``C`` right, for the sum and the product, with rows of the same columns
    and rows at the last column; the cases sit on the side of the rule they are named for."""
    shape, density_a, density_b = COUNT_CASES[case]
    a, b = (sp.random_array(shape, density=d, format="lil", rng=rng) for d in (density_a, density_b))
    a[0, shape[1] - 1] = b[1, shape[1] - 1] = 3.0
    a[2, :5] = b[2, :5] = 1.0
    a, b = sp.csr_array(a), sp.csr_array(b)
    columns, entries = int(max(a.indices.max(), b.indices.max())) + 1, a.nnz + b.nnz
    assert (entries >= STAMP_ENTRIES and columns <= min(entries, STAMP_COLUMNS)) == (case == "stamps")
    with fixed(threads):
        c = _kernel(expression=expression)(A=a, B=b).to_scipy()
    want = sp.csr_array(a + b if "+" in expression else a.multiply(b))  # random values: nothing cancels
    want.sort_indices()
    np.testing.assert_array_equal(c.indptr, want.indptr)
    np.testing.assert_array_equal(c.indices, want.indices)
    np.testing.assert_allclose(c.data, want.data, rtol=1e-13)


@pytest.mark.parametrize("heavy", [[0], [399], [0, 1, 2], list(range(0, 400, 37))])
def test_skewed_rows_split_into_chunks_that_cover_every_row_once(heavy, rng):
    """Chunks hold equal numbers of operand entries: a few dense rows among sparse ones put whole chunks on one
    row and leave others empty; every row must still be written exactly once."""
    a = random_sparse(rng, (400, 3000), 0.002, "float64")
    a[heavy, :] = random_sparse(rng, (len(heavy), 3000), 0.9, "float64")
    a = sp.csr_array(a)
    b = _random(rng, (400, 3000), 0.003, "float64")
    with fixed(2):
        _check(_kernel()(A=a, B=b), a, b)
        _check(_kernel()(A=b, B=a), b, a)


def test_empty_rows_trailing_rows_overlap_and_cancellation():
    a = sp.csr_array(np.array([[1.0, 0, 2, 0], [0, 0, 0, 0], [0, 3, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]))
    b = sp.csr_array(np.array([[1.0, 5, 0, 0], [0, 0, 0, 7], [0, -3, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]))
    got = _kernel(expression="C[i,j] = A[i,j] - B[i,j]")(A=a, B=b)
    _check(got, a, b, 1, -1)
    c = got.to_scipy()
    assert list(c.indptr) == [0, 3, 4, 5, 5, 5]
    assert list(c.indices) == [0, 1, 2, 3, 1] and list(c.data) == [0.0, -5.0, 2.0, -7.0, 6.0]  # 0 stays stored


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_the_same_columns_and_rows_at_the_buffers_end(threads, rng):
    """Rows of equal columns add entry by entry; rows of equal length but other columns, and the last rows
    (whose next column is past the buffers' end), merge."""
    a = _random(rng, (300, 64), 0.2, "float64")
    b = sp.csr_array((rng.standard_normal(a.nnz), a.indices.copy(), a.indptr.copy()), shape=a.shape)  # a's pattern
    shifted = b.tolil()
    for r in range(0, 300, 3):  # every third row: the same length, one column moved
        row = shifted.rows[r]
        if row and row[-1] < 63:
            value = shifted[r, row[-1]]
            shifted[r, row[-1]] = 0
            shifted[r, 63] = value
    shifted = sp.csr_array(shifted)
    shifted.eliminate_zeros()
    with fixed(threads):
        _check(_kernel()(A=a, B=b), a, b)
        _check(_kernel()(A=a, B=shifted), a, shifted)
        _check(_kernel()(A=shifted, B=a), shifted, a)


@pytest.mark.parametrize("a, b", [
    (sp.csr_array((6, 4)), sp.csr_array((6, 4))),  # both empty
    (sp.csr_array((6, 4)), sp.csr_array(np.eye(6, 4))),  # A empty
    (sp.csr_array(np.eye(6, 4)), sp.csr_array((6, 4))),  # B empty
    (sp.csr_array((0, 4)), sp.csr_array((0, 4))),  # no rows
    (sp.csr_array((3, 0)), sp.csr_array((3, 0))),  # no columns
    (sp.csr_array(np.ones((1, 9))), sp.csr_array(np.ones((1, 9)))),  # a single full row
])
def test_empty_and_degenerate_operands(a, b):
    got = _kernel()(A=a, B=b)
    assert got.shape == a.shape
    _check(got, a, b)


@pytest.mark.parametrize("widths", [((64, 64), (32, 32), (32, 32)), ((32, 32), (64, 64), (64, 32)),
                                    ((64, 32), (32, 16), (64, 64)), ((32, 16), (32, 16), (32, 16))])
def test_index_widths(widths, rng):
    """Operands and result of any index widths; 16-bit operand coordinates past the signed range (40000) compare
    unsigned (a result's coordinates must fit its width as signed numbers: the C entry point refuses more)."""
    (ap, ac), (bp, bc), (cp, cc) = widths
    cols = 20_000 if cc == 16 else 40_000 if 16 in (ac, bc) else 500
    a = sp.csr_array(sp.random(20, cols, density=0.01, format="csr", random_state=3, dtype=np.int64))
    b = sp.csr_array(sp.random(20, cols, density=0.01, format="csr", random_state=4, dtype=np.int64))
    a.data[:], b.data[:] = rng.integers(1, 9, a.nnz), rng.integers(-9, 0, b.nnz)
    kernel = _kernel("int64", CSR.with_widths(ap, ac), CSR.with_widths(bp, bc), CSR.with_widths(cp, cc))
    got = kernel(A=sm.SparseTensor.from_scipy(a, CSR.with_widths(ap, ac)),
                 B=sm.SparseTensor.from_scipy(b, CSR.with_widths(bp, bc)))
    assert got.format == CSR.with_widths(cp, cc)
    assert [buffer.dtype.itemsize * 8 for buffer in got.buffers[:2]] == [cp, cc]
    _check(got, a, b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(0, 12), cols=st.integers(1, 40), density_a=st.floats(0, 1), density_b=st.floats(0, 1),
       seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES))
def test_random_patterns_match_scipy(rows, cols, density_a, density_b, seed, dtype):
    rng = np.random.default_rng(seed)
    a, b = _random(rng, (rows, cols), density_a, dtype), _random(rng, (rows, cols), density_b, dtype)
    _check(_kernel(dtype)(A=a, B=b), a, b)


def _real_matrices() -> list[Path]:
    bundled = Path(sparse_mlir.data.__file__).parent
    found = [bundled / "west0479.mtx.gz", bundled / "karate.mtx.gz"]
    return found + [SUITESPARSE / f"{name}.mtx.gz" for name in ("bcsstk13", "cryg2500", "rajat01", "zenios")
                    if (SUITESPARSE / f"{name}.mtx.gz").is_file()]


@pytest.mark.parametrize("path", _real_matrices(), ids=lambda p: p.name)
def test_real_matrices_plus_their_transpose(path):
    a = sp.csr_array(read_matrix(path))
    a.sum_duplicates()
    a.sort_indices()
    if a.shape[0] != a.shape[1]:
        pytest.skip("not square")
    b = sp.csr_array(a.T)
    b.sort_indices()
    with fixed(2):
        _check(_kernel()(A=a, B=b), a, b)
        _check(_kernel(expression="C[i,j] = A[i,j] - B[i,j]")(A=a, B=b), a, b, 1, -1)


def test_what_is_not_a_sparse_add_is_left_to_the_sparsifier():
    def matched(expression: str, formats: dict) -> bool:
        spec = sm.compile(expression, formats=formats, dtype="float32").spec
        return sparse_sum_operands(spec, spec.formats) is not None

    assert matched(EXPRESSION, {"A": "csr", "B": "csr", "C": "csr"})
    assert matched(EXPRESSION, {"A": CSR.with_widths(64, 16), "B": "csr", "C": CSR.with_widths(64, 64)})
    assert not matched(EXPRESSION, {"A": "csr", "B": "csc", "C": "csr"})
    assert not matched(EXPRESSION, {"A": "csr", "B": "csr", "C": "dcsr"})
    assert not matched("C[i,j] = A[i,j] + B[j,i]", {"A": "csr", "B": "csr", "C": "csr"})
    assert not matched("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "B": "csr", "C": "csr"})
    assert not matched("C[i,j] = A[i,j] + A[i,j]", {"A": "csr", "C": "csr"})
    assert not matched("C[i,j] = A[i,j] + B[i,j] + D[i,j]", {"A": "csr", "B": "csr", "C": "csr", "D": "csr"})
    assert not matched("C[i,j] = relu(A[i,j]) + B[i,j]", {"A": "csr", "B": "csr", "C": "csr"})


def test_the_openmp_runtime_is_linked_for_it():
    spec = _kernel().spec
    assert threads_sparse_output(spec, spec.formats)


def test_bad_operands_are_named_errors():
    kernel = _kernel()
    with pytest.raises(ShapeError):
        kernel(A=sp.csr_array(np.ones((5, 4))), B=sp.csr_array(np.ones((5, 6))))
    with pytest.raises(ShapeError):
        kernel(A=sp.csr_array(np.ones((5, 4))), B=sp.csr_array(np.ones((3, 4))))
    wild = sp.csr_array(np.ones((5, 4)))
    wild.indices[3] = 9  # a column past the width
    with pytest.raises(InvalidIndicesError):
        kernel(A=wild, B=sp.csr_array(np.ones((5, 4))))
    with pytest.raises(DTypeError):
        kernel(A=sp.csr_array(np.ones((5, 4))), B=sp.csr_array(np.ones((5, 4), dtype=np.float32)))
    with pytest.raises(DTypeError):
        _kernel("float32")(A=sp.csr_array(np.ones((5, 4))), B=sp.csr_array(np.ones((5, 4))))
