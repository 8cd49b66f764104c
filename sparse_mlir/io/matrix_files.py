"""Readers and writers for the files sparse tensors travel in, gzip or not.

Real workloads arrive as Matrix Market (``.mtx``), DLMC patterns (``.smtx``)
or scipy ``.npz``; ``load_any``/``save_any`` pick the reader or writer from
the file name so tools need not care which, and ``.smt`` (see
``sparse_mlir.io.smt``) keeps any format, order and index width exactly.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from sparse_mlir.dtypes import check_dtype
from sparse_mlir.errors import DTypeError, FormatError, OperandError
from sparse_mlir.files import open_atomically
from sparse_mlir.formats import Format, as_format
from sparse_mlir.io.smt import load_tensor, save_tensor
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["read_matrix", "read_smtx", "read_mtx", "read_npy", "read_npz", "write_smtx", "write_mtx", "write_npz",
           "load_any", "save_any", "file_kind"]


def _open(path: Any) -> IO[bytes]:
    path = Path(str(path)) if not hasattr(path, "open") else path
    handle = path.open("rb")
    if not str(path).endswith(".gz"):
        return handle
    unzipped = gzip.GzipFile(fileobj=handle)
    unzipped.myfileobj = handle  # so closing the gzip stream closes the file too (GzipFile owns myfileobj)
    return unzipped


# Text files are read in two steps so that no count in them can drive memory: the header line(s) first,
# with a bounded readline, then the body, never more bytes than the counts in the header allow (which
# also stops a gzip bomb early), and only once the body is long enough to hold what the header
# promises is anything sized by those counts allocated.
_MAX_HEADER = 1 << 24       # bytes of banner and comments before a Matrix Market size line
_MAX_NUMBER = 24            # characters of one number and its separator (int64, or a float in %.17g)
_MAX_MTX_ENTRY = 4 * _MAX_NUMBER + 8


def _read_bounded(f: IO[bytes], limit: int, path: Any, what: str) -> bytes:
    """The rest of ``f``, refusing a file longer than ``limit`` bytes (without reading past it)."""
    chunks, size = [], 0
    while chunk := f.read(min(1 << 20, limit + 1 - size)):  # read(n) would allocate n bytes up front
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise FormatError(f"{path}: more data than the header's {what} can take ({limit} bytes)")
    return b"".join(chunks)


def _counts(text: bytes, n: int, path: Any, what: str) -> list[int]:
    """``n`` non-negative integers, separated by commas and/or blanks (a header line)."""
    fields = text.replace(b",", b" ").split()
    if len(fields) != n or not all(f.isdigit() for f in fields):
        raise FormatError(f"{path}: the {what} line must hold {n} non-negative integers, got {text[:200]!r}")
    return [int(f) for f in fields]


def _int_array(text: bytes, count: int, path: Any, what: str) -> np.ndarray:
    """A line of ``count`` integers as int64; anything else is a ``FormatError`` naming the line."""
    fields = text.split()
    if len(fields) != count:
        raise FormatError(f"{path}: the {what} line holds {len(fields)} numbers, the header says {count}")
    try:
        return np.array(fields, dtype=np.int64) if count else np.zeros(0, np.int64)
    except (ValueError, OverflowError) as exc:
        raise FormatError(f"{path}: the {what} line holds something other than 64-bit integers ({exc})") from None


def read_smtx(path: Any, dtype: str = "float32", seed: int = 0) -> Any:
    """A DLMC ``.smtx`` pattern as a scipy CSR matrix with seeded random values.

    Line 1 is ``nrows, ncols, nnz``, line 2 the row offsets, line 3 the column
    indices (the files carry no values).  Every count is checked against the
    file before anything sized by it is allocated; a malformed file raises
    ``FormatError`` naming the line.
    """
    import scipy.sparse as sp

    dt = check_dtype(dtype, ".smtx values")
    try:
        with _open(path) as f:
            rows, cols, nnz = _counts(f.readline(4096), 3, path, "first (nrows, ncols, nnz)")
            if nnz > rows * cols or max(rows, cols, nnz) > np.iinfo(np.int64).max - 1:
                raise FormatError(f"{path}: {nnz} nonzeros do not fit a {rows} x {cols} matrix")
            numbers = rows + 1 + nnz
            body = _read_bounded(f, numbers * _MAX_NUMBER + 16, path, f"{rows} rows and {nnz} nonzeros")
    except (OSError, EOFError, zlib.error) as exc:  # a damaged gzip stream
        raise FormatError(f"{path}: cannot read the file ({exc})") from exc
    if len(body) < 2 * numbers - 3:  # every number takes a digit and a separator
        raise FormatError(f"{path}: the header announces {rows} rows and {nnz} nonzeros, but the file holds only "
                          f"{len(body)} more bytes")
    lines = body.split(b"\n") + [b""]  # the indices line of an empty matrix may be missing
    indptr = _int_array(lines[0], rows + 1, path, "row offsets (second)")
    indices = _int_array(lines[1], nnz, path, "column indices (third)")
    if b"".join(lines[2:]).strip():
        raise FormatError(f"{path}: unexpected data after the column indices line")
    if indptr[0] != 0 or indptr[-1] != nnz or (np.diff(indptr) < 0).any():
        raise FormatError(f"{path}: the row offsets must rise from 0 to nnz = {nnz}")
    if nnz and (indices.min() < 0 or indices.max() >= cols):
        raise FormatError(f"{path}: a column index lies outside [0, {cols})")
    index = np.int32 if max(rows, cols, nnz) < np.iinfo(np.int32).max else np.int64
    values = np.random.default_rng(seed).standard_normal(nnz).astype(dt)
    return sp.csr_matrix((values, indices.astype(index), indptr.astype(index)), shape=(rows, cols))


_MTX_FIELDS = {"real": 6, "double": 6, "integer": 6, "unsigned-integer": 6, "complex": 8, "pattern": 4}
_MTX_SYMMETRIES = ("general", "symmetric", "skew-symmetric", "hermitian")


def _mtx_header(f: IO[bytes], path: Any) -> tuple[bytes, int, int]:
    """The banner, comments and size line as read; the entries they announce; the fewest bytes those take."""
    banner = f.readline(4096)
    words = banner.decode("latin-1").lower().split()
    if len(words) != 5 or words[0] != "%%matrixmarket" or words[1] != "matrix" \
            or words[2] not in ("coordinate", "array") or words[3] not in _MTX_FIELDS \
            or words[4] not in _MTX_SYMMETRIES:
        raise FormatError(f"{path}: not a Matrix Market matrix (banner {banner[:200]!r}; expected "
                          f"'%%MatrixMarket matrix coordinate|array <field> <symmetry>')")
    layout, field, symmetry = words[2], words[3], words[4]
    if layout == "array" and field == "pattern":
        raise FormatError(f"{path}: a Matrix Market array cannot be a pattern")
    head = [banner]
    while True:
        line = f.readline(4096)
        head.append(line)
        if sum(map(len, head)) > _MAX_HEADER or not line:
            raise FormatError(f"{path}: no Matrix Market size line within {_MAX_HEADER} bytes")
        if line.strip() and not line.startswith(b"%"):
            break
    if layout == "coordinate":
        rows, cols, entries = _counts(line, 3, path, "size (rows, columns, entries)")
        if entries > rows * cols:
            raise FormatError(f"{path}: {entries} entries do not fit a {rows} x {cols} matrix")
        smallest = _MTX_FIELDS[field]
    else:
        rows, cols = _counts(line, 2, path, "size (rows, columns)")
        n = min(rows, cols)
        entries = rows * cols - {"general": 0, "symmetric": n * (n - 1) // 2, "hermitian": n * (n - 1) // 2,
                                 "skew-symmetric": n * (n + 1) // 2}[symmetry]
        smallest = 4 if field == "complex" else 2
    if max(rows, cols) > np.iinfo(np.int64).max - 1:
        raise FormatError(f"{path}: a {rows} x {cols} matrix is past 64-bit indices")
    _check_positions_fit(rows, entries * smallest, path)
    return b"".join(head), entries, smallest


# bytes of CSR row positions any file may ask for, however short; past that, at most
# _POSITION_BYTES_PER_BODY_BYTE per byte its entries take at least (a matrix far taller than its entries is refused)
_FREE_POSITION_BYTES = 256 << 20
_POSITION_BYTES_PER_BODY_BYTE = 64


def _check_positions_fit(rows: int, body_bytes: int, path: Any) -> None:
    """The one allocation the length of the body does not bound: the CSR result's position per row (a 75-byte
    file announcing 10^15 rows asked numpy for 7 PiB, one announcing 2 * 10^9 took 8 GB and 19 s).  Allowed up to
    ``_FREE_POSITION_BYTES``, or ``_POSITION_BYTES_PER_BODY_BYTE`` times the least the entries take, and never
    past the memory free now."""
    need = (rows + 1) * 8
    try:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        free = 1 << 40
    allowed = min(max(_FREE_POSITION_BYTES, _POSITION_BYTES_PER_BODY_BYTE * body_bytes), free)
    if need > allowed:
        raise FormatError(f"{path}: {rows} rows need {need >> 20} MiB of CSR row positions, more than the "
                          f"{allowed >> 20} MiB a file of {body_bytes} bytes of entries may ask for")


def read_mtx(path: Any) -> Any:
    """A Matrix Market file as a scipy CSR matrix (symmetric files expand to both triangles).

    The banner and size line are checked, and the body must be long enough
    for the entries they announce (and no longer than they can take) before
    scipy parses it, so a count cannot make the reader allocate more than
    the file holds, and the row count against that and the memory free
    (``_check_positions_fit``: the CSR result holds a position per row);
    anything malformed raises ``FormatError``.
    """
    import io

    import scipy.io
    import scipy.sparse as sp

    try:
        with _open(path) as f:
            head, entries, smallest = _mtx_header(f, path)
            body = _read_bounded(f, entries * _MAX_MTX_ENTRY + _MAX_HEADER, path, f"{entries} entries")
    except (OSError, EOFError, zlib.error) as exc:
        raise FormatError(f"{path}: cannot read the file ({exc})") from exc
    if len(body) < entries * smallest - 1:
        raise FormatError(f"{path}: the size line announces {entries} entries, but the file holds only "
                          f"{len(body)} more bytes")
    try:
        matrix = scipy.io.mmread(io.BytesIO(head + body))
    except MemoryError:
        raise
    except Exception as exc:  # scipy's parsers raise ValueError, RuntimeError, IndexError, OverflowError...
        raise FormatError(f"{path}: malformed Matrix Market file ({type(exc).__name__}: {exc})") from exc
    return sp.csr_matrix(matrix)


def read_matrix(path: Any, dtype: str = "float64") -> Any:
    """Read ``.mtx``/``.smtx`` (optionally ``.gz``) by extension."""
    name = str(path)
    if ".smtx" in name:
        return read_smtx(path, dtype)
    if ".mtx" in name:
        return _cast_values(read_mtx(path), check_dtype(dtype, "matrix values"), path)
    raise FormatError(f"{path}: unknown matrix file type (expected .mtx or .smtx, optionally .gz)")


def _cast_values(matrix: Any, dtype: np.dtype, path: Any) -> Any:
    """``matrix`` with values of ``dtype``, refusing what the cast would change past rounding: complex values
    (numpy drops the imaginary part with a warning) and values an integer dtype cannot hold (3000000000 as
    int32 came back as -1294967296)."""
    data = matrix.data
    if np.iscomplexobj(data):
        raise DTypeError(f"{path}: the file holds complex values; kernels take {dtype} (real) ones")
    if dtype.kind == "i":
        with np.errstate(invalid="ignore"):
            cast = data.astype(dtype)
        inexact = cast != data
        if inexact.any():
            raise DTypeError(f"{path}: value {data[np.argmax(inexact)].item()!r} is not an {dtype} integer")
    return matrix.astype(dtype)


# -- writers ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def _open_write(path: Any) -> Iterator[IO[bytes]]:
    """A binary file for writing that replaces ``path`` only once all of it is written (``open_atomically``: a
    writer that fails halfway leaves an existing file as it was); gzip (with a fixed mtime and the target's
    name in its header, so output is reproducible) if it ends in .gz."""
    target = Path(path)
    with open_atomically(target, mode=0o666) as raw:  # permissions as open(path, "wb") gives them
        if target.name.endswith(".gz"):
            with gzip.GzipFile(filename=target.name, mode="wb", fileobj=raw, mtime=0) as f:
                yield f
        else:
            yield raw


def _as_scipy(matrix: Any, what: str) -> Any:
    """A scipy matrix for a writer that only knows 2-d matrices: float16 values widened to float32, which holds
    each one exactly (scipy.sparse has no float16)."""
    import scipy.sparse as sp

    if isinstance(matrix, SparseTensor):
        if matrix.ndim != 2:
            raise FormatError(f"{what} holds 2-d matrices, got a {matrix.ndim}-d tensor (save it as .smt)")
        return (matrix.astype("float32") if matrix.dtype == np.float16 else matrix).to_scipy()
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
    survives a round trip; values read back as float64 or int64 (float16
    ones are written through float32, exactly).
    """
    import scipy.io

    converted = _as_scipy(matrix, ".mtx")
    with _open_write(path) as f:
        scipy.io.mmwrite(f, converted, symmetry="general")


