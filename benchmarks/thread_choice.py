"""Serial or threaded when the pool sleeps: each kernel's measured choice against the entry-count rule it replaced.

``python benchmarks/thread_choice.py [--rounds 21] [--every 8]``, in the
efficiency-gap benchmark's regime (it restarts itself with that benchmark's
``POOL_SETTINGS``: ``KMP_BLOCKTIME=0``, so every call finds the workers
asleep), one process, the order of the systems rotating each round:

* ``measured``: the call as users make it (``runtime/thread_choice.py``
  decides, after its trials);
* ``rule``: the same call with the thread count the entry-count rule gives
  (``threads.for_work``, computed per call as the runtime did before);
* the libraries the efficiency-gap benchmark compares with, in between, so
  the caches and the pools are in the state they leave them in.

Workloads: the SpGEMM ``A @ A`` of six SuiteSparse matrices (the rule's
worst case: few operand entries for much work) and every ``--every``-th
DLMC 0.9 pattern as a SpMM with N=128.  Ratios are ``rule / measured``
(above 1: the measured choice is faster), medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp
from efficiency_gap import _comparators, _mkl_product, _torch_csr, fresh_environment, interleaved

import sparse_mlir as sm
from sparse_mlir.io.matrix_files import read_matrix, read_smtx
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime import threads

SUITESPARSE = ("west0479", "cryg2500", "zenios", "bcsstk13", "hangGlider_2", "rajat01")


def by_rule(call: Callable[[], object], entries: int) -> Callable[[], object]:
    """``call`` at the thread count the entry-count rule gives a call of ``entries`` operand entries."""
    def run() -> object:
        with threads.fixed(threads.for_work(entries)):
            return call()
    return run


def compare(name: str, call: Callable[[], object], entries: int, others: dict[str, Callable[[], object]],
            rounds: int) -> None:
    times = interleaved({"measured": call, "rule": by_rule(call, entries), **others}, rounds)
    libs = "  ".join(f"{k} {v * 1e3:.3f}" for k, v in times.items() if k not in ("measured", "rule"))
    print(f"| {name} | {entries} | {times['measured'] * 1e3:.3f} | {times['rule'] * 1e3:.3f} | "
          f"{times['rule'] / times['measured']:.2f} | {libs} |", flush=True)


def spgemm(rounds: int) -> None:
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64")
    for name in SUITESPARSE:
        path = knobs.data_dir() / "suitesparse" / f"{name}.mtx.gz"
        if not path.is_file():
            print(f"| SpGEMM {name} | missing: {path} |")
            continue
        a = sp.csr_matrix(read_matrix(path), dtype=np.float64)
        a.sort_indices()
        tensor = sm.SparseTensor.from_scipy(a)
        others: dict[str, Callable[[], object]] = {"scipy": lambda a=a: a @ a}
        t, mkl = _torch_csr(a), _mkl_product()
        if t is not None:
            others["torch"] = lambda t=t: t @ t
        if mkl is not None:
            others["mkl"] = lambda a=a: mkl(a, a)
        compare(f"SpGEMM {name}", lambda t=tensor: kernel(A=t, B=t), 2 * a.nnz, others, rounds)


def dlmc_spmm(rounds: int, every: int) -> None:
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32")
    paths = sorted((knobs.data_dir() / "dlmc" / "transformer" / "magnitude_pruning" / "0.9").glob("*.smtx.gz"))
    for path in paths[::every]:
        a = sp.csr_matrix(read_smtx(path), dtype=np.float32)
        a.sort_indices()
        b = np.random.default_rng(0).standard_normal((a.shape[1], 128)).astype(np.float32)
        tensor, out = sm.SparseTensor.from_scipy(a), np.empty((a.shape[0], 128), np.float32)
        others, _ = _comparators(a, b)
        compare(f"SpMM {path.name.removesuffix('.smtx.gz')[5:40]} {a.shape[0]}x{a.shape[1]}",
                lambda t=tensor, b=b, o=out: kernel(A=t, B=b, out=o), a.nnz + b.size, others, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="rotating rounds (medians)")
    parser.add_argument("--every", type=int, default=8, help="every n-th DLMC pattern")
    args = parser.parse_args()
    print(f"{threads.blocktime_seconds() * 1e3:g} ms blocktime, {knobs.num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}; ms; rule / measured above 1: the measured choice is faster")
    print("| workload | entries | measured | rule | rule / measured | libraries |\n|---|---|---|---|---|---|")
    spgemm(args.rounds)
    dlmc_spmm(args.rounds, args.every)


if __name__ == "__main__":
    fresh = fresh_environment(os.environ)
    if fresh is not None:  # the pool settings must be in place before the OpenMP runtimes load
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], fresh)
    main()
