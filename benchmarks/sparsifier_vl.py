"""Does the sparsifier's own vectorization (``vl``) pay, per kernel family, on this host?

    python benchmarks/sparsifier_vl.py [--vl 0 8 16] [--rounds 2]

Kernels the hand-scheduled emitters do not build go through the sparsifier,
which ``lowering/sparsify.py`` runs with ``vl=0`` (scalar loops, which LLVM
may still vectorize).  This times each family with ``vl`` set to each value
asked for: every value runs in a child process of its own (a private cache,
compiled in process with the pipeline's ``vl`` replaced), the children
alternate, ``--rounds`` times, and each figure is the median over rounds of
the median of 15 calls, on one thread.  Ratios are ``vl=0`` time over the
other's (above 1: the vectorized build is faster).  Families: COO, DCSR and
CSC SpMV, the CSR row sum, and the elementwise product of a CSR matrix and a
dense one into a CSR result, on SuiteSparse bcsstk13 and a random 200000^2
matrix with 20 entries per row (the elementwise product on bcsstk13 only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

MATRIX = Path(__file__).resolve().parents[2] / "shared" / "data" / "suitesparse" / "bcsstk13.mtx.gz"


def _child(vl: int) -> dict[str, float]:
    """The times of every family with ``vl`` (runs in a child process: it patches the pipeline)."""
    import scipy.sparse as sp
    from sparse_mlir.lowering import sparsify

    import sparse_mlir as sm
    from sparse_mlir.io.matrix_files import read_matrix
    from sparse_mlir.timing import median_seconds

    scalar = sparsify.sparsify_pipeline
    sparsify.sparsify_pipeline = lambda parallel: scalar(parallel).replace("vl=0", f"vl={vl}")
    rng = np.random.default_rng(0)
    matrices = {"bcsstk13": sp.csr_array(read_matrix(MATRIX)),
                "random 200000^2": sp.random(200_000, 200_000, density=20 / 200_000, format="csr",
                                             random_state=rng)}
    spmv = "y[i] = A[i,k] * x[k]"
    times = {}
    for label, matrix in matrices.items():
        x = rng.random(matrix.shape[1])
        cases = [(f"{fmt} SpMV", spmv, fmt, {"x": x}) for fmt in ("coo", "dcsr", "csc")]
        cases.append(("CSR row sum", "y[i] = A[i,k]", "csr", {}))
        if matrix.shape[0] * matrix.shape[1] < 1e8:
            cases.append(("CSR .* dense -> CSR", "C[i,j] = A[i,j] * B[i,j]", "csr", {"B": rng.random(matrix.shape)}))
        for name, expression, fmt, dense in cases:
            formats = {"A": fmt, "C": "csr"} if "C[" in expression else {"A": fmt}
            kernel = sm.compile(expression, formats=formats, dtype="float64")
            operands = {"A": sm.SparseTensor.from_scipy(matrix, fmt), **dense}
            kernel(**operands)
            times[f"{label}: {name}"] = median_seconds(lambda k=kernel, o=operands: k(**o), 15)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vl", type=int, nargs="+", default=[0, 8, 16], help="vector lengths to compare")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of every vl (median reported)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args.child)))
        return
    if 0 not in args.vl:
        args.vl = [0, *args.vl]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    width = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    runs: dict[int, list[dict[str, float]]] = {vl: [] for vl in args.vl}
    for _ in range(args.rounds):
        for vl in args.vl:
            env = {**os.environ, "SPARSE_MLIR_COMPILE_IN_PROCESS": "1", "SPARSE_MLIR_NUM_THREADS": "1",
                   "SPARSE_MLIR_CACHE_DIR": tempfile.mkdtemp(prefix="sparsifier_vl_")}
            done = subprocess.run([sys.executable, __file__, "--child", str(vl)], capture_output=True, text=True,
                                  env=env, check=True)
            runs[vl].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"host: {width}, {os.cpu_count()} cores; one thread; medians over {args.rounds} rounds; ratio = vl=0 time / "
          f"vl=N time (above 1: vectorized faster)")
    for name in runs[0][0]:
        base = float(np.median([r[name] for r in runs[0]]))
        cells = [f"vl=0 {base * 1e6:.0f} us"]
        for vl in args.vl[1:]:
            t = float(np.median([r[name] for r in runs[vl]]))
            cells.append(f"vl={vl} {t * 1e6:.0f} us ({base / t:.2f}x)")
        print(f"{name:<40} " + "  ".join(cells))


if __name__ == "__main__":
    main()
