"""The hand-scheduled CPU SpGEMM (``dialects/native/spgemm.py``): CSR x CSR -> CSR against scipy.

What every result must be: the structural product (every column some
``A[i,k] * B[k,j]`` pair reaches, a product that sums to zero included, as
the sparsifier's kernel stores it), columns sorted and unique within each
row, values equal to scipy's (exactly for integers), whatever the dtype,
index widths, thread count, row lengths and column count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import DTYPES, random_sparse

import sparse_mlir as sm
import sparse_mlir.data
from sparse_mlir.dialects.native.spgemm import BLOCK_WORDS, STAMP_COLUMNS
from sparse_mlir.dsl.patterns import spgemm_operands, threads_sparse_output
from sparse_mlir.errors import DTypeError, InvalidIndicesError, ShapeError
from sparse_mlir.formats import CSR
from sparse_mlir.io import read_matrix
from sparse_mlir.runtime.threads import fixed, openmp_library

EXPRESSION = "C[i,j] = A[i,k] * B[k,j]"
SUITESPARSE = Path("/work/shared/data/suitesparse")


def _kernel(dtype: str = "float64", a="csr", b="csr", c="csr", expression: str = EXPRESSION):
    return sm.compile(expression, formats={"A": a, "B": b, "C": c}, dtype=dtype)


def _pattern(m: sp.csr_array) -> sp.csr_array:
    """The stored entries of ``m`` as ones (explicit zeros included)."""
    return sp.csr_array((np.ones(m.nnz), m.indices, m.indptr), shape=m.shape)


def _check(got: sm.SparseTensor, a: sp.csr_array, b: sp.csr_array) -> None:
    """``got`` is the structural product of ``a`` and ``b`` with scipy's values, rows sorted and unique."""
    c = got.to_scipy()
    structure = _pattern(a) @ _pattern(b)
    structure.sort_indices()
    np.testing.assert_array_equal(c.indptr, structure.indptr)
    np.testing.assert_array_equal(c.indices, structure.indices)  # sorted and unique: scipy's sort_indices order
    if np.issubdtype(c.dtype, np.integer):  # exact, in the kernel's own wrapping arithmetic
        difference = c - (a.astype(c.dtype) @ b.astype(c.dtype))
        assert difference.count_nonzero() == 0
    else:
        difference = abs(c.astype(np.float64) - a.astype(np.float64) @ b.astype(np.float64))
        scale = abs(a).astype(np.float64) @ abs(b).astype(np.float64)  # no cancellation in the bound
        tol = 1e-5 if c.dtype == np.float32 else 1e-12
        assert np.max((difference - tol * scale).data, initial=0.0) <= 1e-30


