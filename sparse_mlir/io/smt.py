"""``.smt``: a compact, versioned, checksummed file for sending a ``SparseTensor`` elsewhere.

Why another file format: Matrix Market is slow text, scipy's ``.npz`` holds
only 2-d matrices in scipy's own layouts, and neither keeps what a kernel
needs -- the exact level buffers of any format (order-3 COO, CSF, BSR, N:M),
their index widths (8 to 64 bits) and the format itself.  ``.smt`` stores
those buffers as they are, so loading one is a validation, not a conversion,
and an uncompressed file maps straight into memory.

Layout (integers little-endian)::

    0    magic b"SPMLTNS\\0"          8 bytes
    8    format version (1)          uint32
    12   header length H             uint32
    16   header, UTF-8 JSON          H bytes
         zero padding to a 64-byte boundary
         the buffers, each at a 64-byte aligned offset, zero-padded between

The header holds ``format`` (``formats.format_to_json``), ``shape``,
``dtype`` and ``buffers``: one entry per level buffer, in
``format.buffer_names`` order, with ``name``, ``dtype``, ``count``
(elements), ``encoding``, ``compression``, ``offset`` (from the start of the
file), ``length`` (stored bytes) and ``sha256`` (of the stored bytes).

Encodings make sorted indices small, hence compressible:

* ``raw``: the elements' little-endian bytes;
* ``delta``: the first element, then differences (positions become counts);
* ``segment_delta``: ``crdN`` of a level with positions, as differences within
  each segment of ``posN`` (a segment's first coordinate as is).

Differences wrap around in the buffer's own dtype, so they are exact for any
content and never widen a buffer.  Values are always stored raw.  Each
buffer is then compressed with ``zlib`` or ``lzma`` when asked and when that
makes it smaller.  Aligned raw, uncompressed buffers are what let
``load_tensor`` return ``np.memmap`` views (of a private snapshot of the
file, never of the file itself: see ``_snapshot``).

Files are written to a temporary name and renamed into place, so a reader --
or a tensor still mapping the previous file -- never sees a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparse_mlir.formats import format_from_json, format_to_json
from sparse_mlir.errors import FormatError, OperandError, SparseMLIRError
from sparse_mlir.files import open_atomically
from sparse_mlir.formats import Format, LevelKind
from sparse_mlir.tensor.host import SparseTensor, check_dtype
from sparse_mlir.tensor.storage import check_shape, index_dtype

__all__ = ["MAGIC", "VERSION", "load_tensor", "save_tensor"]

PathLike = str | os.PathLike[str]

MAGIC = b"SPMLTNS\0"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sII")  # magic, version, header length

_COMPRESS: dict[str, Callable[[Any], Any]] = {"none": lambda data: data, "zlib": zlib.compress,
                                               "lzma": lzma.compress}
_DECOMPRESSORS: dict[str, Callable[[], Any]] = {"zlib": zlib.decompressobj, "lzma": lzma.LZMADecompressor}
_INDEX_ENCODINGS = ("delta", "raw")
_ENCODINGS = ("raw", "delta", "segment_delta")


@dataclass(frozen=True)
class _Entry:
    """How one buffer is stored: the header's record of it."""

    name: str
    dtype: str
    count: int
    encoding: str
    compression: str
    offset: int
    length: int
    sha256: str


# -- encodings ------------------------------------------------------------------------------------

