"""The call path against scipy: SpMV with a scipy operand, and the fixed cost of a cached call, layer by layer.

    SPARSE_MLIR_NUM_THREADS=1 python benchmarks/call_path.py [--repeats 9]

Everything runs in this one process.  Each figure is the median over
``--repeats`` timing runs (each run a loop of calls, per-call mean); on a
shared machine the spread is wide, so the ratios, measured back to back,
matter more than the absolute times.  Speed ratios are ``scipy time / our
time`` (above 1: ours faster); the layer-by-layer rows of the fixed cost are
``time / scipy time``.

1. SpMV on SuiteSparse bcsstk13 (2003^2, 83,883 nonzeros, float64): the
   kernel with the ``scipy.sparse.csr_array`` itself (zero copy, bounds
   checked per call), with a prebuilt ``SparseTensor``, and scipy's ``A @ x``.
2. The same with float32 operands (``dtype=None`` picks float32; scipy
   float32 as well).
3. SpMV on a 64x64 matrix (10% dense): per-call overhead, with a scipy
   ``csr_array`` / ``csr_matrix`` operand and with ``A @ x`` on a
   ``SparseTensor`` (issue 16: >= 0.8x scipy's speed with a scipy operand;
   ``A @ x`` >= 0.95x the kernel called directly).
4. The fixed cost of a cached call (4x4 SpMV), from the outside in: the
   ``dtype=None`` kernel, the float64 kernel (both through the C-level call,
   ``runtime/fast_call.c``), then the Python path it replaces, layer by
   layer: operand checks (``prepare``, ``check_extents``), the ctypes
   ``NativeFunction`` call, the bare ctypes function with prepared
   arguments; and scipy's ``a @ x``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.io.matrix_files import read_matrix
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime.kernel import operand_table
from sparse_mlir.runtime.operands import check_extents, prepare

SPMV = "y[i] = A[i,k] * x[k]"
MATRIX = Path(__file__).resolve().parents[2] / "shared" / "data" / "suitesparse" / "bcsstk13.mtx.gz"


def per_call(call: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` runs of the mean seconds per call of ``calls`` calls."""
    call()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - start) / calls)
    return float(np.median(runs))


def spmv(matrix: sp.csr_array, dtype: str, repeats: int) -> None:
    A = matrix.astype(dtype)
    x = np.random.default_rng(0).random(A.shape[1]).astype(dtype)
    kernel = sm.compile(SPMV, formats={"A": "csr"})  # dtype=None: float32 operands run a float32 kernel
    tensor = sm.SparseTensor.from_scipy(A)
    np.testing.assert_allclose(kernel(A=A, x=x), A @ x, rtol=1e-4 if dtype == "float32" else 1e-10)
    scipy_s = per_call(lambda: A @ x, 2000, repeats)
    operand_s = per_call(lambda: kernel(A=A, x=x), 2000, repeats)
    tensor_s = per_call(lambda: kernel(A=tensor, x=x), 2000, repeats)
    matmul_s = per_call(lambda: tensor @ x, 2000, repeats)
    print(f"bcsstk13 SpMV {dtype}: scipy A @ x {scipy_s * 1e6:.1f} us | kernel(A=csr_array) {operand_s * 1e6:.1f} us "
          f"(speed vs scipy {scipy_s / operand_s:.2f}x) | kernel(A=SparseTensor) {tensor_s * 1e6:.1f} us "
          f"({scipy_s / tensor_s:.2f}x) | SparseTensor @ x {matmul_s * 1e6:.1f} us "
          f"({tensor_s / matmul_s:.2f}x the direct call)")


