"""schedule="auto": variants timed on the caller's matrix, sparse at 99%, dense BLAS at 10%."""

from __future__ import annotations

import numpy as np
import pytest

import sparse_mlir as sm
from sparse_mlir.runtime.schedule import einsum_plan
from support.kernels import SPARSIFIED_SPMV


@pytest.fixture(scope="module")
def auto():
    return sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32", schedule="auto")


def operands(sparsity: float):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((512, 512)) * (rng.random((512, 512)) >= sparsity)).astype(np.float32)
    return a, sm.SparseTensor.from_dense(a, "csr"), rng.standard_normal((512, 256)).astype(np.float32)


def test_sparse_chosen_when_sparse_and_the_fastest_when_not(auto):
    """At 99% the sparse kernel does a hundredth of the work: it wins everywhere.  At 10% the winner is the
    host's: dense BLAS on most machines, but on a 2-vCPU VM whose OpenBLAS ran 7x slower on two threads than
    on one, the sparse kernel (2 ms against 8 ms).  What auto promises is the fastest variant it timed, dense
    BLAS unless a sparse one takes under ``SPARSE_MARGIN`` of its time."""
    from sparse_mlir.runtime.schedule import SPARSE_MARGIN

    for sparsity in (0.99, 0.10):
        a, A, B = operands(sparsity)
        np.testing.assert_allclose(auto(A=A, B=B), a @ B, rtol=1e-4, atol=1e-3)
        seconds = auto.schedule["seconds"]
        assert set(seconds) >= {"sparse", "dense"}
        fastest = min(seconds, key=seconds.__getitem__)
        expected = fastest if seconds[fastest] <= SPARSE_MARGIN * seconds["dense"] else "dense"
        assert auto.schedule["choice"] == expected, auto.schedule
        if sparsity == 0.99:
            assert auto.schedule["choice"].startswith("sparse"), auto.schedule


def test_decision_is_cached_per_tensor(auto):
    a, A, B = operands(0.99)
    auto(A=A, B=B)
    first = auto.schedule
    out = np.empty((512, 256), np.float32)
    assert auto(A=A, B=B, out=out) is out and auto.schedule is first


def test_einsum_plan_only_for_sums_of_products():
    from sparse_mlir.dsl import plan

    assert einsum_plan(plan("C[i,j] = A[i,k] * B[k,j] * 2", {"A": "csr"}))[0] == "ac,cb->ab"
    assert einsum_plan(plan("C[i,j] = relu(A[i,k] * B[k,j])", {"A": "csr"})) is None
    assert einsum_plan(plan("C[i,j] = A[i,j] + B[i,j]", {"A": "csr", "B": "csr", "C": "csr"})) is None
    with pytest.raises(sm.errors.OptionError):
        sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}, schedule="fast")


def test_matmul_form_recognizes_matrix_products():
    from sparse_mlir.runtime.schedule import matmul_form

    assert matmul_form("ac,cb->ab") == (False, False, False)
    assert matmul_form("ca,cb->ab") == (True, False, False)
    assert matmul_form("ac,bc->ab") == (False, True, False)
    assert matmul_form("ac,cb->ba") == (False, False, True)
    assert matmul_form("ab,b->a") == (False, False, False)
    assert matmul_form("ab,a->b") == (True, False, False)
    for other in ("abc,cd->abd", "ab,ab->", "ab,bc->abc", "ab,bc,cd->ad", "ab,b->ab"):
        assert matmul_form(other) is None, other


