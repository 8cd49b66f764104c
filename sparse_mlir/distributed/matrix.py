"""Row- and column-sharded sparse matrices over Dask arrays, with our kernels mapped over the blocks.

``RowShardedMatrix.blocks`` is a Dask array of shape ``(nrows, ncols)``
chunked along rows only, whose chunk ``k`` is a CSR ``SparseTensor`` holding
rows ``rows[k]`` restricted to the columns ``windows[k]`` they touch.  A
kernel mapped over the blocks gets, for every dense operand, the slice its
block needs: rows ``r0:r1`` for an operand indexed like the matrix's rows,
``lo:hi`` for one indexed like its columns, the whole array otherwise; so a
``RowShardedMatrix @ x`` on a row-chunked ``x`` moves only the window of
``x`` each block reads.  Results are Dask arrays chunked like the rows (a
sparse result is a ``RowShardedMatrix`` with the same layout).
``ColumnShardedMatrix`` (``A.T``) multiplies block by block with the
transposed kernel and sums the windowed partial results in a tree.

Dask arrays are only containers here: the products come from our kernels,
run on the workers as exports shipped from the client or compiled there
(``kernels``).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparse_mlir.distributed import blocks as B
from sparse_mlir.distributed.kernels import SHIP_MODES, KernelPlan, make_plan
from sparse_mlir.dsl.plan import plan as plan_spec
from sparse_mlir.dtypes import check_dtype, whole_number
from sparse_mlir.errors import FormatError, OperandError, ShapeError
from sparse_mlir.formats import CSR, Format
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["Layout", "RowShardedMatrix", "ColumnShardedMatrix", "row_bounds"]

_INT32_MAX = np.iinfo(np.int32).max
# task names: unique per client process (a random tag drawn once) and per graph (a counter), so two clients of
# one scheduler never collide; drawing a uuid per product cost milliseconds on a machine short of entropy
_TAG = os.urandom(6).hex()
_serial = itertools.count()


def _unique(prefix: str) -> str:
    return f"{prefix}-{_TAG}-{next(_serial)}"


def row_bounds(nrows: int, chunks: int | tuple[int, ...] | None) -> list[tuple[int, int]]:
    """``(r0, r1)`` of each row block: ``chunks`` rows per block, explicit block sizes, or 4 even blocks."""
    if chunks is None:
        chunks = max(1, math.ceil(nrows / 4))
    if isinstance(chunks, (int, np.integer)) and not isinstance(chunks, (bool, np.bool_)):
        chunks = int(chunks)
        if chunks < 1:
            raise ShapeError(f"chunks must be a positive number of rows, got {chunks}")
        sizes = [min(chunks, nrows - r) for r in range(0, nrows, chunks)] or [0]
    else:
        try:
            sizes = [operator.index(s) for s in chunks if not isinstance(s, (bool, np.bool_))]
            if len(sizes) != len(chunks):
                raise TypeError
        except TypeError:
            raise ShapeError(f"chunks must be a number of rows or a sequence of block sizes, got {chunks!r}") from None
        # an empty block of a matrix with rows was dropped by dask's concatenate, pairing blocks with wrong rows
        if sum(sizes) != nrows or min(sizes, default=0) < (1 if nrows else 0):
            raise ShapeError(f"row chunks {tuple(sizes)} must be positive and add up to the {nrows} rows")
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
    return list(zip(starts[:-1], starts[1:]))


def _block_format(rows: int, cols: int, nnz: int) -> Format:
    """CSR with 32-bit indices, or 64-bit when the block needs them (as ``SparseTensor`` would choose)."""
    return CSR if max(rows, cols, nnz) <= _INT32_MAX else CSR.with_widths(64, 64)


@dataclass(frozen=True)
class Layout:
    """Where each block sits: its rows, its column window and its storage format (known on the client)."""

    shape: tuple[int, int]
    rows: tuple[tuple[int, int], ...]
    windows: tuple[tuple[int, int], ...]
    formats: tuple[Format, ...]

    @property
    def row_chunks(self) -> tuple[int, ...]:
        return tuple(r1 - r0 for r0, r1 in self.rows)

    def block_keys(self) -> set[tuple]:
        """The distinct (shape, widths) of the blocks: one export each."""
        return {((r1 - r0, hi - lo), f.pos_width, f.crd_width)
                for (r0, r1), (lo, hi), f in zip(self.rows, self.windows, self.formats)}


def _stack(parts: list[Any], layout: Layout, dtype: np.dtype) -> Any:
    """A Dask array of shape ``layout.shape`` whose chunk ``k`` is the block ``parts[k]`` (a Delayed)."""
    import dask.array as da

    meta = np.empty((0, 0), dtype)
    arrays = [da.from_delayed(p, shape=(r1 - r0, layout.shape[1]), dtype=dtype, meta=meta)
              for p, (r0, r1) in zip(parts, layout.rows)]
    return da.concatenate(arrays, axis=0) if len(arrays) > 1 else arrays[0]


class RowShardedMatrix:
    """A sparse matrix split into row blocks held by Dask (``blocks``), multiplied with our kernels.

    ``ship`` chooses how workers get kernels (``"artifact"``: exported on the
    client, run with ``sm.load_kernel``, no MLIR on the workers;
    ``"compile"``: compiled on the workers through the shared disk cache).
    """

    def __init__(self, blocks: Any, layout: Layout, dtype: Any, *, ship: str = "artifact", target: str = "cpu"):
        if ship not in SHIP_MODES:
            raise OperandError(f"ship must be one of {SHIP_MODES}, got {ship!r}")
        self.blocks = blocks
        self.layout = layout
        self.dtype = check_dtype(dtype, "sharded matrix")
        self.ship = ship
        self.target = target

    # -- building ---------------------------------------------------------------------------------------------
    @classmethod
    def from_scipy(cls, matrix: Any, chunks: int | tuple[int, ...] | None = None, *, dtype: Any = None,
                   ship: str = "artifact") -> RowShardedMatrix:
        """Split a scipy matrix into row blocks; each is converted to a SparseTensor once, on a worker."""
        from dask import delayed

        if not hasattr(matrix, "tocsr"):
            raise OperandError(f"from_scipy takes a scipy.sparse matrix, got {type(matrix).__name__} "
                               f"(scipy.sparse.csr_matrix(dense) makes one)")
        csr = matrix.tocsr()
        dtype = check_dtype(dtype if dtype is not None else csr.dtype, "sharded matrix")
        rows = row_bounds(csr.shape[0], chunks)
        windows, formats, pieces = [], [], []
        tag = _unique("sm-block")
        for r0, r1 in rows:
            piece = csr[r0:r1]
            window = B.window_of(piece.indices, csr.shape[1])
            windows.append(window)
            formats.append(_block_format(r1 - r0, window[1] - window[0], piece.nnz))
            pieces.append(piece)
        # the pieces travel inside the graph (not scattered): a block lost with its worker is rebuilt from them
        parts = [delayed(B.as_block, pure=False)(k, rows[k], windows[k], formats[k], dtype, piece,
                                                 dask_key_name=f"{tag}-{k}") for k, piece in enumerate(pieces)]
        layout = Layout(csr.shape, tuple(rows), tuple(windows), tuple(formats))
        return cls(_stack(parts, layout, dtype), layout, dtype, ship=ship)

    @classmethod
    def from_blocks(cls, chunks: list[Any], ncols: int | None = None, *, row_sizes: list[int] | None = None,
                    dtype: Any = None, ship: str = "artifact") -> RowShardedMatrix:
        """Stack existing row blocks: SparseTensors, scipy matrices, or Dask Delayed/Futures of either.

        Blocks whose shape the client cannot see (Delayed, Futures) need
        ``row_sizes`` and ``ncols``.  Each block is checked (and converted
        to CSR if needed) on a worker; a bad one raises the library's error
        there, which reaches the client naming the chunk.
        """
        from dask import delayed

        shapes = [tuple(c.shape) if _known(c) else None for c in chunks]
        if row_sizes is None:
            if any(s is None for s in shapes):
                raise ShapeError("from_blocks needs row_sizes (and ncols) for blocks given as Delayed or Futures")
            row_sizes = [s[0] for s in shapes]
        if ncols is None:
            known = {s[1] for s in shapes if s is not None}
            if len(known) != 1:
                raise ShapeError(f"the blocks disagree on the number of columns ({sorted(known)}): give ncols")
            ncols = known.pop()
        if dtype is None:
            dtypes = {np.dtype(c.dtype) for c in chunks if _known(c)}
            if len(dtypes) != 1:
                raise ShapeError("from_blocks needs dtype= when the blocks' dtypes are not all known and equal")
            dtype = dtypes.pop()
        dtype = check_dtype(dtype, "sharded matrix")
        if len(row_sizes) != len(chunks):
            raise ShapeError(f"row_sizes gives {len(row_sizes)} sizes for {len(chunks)} blocks")
        try:
            nrows = sum(operator.index(s) for s in row_sizes)
        except TypeError:
            raise ShapeError(f"row_sizes must be whole numbers of rows, got {row_sizes!r}") from None
        rows = row_bounds(nrows, tuple(row_sizes))
        formats = tuple(_existing_format(c, r1 - r0, ncols) for c, (r0, r1) in zip(chunks, rows))
        tag = _unique("sm-block")
        parts = [delayed(B.as_block, pure=False)(k, rows[k], (0, ncols), formats[k], dtype, c,
                                                  dask_key_name=f"{tag}-{k}") for k, c in enumerate(chunks)]
        layout = Layout((nrows, ncols), tuple(rows), ((0, ncols),) * len(rows), formats)
        return cls(_stack(parts, layout, dtype), layout, dtype, ship=ship)

    @classmethod
    def from_file(cls, path: str | Path, chunks: int | tuple[int, ...] | None = None, *, dtype: Any = None,
                  ship: str = "artifact") -> RowShardedMatrix:
        """A Matrix Market / ``.smtx`` / ``.smt`` / ``.npz`` file, read by the workers.

        Each worker reads the file once with the package's readers
        (``sparse_mlir.io.matrix_files.load_any``: a ``.smt`` is memory-mapped) and cuts
        its row blocks from it; one small task first reads the layout (shape
        and the column window of every block) for the client to plan with.
        """
        from dask import delayed

        path = str(Path(path).resolve())
        stamp = B.file_stamp(path)
        bounds = functools.partial(row_bounds, chunks=chunks)
        info = delayed(B.probe_file, pure=True)(path, stamp, bounds).compute()
        dtype = check_dtype(dtype if dtype is not None else np.dtype(info["dtype"]), "sharded matrix")
        rows, windows = tuple(map(tuple, info["rows"])), tuple(map(tuple, info["windows"]))
        formats = tuple(_block_format(r1 - r0, hi - lo, n) for (r0, r1), (lo, hi), n in zip(rows, windows, info["nnz"]))
        parts = [delayed(B.file_block, pure=True)(path, stamp, k, rows[k], windows[k], formats[k], dtype)
                 for k in range(len(rows))]
        layout = Layout(tuple(info["shape"]), rows, windows, formats)
        return cls(_stack(parts, layout, dtype), layout, dtype, ship=ship)

    # -- shape and movement -------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.shape

    @property
    def nblocks(self) -> int:
        return len(self.layout.rows)

    @property
    def T(self) -> ColumnShardedMatrix:  # noqa: N802 - as numpy
        """The transpose, sharded by columns (the same blocks, nothing moves)."""
        return ColumnShardedMatrix(self)

    def _like(self, blocks: Any) -> RowShardedMatrix:
        return type(self)(blocks, self.layout, self.dtype, ship=self.ship, target=self.target)

    def persist(self) -> RowShardedMatrix:
        """Build the blocks on the workers and keep them there (what every later product reads)."""
        return self._like(self.blocks.persist())

    def to(self, device: str) -> RowShardedMatrix:
        """``"cuda"``: blocks moved to each worker's GPU (``SparseTensor.to``), kernels compiled there for CuPy."""
        if device not in ("cpu", "cuda"):
            raise OperandError(f"unknown device {device!r}; devices: cpu, cuda")
        if device == self.target:
            return self
        if self.target != "cpu":
            raise OperandError("device blocks do not come back to the host through to(); rebuild the matrix")
        moved = self.blocks.map_blocks(B.to_device, device, meta=np.empty((0, 0), self.dtype))
        return type(self)(moved, self.layout, self.dtype, ship="compile", target=device)

    def block_list(self) -> list[Any]:
        """The blocks as Delayed objects, one per row block."""
        return list(self.blocks.to_delayed(optimize_graph=False).ravel())

    def to_scipy(self) -> Any:
        """Gather the matrix on the client as scipy CSR (small matrices, checks)."""
        import dask
        import scipy.sparse as sp

        blocks = dask.compute(*self.block_list())
        ncols = self.shape[1]
        return sp.vstack([B.block_to_scipy(b, w, ncols) for b, w in zip(blocks, self.layout.windows)], format="csr")

    # -- products -------------------------------------------------------------------------------------------------
    def __matmul__(self, other: Any) -> Any:
        """``A @ x`` (SpMV) or ``A @ X`` (SpMM), chunked like A's rows."""
        ndim = np.ndim(other) if not hasattr(other, "dask") else other.ndim
        if ndim == 1:
            return self.map_kernel("y[i] = A[i,j] * x[j]", x=other)
        if ndim == 2:
            return self.map_kernel("C[i,j] = A[i,k] * B[k,j]", B=other)
        raise ShapeError(f"a sharded matrix multiplies a vector or a matrix, got {ndim} dimensions")

    def map_kernel(self, kernel: Any, operand: str | None = None, **operands: Any) -> Any:
        """Run a compiled kernel (or an expression, compiled with this matrix's dtype) on every row block.

        ``operand`` names the kernel's sparse operand that the blocks are
        (default: its only sparse input).  The result's first index must be
        that operand's row index; a dense result is a Dask array chunked like
        the rows, a sparse one a ``RowShardedMatrix``.
        """
        spec, operand = _spec_of(kernel, operand, self.dtype)
        call = _Call(spec, operand, operands, self.layout, reduce=False)
        plan = make_plan(spec.expression, operand, dict(spec.formats), spec.dtype.name, self.layout.block_keys(),
                         ship=self.ship, target=self.target)
        graph = _Graph("sm-map", self.blocks, call)
        keys = graph.run_blocks(plan, self, partial=False)
        if spec.sparse_output:
            return self._like(graph.array(keys, ((self.layout.row_chunks), (self.shape[1],)),
                                          np.empty((0, 0), spec.output_dtype)))
        chunks = (self.layout.row_chunks, *((s,) for s in call.out_shape[1:]))
        return graph.array(keys, chunks, _meta(call.ndim_out, spec.output_dtype, self.target))


