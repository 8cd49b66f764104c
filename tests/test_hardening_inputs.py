"""Issue 14, inputs and files: each test is a defect found by an adversarial pass, refused or handled now.

Tensors from outside (buffers, COO lists, scalars, files of every kind) are
validated once where they enter; what could crash a process runs in a child.
"""

from __future__ import annotations

import gzip
import json
import lzma
import pickle
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.errors import DTypeError, FormatError, InvalidIndicesError, ShapeError, SparseMLIRError
from sparse_mlir.formats import CSR, coo

I32 = np.int32


def coo_buffers(rows, cols, *more):
    """COO level buffers (pos0, crd0, crd1[, crd2]) of len(rows) entries, values 1..nnz."""
    crds = [np.asarray(c, I32) for c in (rows, cols, *more)]
    return (np.array([0, len(rows)], I32), *crds, np.arange(1.0, len(rows) + 1))


# -- item 6: COO and singleton levels are validated like CSR ----------------------------------------

@pytest.mark.parametrize("fmt,shape,buffers,match", [
    ("coo", (3, 3), coo_buffers([0, 0, 1], [2, 1, 0]), "sorted"),          # columns fall within row 0
    ("coo", (3, 3), coo_buffers([0, 0, 1], [1, 1, 0]), "duplicate"),       # (0, 1) twice
    ("coo3", (3, 3, 3), coo_buffers([0, 0, 0], [1, 1, 1], [2, 0, 1]), "sorted"),
    ("coo3", (3, 3, 3), coo_buffers([0, 0, 0], [1, 1, 2], [2, 2, 1]), "duplicate"),
    ("coo3", (3, 3, 3), coo_buffers([0, 0], [2, 1], [0, 0]), "sorted"),    # the middle level falls
])
def test_coo_buffers_are_validated(fmt, shape, buffers, match):
    with pytest.raises(InvalidIndicesError, match=match):
        sm.SparseTensor.from_buffers(fmt, shape, buffers)


def test_coo_checks_whole_tuples_not_single_levels():
    t = sm.SparseTensor.from_buffers("coo3", (3, 3, 3), coo_buffers([0, 0, 0, 1], [1, 1, 2, 0], [0, 2, 2, 2]))
    assert t.nnz == 4
    # a nonunique singleton ("c") may repeat a coordinate; the unique level under it may not repeat a tuple
    t = sm.SparseTensor.from_buffers("ucq", (2, 2, 2), coo_buffers([0, 0], [1, 1], [0, 1]))
    assert t.to_dense()[0, 1].tolist() == [1.0, 2.0]
    with pytest.raises(InvalidIndicesError, match="duplicate"):
        sm.SparseTensor.from_buffers("ucq", (2, 2, 2), coo_buffers([0, 0], [1, 1], [1, 1]))


def test_unsorted_coo_file_is_refused(tmp_path):
    good = sm.SparseTensor.from_coo([[0, 0, 1], [1, 2, 0]], [1.0, 2.0, 3.0], (3, 3), "coo")
    path = tmp_path / "t.smt"
    sm.save_tensor(good, path, compression="none", index_encoding="raw")
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<I", raw[12:16])
    crd1 = next(b for b in json.loads(raw[16:16 + length])["buffers"] if b["name"] == "crd1")
    raw[crd1["offset"]:crd1["offset"] + 8] = np.array([2, 1], I32).tobytes()  # swap row 0's columns
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="sorted"):
        sm.load_tensor(path, verify=False)


def test_unsorted_coo_no_longer_gives_a_wrong_product():
    spmv = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "coo"}, dtype="float64")
    with pytest.raises(InvalidIndicesError):
        spmv(A=sm.SparseTensor.from_buffers("coo", (2, 3), coo_buffers([0, 0], [2, 0])), x=np.ones(3))


# -- item 7: (nnz, ndim) coordinates are refused, not reshaped ----------------------------------------

