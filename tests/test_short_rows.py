"""The CSR SpMV on short and mixed rows (``dialects/native/spmv.py``) against scipy, and when small calls stay serial.

A row takes one of two paths by its length (the plain loop below
``SHORT_ROW`` entries; from there the unrolled, prefetching loop, or where
gathers pay, pairs of vectors of entries, one more vector and a scalar tail),
so every length from 0 to 100 (two pairs of 16 lanes, one more and 15 left)
is checked in one matrix, in order and shuffled, on this host's path and on
scalar loads, beside empty rows, a single row, no rows, no columns and
matrices of only empty rows, for every dtype and index width, serial and
threaded.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sparse_mlir.dialects.native.spmv import SHORT_ROW, UNROLL
from support.data import DTYPES

import sparse_mlir as sm
from sparse_mlir.formats import CSR
from sparse_mlir.runtime import threads
from sparse_mlir.runtime.threads import fixed

EXPRESSION = "y[i] = A[i,j] * x[j]"


def _kernel(dtype: str):
    return sm.compile(EXPRESSION, formats={"A": "csr"}, dtype=dtype)


def _rows_of_lengths(rng: np.random.Generator, lengths: list[int], cols: int, dtype: str) -> sp.csr_array:
    """A CSR matrix whose row ``r`` has ``lengths[r]`` entries in sorted random distinct columns."""
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = np.concatenate([np.sort(rng.choice(cols, n, replace=False)) for n in lengths] or [np.zeros(0)])
    values = (rng.integers(1, 9, size=int(indptr[-1])) * rng.choice([-1, 1], size=int(indptr[-1]))).astype(dtype)
    return sp.csr_array((values, indices.astype(np.int64), indptr), shape=(len(lengths), cols))


def _check(kernel, a: sp.csr_array, dtype: str, rng: np.random.Generator, fmt=None) -> None:
    x = rng.integers(-5, 6, size=a.shape[1]).astype(dtype)
    tensor = sm.SparseTensor.from_scipy(a, fmt) if fmt is not None else sm.SparseTensor.from_scipy(a)
    got = kernel(A=tensor, x=x)
    expected = a.astype(np.float64) @ x.astype(np.float64)
    assert got.dtype == np.dtype(dtype) and got.shape == (a.shape[0],)
    np.testing.assert_array_equal(got, expected.astype(dtype))  # small integers: exact in every dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads_used", [1, 2])
# this host's gathers where they pay; scalar loads (an x86-64 target only where that runs)
@pytest.mark.parametrize("cpu", ["native", "x86-64-v3"] if platform.machine().lower() in ("x86_64", "amd64")
                         else ["native"])
def test_every_row_length_from_0_to_100(dtype, threads_used, cpu, rng, monkeypatch):
    monkeypatch.setenv("SPARSE_MLIR_CPU", cpu)
    lengths = list(range(101)) * 2
    in_order = _rows_of_lengths(rng, lengths, 128, dtype)
    shuffled = _rows_of_lengths(rng, list(rng.permutation(lengths)), 128, dtype)
    kernel = _kernel(dtype)
    with fixed(threads_used):
        _check(kernel, in_order, dtype, rng)
        _check(kernel, shuffled, dtype, rng)


@pytest.mark.parametrize("lengths", [[0], [1], [SHORT_ROW - 1], [SHORT_ROW], [SHORT_ROW + UNROLL + 1], [0] * 9,
                                     [0, 0, 3, 0], [40], [2 * SHORT_ROW + 3] + [0] * 5, [16], [32], [47], [48]])
def test_single_rows_and_empty_rows(lengths, rng):
    _check(_kernel("float64"), _rows_of_lengths(rng, lengths, 48, "float64"), "float64", rng)


def test_no_rows_and_no_columns(rng):
    kernel = _kernel("float32")
    assert kernel(A=sp.csr_array((0, 5), dtype=np.float32), x=np.ones(5, np.float32)).shape == (0,)
    got = kernel(A=sp.csr_array((4, 0), dtype=np.float32), x=np.ones(0, np.float32))
    np.testing.assert_array_equal(got, np.zeros(4, np.float32))


@pytest.mark.parametrize("widths", [(32, 32), (64, 64), (64, 32), (32, 16), (16, 8)])
def test_index_widths(widths, rng):
    """Narrow coordinates are read unsigned: columns past the signed range of the width (16-bit: 40000) count."""
    cols = 40000 if widths[1] == 16 else (200 if widths[1] == 8 else 70000)
    lengths = list(range(20)) * 4
    a = _rows_of_lengths(rng, lengths, cols, "float64")
    if widths[0] == 16:
        a = a[:, :200]  # 16-bit positions: at most 65535 entries, 8-bit coordinates: 256 columns
        a = sp.csr_array(a)
    _check(_kernel("float64"), a, "float64", rng, CSR.with_widths(*widths))


def test_inf_and_nan_reach_only_their_rows(rng):
    a = _rows_of_lengths(rng, [3, 0, 2, 5, 1], 6, "float64")
    x = np.arange(6, dtype=np.float64)
    x[a.indices[0]] = np.inf
    got = _kernel("float64")(A=a, x=x)
    with np.errstate(invalid="ignore"):
        expected = a @ x
    np.testing.assert_array_equal(np.isinf(got) | np.isnan(got), np.isinf(expected) | np.isnan(expected))
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(got[finite], expected[finite])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 100), min_size=0, max_size=60), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(DTYPES))
def test_random_row_lengths_match_scipy(lengths, seed, dtype):
    rng = np.random.default_rng(seed)
    _check(_kernel(dtype), _rows_of_lengths(rng, lengths, 101, dtype), dtype, rng)


def test_small_calls_run_serially_large_ones_threaded(monkeypatch):
    """``for_work`` gives one thread below ``SERIAL_BELOW`` entries (no wake-up of the pool) and the configured
    count from there; an explicit ``fixed`` count always wins."""
    monkeypatch.setenv("SPARSE_MLIR_NUM_THREADS", "2")
    assert threads.for_work(threads.SERIAL_BELOW - 1) == 1
    assert threads.for_work(threads.COLD_SERIAL_BELOW) == 2
    with fixed(2):
        assert threads.for_work(10) == 2
    with fixed(1):
        assert threads.for_work(10 * threads.SERIAL_BELOW) == 1


def test_small_calls_stay_serial_while_the_pool_sleeps(monkeypatch):
    """Below ``COLD_SERIAL_BELOW`` entries a call forks only when the last call on this thread came within the
    blocktime (the workers still spin, or a burst of calls shares one wake-up); with ``KMP_BLOCKTIME=0`` never.
    Larger calls always fork."""
    monkeypatch.setenv("SPARSE_MLIR_NUM_THREADS", "2")
    small, large = threads.SERIAL_BELOW, threads.COLD_SERIAL_BELOW
    monkeypatch.setattr(threads._local, "last_call", None, raising=False)  # (a real clock's time, from a test before)
    clock = [1000.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv("KMP_BLOCKTIME", "0")
    assert [threads.for_work(small) for _ in range(3)] == [1, 1, 1]
    assert threads.for_work(large) == 2
    for text, seconds in (("10", 0.01), ("10ms", 0.01), ("300us", 3e-4), ("1s", 1.0)):
        monkeypatch.setenv("KMP_BLOCKTIME", text)
        clock[0] += 100.0
        assert threads.for_work(small) == 1  # an isolated call: the workers slept
        clock[0] += seconds / 2
        assert threads.for_work(small) == 2  # within the blocktime of the last one
        clock[0] += seconds * 1.5
        assert threads.for_work(small) == 1, text
    monkeypatch.setenv("KMP_BLOCKTIME", "infinite")
    clock[0] += 1e6
    assert threads.for_work(small) == 2
    monkeypatch.delenv("KMP_BLOCKTIME")
    clock[0] += 100.0
    with threads.blocktime(0):
        assert [threads.for_work(small) for _ in range(2)] == [1, 1]
    clock[0] += 100.0
    assert [threads.for_work(small) for _ in range(2)] == [1, 2]  # the default blocktime, BLOCKTIME_MS