@pytest.mark.parametrize(("expr", "reference"), [
    ("C[i,j] = A[i,k] * B[k,j] * 2", lambda a, b: 2 * (a @ b)),
    ("C[i,j] = A[k,i] * B[k,j]", lambda a, b: a.T @ b),
    ("C[i,j] = B[k,j] * A[i,k]", lambda a, b: a @ b),  # (B.T @ A.T).T: computed as A @ B
    ("y[i] = B[j] * A[i,j]", lambda a, b: a @ b[:, 0]),  # vector first: einsum
    ("y[i] = A[i,j] * B[j]", lambda a, b: a @ b[:, 0]),
    ("y[j] = A[i,j] * B[i]", lambda a, b: a.T @ b[:, 0]),
])
def test_dense_fallback_computes_each_product_form(expr, reference):
    """The fallback runs BLAS (``np.matmul``) on transposed views, into ``out`` when given, checked like a kernel's."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 64)).astype(np.float32) * (rng.random((64, 64)) < 0.9)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    kernel = sm.compile(expr, formats={"A": "csr"}, dtype="float32", schedule="auto")
    dense_b = b if "B[k,j]" in expr else b[:, 0].copy()
    args = {"A": sm.SparseTensor.from_dense(a, "csr"), "B": dense_b}
    want = reference(a, b)
    np.testing.assert_allclose(kernel._dense(args, None), want, rtol=1e-4, atol=1e-4)
    out = np.full(want.shape, np.nan, np.float32)
    assert kernel._dense(args, out) is out
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(sm.errors.ShapeError):
        kernel._dense(args, np.empty((3, 3) if want.ndim == 2 else 3, np.float32))


def _blocky_problem(seed: int, grid: int, cols: int):
    """``(rng, a, B, kernel)``: a CSR matrix whose nonzeros fill 4x4 blocks (a ``grid`` x ``grid`` of them, 10%),
    a dense ``B`` of ``cols`` columns and the auto kernel of ``A @ B + bias``."""
    rng = np.random.default_rng(seed)
    blocks = np.kron(rng.random((grid, grid)) < 0.1, np.ones((4, 4)))
    a = (blocks * rng.standard_normal((4 * grid, 4 * grid))).astype(np.float32)
    B = rng.standard_normal((4 * grid, cols)).astype(np.float32)
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j] + bias[j]", formats={"A": "csr"}, dtype="float32",
                        schedule="auto")
    return rng, a, B, kernel


def test_blocky_csr_gets_a_bsr_candidate_and_scattered_csr_does_not():
    """Auto may convert a CSR SpMM operand to BSR (dense register blocks) when its nonzeros fill whole blocks."""
    rng, a, B, kernel = _blocky_problem(2, 64, 40)
    bias = rng.standard_normal(40).astype(np.float32)
    A = sm.SparseTensor.from_dense(a, "csr")
    np.testing.assert_allclose(kernel(A=A, B=B, bias=bias), a @ B + bias, rtol=1e-4, atol=1e-4)
    assert "sparse, bsr4x4" in kernel.schedule["seconds"] and kernel.schedule["conversion_seconds"] > 0
    out = np.full((256, 40), np.nan, np.float32)
    assert kernel._run("sparse, bsr4x4", {"A": A, "B": B, "bias": bias}, out) is out  # the blocked variant itself
    np.testing.assert_allclose(out, a @ B + bias, rtol=1e-4, atol=1e-4)
    scattered = (rng.standard_normal((256, 256)) * (rng.random((256, 256)) < 0.1)).astype(np.float32)
    kernel(A=sm.SparseTensor.from_dense(scattered, "csr"), B=B, bias=bias)
    assert not any(c.startswith("sparse, bsr") for c in kernel.schedule["seconds"])


def test_the_sparsifier_kernel_is_a_candidate_where_it_may_pay(monkeypatch):
    import scipy.sparse as sp

    from sparse_mlir.runtime import schedule

    a = sp.random(300, 300, density=0.03, format="csr", random_state=np.random.default_rng(1))
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64",
                        schedule="auto")
    kernel(A=a, B=a)  # a tiny product: not worth a per-shape build, and it says so
    assert "sparsifier" not in kernel.schedule["seconds"] and kernel._sparsified is None
    assert "ms per call" in kernel.schedule["skipped"]["sparsifier"]
    monkeypatch.setattr(schedule, "SPARSIFIER_WORTH", 0.0)
    b = sp.random(300, 300, density=0.03, format="csr", random_state=np.random.default_rng(2))
    c = kernel(A=b, B=b)  # another structure: decided again, the sparsifier's kernel timed too
    assert "sparsifier" in kernel.schedule["seconds"]
    expected = (b @ b).toarray()
    np.testing.assert_allclose(c.to_dense(), expected, rtol=1e-12)
    np.testing.assert_allclose(kernel._run("sparsifier", {"A": sm.SparseTensor.from_scipy(b),
                                                          "B": sm.SparseTensor.from_scipy(b)}, None).to_dense(),
                               expected, rtol=1e-12)


def test_a_sparsifier_kernel_has_no_sparsifier_candidate():
    import scipy.sparse as sp

    kernel = sm.compile(SPARSIFIED_SPMV, formats={"A": "csc"}, dtype="float64", schedule="auto")
    a = sp.random(50, 40, density=0.1, format="csc", random_state=np.random.default_rng(0))
    np.testing.assert_allclose(kernel(A=a, x=np.ones(40)), a @ np.ones(40), rtol=1e-12)
    assert "sparsifier" not in kernel.schedule["seconds"] and "sparsifier" not in kernel.schedule["skipped"]


def _decided(kernel, monkeypatch, choice: str) -> None:
    """Make ``kernel``'s next decisions ``choice`` without timing anything (``compile`` may hand back a kernel
    an earlier test used: its decisions are forgotten)."""
    kernel._decisions.clear()
    kernel._native_fast = None
    monkeypatch.setattr(type(kernel), "_decide", lambda self, args: {"choice": choice, "seconds": {choice: 1.0},
                                                                     "conversion_seconds": 0.0, "skipped": {}})


@pytest.mark.parametrize("choice", ["sparse", "sparse, 1 thread"])
def test_a_sparse_decision_sends_the_same_tensor_straight_to_the_kernel(monkeypatch, choice):
    """Decided for a ``SparseTensor`` object, later calls with that very object skip the Python path (operand
    checks, structure key, decision look-up) and run the specialization's C-level call, on one thread where that
    was the choice; another object, even of the same structure, goes through the Python path; the tensors are
    held weakly."""
    import gc
    import weakref

    from sparse_mlir.runtime import schedule

    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32", schedule="auto")
    _decided(kernel, monkeypatch, choice)
    a, A, B = operands(0.99)
    np.testing.assert_allclose(kernel(A=A, B=B), a @ B, rtol=1e-4, atol=1e-3)
    assert kernel._native_fast is not None
    python_path, counts = [], []
    real_run, real_fixed = type(kernel)._run, schedule.threads.fixed
    monkeypatch.setattr(type(kernel), "_run", lambda self, *args: python_path.append(1) or real_run(self, *args))
    monkeypatch.setattr(schedule.threads, "fixed", lambda count: counts.append(count) or real_fixed(count))
    out = np.full((512, 256), np.nan, np.float32)
    assert kernel(A=A, B=B, out=out) is out
    np.testing.assert_allclose(out, a @ B, rtol=1e-4, atol=1e-3)
    assert python_path == [] and counts == ([1] if choice == "sparse, 1 thread" else [])
    twin = sm.SparseTensor.from_dense(a, "csr")  # the same structure, another object
    np.testing.assert_allclose(kernel(A=twin, B=B), a @ B, rtol=1e-4, atol=1e-3)
    assert python_path == [1]
    held = weakref.ref(twin)
    del twin
    gc.collect()
    assert held() is None  # the route kept no strong reference
    np.testing.assert_allclose(kernel(A=A, B=B), a @ B, rtol=1e-4, atol=1e-3)  # decided again: the Python path
    assert python_path == [1, 1]


@pytest.mark.parametrize("expression, name, columns, reference", [
    ("C[i,j] = A[i,k] * B[k,j]", "B", 64, lambda a, b: a @ b),
    ("C[i,j] = 2 * A[i,k] * B[k,j]", "B", 64, lambda a, b: 2 * (a @ b)),
    ("C[i,j] = A[k,i] * B[k,j]", "B", 64, lambda a, b: a.T @ b),
    ("y[i] = A[i,j] * x[j]", "x", None, lambda a, b: a @ b),
])
def test_a_dense_decision_sends_the_same_tensor_straight_to_blas(monkeypatch, expression, name, columns, reference):
    """Decided dense for a ``SparseTensor`` object, later calls with that object and arrays of the decided dtype
    and shapes multiply the cached dense copy at once (no operand checks, structure key or look-up); anything
    else (``out=``, another dtype, a missing operand) takes the Python path, which checks it; the route keeps
    neither the tensor nor its dense copy alive."""
    import gc
    import weakref

    from sparse_mlir.errors import DTypeError, OperandError, ShapeError
    from sparse_mlir.runtime import schedule

    kernel = sm.compile(expression, formats={"A": "csr"}, dtype="float32", schedule="auto")
    _decided(kernel, monkeypatch, "dense")
    a, A, _ = operands(0.5)
    b = np.random.default_rng(1).standard_normal((512, columns) if columns else 512).astype(np.float32)
    np.testing.assert_allclose(kernel(A=A, **{name: b}), reference(a, b), rtol=1e-4, atol=1e-3)
    assert kernel._native_fast is not None
    python_path = []
    real_run = type(kernel)._run
    monkeypatch.setattr(type(kernel), "_run", lambda self, *args: python_path.append(1) or real_run(self, *args))
    got = kernel(A=A, **{name: b})
    assert got.dtype == np.float32 and python_path == []
    np.testing.assert_allclose(got, reference(a, b), rtol=1e-4, atol=1e-3)
    out = np.full(got.shape, np.nan, np.float32)
    assert kernel(A=A, out=out, **{name: b}) is out and python_path == []
    np.testing.assert_allclose(out, reference(a, b), rtol=1e-4, atol=1e-3)
    with pytest.raises(DTypeError):
        kernel(A=A, **{name: b.astype(np.float64)})
    with pytest.raises(OperandError):
        kernel(A=A)
    with pytest.raises(ShapeError):
        kernel(A=A, **{name: b[:100]})
    with pytest.raises(OperandError, match="C-contiguous"):
        kernel(A=A, out=np.empty((*got.shape, 2), np.float32)[..., 0], **{name: b})
    if got.shape == b.shape:
        with pytest.raises(OperandError, match="overlaps"):
            kernel(A=A, out=b, **{name: b})
    refused = len(python_path)  # the Python path refused them all (the bad ``out=`` in ``_run``)
    kernel(A=A, **{name: b})  # still routed: the refused calls left the route in place
    assert len(python_path) == refused
    tensor, copy = weakref.ref(A), weakref.ref(schedule._dense_copies[A])
    del A
    gc.collect()
    assert tensor() is None and copy() is None


def test_scipy_operands_keep_the_python_path(monkeypatch):
    import scipy.sparse as sp

    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32", schedule="auto")
    a, A, B = operands(0.99)
    _decided(kernel, monkeypatch, "sparse")
    kernel(A=A, B=B)
    assert kernel._native_fast is not None
    np.testing.assert_allclose(kernel(A=sp.csr_array(a), B=B), a @ B, rtol=1e-4, atol=1e-3)
    assert kernel._native_fast is None  # a scipy matrix becomes a new tensor on every call


def test_dense_blas_is_timed_last_once_our_workers_rest(monkeypatch):
    """Each pool's idle threads slow the other's calls on a small machine (OpenBLAS's spin for about 0.1 s):
    the sparse candidates are timed first, dense BLAS after ``threads.wait_until_idle``."""
    from sparse_mlir.runtime import schedule

    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32", schedule="auto")
    events = []
    real_on_threads, real_dense = type(kernel)._on_threads, type(kernel)._dense
    monkeypatch.setattr(type(kernel), "_on_threads",
                        lambda self, count, *args: events.append("sparse") or real_on_threads(self, count, *args))
    monkeypatch.setattr(type(kernel), "_dense", lambda self, *args: events.append("dense") or real_dense(self, *args))
    monkeypatch.setattr(schedule.threads, "wait_until_idle", lambda: events.append("rest"))
    monkeypatch.setattr(schedule.knobs, "num_threads", lambda: 2)
    kernel._decisions.clear()  # ``compile`` may hand back the kernel an earlier test decided for these operands
    kernel._native_fast = None  # and the route that decision left
    a, A, B = operands(0.99)
    kernel(A=A, B=B)
    first_dense = events.index("dense")
    assert events[first_dense - 1] == "rest" and "sparse" not in events[first_dense:first_dense + 6], events
    assert events.count("rest") == 1 and events.index("rest") > events.index("sparse")


def test_wait_until_idle_sleeps_for_a_short_blocktime_only(monkeypatch):
    import math
    import time

    from sparse_mlir.runtime import threads

    for spin, least, most in ((0.02, 0.02, 1.0), (0.0, 0.0, 0.2), (math.inf, 0.0, 0.2), (0.3, 0.0, 0.25)):
        monkeypatch.setattr(threads, "blocktime_seconds", lambda spin=spin: spin)
        start = time.perf_counter()
        threads.wait_until_idle()
        assert least <= time.perf_counter() - start < most, spin


def test_a_sparse_variant_must_beat_dense_blas_by_the_margin(monkeypatch):
    """Timed back to back, sparse kernels look better than they run between other work: a sparse variant
    replaces dense BLAS only when it takes under ``SPARSE_MARGIN`` of its time."""
    from sparse_mlir.runtime import schedule

    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32", schedule="auto")
    a, A, B = operands(0.5)
    ran_dense = []
    real_dense = type(kernel)._dense
    monkeypatch.setattr(type(kernel), "_dense",
                        lambda self, *args: ran_dense.append(1) or real_dense(self, *args))
    for share, expected in ((schedule.SPARSE_MARGIN + 0.05, "dense"), (schedule.SPARSE_MARGIN - 0.05, "sparse")):
        def timed(fn, repeats, share=share):  # dense BLAS 1 s, every sparse variant ``share`` of it
            ran_dense.clear()
            fn()
            return 1.0 if ran_dense else share

        monkeypatch.setattr(schedule, "median_seconds", timed)
        kernel._decisions.clear()
        kernel._native_fast = None  # nor the route the last decision left
        np.testing.assert_allclose(kernel(A=A, B=B), a @ B, rtol=1e-4, atol=1e-3)
        seconds = kernel.schedule["seconds"]
        assert seconds["dense"] == 1.0 and seconds["sparse"] == share, seconds
        assert kernel.schedule["choice"] == expected, kernel.schedule


def test_a_bsr_decision_sends_the_same_tensor_to_the_blocked_kernel(monkeypatch):
    """Decided for a BSR copy, later calls with the same ``SparseTensor`` go to the blocked kernel (its cached
    copy, its own C-level call) without the auto kernel's Python path."""
    rng, a, B, kernel = _blocky_problem(3, 32, 24)
    kernel._decisions.clear()

    def decide(self, args):
        assert self._block_candidate(args) is not None
        return {"choice": "sparse, bsr4x4", "seconds": {}, "conversion_seconds": 0.0, "skipped": {}}

    monkeypatch.setattr(type(kernel), "_decide", decide)
    A, bias = sm.SparseTensor.from_dense(a, "csr"), rng.standard_normal(24).astype(np.float32)
    want = a @ B + bias
    np.testing.assert_allclose(kernel(A=A, B=B, bias=bias), want, rtol=1e-4, atol=1e-4)
    assert kernel._native_fast is not None
    python_path = []
    real_run = type(kernel)._run
    monkeypatch.setattr(type(kernel), "_run", lambda self, *args: python_path.append(1) or real_run(self, *args))
    out = np.full((128, 24), np.nan, np.float32)
    for _ in range(3):
        assert kernel(A=A, B=B, bias=bias, out=out) is out
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    assert python_path == []
    with pytest.raises(sm.errors.ShapeError):  # bad operands still get the library's error
        kernel(A=A, B=B[:100], bias=bias)


def test_a_dense_choice_follows_values_changed_in_place(monkeypatch):
    """The dense copy the auto schedule multiplies was kept per tensor: a scipy operand's values changed in place
    between calls were not seen (the plain kernel saw them).  A SparseTensor keeps copies of what it is given, so
    its values cannot change under a kept copy."""
    import scipy.sparse as sp

    import sparse_mlir.runtime.schedule as schedule

    monkeypatch.setattr(schedule, "SPARSE_MARGIN", 1e-9)  # dense wins the decision
    rng = np.random.default_rng(0)
    dense = rng.random((96, 96)) + 0.1
    a, b = sp.csr_matrix(dense), rng.random((96, 16))
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, schedule="auto")
    first = kernel(A=a, B=b)
    assert kernel.schedule["choice"] == "dense"
    a.data *= 2.0
    np.testing.assert_allclose(kernel(A=a, B=b), 2 * first, rtol=1e-12)
    values = a.data.copy()
    tensor = sm.SparseTensor.from_buffers("csr", a.shape, (a.indptr, a.indices, values))
    before = kernel(A=tensor, B=b)
    values *= 2.0  # the tensor holds its own copy
    np.testing.assert_array_equal(kernel(A=tensor, B=b), before)
