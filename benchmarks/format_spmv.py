"""SpMV on COO, DCSR and CSC operands (and CSR read transposed): the threaded format kernels against scipy,
torch, MKL and the sparsifier's serial kernel they replaced.

``python benchmarks/format_spmv.py [--rounds 7 --repeats 5]``.  For each matrix (METIS mdual and copter2 from
Debian's ``libmetis-doc`` when installed, the SuiteSparse matrices of ``$SPARSE_MLIR_DATA``, a random
200000^2 with 10 entries a row, and the arrow matrix: a few very long rows) and each form:

* ``coo``: ``y = A @ x`` with A in COO; scipy ``coo_array @ x``, torch ``sparse_coo`` ``torch.mv``;
* ``dcsr``: the same in DCSR; scipy and MKL on the CSR matrix (neither has DCSR);
* ``csc``: the same in CSC; scipy ``csc_array @ x``, MKL on the CSC matrix;
* ``csr^T``: ``y = A^T @ x`` with A in CSR (``y[j] = A[i,j] * x[i]``); scipy ``A.T @ x``, MKL on ``A.T``,

ours runs at the configured thread count and at one thread, in alternating rounds with every library (medians;
a shared machine's drift hits all alike), after a check against scipy.  The sparsifier's kernel for the same
expression (serial: its outer loop is compressed or a reduction) is timed in a child process that drops the
``format_spmv`` row from the emitter table (``sparsifier_child``), alternating with scipy there: its ratio is the
child's sparsifier/scipy times this process's scipy/ours, scipy the yardstick both processes share.  Every ratio is **their time over ours: above
1, ours is faster**; a library that does not load is named, not dashed.
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import sparsifier_child  # benchmarks/: this script's folder, first on sys.path
from efficiency_gap import read_metis
from spgemm import round_robin

import sparse_mlir as sm
from sparse_mlir.io.matrix_files import read_matrix
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime.threads import fixed

METIS = Path("/usr/share/doc/libmetis-dev/examples/graphs")
SUITESPARSE = ("bcsstk13", "rajat01", "hangGlider_2", "cryg2500", "zenios", "arrow")
FORMS = {"coo": ("y[i] = A[i,j] * x[j]", "coo"), "dcsr": ("y[i] = A[i,j] * x[j]", "dcsr"),
         "csc": ("y[i] = A[i,j] * x[j]", "csc"), "csr^T": ("y[j] = A[i,j] * x[i]", "csr")}
MISSING: list[str] = []  # libraries or files that did not load, said once at the end


def matrices() -> dict[str, sp.csr_array]:
    """The workloads that are here, float64 with seeded random values."""
    rng = np.random.default_rng(0)
    found: dict[str, sp.csr_array] = {}
    for name in ("mdual", "copter2"):
        path = METIS / f"{name}.graph"
        if path.is_file():
            found[name] = sp.csr_array(read_metis(path))
        else:
            MISSING.append(f"{path} (apt-get install libmetis-doc)")
    for name in SUITESPARSE:
        path = knobs.data_dir() / "suitesparse" / f"{name}.mtx.gz"
        if path.is_file():
            found[name] = sp.csr_array(read_matrix(path))
        else:
            MISSING.append(str(path))
    n = 200_000
    found["random 200000^2, 10 a row"] = sp.random_array((n, n), density=10 / n, format="csr", rng=rng)
    for a in found.values():
        a.data = rng.standard_normal(a.nnz)
        a.sum_duplicates()
    return found


def _operand(a: sp.csr_array, form: str) -> sp.sparray:
    return sp.coo_array(a) if form == "coo" else sp.csc_array(a) if form == "csc" else a


def _vector(a: sp.csr_array, form: str) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(a.shape[0] if form == "csr^T" else a.shape[1])


def _reference(a: sp.csr_array, form: str, x: np.ndarray) -> np.ndarray:
    return (a.T if form == "csr^T" else a) @ x


def libraries(a: sp.csr_array, form: str, x: np.ndarray) -> dict[str, Callable[[], object]]:
    """scipy, torch and MKL as a user would call them for this form (the module docstring)."""
    operand = a.T if form == "csr^T" else _operand(a, form)
    found: dict[str, Callable[[], object]] = {"scipy": functools.partial(operator.matmul, operand, x)}
    if form == "coo":
        try:
            import torch

            c = sp.coo_array(a)
            t = torch.sparse_coo_tensor(torch.from_numpy(np.vstack([c.row, c.col]).astype(np.int64)),
                                        torch.from_numpy(c.data), c.shape).coalesce()
            found["torch"] = functools.partial(torch.mv, t, torch.from_numpy(x))
        except ImportError:
            _missing("torch")
    try:
        from sparse_dot_mkl import dot_product_mkl

        mkl_operand = sp.csc_matrix(a) if form == "csc" else sp.csr_matrix(a).T if form == "csr^T" \
            else sp.csr_matrix(a)
        found["mkl"] = functools.partial(dot_product_mkl, mkl_operand, x)
    except ImportError:
        _missing("sparse_dot_mkl (pip install sparse_dot_mkl mkl)")
    return found


def _missing(what: str) -> None:
    if what not in MISSING:
        MISSING.append(what)


def ours(a: sp.csr_array, form: str, x: np.ndarray) -> dict[str, Callable[[], object]]:
    """Our kernel at the configured threads and at one, checked against scipy first."""
    expression, fmt = FORMS[form]
    kernel = sm.compile(expression, formats={"A": fmt}, dtype="float64")
    tensor = sm.SparseTensor.from_scipy(a, fmt)
    call = functools.partial(kernel, A=tensor, x=x)
    np.testing.assert_allclose(call(), _reference(a, form, x), rtol=1e-10, atol=1e-10)

    def serial() -> object:
        with fixed(1):
            return call()

    return {"ours": call, "ours 1 thread": serial}


def sparsifier(rounds: int, repeats: int) -> dict[str, dict[str, float]]:
    """The sparsifier's kernel for every matrix and form, timed in a child process (module docstring)."""
    return sparsifier_child.run(__file__, "format_spmv_sparsifier_cache_", rounds, repeats)


