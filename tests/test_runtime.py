"""Calling kernels: operand checks, outputs, specialization and caching, IR introspection."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import scipy.sparse as sp
from support.concurrency import run_at_once
from support.data import random_sparse, random_values

import sparse_mlir as sm
from sparse_mlir.errors import DeviceError, DTypeError, FormatError, OperandError, ShapeError
from support.kernels import SPARSIFIED_SPMV, SPARSIFIED_SPMV_T

SPMM = "C[i,j] = A[i,k] * B[k,j]"


@pytest.fixture
def spmm():
    return sm.compile(SPMM, formats={"A": sm.CSR}, dtype="float64")


@pytest.fixture
def operands(rng):
    a = random_sparse(rng, (6, 5), 0.4, "float64")
    return sm.SparseTensor.from_dense(a, "csr"), a, random_values(rng, (5, 3), "float64")


def test_compile_is_cached_per_process():
    assert sm.compile(SPMM, formats={"A": "csr"}) is sm.compile(SPMM, formats={"A": sm.CSR})


def test_one_specialization_per_sparse_shape_for_a_sparsifier_kernel(rng):
    spmm = sm.compile(SPMM, formats={"A": sm.CSC}, dtype="float64")  # no hand-scheduled CSC SpMM: sparsified
    assert not spmm.shape_generic
    for rows in (4, 4, 5, 4):
        a = random_sparse(rng, (rows, 3), 0.5, "float64")
        b = random_values(rng, (3, rows + 1), "float64")  # dense sizes vary freely
        np.testing.assert_array_equal(spmm(A=sm.SparseTensor.from_dense(a, "csc"), B=b), a @ b)
    shapes = sorted(s.shapes["A"] for s in spmm.specializations if s.shapes["A"] in ((4, 3), (5, 3)))
    assert shapes == [(4, 3), (5, 3)]  # one each, whatever the dense sizes


def test_mlir_text_has_dynamic_sparse_sizes(spmm):
    assert "tensor<?x?xf64, #sparse" in spmm.mlir and "linalg.generic" in spmm.mlir


def test_ir_of_every_stage(operands):
    A, a, _ = operands
    spmv = sm.compile(SPARSIFIED_SPMV_T, formats={"A": "csr"})  # sparsified, not hand-scheduled
    spmv(A=A, x=np.ones(6))
    ir = spmv.ir
    assert list(ir) == ["input", "sparsified", "mapped", "llvm"]  # the same stages on every target
    assert "tensor<6x5xf64, #sparse" in ir["input"]
    assert "scf.for" in ir["sparsified"] and "sparse_tensor" not in ir["sparsified"].split("module", 1)[1]
    assert "llvm.func @sparse_mlir_kernel(" in ir["llvm"]  # the plain C entry point
    assert "llvm.func internal @_mlir_ciface_kernel" in ir["llvm"]


def test_csr_spmv_uses_its_emitter(operands):
    """Long rows prefetch ``x`` on scalar loads, or gather it a register at a time where gathers pay."""
    from sparse_mlir.knobs import knobs
    from sparse_mlir.lowering.toolchain import fast_gathers

    A, a, _ = operands
    x = np.arange(5.0)
    spmv = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})
    np.testing.assert_allclose(spmv(A=A, x=x), a @ x)
    long_rows = "vector.gather" if fast_gathers(knobs.cpu()) else "memref.prefetch"
    assert long_rows in spmv.ir["input"] and "scf.parallel" in spmv.ir["input"]


def test_csr_spmm_uses_the_register_tiled_emitter(spmm, operands):
    A, a, B = operands
    np.testing.assert_array_equal(spmm(A=A, B=B), a @ B)
    assert "vector.fma" in spmm.ir["input"] and "scf.parallel" in spmm.ir["input"]


def test_scipy_operands_take_the_conversion_path(spmm, operands):
    _, a, B = operands
    m = sp.csr_matrix(a)
    np.testing.assert_array_equal(spmm(A=m, B=B), a @ B)
    np.testing.assert_array_equal(spmm(A=m.tocoo(), B=B), a @ B)  # converted to the declared CSR


def test_out_is_overwritten(spmm, operands):
    A, a, B = operands
    out = np.full((6, 3), 7.0)
    result = spmm(A=A, B=B, out=out)
    assert result is out
    np.testing.assert_array_equal(out, a @ B)


@pytest.mark.parametrize("bad,error", [
    (np.zeros((6, 3), np.float32), DTypeError),
    (np.zeros((6, 4)), ShapeError),
    (np.zeros((3, 6)).T, OperandError),
    ([[0.0] * 3] * 6, OperandError),
])
def test_bad_out(spmm, operands, bad, error):
    A, _, B = operands
    with pytest.raises(error):
        spmm(A=A, B=B, out=bad)


def test_missing_and_misspelled_operands(spmm, operands):
    A, _, B = operands
    with pytest.raises(OperandError, match="missing B"):
        spmm(A=A)
    with pytest.raises(OperandError, match="did you mean B"):
        spmm(A=A, b=B)
    with pytest.raises(TypeError):
        spmm(A, B)  # keyword operands only


def test_dense_operand_dtype_is_never_cast(spmm, operands):
    A, _, B = operands
    with pytest.raises(DTypeError, match="no implicit casts"):
        spmm(A=A, B=B.astype(np.float32))
    with pytest.raises(DTypeError):
        spmm(A=A, B=B.astype(object))
    with pytest.raises(DTypeError):
        spmm(A=A, B=np.array([["a"] * 3] * 5))


def test_sparse_operand_dtype_and_format(spmm, operands):
    A, a, B = operands
    with pytest.raises(DTypeError):
        spmm(A=sm.SparseTensor.from_dense(a.astype(np.float32), "csr"), B=B)
    with pytest.raises(FormatError, match="declared csr"):
        spmm(A=sm.SparseTensor.from_dense(a, "coo"), B=B)
    with pytest.raises(OperandError, match="SparseTensor or a scipy.sparse"):
        spmm(A=a, B=B)
    with pytest.raises(FormatError, match="dense in this kernel"):
        spmm(A=A, B=sp.csr_matrix(B))


def test_shape_mismatch_names_both_operands(spmm, operands):
    A, _, _ = operands
    with pytest.raises(ShapeError, match="A dimension 1 has size 5 but B dimension 0 has size 4"):
        spmm(A=A, B=np.zeros((4, 3)))
    with pytest.raises(ShapeError, match="2 indices"):
        spmm(A=A, B=np.zeros(5))


class FakeCupyArray:
    """Stands in for a cupy.ndarray: the runtime recognises device arrays by their module."""

    __module__ = "cupy._core.core"


def test_device_arrays_are_refused_on_cpu(spmm, operands):
    A, _, _ = operands
    with pytest.raises(DeviceError, match="CuPy"):
        spmm(A=A, B=FakeCupyArray())


def test_unknown_target():
    with pytest.raises(DeviceError):
        sm.compile(SPMM, formats={"A": "csr"}, target="tpu")


@pytest.mark.parametrize("layout", ["fortran", "strided", "readonly", "misaligned"])
def test_dense_layouts_are_handled_and_inputs_untouched(spmm, operands, layout):
    A, a, B = operands
    if layout == "fortran":
        Bx = np.asfortranarray(B)
    elif layout == "strided":
        Bx = np.repeat(B, 2, axis=1)[:, ::2]
    elif layout == "readonly":
        Bx = B.copy()
        Bx.flags.writeable = False
    else:
        raw = np.zeros(B.size * 8 + 1, dtype=np.uint8)[1:].view(np.float64).reshape(B.shape)
        raw[...] = B
        Bx = raw
        assert not Bx.flags.aligned
    before = Bx.copy()
    np.testing.assert_array_equal(spmm(A=A, B=Bx), a @ B)
    np.testing.assert_array_equal(Bx, before)


def test_nan_and_inf_propagate(rng):
    a = np.array([[1.0, 0.0], [0.0, np.nan], [np.inf, 2.0]])
    x = np.array([1.0, 2.0])
    y = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})(A=sm.SparseTensor.from_dense(a, "csr"), x=x)
    np.testing.assert_array_equal(y, a @ x)


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 0)])
def test_zero_size_dimensions(shape):
    a = np.zeros(shape)
    x = np.ones(shape[1])
    y = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})(A=sm.SparseTensor.from_dense(a, "csr"), x=x)
    np.testing.assert_array_equal(y, a @ x)


def test_empty_matrix_with_sparse_output():
    z = sm.SparseTensor.from_dense(np.zeros((3, 4)), "csr")
    C = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": "csr", "B": "csr", "C": "csr"})(A=z, B=z)
    assert C.nnz == 0 and C.to_dense().shape == (3, 4)


def test_sparse_results_own_their_buffers(rng):
    add = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": "csr", "B": "csr", "C": "csr"})
    a = random_sparse(rng, (50, 40), 0.2, "float64")
    A = sm.SparseTensor.from_dense(a, "csr")
    results = [add(A=A, B=A) for _ in range(50)]
    del results[:-1]
    np.testing.assert_array_equal(results[-1].to_dense(), 2 * a)
    assert not results[-1].values.flags.writeable


def test_threads_share_one_compile(rng):
    from sparse_mlir.runtime import cpu as runtime_kernel

    k = sm.compile("y[i] = A[i,j] * x[j] + 1", formats={"A": "csr"})
    a = random_sparse(rng, (9, 9), 0.3, "float64")
    A, x = sm.SparseTensor.from_dense(a, "csr"), random_values(rng, 9, "float64")
    errors: list[BaseException] = []

    def work(_: int) -> None:
        try:
            for _ in range(20):
                np.testing.assert_array_equal(k(A=A, x=x), a @ x + 1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_at_once(work, 8)
    assert not errors
    assert len(k.specializations) == 1
    assert sum(1 for s in runtime_kernel._loaded.values() if s is k.specializations[0]) == 1


def test_a_compiler_crash_becomes_a_lowering_error(tmp_path):
    """The sparsifier segfaults co-iterating CSC A twice with a dense x (see test_kernels); asked directly,
    without the densified retry, the compiler process dies and this one gets a LoweringError."""
    from sparse_mlir.compiler import process as worker
    from sparse_mlir.dsl import plan
    from sparse_mlir.errors import LoweringError
    from sparse_mlir.abi.c_signature import Signature

    spec = plan("z[j] = -(A[i,j] + (A[i,j] + x[j]))", {"A": "csc"})
    shapes = {"A": (2, 3), "x": (None,), "z": (None,)}
    sig = Signature.from_spec(spec, spec.formats, shapes, "k")
    with pytest.raises(LoweringError, match="compiler process died"):
        worker.call("build_cpu", spec, shapes, sig, tmp_path / "k.so", "native", None, False)
    k = sm.compile("s[] = A[i,j] * 2", formats={"A": "csr"})  # the next compile gets a fresh process
    assert k(A=sm.SparseTensor.from_dense(np.eye(3), "csr")) == 6.0


def test_an_unpicklable_compiler_error_still_arrives_as_a_lowering_error(tmp_path):
    """The bindings' MLIRError cannot be pickled; the compiler process sends its text instead of dying."""
    from sparse_mlir.compiler import process as worker
    from sparse_mlir.dsl import plan
    from sparse_mlir.errors import LoweringError
    from sparse_mlir.abi.c_signature import Signature

    spec = plan(SPARSIFIED_SPMV, {"A": "csc"})  # a sparsifier kernel: the shapes reach MLIR
    sig = Signature.from_spec(spec, spec.formats, {"A": (4, 4), "x": (4,), "y": (4,)}, "k")
    with pytest.raises(LoweringError, match="invalid tensor dimension size"):
        worker.call("build_cpu", spec, {"A": (-3, 4), "x": (4,), "y": (-3,)}, sig, tmp_path / "k.so", "native",
                    None, False)