def test_coordinate_pairs_are_refused_with_a_hint():
    pairs = np.array([[0, 1], [1, 2], [2, 0]])  # three (row, col) pairs
    with pytest.raises(InvalidIndicesError, match=r"coords\.T"):
        sm.SparseTensor.from_coo(pairs, [1.0, 2.0, 3.0], (3, 3))
    t = sm.SparseTensor.from_coo(pairs.T, [1.0, 2.0, 3.0], (3, 3))
    assert t.to_dense()[2, 0] == 3.0


def test_coordinates_of_another_layout_are_refused():
    with pytest.raises(InvalidIndicesError, match="one row per dimension"):
        sm.SparseTensor.from_coo([0, 1, 1, 2], [1.0, 2.0], (3, 3))  # flat, for a 2-d tensor
    assert sm.SparseTensor.from_coo([0, 2], [1.0, 2.0], (3,), "sparse_vector").nnz == 2  # a 1-d list is fine


# -- item 20 (shapes): precise errors, never a raw builtin one ---------------------------------------

@pytest.mark.parametrize("shape,match", [
    ((-1, 3), "negative"),
    ((2**70, 3), "2\\*\\*63"),
    ((2.5, 3), "integers"),
    (("a", 3), "integers"),
    ((True, 3), "integers"),
    (5, "sequence"),
    ((2**62, 2), "allocated"),
])
def test_bad_shapes_raise_shape_error(shape, match):
    with pytest.raises(ShapeError, match=match):
        sm.SparseTensor.from_coo([[0], [0]], [1.0], shape, "csr")
    if isinstance(shape, tuple) and len(shape) == 2:
        with pytest.raises(ShapeError):
            sm.SparseTensor("csr", shape, (np.array([0, 0], I32), np.zeros(0, I32), np.zeros(0)))


# -- item 8: a Python scalar for a 0-d operand is never cast -------------------------------------------

@pytest.fixture(scope="module")
def scaled_int():
    import scipy.sparse as sp

    kernel = sm.compile("y[i] = A[i,j] * s[]", formats={"A": "csr"}, dtype="int32")
    return kernel, sm.SparseTensor.from_scipy(sp.eye(3, format="csr", dtype=np.int32))


@pytest.mark.parametrize("value", [2.7, "2", b"2", True, 2**40, 1 + 0j])
def test_inexact_scalars_are_refused_exact_ones_accepted(scaled_int, value):
    kernel, a = scaled_int
    with pytest.raises(DTypeError):
        kernel(A=a, s=value)
    for exact in (2, 2.0, np.int32(2), np.array(2, np.int32)):
        assert kernel(A=a, s=exact).tolist() == [2, 2, 2]


EXACTNESS = [
    (0.1, "float32", False), (0.5, "float32", True), (1e300, "float32", False), (float("nan"), "float32", True),
    (2**53 + 1, "float64", False), (2**53, "float64", True), (70000.0, "float16", False),
    (2**31, "int32", False), (-2**31, "int32", True), (np.float64(0.5), "float32", False),
]


def test_scalar_exactness_per_dtype():
    from sparse_mlir.runtime.operands import dense_operand

    for value, dtype, ok in EXACTNESS:
        if ok:
            got = dense_operand("s", value, 0, np.dtype(dtype), "cpu")
            assert got.dtype == dtype and (got == value or value != value)
        else:
            with pytest.raises(DTypeError):
                dense_operand("s", value, 0, np.dtype(dtype), "cpu")


# -- item 4: a loaded tensor never reads the file it was named -----------------------------------------

