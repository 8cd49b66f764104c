"""``SparseTensor``: a format, a shape and validated level buffers on the host.

A tensor validates its buffers once, when built, and holds them as read-only
views, so kernels trust it afterwards: that is what makes passing a
``SparseTensor`` the fast way to call a kernel.  For that trust to hold, what
was checked cannot change afterwards: the tensor's attributes cannot be set
(``A.shape = ...`` on a checked tensor made a kernel read far outside it), and
a tensor keeps copies of the buffers it is given, unless nobody can write them
(a read-only mapped file), since the caller's own arrays stay writable (a
coordinate changed after the check crashed the kernel, and values changed
after a schedule cached a dense copy of them were not seen).  The one
exception is ``share_scipy``'s view of a scipy operand for one call
(``borrowed``): checked on every call, never kept by anything.  Builders
never modify what they are given.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from sparse_mlir.dtypes import SUPPORTED_DTYPES, check_dtype
from sparse_mlir.errors import DeviceError, DTypeError, FormatError, InvalidIndicesError, ShapeError, SparseMLIRError
from sparse_mlir.formats import BSR, COO, CSC, CSR, Format, LevelKind, as_format
from sparse_mlir.tensor import storage

# ``SUPPORTED_DTYPES`` and ``check_dtype`` live in ``sparse_mlir.dtypes``; they stay importable from here
__all__ = ["SparseTensor", "LevelBuffers", "exactly_tensor", "SUPPORTED_DTYPES", "check_dtype", "DEVICES",
           "register_device", "register_compile", "share_scipy"]

DEVICES = ("cpu", "cuda")

# Two things ``SparseTensor`` does belong to higher layers, which import this module: compiling the kernel of
# ``A @ B`` (``sparse_mlir.api``) and copying to a GPU (``sparse_mlir.tensor.device``).  Each registers its
# capability here when it is imported (``sparse_mlir.tensor`` imports ``device``, the package face ``api``), so
# this module imports neither.
_device_copies: dict[str, Callable[[SparseTensor], Any]] = {}
_compile: Callable[..., Any] | None = None


def register_device(device: str, copy: Callable[[SparseTensor], Any]) -> None:
    """Make ``SparseTensor.to(device)`` return ``copy(tensor)`` (``sparse_mlir.tensor.device`` registers "cuda")."""
    if device not in DEVICES or device == "cpu":
        raise DeviceError(f"cannot register device {device!r}; devices: {', '.join(DEVICES[1:])}")
    _device_copies[device] = copy


def register_compile(compile_kernel: Callable[..., Any]) -> None:
    """Make ``A @ B`` compile its kernel with ``compile_kernel(expression, formats=..., dtype=...)``
    (``sparse_mlir.api`` registers its ``compile``)."""
    global _compile
    _compile = compile_kernel
    _matmul_kernels.clear()


def _compile_kernel(expression: str, formats: dict[str, Format], dtype: np.dtype) -> Any:
    """The kernel ``A @ B`` runs: ``compile``'s, remembered here by the very arguments (``compile`` returns the
    same kernel for them every time, but finding it costs about 20 us, ten times a small SpMV)."""
    key = (expression, *formats.items(), dtype)
    kernel = _matmul_kernels.get(key)
    if kernel is None:
        if _compile is None:
            raise SparseMLIRError("A @ B compiles its kernel with the compile() sparse_mlir.api registers when "
                                  "imported (sparse_mlir.tensor.host.register_compile), and none is registered")
        kernel = _matmul_kernels[key] = _compile(expression, formats=formats, dtype=dtype)
    return kernel


_matmul_kernels: dict[tuple, Any] = {}
_MATVEC = "y[i] = A[i,k] * x[k]"
_MATMUL = "C[i,j] = A[i,k] * B[k,j]"


def _unchangeable(array: np.ndarray) -> bool:
    """Whether nothing in this process can write ``array``'s memory: a read-only view of read-only memory that
    is not a numpy array (whose holder may make it writeable again), such as a file mapped read-only or bytes."""
    if array.flags.writeable:
        return False
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, np.ndarray):
        return False
    try:
        return memoryview(base).readonly
    except TypeError:
        return False


def _readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _check_storable(shape: tuple[int, ...], fmt: Format) -> None:
    """Raise ``FormatError``/``ShapeError`` when ``fmt`` cannot hold a tensor of ``shape`` (a checked shape)."""
    fmt.check_shape(shape)
    storage.check_shape(shape, fmt)


def _fit_widths(fmt: Format, shape: tuple[int, ...], nnz: int) -> Format:
    """Widen index buffers to 64 bits when the shape or nnz does not fit the format's widths."""
    limit = np.iinfo(np.int32).max
    # only levels that store coordinates count: an N:M level's are offsets below m, whatever the shape
    stored = [size for size, level in zip(fmt.level_sizes(shape), fmt.levels) if level.kind is not LevelKind.DENSE]
    need_crd = fmt.crd_width not in (0, 64) and max(stored, default=0) > np.iinfo(
        storage.index_dtype(fmt.crd_width)).max
    need_pos = fmt.pos_width not in (0, 64) and nnz > min(limit, np.iinfo(storage.index_dtype(fmt.pos_width)).max)
    if not (need_crd or need_pos):
        return fmt
    return fmt.with_widths(64 if need_pos else None, 64 if need_crd else None)


