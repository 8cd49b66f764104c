"""Sparse add ``C[i,j] = A[i,j] + B[i,j]``, CSR + CSR -> CSR: random matrices and SuiteSparse ``A + A^T``.

``python benchmarks/sparse_add.py [--rounds 5 --repeats 3]``: per case, every system in alternating rounds
(medians; the machine is shared, so drift hits all alike).  In this process: ours (the hand-scheduled kernel,
``dialects/native/sparse_add.py``) at the configured thread count and at one thread, scipy's ``A + B``
(serial; its result is canonical, as ours is) and ``torch`` CSR + CSR when it loads.  Our previous path, the
sparsifier's kernel for the same expression and formats, is timed in a child process (``--sparsifier``) that
drops the sparse-add row from the CPU emitter table and compiles into a private cache, alternating with scipy
there; its ratio to ours goes through scipy's time in both processes.  Ratios are their time over ours: above
1, ours is faster.  Every result is checked against scipy's before it is timed (scipy drops sums that cancel
to zero, ours keeps them: the random values here never cancel).
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import warnings
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp
import sparsifier_child  # benchmarks/: this script's folder, first on sys.path
from spgemm import round_robin

import sparse_mlir as sm
from sparse_mlir.io import read_matrix
from sparse_mlir.knobs import knobs

EXPRESSION = "C[i,j] = A[i,j] + B[i,j]"
FORMATS = {"A": "csr", "B": "csr", "C": "csr"}
SUITESPARSE_NAMES = ("bcsstk13", "cryg2500", "rajat01")


def _canonical(matrix, dtype=np.float64) -> sp.csr_array:
    a = sp.csr_array(matrix).astype(dtype)
    a.sum_duplicates()
    a.sort_indices()
    return a


def _random(n: int, density: float, seed: int) -> sp.coo_array:
    """An ``n x n`` matrix with about ``density`` of its entries stored at uniformly random places (scipy's
    ``sp.random`` draws from all ``n^2`` places, too much memory at these sizes)."""
    rng = np.random.default_rng(seed)
    count = int(n * n * density)
    return sp.coo_array((rng.standard_normal(count), (rng.integers(0, n, count), rng.integers(0, n, count))),
                        shape=(n, n))


def cases() -> dict[str, tuple[sp.csr_array, sp.csr_array]]:
    """``(A, B)`` by name: random pairs (the issue's 4096^2 at 1% first) and SuiteSparse ``A, A^T`` pairs."""
    found = {}
    for n, density, dtype in ((4096, 0.01, np.float64), (4096, 0.01, np.float32), (4096, 0.001, np.float64),
                              (16384, 0.001, np.float64), (100_000, 4e-5, np.float64)):
        name = f"random {n}^2 at {density:.2%}" + (", float32" if dtype == np.float32 else "")
        found[name] = tuple(_canonical(_random(n, density, seed), dtype) for seed in (1, 2))
    suite = knobs.data_dir() / "suitesparse"
    for name in SUITESPARSE_NAMES:
        if (suite / f"{name}.mtx.gz").is_file():
            a = _canonical(read_matrix(suite / f"{name}.mtx.gz"))
            found[f"{name} + transpose"] = (a, _canonical(a.T))
    return found


def _check(c: sp.csr_array, a: sp.csr_array, b: sp.csr_array, name: str) -> None:
    expected = a + b
    expected.sort_indices()
    if not (np.array_equal(c.indptr, expected.indptr) and np.array_equal(c.indices, expected.indices)
            and np.allclose(c.data, expected.data, rtol=1e-6, atol=0)):
        raise SystemExit(f"{name}: the result differs from scipy's")


def calls(a: sp.csr_array, b: sp.csr_array, kernel) -> dict[str, Callable[[], object]]:
    """Ours (threaded and one thread, checked first), scipy, and torch when it loads."""
    from sparse_mlir.runtime.threads import fixed

    ours = functools.partial(kernel, A=sm.SparseTensor.from_scipy(a), B=sm.SparseTensor.from_scipy(b))
    _check(ours().to_scipy(), a, b, "ours")

    def serial() -> object:
        with fixed(1):
            return ours()

    found = {"ours": ours, "ours 1 thread": serial, "scipy": functools.partial(operator.add, a, b)}
    try:
        import torch

        warnings.filterwarnings("ignore", message="Sparse (CSR tensor support|invariant checks)")

        def tensor(m: sp.csr_array):
            return torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)),
                                           torch.from_numpy(m.indices.astype(np.int64)), torch.from_numpy(m.data),
                                           m.shape)

        found["torch"] = functools.partial(operator.add, tensor(a), tensor(b))
    except ImportError:
        print("torch did not load: no torch column")
    return found


