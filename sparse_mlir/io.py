"""Readers and writers for the files sparse tensors travel in, gzip or not.

Real workloads arrive as Matrix Market (``.mtx``), DLMC patterns (``.smtx``)
or scipy ``.npz``; ``load_any``/``save_any`` pick the reader or writer from
the file name so tools need not care which, and ``.smt`` (see
``sparse_mlir.tensor_file``) keeps any format, order and index width exactly.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO, Any

import numpy as np

from .errors import FormatError, OperandError
from .formats import Format, as_format
from .tensor import SparseTensor
from .tensor_file import load_tensor, save_tensor

__all__ = ["read_matrix", "read_smtx", "read_mtx", "read_npz", "write_smtx", "write_mtx", "write_npz",
           "load_any", "save_any"]


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


# -- writers ----------------------------------------------------------------------------------------

def _open_write(path: Any) -> IO[bytes]:
    """A binary file for writing; gzip (with a fixed mtime, so output is reproducible) if it ends in .gz."""
    name = str(path)
    return gzip.GzipFile(name, "wb", mtime=0) if name.endswith(".gz") else open(name, "wb")


def _as_scipy(matrix: Any, what: str) -> Any:
    """A scipy matrix for a writer that only knows 2-d matrices."""
    import scipy.sparse as sp

    if isinstance(matrix, SparseTensor):
        if matrix.ndim != 2:
            raise FormatError(f"{what} holds 2-d matrices, got a {matrix.ndim}-d tensor (save it as .smt)")
        return matrix.to_scipy()
    if sp.issparse(matrix):
        return matrix
    raise OperandError(f"{what} writer expects a SparseTensor or a scipy.sparse matrix, got {type(matrix).__name__}")


def _as_tensor(obj: Any) -> SparseTensor:
    return obj if isinstance(obj, SparseTensor) else SparseTensor.from_scipy(_as_scipy(obj, ".smt"))


def write_smtx(matrix: Any, path: Any) -> None:
    """Write the pattern of a 2-d matrix as a DLMC ``.smtx`` file (values are dropped), gzip if ``.gz``.

    Duplicates are merged and column indices sorted, as ``read_smtx`` expects.
    """
    csr = _as_scipy(matrix, ".smtx").tocsr(copy=True)
    csr.sum_duplicates()
    rows, cols = csr.shape
    text = (f"{rows}, {cols}, {csr.nnz}\n" + " ".join(map(str, csr.indptr.tolist())) + "\n"
            + " ".join(map(str, csr.indices.tolist())) + "\n")
    with _open_write(path) as f:
        f.write(text.encode())


def write_mtx(matrix: Any, path: Any) -> None:
    """Write a 2-d matrix as Matrix Market (``scipy.io.mmwrite``), gzip if ``.gz``.

    Every stored entry is written (no symmetry folding), so the pattern
    survives a round trip; values read back as float64 or int64.
    """
    import scipy.io

    with _open_write(path) as f:
        scipy.io.mmwrite(f, _as_scipy(matrix, ".mtx"), symmetry="general")


def read_npz(path: Any) -> Any:
    """A scipy sparse matrix saved with ``scipy.sparse.save_npz``."""
    import scipy.sparse as sp

    return sp.load_npz(path)


def write_npz(matrix: Any, path: Any, compressed: bool = True) -> None:
    """Write a 2-d matrix with ``scipy.sparse.save_npz`` (to ``path`` exactly: no ``.npz`` is appended)."""
    import scipy.sparse as sp

    with open(path, "wb") as f:
        sp.save_npz(f, _as_scipy(matrix, ".npz"), compressed=compressed)


# -- dispatch by file name --------------------------------------------------------------------------

_KINDS = {".smt": "smt", ".mtx": "mtx", ".mtx.gz": "mtx", ".smtx": "smtx", ".smtx.gz": "smtx", ".npz": "npz"}


def _kind(path: Any) -> str:
    name = str(path).lower()
    for suffix, kind in _KINDS.items():
        if name.endswith(suffix):
            return kind
    raise FormatError(f"{path}: unknown sparse file type (expected {', '.join(_KINDS)})")


def _convert(tensor: SparseTensor, format: Format | str | None) -> SparseTensor:
    if format is None or as_format(format, tensor.ndim) == tensor.format:
        return tensor
    coords, values = tensor.to_coo()
    return SparseTensor.from_coo(coords, values, tensor.shape, format)


def load_any(path: Any, format: Format | str | None = None) -> SparseTensor:
    """Read ``.smt``, ``.mtx[.gz]``, ``.smtx[.gz]`` or ``.npz`` (by extension) as a SparseTensor.

    ``format`` converts to that format; by default a ``.smt`` keeps its own and
    a matrix file takes scipy's (CSR for ``.mtx``/``.smtx``).  ``.smtx`` files
    carry no values: they get ``read_smtx``'s seeded random ones.
    """
    kind = _kind(path)
    if kind == "smt":
        return _convert(load_tensor(path), format)
    matrix = {"mtx": read_mtx, "smtx": read_smtx, "npz": read_npz}[kind](path)
    return SparseTensor.from_scipy(matrix, format)


def save_any(tensor_or_matrix: Any, path: Any) -> None:
    """Write a SparseTensor or scipy matrix to ``.smt``, ``.mtx[.gz]``, ``.smtx[.gz]`` or ``.npz`` (by extension).

    Only ``.smt`` holds tensors of order other than 2 and every format as is.
    """
    kind = _kind(path)
    if kind == "smt":
        save_tensor(_as_tensor(tensor_or_matrix), path)
        return
    {"mtx": write_mtx, "smtx": write_smtx, "npz": write_npz}[kind](tensor_or_matrix, path)