def _rewrite_in_place(path: Path, data: bytes) -> None:
    """What ``cp other.smt path`` does: truncate the same inode, then write."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


def test_rewriting_a_loaded_file_in_place_leaves_the_tensor_intact(tmp_path):
    a = sm.SparseTensor.from_coo([[0, 1, 2], [2, 0, 1]], [1.0, 2.0, 3.0], (3, 3), "csr")
    b = sm.SparseTensor.from_coo([[0, 0, 0], [0, 1, 2]], [7.0, 8.0, 9.0], (3, 3), "csr")
    path, other = tmp_path / "a.smt", tmp_path / "b.smt"
    sm.save_tensor(a, path, compression="none", index_encoding="raw")
    sm.save_tensor(b, other, compression="none", index_encoding="raw")
    for mmap in (True, False):
        t = sm.load_tensor(path, mmap=mmap)
        _rewrite_in_place(path, other.read_bytes())  # same length, other contents
        np.testing.assert_array_equal(t.to_dense(), a.to_dense())
        sm.save_tensor(a, path, compression="none", index_encoding="raw")


def test_truncating_a_loaded_file_does_not_crash_a_kernel_call(tmp_path):
    path = tmp_path / "a.smt"
    a = sm.SparseTensor.from_coo(np.nonzero(np.eye(300)), np.ones(300), (300, 300), "csr")
    sm.save_tensor(a, path, compression="none", index_encoding="raw")
    script = textwrap.dedent(f"""
        import numpy as np, sparse_mlir as sm
        t = sm.load_tensor({str(path)!r})
        with open({str(path)!r}, "r+b") as f:
            f.truncate(0)
            f.write(b"short")
        y = sm.compile("y[i] = A[i,j] * x[j]", formats={{"A": "csr"}}, dtype="float64")(A=t, x=np.ones(300))
        print("sum", y.sum())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "sum 300.0" in out.stdout, (out.returncode, out.stderr[-2000:])


# -- item 15 and 20 (.smt): counts are checked before anything is inflated ------------------------------

def _forge(path: Path, tensor: sm.SparseTensor, edit, payloads: dict[str, bytes] | None = None) -> None:
    """Write ``tensor`` as .smt with its header records edited and some buffers' stored bytes replaced."""
    from dataclasses import asdict

    from sparse_mlir.abi.c_signature import format_to_json
    from sparse_mlir.io.smt import _Entry, _header, _stored, _write_atomically

    entries, stored = _stored(tensor, "none", "raw")
    for i, e in enumerate(entries):
        if payloads and e.name in payloads:
            stored[i] = payloads[e.name]
            entries[i] = _Entry(**{**asdict(e), "length": len(stored[i]), "compression": "zlib"})
    meta = {"format": format_to_json(tensor.format), "shape": list(tensor.shape), "dtype": tensor.dtype.name}
    edit(meta, entries)
    header, placed = _header(meta, entries)
    _write_atomically(path, header, placed, stored)


def _zlib_zeros(nbytes: int) -> bytes:
    c = zlib.compressobj(9)
    chunk = bytes(1 << 24)
    out = [c.compress(chunk) for _ in range(nbytes >> 24)]
    return b"".join(out) + c.flush()


def _peak_mib(action) -> float:
    tracemalloc.start()
    try:
        action()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2**20


