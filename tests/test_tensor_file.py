"""The ``.smt`` tensor file and the io dispatchers: exact round trips, zero-copy maps, refusing bad files."""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import DTYPES, prune_nm, random_sparse

import sparse_mlir as sm
from sparse_mlir.errors import DTypeError, FormatError, OperandError
from sparse_mlir.formats import coo, sparse_vector
from sparse_mlir.io.matrix_files import load_any, read_matrix, read_mtx, read_npz, read_smtx, save_any
from sparse_mlir.io.smt import MAGIC, load_tensor, save_tensor

DLMC = Path(sm.__file__).parent / "data" / "dlmc_attention_q_0.9.smtx.gz"  # a real pruned pattern, shipped

FORMATS = ["csr", "csc", "coo", "coo3", "dcsr", "csf", "bsr2x2", "2:4", "sparse_vector"]
COMPRESSIONS = ["none", "zlib", "lzma"]
ENCODINGS = ["delta", "raw"]


def make_tensor(rng: np.random.Generator, name: str, dtype: str = "float64") -> sm.SparseTensor:
    if name == "2:4":
        return sm.SparseTensor.from_dense(prune_nm(random_sparse(rng, (6, 16), 0.8, dtype), 2, 4), sm.NM(2, 4))
    if name in ("coo3", "csf"):
        fmt = coo(3) if name == "coo3" else sm.CSF
        return sm.SparseTensor.from_dense(random_sparse(rng, (4, 5, 6), 0.2, dtype), fmt)
    if name == "sparse_vector":
        return sm.SparseTensor.from_dense(random_sparse(rng, 40, 0.3, dtype), sparse_vector())
    return sm.SparseTensor.from_dense(random_sparse(rng, (12, 10), 0.25, dtype), name)


