"""Issue 14, the compiler side: memory budgets, a dying or stuck compiler, interrupted exchanges, fork, blow-ups.

Kernels here use small shapes and expressions new to the process (a literal
unique to each test), so each test compiles what it means to compile; the
ones that need a cold disk cache get their own cache folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.compiler import process as worker
from sparse_mlir.dsl import plan
from sparse_mlir.errors import DSLError, LoweringError, SparseMLIRError
from sparse_mlir.runtime import schedule
from sparse_mlir.compiler import cache
from sparse_mlir.compiler import driver
from sparse_mlir.knobs import knobs

# a dense result co-iterating 5 sparse operands: about a second to compile, several under load
SLOW = "C[i,j] = A0[i,j] + A1[i,j] + A2[i,j] + A3[i,j] + A4[i,j] + {n}"
SLOW_FORMATS = {f"A{i}": "csr" for i in range(5)}


def slow_operands(n: int = 4) -> dict[str, sp.csr_matrix]:
    return {f"A{i}": sp.eye(n, format="csr") * (i + 1) for i in range(5)}


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPARSE_MLIR_CACHE_DIR", str(folder))
    return folder


def compiler_pid() -> int | None:
    return None if worker._compiler is None else worker._compiler.popen.pid


def wait_until_compiling(thread: threading.Thread, seconds: float = 30) -> None:
    """Until the compiler lock is held by ``thread``'s compile and its request is on its way."""
    deadline = time.monotonic() + seconds
    while not (worker._lock.locked() and worker._compiler is not None):
        assert thread.is_alive() and time.monotonic() < deadline, "the compile never started"
        time.sleep(0.01)
    time.sleep(0.2)


# -- item 14: the auto schedule's memory budget and per-structure decisions ------------------------------------

def test_dense_budget_reads_the_setting(monkeypatch):
    monkeypatch.setenv("SPARSE_MLIR_DENSE_BUDGET", "12345")
    assert knobs.dense_budget() == 12345
    monkeypatch.setenv("SPARSE_MLIR_DENSE_BUDGET", "lots")
    with pytest.warns(RuntimeWarning, match="SPARSE_MLIR_DENSE_BUDGET"):
        default = knobs.dense_budget()
    monkeypatch.delenv("SPARSE_MLIR_DENSE_BUDGET")
    assert 0 < default and abs(knobs.dense_budget() - default) < default  # a fraction of what is free


def test_auto_plans_no_dense_copy_over_the_budget(monkeypatch):
    monkeypatch.setenv("SPARSE_MLIR_DENSE_BUDGET", str(64 * 64 * 4 - 1))  # one byte short of A's dense copy
    k = sm.compile("C[i,j] = A[i,k] * B[k,j] * 3", formats={"A": "csr"}, dtype="float32", schedule="auto")
    a = sp.random(64, 64, density=0.5, format="csr", dtype=np.float32, random_state=0)
    b = np.ones((64, 8), np.float32)
    A = sm.SparseTensor.from_scipy(a)
    np.testing.assert_allclose(k(A=A, B=b), 3 * (a @ b), rtol=1e-5)
    assert "dense" not in k.schedule["seconds"] and "over the dense budget" in k.schedule["skipped"]["dense"]
    assert A not in schedule._dense_copies


def test_auto_on_a_million_square_spmv_asks_for_no_terabytes():
    """The issue's case: the dense candidate of a 1M x 1M SpMV needed 3.6 TiB (MemoryError)."""
    n = 1 << 20
    a = sp.csr_matrix((np.array([1.0, 2.0, 3.0]), (np.array([0, 5, n - 1]), np.array([n - 1, 0, 7]))), shape=(n, n))
    k = sm.compile("y[i] = A[i,j] * x[j] * 5", formats={"A": "csr"}, schedule="auto")
    x = np.arange(n, dtype=np.float64)
    np.testing.assert_array_equal(k(A=sm.SparseTensor.from_scipy(a), x=x), 5 * (a @ x))
    assert k.schedule["choice"].startswith("sparse") and "dense" in k.schedule["skipped"]


def test_auto_decides_once_per_scipy_structure(monkeypatch):
    timed: list[object] = []
    real = schedule.median_seconds
    monkeypatch.setattr(schedule, "median_seconds", lambda fn, n: timed.append(fn) or real(fn, n))
    k = sm.compile("y[i] = A[i,j] * x[j] * 7", formats={"A": "csr"}, schedule="auto")
    a = sp.random(200, 100, density=0.1, format="csr", random_state=1)
    x = np.ones(100)
    for _ in range(4):  # a new SparseTensor each call: the decision must still be reused
        np.testing.assert_allclose(k(A=a, x=x), 7 * (a @ x))
    first = len(timed)
    assert first >= 2
    a2 = a.copy()
    a2.data[:] = 2.0  # other values, same structure: the same decision
    np.testing.assert_allclose(k(A=a2, x=x), 7 * (a2 @ x))
    assert len(timed) == first
    other = sp.random(200, 100, density=0.1, format="csr", random_state=2)  # same shape and nnz, other pattern
    assert other.nnz == a.nnz
    k(A=other, x=x)
    assert len(timed) == 2 * first


