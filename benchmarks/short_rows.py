"""CSR SpMV on short rows (METIS mdual, about 4 nonzeros a row) and long ones, the fixed cost of a call, and where
threads start to pay.

``python benchmarks/short_rows.py [--rounds 7 --repeats 5]``, three parts, each in alternating rounds (medians;
the machine is shared, so drift hits all alike):

1. SpMV ``y = A @ x`` (float64) on mdual (``/usr/share/doc/libmetis-dev/examples/graphs/mdual.graph``, from
   Debian's ``libmetis-doc``; said when missing), the short-row SuiteSparse matrices (west0479, cryg2500), the
   long-row bcsstk13 and DLMC transformer patterns (0.9 magnitude pruning) as matrices: ours at the configured
   thread count and at one thread, scipy, torch CSR (``torch.mv``) and MKL (``sparse_dot_mkl``), each library
   named when it does not load.  Ratios are their time over ours: above 1, ours is faster.
2. The fixed cost of a call: a 4x4 SpMV, ours (a prebuilt ``SparseTensor``) and scipy's ``A @ x``.
3. Threads against one thread on short-row matrices of 8k to 512k stored entries (the runtime's
   ``threads.for_work`` runs calls under ``SERIAL_BELOW`` entries on one thread): ratio 1 thread / threaded,
   above 1: threads pay.  The pool's spin time is the runtime's (``BLOCKTIME_MS``) unless ``KMP_BLOCKTIME``
   is set.
4. The same while the pool sleeps, so a fork waits for the workers to wake (below ``COLD_SERIAL_BELOW`` entries
   ``for_work`` then runs the call on one thread): each call after a pause longer than the blocktime, and back to
   back with a blocktime of 0; SpMV with 8 a row and SpMM (N=128, 10% dense): 1 thread, the configured count and
   the runtime's own choice (``auto``), ratio 1 thread / threaded.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from efficiency_gap import read_metis
from spgemm import round_robin

import sparse_mlir as sm
import sparse_mlir.data
from sparse_mlir.io.matrix_files import read_matrix, read_smtx
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime import threads

EXPRESSION = "y[i] = A[i,j] * x[j]"
MDUAL = Path("/usr/share/doc/libmetis-dev/examples/graphs/mdual.graph")


def host() -> str:
    """The CPU model, cores, vector width the kernels are built for, and the load now."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    return (f"{model}, {os.cpu_count()} cores, {'AVX-512' if ' avx512f' in flags else 'AVX2'}; "
            f"{knobs.num_threads()} threads configured; load average {os.getloadavg()[0]:.1f}; "
            f"KMP_BLOCKTIME {os.environ.get('KMP_BLOCKTIME', f'unset (runtime: {threads.BLOCKTIME_MS} ms)')}")


def matrices() -> dict[str, sp.csr_matrix]:
    found: dict[str, sp.csr_matrix] = {}
    if MDUAL.is_file():
        found["mdual"] = read_metis(MDUAL)
    else:
        print(f"mdual is missing ({MDUAL}: apt-get install libmetis-doc, or the file from its package)")
    suite = knobs.data_dir() / "suitesparse"
    found["west0479"] = read_matrix(Path(sparse_mlir.data.__file__).parent / "west0479.mtx.gz")
    for name in ("cryg2500", "bcsstk13"):
        if (suite / f"{name}.mtx.gz").is_file():
            found[name] = read_matrix(suite / f"{name}.mtx.gz")
    dlmc = sorted((knobs.data_dir() / "dlmc" / "transformer" / "magnitude_pruning" / "0.9").glob("*.smtx.gz"))
    for path in dlmc[:3]:
        found[f"dlmc {path.name.removesuffix('.smtx.gz')}"] = read_smtx(path)
    return {name: _canonical(m) for name, m in found.items()}


def _canonical(m) -> sp.csr_matrix:
    m = sp.csr_matrix(m, dtype=np.float64)
    m.sum_duplicates()
    m.sort_indices()
    return m


