"""Issue 19's targets for sparse_mlir.dask, measured on LocalClusters of 1-thread worker processes.

    python benchmarks/dask_scaling.py            # n = 115: the 10.6M-nonzero Poisson matrix
    python benchmarks/dask_scaling.py --n 60 --quick

1. SpMV on the Poisson matrix, steady state (matrix and vector already on the
   workers, the result left there): 1 worker against 2; target >= 1.6x.
2. CG on the Poisson matrix to 1e-8 on 2 workers against scipy's ``cg`` in
   this process: iterations, answer, times.
3. Overhead of one distributed SpMV call on a 1M-nonzero Poisson matrix (2
   workers, result left on the workers; and gathered to the client) against
   the same serial kernel called in this process; target <= 3x.

Every figure is a median of repeated calls after a warm-up; each ratio is
printed with the direction that is better.  Kernels are exported here and
shipped to the workers (serial code, like one thread per worker).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np
import scipy.sparse.linalg as sla

import sparse_mlir as sm
from sparse_mlir.dask import RowShardedMatrix, cg, poisson3d
from sparse_mlir.timing import median_seconds


def cluster(workers: int):
    from distributed import LocalCluster

    return LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                        dashboard_address="127.0.0.1:0")


def steady_spmv(matrix, workers: int, blocks: int, repeat: int) -> float:
    """Median seconds of ``A @ x`` with A and x persisted on ``workers`` workers and y left there."""
    import dask.array as da
    from distributed import Client, wait

    with cluster(workers) as c, Client(c):
        a = RowShardedMatrix.from_scipy(matrix, -(-matrix.shape[0] // blocks)).persist()
        x = da.from_array(np.random.default_rng(0).normal(size=matrix.shape[1]),
                          chunks=(a.layout.row_chunks,)).persist()
        wait([a.blocks, x])

        def call() -> None:
            wait((a @ x).persist())

        return median_seconds(call, repeat, warmup=2)


def single_kernel(matrix, repeat: int) -> float:
    """Median seconds of the serial SpMV kernel on the whole matrix in this process."""
    spmv = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}, dtype="float64")
    tensor = sm.SparseTensor.from_scipy(matrix)
    x = np.random.default_rng(0).normal(size=matrix.shape[1])
    return median_seconds(lambda: spmv(A=tensor, x=x), repeat, warmup=2)


def call_overhead(matrix, repeat: int) -> tuple[float, float]:
    """Median seconds of one distributed SpMV on 2 workers: result left there, and gathered here."""
    import dask.array as da
    from distributed import Client, wait

    with cluster(2) as c, Client(c):
        a = RowShardedMatrix.from_scipy(matrix, -(-matrix.shape[0] // 2)).persist()
        x = da.from_array(np.random.default_rng(0).normal(size=matrix.shape[1]),
                          chunks=(a.layout.row_chunks,)).persist()
        wait([a.blocks, x])
        persisted = median_seconds(lambda: wait((a @ x).persist()), repeat, warmup=2)
        gathered = median_seconds(lambda: (a @ x).compute(), repeat, warmup=2)
    return persisted, gathered


def cg_against_scipy(matrix, rtol: float) -> None:
    from distributed import Client

    b = np.random.default_rng(1).normal(size=matrix.shape[0])
    count = [0]
    start = time.perf_counter()
    reference, _ = sla.cg(matrix, b, rtol=rtol, callback=lambda _: count.__setitem__(0, count[0] + 1))
    scipy_seconds = time.perf_counter() - start
    with cluster(2) as c, Client(c):
        a = RowShardedMatrix.from_scipy(matrix, -(-matrix.shape[0] // 2)).persist()
        cg(a, b, maxiter=1)  # warm-up: exports, worker start
        result = cg(a, b, rtol=rtol)
    residual = np.linalg.norm(b - matrix @ result.x) / np.linalg.norm(b)
    difference = np.linalg.norm(result.x - reference) / np.linalg.norm(reference)
    print(f"  dask cg (2 workers): {result.iterations} iterations, {result.seconds:.2f} s "
          f"({1e3 * result.seconds / max(result.iterations, 1):.1f} ms/iteration), residual {residual:.2e}")
    print(f"  scipy cg (1 process): {count[0]} iterations, {scipy_seconds:.2f} s "
          f"({1e3 * scipy_seconds / max(count[0], 1):.1f} ms/iteration)")
    print(f"  same iterations: {result.iterations == count[0]}; ||x - x_scipy|| / ||x_scipy|| = {difference:.2e} "
          f"(target <= 1e-8: {difference <= 1e-8}); time ratio dask/scipy = "
          f"{result.seconds / scipy_seconds:.2f}x (lower is better)")


def main() -> None:
    os.environ.setdefault("SPARSE_MLIR_NUM_THREADS", "1")  # the in-process kernel: one thread, like one worker
    # from_scipy puts the row blocks in the graph on purpose (a block lost with its worker is rebuilt from it):
    # distributed's advice to scatter large graphs does not apply
    warnings.filterwarnings("ignore", message="Sending large graph", category=UserWarning)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=115, help="Poisson grid for items 1-2 (115: 10.6M nonzeros)")
    parser.add_argument("--overhead-n", type=int, default=53, help="Poisson grid for item 3 (53: 1.0M nonzeros)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, skip CG")
    args = parser.parse_args()
    repeat = 5 if args.quick else args.repeat
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")

    big = poisson3d(args.n)
    print(f"1. steady-state SpMV, Poisson {args.n}^3 ({big.nnz / 1e6:.1f}M nonzeros), 4 row blocks")
    one = steady_spmv(big, 1, 4, repeat)
    two = steady_spmv(big, 2, 4, repeat)
    local = single_kernel(big, repeat)
    print(f"  1 worker {1e3 * one:.1f} ms, 2 workers {1e3 * two:.1f} ms, in-process serial kernel {1e3 * local:.1f} ms")
    print(f"  speedup 2 vs 1 worker = {one / two:.2f}x (higher is better; target >= 1.6x: {one / two >= 1.6})")

    if not args.quick:
        print(f"2. CG to 1e-8 on Poisson {args.n}^3")
        cg_against_scipy(big, 1e-8)

    small = poisson3d(args.overhead_n)
    print(f"3. per-call overhead, Poisson {args.overhead_n}^3 ({small.nnz / 1e6:.2f}M nonzeros), 2 workers")
    kernel = single_kernel(small, repeat)
    persisted, gathered = call_overhead(small, repeat)
    print(f"  in-process kernel {1e3 * kernel:.2f} ms; distributed call {1e3 * persisted:.2f} ms (result on the "
          f"workers), {1e3 * gathered:.2f} ms (gathered)")
    print(f"  distributed / in-process = {persisted / kernel:.2f}x (lower is better; target <= 3x: "
          f"{persisted / kernel <= 3}); gathered: {gathered / kernel:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