def test_auto_blocked_choice_works_for_a_new_tensor_of_the_same_structure():
    """A BSR choice made for one tensor runs on another of the same structure (its BSR copy is made then)."""
    rng = np.random.default_rng(3)
    a = (np.kron(rng.random((16, 16)) < 0.2, np.ones((4, 4))) * rng.standard_normal((64, 64))).astype(np.float32)
    k = sm.compile("C[i,j] = W[i,k] * X[k,j]", formats={"W": "csr"}, dtype="float32", schedule="auto")
    B = rng.standard_normal((64, 16)).astype(np.float32)
    k(W=sm.SparseTensor.from_dense(a, "csr"), X=B)
    assert "sparse, bsr4x4" in k.schedule["seconds"]
    args = {"W": sm.SparseTensor.from_dense(a * 2, "csr"), "X": B}
    np.testing.assert_allclose(k._run("sparse, bsr4x4", args, None), (a * 2) @ B, rtol=1e-4, atol=1e-4)


# -- item 16: only a real sparsifier refusal densifies, and only within the budget ---------------------------

def test_a_killed_compiler_gives_a_lowering_error_and_caches_nothing(own_cache):
    k = sm.compile(SLOW.format(n=16), formats=SLOW_FORMATS)
    worker.call("kernel_source", plan("y[i] = x[i]"))  # a running compiler to kill
    before = dict(driver.stats)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(LoweringError, k, **slow_operands()).value))
    thread.start()
    wait_until_compiling(thread)
    os.kill(compiler_pid(), signal.SIGKILL)
    thread.join(60)
    (error,) = errors
    assert isinstance(error, worker.CompilerDied) and not error.crashed and "SIGKILL" in str(error)
    assert driver.stats["densified"] == before["densified"]
    assert not list(own_cache.rglob("*.so"))  # nothing cached, densified or not
    np.testing.assert_array_equal(k(**slow_operands()), np.eye(4) * 15 + 16)  # a fresh compiler builds it


def test_a_refused_kernel_is_not_densified_beyond_the_budget(own_cache, monkeypatch):
    """The sparsifier crashes on this co-iteration (as in test_kernels, there 2 x 3); the dense copy of this 3 x 2
    A would need 48 bytes."""
    monkeypatch.setenv("SPARSE_MLIR_DENSE_BUDGET", "47")
    k = sm.compile("z[j] = -(A[i,j] + (A[i,j] + x[j]))", formats={"A": "csc"})
    A = sm.SparseTensor.from_dense(np.array([[1.0, 0], [0, 3], [2, 0]]), "csc")
    before = driver.stats["densified"]
    with pytest.raises(LoweringError, match="over the dense budget of 47"):
        k(A=A, x=np.ones(2))
    assert driver.stats["densified"] == before
    monkeypatch.setenv("SPARSE_MLIR_DENSE_BUDGET", "48")
    np.testing.assert_array_equal(k(A=A, x=np.ones(2)), [-9.0, -9.0])
    assert driver.stats["densified"] == before + 1


def test_only_refusals_densify():
    for stage in ("input", "sparsified", "llvm"):  # MLIR refusing to build, sparsify or lower the kernel
        assert driver.refused(LoweringError("x", stage=stage, target="cpu"))
    assert driver.refused(worker.CompilerDied("x", returncode=-signal.SIGSEGV))
    assert driver.refused(worker.CompilerDied("x", returncode=-signal.SIGABRT))
    for other in (worker.CompilerDied("x", returncode=-signal.SIGKILL), worker.CompilerDied("x", returncode=1),
                  worker.CompilerDied("x", returncode=None, timed_out=True),
                  LoweringError("linking failed", stage="link", target="cpu"),
                  LoweringError("AttributeError: ...", stage="build_cpu", target="cpu")):
        assert not driver.refused(other), other


# -- item 17: replies matched to requests; a broken exchange restarts the compiler ------------------------------

class _Interrupted(BaseException):
    """What a timeout signal's handler (or Ctrl-C) raises in the middle of a wait."""