def _delta(a: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    out[:1] = a[:1]
    np.subtract(a[1:], a[:-1], out=out[1:])  # wraps around in a's dtype: exact for any content
    return out


def _undelta(d: np.ndarray) -> np.ndarray:
    return np.cumsum(d, dtype=d.dtype)


def _segment_delta(crd: np.ndarray, pos: np.ndarray) -> np.ndarray:
    out = _delta(crd)
    starts = pos[:-1].astype(np.int64)
    starts = starts[starts < crd.size]  # empty segments start where the next one does
    out[starts] = crd[starts]
    return out


def _segment_undelta(d: np.ndarray, pos: np.ndarray) -> np.ndarray:
    running = np.concatenate([np.zeros(1, d.dtype), _undelta(d)])
    return running[1:] - np.repeat(running[pos[:-1]], np.diff(pos))


def _encoding(fmt: Format, name: str, index_encoding: str) -> str:
    """The encoding of buffer ``name``: only index buffers are delta-encoded, and only when asked."""
    if index_encoding == "raw" or name == "values":
        return "raw"
    if name.startswith("pos"):
        return "delta"
    return "segment_delta" if fmt.levels[int(name[3:])].has_positions else "raw"


def _encode(buf: np.ndarray, encoding: str, pos: np.ndarray | None) -> np.ndarray:
    if encoding == "delta":
        return _delta(buf)
    if encoding == "segment_delta":
        assert pos is not None
        return _segment_delta(buf, pos)
    return buf


def _decode(arr: np.ndarray, entry: _Entry, pos: np.ndarray | None, path: PathLike) -> np.ndarray:
    if entry.encoding == "delta":
        return _undelta(arr)
    if entry.encoding == "segment_delta":
        return _segment_undelta(arr, _segments(pos, arr.size, entry.name, path))
    return arr


def _segments(pos: np.ndarray | None, size: int, name: str, path: PathLike) -> np.ndarray:
    """Positions as int64, checked first: segment decoding indexes with them."""
    if pos is None or pos.size == 0:
        raise FormatError(f"{path}: buffer {name!r} is segment-delta encoded but its positions are missing")
    p = pos.astype(np.int64)
    if p[0] != 0 or p[-1] != size or (np.diff(p) < 0).any():
        raise FormatError(f"{path}: the positions of buffer {name!r} do not split its {size} coordinates "
                          f"into segments (they must rise from 0 to {size})")
    return p


# -- writing ----------------------------------------------------------------------------------------

def _le_bytes(arr: np.ndarray) -> np.ndarray:
    """The elements' little-endian bytes as a uint8 view (no copy on little-endian machines)."""
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)


def _compress(data: np.ndarray, compression: str) -> tuple[str, Any]:
    """Compress ``data``, or keep it as is when compressing would not make it smaller."""
    packed = _COMPRESS[compression](data)
    return ("none", data) if len(packed) >= data.size else (compression, packed)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _place(entries: list[_Entry], start: int) -> list[_Entry]:
    """Give each entry the next aligned offset from ``start``."""
    placed = []
    for e in entries:
        placed.append(_Entry(**{**asdict(e), "offset": start}))
        start = _align(start + e.length)
    return placed


def _header(meta: dict[str, Any], entries: list[_Entry]) -> tuple[bytes, list[_Entry]]:
    """The header bytes and the placed entries.

    Offsets are absolute, so the header's length depends on the offsets it
    holds; iterate to the fixed point (the lengths only grow, so it ends).
    """
    start = 0
    while True:
        placed = _place(entries, start)
        header = json.dumps({**meta, "buffers": [asdict(e) for e in placed]}, separators=(",", ":")).encode()
        data_start = _align(_PREFIX.size + len(header))
        if data_start == start:
            return header, placed
        start = data_start


def _stored(tensor: SparseTensor, compression: str, index_encoding: str) -> tuple[list[_Entry], list[Any]]:
    """Encode and compress every buffer; entries are not yet placed."""
    fmt = tensor.format
    entries, payloads = [], []
    for name, buf in zip(fmt.buffer_names, tensor.buffers):
        encoding = _encoding(fmt, name, index_encoding)
        pos = tensor.buffer(f"pos{name[3:]}") if encoding == "segment_delta" else None
        used, payload = _compress(_le_bytes(_encode(buf, encoding, pos)), compression)
        entries.append(_Entry(name, buf.dtype.name, int(buf.size), encoding, used, 0, len(payload),
                              hashlib.sha256(payload).hexdigest()))
        payloads.append(payload)
    return entries, payloads


def _write_atomically(path: Path, header: bytes, entries: list[_Entry], payloads: list[Any]) -> None:
    """Write the file under a temporary name and move it into place (permissions as ``open(path, "wb")``)."""
    with open_atomically(path, mode=0o666) as f:
        f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
        f.write(header)
        for entry, payload in zip(entries, payloads):
            f.write(b"\0" * (entry.offset - f.tell()))
            f.write(payload)


