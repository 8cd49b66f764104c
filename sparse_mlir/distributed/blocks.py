"""Worker-side pieces of a sharded matrix: building blocks and running a kernel on one of them.

Everything here runs inside Dask tasks.  A block is the ``SparseTensor`` (CSR)
of rows ``r0:r1`` and columns ``lo:hi`` of the matrix (its *window*: the
columns it touches, so a product needs only that slice of the vector, and
for a banded matrix a row block reads its neighbours' edges, not the whole
vector).  Every library error raised for a block is re-raised naming it, so
the client learns which chunk was bad.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from sparse_mlir.errors import DSLError, LoweringError, ShapeError, SparseMLIRError
from sparse_mlir.formats import Format
from sparse_mlir.io.matrix_files import load_any
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["name_chunk", "as_block", "file_block", "probe_file", "run_block", "add_partials", "place_partial",
           "block_to_scipy"]

Rows = tuple[int, int]
Window = tuple[int, int]


def name_chunk(exc: SparseMLIRError, k: int, rows: Rows) -> SparseMLIRError:
    """The same error class with ``chunk k (rows r0:r1)`` in front of its message (kept when pickled)."""
    where = f"chunk {k} (rows {rows[0]}:{rows[1]})"
    new: SparseMLIRError
    if isinstance(exc, LoweringError):
        new = LoweringError(f"{where}: {exc.message}", stage=exc.stage, target=exc.target, diagnostics=exc.diagnostics)
    elif isinstance(exc, DSLError):
        new = DSLError(f"{where}: {exc.message}", exc.expression, exc.column)
    else:
        try:
            new = type(exc)(f"{where}: {exc}")
        except TypeError:  # a subclass with another constructor: keep the library's base class
            new = SparseMLIRError(f"{where}: {type(exc).__name__}: {exc}")
    new.__cause__ = exc
    return new


def _guarded(k: int, rows: Rows, work: Callable[[], Any]) -> Any:
    try:
        return work()
    except SparseMLIRError as exc:
        raise name_chunk(exc, k, rows) from exc


def _window_csr(matrix: Any, window: Window, fmt: Format, dtype: np.dtype | None) -> SparseTensor:
    """The CSR tensor of a row slice restricted to its column window (coordinates shifted by ``lo``)."""
    import scipy.sparse as sp

    lo, hi = window
    csr = matrix.tocsr()
    if (lo, hi) != (0, csr.shape[1]):
        csr = sp.csr_matrix((csr.data, csr.indices - lo, csr.indptr), shape=(csr.shape[0], hi - lo))
    if dtype is not None and csr.dtype != dtype:
        csr = csr.astype(dtype)
    return SparseTensor.from_scipy(csr, fmt)


def as_block(k: int, rows: Rows, window: Window, fmt: Format, dtype: np.dtype | None, value: Any) -> SparseTensor:
    """Chunk ``k`` as the block the kernels take: a SparseTensor or scipy matrix, converted once, here."""
    def build() -> SparseTensor:
        shape = (rows[1] - rows[0], window[1] - window[0])
        if isinstance(value, SparseTensor) and value.format == fmt and window == (0, value.shape[1]) \
                and (dtype is None or value.dtype == dtype):
            block = value
        else:
            block = _window_csr(value.to_scipy() if isinstance(value, SparseTensor) else value, window, fmt, dtype)
        if block.shape != shape:
            raise ShapeError(f"the chunk has shape {block.shape}, the matrix's layout says {shape}")
        return block

    return _guarded(k, rows, build)


# -- files, read on the workers ---------------------------------------------------------------------------

_files: OrderedDict[tuple, Any] = OrderedDict()  # the last files read by this worker, as scipy CSR


def _read_file(path: str, stamp: tuple[int, int]) -> Any:
    """The whole file as scipy CSR, once per worker process and file version (``stamp``: size, mtime)."""
    key = (path, stamp)
    matrix = _files.get(key)
    if matrix is None:
        matrix = _files[key] = load_any(path, "csr").to_scipy()
        while len(_files) > 2:
            _files.popitem(last=False)
    return matrix


def file_stamp(path: str) -> tuple[int, int]:
    """Size and modification time: a rewritten file is a new version (new task keys, no stale cache)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def probe_file(path: str, stamp: tuple[int, int], bounds: Callable[[int], list[Rows]]) -> dict[str, Any]:
    """Shape, dtype, row bounds, column windows and nonzeros per block of a file (a small task)."""
    matrix = _read_file(path, stamp)
    rows = bounds(matrix.shape[0])
    windows = [window_of(matrix.indices[matrix.indptr[r0]:matrix.indptr[r1]], matrix.shape[1]) for r0, r1 in rows]
    nnz = [int(matrix.indptr[r1] - matrix.indptr[r0]) for r0, r1 in rows]
    return {"shape": matrix.shape, "dtype": matrix.dtype.str, "rows": rows, "windows": windows, "nnz": nnz}