class ColumnShardedMatrix:
    """A sparse matrix split into column blocks: the transpose of a ``RowShardedMatrix``.

    ``M @ x`` runs the transposed kernel on every block with that block's
    slice of ``x`` and adds the partial results in a tree
    (``split_every`` at a time), so no worker ever holds more than a few
    partial vectors, each only as long as its block's window.
    """

    def __init__(self, rows: RowShardedMatrix, split_every: int = 2):
        self.rows = rows
        self.split_every = whole_number(split_every, "split_every", OperandError, least=2)

    @classmethod
    def from_scipy(cls, matrix: Any, chunks: int | tuple[int, ...] | None = None, *, dtype: Any = None,
                   ship: str = "artifact") -> ColumnShardedMatrix:
        """Split a scipy matrix into column blocks (stored as the row blocks of its transpose)."""
        return RowShardedMatrix.from_scipy(matrix.T.tocsr(), chunks, dtype=dtype, ship=ship).T

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[::-1]

    @property
    def T(self) -> RowShardedMatrix:  # noqa: N802 - as numpy
        return self.rows

    def persist(self) -> ColumnShardedMatrix:
        return ColumnShardedMatrix(self.rows.persist(), self.split_every)

    def __matmul__(self, other: Any) -> Any:
        """``M @ x`` / ``M @ X``: per-block transposed products, tree-summed into one Dask chunk."""
        a = self.rows
        ndim = np.ndim(other) if not hasattr(other, "dask") else other.ndim
        if ndim not in (1, 2):
            raise ShapeError(f"a sharded matrix multiplies a vector or a matrix, got {ndim} dimensions")
        expression = "y[j] = A[i,j] * x[i]" if ndim == 1 else "C[j,m] = A[i,j] * X[i,m]"
        spec, operand = _spec_of(expression, "A", a.dtype)
        call = _Call(spec, operand, {"x" if ndim == 1 else "X": other}, a.layout, reduce=True)
        plan = make_plan(spec.expression, operand, dict(spec.formats), spec.dtype.name, a.layout.block_keys(),
                         ship=a.ship, target=a.target)
        graph = _Graph("sm-tmap", a.blocks, call)
        parts = graph.run_blocks(plan, a, partial=True)
        level = 0
        while len(parts) > 1:
            parts = [graph.task((f"{graph.name}-sum{level}", i), B.add_partials, *parts[i:i + self.split_every])
                     for i in range(0, len(parts), self.split_every)]
            level += 1
        root = graph.task((graph.name, 0) + (0,) * (call.ndim_out - 1), B.place_partial, parts[0], a.shape[1])
        chunks = ((a.shape[1],), *((s,) for s in call.out_shape[1:]))
        return graph.array([root], chunks, _meta(call.ndim_out, spec.output_dtype, a.target))