def libraries(a: sp.csr_matrix, x: np.ndarray) -> dict[str, Callable[[], object]]:
    """scipy, torch CSR and MKL, each when it loads (a missing one is said)."""
    found: dict[str, Callable[[], object]] = {"scipy": functools.partial(a.dot, x)}
    try:
        import torch

        warnings.filterwarnings("ignore", message="Sparse (CSR tensor support|invariant checks)")
        t = torch.sparse_csr_tensor(torch.from_numpy(a.indptr.astype(np.int32)),
                                    torch.from_numpy(a.indices.astype(np.int32)), torch.from_numpy(a.data), a.shape)
        found["torch"] = functools.partial(torch.mv, t, torch.from_numpy(x))
    except ImportError as exc:
        print(f"torch did not load ({exc}): no torch column")
    try:
        from sparse_dot_mkl import dot_product_mkl

        found["mkl"] = functools.partial(dot_product_mkl, a, x)
    except ImportError as exc:
        print(f"sparse_dot_mkl did not load ({exc}): no MKL column")
    return found


def spmv_table(rounds: int, repeats: int) -> None:
    kernel = sm.compile(EXPRESSION, formats={"A": "csr"}, dtype="float64")
    print("SpMV, float64: medians (us); ratio = theirs / ours (above 1: ours faster)")
    for name, a in matrices().items():
        x = np.random.default_rng(1).standard_normal(a.shape[1])
        tensor = sm.SparseTensor.from_scipy(a)
        y = np.empty(a.shape[0])
        ours = functools.partial(kernel, A=tensor, x=x, out=y)
        ours()
        if not np.allclose(y, a @ x, rtol=1e-10, atol=1e-10 * np.abs(a).max()):
            raise SystemExit(f"{name}: the result differs from scipy's")

        def serial(ours: Callable[[], object] = ours) -> object:
            with threads.fixed(1):
                return ours()

        row = round_robin({"ours": ours, "ours 1 thread": serial, **libraries(a, x)}, rounds, repeats)
        theirs = [col for col in ("scipy", "torch", "mkl") if col in row]
        best = min(theirs, key=row.__getitem__)
        print(f"{name} ({a.shape[0]} rows, {a.nnz / max(a.shape[0], 1):.1f} per row): "
              + "  ".join(f"{col} {row[col] * 1e6:.1f}" for col in row))
        for base in ("ours", "ours 1 thread"):
            print(f"    best library ({best}) / {base} {row[best] / row[base]:.2f}  "
                  + "  ".join(f"{col}/{base} {row[col] / row[base]:.2f}" for col in theirs))


def call_cost(rounds: int, repeats: int) -> None:
    kernel = sm.compile(EXPRESSION, formats={"A": "csr"}, dtype="float64")
    a = sp.csr_matrix(np.eye(4))
    tensor, x, y = sm.SparseTensor.from_scipy(a), np.ones(4), np.empty(4)
    row = round_robin({"ours": functools.partial(kernel, A=tensor, x=x, out=y),
                       "scipy": functools.partial(a.dot, x)}, rounds, max(repeats, 101))
    print(f"fixed cost of a call, 4x4 SpMV: ours {row['ours'] * 1e6:.1f} us, scipy {row['scipy'] * 1e6:.1f} us "
          f"(scipy / ours {row['scipy'] / row['ours']:.2f})")


def thread_threshold(rounds: int, repeats: int) -> None:
    kernel = sm.compile(EXPRESSION, formats={"A": "csr"}, dtype="float64")
    rng = np.random.default_rng(0)
    count = knobs.num_threads()
    print(f"threads ({count}) against 1 on short rows; for_work runs calls under SERIAL_BELOW = "
          f"{threads.SERIAL_BELOW} entries (values + x) on 1 thread; ratio 1 thread / {count} (above 1: threads pay)")
    for per_row in (4, 32):
        for nnz in (8192, 16384, 32768, 65536, 131072, 262144, 524288):
            n = nnz // per_row
            columns = np.sort(rng.integers(0, n, size=(n, per_row)), axis=1).ravel().astype(np.int32)
            a = sp.csr_matrix((rng.standard_normal(nnz), columns, np.arange(0, nnz + 1, per_row)), shape=(n, n))
            tensor, x, y = sm.SparseTensor.from_scipy(a), rng.standard_normal(n), np.empty(n)

            def at(t: int, tensor=tensor, x=x, y=y) -> object:
                with threads.fixed(t):
                    return kernel(A=tensor, x=x, out=y)

            row = round_robin({"1": functools.partial(at, 1), "n": functools.partial(at, count)}, rounds, repeats)
            print(f"    {per_row} per row, {nnz + n} entries: 1 thread {row['1'] * 1e6:.1f} us, {count} threads "
                  f"{row['n'] * 1e6:.1f} us, ratio {row['1'] / row['n']:.2f}")