def read_npz(path: Any) -> Any:
    """A scipy sparse matrix saved with ``scipy.sparse.save_npz`` (no pickles; a bad file is a ``FormatError``).

    Every member's array header is checked against the bytes the member can hold first (``_check_npz_members``):
    numpy allocates what a header announces before reading a zip member.
    """
    import zipfile

    import scipy.sparse as sp

    try:
        _check_npz_members(path)
        return sp.load_npz(path)
    except (FileNotFoundError, FormatError):
        raise
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError, RuntimeError, OSError, EOFError,
            UnicodeDecodeError, zlib.error, zipfile.BadZipFile) as exc:  # np.load, load_npz, zipfile (encrypted)
        raise FormatError(f"{path}: not a scipy sparse .npz file ({type(exc).__name__}: {exc})") from exc


def read_npy(path: Any) -> np.ndarray:
    """A dense array saved with ``numpy.save`` (no pickles); its header is checked against the file's length first
    (numpy allocates what the header announces), and a bad file is a ``FormatError``."""
    try:
        with open(path, "rb") as f:
            _npy_header(f, os.fstat(f.fileno()).st_size, path, "the file")
        return np.load(path, allow_pickle=False)
    except (FileNotFoundError, FormatError):
        raise
    except (ValueError, TypeError, OSError, EOFError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: not a .npy file ({type(exc).__name__}: {exc})") from exc


def _npy_header(f: IO[bytes], most: int, path: Any, what: str) -> None:
    """Read a ``.npy`` header from ``f``, refusing an array of more bytes than ``most`` (what holds it can)."""
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise FormatError(f"{path}: {what} has .npy version {version}")
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = reader(f)
    announced = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if announced > most:
        raise FormatError(f"{path}: {what} announces a {shape} array of {dtype} ({announced} bytes), more than "
                          f"its {most} bytes can hold")


# numpy writes members stored or deflated; deflate expands a byte into at most 1032 (its longest match per code)
_NPZ_EXPANSION = {0: 1, 8: 1032}  # zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED


def _check_npz_members(path: Any) -> None:
    """Refuse a member whose ``.npy`` header announces more bytes than the member can decompress to (a 300-byte
    file announcing 2**44 float64 made numpy ask for 128 TiB), or that is compressed otherwise than numpy
    writes it."""
    import zipfile

    size = os.path.getsize(path)
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            expansion = _NPZ_EXPANSION.get(info.compress_type)
            if expansion is None:
                raise FormatError(f"{path}: member {info.filename!r} is compressed with method "
                                  f"{info.compress_type}; numpy writes members stored or deflated")
            most = min(info.file_size, min(info.compress_size, size) * expansion)
            with archive.open(info) as member:
                _npy_header(member, most, path, f"member {info.filename!r}")


def write_npz(matrix: Any, path: Any, compressed: bool = True) -> None:
    """Write a 2-d matrix with ``scipy.sparse.save_npz`` (to ``path`` exactly: no ``.npz`` is appended).

    float16 values are stored as float32 (scipy has no float16) and read back as such.  Like every writer
    here, it replaces an existing file only once the new one is whole.
    """
    import scipy.sparse as sp

    converted = _as_scipy(matrix, ".npz")
    with _open_write(path) as f:
        sp.save_npz(f, converted, compressed=compressed)


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


def file_kind(path: Any) -> str:
    """``smt``, ``mtx``, ``smtx`` or ``npz``, from the file name (``FormatError`` for anything else)."""
    return _kind(path)


def save_any(tensor_or_matrix: Any, path: Any, *, pattern_only: bool = False) -> None:
    """Write a SparseTensor or scipy matrix to ``.smt``, ``.mtx[.gz]``, ``.smtx[.gz]`` or ``.npz`` (by extension).

    Only ``.smt`` holds tensors of order other than 2 and every format as is.
    ``.smtx`` stores the pattern alone: the values are dropped (and read
    back as random ones), which warns unless ``pattern_only=True`` says that
    is what the caller wants.
    """
    kind = _kind(path)
    if kind == "smtx" and not pattern_only:
        warnings.warn(f"{path}: .smtx stores only the sparsity pattern; the values are dropped (pass "
                      f"pattern_only=True to say so, or write .smt, .mtx or .npz to keep them)", UserWarning,
                      stacklevel=2)
    if kind == "smt":
        save_tensor(_as_tensor(tensor_or_matrix), path)
        return
    {"mtx": write_mtx, "smtx": write_smtx, "npz": write_npz}[kind](tensor_or_matrix, path)