def _client() -> Any:
    """The distributed client in use, or None (no ``distributed``, or the local schedulers)."""
    try:
        import dask
        from distributed import default_client
    except ImportError:
        return None
    if dask.config.get("scheduler", None) not in (None, "dask.distributed", "distributed"):
        return None  # a local scheduler was asked for explicitly
    try:
        return default_client()
    except ValueError:
        return None


_plans: dict[tuple, Any] = {}  # (client id, plan token) -> Future of the plan, held on every worker


def _shipped(plan: KernelPlan) -> Any:
    """The plan scattered once to every worker (a Future), so a product's tasks never fetch it from one another.

    None without a distributed client.
    """
    from dask.tokenize import tokenize

    client = _client()
    if client is None:
        return None
    key = (client.id, tokenize(plan))
    future = _plans.get(key)
    if future is None or future.status != "finished":
        future = _plans[key] = client.scatter(plan, broadcast=True, hash=False)
    return future


def _known(chunk: Any) -> bool:
    """Whether the client can see a chunk's shape, dtype and nonzeros (not a Delayed or a Future)."""
    import scipy.sparse as sp

    return isinstance(chunk, SparseTensor) or sp.issparse(chunk)


def _existing_format(chunk: Any, rows: int, ncols: int) -> Format:
    """A CSR SparseTensor keeps its widths; anything else becomes CSR of the widths its size needs."""
    if isinstance(chunk, SparseTensor) and chunk.format == CSR.with_widths(chunk.format.pos_width,
                                                                           chunk.format.crd_width):
        return chunk.format
    return _block_format(rows, ncols, int(chunk.nnz) if _known(chunk) else 0)