def assert_same(a: sm.SparseTensor, b: sm.SparseTensor) -> None:
    assert (a.format, a.shape, a.dtype) == (b.format, b.shape, b.dtype)
    for x, y in zip(a.buffers, b.buffers, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def header(path: Path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<I", raw[12:16])
    return json.loads(raw[16:16 + length])


def file_backed(array: np.ndarray) -> bool:
    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = getattr(array, "base", None)
    return False


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


# -- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_round_trip_every_format(rng, tmp_path, fmt, compression, encoding):
    t = make_tensor(rng, fmt)
    path = tmp_path / "t.smt"
    save_tensor(t, path, compression=compression, index_encoding=encoding)
    for mmap in (True, False):
        assert_same(load_tensor(path, mmap=mmap), t)


@pytest.mark.parametrize("width", [8, 16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_index_widths_and_dtypes(rng, tmp_path, width, dtype, fmt):
    f = sm.parse_format(fmt).with_widths(width, width)
    t = sm.SparseTensor.from_dense(random_sparse(rng, (9, 11), 0.3, dtype), f)
    assert t.format == f
    save_tensor(t, tmp_path / "t.smt")
    assert_same(load_tensor(tmp_path / "t.smt"), t)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (4, 4)])
def test_empty_tensors(tmp_path, shape):
    t = sm.SparseTensor.from_dense(np.zeros(shape, np.float32), "csr")
    save_tensor(t, tmp_path / "t.smt", compression="lzma")
    assert_same(load_tensor(tmp_path / "t.smt"), t)


def test_layout_is_aligned_and_delta_encodes_indices(rng, tmp_path):
    path = tmp_path / "t.smt"
    save_tensor(make_tensor(rng, "dcsr"), path)
    raw = path.read_bytes()
    assert raw[:8] == MAGIC and struct.unpack("<I", raw[8:12]) == (1,)
    entries = {b["name"]: b for b in header(path)["buffers"]}
    assert [e["encoding"] for e in entries.values()] == ["delta", "segment_delta", "delta", "segment_delta", "raw"]
    assert all(e["offset"] % 64 == 0 for e in entries.values())


def test_overwriting_a_mapped_file_leaves_the_loaded_tensor_intact(rng, tmp_path):
    path = tmp_path / "t.smt"
    first, second = make_tensor(rng, "csr"), make_tensor(rng, "csr")
    save_tensor(first, path, compression="none", index_encoding="raw")
    mapped = load_tensor(path)
    save_tensor(second, path, compression="none", index_encoding="raw")
    assert_same(mapped, first)
    assert_same(load_tensor(path), second)


# -- zero copy -------------------------------------------------------------------------------------

def test_raw_uncompressed_buffers_are_mapped_zero_copy(rng, tmp_path):
    path = tmp_path / "t.smt"
    save_tensor(make_tensor(rng, "coo3"), path, compression="none", index_encoding="raw")
    t = load_tensor(path)
    assert all(file_backed(b) and not b.flags.writeable for b in t.buffers)
    assert not any(file_backed(b) for b in load_tensor(path, mmap=False).buffers)


def test_only_raw_uncompressed_buffers_are_mapped(rng, tmp_path):
    path = tmp_path / "t.smt"
    save_tensor(make_tensor(rng, "csr"), path, compression="none", index_encoding="delta")
    assert [file_backed(b) for b in load_tensor(path).buffers] == [False, False, True]


# -- bad files -------------------------------------------------------------------------------------

@pytest.fixture
def saved(rng, tmp_path) -> tuple[sm.SparseTensor, Path]:
    t = make_tensor(rng, "csr")
    path = tmp_path / "t.smt"
    save_tensor(t, path)
    return t, path


@pytest.mark.parametrize("name", ["pos1", "crd1", "values"])
def test_checksum_mismatch_names_the_buffer(saved, name):
    _, path = saved
    entry = next(b for b in header(path)["buffers"] if b["name"] == name)
    flip_byte(path, entry["offset"] + entry["length"] // 2)
    with pytest.raises(FormatError, match=f"buffer '{name}' is corrupt"):
        load_tensor(path)


def test_tampered_indices_are_caught_without_checksums(rng, tmp_path):
    t = make_tensor(rng, "csr")
    path = tmp_path / "t.smt"
    save_tensor(t, path, compression="none", index_encoding="raw")
    entry = next(b for b in header(path)["buffers"] if b["name"] == "crd1")
    flip_byte(path, entry["offset"] + 3)  # the high byte of the first coordinate: now negative
    with pytest.raises(FormatError, match="not a valid"):
        load_tensor(path, verify=False)


def test_tampered_values_load_without_checksums(saved):
    t, path = saved
    save_tensor(t, path, compression="none")
    entry = header(path)["buffers"][-1]
    flip_byte(path, entry["offset"])
    assert not np.array_equal(load_tensor(path, verify=False).values, t.values)


@pytest.mark.parametrize("fmt", ["csr", "coo3", "2:4"])
@pytest.mark.parametrize("compression, encoding", [("zlib", "delta"), ("none", "raw")])
def test_random_corruption_only_raises_format_error(rng, tmp_path, fmt, compression, encoding):
    path = tmp_path / "t.smt"
    save_tensor(make_tensor(rng, fmt, "int32"), path, compression=compression, index_encoding=encoding)
    raw = path.read_bytes()
    for _ in range(40):
        corrupt = bytearray(raw)
        corrupt[rng.integers(len(raw))] = rng.integers(256)
        path.write_bytes(bytes(corrupt))
        try:
            load_tensor(path, verify=False)
        except FormatError:
            pass


def test_bad_magic(saved):
    _, path = saved
    flip_byte(path, 0)
    with pytest.raises(FormatError, match="bad magic"):
        load_tensor(path)


def test_unknown_version(saved):
    _, path = saved
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 99)
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="version 99"):
        load_tensor(path)


@pytest.mark.parametrize("keep", [0, 10, 40, -1])
def test_truncated_file(saved, keep):
    _, path = saved
    raw = path.read_bytes()
    path.write_bytes(raw[:keep])
    with pytest.raises(FormatError, match="truncated"):
        load_tensor(path)


@pytest.mark.parametrize("edit", [
    lambda h: b"{not json" + h[9:],
    lambda h: h.replace(b'"shape"', b'"shapx"'),
    lambda h: h.replace(b'"int32"', b'"int64"', 1),
    lambda h: h.replace(b'"pos1"', b'"pos9"'),
])
def test_malformed_header(saved, edit):
    _, path = saved
    raw = path.read_bytes()
    (length,) = struct.unpack("<I", raw[12:16])
    new = edit(raw[16:16 + length])
    path.write_bytes(raw[:12] + struct.pack("<I", len(new)) + new + raw[16 + length:])
    with pytest.raises(FormatError, match="malformed"):
        load_tensor(path)


def test_bad_arguments(saved, tmp_path):
    t, _ = saved
    with pytest.raises(FormatError, match="compression"):
        save_tensor(t, tmp_path / "x.smt", compression="gzip")
    with pytest.raises(FormatError, match="index_encoding"):
        save_tensor(t, tmp_path / "x.smt", index_encoding="rle")
    with pytest.raises(OperandError, match="SparseTensor"):
        save_tensor(t.to_scipy(), tmp_path / "x.smt")


# -- size --------------------------------------------------------------------------------------------

def raw_csr_bytes(t: sm.SparseTensor) -> int:
    return sum(b.nbytes for b in t.buffers)


def test_compressed_delta_is_smaller_than_raw_csr(tmp_path):
    m = sp.random(2000, 2000, density=0.01, format="csr", dtype=np.float32, random_state=7)
    t = sm.SparseTensor.from_scipy(m)
    path = tmp_path / "m.smt"
    save_tensor(t, path)
    assert os.path.getsize(path) < 0.75 * raw_csr_bytes(t)
    assert_same(load_tensor(path), t)


def test_dlmc_matrix_compresses(tmp_path):
    t = sm.SparseTensor.from_scipy(read_smtx(DLMC))
    path = tmp_path / "m.smt"
    save_tensor(t, path)
    assert os.path.getsize(path) < 0.75 * raw_csr_bytes(t)
    assert_same(load_tensor(path), t)


# -- io dispatch -----------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".smt", ".mtx", ".mtx.gz", ".npz"])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_load_any_save_any_keep_values(rng, tmp_path, suffix, dtype):
    t = sm.SparseTensor.from_dense(random_sparse(rng, (15, 9), 0.3, dtype), "csr")
    path = tmp_path / f"m{suffix}"
    save_any(t, path)
    loaded = load_any(path)
    assert loaded.shape == t.shape and loaded.nnz == t.nnz
    np.testing.assert_array_equal(loaded.to_dense().astype(dtype), t.to_dense())


@pytest.mark.parametrize("suffix", [".smtx", ".smtx.gz"])
def test_smtx_keeps_the_pattern(rng, tmp_path, suffix):
    m = sp.random(20, 30, density=0.1, format="csr", dtype=np.float64, random_state=3)
    path = tmp_path / f"m{suffix}"
    save_any(m, path)
    loaded = load_any(path).to_scipy()
    np.testing.assert_array_equal(loaded.indptr, m.indptr)
    np.testing.assert_array_equal(loaded.indices, m.indices)


def test_smtx_writer_matches_dlmc_files(tmp_path):
    m = read_smtx(DLMC)
    path = tmp_path / "m.smtx.gz"
    save_any(m, path)
    again = read_smtx(path)
    assert (again != m).nnz == 0  # same pattern, and read_smtx's seeded values


def test_save_any_accepts_scipy_and_load_any_converts(rng, tmp_path):
    m = sp.random(10, 12, density=0.3, format="coo", dtype=np.float64, random_state=5)
    save_any(m, tmp_path / "m.smt")
    t = load_any(tmp_path / "m.smt", format="csc")
    assert t.format == sm.CSC
    np.testing.assert_array_equal(t.to_dense(), m.toarray())
    assert load_any(tmp_path / "m.smt").format == sm.COO


def test_dispatch_errors(rng, tmp_path):
    t3 = make_tensor(rng, "coo3")
    with pytest.raises(FormatError, match="2-d"):
        save_any(t3, tmp_path / "t.mtx")
    with pytest.raises(FormatError, match="unknown sparse file type"):
        save_any(t3, tmp_path / "t.h5")
    with pytest.raises(OperandError):
        save_any(np.eye(3), tmp_path / "t.npz")
    save_any(t3, tmp_path / "t.smt")
    assert_same(load_any(tmp_path / "t.smt"), t3)


# -- writers never lose the file they replace; readers refuse what would change or blow up ----------------------

@pytest.mark.parametrize("suffix", [".mtx", ".mtx.gz", ".npz", ".smtx"])
@pytest.mark.parametrize("bad", [[[1.0, 2.0]], "3-d"])
def test_a_failed_write_leaves_the_old_file(tmp_path, suffix, bad):
    """The writers opened (and truncated) the target before looking at what they were given."""
    path = tmp_path / f"keep{suffix}"
    path.write_bytes(b"precious\n" * 10)
    if bad == "3-d":
        bad = sm.SparseTensor.from_dense(np.ones((2, 2, 2)), coo(3))
    with pytest.raises((OperandError, FormatError)):
        save_any(bad, path, pattern_only=True)
    assert path.read_bytes() == b"precious\n" * 10
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize("suffix", [".mtx", ".mtx.gz", ".npz", ".smtx"])
def test_float16_tensors_are_written_through_float32(tmp_path, suffix):
    t = sm.SparseTensor.from_coo([[0, 1], [1, 0]], np.array([1.5, 2.5], np.float16), (2, 2), "csr")
    path = tmp_path / f"m{suffix}"
    save_any(t, path, pattern_only=True)
    loaded = load_any(path).to_dense()
    if suffix == ".smtx":
        assert (loaded != 0).tolist() == [[False, True], [True, False]]
    else:
        np.testing.assert_array_equal(loaded, t.to_dense().astype(np.float32))
    with pytest.raises(DTypeError, match="float16"):
        t.to_scipy()


def test_a_tiny_mtx_cannot_ask_for_huge_row_positions(tmp_path):
    """A 69-byte file announcing 2 * 10^9 rows took 8 GB and 19 s; 10^15 rows asked numpy for 7 PiB."""
    for rows in (2_000_000_000, 10 ** 15):
        path = tmp_path / "tall.mtx"
        path.write_text(f"%%MatrixMarket matrix coordinate real general\n{rows} 1 1\n1 1 1.0\n")
        with pytest.raises(FormatError, match="row positions"):
            read_mtx(path)
    path.write_text("%%MatrixMarket matrix coordinate real general\n1000000 1 1\n1 1 1.0\n")
    assert read_mtx(path).shape == (1000000, 1)  # a tall, nearly empty matrix of a sane size still reads


def _npz(path, members, method=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", method) as z:
        for name, data in members.items():
            z.writestr(name + ".npy", data)


def _npy(array=None, shape=None):
    if shape is None:
        buf = io.BytesIO()
        np.save(buf, array)
        return buf.getvalue()
    header = f"{{'descr': '<f8', 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (63 - (len(header) + 10) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(16)


@pytest.mark.parametrize("edit, message", [
    ({"data": _npy(shape=(1 << 44,))}, "announces"),  # numpy allocated 128 TiB before reading the member
    ({"format": _npy(np.array("dok"))}, "NotImplementedError"),
    ({"format": _npy(np.array(5))}, "AttributeError"),
])
def test_crafted_npz_members_are_format_errors(tmp_path, edit, message):
    good = sp.random(4, 4, density=0.5, format="csr", random_state=0)
    members = {"format": _npy(np.array("csr")), "shape": _npy(np.array([4, 4])), "data": _npy(good.data),
               "indices": _npy(good.indices), "indptr": _npy(good.indptr)}
    path = tmp_path / "m.npz"
    _npz(path, {**members, **edit})
    with pytest.raises(FormatError, match=message):
        read_npz(path)
    _npz(path, members, zipfile.ZIP_DEFLATED)
    raw = bytearray(path.read_bytes())
    start = raw.find(b"data.npy") + len("data.npy") + 5
    raw[start:start + 20] = bytes(b ^ 0xFF for b in raw[start:start + 20])  # a corrupt deflate stream
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError):
        read_npz(path)


def test_read_matrix_refuses_casts_that_change_values(tmp_path):
    path = tmp_path / "m.mtx"
    path.write_text("%%MatrixMarket matrix coordinate complex general\n2 2 1\n1 1 0.0 5.0\n")
    with pytest.raises(DTypeError, match="complex"):
        read_matrix(path)  # numpy dropped the imaginary part, with a warning
    path.write_text("%%MatrixMarket matrix coordinate integer general\n2 2 1\n1 1 3000000000\n")
    with pytest.raises(DTypeError, match="3000000000"):
        read_matrix(path, "int32")  # came back as -1294967296
    path.write_text("%%MatrixMarket matrix coordinate real general\n2 2 1\n1 1 2.5\n")
    with pytest.raises(DTypeError, match="2.5"):
        read_matrix(path, "int64")
    assert read_matrix(path, "float32").dtype == np.float32  # rounding a float is what a float32 read means
