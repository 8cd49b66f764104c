"""SpGEMM ``C[i,j] = A[i,k] * B[k,j]``, CSR x CSR -> CSR, float64: A @ A on SuiteSparse matrices and random ones.

``python benchmarks/spgemm.py [--rounds 5 --repeats 3]``: per matrix, every system in alternating rounds
(medians; the machine is shared, so drift hits all alike).  In this process: ours
(the hand-scheduled kernel, ``dialects/native/spgemm.py``) at the configured thread count and at one thread,
scipy's ``A @ A`` (serial; its rows come out unsorted, so also ``A @ A`` then ``sort_indices()``, which is what
ours returns), ``torch.sparse`` CSR @ CSR and ``sparse_dot_mkl.dot_product_mkl`` (unsorted rows) when
installed.  Our previous path, the sparsifier's kernel for the same expression and formats, is timed in a child
process (``--sparsifier``) that drops the SpGEMM row from the CPU emitter table and compiles into a private
cache, alternating with scipy there; its ratio to ours goes through scipy's time in both processes.  Ratios
are their time over ours: above 1, ours is faster.  Every result is checked against scipy's
before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import sparsifier_child  # benchmarks/: this script's folder, first on sys.path

import sparse_mlir as sm
import sparse_mlir.data
from sparse_mlir.io import read_matrix
from sparse_mlir.timing import median_seconds

EXPRESSION = "C[i,j] = A[i,k] * B[k,j]"
FORMATS = {"A": "csr", "B": "csr", "C": "csr"}
SUITESPARSE = Path("/work/shared/data/suitesparse")
# arrow's square is dense (46500^2 entries): left out
SUITESPARSE_NAMES = ("bcsstk13", "cryg2500", "hangGlider_2", "rajat01", "zenios")


def cases() -> dict[str, sp.csr_array]:
    """The matrices, by name: the bundled west0479, the shared SuiteSparse files present, two random ones."""
    paths = {"west0479": Path(sparse_mlir.data.__file__).parent / "west0479.mtx.gz"}
    paths.update({name: SUITESPARSE / f"{name}.mtx.gz" for name in SUITESPARSE_NAMES
                  if (SUITESPARSE / f"{name}.mtx.gz").is_file()})
    found = {name: _canonical(read_matrix(path)) for name, path in paths.items()}
    rng = np.random.default_rng(0)
    for n, per_row in ((20000, 8), (50000, 4)):
        found[f"random {n}^2, {per_row}/row"] = _canonical(
            sp.random(n, n, density=per_row / n, format="csr", random_state=rng))
    return found


def _canonical(matrix) -> sp.csr_array:
    a = sp.csr_array(matrix).astype(np.float64)
    a.sum_duplicates()
    a.sort_indices()
    return a


def _check(c: sp.csr_array, a: sp.csr_array, name: str) -> None:
    """``c`` has scipy's values (to float64 rounding of the sums' magnitudes) and sorted unique rows."""
    difference = abs(c - a @ a)
    scale = abs(a) @ abs(a)
    if np.max((difference - 1e-12 * scale).data, initial=0.0) > 1e-300:
        raise SystemExit(f"{name}: the result differs from scipy's")
    if not all(np.all(np.diff(c.indices[c.indptr[i]:c.indptr[i + 1]]) > 0) for i in range(c.shape[0])):
        raise SystemExit(f"{name}: a row's columns are not sorted and unique")


def _sorted_product(a: sp.csr_array) -> sp.csr_array:
    c = a @ a
    c.sort_indices()
    return c


def round_robin(calls: dict[str, Callable[[], object]], rounds: int, repeats: int) -> dict[str, float]:
    """Median over ``rounds`` of each call's ``median_seconds``, the calls alternating (each first in turn), so
    drift on the shared machine hits every system alike."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    order = list(calls)
    for r in range(rounds):
        for label in order if r % 2 else order[::-1]:
            times[label].append(median_seconds(calls[label], repeats=repeats))
    return {label: float(np.median(samples)) for label, samples in times.items()}


