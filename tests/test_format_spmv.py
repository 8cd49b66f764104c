"""The threaded CPU SpMV and row sums for COO, DCSR and CSC operands, and CSR read transposed
(``dialects/native/format_spmv.py``), against scipy.

What every result must be: ``A @ x`` (``A.T @ x`` for the transposed forms,
the row sums without ``x``) exactly, for values that are small integers,
whatever the dtype, index widths, thread count, row lengths (empty rows, one
long row, every entry in one row) and size, from one shape-generic build.
The COO kernel's sums do not depend on the thread count; a scipy COO whose
canonical flag lies (rows shuffled in place) still gives the sum.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import DTYPES

import sparse_mlir as sm
from sparse_mlir.compiler.emitters import shape_generic_emitter
from sparse_mlir.dsl.plan import plan
from sparse_mlir.formats import COO, CSC, DCSR
from sparse_mlir.runtime.threads import fixed, openmp_library

SPMV, TRANSPOSED, ROW_SUM = "y[i] = A[i,j] * x[j]", "y[j] = A[i,j] * x[i]", "y[i] = A[i,j]"
# (expression, format of A): every form the emitter builds
FORMS = [(SPMV, "coo"), (SPMV, "dcsr"), (SPMV, "csc"), (TRANSPOSED, "csc"), (TRANSPOSED, "csr"),
         (ROW_SUM, "coo"), (ROW_SUM, "dcsr"), (ROW_SUM, "csc")]
IDS = [f"{expression} {fmt}" for expression, fmt in FORMS]


def _matrix(rng: np.random.Generator, shape: tuple[int, int], density: float, dtype: str) -> sp.csr_array:
    """Small nonzero integers (exact in every dtype), with an empty row and an empty column when there is room."""
    a = sp.random_array(shape, density=density, format="csr", rng=rng)
    a.data = rng.integers(1, 5, size=a.nnz) * rng.choice([-1, 1], size=a.nnz)
    a = a.astype(dtype)
    if shape[0] > 2 and shape[1] > 2:
        a = sp.csr_array(a.toarray() * (np.arange(shape[0]) != shape[0] // 2)[:, None]
                         * (np.arange(shape[1]) != 1)[None, :])
    return a


def _expected(a: sp.csr_array, expression: str, x: np.ndarray | None) -> np.ndarray:
    if expression == ROW_SUM:
        return np.asarray(a.sum(axis=1)).ravel().astype(a.dtype)
    return (a.T if expression == TRANSPOSED else a) @ x


def _operands(rng, a: sp.csr_array, expression: str, fmt: str) -> dict:
    args = {"A": sm.SparseTensor.from_scipy(a, fmt)}
    if expression != ROW_SUM:
        length = a.shape[0] if expression == TRANSPOSED else a.shape[1]
        args["x"] = rng.integers(-3, 4, size=length).astype(a.dtype)
    return args


@pytest.mark.parametrize("expression, fmt", FORMS, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_form_and_dtype_equals_scipy_at_every_size_from_one_build(rng, expression, fmt, dtype):
    kernel = sm.compile(expression, formats={"A": fmt}, dtype=dtype)
    shapes = [(1, 1), (7, 5), (300, 200), (3, 9000), (9000, 3), (2000, 3000), (40, 60)]
    for shape in shapes:
        a = _matrix(rng, shape, 0.0 if shape == (40, 60) else min(1.0, 6000 / (shape[0] * shape[1])), dtype)
        args = _operands(rng, a, expression, fmt)
        got = kernel(**args)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, _expected(a, expression, args.get("x")))
    assert kernel.shape_generic and kernel.stats["specializations"] == 1  # one build took every size


@pytest.mark.parametrize("expression, fmt", FORMS, ids=IDS)
def test_the_emitter_builds_every_form_threaded(expression, fmt):
    spec = plan(expression, {"A": fmt}, "float64", None)
    assert shape_generic_emitter(spec, spec.formats) == "format_spmv"
    kernel = sm.compile(expression, formats={"A": fmt}, dtype="float64")
    a = _matrix(np.random.default_rng(0), (50, 40), 0.1, "float64")
    kernel(**_operands(np.random.default_rng(1), a, expression, fmt))
    assert "linalg.generic" not in kernel.ir["input"]
    if openmp_library() is not None:
        assert "omp.wsloop" in kernel.ir["mapped"]


@pytest.mark.parametrize("widths", [(32, 32), (64, 64), (16, 8), (64, 16)])
@pytest.mark.parametrize("preset", [COO, DCSR, CSC], ids=["coo", "dcsr", "csc"])
def test_index_widths(rng, preset, widths):
    fmt = preset.with_widths(*widths)
    a = _matrix(rng, (200, 120), 0.05, "float64")
    kernel = sm.compile(SPMV, formats={"A": fmt}, dtype="float64")
    x = rng.integers(-3, 4, size=120).astype(np.float64)
    np.testing.assert_array_equal(kernel(A=sm.SparseTensor.from_scipy(a, fmt), x=x), a @ x)


@pytest.mark.parametrize("expression, fmt", [(SPMV, "coo"), (SPMV, "csc"), (TRANSPOSED, "csr"), (SPMV, "dcsr")])
def test_sums_are_the_same_on_one_and_two_threads_and_on_every_run(expression, fmt):
    """Random float values: a kernel whose sums depended on scheduling would differ from run to run.  COO
    chunks by entry count alone, so it is also bit-identical across thread counts; the scatter kernels give
    each thread a private vector, summed in a fixed order, so they are bit-identical run to run."""
    rng = np.random.default_rng(3)
    a = sp.random_array((30000, 20000), density=8 / 20000, format="csr", rng=rng)
    a.data = rng.standard_normal(a.nnz)
    x = rng.standard_normal(30000 if expression == TRANSPOSED else 20000)
    kernel = sm.compile(expression, formats={"A": fmt}, dtype="float64")
    tensor = sm.SparseTensor.from_scipy(a, fmt)
    with fixed(2):
        threaded = [kernel(A=tensor, x=x) for _ in range(4)]
    with fixed(1):
        serial = kernel(A=tensor, x=x)
    np.testing.assert_allclose(serial, (a.T if expression == TRANSPOSED else a) @ x, rtol=1e-12, atol=1e-12)
    for result in threaded:
        np.testing.assert_array_equal(result, threaded[0])
    if fmt in ("coo", "dcsr"):
        np.testing.assert_array_equal(threaded[0], serial)


@pytest.mark.parametrize("shape", [(5, 4), (200, 300), (40000, 50)])
def test_a_scipy_coo_whose_canonical_flag_lies_still_gives_the_sum(shape):
    """Rows shuffled in place after scipy cached ``has_canonical_format``: every chunk sees a row lower than
    the one before it, and the kernel sums again serially instead of racing or losing entries."""
    rng = np.random.default_rng(4)
    a = sp.coo_array(_matrix(rng, shape, min(1.0, 20000 / (shape[0] * shape[1])), "float64"))
    a.sum_duplicates()
    assert a.has_canonical_format
    order = rng.permutation(a.nnz)
    a.row[:], a.col[:], a.data[:] = a.row[order], a.col[order], a.data[order]
    assert a.has_canonical_format  # the flag now lies
    x = rng.integers(-3, 4, size=shape[1]).astype(np.float64)
    kernel = sm.compile(SPMV, formats={"A": "coo"}, dtype="float64")
    want = sp.csr_array((a.data, (a.row, a.col)), shape=shape) @ x
    for threads in (1, 2):
        with fixed(threads):
            np.testing.assert_array_equal(kernel(A=a, x=x), want)


def test_skewed_rows_one_long_row_and_every_entry_in_one_row(rng):
    dense = np.zeros((3000, 4000))
    dense[7] = rng.integers(1, 4, size=4000)  # one row holds most entries: COO chunks split it
    dense[rng.integers(0, 3000, 500), rng.integers(0, 4000, 500)] = 2.0
    for a in (sp.csr_array(dense), sp.csr_array(dense[7:8])):
        x = rng.integers(-3, 4, size=a.shape[1]).astype(np.float64)
        for fmt in ("coo", "dcsr", "csc"):
            kernel = sm.compile(SPMV, formats={"A": fmt}, dtype="float64")
            with fixed(2):
                np.testing.assert_array_equal(kernel(A=sm.SparseTensor.from_scipy(a, fmt), x=x), a @ x)


def test_scipy_operands_and_out(rng):
    a = _matrix(rng, (500, 400), 0.02, "float64")
    x = rng.integers(-3, 4, size=400).astype(np.float64)
    for fmt, operand in (("coo", sp.coo_array(a)), ("csc", sp.csc_array(a)), ("csc", sp.csc_matrix(a))):
        kernel = sm.compile(SPMV, formats={"A": fmt}, dtype="float64")
        out = np.full(500, 7.0)
        result = kernel(A=operand, x=x, out=out)
        assert result is out
        np.testing.assert_array_equal(out, a @ x)  # the stale 7s are gone: the entry point zeroes y


def _scaled(expression: str, factor: str) -> str:
    """``expression`` with its right side multiplied by the literal ``factor`` on the left."""
    left, right = expression.split(" = ")
    return f"{left} = {factor} * {right}"


@pytest.mark.parametrize("expression, fmt", [*FORMS, (SPMV, "csr")], ids=[*IDS, f"{SPMV} csr"])
@pytest.mark.parametrize("dtype, factor, value", [("float64", "2.5", 2.5), ("int32", "-3", -3),
                                                  ("float32", "-(2 * 0.5)", -1.0)])
def test_literal_factors_scale_the_finished_sums_in_the_hand_scheduled_kernels(rng, expression, fmt, dtype,
                                                                               factor, value):
    """``2.5 * A[i,j] * x[j]``: the same emitters (CSR's own SpMV, the format kernels), each sum times the
    literals' product, exactly for small integers; the shape-generic table agrees with the build."""
    scaled = _scaled(expression, factor)
    spec = plan(scaled, {"A": fmt}, dtype, None)
    assert shape_generic_emitter(spec, spec.formats) == ("spmv" if fmt == "csr" and expression == SPMV
                                                         else "format_spmv")
    kernel = sm.compile(scaled, formats={"A": fmt}, dtype=dtype)
    for shape in ((300, 200), (1, 1), (2000, 3000)):
        a = _matrix(rng, shape, min(1.0, 6000 / (shape[0] * shape[1])), dtype)
        args = _operands(rng, a, expression, fmt)
        want = (_expected(a, expression, args.get("x")).astype(np.float64) * value).astype(dtype)
        np.testing.assert_array_equal(kernel(**args), want)
    assert "linalg.generic" not in kernel.ir["input"] and kernel.stats["specializations"] == 1