def test_an_exception_while_waiting_restarts_the_compiler(own_cache):
    k = sm.compile(SLOW.format(n=17), formats=SLOW_FORMATS)
    worker.call("kernel_source", plan("y[i] = x[i]"))
    old = compiler_pid()

    def interrupt(signum, frame):
        raise _Interrupted

    def alarm_while_compiling() -> None:  # a timeout signal, delivered while the reply is awaited
        wait_until_compiling(threading.main_thread())
        signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, interrupt)
    sender = threading.Thread(target=alarm_while_compiling)
    try:
        sender.start()
        with pytest.raises(_Interrupted):
            k(**slow_operands())
    finally:
        sender.join()
        signal.signal(signal.SIGALRM, previous)
    assert compiler_pid() is None  # the interrupted compiler was ended, not left one reply ahead
    with pytest.raises(ProcessLookupError):
        os.kill(old, 0)
    spmv = sm.compile("y[i] = A[i,j] * x[j] * 17", formats={"A": "csr"})
    np.testing.assert_array_equal(spmv(A=sp.eye(3, format="csr"), x=np.ones(3)), np.full(3, 17.0))
    source = worker.call("kernel_source", plan("y[i] = B[i,j] * v[j]", {"B": "csr"}))
    assert isinstance(source, str) and "linalg.generic" in source


def test_a_reply_to_another_request_restarts_the_compiler(monkeypatch):
    worker.call("kernel_source", plan("y[i] = x[i]"))
    old = compiler_pid()
    send = worker._send
    monkeypatch.setattr(worker, "_send", lambda popen, request_id, message: send(popen, request_id + 1, message))
    with pytest.raises(LoweringError, match="answered request"):
        worker.call("kernel_source", plan("y[i] = x[i]"))
    monkeypatch.setattr(worker, "_send", send)
    assert compiler_pid() is None
    assert "linalg" in worker.call("kernel_source", plan("y[i] = A[i,j]", {"A": "csr"}))
    assert compiler_pid() != old


# -- item 18: fork while another thread compiles ----------------------------------------------------------------