def calls(a: sp.csr_array, kernel) -> dict[str, Callable[[], object]]:
    """Ours (threaded and one thread, checked first), scipy (plain and sorted), torch.sparse and MKL if there."""
    from sparse_mlir.runtime.threads import fixed

    tensor = sm.SparseTensor.from_scipy(a)
    ours = functools.partial(kernel, A=tensor, B=tensor)
    _check(ours().to_scipy(), a, "ours")

    def serial() -> object:
        with fixed(1):
            return ours()

    found = {"ours": ours, "ours 1 thread": serial, "scipy": functools.partial(operator.matmul, a, a),
             "scipy sorted": functools.partial(_sorted_product, a)}
    try:
        import torch

        warnings.filterwarnings("ignore", message="Sparse (CSR tensor support|invariant checks)")
        t = torch.sparse_csr_tensor(torch.from_numpy(a.indptr.astype(np.int64)),
                                    torch.from_numpy(a.indices.astype(np.int64)), torch.from_numpy(a.data), a.shape)
        found["torch"] = functools.partial(operator.matmul, t, t)
    except ImportError:
        pass
    try:
        from sparse_dot_mkl import dot_product_mkl

        m = sp.csr_matrix(a)
        found["mkl"] = functools.partial(dot_product_mkl, m, m)
    except ImportError:
        pass
    return found


def sparsifier(rounds: int, repeats: int) -> dict[str, dict[str, float]]:
    """The sparsifier's kernel and scipy, alternating, timed in a child process (see the module docstring)."""
    return sparsifier_child.run(__file__, "spgemm_sparsifier_cache_", rounds, repeats)


def _sparsifier_child(rounds: int, repeats: int) -> None:
    sparsifier_child.drop_emitter("spgemm")
    kernel = sm.compile(EXPRESSION, formats=FORMATS, dtype="float64")
    out = {}
    for name, a in cases().items():
        tensor = sm.SparseTensor.from_scipy(a)
        _check(kernel(A=tensor, B=tensor).to_scipy(), a, name)
        assert "linalg.generic" in kernel.ir["input"]  # the sparsifier built it
        out[name] = round_robin({"sparsifier": functools.partial(kernel, A=tensor, B=tensor),
                                 "scipy": functools.partial(operator.matmul, a, a)}, rounds, repeats)
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
    kernel = sm.compile(EXPRESSION, formats=FORMATS, dtype="float64")
    matrices = cases()
    table = {name: round_robin(calls(a, kernel), args.rounds, args.repeats) for name, a in matrices.items()}
    child = sparsifier(args.rounds, args.repeats)
    print(f"A @ A, CSR x CSR -> CSR, float64: medians of {args.rounds} alternating rounds of {args.repeats} calls "
          f"(ms); ratio = theirs / ours (above 1: ours faster); ours at the configured threads ({os.cpu_count()} "
          f"cores here); the sparsifier's ratio goes through scipy (its time over scipy's in the child process, "
          f"times scipy's over ours here)")
    for name, a in matrices.items():
        row, base_row = table[name], child[name]
        theirs = [col for col in ("scipy", "scipy sorted", "torch", "mkl") if col in row]
        times = "  ".join(f"{col} {row[col] * 1e3:.2f}" for col in ("ours", "ours 1 thread", *theirs))
        print(f"{name} ({a.shape[0]}^2, {a.nnz} entries): {times}  sparsifier {base_row['sparsifier'] * 1e3:.2f} "
              f"(child; scipy there {base_row['scipy'] * 1e3:.2f})")
        via_scipy = base_row["sparsifier"] / base_row["scipy"]
        for base in ("ours", "ours 1 thread"):
            print("    " + "  ".join([f"{col}/{base} {row[col] / row[base]:.2f}" for col in theirs]
                                     + [f"sparsifier/{base} {via_scipy * row['scipy'] / row[base]:.2f}"]))


if __name__ == "__main__":
    main()