def small_spmv(repeats: int) -> None:
    dense = sp.random(64, 64, density=0.1, format="csr", dtype=np.float64, random_state=0)
    x = np.random.default_rng(0).random(64)
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    tensor = sm.SparseTensor.from_scipy(dense)
    for kind in (sp.csr_array, sp.csr_matrix):
        a = kind(dense)
        np.testing.assert_allclose(kernel(A=a, x=x), a @ x, rtol=1e-12)
        scipy_s = per_call(lambda a=a: a @ x, 20_000, repeats)
        ours_s = per_call(lambda a=a: kernel(A=a, x=x), 20_000, repeats)
        print(f"64x64 SpMV, {kind.__name__}: scipy {scipy_s * 1e6:.2f} us | kernel(A={kind.__name__}) "
              f"{ours_s * 1e6:.2f} us | speed vs scipy (scipy time / ours, above 1: ours faster) "
              f"{scipy_s / ours_s:.2f}x")
    float64 = kernel.kernel_for("float64")
    direct_s = per_call(lambda: float64(A=tensor, x=x), 20_000, repeats)
    matmul_s = per_call(lambda: tensor @ x, 20_000, repeats)
    print(f"64x64 SpMV, SparseTensor: kernel(A=t, x=x) {direct_s * 1e6:.2f} us | t @ x {matmul_s * 1e6:.2f} us | "
          f"speed of @ vs the direct call (direct time / @ time) {direct_s / matmul_s:.2f}x")


def fixed_cost(repeats: int) -> None:
    a = sp.random(4, 4, density=0.5, format="csr", dtype=np.float64, random_state=0)
    x = np.ones(4)
    tensor = sm.SparseTensor.from_scipy(a)
    generic = sm.compile(SPMV, formats={"A": "csr"})
    fixed = generic.kernel_for("float64")
    generic(A=tensor, x=x)
    spec = fixed.spec
    inputs, sources = operand_table(spec), tuple(spec.extent_sources().items())
    native = fixed.specializations[-1].native
    args = prepare(spec.expression, inputs, {"A": tensor, "x": x}, spec.dtype, "cpu")
    out = np.empty(4)
    params = native_params(native, args, out)
    calls = 20_000
    rows = [
        ("scipy a @ x", lambda: a @ x),
        ("kernel(A=csr_matrix, x=x), dtype=None", lambda: generic(A=a, x=x)),
        ("kernel(A=SparseTensor, x=x), dtype=None", lambda: generic(A=tensor, x=x)),
        ("kernel(A=SparseTensor, x=x), dtype=float64", lambda: fixed(A=tensor, x=x)),
        ("  the Python path: kernel(...) with the C call off", lambda: python_path(fixed, tensor, x)),
        ("  prepare (operand checks)", lambda: prepare(spec.expression, inputs, {"A": tensor, "x": x}, spec.dtype,
                                                       "cpu")),
        ("  check_extents", lambda: check_extents(sources, args)),
        ("  NativeFunction call (runtime/library.py)", lambda: native(args, out, (4,))),
        ("  bare ctypes function(*params)", lambda: native.function(*params)),
    ]
    base = None
    for label, call in rows:
        seconds = per_call(call, calls, repeats)
        base = base or seconds
        print(f"{label:<48} {seconds * 1e6:6.2f} us  ({seconds / base:.2f}x scipy)")


def python_path(kernel: Any, tensor: sm.SparseTensor, x: np.ndarray) -> Any:
    """The call without the C-level path (what every call cost before it)."""
    return type(kernel).__call__.__wrapped__(kernel, None, A=tensor, x=x)


def native_params(native: Any, args: dict, out: np.ndarray) -> tuple:
    """The arguments ``NativeFunction`` passes its ctypes function for these operands, recorded from one call
    (so this follows whatever that layer does)."""
    recorded: list[tuple] = []
    real = native.function
    native.function = lambda *params: recorded.append(params) or 0
    try:
        native(args, out, out.shape)
    finally:
        native.function = real
    return recorded[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timing runs per figure (the median is reported)")
    repeats = parser.parse_args().repeats
    print(f"threads per kernel: {knobs.num_threads()}; medians of {repeats} runs")
    matrix = sp.csr_array(read_matrix(MATRIX))
    for dtype in ("float64", "float32"):
        spmv(matrix, dtype, repeats)
    small_spmv(repeats)
    fixed_cost(repeats)


if __name__ == "__main__":
    main()
