"""The C-level call path (``runtime/fast_call.c``): taken for the common case, bit-identical to the Python path,
and never the one to judge bad input (it declines, and the Python path raises the error that names it)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import prune_nm, random_sparse, random_values

import sparse_mlir as sm
from sparse_mlir.compiler import driver
from sparse_mlir.errors import (
    DTypeError,
    InvalidIndicesError,
    LoweringError,
    OperandError,
    ShapeError,
)
from sparse_mlir.runtime import cpu, fast_call

SPMV = "y[i] = A[i,k] * x[k]"
SPMM = "C[i,j] = A[i,k] * B[k,j]"
LINEAR = "Y[n,o] = X[n,i] * W[o,i] + b[o]"


def _plan(kernel):
    """The C-level call object of a kernel's most recent specialization."""
    return getattr(kernel, "_current", kernel)._last.planner.current


def _python_path(kernel, **operands):
    """The same call through the Python checks and ctypes alone."""
    single = getattr(kernel, "_current", kernel)
    return type(single).__call__.__wrapped__(single, None, **operands)


def _fresh_table(monkeypatch):
    """An empty table of loaded libraries, so the next call loads (and plans) its specialization anew."""
    monkeypatch.setattr(cpu, "_loaded", type(cpu._loaded)())


@pytest.fixture(autouse=True)
def _needs_the_extension():
    if fast_call.unavailable() is not None:
        pytest.fail(f"the C call path is not available on this machine: {fast_call.unavailable()}")


def test_second_call_runs_in_c_and_matches_the_python_path(rng):
    dense = random_sparse(rng, (64, 64), 0.1, "float64")
    a, x = sp.csr_array(dense), random_values(rng, 64, "float64")
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    first = kernel(A=a, x=x)  # the Python path, which builds the plan (shared by every kernel of that build)
    plan = _plan(kernel)
    assert plan is not None and plan.open
    calls = plan.calls
    second = kernel(A=a, x=x)
    assert plan.calls == calls + 1
    np.testing.assert_array_equal(second, first)
    np.testing.assert_array_equal(second, _python_path(kernel, A=a, x=x))
    np.testing.assert_allclose(second, dense @ x, rtol=1e-12)