def _sparsifier_child(rounds: int, repeats: int) -> None:
    sparsifier_child.drop_emitter("format_spmv")
    out = {}
    for name, a in matrices().items():
        for form, (expression, fmt) in FORMS.items():
            kernel = sm.compile(expression, formats={"A": fmt}, dtype="float64")
            x = _vector(a, form)
            call = functools.partial(kernel, A=sm.SparseTensor.from_scipy(a, fmt), x=x)
            np.testing.assert_allclose(call(), _reference(a, form, x), rtol=1e-10, atol=1e-10)
            assert "linalg.generic" in kernel.ir["input"]  # the sparsifier built it
            scipy_call = functools.partial(operator.matmul, a.T if form == "csr^T" else _operand(a, form), x)
            out[f"{name} {form}"] = round_robin({"sparsifier": call, "scipy": scipy_call}, rounds, repeats)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sparsifier", action="store_true", help=argparse.SUPPRESS)  # the child's run
    parser.add_argument("--no-sparsifier", action="store_true", help="skip the sparsifier's kernels (slow builds)")
    args = parser.parse_args()
    if args.sparsifier:
        _sparsifier_child(args.rounds, args.repeats)
        return
    warnings.filterwarnings("ignore", message="Sparse (CSR tensor support|invariant checks)")
    old = {} if args.no_sparsifier else sparsifier(max(3, args.rounds // 2), args.repeats)
    print(f"# format SpMV, float64, {knobs.num_threads()} threads, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}; ratios: their time / ours (above 1: ours faster)")
    print("| matrix | form | nnz | ours ms | 1 thread ms | " + " | ".join(
        f"{s} / ours" for s in ("scipy", "torch", "mkl", "sparsifier")) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, a in matrices().items():
        for form in FORMS:
            x = _vector(a, form)
            calls = {**ours(a, form, x), **libraries(a, form, x)}
            times = round_robin(calls, args.rounds, args.repeats)
            if f"{name} {form}" in old:  # the child's sparsifier/scipy times this process's scipy/ours
                child = old[f"{name} {form}"]
                times["sparsifier"] = child["sparsifier"] / child["scipy"] * times["scipy"]
            ratio = {s: f"{times[s] / times['ours']:.2f}" if s in times else "n/a"
                     for s in ("scipy", "torch", "mkl", "sparsifier")}
            print(f"| {name} | {form} | {a.nnz} | {times['ours'] * 1e3:.3f} | {times['ours 1 thread'] * 1e3:.3f} | "
                  + " | ".join(ratio.values()) + " |", flush=True)
    print("n/a: no such call (torch: COO only here)" + (f"; not loaded: {'; '.join(MISSING)}" if MISSING else ""))


if __name__ == "__main__":
    sys.exit(main())
