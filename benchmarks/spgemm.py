"""SpGEMM ``C[i,j] = A[i,k] * B[k,j]``, CSR x CSR -> CSR, float64: A @ A on SuiteSparse matrices and random ones.

``python benchmarks/spgemm.py [--repeats 7]``: medians of ``--repeats`` calls each.  In this process: ours
(the hand-scheduled kernel, ``dialects/native/spgemm.py``) at the configured thread count and at one thread,
scipy's ``A @ A`` (serial; its rows come out unsorted, so also ``A @ A`` then ``sort_indices()``, which is what
ours returns), ``torch.sparse`` CSR @ CSR and ``sparse_dot_mkl.dot_product_mkl`` (unsorted rows) when
installed.  Our previous path, the sparsifier's kernel for the same expression and formats, is timed in a child
process (``--sparsifier``) that drops the SpGEMM row from the CPU emitter table and compiles into a private
cache.  Ratios are their time over ours: above 1, ours is faster.  Every result is checked against scipy's
before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp

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


def _time(fn: Callable[[], object], repeats: int) -> float:
    return median_seconds(fn, repeats=repeats)


def ours(matrices: dict[str, sp.csr_array], repeats: int) -> dict[str, dict[str, float]]:
    """Our kernel, default threads and one thread; checked first."""
    from sparse_mlir.runtime.threads import fixed

    kernel = sm.compile(EXPRESSION, formats=FORMATS, dtype="float64")
    out: dict[str, dict[str, float]] = {}
    for name, a in matrices.items():
        tensor = sm.SparseTensor.from_scipy(a)
        _check(kernel(A=tensor, B=tensor).to_scipy(), a, name)
        call = functools.partial(kernel, A=tensor, B=tensor)
        threaded = _time(call, repeats)
        with fixed(1):
            serial = _time(call, repeats)
        out[name] = {"ours": threaded, "ours 1 thread": serial}
    return out


def others(matrices: dict[str, sp.csr_array], repeats: int) -> dict[str, dict[str, float]]:
    """scipy (plain and sorted), torch.sparse and MKL where installed."""
    out: dict[str, dict[str, float]] = {}
    try:
        import torch
    except ImportError:
        torch = None
    try:
        from sparse_dot_mkl import dot_product_mkl
    except ImportError:
        dot_product_mkl = None
    for name, a in matrices.items():
        row = out[name] = {"scipy": _time(functools.partial(operator.matmul, a, a), repeats),
                           "scipy sorted": _time(functools.partial(_sorted_product, a), repeats)}
        if torch is not None:
            warnings.filterwarnings("ignore", message="Sparse (CSR tensor support|invariant checks)")
            t = torch.sparse_csr_tensor(torch.from_numpy(a.indptr.astype(np.int64)),
                                        torch.from_numpy(a.indices.astype(np.int64)), torch.from_numpy(a.data),
                                        a.shape)
            row["torch"] = _time(functools.partial(operator.matmul, t, t), repeats)
        if dot_product_mkl is not None:
            m = sp.csr_matrix(a)
            row["mkl"] = _time(functools.partial(dot_product_mkl, m, m), repeats)
    return out


def sparsifier(repeats: int) -> dict[str, dict[str, float]]:
    """The sparsifier's kernel for the same product, timed in a child process (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="spgemm_sparsifier_cache_") as cache:
        env = {**os.environ, "SPARSE_MLIR_CACHE_DIR": cache, "SPARSE_MLIR_COMPILE_IN_PROCESS": "1"}
        done = subprocess.run([sys.executable, __file__, "--sparsifier", "--repeats", str(repeats)], env=env,
                              capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def _sparsifier_child(repeats: int) -> None:
    # MLIR in this child only: the table the compiler reads
    from sparse_mlir.dialects import select

    select.CPU_EMITTERS = tuple(row for row in select.CPU_EMITTERS if row.name != "spgemm")
    kernel = sm.compile(EXPRESSION, formats=FORMATS, dtype="float64")
    out = {}
    for name, a in cases().items():
        tensor = sm.SparseTensor.from_scipy(a)
        _check(kernel(A=tensor, B=tensor).to_scipy(), a, name)
        assert "linalg.generic" in kernel.ir["input"]  # the sparsifier built it
        out[name] = {"sparsifier": _time(functools.partial(kernel, A=tensor, B=tensor), repeats)}
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sparsifier", action="store_true", help="(internal) time the sparsifier's kernel")
    args = parser.parse_args()
    if args.sparsifier:
        _sparsifier_child(args.repeats)
        return
    matrices = cases()
    table = {name: {} for name in matrices}
    for part in (ours(matrices, args.repeats), others(matrices, args.repeats), sparsifier(args.repeats)):
        for name, row in part.items():
            table[name].update(row)
    print(f"A @ A, CSR x CSR -> CSR, float64, medians of {args.repeats} calls (ms); ratio = theirs / ours "
          f"(above 1: ours faster); ours at the configured threads ({os.cpu_count()} cores here)")
    columns = ["ours", "ours 1 thread", "scipy", "scipy sorted", "torch", "mkl", "sparsifier"]
    for name, a in matrices.items():
        row = table[name]
        times = "  ".join(f"{col} {row[col] * 1e3:.2f}" for col in columns if col in row)
        print(f"{name} ({a.shape[0]}^2, {a.nnz} entries): {times}")
        for base in ("ours", "ours 1 thread"):
            print("    " + "  ".join(f"{col}/{base} {row[col] / row[base]:.2f}" for col in columns[2:] if col in row))


if __name__ == "__main__":
    main()
