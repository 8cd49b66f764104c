"""SparseTensor: builders, zero-copy sharing, round trips, validation, and never modifying inputs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import prune_nm, random_sparse

import sparse_mlir as sm
from sparse_mlir.errors import DTypeError, FormatError, InvalidIndicesError, PatternError, ShapeError
from sparse_mlir.formats import coo

FORMATS_2D = ["csr", "csc", "coo", "dcsr", "ds:1,0", "bsr2x2", "sd", "uq"]


@pytest.mark.parametrize("fmt", FORMATS_2D)
@pytest.mark.parametrize("shape", [(6, 8), (0, 4), (4, 0), (1, 1)])
def test_dense_round_trip(rng, fmt, shape):
    dense = random_sparse(rng, shape, 0.3, "float64")
    if fmt.startswith("bsr") and any(s % 2 for s in shape):
        with pytest.raises(FormatError, match="not a multiple"):
            sm.SparseTensor.from_dense(dense, fmt)
        return
    t = sm.SparseTensor.from_dense(dense, fmt)
    assert t.shape == shape and t.dtype == np.float64
    np.testing.assert_array_equal(t.to_dense(), dense)
    np.testing.assert_array_equal(t.to_scipy().toarray(), dense)


@pytest.mark.parametrize("fmt", ["csf", "coo", "sss", "dss", "dds"])
def test_order_3_round_trip(rng, fmt):
    dense = random_sparse(rng, (3, 4, 5), 0.25, "int32")
    t = sm.SparseTensor.from_dense(dense, fmt)
    np.testing.assert_array_equal(t.to_dense(), dense)


def test_order_1(rng):
    dense = random_sparse(rng, 17, 0.3, "float32")
    np.testing.assert_array_equal(sm.SparseTensor.from_dense(dense, "s").to_dense(), dense)


def test_nm_round_trip_pads_groups(rng):
    dense = prune_nm(random_sparse(rng, (4, 8), 0.9, "float32"), 2, 4)
    dense[0, :4] = [0, 0, 0, 5]  # a group with one nonzero gets one explicit zero
    t = sm.SparseTensor.from_dense(dense, "2:4")
    assert t.nnz == 4 * 8 // 2
    np.testing.assert_array_equal(t.to_dense(), dense)
    offsets = t.buffer("crd2").reshape(-1, 2)
    assert (np.diff(offsets, axis=1) > 0).all()


def test_nm_full_groups_take_the_unpadded_path_with_the_same_buffers(rng):
    """Every group full (pruned weights) is packed without padding; one short group pads; both agree."""
    full = prune_nm(rng.standard_normal((6, 16)).astype(np.float32) + 3, 2, 4)  # no exact zeros kept
    short = full.copy()
    short[2, 5] = 0
    for dense in (full, short):
        t = sm.SparseTensor.from_dense(dense, "2:4")
        np.testing.assert_array_equal(t.to_dense(), dense)
        assert t.nnz == 6 * 16 // 2 and (np.diff(t.buffer("crd2").reshape(-1, 2), axis=1) > 0).all()
    a, b = (sm.SparseTensor.from_dense(d, "2:4") for d in (full, short))
    same = np.ones(a.nnz, bool)
    same[(2 * 4 + 1) * 2:(2 * 4 + 1) * 2 + 2] = False  # the short group's two slots
    np.testing.assert_array_equal(a.buffer("crd2")[same], b.buffer("crd2")[same])


def test_nm_pattern_violation_names_the_group():
    dense = np.zeros((2, 8))
    dense[1, 4:7] = 1.0
    with pytest.raises(PatternError, match="row 1, columns 4..7"):
        sm.SparseTensor.from_dense(dense, "2:4")


@pytest.mark.parametrize("fmt", ["2:4", "1:4", "4:8", "1:2", "3:16", "2:6", "4:128", "2:4;crd=32"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_dense_to_nm_packs_straight_from_the_groups_as_the_coordinate_path_does(rng, fmt, dtype):
    """``from_dense`` reads a row N:M format's groups straight off the matrix (``storage.pack_row_nm``); the same
    matrix through coordinates (``from_coo`` of its ``np.nonzero``) gives the same format and buffers: full,
    short and empty groups, an empty row, NaN (a nonzero), -0.0 (a zero), views that are not C-contiguous."""
    from sparse_mlir.formats import as_format
    from sparse_mlir.tensor import storage

    fmt = as_format(fmt.replace(";crd=32", ""), 2).with_widths(None, 32) if ";" in fmt else as_format(fmt, 2)
    level = fmt.levels[-1]
    assert storage.is_row_nm(fmt)
    dense = prune_nm(rng.integers(1, 9, size=(7, 6 * level.m)).astype(dtype), level.n, level.m)
    dense[1, :level.m] = 0  # an empty group
    dense[2] = 0  # an empty row
    dense[3, rng.choice(dense.shape[1], dense.shape[1] // 2, replace=False)] = 0  # short groups
    if dtype.startswith("float"):
        dense[4, np.flatnonzero(dense[4])[0]] = np.nan
        dense[5, np.flatnonzero(dense[5])[0]] = -0.0
    for view in (dense, np.asfortranarray(dense), np.ascontiguousarray(dense.T).T):
        direct = sm.SparseTensor.from_dense(view, fmt)
        coords = np.array(np.nonzero(view))
        through = sm.SparseTensor.from_coo(coords, view[tuple(coords)], view.shape, fmt)
        assert direct.format == through.format == fmt and direct.shape == through.shape
        for got, want in zip(direct.buffers, through.buffers, strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    assert np.isnan(direct.to_dense()[4]).sum() == (1 if dtype.startswith("float") else 0)


@pytest.mark.parametrize("fmt", ["2:4", "csr", "coo"])
def test_from_dense_where_stores_exactly_the_kept_entries_zeros_included(rng, fmt):
    dense = prune_nm(rng.integers(1, 9, size=(5, 16)).astype(np.float32), 2, 4)
    kept = dense != 0
    dense[0, np.flatnonzero(dense[0])[:3]] = 0  # kept zeros stay stored
    dense[1, np.flatnonzero(~kept[1])[0]] = 7  # an entry not kept is dropped
    t = sm.SparseTensor.from_dense(dense, fmt, where=kept)
    assert t.nnz == kept.sum()
    np.testing.assert_array_equal(t.to_dense(), np.where(kept, dense, 0))
    assert (t.values == 0).sum() == 3  # the kept zeros, stored (2:4 groups are full: no padding)
    with pytest.raises(DTypeError, match="boolean"):
        sm.SparseTensor.from_dense(dense, fmt, where=kept.astype(np.int8))
    with pytest.raises(ShapeError, match="where has shape"):
        sm.SparseTensor.from_dense(dense, fmt, where=kept[:, :8])


def test_dense_to_nm_refuses_a_crowded_group_as_the_coordinate_path_does():
    dense = np.zeros((3, 12), np.float32)
    dense[2, 4:7] = [1, np.nan, 2]
    dense[1, 8:11] = 1  # both groups hold 3; the first of the most crowded is named
    with pytest.raises(PatternError, match="group 5 .row 1, columns 8..11. has 3 nonzeros, more than 2") as direct:
        sm.SparseTensor.from_dense(dense, "2:4")
    coords = np.array(np.nonzero(dense))
    with pytest.raises(PatternError) as through:
        sm.SparseTensor.from_coo(coords, dense[tuple(coords)], dense.shape, "2:4")
    assert str(direct.value) == str(through.value)


def test_dense_to_nm_with_columns_not_whole_groups_takes_the_coordinate_path():
    dense = np.zeros((2, 6), np.float32)
    with pytest.raises(FormatError, match="multiple"):
        sm.SparseTensor.from_dense(dense, "2:4")


def test_from_scipy_csr_keeps_its_own_copy():
    """A tensor must not share memory the caller can still write (``tensor.host``'s docstring): a scipy operand
    passed to a kernel is used in place, checked on every call, but a tensor built from it is a copy."""
    m = sp.random(20, 30, density=0.2, format="csr", dtype=np.float32, random_state=0)
    m.indices = m.indices.astype(np.int32)
    m.indptr = m.indptr.astype(np.int32)
    t = sm.SparseTensor.from_scipy(m)
    assert t.format == sm.CSR
    assert not any(np.shares_memory(t.buffer(n), b) for n, b in (("values", m.data), ("crd1", m.indices)))
    assert m.data.flags.writeable, "the user's arrays keep their flags"
    assert not t.values.flags.writeable
    m.data[:] = 0
    assert t.values.any()


@pytest.mark.parametrize("kind,expected", [("csr", sm.CSR), ("csc", sm.CSC), ("coo", sm.COO)])
def test_from_scipy_infers_format(kind, expected):
    m = sp.random(7, 9, density=0.3, format=kind, random_state=1)
    t = sm.SparseTensor.from_scipy(m)
    assert t.format == expected
    np.testing.assert_array_equal(t.to_dense(), m.toarray())


def test_from_scipy_bsr():
    m = sp.random(8, 6, density=0.3, format="csr", random_state=2).tobsr(blocksize=(2, 3))
    t = sm.SparseTensor.from_scipy(m)
    assert t.format == sm.BSR(2, 3)
    np.testing.assert_array_equal(t.to_dense(), m.toarray())
    assert isinstance(t.to_scipy(), sp.bsr_array)  # scipy's sparse arrays by default (issue 16)
    assert isinstance(t.to_scipy(kind="matrix"), sp.bsr_matrix)


def test_unsorted_duplicates_are_summed_in_a_copy():
    indptr = np.array([0, 3, 4], dtype=np.int32)
    indices = np.array([2, 0, 2, 1], dtype=np.int32)
    data = np.array([1.0, 2.0, 3.0, 4.0])
    m = sp.csr_matrix((data.copy(), indices.copy(), indptr.copy()), shape=(2, 3))
    t = sm.SparseTensor.from_scipy(m)
    np.testing.assert_array_equal(t.to_dense(), [[2.0, 0, 4.0], [0, 4.0, 0]])
    np.testing.assert_array_equal(m.indices, indices)
    np.testing.assert_array_equal(m.data, data)


@pytest.mark.parametrize("fmt, shape", [("csr", (9, 7)), ("csc", (9, 7)), ("coo", (9, 7)), ("dcsr", (9, 7)),
                                        ("bsr2x2", (8, 6)), ("2:4", (5, 8)), ("csf", (4, 3, 5)), ("coo3", (4, 3, 5))])
@pytest.mark.parametrize("huge", [False, True])
def test_coordinates_in_any_order_with_duplicates_sort_and_sum_as_a_reference_does(rng, fmt, shape, huge,
                                                                                   monkeypatch):
    """``canonicalize`` sorts by one level-order key where the level sizes multiply within ``int64``, by the
    levels one by one past that (``huge``: the key is refused); both give the reference: entries in level
    order, duplicates summed in the order given."""
    from sparse_mlir.tensor import storage

    if huge:
        monkeypatch.setattr(storage, "_level_order_key", lambda lvl, sizes: None)
    fmt_ = sm.formats.as_format(fmt, len(shape))
    count = 40
    coords = np.vstack([rng.integers(0, extent, count) for extent in shape])
    if fmt == "2:4":  # at most 2 a group: the first two columns of each group of 4
        coords[1] = (coords[1] // 4) * 4 + coords[1] % 2
    coords = np.hstack([coords, coords[:, :10]])  # duplicates
    values = rng.integers(1, 9, coords.shape[1]).astype(np.float64)
    got_coords, got_values = storage.canonicalize(coords, values, shape, fmt_)
    lvl = storage.level_coordinates(fmt_, coords)
    reference: dict[tuple, float] = {}
    for column in sorted(range(coords.shape[1]), key=lambda k: (tuple(lvl[:, k]), k)):
        reference[tuple(lvl[:, column])] = reference.get(tuple(lvl[:, column]), 0.0) + values[column]
    got_lvl = storage.level_coordinates(fmt_, got_coords)
    assert [tuple(c) for c in got_lvl.T] == list(reference)
    np.testing.assert_array_equal(got_values, list(reference.values()))
    t = sm.SparseTensor.from_coo(coords, values, shape, fmt_)
    dense = np.zeros(shape)
    np.add.at(dense, tuple(coords), values)
    np.testing.assert_array_equal(t.to_dense(), dense)


def test_int64_indices_are_narrowed_when_they_fit():
    m = sp.random(10, 10, density=0.3, format="csr", random_state=3)
    m.indices, m.indptr = m.indices.astype(np.int64), m.indptr.astype(np.int64)
    t = sm.SparseTensor.from_scipy(m)
    assert t.format == sm.CSR and t.buffer("crd1").dtype == np.int32


def test_dimensions_beyond_32_bits_widen_the_format():
    shape = (3, 2**33)
    t = sm.SparseTensor.from_coo([[0, 2], [5, 2**33 - 1]], [1.0, 2.0], shape, "csr")
    assert t.format.crd_width == 64
    coords, values = t.to_coo()
    assert coords[1].tolist() == [5, 2**33 - 1]


def test_from_coo_does_not_modify_inputs():
    coords = np.array([[1, 0, 1], [2, 1, 2]])
    values = np.array([1.0, 2.0, 3.0])
    before = (coords.copy(), values.copy())
    t = sm.SparseTensor.from_coo(coords, values, (2, 3), "csr")
    np.testing.assert_array_equal(coords, before[0])
    np.testing.assert_array_equal(values, before[1])
    np.testing.assert_array_equal(t.to_dense(), [[0, 2.0, 0], [0, 0, 4.0]])


@pytest.mark.parametrize("coords,match", [
    ([[0, 5], [0, 0]], "out of range"),
    ([[0, -1], [0, 0]], "out of range"),
    ([[0, 1], [0, 3]], "out of range"),
])
def test_from_coo_rejects_bad_coordinates(coords, match):
    with pytest.raises(InvalidIndicesError, match=match):
        sm.SparseTensor.from_coo(coords, [1.0, 2.0], (2, 3), "csr")


def test_nnz_mismatch():
    with pytest.raises(InvalidIndicesError, match="nnz mismatch"):
        sm.SparseTensor.from_coo([[0, 1], [0, 1]], [1.0, 2.0, 3.0], (2, 2), "csr")


@pytest.mark.parametrize("buffers,match", [
    (([0, 2, 1], [0, 1], [1.0, 2.0]), "monotone"),
    (([0, 1], [0], [1.0]), "entries"),
    (([1, 1, 2], [0, 1], [1.0, 2.0]), "start at 0"),
    (([0, 1, 3], [0, 1], [1.0, 2.0]), "nnz mismatch"),
    (([0, 2, 2], [1, 0], [1.0, 2.0]), "sorted"),
    (([0, 2, 2], [1, 1], [1.0, 2.0]), "sorted"),
    (([0, 1, 2], [0, 7], [1.0, 2.0]), "out of range"),
    (([0, 1, 2], [0, 1], [1.0]), "nnz mismatch"),
])
def test_from_buffers_validates(buffers, match):
    pos, crd, vals = (np.asarray(buffers[0], np.int32), np.asarray(buffers[1], np.int32), np.asarray(buffers[2]))
    with pytest.raises(InvalidIndicesError, match=match):
        sm.SparseTensor.from_buffers("csr", (2, 3), (pos, crd, vals))


def test_from_buffers_checks_index_dtype():
    with pytest.raises(DTypeError, match="pos1"):
        sm.SparseTensor.from_buffers("csr", (1, 2), (np.array([0, 1]), np.array([0], np.int32), np.ones(1)))


@pytest.mark.parametrize("values", [np.array(["a"]), np.array([object()]), np.array([1 + 2j]),
                                    np.array([True])])
def test_unsupported_value_dtypes(values):
    with pytest.raises(DTypeError):
        sm.SparseTensor.from_coo([[0], [0]], values, (1, 1), "csr")


def test_format_rank_and_shape_errors():
    with pytest.raises(FormatError):
        sm.SparseTensor.from_dense(np.ones((2, 2, 2)), "csr")
    with pytest.raises(FormatError, match="multiple"):
        sm.SparseTensor.from_dense(np.ones((3, 3)), "bsr2x2")
    with pytest.raises(ShapeError):
        sm.SparseTensor.from_dense(np.ones((2, 2, 2, 2)), coo(4))
    with pytest.raises(FormatError):
        sm.SparseTensor.from_scipy(np.ones((2, 2)))


def test_repr_and_properties():
    t = sm.SparseTensor.from_dense(np.eye(3), "csr")
    assert t.nnz == 3 and t.ndim == 2 and t.format == sm.CSR
    assert "csr" in repr(t) and "nnz=3" in repr(t)


def test_dense_levels_beyond_memory_are_refused_before_allocating():
    from sparse_mlir.errors import ShapeError

    with pytest.raises(ShapeError, match="dense levels"):
        sm.SparseTensor.from_coo([[0], [0]], [1.0], (2**40, 2), "dd")