@functools.lru_cache(maxsize=64)
def _planned(expression: str, operand: str, dtype: str) -> Any:
    """The spec of an expression with a CSR ``operand`` (parsed once: a solver asks for it every step)."""
    return plan_spec(expression, {operand: CSR}, dtype)


def _spec_of(kernel: Any, operand: str | None, dtype: np.dtype) -> tuple[Any, str]:
    """The kernel's spec (no MLIR needed) and the name of its sharded operand."""
    if isinstance(kernel, str):
        spec = _planned(kernel, operand or "A", dtype.name)
    elif hasattr(kernel, "spec"):
        spec = kernel.spec
    else:
        raise OperandError(f"map_kernel takes a kernel from sm.compile or an expression, got {type(kernel).__name__}")
    sparse = [n for n in spec.inputs if spec.is_sparse(n)]
    if operand is None:
        if len(sparse) != 1:
            raise OperandError(f"{spec.expression!r} has sparse inputs {sparse}: name the sharded one (operand=)")
        operand = sparse[0]
    if operand not in sparse:
        raise OperandError(f"{operand!r} is not a sparse input of {spec.expression!r}")
    if len(sparse) > 1:
        raise OperandError(f"{spec.expression!r}: only the sharded operand {operand!r} may be sparse, not {sparse}")
    fmt = spec.formats[operand]
    if fmt != CSR.with_widths(fmt.pos_width, fmt.crd_width):
        raise FormatError(f"the blocks are CSR, but the kernel declares {operand} as {fmt}")
    if spec.dtype != dtype:
        raise OperandError(f"the kernel computes in {spec.dtype}, the matrix holds {dtype}")
    return spec, operand