def save_tensor(tensor: SparseTensor, path: PathLike, *, compression: str = "zlib",
                index_encoding: str = "delta") -> None:
    """Write ``tensor`` to ``path`` (``.smt`` by convention); see the module docstring for the layout.

    ``compression`` is ``"none"``, ``"zlib"`` or ``"lzma"``; ``index_encoding``
    ``"delta"`` (positions as counts, coordinates as gaps within segments) or
    ``"raw"``.  Pick ``compression="none", index_encoding="raw"`` for files
    that ``load_tensor`` maps without copying.
    """
    if not isinstance(tensor, SparseTensor):
        raise OperandError(f"save_tensor expects a SparseTensor, got {type(tensor).__name__} "
                           f"(build one with SparseTensor.from_scipy or from_coo)")
    if compression not in _COMPRESS:
        raise FormatError(f"unknown compression {compression!r}; expected one of {', '.join(_COMPRESS)}")
    if index_encoding not in _INDEX_ENCODINGS:
        raise FormatError(f"unknown index_encoding {index_encoding!r}; expected one of {', '.join(_INDEX_ENCODINGS)}")
    entries, payloads = _stored(tensor, compression, index_encoding)
    meta = {"format": format_to_json(tensor.format), "shape": list(tensor.shape), "dtype": tensor.dtype.name}
    header, placed = _header(meta, entries)
    _write_atomically(Path(path), header, placed, payloads)


# -- reading ----------------------------------------------------------------------------------------

def _read_prefix(data: np.ndarray, path: PathLike) -> int:
    """Check magic and version; return the header length."""
    if data.size < _PREFIX.size:
        raise FormatError(f"{path}: truncated .smt file ({data.size} bytes, the fixed prefix alone takes "
                          f"{_PREFIX.size})")
    magic, version, header_len = _PREFIX.unpack(data[:_PREFIX.size].tobytes())
    if magic != MAGIC:
        raise FormatError(f"{path}: not a sparse tensor file (bad magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise FormatError(f"{path}: unsupported .smt format version {version} (this reader knows {VERSION})")
    if _PREFIX.size + header_len > data.size:
        raise FormatError(f"{path}: truncated .smt file (header of {header_len} bytes, file of {data.size})")
    return header_len


def _entry(record: dict[str, Any], expected: np.dtype, file_size: int) -> _Entry:
    """One header record, checked against the format and the file; raises ValueError/TypeError/KeyError."""
    e = _Entry(**record)
    if np.dtype(e.dtype) != expected:
        raise ValueError(f"buffer {e.name!r} has dtype {e.dtype}, but the format stores {expected}")
    if e.encoding not in _ENCODINGS or e.compression not in _COMPRESS:
        raise ValueError(f"buffer {e.name!r} has unknown encoding {e.encoding!r} or compression {e.compression!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (e.count, e.offset, e.length)):
        raise ValueError(f"buffer {e.name!r} needs non-negative integer count, offset and length")
    if e.compression == "none" and e.length != e.count * expected.itemsize:
        raise ValueError(f"buffer {e.name!r} stores {e.length} bytes for {e.count} elements of {expected}")
    if e.offset + e.length > file_size:
        raise EOFError(f"buffer {e.name!r} ends at byte {e.offset + e.length}, past the end of the file "
                       f"({file_size} bytes)")
    return e


def _expected_dtypes(fmt: Format, dtype: np.dtype) -> list[np.dtype]:
    return [dtype if n == "values" else index_dtype(fmt.pos_width if n.startswith("pos") else fmt.crd_width)
            for n in fmt.buffer_names]


def _check_counts(fmt: Format, shape: tuple[int, ...], entries: list[_Entry]) -> None:
    """Check every buffer's element count against the shape, the format and the counts before it.

    Runs on the header alone, before anything is decompressed or allocated,
    so a small file cannot make the loader build buffers its shape rules out
    (a bomb behind a count the shape contradicts).  The counts must chain as
    the levels do: ``posN`` has one entry per parent plus one, a singleton
    or N:M level a fixed number per parent, ``values`` one per entry of the
    last level; a compressed level stores at most ``size`` coordinates per
    parent when it is unique (and, in a COO region, at most one per distinct
    tuple).  Whether ``posN`` really ends at the coordinate count is checked
    after decoding, with the rest of the buffers.
    """
    count = {e.name: e.count for e in entries}
    sizes = fmt.level_sizes(shape)
    n = 1  # entries of the level above
    for i, level in enumerate(fmt.levels):
        if level.kind is LevelKind.DENSE:
            n *= sizes[i]
            continue
        crd = count[f"crd{i}"]
        if level.kind is LevelKind.STRUCTURED:
            want: int | None = n * level.n
        elif level.kind is LevelKind.SINGLETON:
            want = n
        else:
            if count[f"pos{i}"] != n + 1:
                raise ValueError(f"buffer 'pos{i}' holds {count[f'pos{i}']} positions, but shape {shape} in format "
                                 f"{fmt} has {n} parents at level {i} ({n + 1} positions)")
            want = None
            bound = _coordinate_bound(fmt, sizes, i)
            if bound is not None and crd > n * bound:
                raise ValueError(f"buffer 'crd{i}' holds {crd} coordinates, more than the {n * bound} that shape "
                                 f"{shape} in format {fmt} can hold at level {i}")
        if want is not None and crd != want:
            raise ValueError(f"buffer 'crd{i}' holds {crd} coordinates, but shape {shape} in format {fmt} "
                             f"needs {want} at level {i}")
        n = crd
    if count["values"] != n:
        raise ValueError(f"buffer 'values' holds {count['values']} values, but the levels of format {fmt} "
                         f"store {n} entries (nnz mismatch)")


def _coordinate_bound(fmt: Format, sizes: tuple[int, ...], i: int) -> int | None:
    """Most coordinates compressed level ``i`` can store per parent, or ``None`` when duplicates are legal."""
    bound = 1
    for k in range(i, len(fmt.levels)):
        level = fmt.levels[k]
        if k > i and level.kind is not LevelKind.SINGLETON:
            return None  # a nonunique level not closed by a unique singleton: any repeat count is valid
        bound *= sizes[k]
        if level.unique:
            return bound
    return None


def _read_header(data: np.ndarray, path: PathLike) -> tuple[Format, tuple[int, ...], list[_Entry]]:
    header_len = _read_prefix(data, path)
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + header_len].tobytes().decode("utf-8"))
        if not isinstance(header, dict):
            raise TypeError(f"the header is a JSON {type(header).__name__}, not an object")
        fmt = format_from_json(header["format"])
        if fmt.is_dense:
            raise ValueError("the format is dense; .smt files hold sparse tensors")
        shape = check_shape(header["shape"])
        fmt.check_shape(shape)
        check_shape(shape, fmt)
        expected = _expected_dtypes(fmt, check_dtype(header["dtype"], "the header's values"))
        records = header["buffers"]
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError("'buffers' must be a list of objects")
        if [r.get("name") for r in records] != list(fmt.buffer_names):
            raise ValueError(f"buffers {[r.get('name') for r in records]} do not match the format's "
                             f"{list(fmt.buffer_names)}")
        entries = [_entry(r, dt, data.size) for r, dt in zip(records, expected)]
        _check_counts(fmt, shape, entries)
    except EOFError as exc:
        raise FormatError(f"{path}: truncated .smt file: {exc}") from exc
    except RecursionError:  # JSON nested thousands deep
        raise FormatError(f"{path}: malformed .smt header: nested too deeply") from None
    except (ValueError, TypeError, KeyError, AttributeError, SparseMLIRError) as exc:
        raise FormatError(f"{path}: malformed .smt header: {exc}") from exc
    return fmt, shape, entries


