"""Compile time, per-call overhead and cached-load time of a CSR SpMM kernel (the core issue's figures).

    python benchmarks/compile_and_call.py

Compiles fresh specializations into a private cache (the compiler process is
started first, so its start-up is reported apart), times a tiny call with a
``SparseTensor`` operand, and times a second process that loads the cached
kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import scipy.sparse as sp

import sparse_mlir as sm

SPMM = "C[i,j] = A[i,k] * B[k,j]"


def main() -> None:
    # a private cache (read at use time), inherited by the second process: every compile below is a fresh one
    os.environ["SPARSE_MLIR_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparse_mlir_bench_")
    kernel = sm.compile(SPMM, formats={"A": sm.CSR}, dtype="float32")
    B = np.ones((64, 8), np.float32)
    start = time.perf_counter()
    kernel(A=sm.SparseTensor.from_scipy(sp.random(99, 64, 0.1, "csr", np.float32, random_state=0)), B=B)
    first = time.perf_counter() - start
    compiles = []
    for rows in range(100, 107):  # each new sparse shape is a new specialization
        A = sm.SparseTensor.from_scipy(sp.random(rows, 64, 0.1, "csr", np.float32, random_state=0))
        start = time.perf_counter()
        kernel(A=A, B=B)
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
    print(f"compile per specialization: median {np.median(compiles) * 1e3:.0f} ms, "
          f"min {min(compiles) * 1e3:.0f}, max {max(compiles) * 1e3:.0f}")
    print(f"per-call overhead, 4x4 CSR SpMM with a SparseTensor: {best * 1e6:.1f} us")
    print(f"new process, compile() + first call from the disk cache: {cached:.1f} ms")


if __name__ == "__main__":
    main()