def _meta(ndim: int, dtype: np.dtype, target: str) -> Any:
    if target == "cuda":
        import cupy

        return cupy.empty((0,) * ndim, dtype)
    return np.empty((0,) * ndim, dtype)


def _one_chunk_across(value: Any) -> Any:
    """A Dask operand rechunked to one chunk along every axis but the first (blocks take whole rows of it); a
    dense operand must be a numpy or Dask array (a list was a bare ``AttributeError``)."""
    if not (hasattr(value, "dask") or isinstance(value, (np.ndarray, np.generic, int, float))):
        raise OperandError(f"dense operands of a sharded matrix are numpy or Dask arrays (or scalars), got "
                           f"{type(value).__name__}")
    if hasattr(value, "dask") and value.ndim > 1 and any(len(c) > 1 for c in value.chunks[1:]):
        return value.rechunk({axis: -1 for axis in range(1, value.ndim)})
    return value


class _Call:
    """How one kernel's operands follow the blocks: which slice of each dense operand a block gets."""

    def __init__(self, spec: Any, operand: str, operands: dict[str, Any], layout: Layout, reduce: bool):
        self.layout = layout
        row, col = spec.operand_index(operand)
        missing = [n for n in spec.inputs if n != operand and n not in operands]
        extra = [n for n in operands if n not in spec.inputs or n == operand]
        if missing or extra:
            raise OperandError(f"{spec.expression!r}: missing operands {missing}, unknown operands {extra}")
        self.names = tuple(n for n in spec.inputs if n != operand)
        self.values = [_one_chunk_across(operands[n]) for n in self.names]
        # per operand and axis: "rows" (cut to the block's rows), "window" (to its columns) or None (whole)
        self.roles: list[tuple[str | None, ...]] = []
        sizes = {row: layout.shape[0], col: layout.shape[1]}
        for name, value in zip(self.names, self.values):
            index = spec.operand_index(name)
            self.roles.append(tuple("rows" if i == row else "window" if i == col else None for i in index))
            for axis, idx in enumerate(index):
                size = int(value.shape[axis])
                if sizes.setdefault(idx, size) != size:
                    raise ShapeError(f"{name} axis {axis} ({idx}) has size {size}, expected {sizes[idx]}")
        out = spec.output_indices
        self.ndim_out = len(out)
        self.out_shape = tuple(sizes[i] for i in out)
        if reduce:
            if out[:1] != (col,) or row in out:
                raise OperandError(f"{spec.expression!r}: a column-sharded product must sum over {operand}'s rows")
            self.pad_axis = None
        else:
            if out[:1] != (row,) or row in out[1:]:
                raise OperandError(f"{spec.expression!r}: the result's first index must be {operand}'s row index "
                                   f"{row!r} (and only that one)")
            if spec.sparse_output and out != (row, col):
                raise OperandError(f"{spec.expression!r}: a sparse result must be indexed like {operand} ({row},{col})")
            self.pad_axis = None if spec.sparse_output or col not in out else out.index(col)
        self.dtype = spec.output_dtype

    def pieces(self, k: int) -> tuple[list[Any], tuple[Any, ...]]:
        """Block ``k``'s piece of each dense operand, and how it arrives (``blocks._joined``).

        A numpy operand is sliced here and travels in the task; a Dask one
        is passed as the keys of the chunks its slice overlaps along axis 0
        with the cut of each, so the task depends on those chunks only.
        """
        bounds = {"rows": self.layout.rows[k], "window": self.layout.windows[k]}
        values, cuts = [], []
        for value, roles in zip(self.values, self.roles):
            cut = tuple(slice(*bounds[r]) if r else slice(None) for r in roles)
            if not hasattr(value, "dask"):
                values.append(value[cut])
                cuts.append(None)
                continue
            start, stop, _ = cut[0].indices(value.shape[0]) if cut else (0, 0, 1)
            keys, parts = [], []
            offsets = np.concatenate([[0], np.cumsum(value.chunks[0])]).astype(int)
            for c in range(len(value.chunks[0])):
                a, b = max(start, offsets[c]), min(stop, offsets[c + 1])
                if a < b or (start == stop and c == 0):
                    keys.append((value.name, c) + (0,) * (value.ndim - 1))
                    parts.append((slice(a - offsets[c], b - offsets[c]), *cut[1:]))
            values.append(keys)
            cuts.append(tuple(parts))
        return values, tuple(cuts)

    def operands(self) -> list[Any]:
        """The dense operands as Dask needs them (one chunk along every axis but the first)."""
        return [v for v in self.values if hasattr(v, "dask")]


