"""Readers for the matrix files of real workloads (Matrix Market, DLMC ``.smtx``), gzip or not."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO, Any

import numpy as np

from .errors import FormatError

__all__ = ["read_matrix", "read_smtx", "read_mtx"]


def _open(path: Any) -> IO[bytes]:
    path = Path(str(path)) if not hasattr(path, "open") else path
    handle = path.open("rb")
    return gzip.open(handle) if str(path).endswith(".gz") else handle


def read_smtx(path: Any, dtype: str = "float32", seed: int = 0) -> Any:
    """A DLMC ``.smtx`` pattern as a scipy CSR matrix with seeded random values.

    Line 1 is ``nrows, ncols, nnz``, line 2 the row offsets, line 3 the column
    indices (the files carry no values).
    """
    import scipy.sparse as sp

    with _open(path) as f:
        lines = f.read().decode().splitlines()
    try:
        rows, cols, nnz = (int(x) for x in lines[0].replace(",", " ").split())
        indptr = np.array(lines[1].split(), dtype=np.int32)
        indices = np.array(lines[2].split(), dtype=np.int32) if nnz else np.zeros(0, np.int32)
    except (IndexError, ValueError) as exc:
        raise FormatError(f"{path}: not a DLMC .smtx file ({exc})") from exc
    values = np.random.default_rng(seed).standard_normal(nnz).astype(dtype)
    return sp.csr_matrix((values, indices, indptr), shape=(rows, cols))


def read_mtx(path: Any) -> Any:
    """A Matrix Market file as a scipy CSR matrix (symmetric files expand to both triangles)."""
    import scipy.io
    import scipy.sparse as sp

    with _open(path) as f:
        return sp.csr_matrix(scipy.io.mmread(f))


def read_matrix(path: Any, dtype: str = "float64") -> Any:
    """Read ``.mtx``/``.smtx`` (optionally ``.gz``) by extension."""
    name = str(path)
    if ".smtx" in name:
        return read_smtx(path, dtype)
    if ".mtx" in name:
        return read_mtx(path).astype(dtype)
    raise FormatError(f"{path}: unknown matrix file type (expected .mtx or .smtx, optionally .gz)")