def test_a_count_the_shape_rules_out_is_refused_before_inflating(tmp_path):
    from dataclasses import asdict

    from sparse_mlir.io.smt import _Entry

    t = sm.SparseTensor.from_coo([[0, 1], [1, 2]], [1.0, 2.0], (3, 3), "csr")
    bomb = _zlib_zeros(1 << 28)  # 256 MiB of zeros in about 260 KB

    def claim(meta, entries):
        entries[0] = _Entry(**{**asdict(entries[0]), "count": (1 << 28) // 4})

    path = tmp_path / "bomb.smt"
    _forge(path, t, claim, {"pos1": bomb})
    assert path.stat().st_size < 400_000

    def load():
        with pytest.raises(FormatError, match="positions"):
            sm.load_tensor(path, verify=False)

    assert _peak_mib(load) < 32


def _edit_record(name, **changes):
    from dataclasses import asdict

    from sparse_mlir.io.smt import _Entry

    def edit(meta, entries):
        i = next(k for k, e in enumerate(entries) if e.name == name)
        entries[i] = _Entry(**{**asdict(entries[i]), **changes})
    return edit


def _edit_meta(**changes):
    return lambda meta, entries: meta.update(changes)


@pytest.mark.parametrize("edit,match", [
    (_edit_meta(shape=[2**64, 3]), "2\\*\\*63"),
    (_edit_meta(shape=[3.5, 3]), "integers"),
    (_edit_meta(shape="33"), "integers"),
    (_edit_meta(shape=None), "sequence"),
    (_edit_meta(format={"levels": [["dense", True, True, 0, 0], ["compressed", 1, True, 0, 0]],
                        "dim_to_lvl": [[0, "", 0], [1, "", 0]], "pos_width": 32, "crd_width": 32, "name": "x"}),
     "boolean"),
    (_edit_meta(format={"levels": [["dense", True, True, 0, 0], ["compressed", True, True, 0, 0]],
                        "dim_to_lvl": [[0, "", 0], [1, "", 0]], "pos_width": 32.0, "crd_width": 32, "name": "x"}),
     "pos_width"),
    (_edit_record("crd1", count=10, compression="zlib", length=len(zlib.compress(bytes(40)))), "more than the 9"),
    (_edit_record("pos1", count=True), "non-negative integer"),
])
def test_odd_headers_raise_format_error(tmp_path, edit, match):
    t = sm.SparseTensor.from_coo([[0, 1], [1, 2]], [1.0, 2.0], (3, 3), "csr")
    path = tmp_path / "odd.smt"
    _forge(path, t, edit, {"crd1": zlib.compress(bytes(40))} if "9" in match else None)
    with pytest.raises(FormatError, match=match):
        sm.load_tensor(path, verify=False)


def test_deeply_nested_header_is_a_format_error(tmp_path):
    from sparse_mlir.io.smt import MAGIC, VERSION

    header = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "deep.smt"
    path.write_bytes(struct.pack("<8sII", MAGIC, VERSION, len(header)) + header)
    with pytest.raises(FormatError, match="nested"):
        sm.load_tensor(path)


def test_coo_coordinate_count_is_bounded_by_its_tuples(tmp_path):
    t = sm.SparseTensor.from_coo([[0, 1], [1, 2]], [1.0, 2.0], (2, 3), "coo")

    stored = {"crd0": zlib.compress(bytes(28)), "crd1": zlib.compress(bytes(28)), "values": zlib.compress(bytes(56))}

    def grow(meta, entries):  # 2 x 3 holds at most 6 distinct (row, col) tuples
        for name, payload in stored.items():
            _edit_record(name, count=7, length=len(payload), compression="zlib")(meta, entries)
    path = tmp_path / "coo.smt"
    _forge(path, t, grow, stored)
    with pytest.raises(FormatError, match="more than the 6"):
        sm.load_tensor(path, verify=False)


# -- items 15 and 20 (text files): .smtx and Matrix Market counts cannot drive memory ----------------

def _write(path: Path, data: bytes) -> Path:
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def test_a_tiny_smtx_cannot_allocate_its_announced_nonzeros(tmp_path):
    from sparse_mlir.io.matrix_files import read_smtx

    path = _write(tmp_path / "a.smtx", b"1000000, 100, 20000000\n0\n\n")  # 28 bytes announcing 20M values
    read_smtx(_write(tmp_path / "warm.smtx", b"1, 1, 0\n0 0\n"))  # imports outside the measurement

    def load():
        with pytest.raises(FormatError, match="holds only"):
            read_smtx(path)

    assert _peak_mib(load) < 16


def test_a_tiny_mtx_cannot_allocate_its_announced_entries(tmp_path):
    from sparse_mlir.io.matrix_files import read_mtx

    path = _write(tmp_path / "a.mtx.gz", b"%%MatrixMarket matrix coordinate real general\n"
                                         b"5000000 5000000 20000000\n1 1 1\n")
    read_mtx(_write(tmp_path / "warm.mtx", b"%%MatrixMarket matrix coordinate real general\n1 1 1\n1 1 2\n"))

    def load():
        with pytest.raises(FormatError, match="holds only"):
            read_mtx(path)

    assert _peak_mib(load) < 16


def test_a_gzip_bomb_behind_small_counts_is_not_inflated(tmp_path):
    from sparse_mlir.io.matrix_files import read_smtx

    path = tmp_path / "bomb.smtx.gz"
    path.write_bytes(gzip.compress(b"3, 3, 1\n0 1 1 1\n0\n" + b" " * (1 << 27)))  # 128 MiB of blanks

    def load():
        with pytest.raises(FormatError, match="more data"):
            read_smtx(path)

    assert _peak_mib(load) < 16


@pytest.mark.parametrize("text,match", [
    (b"3, 3, 2\n0 1 2\n0 2\n", "row offsets"),            # one offset short
    (b"3, 3, 2\n0 2 1 2\n0 2\n", "rise"),                 # offsets fall
    (b"3, 3, 2\n0 1 2 2\n0 5\n", "column index"),         # column out of range
    (b"3, 3, 2\n0 1 2 2\n0 99999999999999999999999\n", "64-bit"),
    (b"3, 3, 2\n0 1 2 2\n0 2\n7 7 7\n", "after"),
    (b"3, 3, 2\n0 1 2 2\n0\n", "column indices"),
])
def test_malformed_smtx_lines_raise_format_error(tmp_path, text, match):
    from sparse_mlir.io.matrix_files import read_smtx

    with pytest.raises(FormatError, match=match):
        read_smtx(_write(tmp_path / "m.smtx", text))


@pytest.mark.parametrize("body,match", [
    (b"%%MatrixMarket matrix coordinate real general\n3 3 2\n1 1 1.5\n3 9 2\n", "malformed"),
    (b"%%MatrixMarket matrix coordinate real general\n3 3 2\n1 1 x\n3 2 2\n", "malformed"),
    (b"%%MatrixMarket matrix coordinate real general\n9 9 20\n1 1 1\n", "holds only"),
    (b"%%MatrixMarket matrix coordinate real general\n3 3 99\n", "do not fit"),
    (b"%%MatrixMarket matrix array real general\n2 2\n1\n2\n3\n", "holds only"),
    (b"%%MatrixMarket tensor coordinate real general\n3 3 1\n1 1 1\n", "banner"),
])
def test_malformed_mtx_raises_format_error(tmp_path, body, match):
    from sparse_mlir.io.matrix_files import read_mtx

    with pytest.raises(FormatError, match=match):
        read_mtx(_write(tmp_path / "m.mtx", body))


# -- item 11: converting to .smtx never drops values silently ------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[1])


def test_convert_to_smtx_needs_pattern_only_and_then_warns(tmp_path):
    src, out = tmp_path / "x.smt", tmp_path / "y.smtx.gz"
    sm.save_tensor(sm.SparseTensor.from_coo([[0, 1], [1, 0]], [2.5, -1.0], (2, 2), "csr"), src)
    refused = _cli("convert", str(src), str(out))
    assert refused.returncode != 0 and "--pattern-only" in refused.stderr and not out.exists()
    done = _cli("convert", str(src), str(out), "--pattern-only")
    assert done.returncode == 0 and "dropped" in done.stderr
    from sparse_mlir.io.matrix_files import load_any

    assert load_any(out).to_scipy().indices.tolist() == [1, 0]


def test_save_any_to_smtx_warns_that_values_are_dropped(tmp_path):
    from sparse_mlir.io.matrix_files import save_any

    t = sm.SparseTensor.from_coo([[0], [1]], [2.5], (2, 2), "csr")
    with pytest.warns(UserWarning, match="values are dropped"):
        save_any(t, tmp_path / "m.smtx")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_any(t, tmp_path / "n.smtx", pattern_only=True)


# -- item 5: the exported C function refuses a position buffer that is not monotone -----------------

SPIKE_SCRIPT = """
import sys, numpy as np, sparse_mlir as sm
from sparse_mlir.errors import InvalidIndicesError
kernel = sm.load_kernel(sys.argv[1]) if len(sys.argv) > 1 else sm.compile(
    "y[i] = A[i,j] * x[j]", formats={"A": "csr"}, dtype="float64")
rows = 64
pos = np.full(rows + 1, 2, np.int32)
pos[0], pos[rows // 2] = 0, 1 << 28                      # right length, 0 ... nnz, a spike inside
spiky = sm.SparseTensor("csr", (rows, rows), (pos, np.array([0, 1], np.int32), np.ones(2)), validate=False)
for bad in (spiky,
            sm.SparseTensor("csr", (rows, rows), (np.r_[np.int32(1), pos[1:]].astype(np.int32),
                                                   np.array([0, 1], np.int32), np.ones(2)), validate=False)):
    try:
        kernel(A=bad, x=np.ones(rows))
        print("computed")
    except InvalidIndicesError as exc:
        print("refused:", exc)
good = sm.SparseTensor.from_coo([[0, 1], [0, 1]], [1.0, 2.0], (rows, rows), "csr")
print("good", kernel(A=good, x=np.ones(rows))[:2].tolist())
"""


def _run_spike(*args: str) -> str:
    out = subprocess.run([sys.executable, "-c", SPIKE_SCRIPT, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return out.stdout


def test_jit_kernel_refuses_a_position_spike():
    out = _run_spike()
    assert out.count("refused:") == 2 and "good [1.0, 2.0]" in out, out


def test_exported_library_refuses_a_position_spike(tmp_path):
    sm.export(sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}, dtype="float64"), tmp_path, "spmv_spike",
              shapes={"A": (64, 64)})
    out = _run_spike(str(tmp_path / "spmv_spike.json"))
    assert out.count("refused:") == 2 and "good [1.0, 2.0]" in out, out


@pytest.mark.parametrize("width", [32, 64])
def test_a_fall_in_the_positions_is_refused_wherever_it_is(width):
    """The vectorized position check (``c_entry.VECTORIZE``) sees a single fall at any offset: in its vector
    body or in its scalar tail.  Each fall stays inside the buffers, so a missed one would be a wrong answer
    here, not a wild read."""
    rows = 150  # several 16-lane vectors of int32 positions, and a tail
    kernel = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": CSR.with_widths(width, width)}, dtype="float64")
    dtype = np.int32 if width == 32 else np.int64
    good = np.arange(rows + 1, dtype=dtype)  # one entry a row
    crd, values, x = np.zeros(rows, dtype), np.ones(rows), np.ones(rows)
    assert kernel(A=sm.SparseTensor(CSR.with_widths(width, width), (rows, rows), (good, crd, values)), x=x).sum() \
        == rows
    for k in range(2, rows):  # every pair (k - 1, k) but the first and the last, which no in-bounds fall reaches
        pos = good.copy()
        pos[k] = k - 2
        bad = sm.SparseTensor(CSR.with_widths(width, width), (rows, rows), (pos, crd, values), validate=False)
        with pytest.raises(InvalidIndicesError, match="inconsistent level buffer lengths"):
            kernel(A=bad, x=x)


@pytest.mark.parametrize("content", [b"not a zip", b"PK\x03\x04" + bytes(40)])
def test_malformed_npz_raises_format_error(tmp_path, content):
    from sparse_mlir.io.matrix_files import read_npz

    path = tmp_path / "m.npz"
    path.write_bytes(content)
    with pytest.raises(FormatError, match="npz"):
        read_npz(path)


def test_npz_with_inconsistent_arrays_raises_format_error(tmp_path):
    from sparse_mlir.io.matrix_files import read_npz

    path = tmp_path / "m.npz"
    np.savez(path, format=np.array("csr"), shape=np.array([3, 3]), data=np.ones(2), indices=np.array([0, 1]),
             indptr=np.array([0, 5, 9, 9]))
    with pytest.raises(FormatError):
        read_npz(path)


@pytest.mark.parametrize("buffers,error", [
    ((np.array([None, 1, 1]), np.array([0], I32), np.ones(1)), DTypeError),
    ((np.array([0, 1, 1], I32), np.array(["a"]), np.ones(1)), DTypeError),
    (None, InvalidIndicesError),
    ((np.array([[0, 1, 1]], I32), np.array([0], I32), np.ones(1)), InvalidIndicesError),
    ((np.array([0, 1, 1], I32), np.array([0], I32), np.ones((1, 1))), InvalidIndicesError),
])
def test_odd_buffers_raise_precise_errors(buffers, error):
    with pytest.raises(error):
        sm.SparseTensor.from_buffers("csr", (2, 2), buffers)


def test_convert_reports_a_missing_input_without_a_traceback(tmp_path):
    out = _cli("convert", str(tmp_path / "missing.smt"), str(tmp_path / "y.smt"))
    assert out.returncode == 2 and "No such file" in out.stderr and "Traceback" not in out.stderr


# -- what a kernel trusts cannot change after the check (an attacker's audit, session 28) -------------------------

SPMV_CSR = "y[i] = A[i,j] * x[j]"


def test_a_tensor_keeps_copies_of_the_index_buffers_it_checked():
    """``from_buffers`` shared the caller's coordinates; setting one to 2**30 afterwards crashed the SpMV."""
    pos, crd, val = np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), np.array([1.0, 2.0])
    a = sm.SparseTensor.from_buffers("csr", (2, 2), (pos, crd, val))
    crd[1], pos[1] = 1 << 30, 5
    np.testing.assert_array_equal(sm.compile(SPMV_CSR, formats={"A": "csr"})(A=a, x=np.ones(2)), [1.0, 2.0])
    val[0] = 7.0  # values are copied too: nothing a kept copy of them (a schedule's dense copy) could miss
    assert a.values[0] == 1.0


def test_a_checked_tensor_cannot_be_changed_and_a_lying_subclass_is_checked_again():
    """``A.shape = (2, 2)`` on a checked (2, 4M) tensor, or a subclass whose ``shape`` property says so, made the
    kernel read 4M past ``x``; pickling still round-trips (checked again on load)."""
    m = 4_000_000
    a = sm.SparseTensor.from_buffers("csr", (2, m), (np.array([0, 1, 2], np.int32), np.array([0, m - 1], np.int32),
                                                     np.array([1.0, 2.0])))
    for name, value in (("shape", (2, 2)), ("buffers", ()), ("format", sm.CSC), ("dtype", np.float32)):
        with pytest.raises(AttributeError, match="cannot be changed"):
            setattr(a, name, value)

    class Lying(sm.SparseTensor):
        __slots__ = ()

        @property
        def shape(self):
            return (2, 2)

    lying = Lying.from_buffers("csr", (2, m), tuple(a.buffers))
    with pytest.raises(ShapeError):
        sm.compile(SPMV_CSR, formats={"A": "csr"})(A=lying, x=np.ones(2))
    again = pickle.loads(pickle.dumps(a))
    assert again.shape == a.shape and all(np.array_equal(x, y) for x, y in zip(again.buffers, a.buffers))


def test_numpy_subclasses_are_checked_by_their_memory_and_huge_results_refused():
    """A subclass's ``dtype`` or ``shape`` property that lies about its memory was read (and, as out=, written)
    past the end; a result too large to allocate was numpy's MemoryError or ValueError."""

    class LyingDtype(np.ndarray):
        dtype = property(lambda self: np.dtype("float64"))

    class LyingShape(np.ndarray):
        shape = property(lambda self: (64,))

    kernel = sm.compile(SPMV_CSR, formats={"A": "csr"})
    a = sp.random(64, 64, density=0.1, format="csr", random_state=0)
    with pytest.raises(DTypeError, match="int8"):
        kernel(A=a, x=np.ones(64, np.int8).view(LyingDtype))
    with pytest.raises(DTypeError, match="int8"):
        kernel(A=a, x=np.ones(64), out=np.zeros(64, np.int8).view(LyingDtype))
    with pytest.raises(ShapeError, match=r"\(16,\)"):
        kernel(A=a, x=np.ones(64), out=np.zeros(16).view(LyingShape))
    huge = sm.SparseTensor.from_coo([[0, 1], [0, 1]], [1.0, 2.0], (1 << 62, 4), "dcsr")
    with pytest.raises(ShapeError, match="cannot be allocated"):
        sm.compile(SPMV_CSR, formats={"A": "dcsr"})(A=huge, x=np.ones(4))


def test_audit_five_tensor_edges():
    """N:M ``from_dense(where=)`` padded a group with the array's own values, not zeros (a pruned weight came
    back); CSC @ CSR failed in the sparsifier; ragged lists and huge dense views were numpy's errors; a knob of
    Unicode digits (``"²"``) was a ValueError on every call."""
    row = np.array([[5.0, 6.0, 7.0, 8.0]])
    kept = sm.SparseTensor.from_dense(row, "2:4", where=np.array([[False, False, True, False]]))
    np.testing.assert_array_equal(kept.to_dense(), [[0.0, 0.0, 7.0, 0.0]])
    a = sp.random(20, 30, density=0.2, format="csr", random_state=1)
    b = sp.random(30, 10, density=0.2, format="csr", random_state=2)
    product = sm.SparseTensor.from_scipy(a, "csc") @ sm.SparseTensor.from_scipy(b)
    np.testing.assert_allclose(product.to_dense(), (a @ b).toarray(), rtol=1e-12)
    with pytest.raises(ShapeError, match="rectangular"):
        sm.SparseTensor.from_coo([[0, 1], [0, 1]], [[1.0], [2.0, 3.0]], (2, 2))
    with pytest.raises(ShapeError, match="rectangular"):
        sm.SparseTensor.from_dense([[1.0, 2.0], [3.0]], "csr")
    huge = sm.SparseTensor.from_coo([[0, 1], [0, 1]], [1.0, 2.0], (1 << 40, 1 << 40), "dcsr")
    for convert in (huge.to_dense, huge.toarray, huge.to_scipy):
        with pytest.raises(ShapeError):
            convert()
    script = ("import numpy as np, scipy.sparse as sp, sparse_mlir as sm; "
              "k = sm.compile('y[i] = A[i,j] * x[j]', formats={'A': 'csr'}); "
              "print(k(A=sp.eye(3, format='csr'), x=np.ones(3)).sum())")
    for name in ("SPARSE_MLIR_NUM_THREADS", "KMP_BLOCKTIME", "SPARSE_MLIR_MAX_LOADED_KERNELS"):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={**__import__("os").environ, name: "²"}, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "3.0", (name, done.stderr[-500:])


def test_the_c_entry_point_refuses_negative_lengths_and_size_overflow(tmp_path):
    """Called from C: a negative position length that matched a wrapped ``rows + 1`` (rows = INT64_MAX) passed,
    and the position check read past the buffer; rows = 2**62 at 2:4 wrapped the coordinate count to 0 (an
    empty matrix of 2**62 rows, whose kernel read past its values)."""
    import ctypes

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    spmm = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32")
    nm = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "2:4"}, dtype="float32")
    sm.export(spmm, tmp_path, "guarded_spmm")
    sm.export(nm, tmp_path, "guarded_nm")
    pos, dense = np.zeros(3, np.int32), np.zeros(4, np.float32)
    at = lambda a: a.ctypes.data  # noqa: E731
    lib = ctypes.CDLL(str(tmp_path / "libguarded_spmm.so"))
    lib.guarded_spmm.restype, lib.guarded_spmm.argtypes = ctypes.c_int32, [ptr, i64, ptr, i64, ptr, i64, i64, i64,
                                                                           ptr, i64, i64, ptr, i64, i64]
    big = np.iinfo(np.int64)
    status = lib.guarded_spmm(at(pos), big.min, None, 0, None, 0, big.max, 4, at(dense), 4, 0, at(dense), big.max, 0)
    assert status == 3  # SPARSE_MLIR_BAD_LEVELS: lengths are never negative
    status = lib.guarded_spmm(at(pos), 3, None, 0, None, 0, big.max, 4, at(dense), 4, 0, at(dense), big.max, 0)
    assert status in (2, 3)  # INT64_MAX rows: their positions cannot be counted
    lib = ctypes.CDLL(str(tmp_path / "libguarded_nm.so"))
    lib.guarded_nm.restype, lib.guarded_nm.argtypes = ctypes.c_int32, [ptr, i64, ptr, i64, i64, i64, ptr, i64, i64,
                                                                       ptr, i64, i64]
    crd = np.zeros(4, np.int8)
    status = lib.guarded_nm(at(crd), 0, at(dense), 0, 1 << 62, 8, at(dense), 8, 0, at(dense), 1 << 62, 0)
    assert status == 2  # SPARSE_MLIR_SIZE_MISMATCH: 2**62 rows x 2 groups x 2 entries overflows
