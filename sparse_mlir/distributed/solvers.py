"""Conjugate gradients on a row-sharded matrix: SpMV on the workers, dot products as Dask reductions.

The iteration is scipy's ``cg`` step for step (same stopping test
``||r|| < rtol * ||b||`` before each step, same updates, ``x0 = 0``), so its
iteration count and answer can be compared with scipy's.  Each step persists
its vectors on the workers (chunked like the matrix's rows) and brings two
scalars back to the client: ``p.q`` and ``r.r``.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparse_mlir.dtypes import whole_number
from sparse_mlir.errors import DTypeError, OperandError, OptionError, ShapeError
from sparse_mlir.distributed.matrix import RowShardedMatrix

__all__ = ["CGResult", "cg", "dot", "axpy", "poisson3d"]


@dataclass
class CGResult:
    """The solution gathered on the client and how it was reached."""

    x: np.ndarray
    iterations: int
    residual: float  # ||r|| / ||b|| of the recurrence's last residual
    converged: bool
    seconds: float


def _tag(prefix: str) -> str:
    return f"{prefix}-{_TAG}-{next(_serial)}"


_TAG = os.urandom(6).hex()
_serial = itertools.count()


def _axpy(a: np.ndarray, alpha: float, b: np.ndarray) -> np.ndarray:
    return a + alpha * b


def _partial_dot(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b))


def _add(*terms: float) -> float:
    return math.fsum(terms)


def _chunk_keys(u: Any, v: Any) -> list[tuple[tuple, tuple]]:
    if u.chunks != v.chunks:
        raise ShapeError(f"vectors chunked differently: {u.chunks} and {v.chunks}")
    return list(zip(u.__dask_keys__(), v.__dask_keys__()))


def axpy(a: Any, alpha: float, b: Any) -> Any:
    """``a + alpha * b`` chunk by chunk: one task per chunk (a Dask expression would build two layers)."""
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    name = _tag("sm-axpy")
    layer = {(name, i): (_axpy, ka, alpha, kb) for i, (ka, kb) in enumerate(_chunk_keys(a, b))}
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[a, b])
    return da.Array(graph, name, chunks=a.chunks, meta=np.empty((0,), np.result_type(a.dtype, b.dtype)))


def dot(u: Any, v: Any, split_every: int = 4) -> float:
    """``u . v`` as a Dask tree reduction: a partial dot per chunk, summed ``split_every`` at a time."""
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    name = _tag("sm-dot")
    layer: dict[Any, Any] = {}
    keys = []
    for i, (ku, kv) in enumerate(_chunk_keys(u, v)):
        layer[(name, 0, i)] = (_partial_dot, ku, kv)
        keys.append((name, 0, i))
    level = 0
    while len(keys) > 1:
        level += 1
        keys = [_tree_node(layer, (name, level, j // split_every), keys[j:j + split_every])
                for j in range(0, len(keys), split_every)]
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[u, v])
    return float(Delayed(keys[0], graph, layer=name).compute())


def _tree_node(layer: dict[Any, Any], key: tuple, children: list[tuple]) -> tuple:
    layer[key] = (_add, *children)
    return key


def _persist(*arrays: Any) -> tuple[Any, ...]:
    import dask

    return dask.persist(*arrays)


def cg(A: RowShardedMatrix, b: Any, *, rtol: float = 1e-8, maxiter: int | None = None,
       callback: Callable[[int, float], None] | None = None) -> CGResult:
    """Solve ``A x = b`` (A symmetric positive definite) to ``||b - A x|| < rtol ||b||`` from ``x = 0``.

    ``b`` is a numpy array or a Dask array; the vectors live on the workers
    chunked like ``A``'s rows, and only scalars and the final ``x`` come
    back.  ``callback(iteration, relative_residual)`` runs after each step.
    """
    import dask.array as da

    if not isinstance(A, RowShardedMatrix):
        raise OperandError(f"cg takes a RowShardedMatrix, got {type(A).__name__} (RowShardedMatrix.from_scipy)")
    n = A.shape[0]
    if A.shape[0] != A.shape[1] or np.shape(b) != (n,):
        raise ShapeError(f"cg needs a square matrix and a right-hand side of its size, got {A.shape} and "
                         f"{np.shape(b)}")
    b_dtype = np.dtype(getattr(b, "dtype", None) or np.asarray(b).dtype)
    if not np.can_cast(b_dtype, A.dtype, "same_kind"):  # a complex b lost its imaginary part, "converged"
        raise DTypeError(f"cg's right-hand side is {b_dtype}, the matrix {A.dtype}; it would not cast exactly")
    if not 0 <= rtol < math.inf:  # NaN too
        raise OptionError(f"cg's rtol must be a finite number >= 0, got {rtol}")
    maxiter = 10 * n if maxiter is None else whole_number(maxiter, "cg's maxiter", OptionError)
    start = time.perf_counter()
    chunks = (A.layout.row_chunks,)
    r = (b.rechunk(chunks) if hasattr(b, "dask") else da.from_array(np.asarray(b, A.dtype), chunks=chunks))
    x = da.zeros(n, dtype=A.dtype, chunks=chunks)
    x, r = _persist(x, r)
    rho = dot(r, r)
    bnorm = math.sqrt(rho)
    if not math.isfinite(bnorm):
        raise OperandError("cg's right-hand side holds NaN or infinity")
    if bnorm == 0.0:
        return CGResult(x.compute(), 0, 0.0, True, time.perf_counter() - start)
    p, iterations, rho_old = None, 0, rho
    while rho > 0 and math.sqrt(rho) >= rtol * bnorm and iterations < maxiter:  # rho == 0: solved exactly
        p = r if p is None else axpy(r, rho / rho_old, p)
        q = A @ p
        p, q = _persist(p, q)
        curvature = dot(p, q)
        if not curvature > 0:  # p^T A p <= 0 (or NaN): A is not positive definite, and alpha would divide by it
            raise OperandError(f"cg needs a symmetric positive definite matrix: p^T A p = {curvature:g} at "
                               f"iteration {iterations + 1}")
        alpha = rho / curvature
        x, r = _persist(axpy(x, alpha, p), axpy(r, -alpha, q))
        rho_old, rho = rho, dot(r, r)
        iterations += 1
        if callback is not None:
            callback(iterations, math.sqrt(rho) / bnorm)
    residual = math.sqrt(rho) / bnorm
    return CGResult(x.compute(), iterations, residual, residual < rtol or rho == 0, time.perf_counter() - start)


def poisson3d(n: int, dtype: Any = np.float64) -> Any:
    """The 7-point Laplacian on an ``n^3`` grid (Dirichlet), scipy CSR: SPD, ``7 n^3 - 6 n^2`` nonzeros."""
    import scipy.sparse as sp

    if n < 1:
        raise ShapeError(f"poisson3d needs n >= 1, got {n}")
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n), format="csr", dtype=dtype)
    eye = sp.identity(n, format="csr", dtype=dtype)
    a = sp.kron(sp.kron(t, eye), eye) + sp.kron(sp.kron(eye, t), eye) + sp.kron(sp.kron(eye, eye), t)
    a = a.tocsr()
    a.sort_indices()
    return a