@pytest.mark.parametrize("kind", [sp.csr_array, sp.csr_matrix])
@pytest.mark.parametrize("index", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_scipy_operands_of_every_layout_width_and_dtype(rng, kind, index, dtype):
    dense = random_sparse(rng, (37, 23), 0.2, dtype)
    matrix = kind(dense)
    matrix.indptr, matrix.indices = matrix.indptr.astype(index), matrix.indices.astype(index)
    assert matrix.has_canonical_format
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    x = random_values(rng, 23, dtype)
    kernel(A=matrix, x=x)
    plan = _plan(kernel)
    calls = plan.calls
    y = kernel(A=matrix, x=x)
    assert plan.calls == calls + 1, "declined a scipy operand it covers"
    np.testing.assert_array_equal(y, _python_path(kernel, A=matrix, x=x))


def test_every_size_through_one_plan(rng):
    kernel = sm.compile(SPMM, formats={"A": "csr"}, dtype="float64")
    kernel(A=sp.csr_array(np.eye(2)), B=np.ones((2, 2)))
    calls = _plan(kernel).calls
    for shape in [(1, 1, 1), (5, 3, 2), (64, 80, 17), (0, 4, 3), (7, 0, 5), (33, 9, 0)]:
        m, k, n = shape
        dense = random_sparse(rng, (m, k), 0.3, "float64")
        b = random_values(rng, (k, n), "float64")
        got = kernel(A=sp.csr_array(dense), B=b)  # a new size is no new build, and runs in C from its first call
        np.testing.assert_allclose(got, dense @ b, rtol=1e-12, atol=1e-12)
    assert _plan(kernel).calls == calls + 6 and kernel.stats["specializations"] == 1


def test_sparse_tensor_operands_and_nm_and_bias(rng):
    weights = prune_nm(random_values(rng, (24, 32), "float32"), 2, 4)
    tensor = sm.SparseTensor.from_dense(weights, sm.NM(2, 4))
    kernel = sm.compile(LINEAR, formats={"W": sm.NM(2, 4)}, dtype="float32")
    x, b = random_values(rng, (10, 32), "float32"), random_values(rng, 24, "float32")
    kernel(X=x, W=tensor, b=b)
    plan = _plan(kernel)
    calls = plan.calls
    y = kernel(X=x, W=tensor, b=b)
    assert plan.calls == calls + 1
    np.testing.assert_array_equal(y, _python_path(kernel, X=x, W=tensor, b=b))
    np.testing.assert_allclose(y, x @ weights.T + b, rtol=1e-5, atol=1e-5)


def test_out_is_written_in_place_and_returned(rng):
    dense = random_sparse(rng, (9, 8), 0.4, "float64")
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float64")
    a, x = sp.csr_array(dense), random_values(rng, 8, "float64")
    kernel(A=a, x=x)
    calls = _plan(kernel).calls
    out = np.full(9, np.nan)
    assert kernel(A=a, x=x, out=out) is out
    assert _plan(kernel).calls == calls + 1
    np.testing.assert_allclose(out, dense @ x, rtol=1e-12)


# every refusal below comes from the Python path, after the C path declined with nothing done
def _warm(rng):
    dense = random_sparse(rng, (6, 5), 0.5, "float64")
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float64")
    a, x = sp.csr_array(dense), random_values(rng, 5, "float64")
    kernel(A=a, x=x)
    return kernel, a, x, dense


class _NoCallsIn:
    """Asserts that a block ran no call through the kernel's C path."""

    def __init__(self, kernel):
        self.plan = _plan(kernel)

    def __enter__(self):
        self.calls = self.plan.calls

    def __exit__(self, *_exc):
        assert self.plan.calls == self.calls


def test_wrong_dtype_shape_and_names_are_refused_by_name(rng):
    kernel, a, x, _ = _warm(rng)
    with _NoCallsIn(kernel), pytest.raises(DTypeError, match="x"):
        kernel(A=a, x=x.astype(np.float32))
    with pytest.raises(ShapeError, match="index 'k'"):
        kernel(A=a, x=np.ones(6))
    with pytest.raises(OperandError, match="missing x"):
        kernel(A=a)
    with pytest.raises(OperandError, match="unknown z"):
        kernel(A=a, x=x, z=x)
    with pytest.raises(OperandError, match="keyword"):
        kernel(a, x)


def test_bad_out_is_refused_by_name(rng):
    kernel, a, x, _ = _warm(rng)
    with _NoCallsIn(kernel), pytest.raises(DTypeError, match="out="):
        kernel(A=a, x=x, out=np.empty(6, np.float32))
    with pytest.raises(ShapeError, match="out="):
        kernel(A=a, x=x, out=np.empty(7))
    with pytest.raises(OperandError, match="C-contiguous"):
        kernel(A=a, x=x, out=np.empty(12)[::2])
    readonly = np.empty(6)
    readonly.flags.writeable = False
    with pytest.raises(OperandError, match="writeable"):
        kernel(A=a, x=x, out=readonly)
    both = np.zeros(11)
    with _NoCallsIn(kernel), pytest.raises(OperandError, match="overlaps operand x"):
        kernel(A=a, x=both[:5], out=both[3:9])


def test_indices_broken_in_place_after_a_fast_call_are_caught(rng):
    """An attacker's matrix: canonical when scipy cached its flag, then an index pushed out of bounds (or made
    negative) in place.  The C path checks every index on every call, so the kernel never reads outside x."""
    kernel, a, x, dense = _warm(rng)
    calls = _plan(kernel).calls
    kernel(A=a, x=x)
    assert a.has_canonical_format and _plan(kernel).calls == calls + 1
    saved = a.indices.copy()
    for bad in (5, 1 << 30, -1):
        a.indices[0] = bad
        with _NoCallsIn(kernel), pytest.raises(InvalidIndicesError):
            kernel(A=a, x=x)
    a.indices[:] = saved
    np.testing.assert_allclose(kernel(A=a, x=x), dense @ x, rtol=1e-12)


def test_indptr_broken_in_place_is_caught(rng):
    kernel, a, x, _ = _warm(rng)
    a.indptr[2] = a.indptr[-1] + 50  # a spike: rows would run past the end of indices
    with pytest.raises(InvalidIndicesError):
        kernel(A=a, x=x)


class _Subclass(np.ndarray):
    """An ndarray subclass: its ``__array_finalize__`` or buffer could differ, so only the Python path takes it."""


def test_non_canonical_scipy_and_unusual_arrays_go_the_python_way(rng):
    kernel, a, x, dense = _warm(rng)
    order = np.concatenate([np.arange(a.indptr[r], a.indptr[r + 1])[::-1] for r in range(a.shape[0])])
    unsorted = sp.csr_array((a.data[order], a.indices[order], a.indptr.copy()), shape=a.shape)
    assert not unsorted.has_canonical_format
    np.testing.assert_allclose(kernel(A=unsorted, x=x), dense @ x, rtol=1e-12)  # summed from a sorted copy
    strided = np.repeat(x, 2)[::2]  # not contiguous: the Python path copies it
    np.testing.assert_allclose(kernel(A=a, x=strided), dense @ x, rtol=1e-12)
    readonly = x.copy()
    readonly.flags.writeable = False
    np.testing.assert_allclose(kernel(A=a, x=readonly), dense @ x, rtol=1e-12)
    np.testing.assert_allclose(kernel(A=a, x=x.view(_Subclass)), dense @ x, rtol=1e-12)  # not exactly ndarray
    with pytest.raises(DTypeError):  # another byte order: another dtype object, and no implicit conversion
        kernel(A=a, x=x.astype(">f8"))


def test_torch_operands_still_come_back_as_torch(rng):
    torch = pytest.importorskip("torch")
    kernel, a, x, dense = _warm(rng)
    y = kernel(A=a, x=torch.from_numpy(x))
    assert isinstance(y, torch.Tensor)
    np.testing.assert_allclose(y.numpy(), dense @ x, rtol=1e-12)


def test_calls_from_many_threads_at_once(rng):
    dense = random_sparse(rng, (300, 200), 0.1, "float64")
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float64")
    a = sp.csr_array(dense)
    kernel(A=a, x=np.ones(200))
    calls = _plan(kernel).calls
    failures = []

    def work(seed: int) -> None:
        x = np.random.default_rng(seed).random(200)
        for _ in range(200):
            if not np.allclose(kernel(A=a, x=x), dense @ x, rtol=1e-12):
                failures.append(seed)

    workers = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures and _plan(kernel).calls == calls + 800


def test_eviction_closes_the_plan_and_the_kernel_reloads(rng, monkeypatch):
    monkeypatch.setenv("SPARSE_MLIR_MAX_LOADED_KERNELS", "1")
    first = sm.compile(SPMV, formats={"A": "csr"}, dtype="float64")
    second = sm.compile(SPMV, formats={"A": "csc"}, dtype="float64")
    dense = random_sparse(rng, (8, 8), 0.4, "float64")
    x = random_values(rng, 8, "float64")
    for _ in range(3):
        for kernel, matrix in ((first, sp.csr_array(dense)), (second, sp.csc_array(dense))):
            kernel(A=matrix, x=x)
            np.testing.assert_allclose(kernel(A=matrix, x=x), dense @ x, rtol=1e-12)
    assert len(cpu._loaded) == 1
    closed = [k._last.planner.current for k in (first, second) if k._last.key not in cpu._loaded]
    assert closed and not closed[0].open


def test_a_kernel_just_loaded_is_never_the_one_evicted(rng, monkeypatch):
    """With every loaded kernel called through C since eviction last looked, the table went round once, the new
    one reached the front and was unloaded before its first call (found in the full suite: a shape-generic
    kernel counted two specializations)."""
    _fresh_table(monkeypatch)
    monkeypatch.setenv("SPARSE_MLIR_MAX_LOADED_KERNELS", "2")
    dtypes = ("float64", "float32", "int64")
    kernels = [sm.compile(SPMV, formats={"A": "csr"}, dtype=dtype) for dtype in dtypes]
    operands = [(sp.csr_array(random_sparse(rng, (8, 8), 0.4, dtype)), random_values(rng, 8, dtype))
                for dtype in dtypes]
    for kernel, (matrix, x) in zip(kernels[:2], operands[:2]):
        for _ in range(3):  # the later calls go through C
            kernel(A=matrix, x=x)
        assert _plan(kernel).calls > 0  # used since eviction last looked
    matrix, x = operands[2]
    loads = kernels[2].stats["specializations"]  # compile() hands out one Kernel per process: earlier tests count
    kernels[2](A=matrix, x=x)
    assert kernels[2]._last.key in cpu._loaded and len(cpu._loaded) == 2
    np.testing.assert_array_equal(kernels[2](A=matrix, x=x), matrix @ x)
    assert kernels[2].stats["specializations"] == loads + 1  # loaded once, not again for its second call


def test_turned_off_by_the_knob(rng, monkeypatch):
    monkeypatch.setenv("SPARSE_MLIR_FAST_CALL", "0")
    assert "SPARSE_MLIR_FAST_CALL=0" in fast_call.unavailable()
    _runs_without_a_plan(rng, monkeypatch)


def test_a_machine_that_cannot_build_it_runs_the_python_path(rng, monkeypatch):
    def no_compiler(*_args):
        raise LoweringError("no C compiler/linker found", stage="link", target="cpu")

    monkeypatch.setattr(fast_call, "_tried", False)
    monkeypatch.setattr(fast_call, "_module", None)
    monkeypatch.setattr(fast_call, "_why_not", None)
    monkeypatch.setattr(driver, "python_extension", no_compiler)
    assert "no C compiler" in fast_call.unavailable()
    _runs_without_a_plan(rng, monkeypatch)


def _runs_without_a_plan(rng, monkeypatch) -> None:
    """A specialization loaded now gets no C-level call, and its calls are right through the Python path."""
    _fresh_table(monkeypatch)
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float64")
    dense = random_sparse(rng, (5, 4), 0.5, "float64")
    x = random_values(rng, 4, "float64")
    for _ in range(2):
        np.testing.assert_allclose(kernel(A=sp.csr_array(dense), x=x), dense @ x, rtol=1e-12)
    assert _plan(kernel) is None


def test_the_extension_is_built_once_and_checksummed():
    first = driver.python_extension(fast_call.SOURCE, fast_call.MODULE)
    assert driver.python_extension(fast_call.SOURCE, fast_call.MODULE) == first
    assert first.is_file() and first.with_suffix(".json").is_file()


def test_a_malformed_plan_is_refused_without_a_crash():
    module = fast_call._extension()
    good = (1, None, None, np.empty, np.ndarray, sm.SparseTensor, (), (), (np.dtype("float64"), ()))
    with pytest.raises(ValueError):
        module.FastCall(0, *good[1:])
    with pytest.raises(TypeError):
        module.FastCall(*good[:6], "operands", (), good[8])
    bad_rank = (("x", 0, np.dtype("float64"), 9, None, 0, (), (), None, 0),)
    with pytest.raises(ValueError):
        module.FastCall(*good[:6], bad_rank, (), good[8])
    bad_place = (("x", 0, np.dtype("float64"), 1, None, 0, (), (), None, 0),)
    with pytest.raises(ValueError):
        module.FastCall(*good[:6], bad_place, (((0, 3),),), good[8])
    plan = module.FastCall(*good)  # a plan of no operands; declines what it was not built for
    assert plan.call({"x": 1}, None) is NotImplemented
    with pytest.raises(TypeError):
        plan.call([], None)


def test_auto_schedule_is_never_bypassed(rng, monkeypatch):
    """``schedule="auto"`` decides per operand structure what runs (dense BLAS, one thread, a BSR copy...): the
    C-level call of the variant it timed last must not take over its later calls (only the very ``SparseTensor``
    objects a sparse variant was chosen for go straight to it: ``test_schedule``)."""
    kernel = sm.compile(SPMM, formats={"A": "csr"}, dtype="float64", schedule="auto")
    dense = random_sparse(rng, (32, 32), 0.5, "float64")
    b = random_values(rng, (32, 8), "float64")
    for _ in range(3):
        np.testing.assert_allclose(kernel(A=sp.csr_array(dense), B=b), dense @ b, rtol=1e-12)
    assert kernel._native_fast is None
    runs = []
    monkeypatch.setattr(type(kernel), "_run", lambda self, choice, args, out: runs.append(choice) or "ran")
    assert kernel(A=sp.csr_array(dense), B=b) == "ran" and runs == [kernel.schedule["choice"]]


def test_a_loaded_shape_generic_export_calls_in_c(rng, tmp_path):
    kernel = sm.compile(SPMM, formats={"A": "csr"}, dtype="float64")
    sm.export(kernel, tmp_path, "spmm_any")
    loaded = sm.load_kernel(tmp_path / "spmm_any.json")
    assert loaded.shape_generic
    for m, k, n in [(5, 7, 3), (40, 33, 9)]:
        dense = random_sparse(rng, (m, k), 0.3, "float64")
        b = random_values(rng, (k, n), "float64")
        for a in (sp.csr_array(dense), sm.SparseTensor.from_dense(dense, "csr")):
            loaded(A=a, B=b)
            plan = loaded._planner.current
            calls = plan.calls
            np.testing.assert_allclose(loaded(A=a, B=b), dense @ b, rtol=1e-12)
            assert plan.calls == calls + 1
    with pytest.raises(ShapeError):
        loaded(A=sp.csr_array(np.eye(3)), B=np.ones((4, 2)))


def test_scipy_flags_read_as_scipy_reads_them(rng):
    """The C path reads a matrix's cached flags from its instance dictionary the way scipy's
    ``has_canonical_format`` property does: not yet cached, the property computes it (and the call runs in C);
    ``has_sorted_indices`` set false, the matrix is not canonical (the Python path sorts a copy)."""
    kernel, a, x, dense = _warm(rng)
    fresh = sp.csr_array((a.data.copy(), a.indices.copy(), a.indptr.copy()), shape=a.shape)
    assert "_has_canonical_format" not in vars(fresh)
    calls = _plan(kernel).calls
    np.testing.assert_allclose(kernel(A=fresh, x=x), dense @ x, rtol=1e-12)
    assert _plan(kernel).calls == calls + 1 and vars(fresh)["_has_canonical_format"] is True
    fresh.has_sorted_indices = False  # a lie in the safe direction: scipy and we then treat it as unsorted
    with _NoCallsIn(kernel):
        np.testing.assert_allclose(kernel(A=fresh, x=x), dense @ x, rtol=1e-12)


SPGEMM = "C[i,j] = A[i,k] * B[k,j]"
SPARSE_ADD = "C[i,j] = A[i,j] + B[i,j]"


@pytest.mark.parametrize("expression", [SPGEMM, SPARSE_ADD])
def test_sparse_results_come_back_through_c(rng, expression):
    """A sparse result's buffers, malloc-ed by the entry point, are adopted as they are: same structure and values
    as the Python path, read-only, owned by the result (they outlive the operands and the kernel's next calls)."""
    a = sp.csr_array(random_sparse(rng, (70, 70), 0.08, "float64"))
    b = sp.csr_array(random_sparse(rng, (70, 70), 0.08, "float64"))
    kernel = sm.compile(expression, formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64")
    first = kernel(A=a, B=b)
    plan = _plan(kernel)
    assert plan is not None
    calls = plan.calls
    results = [kernel(A=a, B=b) for _ in range(3)]
    assert plan.calls == calls + 3
    expected = (a @ b if expression == SPGEMM else a + b).toarray()
    reference = _python_path(kernel, A=a, B=b)
    del a, b
    for got in [first, *results]:
        assert isinstance(got, sm.SparseTensor) and got.format == sm.CSR and got.shape == (70, 70)
        for mine, theirs in zip(got.buffers, reference.buffers):
            np.testing.assert_array_equal(mine, theirs)
            assert mine.dtype == theirs.dtype and not mine.flags.writeable
        np.testing.assert_allclose(got.to_dense(), expected, rtol=1e-12)
    assert len({got.buffers[-1].ctypes.data for got in results}) == 3  # each call its own buffers


def test_a_sparse_result_too_large_for_its_widths_is_named_by_the_python_path(rng):
    """The entry point refuses (RESULT_OVERFLOW) and frees what it built; the C path declines, and the Python
    path raises the FormatError that names the widths."""
    kernel = sm.compile(SPGEMM, formats={"A": "csr", "B": "csr", "C": sm.CSR.with_widths(16, 16)}, dtype="float64")
    small = sp.csr_array(random_sparse(rng, (50, 50), 0.05, "float64"))
    kernel(A=small, B=small)
    kernel(A=small, B=small)
    plan = _plan(kernel)
    assert plan is not None
    dense = sp.csr_array(np.ones((200, 200)))
    with _NoCallsIn(kernel), pytest.raises(sm.errors.FormatError, match="16/16 bits"):
        kernel(A=dense, B=dense)
    np.testing.assert_allclose(kernel(A=small, B=small).to_dense(), (small @ small).toarray(), rtol=1e-12)


def test_out_with_a_sparse_result_is_refused_by_name(rng):
    a = sp.csr_array(random_sparse(rng, (20, 20), 0.1, "float64"))
    kernel = sm.compile(SPGEMM, formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64")
    kernel(A=a, B=a)
    kernel(A=a, B=a)
    with _NoCallsIn(kernel), pytest.raises(OperandError, match="out= is only for dense results"):
        kernel(A=a, B=a, out=np.zeros((20, 20)))


def test_a_malformed_sparse_result_plan_is_refused_without_a_crash():
    module = fast_call._extension()
    base = (1, None, None, np.empty, np.ndarray, sm.SparseTensor, (), ())
    for out, error in [((np.dtype("float64"), (), 0, print), ValueError),  # no buffers
                       ((np.dtype("float64"), (), module.MAX_RESULT_BUFFERS + 1, print), ValueError),
                       ((np.dtype("float64"), (), 3, "not callable"), TypeError),
                       ((np.dtype("float64"), (), 3), ValueError)]:
        with pytest.raises(error):
            module.FastCall(*base, out)


def test_a_plan_closed_while_its_call_runs_python_code_does_not_crash(rng, monkeypatch):
    """The C call read the kernel's address and library after running Python code (``numpy.empty``, the thread
    choice), where another thread (or a finalizer) may close the plan, which clears both: under eviction by two
    threads that was a call through NULL.  Here the result's allocation closes the plan itself."""
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float64")
    a, x = sp.csr_array(random_sparse(rng, (40, 30), 0.2, "float64")), random_values(rng, 30, "float64")
    empty = np.empty

    def closing_empty(*args, **kwargs):
        plan = getattr(getattr(kernel, "_last", None), "planner", None)
        if plan is not None and plan.current is not None:
            plan.current.close()
        return empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", closing_empty)  # captured by the plan the first call builds
    kernel(A=a, x=x)
    for _ in range(3):
        np.testing.assert_allclose(kernel(A=a, x=x), a @ x, rtol=1e-12)