def _decompress(stored: np.ndarray, entry: _Entry, itemsize: int, path: PathLike) -> np.ndarray:
    """Inflate one buffer, never past the size its header announces."""
    size = entry.count * itemsize
    inflater = _DECOMPRESSORS[entry.compression]()
    try:
        data = inflater.decompress(stored, max_length=size + 1)
    except (zlib.error, lzma.LZMAError, OverflowError) as exc:  # OverflowError: an absurd count
        raise FormatError(f"{path}: buffer {entry.name!r} does not decompress ({exc})") from exc
    if len(data) != size or not inflater.eof:
        raise FormatError(f"{path}: buffer {entry.name!r} does not decompress to the {size} bytes its header says")
    return np.frombuffer(data, np.uint8)


def _load_buffer(data: np.ndarray, entry: _Entry, pos: np.ndarray | None, verify: bool,
                 path: PathLike) -> np.ndarray:
    stored = data[entry.offset:entry.offset + entry.length]
    if verify and hashlib.sha256(stored).hexdigest() != entry.sha256:
        raise FormatError(f"{path}: buffer {entry.name!r} is corrupt (sha256 mismatch)")
    dtype = np.dtype(entry.dtype)
    raw = stored if entry.compression == "none" else _decompress(stored, entry, dtype.itemsize, path)
    arr = raw.view(dtype.newbyteorder("<"))
    return np.asarray(_decode(arr, entry, pos, path), dtype=dtype)  # native byte order; no copy when it is


