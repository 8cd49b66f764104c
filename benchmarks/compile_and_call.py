"""Compile time, per-call overhead and cached-load time of SpMM kernels (the core issue's figures), and what
shape-generic kernels change (issue 16.1).

    python benchmarks/compile_and_call.py            # everything
    python benchmarks/compile_and_call.py --generic  # only the shape-generic comparison
    python benchmarks/compile_and_call.py --generic --only 2:4  # ... of the kernels whose name has "2:4"

Compiles fresh specializations into a private cache (the compiler process is
started first, so its start-up is reported apart), times a tiny call with a
``SparseTensor`` operand, and times a second process that loads the cached
kernel.

Shape-generic part, per hand-scheduled kernel, in one process: the seconds a
new sparse size costs with one build per shape (the per-shape path, built
through ``compiler.driver.build`` as the runtime did before, and still does
for sparsifier kernels) against the first call of the shape-generic kernel at
that size (no compile), and the steady-state call time of the shape-generic
build against the per-shape one on the same operands (ratio generic /
per-shape: above 1 means the generic kernel is slower).  Call times are the
median of alternating rounds (``ROUNDS``); the machine is shared, so expect
a few percent of noise, more with threads on a loaded machine
(``SPARSE_MLIR_NUM_THREADS=1`` compares the code alone).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.compiler import driver
from sparse_mlir.runtime.library import NativeFunction
from sparse_mlir.runtime.operands import dense_output, prepare
from sparse_mlir.timing import median_seconds

SPMM = "C[i,j] = A[i,k] * B[k,j]"
ROUNDS = 7  # alternating timing rounds per kernel (median reported)
NEW_SIZES = [(100, 64), (104, 64), (256, 120), (1000, 64)]  # A's sizes not seen before (multiples of 4)


def _bsr(rng: np.random.Generator, rows: int, cols: int, density: float) -> sm.SparseTensor:
    """A ``rows x cols`` BSR 4x4 matrix with ``density`` of its blocks stored (dense blocks)."""
    mask = sp.random(rows // 4, cols // 4, density, "csr", np.float32, random_state=rng).toarray() != 0
    dense = np.kron(mask, np.ones((4, 4), np.float32)) * rng.random((rows, cols), dtype=np.float32)
    return sm.SparseTensor.from_dense(dense.astype(np.float32), "bsr4x4")


def _nm(rng: np.random.Generator, rows: int, cols: int) -> sm.SparseTensor:
    """A 2:4 matrix: the first two of every four columns kept."""
    dense = rng.random((rows, cols), dtype=np.float32)
    dense.reshape(rows, cols // 4, 4)[:, :, 2:] = 0
    return sm.SparseTensor.from_dense(dense, "2:4")


def _csr(rng: np.random.Generator, rows: int, cols: int, density: float) -> sm.SparseTensor:
    return sm.SparseTensor.from_scipy(sp.random(rows, cols, density, "csr", np.float32, random_state=rng))


# (name, expression, formats, operands(rng, rows, cols) with A (or W) of that size) for the shape-generic part;
# the steady-state size is the first row of each
GENERIC = [
    ("CSR SpMV", "y[i] = A[i,j] * x[j]", {"A": "csr"}, (16384, 16384),
     lambda rng, m, k: {"A": _csr(rng, m, k, 0.01), "x": rng.random(k, dtype=np.float32)}),
    ("CSR SpMM N=64", SPMM, {"A": "csr"}, (4096, 4096),
     lambda rng, m, k: {"A": _csr(rng, m, k, 0.01), "B": rng.random((k, 64), dtype=np.float32)}),
    ("2:4 SpMM N=64", SPMM, {"A": "2:4"}, (2048, 2048),
     lambda rng, m, k: {"A": _nm(rng, m, k), "B": rng.random((k, 64), dtype=np.float32)}),
    ("BSR 4x4 SpMM N=64", SPMM, {"A": "bsr4x4"}, (4096, 4096),
     lambda rng, m, k: {"A": _bsr(rng, m, k, 0.01), "B": rng.random((k, 64), dtype=np.float32)}),
    ("Linear CSR batch 128", "Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "csr"}, (1536, 384),
     lambda rng, m, k: {"X": rng.random((128, k), dtype=np.float32), "W": _csr(rng, m, k, 0.1),
                        "bias": rng.random(m, dtype=np.float32)}),
]


def _native_call(kernel, native: NativeFunction, operands: dict) -> tuple:
    """What a kernel call hands its native function: prepared operands and an output (for a like-for-like timing)."""
    spec = kernel.spec
    args = prepare(spec.expression, tuple((n, spec.formats.get(n), spec.ranks[n]) for n in spec.inputs), operands,
                   spec.dtype, "cpu")
    sizes = {idx: args[n].shape[d] for n in spec.inputs for d, idx in enumerate(spec.operand_index(n))}
    out_shape = tuple(sizes[i] for i in spec.output_indices)
    return args, dense_output(spec.output, None, out_shape, spec.dtype, args), out_shape


def shape_generic(rng: np.random.Generator) -> None:
    """Per kernel: a new size's cost with one build per shape vs the generic kernel's first call at it, then the
    steady-state call time, generic / per-shape."""
    print("shape-generic kernels (medians; per-shape = one build per sparse shape, the old path):")
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    for name, expression, formats, size, make in GENERIC:
        if only not in name:
            continue
        kernel = sm.compile(expression, formats=formats, dtype="float32")
        assert kernel.shape_generic
        operands = make(rng, *size)
        kernel(**operands)  # the one compile of the generic kernel
        per_shape_compiles, first_calls = [], []
        for m, k in NEW_SIZES:
            new = make(rng, m, k)
            start = time.perf_counter()
            kernel(**new)
            first_calls.append(time.perf_counter() - start)
            extents = {idx: np.shape(new[n])[d] for n in kernel.spec.inputs
                       for d, idx in enumerate(kernel.spec.operand_index(n))}
            start = time.perf_counter()
            driver.build(kernel.spec, {n: new[n].format for n in kernel.spec.formats if n in new},
                         kernel.spec.specialized_shapes(extents), kernel.options, "sparse_mlir_kernel")
            per_shape_compiles.append(time.perf_counter() - start)
        sparse = {n: operands[n].format for n in kernel.spec.formats if n in operands}
        extents = {idx: np.shape(operands[n])[d] for n in kernel.spec.inputs
                   for d, idx in enumerate(kernel.spec.operand_index(n))}
        fixed_artifact = driver.build(kernel.spec, sparse, kernel.spec.specialized_shapes(extents), kernel.options,
                                      "sparse_mlir_kernel")
        fixed = NativeFunction(fixed_artifact.path, fixed_artifact.signature, threaded=bool(kernel.options.openmp))
        generic = kernel.specializations[0].native
        args, out, out_shape = _native_call(kernel, generic, operands)
        expected = fixed(args, out.copy(), out_shape)
        np.testing.assert_allclose(generic(args, out, out_shape), expected, rtol=1e-5, atol=1e-5)
        times = {"generic": [], "per-shape": []}
        pair = [("generic", generic), ("per-shape", fixed)]
        for r in range(ROUNDS):  # alternating, each first in turn, so drift on the shared machine hits both alike
            for label, native in pair if r % 2 else pair[::-1]:
                call = functools.partial(native, args, out, out_shape)
                times[label].append(median_seconds(call, repeats=5))
        g, f = np.median(times["generic"]), np.median(times["per-shape"])
        print(f"  {name} at {size[0]}x{size[1]}: new size {np.median(per_shape_compiles) * 1e3:.0f} ms per-shape "
              f"(compile) vs {np.median(first_calls) * 1e3:.2f} ms generic (first call, no compile); "
              f"steady state {g * 1e3:.3f} ms generic vs {f * 1e3:.3f} ms per-shape: ratio {g / f:.3f} "
              f"(>1: generic slower)")


def main() -> None:
    # a private cache (read at use time), inherited by the second process: every compile below is a fresh one
    os.environ["SPARSE_MLIR_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparse_mlir_bench_")
    if "--generic" in sys.argv:
        shape_generic(np.random.default_rng(0))
        return
    kernel = sm.compile(SPMM, formats={"A": sm.CSR}, dtype="float32")
    B = np.ones((64, 8), np.float32)
    start = time.perf_counter()
    kernel(A=sm.SparseTensor.from_scipy(sp.random(99, 64, 0.1, "csr", np.float32, random_state=0)), B=B)
    first = time.perf_counter() - start
    new_sizes = []
    for rows in range(100, 107):  # a CSR SpMM is shape-generic: a new sparse shape is no new compile
        A = sm.SparseTensor.from_scipy(sp.random(rows, 64, 0.1, "csr", np.float32, random_state=0))
        start = time.perf_counter()
        kernel(A=A, B=B)
        new_sizes.append(time.perf_counter() - start)
    sparsified = sm.compile(SPMM, formats={"A": sm.CSC}, dtype="float32")  # no CSC emitter: one build per shape
    compiles = []
    for rows in range(100, 107):
        A = sm.SparseTensor.from_scipy(sp.random(rows, 64, 0.1, "csc", np.float32, random_state=0))
        start = time.perf_counter()
        sparsified(A=A, B=B)
        compiles.append(time.perf_counter() - start)
    tiny = sm.SparseTensor.from_scipy(sp.random(4, 4, 0.5, "csr", np.float32, random_state=0))
    small_b = np.ones((4, 2), np.float32)
    kernel(A=tiny, B=small_b)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20_000):
            kernel(A=tiny, B=small_b)
        best = min(best, (time.perf_counter() - start) / 20_000)
    script = textwrap.dedent(f"""
        import time, numpy as np, scipy.sparse as sp, sparse_mlir as sm
        A = sm.SparseTensor.from_scipy(sp.random(100, 64, 0.1, "csr", np.float32, random_state=0))
        B = np.ones((64, 8), np.float32)
        start = time.perf_counter()
        sm.compile({SPMM!r}, formats={{"A": sm.CSR}}, dtype="float32")(A=A, B=B)
        print((time.perf_counter() - start) * 1e3)
    """)
    cached = float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                  check=True).stdout.strip())
    print(f"first compile (starts the compiler process): {first * 1e3:.0f} ms")
    print(f"CSR SpMM (shape-generic), first call at a new sparse shape: median {np.median(new_sizes) * 1e3:.2f} ms")
    print(f"CSC SpMM (sparsifier), compile per new sparse shape: median {np.median(compiles) * 1e3:.0f} ms, "
          f"min {min(compiles) * 1e3:.0f}, max {max(compiles) * 1e3:.0f}")
    print(f"per-call overhead, 4x4 CSR SpMM with a SparseTensor: {best * 1e6:.1f} us")
    print(f"new process, compile() + first call from the disk cache: {cached:.1f} ms")
    shape_generic(np.random.default_rng(0))


if __name__ == "__main__":
    main()
