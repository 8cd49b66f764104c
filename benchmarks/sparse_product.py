"""The elementwise product ``C = A .* B`` (CSR x CSR -> CSR): ours against scipy's ``multiply``, torch's ``mul`` on
sparse COO tensors, and the sparsifier's serial kernel it replaced.

``python benchmarks/sparse_product.py [--rounds 5 --repeats 5]``: random 4096^2 at 1% times another at 1%, the same
pattern with other values, 1% times a 30% mask, bcsstk13 times its transpose (from ``$SPARSE_MLIR_DATA`` when there),
float64.  Ours at the configured threads and at one, scipy and torch alternate in one process (medians), after a
check against scipy; the sparsifier's kernel runs in a child process that drops the ``sparse_product`` emitter row
(``sparsifier_child``), alternating with scipy there, and is scaled through scipy.  **Ratios: their time / ours,
above 1: ours faster.**
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings

import numpy as np
import scipy.sparse as sp
import sparsifier_child  # benchmarks/: this script's folder, first on sys.path
from spgemm import round_robin

import sparse_mlir as sm
from sparse_mlir.io.matrix_files import read_matrix
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime.threads import fixed

EXPRESSION = "C[i,j] = A[i,j] * B[i,j]"
FORMATS = {"A": "csr", "B": "csr", "C": "csr"}


def cases() -> dict[str, tuple[sp.csr_array, sp.csr_array]]:
    rng = np.random.default_rng(0)
    n = 4096
    a = sp.random_array((n, n), density=0.01, format="csr", rng=rng)
    same = a.copy()
    same.data = rng.random(a.nnz)
    found = {"4096^2 1% .* 1%": (a, sp.random_array((n, n), density=0.01, format="csr", rng=rng)),
             "4096^2 1% .* same pattern": (a, same),
             "4096^2 1% .* 30% mask": (a, sp.random_array((n, n), density=0.3, format="csr", rng=rng))}
    path = knobs.data_dir() / "suitesparse" / "bcsstk13.mtx.gz"
    if path.is_file():
        b = sp.csr_array(read_matrix(path))
        found["bcsstk13 .* its transpose"] = (b, sp.csr_array(b.T))
    return found


def _check(result: sm.SparseTensor, a: sp.csr_array, b: sp.csr_array) -> None:
    want = sp.csr_array(a.multiply(b))
    assert abs(result.to_scipy() - want).max() <= 1e-12 * max(1.0, abs(want).max())


def _child(rounds: int, repeats: int) -> None:
    sparsifier_child.drop_emitter("sparse_product")
    kernel = sm.compile(EXPRESSION, formats=FORMATS, dtype="float64")
    out = {}
    for name, (a, b) in cases().items():
        call = functools.partial(kernel, A=sm.SparseTensor.from_scipy(a), B=sm.SparseTensor.from_scipy(b))
        _check(call(), a, b)
        assert "linalg.generic" in kernel.ir["input"]  # the sparsifier built it
        out[name] = round_robin({"sparsifier": call, "scipy": functools.partial(a.multiply, b)}, rounds, repeats)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sparsifier", action="store_true", help=argparse.SUPPRESS)  # the child's run
    args = parser.parse_args()
    if args.sparsifier:
        _child(args.rounds, args.repeats)
        return
    old = sparsifier_child.run(__file__, "sparse_product_sparsifier_cache_", args.rounds, args.repeats)
    kernel = sm.compile(EXPRESSION, formats=FORMATS, dtype="float64")
    print(f"# A .* B, float64, {knobs.num_threads()} threads, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          "ratios: their time / ours (above 1: ours faster)")
    print("| case | nnz A, B, C | ours ms | 1 thread ms | scipy / ours | torch / ours | sparsifier / ours |")
    print("|---|---|---|---|---|---|---|")
    for name, (a, b) in cases().items():
        ours = functools.partial(kernel, A=sm.SparseTensor.from_scipy(a), B=sm.SparseTensor.from_scipy(b))
        result = ours()
        _check(result, a, b)

        def serial() -> object:
            with fixed(1):
                return ours()

        calls = {"ours": ours, "ours 1 thread": serial, "scipy": functools.partial(a.multiply, b)}
        torch_note = "n/a"
        try:
            import torch

            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            ta, tb = (torch.sparse_coo_tensor(np.vstack([m.tocoo().row, m.tocoo().col]), m.tocoo().data, m.shape)
                      .coalesce() for m in (a, b))
            calls["torch"] = functools.partial(torch.mul, ta, tb)
        except ImportError:
            torch_note = "not installed"
        times = round_robin(calls, args.rounds, args.repeats)
        child = old[name]
        sparsifier = child["sparsifier"] / child["scipy"] * times["scipy"]
        torch_ratio = f"{times['torch'] / times['ours']:.2f}" if "torch" in times else torch_note
        print(f"| {name} | {a.nnz}, {b.nnz}, {result.nnz} | {times['ours'] * 1e3:.3f} | "
              f"{times['ours 1 thread'] * 1e3:.3f} | {times['scipy'] / times['ours']:.2f} | {torch_ratio} | "
              f"{sparsifier / times['ours']:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