class LevelBuffers:
    """What a sparse tensor reads off its shape and level buffers, wherever the buffers live."""

    __slots__ = ()
    shape: tuple[int, ...]
    buffers: tuple[Any, ...]

    @property
    def nnz(self) -> int:
        """Stored entries, explicit zeros included (as scipy counts them)."""
        return int(self.buffers[-1].size)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class SparseTensor(LevelBuffers):
    """A sparse tensor of order 1 to 3 in any :class:`~sparse_mlir.formats.Format`."""

    __slots__ = ("format", "shape", "dtype", "buffers", "borrowed", "__weakref__")

    def __init__(self, fmt: Format, shape: tuple[int, ...], buffers: tuple[np.ndarray, ...], *,
                 validate: bool = True):
        shape = storage.check_shape(shape)
        fmt = as_format(fmt, len(shape))
        if fmt.is_dense:
            raise FormatError("a SparseTensor needs a sparse format; use a numpy array for dense data")
        _check_storable(shape, fmt)
        try:
            buffers = tuple(np.asarray(b) for b in buffers)
        except TypeError:
            raise InvalidIndicesError(f"buffers must be a sequence of arrays {fmt.buffer_names}, "
                                      f"got {type(buffers).__name__}") from None
        if validate:
            _check_buffer_layout(fmt, buffers)
            # checked as the copies the tensor keeps (see the module's docstring)
            buffers = tuple(b if _unchangeable(b) else b.copy() for b in buffers)
        dtype = check_dtype(buffers[-1].dtype if buffers else None, "values")
        if validate:
            storage.validate(fmt, shape, buffers)
        self._hold(fmt, shape, dtype, buffers, borrowed=False)

    @classmethod
    def _trusted(cls, fmt: Format, shape: tuple[int, ...], buffers: tuple[np.ndarray, ...], *,
                 borrowed: bool = False) -> SparseTensor:
        """Wrap buffers a builder of this module has already checked (layout, bounds, dtype), skipping
        ``__init__``'s checks: what keeps a scipy operand's per-call cost at a few microseconds.  ``borrowed``:
        the buffers are the caller's own (``share_scipy``)."""
        self = object.__new__(cls)
        self._hold(fmt, shape, buffers[-1].dtype, buffers, borrowed=borrowed)
        return self

    def _hold(self, fmt: Format, shape: tuple[int, ...], dtype: np.dtype, buffers: tuple[np.ndarray, ...], *,
              borrowed: bool) -> None:
        """Set the attributes, once (``__setattr__`` refuses it afterwards)."""
        _set_format(self, fmt)
        _set_shape(self, shape)
        _set_dtype(self, dtype)
        _set_buffers(self, tuple(_readonly(np.ascontiguousarray(b)) for b in buffers))
        _set_borrowed(self, borrowed)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a SparseTensor cannot be changed once checked ({name}); build a new one")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a SparseTensor cannot be changed once checked ({name})")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its format, shape and buffers, checked again when loaded (a pickle may come from anywhere)."""
        return SparseTensor, (self.format, self.shape, self.buffers)

    # -- builders ---------------------------------------------------------------
    @classmethod
    def from_buffers(cls, fmt: Format | str, shape: tuple[int, ...], buffers: tuple[np.ndarray, ...]) -> SparseTensor:
        """Level buffers (in ``fmt.buffer_names`` order), validated and copied unless nothing can write them (see
        the module's docstring)."""
        return cls(as_format(fmt, len(shape)), shape, buffers)

    @classmethod
    def from_coo(cls, coords: Any, values: Any, shape: tuple[int, ...], format: Format | str = COO) -> SparseTensor:
        """Build from coordinates (ndim x nnz) and values; unsorted input is sorted and duplicates summed.

        ``coords`` must be ``(ndim, nnz)`` (one row per dimension, as
        ``np.nonzero`` gives them); a 1-d tensor also takes a flat list.  An
        ``(nnz, ndim)`` array is refused, not reshaped: reshaping it would
        silently build a different tensor.
        """
        shape = storage.check_shape(shape)
        fmt = as_format(format, len(shape))
        values = _array_of(values, "values", ShapeError)
        check_dtype(values.dtype, "values")
        if values.ndim != 1:
            raise ShapeError(f"values must be 1-d, got shape {values.shape}")
        _check_storable(shape, fmt)
        coords = _coordinate_rows(coords, len(shape), values.size)
        coords, values = storage.canonicalize(coords, values, shape, fmt)
        fmt = _fit_widths(fmt, shape, values.size)
        return cls(fmt, shape, storage.pack(fmt, shape, coords, values), validate=False)

    @classmethod
    def from_dense(cls, array: Any, format: Format | str, *, where: Any = None) -> SparseTensor:
        """Store the nonzeros of a dense array (NaN counts as a nonzero), or with ``where`` (a boolean array of
        its shape) exactly the entries where it is True, zeros included (a pruning mask that keeps a zero).

        A row N:M format over whole groups is packed straight from the
        groups (``storage.pack_row_nm``: 4096^2 at 2:4 in 0.04 s, not 0.6),
        any other through coordinates.
        """
        array = _array_of(array, "the dense array", ShapeError)
        if not 1 <= array.ndim <= 3:
            raise ShapeError(f"sparse tensors have 1 to 3 dimensions, got {array.ndim}")
        check_dtype(array.dtype, "dense array")
        kept = None if where is None else _array_of(where, "where", ShapeError)
        if kept is not None and kept.dtype != np.bool_:
            raise DTypeError(f"where must be a boolean array, got dtype {kept.dtype}")
        if kept is not None and kept.shape != array.shape:
            raise ShapeError(f"where has shape {kept.shape}, the array {array.shape}")
        fmt = as_format(format, array.ndim)
        if storage.is_row_nm(fmt) and array.ndim == 2 and array.shape[1] % fmt.levels[-1].m == 0:
            buffers = storage.pack_row_nm(fmt, array, kept)  # the constructor checks the shape against fmt
            return cls(_fit_widths(fmt, array.shape, buffers[-1].size), array.shape, buffers, validate=False)
        coords = np.array(np.nonzero(array if kept is None else kept), dtype=np.int64).reshape(array.ndim, -1)
        return cls.from_coo(coords, array[tuple(coords)], array.shape, fmt)

    @classmethod
    def from_scipy(cls, matrix: Any, format: Format | str | None = None) -> SparseTensor:
        """Build from a scipy.sparse matrix or array.

        The format defaults to the matrix's own (csr, csc, coo, bsr; others go
        through CSR).  When it is the matrix's own layout, scipy says the
        matrix is canonical (``has_canonical_format``) and its indices are of
        the format's width, its buffers are copied as they are (checked by
        ``share_scipy``): the tensor never shares the matrix's memory (see
        the module's docstring).  Otherwise a sorted, duplicate-summed copy
        is built; int64 indices are narrowed when they fit and the format is
        widened to 64 bits when they do not.  Kernels take scipy operands through ``share_scipy`` directly,
        at scipy's own index widths.
        """
        import scipy.sparse as sp

        if not sp.issparse(matrix):
            raise FormatError(f"from_scipy expects a scipy.sparse matrix, got {type(matrix).__name__}")
        check_dtype(matrix.dtype, "scipy matrix values")
        kind = matrix.format
        fmt = as_format(format, 2) if format is not None else _SCIPY_FORMATS.get(kind, CSR)
        if kind == "bsr" and format is None:
            fmt = BSR(*matrix.blocksize)
        shared = share_scipy(matrix, fmt)
        if shared is not None and shared.format == fmt:
            return cls._trusted(fmt, shared.shape, tuple(b.copy() for b in shared.buffers))
        _check_scipy_structure(matrix)
        coo = _native_indices(matrix).tocoo()
        return cls.from_coo(np.vstack([coo.row, coo.col]), coo.data, matrix.shape, fmt)

    # -- views ------------------------------------------------------------------
    @property
    def values(self) -> np.ndarray:
        return self.buffers[-1]

    def buffer(self, name: str) -> np.ndarray:
        """A level buffer by name (``pos1``, ``crd1``, ``values``)."""
        return self.buffers[self.format.buffer_names.index(name)]

    def to_coo(self) -> tuple[np.ndarray, np.ndarray]:
        """Coordinates (ndim x nnz) and values of every stored entry, in storage order."""
        return storage.unpack(self.format, self.shape, self.buffers)

    def to_dense(self) -> np.ndarray:
        try:
            out = np.zeros(self.shape, dtype=self.dtype)
        except (MemoryError, ValueError) as exc:  # (2**40, 2**40) with two entries: "array is too big"
            raise ShapeError(f"a dense {self.shape} array of {self.dtype} cannot be allocated: {exc}") from None
        coords, values = self.to_coo()
        np.add.at(out, tuple(coords), values)
        return out

    def to_scipy(self, kind: str = "array") -> Any:
        """A scipy sparse array (2-d only; ``kind="matrix"``: the legacy matrix types): csr/csc/bsr/coo share
        buffers, other formats convert."""
        import scipy.sparse as sp

        if kind not in ("array", "matrix"):
            raise FormatError(f"to_scipy(kind=...) is 'array' or 'matrix', got {kind!r}")
        if self.ndim != 2:
            raise FormatError(f"to_scipy needs a 2-d tensor, got {self.ndim}-d")
        if self.dtype == np.float16:  # scipy.sparse refuses it with a bare ValueError
            raise DTypeError("scipy.sparse has no float16 matrices; convert the values first "
                             "(t.astype('float32').to_scipy(): float32 holds every float16 exactly)")
        csr, csc, bsr, coo_type = ((sp.csr_array, sp.csc_array, sp.bsr_array, sp.coo_array) if kind == "array" else
                                   (sp.csr_matrix, sp.csc_matrix, sp.bsr_matrix, sp.coo_matrix))
        fmt, b = self.format, self.buffers
        if fmt == CSR.with_widths(fmt.pos_width, fmt.crd_width):
            return csr((b[2], b[1], b[0]), shape=self.shape)
        if fmt == CSC.with_widths(fmt.pos_width, fmt.crd_width):
            return csc((b[2], b[1], b[0]), shape=self.shape)
        bm_bn = fmt.block_factors
        if not fmt.is_nm and bm_bn and fmt == BSR(bm_bn[0], bm_bn[1]).with_widths(fmt.pos_width, fmt.crd_width):
            blocks = b[2].reshape(-1, bm_bn[0], bm_bn[1])
            return bsr((blocks, b[1], b[0]), shape=self.shape)
        coords, values = self.to_coo()
        coo = coo_type((values, (coords[0], coords[1])), shape=self.shape)
        if fmt == COO.with_widths(fmt.pos_width, fmt.crd_width):
            return coo
        try:
            return coo.tocsr()
        except (MemoryError, ValueError) as exc:  # a DCSR of 2**40 rows: 8 TiB of CSR row positions
            raise ShapeError(f"a {self.shape} tensor cannot be held as scipy CSR ({exc}); take it as COO with "
                             f"t.to_coo()") from None

    # -- the array protocol (scipy's sparray habits) ------------------------------
    __array_ufunc__ = None  # numpy defers ``x @ A`` to ``A.__rmatmul__`` instead of making an object array

    def toarray(self) -> np.ndarray:
        """The dense array (as scipy's ``toarray``)."""
        return self.to_dense()

    todense = toarray

    def astype(self, dtype: Any) -> SparseTensor:
        """The same pattern with values cast to ``dtype`` (index buffers shared)."""
        target = check_dtype(dtype, "astype")
        if target == self.dtype:
            return self
        return SparseTensor._trusted(self.format, self.shape, (*self.buffers[:-1], self.values.astype(target)),
                                     borrowed=self.borrowed)

    @property
    def T(self) -> SparseTensor:
        """The transpose: CSR and CSC swap into each other over the same buffers; other 2-d formats convert."""
        if self.ndim != 2:
            raise ShapeError(f".T transposes 2-d tensors, got {self.ndim}-d")
        fmt = self.format
        for here, there in ((CSR, CSC), (CSC, CSR)):
            if fmt == here.with_widths(fmt.pos_width, fmt.crd_width):
                return SparseTensor._trusted(there.with_widths(fmt.pos_width, fmt.crd_width), self.shape[::-1],
                                             self.buffers, borrowed=self.borrowed)
        coords, values = self.to_coo()
        return SparseTensor.from_coo(coords[::-1], values, self.shape[::-1], fmt)

    def __matmul__(self, other: Any) -> Any:
        """``A @ B`` with ``B`` dense (1-d: SpMV, 2-d: SpMM) or sparse (a CSR result), through a cached kernel of
        ``A``'s format and dtype."""
        if type(other) is np.ndarray and len(self.shape) == 2:  # the common case, in as few steps as it takes
            kernel = _matmul_kernels.get((_MATVEC if other.ndim == 1 else _MATMUL, ("A", self.format), self.dtype))
            if kernel is not None:
                return kernel(A=self, x=other) if other.ndim == 1 else kernel(A=self, B=other)
        if self.ndim != 2:
            raise ShapeError(f"@ takes a 2-d sparse tensor, got {self.ndim}-d")
        if isinstance(other, SparseTensor):
            a = self
            if a.format == CSC.with_widths(a.format.pos_width, a.format.crd_width) and \
                    other.format != CSC.with_widths(other.format.pos_width, other.format.crd_width):
                # the sparsifier cannot write a CSR result walking a CSC A against another format of B
                # ("failed to legalize unresolved materialization"): A goes row-major first
                coords, values = a.to_coo()
                a = SparseTensor.from_coo(coords, values, a.shape, CSR)
            kernel = _compile_kernel(_MATMUL, {"A": a.format, "B": other.format, "C": CSR}, a.dtype)
            return kernel(A=a, B=other)
        rank = getattr(other, "ndim", None)
        if rank not in (1, 2):
            raise ShapeError(f"@ takes a 1-d or 2-d dense operand, got {type(other).__name__} of rank {rank}")
        expression = _MATVEC if rank == 1 else _MATMUL
        kernel = _compile_kernel(expression, {"A": self.format}, self.dtype)
        return kernel(A=self, **({"x": other} if rank == 1 else {"B": other}))

    def __rmatmul__(self, other: Any) -> Any:
        """``B @ A`` with dense ``B``: ``(A.T @ B.T).T``, over a zero-copy transpose for CSR/CSC."""
        rank = getattr(other, "ndim", None)
        if rank == 1:
            return self.T @ other
        if rank == 2:
            return (self.T @ other.T).T
        return NotImplemented

    def to(self, device: str) -> Any:
        """``"cuda"``: a ``DeviceSparseTensor`` with device copies of the buffers (needs CuPy); ``"cpu"``: self."""
        if device == "cpu":
            return self
        if device not in DEVICES:
            raise DeviceError(f"unknown device {device!r}; devices: {', '.join(DEVICES)}")
        copy = _device_copies.get(device)
        if copy is None:
            raise DeviceError(f"SparseTensor.to({device!r}) copies through sparse_mlir.tensor.device, which registers "
                              f"it when imported, and it has not been: import sparse_mlir.tensor.device")
        return copy(self)

    def __repr__(self) -> str:
        return f"SparseTensor(shape={self.shape}, format={self.format}, dtype={self.dtype}, nnz={self.nnz})"


# the slots' own setters, which ``SparseTensor.__setattr__`` does not let anything else reach
_set_format, _set_shape, _set_dtype, _set_buffers, _set_borrowed = (
    SparseTensor.__dict__[name].__set__ for name in ("format", "shape", "dtype", "buffers", "borrowed"))


def exactly_tensor(tensor: SparseTensor) -> SparseTensor:
    """``tensor`` if it is exactly a ``SparseTensor``; a subclass's slots checked again into one, since its own
    properties may report another shape or other buffers than were checked (a ``shape`` property made a kernel
    read outside the buffers)."""
    if type(tensor) is SparseTensor:
        return tensor
    slot = SparseTensor.__dict__
    return SparseTensor(slot["format"].__get__(tensor), slot["shape"].__get__(tensor), slot["buffers"].__get__(tensor))

_SCIPY_FORMATS = {"csr": CSR, "csc": CSC, "coo": COO}


def _check_buffer_layout(fmt: Format, buffers: tuple[np.ndarray, ...]) -> None:
    """Count, rank and index dtypes of level buffers, checked before anything reads their contents."""
    names = fmt.buffer_names
    if len(buffers) != len(names):
        raise InvalidIndicesError(f"format {fmt} needs {len(names)} buffers {names}, got {len(buffers)}")
    for name, buf in zip(names, buffers):
        if buf.ndim != 1:
            raise InvalidIndicesError(f"{name} must be a 1-d buffer, got shape {buf.shape}")
    for name, buf in zip(names[:-1], buffers[:-1]):
        want = storage.index_dtype(fmt.pos_width if name.startswith("pos") else fmt.crd_width)
        if buf.dtype != want:
            raise DTypeError(f"{name} has dtype {buf.dtype}, but format {fmt} stores {want}")


def _array_of(value: Any, what: str, error: type[SparseMLIRError]) -> np.ndarray:
    """``np.asarray(value)``, with numpy's ``ValueError`` for ragged nested lists raised as ``error``."""
    try:
        return np.asarray(value)
    except ValueError as exc:
        raise error(f"{what} must be a rectangular array ({exc})") from None


def _coordinate_rows(coords: Any, ndim: int, nnz: int) -> np.ndarray:
    """``coords`` as an ``(ndim, nnz)`` array, without guessing at any other layout.

    Only layouts with one reading are accepted: ``(ndim, nnz)`` itself, a
    flat list for a 1-d tensor, and an empty list when there are no entries.
    """
    array = _array_of(coords, "coordinates", InvalidIndicesError)
    if array.ndim == 1 and (ndim == 1 or array.size == 0 == nnz):
        return array.reshape(ndim, -1)
    if array.ndim == 2 and array.shape[0] == ndim:
        return array
    hint = ""
    if array.ndim == 2 and array.shape[1] == ndim:
        hint = f"; these look like ({array.shape[0]}, {ndim}) coordinate pairs: pass coords.T"
    raise InvalidIndicesError(f"coordinates must have shape ({ndim}, nnz), one row per dimension, "
                              f"got {array.shape}{hint}")


def _scipy_layout(matrix: Any) -> tuple[Format, tuple[np.ndarray, ...], int, int] | None:
    """``(format, index buffers, outer extent, inner extent)`` of a csr/csc/bsr/coo matrix in this package's
    terms (index widths 32), or ``None`` for any other kind (dia, lil, dok, n-d coo...)."""
    kind = matrix.format
    if kind in ("csr", "csc", "bsr"):
        rows, cols = matrix.shape
        if kind == "bsr":
            bm, bn = matrix.blocksize
            return _bsr(bm, bn), (matrix.indptr, matrix.indices), rows // bm, cols // bn
        return ((CSR, (matrix.indptr, matrix.indices), rows, cols) if kind == "csr" else
                (CSC, (matrix.indptr, matrix.indices), cols, rows))
    if kind == "coo" and len(matrix.shape) == 2:
        return COO, (matrix.row, matrix.col), matrix.shape[0], matrix.shape[1]
    return None


@functools.lru_cache(maxsize=64)
def _bsr(bm: int, bn: int) -> Format:
    return BSR(bm, bn)  # building a Format costs microseconds; a scipy operand's call asks for the same one


_UNSIGNED = {np.dtype(t): np.dtype(u) for t, u in (("int8", "uint8"), ("int16", "uint16"), ("int32", "uint32"),
                                                    ("int64", "uint64"))}


def _check_scipy_structure(matrix: Any, layout: tuple | None = None) -> None:
    """Raise ``InvalidIndicesError`` for index buffers a kernel (or scipy itself) would read out of bounds.

    Vectorized and copy-free, so it runs on every call with a scipy operand:
    buffer lengths, ``indptr`` from 0 to nnz without decreasing, and every
    index in range, in one pass over the indices (viewed as unsigned, a
    negative index is a huge one).  Order and duplicates are not checked here.
    ``layout`` is ``_scipy_layout(matrix)`` when the caller has it.
    """
    layout = layout or _scipy_layout(matrix)
    if layout is None:
        return
    _, index, outer, inner = layout
    kind = matrix.format
    values = matrix.data.shape[0]
    if kind == "coo":
        row, col = index
        if not row.size == col.size == values:
            raise InvalidIndicesError(f"coo has {row.size} row and {col.size} column indices and {values} values "
                                      f"(nnz mismatch)")
        _check_index_range(kind, "row index", row, matrix.shape[0])
        _check_index_range(kind, "column index", col, matrix.shape[1])
        return
    indptr, indices = index
    if indptr.ndim != 1 or indices.ndim != 1 or indptr.size != outer + 1:
        raise InvalidIndicesError(f"{kind} indptr must have {outer + 1} entries, got shape {indptr.shape}")
    if indptr[0] != 0 or (indptr[1:] < indptr[:-1]).any():
        raise InvalidIndicesError(f"{kind} indptr must start at 0 and be monotone non-decreasing")
    if indptr[-1] != indices.size or values != indices.size:
        raise InvalidIndicesError(f"{kind} indptr ends at {indptr[-1]} with {indices.size} indices and "
                                  f"{values} values (nnz mismatch)")
    _check_index_range(kind, "index", indices, inner)


def _check_index_range(kind: str, what: str, indices: np.ndarray, extent: int) -> None:
    if not indices.size:
        return
    unsigned = _UNSIGNED.get(indices.dtype)
    if unsigned is not None:  # one pass: a negative index viewed as unsigned is past any extent
        too_big = int(indices.view(unsigned).max()) >= extent
    else:
        too_big = indices.min() < 0 or indices.max() >= extent
    if too_big:
        bad = indices[(indices < 0) | (indices >= extent)][0]
        raise InvalidIndicesError(f"{kind} {what} {bad} is out of range [0, {extent})")


def share_scipy(matrix: Any, fmt: Format) -> SparseTensor | None:
    """A ``SparseTensor`` over a scipy matrix's own buffers (read-only views, no copy), or ``None`` when the
    matrix needs a converted copy to be in ``fmt``.

    Shared when ``fmt`` is the matrix's own layout (csr, csc, bsr with its
    blocksize, 2-d coo) whatever its index widths: the tensor takes scipy's
    widths (int32 or int64; kernels specialize on them), so nothing is
    narrowed or widened.  The structure and every index are checked on each
    call (``_check_scipy_structure``: vectorized, one pass, no copy); order
    and duplicates are taken from scipy's ``has_canonical_format``, which
    scipy computes once (in C) and caches on the matrix, as its own
    operations do, so a canonical matrix is never re-sorted or re-checked.
    A matrix whose flag lies (indices reordered in place after scipy cached
    it) stays safe: every index is in bounds, so a kernel reads nothing
    outside its buffers; it only sums in another order, or keeps duplicates
    a kernel with a sparse result may pass on, as scipy would.
    Raises ``InvalidIndicesError`` for a broken structure.
    """
    layout = _scipy_layout(matrix)
    if layout is None or (fmt is not layout[0] and fmt.with_widths(32, 32) != layout[0]):
        return None
    index = layout[1]
    for b in index:
        if type(b) is not np.ndarray or b.dtype not in _SHARED_INDEX_DTYPES:
            return None
    _check_scipy_structure(matrix, layout)
    if not matrix.has_canonical_format:  # scipy's flag: computed once, after the bounds checks made that safe
        return None
    known = _wrapped.get(id(matrix))
    if known is not None:
        ref, first, second, data, shape, asked, tensor = known
        if ref() is matrix and first is index[0] and second is index[1] and data is matrix.data \
                and shape == matrix.shape and asked is fmt:
            return tensor  # over the very buffer objects just checked
    tensor = _wrap_scipy(matrix, fmt, index)
    if tensor is not None:
        key = id(matrix)
        try:
            ref = weakref.ref(matrix, lambda _, key=key: _wrapped.pop(key, None))
        except TypeError:  # a subclass without weak references: wrapped again on every call
            return tensor
        _wrapped[key] = (ref, index[0], index[1], matrix.data, matrix.shape, fmt, tensor)
    return tensor


# id(matrix) -> (weak reference to it, its two index buffers, data and shape, the format asked for, the tensor over
# them): a scipy operand passed again comes back as the same tensor, whose native arguments the runtime has cached.
# Buffers are compared by identity, so a matrix given new arrays gets a new tensor, and values or indices changed
# in place are seen (and the indices checked again) on the next call; an entry leaves with its matrix.  (scipy
# matrices are unhashable, so this cannot be a WeakKeyDictionary.)
_wrapped: dict[int, tuple[Any, ...]] = {}


# index dtypes a kernel reads as they are: native byte order only (a big-endian int32 passes ``kind == "i"``
# and numpy's bounds checks, which read it right, and a kernel would then read its bytes swapped)
_SHARED_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _native_indices(matrix: Any) -> Any:
    """``matrix``, or a shallow copy of it whose index arrays are native int64 when they are not all native
    int32/int64 of one width: scipy's own conversions refuse mixed widths (``tocoo`` raises a ``ValueError``
    on int64 ``indptr`` with int32 ``indices``) and keep a foreign byte order."""
    layout = _scipy_layout(matrix)
    if layout is None:
        return matrix
    index = layout[1]
    if all(b.dtype in _SHARED_INDEX_DTYPES for b in index) and index[0].dtype == index[1].dtype:
        return matrix
    first, second = (b.astype(np.int64) for b in index)
    if matrix.format == "coo":
        return type(matrix)((matrix.data, (first, second)), shape=matrix.shape)
    return type(matrix)((matrix.data, second, first), shape=matrix.shape)


def _wrap_scipy(matrix: Any, fmt: Format, index: tuple[np.ndarray, ...]) -> SparseTensor | None:
    """The tensor over a checked, canonical matrix's buffers (``None`` for a coo whose row and col differ in
    width)."""
    data = matrix.data.reshape(-1)
    if matrix.format == "coo":
        row, col = index
        if row.dtype != col.dtype:
            return None
        buffers: tuple[np.ndarray, ...] = (np.array([0, row.size], dtype=row.dtype), row, col, data)
        shared = fmt.with_widths(row.itemsize * 8, row.itemsize * 8)
    else:
        buffers = (index[0], index[1], data)
        shared = fmt.with_widths(index[0].itemsize * 8, index[1].itemsize * 8)
    check_dtype(data.dtype, "scipy matrix values")
    return SparseTensor._trusted(shared, tuple(matrix.shape), buffers, borrowed=True)
