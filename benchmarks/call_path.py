"""The call path against scipy: SpMV with a scipy operand, and the fixed cost of a cached call, layer by layer.

    SPARSE_MLIR_NUM_THREADS=1 python benchmarks/call_path.py [--repeats 9]

Everything runs in this one process.  Each figure is the median over
``--repeats`` timing runs (each run a loop of calls, per-call mean); on a
shared machine the spread is wide, so the ratios, measured back to back,
matter more than the absolute times.  Ratios are ``sparse_mlir / scipy``:
below 1 is faster than scipy.

1. SpMV on SuiteSparse bcsstk13 (2003^2, 83,883 nonzeros, float64): the
   kernel with the ``scipy.sparse.csr_array`` itself (zero copy, bounds
   checked per call), with a prebuilt ``SparseTensor``, and scipy's ``A @ x``.
2. The same with float32 operands (``dtype=None`` picks float32; scipy
   float32 as well).
3. The fixed cost of a cached call (4x4 SpMV), from the outside in: the
   ``dtype=None`` kernel, the float64 kernel, operand checks (``prepare``,
   ``check_extents``), the ctypes ``NativeFunction`` call, the bare ctypes
   function with prepared arguments; and scipy's ``a @ x``.
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
from sparse_mlir.tensor.host import share_scipy

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
    check_s = per_call(lambda: share_scipy(A, sm.CSR), 2000, repeats)
    print(f"bcsstk13 SpMV {dtype}: scipy A @ x {scipy_s * 1e6:.1f} us | kernel(A=csr_array) {operand_s * 1e6:.1f} us "
          f"({operand_s / scipy_s:.2f}x scipy) | kernel(A=SparseTensor) {tensor_s * 1e6:.1f} us "
          f"({tensor_s / scipy_s:.2f}x scipy) | of which the scipy operand's checks and wrap {check_s * 1e6:.1f} us")


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
    fixed_cost(repeats)


if __name__ == "__main__":
    main()