def _after_pause(call: Callable[[], object], pause: float, repeats: int) -> float:
    """Median seconds of ``call`` over ``repeats`` calls, each after ``pause`` seconds of sleep (0: none)."""
    samples = []
    for _ in range(repeats):
        if pause:
            time.sleep(pause)
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def cold_threshold(rounds: int, repeats: int) -> None:
    """Part 4, in two regimes: each call after a pause longer than the blocktime (the vCPUs may idle too), and
    back to back with a blocktime of 0 (workers asleep at once, as under the efficiency-gap benchmark's
    ``KMP_BLOCKTIME=0``)."""
    count = knobs.num_threads()
    pause = threads.blocktime_seconds() + 0.002
    rng = np.random.default_rng(1)
    spmv = sm.compile(EXPRESSION, formats={"A": "csr"}, dtype="float32")
    spmm = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32")
    cases = [("SpMV 8 a row", spmv, "x", lambda n: rng.standard_normal(n).astype(np.float32),
              lambda n: sp.random(n, n, 8 / n, "csr", np.float32, rng), n) for n in (8000, 16000, 24000, 32000)]
    cases += [("SpMM N=128 10%", spmm, "B", lambda n: rng.standard_normal((n, 128)).astype(np.float32),
               lambda n: sp.random(n, n, 0.1, "csr", np.float32, rng), n) for n in (384, 512, 768, 1024)]
    regimes = [(f"after a {pause * 1e3:.0f} ms pause", pause, None)] if math.isfinite(pause) else []
    regimes.append(("back to back, blocktime 0", 0.0, 0))
    for title, wait, blocktime in regimes:
        print(f"threads ({count}) against 1, {title} (the workers asleep); for_work runs such calls under "
              f"COLD_SERIAL_BELOW = {threads.COLD_SERIAL_BELOW} entries on 1 thread; ratio 1 thread / {count} "
              f"(above 1: threads pay)")
        for label, kernel, name, dense_of, sparse_of, n in cases:
            dense, a = dense_of(n), sparse_of(n)
            tensor = sm.SparseTensor.from_scipy(a)
            out = kernel(A=tensor, **{name: dense})

            def at(t: int | None, kernel=kernel, name=name, dense=dense, tensor=tensor, out=out) -> object:
                with threads.blocktime(blocktime) if blocktime is not None else contextlib.nullcontext():
                    if t is None:
                        return kernel(A=tensor, out=out, **{name: dense})
                    with threads.fixed(t):
                        return kernel(A=tensor, out=out, **{name: dense})

            times: dict[str, list[float]] = {"1": [], "n": [], "auto": []}
            for r in range(rounds):
                for key, t in (("1", 1), ("n", count), ("auto", None))[::1 if r % 2 else -1]:
                    times[key].append(_after_pause(functools.partial(at, t), wait, repeats))
            row = {key: float(np.median(v)) for key, v in times.items()}
            print(f"    {label}, {a.nnz + dense.size} entries: 1 thread {row['1'] * 1e6:.1f} us, {count} threads "
                  f"{row['n'] * 1e6:.1f} us, auto {row['auto'] * 1e6:.1f} us, ratio {row['1'] / row['n']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (median reported)")
    parser.add_argument("--repeats", type=int, default=5, help="calls per round (median)")
    parser.add_argument("--part", choices=("all", "spmv", "call", "threads", "cold"), default="all")
    args = parser.parse_args()
    print(host())
    if args.part in ("all", "spmv"):
        spmv_table(args.rounds, args.repeats)
    if args.part in ("all", "call"):
        call_cost(args.rounds, args.repeats)
    if args.part in ("all", "threads"):
        thread_threshold(args.rounds, args.repeats)
    if args.part in ("all", "cold"):
        cold_threshold(args.rounds, args.repeats)


if __name__ == "__main__":
    main()