def sparsifier(rounds: int, repeats: int) -> dict[str, dict[str, float]]:
    """The sparsifier's kernel and scipy, alternating, timed in a child process (see the module docstring)."""
    return sparsifier_child.run(__file__, "sparse_add_sparsifier_cache_", rounds, repeats)


def _sparsifier_child(rounds: int, repeats: int) -> None:
    sparsifier_child.drop_emitter("sparse_add")
    out = {}
    for name, (a, b) in cases().items():
        kernel = sm.compile(EXPRESSION, formats=FORMATS, dtype=a.dtype)
        ta, tb = sm.SparseTensor.from_scipy(a), sm.SparseTensor.from_scipy(b)
        _check(kernel(A=ta, B=tb).to_scipy(), a, b, name)
        assert "linalg.generic" in kernel.ir["input"]  # the sparsifier built it
        out[name] = round_robin({"sparsifier": functools.partial(kernel, A=ta, B=tb),
                                 "scipy": functools.partial(operator.add, a, b)}, rounds, repeats)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median reported)")
    parser.add_argument("--repeats", type=int, default=3, help="calls per round (median)")
    parser.add_argument("--sparsifier", action="store_true", help="(internal) time the sparsifier's kernel")
    args = parser.parse_args()
    if args.sparsifier:
        _sparsifier_child(args.rounds, args.repeats)
        return
    table, sizes = {}, {}
    for name, (a, b) in cases().items():
        kernel = sm.compile(EXPRESSION, formats=FORMATS, dtype=a.dtype)
        table[name] = round_robin(calls(a, b, kernel), args.rounds, args.repeats)
        sizes[name] = (a.shape, a.nnz + b.nnz)
    child = sparsifier(args.rounds, args.repeats)
    print(f"A + B, CSR + CSR -> CSR: medians of {args.rounds} alternating rounds of {args.repeats} calls (ms); "
          f"ratio = theirs / ours (above 1: ours faster); ours at {knobs.num_threads()} threads (the configured "
          f"count; {os.cpu_count()} cores here) and at 1; the sparsifier's ratio goes through scipy (its time over "
          f"scipy's in the child process, times scipy's over ours here); load average {os.getloadavg()[0]:.1f}")
    for name, row in table.items():
        theirs = [col for col in ("scipy", "torch") if col in row]
        times = "  ".join(f"{col} {row[col] * 1e3:.3f}" for col in ("ours", "ours 1 thread", *theirs))
        base_row = child[name]
        print(f"{name} ({sizes[name][0][0]}x{sizes[name][0][1]}, {sizes[name][1]} operand entries): {times}  "
              f"sparsifier {base_row['sparsifier'] * 1e3:.3f} (child; scipy there {base_row['scipy'] * 1e3:.3f})")
        via_scipy = base_row["sparsifier"] / base_row["scipy"]
        for base in ("ours", "ours 1 thread"):
            print("    " + "  ".join([f"{col}/{base} {row[col] / row[base]:.2f}" for col in theirs]
                                     + [f"sparsifier/{base} {via_scipy * row['scipy'] / row[base]:.2f}"]))


if __name__ == "__main__":
    main()
