"""Conjugate gradients on Dask workers with sparse_mlir kernels, checked against scipy's ``cg``.

    python examples/dask_cg.py                 # bcsstk13 (scaled to unit diagonal) + a 40^3 Poisson matrix
    python examples/dask_cg.py --large         # the Poisson matrix at 115^3 (10.6M nonzeros)

A LocalCluster of worker processes (one thread each) holds the row blocks of
the matrix; every CG step runs the SpMV on the workers with kernels compiled
once here and shipped to them (the workers never load MLIR), the dot products
are Dask tree reductions, and only scalars and the answer come back.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from sparse_mlir.dask import RowShardedMatrix, cg, poisson3d
from sparse_mlir.io.matrix_files import read_mtx

SUITESPARSE = Path(__file__).resolve().parents[2] / "shared" / "data" / "suitesparse" / "bcsstk13.mtx.gz"


def unit_diagonal(matrix: sp.csr_matrix) -> sp.csr_matrix:
    """``D^-1/2 A D^-1/2``: still SPD, and plain CG converges on bcsstk13 (it stalls on the raw matrix)."""
    d = sp.diags(1 / np.sqrt(matrix.diagonal()))
    return (d @ matrix @ d).tocsr()


def scipy_cg(matrix: sp.csr_matrix, b: np.ndarray, rtol: float) -> tuple[np.ndarray, int, float]:
    """scipy's answer, its iteration count and its time."""
    count = [0]
    start = time.perf_counter()
    x, _ = sla.cg(matrix, b, rtol=rtol, maxiter=10 * matrix.shape[0],
                  callback=lambda _: count.__setitem__(0, count[0] + 1))
    return x, count[0], time.perf_counter() - start


def solve(name: str, matrix: sp.csr_matrix, blocks: int, rtol: float) -> None:
    """Solve ``A x = b`` (b: seeded normal) on the workers and with scipy; print both."""
    b = np.random.default_rng(0).normal(size=matrix.shape[0])
    a = RowShardedMatrix.from_scipy(matrix, -(-matrix.shape[0] // blocks)).persist()
    cg(a, b, maxiter=1)  # exports the kernels and warms the workers up
    result = cg(a, b, rtol=rtol)
    reference, iterations, seconds = scipy_cg(matrix, b, rtol)
    difference = np.linalg.norm(result.x - reference) / np.linalg.norm(reference)
    residual = np.linalg.norm(b - matrix @ result.x) / np.linalg.norm(b)
    print(f"{name}: {matrix.shape[0]} rows, {matrix.nnz} nonzeros, {blocks} row blocks")
    print(f"  dask cg : {result.iterations} iterations, {result.seconds:.2f} s, relative residual {residual:.2e}")
    print(f"  scipy cg: {iterations} iterations, {seconds:.2f} s")
    print(f"  ||x - x_scipy|| / ||x_scipy|| = {difference:.2e}")


def main() -> None:
    # from_scipy puts the row blocks in the graph on purpose (a block lost with its worker is rebuilt from it):
    # distributed's advice to scatter large graphs does not apply
    warnings.filterwarnings("ignore", message="Sending large graph", category=UserWarning)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n", type=int, default=40, help="Poisson grid size n (n^3 unknowns)")
    parser.add_argument("--large", action="store_true", help="n = 115: 1.52M unknowns, 10.6M nonzeros")
    parser.add_argument("--rtol", type=float, default=1e-8)
    args = parser.parse_args()
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster):
        if SUITESPARSE.exists():
            solve("bcsstk13 (unit diagonal)", unit_diagonal(read_mtx(SUITESPARSE)), args.workers, args.rtol)
        else:
            print(f"{SUITESPARSE} not found: skipping the SuiteSparse matrix")
        n = 115 if args.large else args.n
        solve(f"Poisson {n}^3", poisson3d(n), 2 * args.workers, args.rtol)


if __name__ == "__main__":
    main()
