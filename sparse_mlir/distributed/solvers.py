"""Conjugate gradients on a row-sharded matrix: SpMV on the workers, dot products as Dask reductions.

The iteration is scipy's ``cg`` step for step (same stopping test
``||r|| < rtol * ||b||`` before each step, same updates, ``x0 = 0``), so its
iteration count and answer can be compared with scipy's.  Each step persists
its vectors on the workers (chunked like the matrix's rows) and brings two
scalars back to the client: ``p.q`` and ``r.r``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ShapeError
from .matrix import RowShardedMatrix

__all__ = ["CGResult", "cg", "poisson3d"]


@dataclass
class CGResult:
    """The solution gathered on the client and how it was reached."""

    x: np.ndarray
    iterations: int
    residual: float  # ||r|| / ||b|| of the recurrence's last residual
    converged: bool
    seconds: float


def _dot(u: Any, v: Any) -> float:
    """``u . v`` as a Dask tree reduction over the row chunks, brought back as one float."""
    return float((u * v).sum(split_every=4).compute())


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

    n = A.shape[0]
    if A.shape[0] != A.shape[1] or np.shape(b) != (n,):
        raise ShapeError(f"cg needs a square matrix and a right-hand side of its size, got {A.shape} and "
                         f"{np.shape(b)}")
    maxiter = 10 * n if maxiter is None else maxiter
    start = time.perf_counter()
    chunks = (A.layout.row_chunks,)
    r = (b.rechunk(chunks) if hasattr(b, "dask") else da.from_array(np.asarray(b, A.dtype), chunks=chunks))
    x = da.zeros(n, dtype=A.dtype, chunks=chunks)
    x, r = _persist(x, r)
    rho = _dot(r, r)
    bnorm = math.sqrt(rho)
    if bnorm == 0.0:
        return CGResult(x.compute(), 0, 0.0, True, time.perf_counter() - start)
    p, iterations = None, 0
    while math.sqrt(rho) >= rtol * bnorm and iterations < maxiter:
        p = r if p is None else r + (rho / rho_old) * p
        q = A @ p
        p, q = _persist(p, q)
        alpha = rho / _dot(p, q)
        x, r = _persist(x + alpha * p, r - alpha * q)
        rho_old, rho = rho, _dot(r, r)
        iterations += 1
        if callback is not None:
            callback(iterations, math.sqrt(rho) / bnorm)
    residual = math.sqrt(rho) / bnorm
    return CGResult(x.compute(), iterations, residual, residual < rtol, time.perf_counter() - start)


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