def _random(rng: np.random.Generator, shape: tuple[int, int], density: float, dtype: str) -> sp.csr_array:
    return sp.csr_array(random_sparse(rng, shape, density, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_products_match_scipy(dtype, rng):
    a, b = _random(rng, (70, 50), 0.08, dtype), _random(rng, (50, 90), 0.1, dtype)
    kernel = _kernel(dtype)
    before = [x.copy() for x in (a.data, a.indices, a.indptr, b.data, b.indices, b.indptr)]
    _check(kernel(A=sm.SparseTensor.from_scipy(a), B=sm.SparseTensor.from_scipy(b)), a, b)
    for was, now in zip(before, (a.data, a.indices, a.indptr, b.data, b.indices, b.indptr)):
        np.testing.assert_array_equal(was, now)  # the operands are only read
    assert "linalg.generic" not in kernel.ir["input"] and "scf.parallel" in kernel.ir["input"]
    if openmp_library() is not None:  # threaded: both passes become OpenMP loops
        assert kernel.ir["mapped"].count("omp.wsloop") >= 3


# rows of C short for the width (listed and sorted: about 245 of 300 here) beside long ones (read back from the
# bitmap), and only long ones
# "mixed": rows read back from the bitmap and rows sorted; "bitmap": short, dense rows; "wide": 300,000 columns,
# rows of one entry of A sorted inline, rows of two or more by the library sort, none from the bitmap
ROWS = {"mixed": ((300, 200), 0.01, (200, 40000), 0.0003), "bitmap": ((300, 200), 0.3, (200, 700), 0.3),
        "wide": ((300, 200), 0.01, (200, 300000), 0.0001)}


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("threads", [1, 2])
def test_row_lengths_and_threads(rows, threads, rng):
    a_shape, a_density, b_shape, b_density = ROWS[rows]
    a, b = _random(rng, a_shape, a_density, "float32"), _random(rng, b_shape, b_density, "float32")
    kernel = _kernel("float32")
    with fixed(threads):
        got = kernel(A=a, B=b)
    _check(got, a, b)


@pytest.mark.parametrize("cols", [1100, 512, 64, 3])
def test_read_back_finds_columns_at_every_word_and_block_edge(cols, rng):
    """Rows read back from the bitmap (two or more columns: "wide" at these widths) skip empty words a block
    of ``BLOCK_WORDS`` at a time: columns on each side of a word's and a block's edge, the first and the last
    column, in one row and in rows of their own, must all come back, in order."""
    edges = sorted({c for c in (0, 1, 62, 63, 64, 65, 511, 512, 513, 1023, 1024, cols - 2, cols - 1)
                    if 0 <= c < cols})
    b = sp.lil_array((len(edges) + 1, cols))
    for r, c in enumerate(edges):
        b[r, c] = r + 1.0
        b[r, (c + 1) % cols] = 0.5  # a second column: every row of C has two or more
    b[len(edges), edges] = 2.0  # one row reaching all of them
    b = sp.csr_array(b)
    a = sp.csr_array(_random(rng, (30, b.shape[0]), 0.3, "float64"))
    assert BLOCK_WORDS * 64 == 512
    for threads in (1, 2):
        with fixed(threads):
            _check(_kernel()(A=a, B=b), a, b)


def _work(a: sp.csr_array, b: sp.csr_array) -> int:
    """The entries of ``b`` the product reads: the kernel's work, which decides stamps or bitmap."""
    return int(np.diff(b.indptr)[a.indices].sum())


# (A's shape and density, B's shape and density): stamped (B's columns at most the work and STAMP_COLUMNS), or the
# bitmap because B has more columns than the work, or more than STAMP_COLUMNS
STAMP_CASES = {"stamped": ((300, 200), 0.05, (200, 3000), 0.01),
               "bitmap: little work": ((300, 200), 0.005, (200, 9000), 0.0005),
               "bitmap: many columns": ((40, 400), 0.2, (400, STAMP_COLUMNS + 7), 0.0004)}


@pytest.mark.parametrize("case", STAMP_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_stamped_and_bitmap_passes_agree_with_scipy(case, threads, rng):
    """Both ways of telling a column's first product in a row (per-worker stamps, per-chunk bitmaps) give the
    structural product, with rows short for the width (listed, sorted) and long ones (read from the bitmap);
    the cases sit on the side of the rule they are named for."""
    a_shape, a_density, b_shape, b_density = STAMP_CASES[case]
    a, b = (sp.random_array(shape, density=d, format="lil", rng=rng) for shape, d in ((a_shape, a_density),
                                                                                    (b_shape, b_density)))
    b[0, :700] = 1.5  # a dense row of B: the rows of C that reach it are long for any width here
    a[:5, 0] = 2.0
    a, b = sp.csr_array(a), sp.csr_array(b)
    columns, work = b.shape[1], _work(a, b)
    assert (columns <= min(work, STAMP_COLUMNS)) == (case == "stamped")
    with fixed(threads):
        _check(_kernel()(A=a, B=b), a, b)
        _check(_kernel()(A=b.T.tocsr(), B=a.T.tocsr()), sp.csr_array(b.T), sp.csr_array(a.T))


@pytest.mark.parametrize("heavy", [[0], [199], [0, 1, 2], [399], list(range(0, 400, 37))])
def test_skewed_work_splits_into_chunks_that_cover_every_row_once(heavy, rng):
    """Rows go to chunks of equal work (prefix sums of each row's products): a few dense rows among sparse
    ones put whole chunks on one row and leave others empty; every row must still be computed exactly once."""
    a = random_sparse(rng, (400, 300), 0.01, "float64")
    a[heavy, :] = random_sparse(rng, (len(heavy), 300), 0.9, "float64")
    a = sp.csr_array(a)
    b = _random(rng, (300, 500), 0.05, "float64")
    with fixed(2):
        _check(_kernel()(A=a, B=b), a, b)


def test_empty_rows_columns_and_cancellation(rng):
    a = _random(rng, (40, 30), 0.2, "float64").tolil()
    a[5, :] = 0  # an empty row of A: an empty row of C
    a[:, 7] = 0  # a column of A no entry reaches
    a[0, :] = 0
    a[0, 0], a[0, 1] = 1.0, 1.0
    b = _random(rng, (30, 25), 0.2, "float64").tolil()
    b[3, :] = 0  # rows of B that A's entries reach but that hold nothing
    b[11, :] = 0
    b[0, :], b[1, :] = 0, 0
    b[0, 2], b[1, 2] = 2.0, -2.0  # C[0, 2] sums to zero: stored all the same
    a, b = sp.csr_array(a), sp.csr_array(b)
    got = _kernel()(A=a, B=b)
    _check(got, a, b)
    c = got.to_scipy()
    assert c.indptr[6] == c.indptr[5]
    assert list(c.indices[:c.indptr[1]]) == [2] and c.data[0] == 0.0


@pytest.mark.parametrize("a, b", [
    (sp.csr_array((6, 4)), sp.csr_array(np.ones((4, 5)))),  # A empty
    (sp.csr_array(np.eye(6, 4)), sp.csr_array((4, 5))),  # B empty
    (sp.csr_array(np.array([[1.0, 2.0, 0, 0]] * 3)),
     sp.csr_array(np.array([[0, 0, 0], [0, 0, 0], [3.0, 0, 1.0], [0, 4.0, 0]]))),  # disjoint: no pair meets
])
def test_empty_results(a, b):
    got = _kernel()(A=a, B=b)
    assert got.nnz == 0 and got.shape == (a.shape[0], b.shape[1])
    _check(got, a, b)


@pytest.mark.parametrize("widths", [((64, 64), (32, 32), (32, 32)), ((32, 32), (64, 64), (64, 32)),
                                    ((64, 32), (32, 64), (64, 64))])
def test_index_widths(widths, rng):
    (ap, ac), (bp, bc), (cp, cc) = widths
    a, b = _random(rng, (60, 45), 0.1, "int64"), _random(rng, (45, 80), 0.1, "int64")
    kernel = _kernel("int64", CSR.with_widths(ap, ac), CSR.with_widths(bp, bc), CSR.with_widths(cp, cc))
    assert spgemm_operands(kernel.spec, kernel.spec.formats) == ("A", "B")
    got = kernel(A=sm.SparseTensor.from_scipy(a, CSR.with_widths(ap, ac)),
                 B=sm.SparseTensor.from_scipy(b, CSR.with_widths(bp, bc)))
    assert got.format == CSR.with_widths(cp, cc)
    assert [buffer.dtype.itemsize * 8 for buffer in got.buffers[:2]] == [cp, cc]
    _check(got, a, b)


def test_factor_order_and_one_tensor_twice(rng):
    a, b = _random(rng, (30, 30), 0.15, "int32"), _random(rng, (30, 30), 0.15, "int32")
    swapped = _kernel("int32", expression="C[i,j] = B[k,j] * A[i,k]")
    _check(swapped(A=a, B=b), a, b)
    square = sm.compile("C[i,j] = A[i,k] * A[k,j]", formats={"A": "csr", "C": "csr"}, dtype="int32")
    assert spgemm_operands(square.spec, square.spec.formats) == ("A", "A")
    _check(square(A=a), a, a)


def _real_matrices() -> list[Path]:
    bundled = Path(sparse_mlir.data.__file__).parent
    found = [bundled / "west0479.mtx.gz", bundled / "karate.mtx.gz"]
    # the shared SuiteSparse files whose square fits a test (arrow's is dense: 46500^2)
    return found + [SUITESPARSE / f"{name}.mtx.gz" for name in ("bcsstk13", "cryg2500", "rajat01", "zenios")
                    if (SUITESPARSE / f"{name}.mtx.gz").is_file()]


@pytest.mark.parametrize("path", _real_matrices(), ids=lambda p: p.name)
def test_real_matrices_squared(path):
    a = sp.csr_array(read_matrix(path))
    a.sum_duplicates()
    a.sort_indices()
    if a.shape[0] != a.shape[1]:
        pytest.skip("not square")
    with fixed(2):
        _check(_kernel()(A=a, B=a), a, a)


def test_what_is_not_an_spgemm_is_left_to_the_sparsifier():
    def matched(expression: str, formats: dict) -> bool:
        spec = sm.compile(expression, formats=formats, dtype="float32").spec
        return spgemm_operands(spec, spec.formats) is not None

    assert matched(EXPRESSION, {"A": "csr", "B": "csr", "C": "csr"})
    assert not matched(EXPRESSION, {"A": "csr", "B": "csc", "C": "csr"})
    assert not matched(EXPRESSION, {"A": "csr", "B": "csr", "C": "coo"})
    assert not matched(EXPRESSION, {"A": "csr", "B": "csr"})  # a dense result
    assert not matched(EXPRESSION, {"A": "csr", "C": "csr"})  # a dense B
    assert not matched("C[i,j] = A[i,k] * B[k,j] * 2.0", {"A": "csr", "B": "csr", "C": "csr"})
    assert not matched("C[i,j] = A[i,k] * B[j,k]", {"A": "csr", "B": "csr", "C": "csr"})
    assert not matched("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "B": "csr", "C": "csr"})


def test_the_openmp_runtime_is_linked_for_it():
    spec = _kernel().spec
    assert threads_sparse_output(spec, spec.formats)


def test_bad_operands_are_named_errors():
    kernel = _kernel()
    with pytest.raises(ShapeError, match="index 'k'"):
        kernel(A=sp.csr_array(np.ones((5, 4))), B=sp.csr_array(np.ones((3, 6))))
    wild = sp.csr_array(np.ones((5, 4)))
    wild.indices[3] = 9  # a column past A's width: it would index B's positions out of bounds
    with pytest.raises(InvalidIndicesError):
        kernel(A=wild, B=sp.csr_array(np.ones((4, 6))))
    with pytest.raises(DTypeError):
        kernel(A=sp.csr_array(np.ones((5, 4))), B=sp.csr_array(np.ones((4, 6), dtype=np.float32)))



_HUGE_PAGE_PROBE = """
import sys
from pathlib import Path
import numpy as np, scipy.sparse as sp, sparse_mlir as sm
a = sp.random_array((1200, 1200), density=0.05, format="csr", rng=np.random.default_rng(0))
kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64")
got = kernel(A=sm.SparseTensor.from_scipy(a), B=sm.SparseTensor.from_scipy(a))
assert abs(got.to_scipy() - a @ a).max() < 1e-12
values = got.buffers[2]
address, inside = values.ctypes.data + values.nbytes // 2, False  # past the page the buffer starts in
for line in Path("/proc/self/smaps").read_text().splitlines():
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        low, high = (int(x, 16) for x in head.split("-"))
        inside = low <= address < high
    elif inside and head == "VmFlags:":
        print(values.nbytes, "hg" in line.split()[1:])
"""


def test_a_large_result_asks_for_huge_pages():
    """C's values and coordinates (here 11.5 and 5.8 MB) are fresh mmap memory on each call; without huge pages
    every 4 KiB of them faults on first touch (``loops.result_buffer``).  The probe runs in a process whose
    malloc maps every buffer from 1 MiB on its own (``MALLOC_MMAP_THRESHOLD_``), so the values' mapping carries
    the advice (``hg`` in its VmFlags) only if the kernel gave it."""
    if not Path("/proc/self/smaps").is_file():
        pytest.skip("no /proc/self/smaps: not Linux")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run([sys.executable, "-c", _HUGE_PAGE_PROBE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    nbytes, advised = done.stdout.split()
    assert int(nbytes) >= 8 << 20 and advised == "True"