def file_block(path: str, stamp: tuple[int, int], k: int, rows: Rows, window: Window, fmt: Format,
               dtype: np.dtype | None) -> SparseTensor:
    """Rows ``r0:r1`` of a file, from this worker's copy of it."""
    return _guarded(k, rows, lambda: _window_csr(_read_file(path, stamp)[rows[0]:rows[1]], window, fmt, dtype))


def window_of(columns: np.ndarray, ncols: int) -> Window:
    """The columns a block touches, ``[min, max]``; an empty block keeps one column (no zero-width shapes)."""
    if columns.size == 0:
        return 0, min(1, ncols)
    return int(columns.min()), int(columns.max()) + 1


def block_to_scipy(block: Any, window: Window, ncols: int) -> Any:
    """A block back in the matrix's columns (scipy CSR), for gathering a matrix on the client."""
    import scipy.sparse as sp

    csr = block.to_scipy().tocsr()
    return sp.csr_matrix((csr.data, csr.indices + window[0], csr.indptr), shape=(csr.shape[0], ncols))


def to_device(block: SparseTensor, device: str) -> Any:
    """A block moved to this worker's GPU (``"cuda"``: a DeviceSparseTensor; needs CuPy there)."""
    return block.to(device)


# -- kernels on blocks --------------------------------------------------------------------------------------

def _array_module(target: str) -> Any:
    if target == "cuda":
        import cupy

        return cupy
    return np


def _joined(value: Any, cut: tuple[slice, ...] | None, xp: Any) -> Any:
    """A dense operand: the array itself (``cut`` None), or the Dask chunks it overlaps, cut and joined on axis 0."""
    if cut is not None:
        pieces = [chunk[s] for chunk, s in zip(value, cut)]
        value = pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis=0)
    return xp.ascontiguousarray(xp.asarray(value))


def run_block(plan: Any, k: int, rows: Rows, window: Window, ncols: int, pad_axis: int | None, partial: bool,
              names: tuple[str, ...], cuts: tuple[Any, ...], block: Any, *values: Any) -> Any:
    """Run ``plan``'s kernel on block ``k`` with its slices of the dense operands.

    ``cuts[n]`` says how operand ``n`` arrives (``_joined``).  ``pad_axis``:
    the output axis that follows the block's columns; the block computes
    only its window of it, placed into the full width here (or, with
    ``partial``, returned as ``(lo, out)`` for a tree sum).
    """
    def call() -> Any:
        xp = _array_module(plan.target)
        operands = {name: _joined(v, cut, xp) for name, v, cut in zip(names, values, cuts)}
        out = plan.kernel_for(block)(**{plan.operand: block}, **operands)
        if partial:
            return window[0], out
        if pad_axis is None or isinstance(out, SparseTensor):
            return out
        full = xp.zeros(out.shape[:pad_axis] + (ncols,) + out.shape[pad_axis + 1:], out.dtype)
        full[(slice(None),) * pad_axis + (slice(window[0], window[1]),)] = out
        return full

    return _guarded(k, rows, call)


def add_partials(*parts: tuple[int, Any]) -> tuple[int, Any]:
    """One step of the tree sum: windowed partial vectors added into their common window."""
    lo = min(p[0] for p in parts)
    hi = max(p[0] + p[1].shape[0] for p in parts)
    first = parts[0][1]
    xp = np if isinstance(first, np.ndarray) else _array_module("cuda")
    total = xp.zeros((hi - lo,) + first.shape[1:], first.dtype)
    for start, vec in parts:
        total[start - lo:start - lo + vec.shape[0]] += vec
    return lo, total


def place_partial(part: tuple[int, Any], length: int) -> Any:
    """The tree sum's root in the full length of the result."""
    lo, vec = add_partials(part)
    if lo == 0 and vec.shape[0] == length:
        return vec
    xp = np if isinstance(vec, np.ndarray) else _array_module("cuda")
    out = xp.zeros((length,) + vec.shape[1:], vec.dtype)
    out[lo:lo + vec.shape[0]] = vec
    return out
