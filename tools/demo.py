"""The demo: compile kernels on built-in real matrices and compare with scipy and numpy.

Prints one row per workload: the max error against the reference and the
median times of our kernel, scipy and dense numpy (first-call compile time
is reported separately).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib.resources import files

import numpy as np

from sparse_mlir.api import compile as compile_kernel
from sparse_mlir.io.matrix_files import read_matrix
from sparse_mlir.tensor.host import SparseTensor
from sparse_mlir.timing import median_seconds


def _workloads() -> list[tuple[str, str, str, dict, Callable]]:
    data = files("sparse_mlir.data")
    west = read_matrix(data / "west0479.mtx.gz")
    karate = read_matrix(data / "karate.mtx.gz")
    dlmc = read_matrix(data / "dlmc_attention_q_0.9.smtx.gz", "float32")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(west.shape[1])
    B = rng.standard_normal((dlmc.shape[1], 128)).astype(np.float32)
    return [
        ("SpMV", "west0479", "y[i] = A[i,j] * x[j]", {"A": west, "x": x}, lambda: west @ x),
        ("SpMM N=128", "DLMC attention q 0.9", "C[i,j] = A[i,k] * B[k,j]", {"A": dlmc, "B": B}, lambda: dlmc @ B),
        ("SpGEMM", "karate x karate", "C[i,j] = A[i,k] * B[k,j]", {"A": karate, "B": karate},
         lambda: (karate @ karate).toarray()),
        ("row sums", "west0479", "r[i] = A[i,j]", {"A": west}, lambda: np.asarray(west.sum(1)).ravel()),
    ]


def run_demo() -> int:
    header = f"{'kernel':<12} {'matrix':<22} {'shape':>10} {'nnz':>7} {'max err':>9} {'compile':>9} " \
             f"{'ours':>9} {'scipy':>9} {'dense':>9}"
    print(header)
    print("-" * len(header))
    for kind, name, expr, operands, reference in _workloads():
        A = operands["A"]
        dtype = A.dtype
        sparse_out = kind == "SpGEMM"
        formats = {n: "csr" for n in operands if hasattr(operands[n], "tocsr")}
        if sparse_out:
            formats["C"] = "csr"
        tensors = {n: SparseTensor.from_scipy(v) if n in formats else v for n, v in operands.items()}
        kernel = compile_kernel(expr, formats=formats, dtype=dtype)
        start = time.perf_counter()
        result = kernel(**tensors)
        compile_s = time.perf_counter() - start
        got = result.to_dense() if isinstance(result, SparseTensor) else result
        err = float(np.max(np.abs(got - reference()))) if got.size else 0.0
        ours = median_seconds(lambda: kernel(**tensors), 15)
        scipy_s = median_seconds(reference, 15)
        dense_ops = {n: (v.toarray() if n in formats else v) for n, v in operands.items()}
        dense = _dense_reference(kind, dense_ops)
        dense_s = median_seconds(dense, 15) if dense else float("nan")
        shape = "x".join(map(str, A.shape))
        print(f"{kind:<12} {name:<22} {shape:>10} {A.nnz:>7} {err:>9.1e} {compile_s * 1e3:>7.0f}ms "
              f"{ours * 1e6:>7.1f}us {scipy_s * 1e6:>7.1f}us {dense_s * 1e6:>7.1f}us")
    return 0


def _dense_reference(kind: str, ops: dict) -> Callable[[], object] | None:
    if kind == "SpMV":
        return lambda: ops["A"] @ ops["x"]
    if kind.startswith("SpMM") or kind == "SpGEMM":
        return lambda: ops["A"] @ ops["B"]
    return lambda: ops["A"].sum(1)