def test_out_must_not_overlap_an_operand(spmm, rng):
    a = random_sparse(rng, (5, 5), 0.5, "float64")
    B = random_values(rng, (5, 5), "float64")
    with pytest.raises(OperandError, match="overlaps operand B"):
        spmm(A=sm.SparseTensor.from_dense(a, "csr"), B=B, out=B)


@pytest.mark.parametrize(("env", "expected"), [({}, "5"), ({"KMP_BLOCKTIME": "0"}, "0")])
def test_idle_pool_threads_spin_briefly_unless_told(env, expected):
    """After a threaded call the pool spins a few ms, not the runtime's 200 ms that slowed BLAS calls after it."""
    script = textwrap.dedent("""
        import ctypes, numpy as np, scipy.sparse as sp, sparse_mlir as sm
        from sparse_mlir.runtime import threads
        if threads.openmp_library() is None:
            print("no-openmp")
        else:
            a = sp.random(3000, 3000, density=0.01, format="csr", random_state=0)
            sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})(A=a, x=np.ones(3000))
            get = threads.load_runtime(threads.kernel_runtime()).kmp_get_blocktime  # the kernels' runtime
            get.restype = ctypes.c_int
            print(get())
    """)
    environ = {k: v for k, v in os.environ.items() if k != "KMP_BLOCKTIME"} | env | {"SPARSE_MLIR_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "no-openmp":
        pytest.skip("no OpenMP runtime")
    assert out.stdout.strip() == expected
