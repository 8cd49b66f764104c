"""SDDMM ``C[i,j] = S[i,j] * A[i,k] * B[k,j]`` (CSR S and C, float32) against ``torch.sparse.sampled_addmm``.

``python benchmarks/sddmm.py [--rounds 7 --repeats 5]``: S random 4096^2 at 1%, K = 64 and 128, with ``B`` given
as ``B[k,j]`` (a ``[K, N]`` matrix: ours transposes it) and as ``B[j,k]`` (attention's ``Q K^T`` with ``K`` as
stored, ``[N, K]``: no transpose; torch gets the transposed view).  Ours at the configured threads and at one,
torch at the same two, alternating in one process (medians over rounds), after a check against scipy.
**Ratios: torch's time / ours at the same thread count, above 1: ours faster.**
"""

from __future__ import annotations

import argparse
import functools
import warnings
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp
from spgemm import round_robin  # benchmarks/: this script's folder, first on sys.path

import sparse_mlir as sm
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime.threads import fixed

FORMATS = {"S": "csr", "C": "csr"}
EXPRESSIONS = {"B[k,j]": "C[i,j] = S[i,j] * A[i,k] * B[k,j]", "B[j,k]": "C[i,j] = S[i,j] * A[i,k] * B[j,k]"}


def _serial(fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        with fixed(1):
            return fn()
    return call


def _torch_calls(s: sp.csr_array, a: np.ndarray, b_kn: np.ndarray, layout: str, threads: int
                 ) -> dict[str, Callable[[], object]]:
    try:
        import torch
    except ImportError:
        print("torch is not installed: no torch columns")
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "sparse CSR support is in beta"
        ts = torch.sparse_csr_tensor(torch.from_numpy(s.indptr.astype(np.int64)),
                                     torch.from_numpy(s.indices.astype(np.int64)), torch.from_numpy(s.data), s.shape)
    ta = torch.from_numpy(a)
    tb = torch.from_numpy(b_kn) if layout == "B[k,j]" else torch.from_numpy(np.ascontiguousarray(b_kn.T)).T

    def at(count: int) -> Callable[[], object]:
        def call() -> object:
            torch.set_num_threads(count)
            return torch.sparse.sampled_addmm(ts, ta, tb, beta=0.0)
        return call

    return {"torch": at(threads), "torch 1 thread": at(1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    threads = knobs.num_threads()
    rng = np.random.default_rng(0)
    n = 4096
    s = sp.random_array((n, n), density=0.01, format="csr", dtype=np.float32, rng=rng)
    tensor = sm.SparseTensor.from_scipy(s)
    print(f"S {n}^2 at 1% ({s.nnz} entries), float32, {threads} threads; ratios: torch / ours (above 1: ours faster)")
    for k in (64, 128):
        a = rng.standard_normal((n, k), dtype=np.float32)
        b_kn = rng.standard_normal((k, n), dtype=np.float32)
        rows = np.repeat(np.arange(n), np.diff(s.indptr))
        # the check's dot products by einsum, not a BLAS matmul: OpenBLAS's pool would spin beside the timed calls
        want = sp.csr_array((s.data * np.einsum("ek,ek->e", a[rows], b_kn.T[s.indices]), s.indices, s.indptr),
                            shape=s.shape)
        for layout, expression in EXPRESSIONS.items():
            kernel = sm.compile(expression, formats=FORMATS, dtype="float32")
            b = b_kn if layout == "B[k,j]" else np.ascontiguousarray(b_kn.T)
            ours = functools.partial(kernel, S=tensor, A=a, B=b)
            assert abs(ours().to_scipy() - want).max() <= 1e-4 * max(1.0, abs(want).max())
            calls = {"ours": ours, "ours 1 thread": _serial(ours), **_torch_calls(s, a, b_kn, layout, threads)}
            times = round_robin(calls, args.rounds, args.repeats)
            line = f"K={k:<4} {layout}: ours {times['ours'] * 1e3:.3f} ms, 1 thread {times['ours 1 thread'] * 1e3:.3f} ms"
            if "torch" in times:
                line += (f"; torch {times['torch'] * 1e3:.3f} / {times['torch 1 thread'] * 1e3:.3f} ms; torch/ours "
                         f"{times['torch'] / times['ours']:.2f}x ({threads} threads), "
                         f"{times['torch 1 thread'] / times['ours 1 thread']:.2f}x (1 thread)")
            print(line, flush=True)


if __name__ == "__main__":
    main()