FORK_SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np, scipy.sparse as sp
    import sparse_mlir as sm
    from sparse_mlir.compiler import process as worker

    slow = sm.compile({slow!r}, formats={formats!r})
    operands = {{f"A{{i}}": sp.eye(4, format="csr") * (i + 1) for i in range(5)}}
    result = []
    thread = threading.Thread(target=lambda: result.append(slow(**operands)))
    thread.start()
    while not (worker._lock.locked() and worker._compiler is not None):
        time.sleep(0.01)
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:  # the child: its first compile must not wait for a lock held by a thread it does not have
        try:
            k = sm.compile("C[i,j] = A[i,j] * 18", formats={{"A": "csr", "C": "csr"}})  # serial: no OpenMP
            ok = np.array_equal(k(A=sp.eye(3, format="csr")).to_dense(), np.eye(3) * 18)
        finally:
            os._exit(0 if ok else 3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("child deadlocked")
        sys.exit(1)
    thread.join()
    assert np.array_equal(result[0], np.eye(4) * 15 + 18)  # the parent's compile was not disturbed
    print("child status", os.waitstatus_to_exitcode(status))
""")


def test_fork_while_another_thread_compiles(tmp_path):
    script = FORK_SCRIPT.format(slow=SLOW.format(n=18), formats=SLOW_FORMATS)
    env = {**os.environ, "SPARSE_MLIR_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "child status 0" in out.stdout, out.stdout + out.stderr


# -- item 19: co-iteration blow-up refused; a compile timeout -----------------------------------------------------

def test_summing_many_sparse_operands_is_refused_before_compiling():
    def summed(n: int, out: str | None) -> tuple[str, dict[str, str]]:
        formats = {f"A{i}": "csr" for i in range(n)} | ({"C": out} if out else {})
        return "C[i,j] = " + " + ".join(f"A{i}[i,j]" for i in range(n)), formats

    plan(*summed(5, "csr"))
    plan(*summed(6, None))
    with pytest.raises(DSLError, match="co-iterates 6 sparse operands"):
        plan(*summed(6, "csr"))
    with pytest.raises(DSLError, match="co-iterates 7 sparse operands"):
        sm.compile(*summed(7, None)[:1], formats=summed(7, None)[1])
    # one operand used many times is one operand
    plan("C[i,j] = " + " + ".join(["A[i,j]", "B[i,j]"] * 20), {"A": "csr", "B": "csr", "C": "csr"})


def test_compile_timeout_stops_the_compiler(own_cache, monkeypatch):
    k = sm.compile("C[i,j] = A0[i,j] + A1[i,j] + A2[i,j] + A3[i,j] + A4[i,j] * 19",
                   formats={**SLOW_FORMATS, "C": "csr"})  # a sparse output of 5 sparse operands: seconds
    worker.call("kernel_source", plan("y[i] = x[i]"))
    old = compiler_pid()
    monkeypatch.setenv("SPARSE_MLIR_COMPILE_TIMEOUT", "0.3")
    start = time.monotonic()
    with pytest.raises(LoweringError, match="SPARSE_MLIR_COMPILE_TIMEOUT=0.3s") as caught:
        k(**slow_operands())
    assert time.monotonic() - start < 3
    assert caught.value.timed_out and not driver.refused(caught.value)
    with pytest.raises(ProcessLookupError):
        os.kill(old, 0)
    assert not list(own_cache.rglob("*.so"))
    monkeypatch.setenv("SPARSE_MLIR_COMPILE_TIMEOUT", "soon")
    with pytest.warns(RuntimeWarning, match="SPARSE_MLIR_COMPILE_TIMEOUT"):
        assert knobs.compile_timeout() is None


# -- item 20: deep expressions, raw errors from the compiler and from odd cache entries ---------------------------

@pytest.mark.parametrize("rhs", [
    " + ".join(f"A{n}[i]" for n in range(600)),  # the flat sum
    "(" * 400 + "A[i]" + ")" * 400,
    "-" * 2000 + "A[i]",
    "relu(" * 300 + "A[i]" + ")" * 300,
    " * ".join(["A[i]"] * 300),
], ids=["flat sum of 600", "400 parentheses", "2000 minuses", "300 calls", "product of 300"])
def test_deep_expressions_are_refused_by_name(rhs):
    with pytest.raises(DSLError, match="nests deeper than 128"):
        sm.compile(f"y[i] = {rhs}")


def test_the_deepest_allowed_expression_compiles_and_one_more_is_refused():
    terms = [f"A{n}[i]" for n in range(129)]
    k = sm.compile("y[i] = " + " + ".join(terms[:128]))
    assert np.array_equal(k(**{f"A{n}": np.ones(2) for n in range(128)}), np.full(2, 128.0))
    with pytest.raises(DSLError, match="nests deeper than 128"):
        sm.compile("y[i] = " + " + ".join(terms))


def test_a_deep_stack_caller_gets_a_dsl_error():
    def nest(depth: int):
        return nest(depth - 1) if depth else plan("y[i] = " + " + ".join(f"A{n}[i]" for n in range(120)))

    with pytest.raises(DSLError, match="nests too deeply"):
        nest(sys.getrecursionlimit() - 200)


def test_raw_errors_in_the_compiler_arrive_as_lowering_errors():
    with pytest.raises(LoweringError, match="AttributeError"):
        worker.call("kernel_source", None)
    with pytest.raises(LoweringError, match="no job 'no_such_function'"):  # a fixed table, nothing looked up
        worker.call("no_such_function")


def test_an_unreadable_ir_file_is_a_cache_error(own_cache):
    k = sm.compile("y[i] = A[i,j] * x[j] * 20", formats={"A": "csr"})
    k(A=sp.eye(3, format="csr"), x=np.ones(3))
    path = cache.ir_path(k.specializations[0].key)
    for text in ("{not json", "[1, 2]"):
        path.write_text(text)
        with pytest.raises(cache.CacheError, match="IR"):
            k.ir
    path.unlink()
    with pytest.raises(SparseMLIRError, match="IR"):
        k.specializations[0].ir


def test_the_exit_handler_stops_the_compiler_and_closes_its_pipes():
    """Left to the interpreter's teardown, the child's handle and pipes were finalized while it ran: one
    ``ResourceWarning`` each at the end of the test suite."""
    worker.call("kernel_source", plan("y[i] = x[i] * 41"))
    compiler = worker._compiler
    assert compiler is not None and compiler.popen.poll() is None
    worker._shutdown_at_exit()
    assert worker._compiler is None and compiler.popen.returncode is not None
    assert compiler.popen.stdin.closed and compiler.popen.stdout.closed and compiler.log.closed


def test_the_exit_handler_does_not_wait_for_a_compile_in_another_thread():
    worker.call("kernel_source", plan("y[i] = x[i] * 43"))
    compiler = worker._compiler
    held, release = threading.Event(), threading.Event()

    def compiling() -> None:  # holds the exchange's lock, as a thread waiting for a reply does
        with worker._lock:
            held.set()
            release.wait()

    thread = threading.Thread(target=compiling)
    thread.start()
    try:
        held.wait()
        start = time.monotonic()
        worker._shutdown_at_exit()
        elapsed = time.monotonic() - start
    finally:
        release.set()
        thread.join()
    assert elapsed < 5 and worker._compiler is compiler and compiler.popen.poll() is None  # left running