class _Graph:
    """A hand-built Dask layer: one task per block, with direct references to the chunks it reads.

    (Building it through ``dask.delayed`` costs tens of milliseconds per
    product in graph traversal; this is what a solver's every step pays.)
    """

    def __init__(self, prefix: str, blocks: Any, call: _Call):
        self.name = _unique(prefix)
        self.layer: dict[Any, Any] = {}
        self.call = call
        self.dependencies = [blocks, *call.operands()]

    def task(self, key: tuple, func: Any, *args: Any) -> tuple:
        """Add ``func(*args)`` under ``key`` (keys in ``args`` are replaced by their results)."""
        self.layer[key] = (func, *args)
        return key

    def run_blocks(self, plan: KernelPlan, matrix: RowShardedMatrix, partial: bool) -> list[tuple]:
        layout, call = matrix.layout, self.call
        plan_key = _shipped(plan)
        if plan_key is None:  # no distributed client: the plan is a node of this graph
            plan_key = f"{self.name}-plan"
            self.layer[plan_key] = plan
        block_keys = [k[0] for k in matrix.blocks.__dask_keys__()]
        keys = []
        for k, block in enumerate(block_keys):
            values, cuts = call.pieces(k)
            key = (f"{self.name}-part", k) if partial else (self.name, k) + (0,) * (call.ndim_out - 1)
            self.layer[key] = (B.run_block, plan_key, k, layout.rows[k], layout.windows[k], layout.shape[1],
                               call.pad_axis, partial, call.names, cuts, block, *values)
            keys.append(key)
        return keys

    def array(self, keys: list[tuple], chunks: tuple, meta: Any) -> Any:
        """The layer as a Dask array whose chunks are the tasks ``keys`` (in order)."""
        import dask.array as da
        from dask.highlevelgraph import HighLevelGraph

        name = self.name
        for i, key in enumerate(keys):
            want = (name, i) + (0,) * (len(chunks) - 1)
            if key != want:
                self.layer[want] = key  # an alias: that chunk is this task's result
        graph = HighLevelGraph.from_collections(name, self.layer, dependencies=self.dependencies)
        return da.Array(graph, name, chunks=chunks, meta=meta)