# -- owning the bytes ---------------------------------------------------------------------------------
#
# A tensor is validated once and trusted by kernels afterwards, so its bytes must not change under it.
# Mapping the named file cannot promise that: a writer that rewrites it in place (``cp other.smt a.smt``
# truncates, then writes) makes mapped pages read the new bytes or raise SIGBUS -- even MAP_PRIVATE
# mappings, since Linux drops private pages past a truncation too.  So the tensor never maps the file it
# was named: it maps a private snapshot, an unlinked file nobody else can open (a reflink clone where the
# file system shares blocks, so that stays zero-copy; else a kernel-side copy in the temporary folder,
# page-cache backed and evictable), or, where neither can be made, owns an in-memory copy.

_FICLONE = 0x40049409  # linux/fs.h: share the source's blocks, copy on write


def _unlinked_file(folder: str) -> Any:
    """A new read-write file in ``folder`` that has no name, or ``None`` where that is unsupported."""
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (OSError, AttributeError):  # no O_TMPFILE on this system or file system, or no write access
        return None
    return os.fdopen(fd, "w+b")


def _copy_into(src: Any, dst: Any, size: int, clone_only: bool) -> bool:
    """Copy ``size`` bytes of ``src`` into ``dst``: reflink, else (unless ``clone_only``) in the kernel."""
    try:
        import fcntl  # POSIX only; elsewhere the in-memory copy is used

        fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
        return True
    except (ImportError, OSError):
        if clone_only:
            return False
    copied = 0
    try:
        while copied < size:
            step = os.copy_file_range(src.fileno(), dst.fileno(), size - copied, copied, copied)
            if step == 0:
                break
            copied += step
    except (AttributeError, OSError):  # no copy_file_range here, or across these file systems
        src.seek(0)
        dst.seek(0)
        shutil.copyfileobj(src, dst)
    dst.flush()
    return os.fstat(dst.fileno()).st_size == size


def _snapshot(path: PathLike, mmap: bool) -> np.ndarray:
    """The file's bytes, in storage only this process can change (see above)."""
    with open(path, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        if mmap and size:
            for folder, clone_only in ((os.path.dirname(os.path.abspath(path)), True),
                                       (tempfile.gettempdir(), False)):
                copy = _unlinked_file(folder)
                if copy is None:
                    continue
                with copy:
                    try:
                        if _copy_into(src, copy, size, clone_only):
                            return np.memmap(copy, np.uint8, mode="r")  # the map keeps its own descriptor
                    except OSError:  # out of space in the temporary folder, say: read it instead
                        pass
        src.seek(0)
        return np.fromfile(src, np.uint8)


def load_tensor(path: PathLike, *, mmap: bool = True, verify: bool = True) -> SparseTensor:
    """Read a tensor written by :func:`save_tensor`.

    The tensor never reads the file it was named after it returns, so
    rewriting or truncating that file afterwards (even in place) leaves it
    intact.  With ``mmap`` the file is first snapshotted into a private,
    unlinked file (a reflink clone where the file system supports it,
    otherwise a kernel-side copy in the temporary folder) and raw,
    uncompressed buffers are read-only views of that mapping; without, the
    file is read into memory.  Other buffers are decoded into new arrays.
    ``verify`` checks every buffer's sha256.  Every count in the header is
    checked against the shape and format before any buffer is decompressed,
    and the buffers are always validated as a ``SparseTensor``.  Any bad
    file -- wrong magic or version, truncated, malformed header, counts the
    shape rules out, checksum mismatch, invalid buffers -- raises
    ``FormatError`` naming the problem.
    """
    data = _snapshot(path, mmap)
    fmt, shape, entries = _read_header(data, path)
    buffers: dict[str, np.ndarray] = {}
    for entry in entries:
        pos = buffers.get(f"pos{entry.name[3:]}") if entry.encoding == "segment_delta" else None
        buffers[entry.name] = _load_buffer(data, entry, pos, verify, path)
    try:
        return SparseTensor.from_buffers(fmt, shape, tuple(buffers[n] for n in fmt.buffer_names))
    except SparseMLIRError as exc:
        raise FormatError(f"{path}: the stored buffers are not a valid {fmt} tensor: {exc}") from exc
