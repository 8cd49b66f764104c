"""N:M Linear and MLP kernels with output features across AVX-512 lanes (``dialects/native/lane_select.py``), run:
every N:M pattern a window holds, dtypes, partial chunks of features, partial windows of inputs, biases,
epilogues, residuals, blocks of the batch; which targets and formats take them.  Batches under
``row_select.SMALL_BATCH`` (24) rows read ``W`` as stored (``dialects/native/row_select.py``) when ``m = 2 n``, a batch
of one block packs ``W`` chunk by chunk in its workers, larger ones pack it whole first: the
cases run on every side of those lines."""

from __future__ import annotations

import numpy as np
import pytest
from support.data import prune_nm, random_values
from support.kernels import LANE_PERMUTE, host_has_lane_kernels

import sparse_mlir as sm
from sparse_mlir.runtime.threads import fixed

pytestmark = pytest.mark.skipif(not host_has_lane_kernels(), reason="the lane kernels need AVX-512")

# (batch, inputs, outputs); the first five read W as stored (spans of 32 float32 inputs: none whole and 16 left,
# 20 left, one and 4 left, two whole, one and 20 left; batch rows in groups of 4, 2 and 1), the others repack it:
# one block of rows (each worker packing the chunks it claims: 72 outputs are 5 chunks, items of 2, 2 and 1; 31
# rows are tiles of 8 and single rows), then several blocks (the whole weight packed first)
SHAPES = [(1, 16, 16), (7, 20, 17), (9, 36, 40), (15, 64, 48), (23, 52, 40), (31, 52, 40), (100, 52, 72),
          (300, 64, 33), (700, 48, 96)]


def _weight(rng: np.random.Generator, outputs: int, inputs: int, n: int, m: int, dtype: str) -> np.ndarray:
    return prune_nm(random_values(rng, (outputs, inputs), dtype), n, m)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [None, "o", "b"])
def test_a_2_4_linear_layer_matches_numpy(rng, dtype, shape, bias):
    """Exact: the values are small integers, so every summation order gives the same floats."""
    batch, inputs, outputs = shape
    inputs += -inputs % 4
    w = _weight(rng, outputs, inputs, 2, 4, dtype)
    x = random_values(rng, (batch, inputs), dtype)
    expression = "Y[b,o] = X[b,i] * W[o,i]" + ("" if bias is None else f" + bias[{bias}]")
    operands = {"X": x, "W": sm.SparseTensor.from_dense(w, "2:4")}
    want = x @ w.T
    if bias is not None:
        operands["bias"] = random_values(rng, outputs if bias == "o" else batch, dtype)
        want = want + (operands["bias"] if bias == "o" else operands["bias"][:, None])
    kernel = sm.compile(expression, formats={"W": "2:4"}, dtype=dtype)
    out = np.full((batch, outputs), -7, dtype)  # every element is stored
    kernel(out=out, **operands)
    np.testing.assert_array_equal(out, want)
    assert LANE_PERMUTE in kernel.ir["input"] and "call @linear_spmm" not in kernel.ir["input"]


@pytest.mark.parametrize("n, m", [(1, 2), (1, 4), (2, 8), (4, 8), (3, 16), (8, 16)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("batch", [45, 3])
def test_every_n_m_pattern_whose_groups_fit_a_window(rng, n, m, dtype, batch):
    """Windows are 16 float32 or 8 float64 inputs: 1:2 to 8:16 in float32; in float64 groups of 16 do not fit,
    so those weights keep the transposing kernel, with the same results."""
    inputs, outputs = 3 * m + (16 if m < 16 else 0), 21
    w = _weight(rng, outputs, inputs, n, m, dtype)
    x = random_values(rng, (batch, inputs), dtype)
    fmt = f"{n}:{m}"
    kernel = sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={"W": fmt}, dtype=dtype)
    np.testing.assert_array_equal(kernel(X=x, W=sm.SparseTensor.from_dense(w, fmt)), x @ w.T)
    lanes = 64 // np.dtype(dtype).itemsize
    assert (LANE_PERMUTE in kernel.ir["input"]) == (lanes % m == 0)


@pytest.mark.parametrize("batch", [300, 40, 10])
def test_a_partial_last_window_reads_nothing_past_its_row(rng, batch):
    """36 inputs: two windows of 16 and a masked one of 4 (as stored: a span of 32 and a masked one of 4).  Odd
    rows of X start with infinities; were the last window of an even row read whole, its padding (a zero weight)
    would pick up the next row's infinity."""
    inputs, outputs = 36, 24
    w = _weight(rng, outputs, inputs, 2, 4, "float32")
    x = random_values(rng, (batch, inputs), "float32")
    x[1::2, :12] = np.inf
    kernel = sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={"W": "2:4"}, dtype="float32")
    got = kernel(X=x, W=sm.SparseTensor.from_dense(w, "2:4"))
    np.testing.assert_array_equal(got[0::2], x[0::2] @ w.T)


@pytest.mark.parametrize("batch", [300, 40, 10])
def test_padding_entries_pick_no_input_of_the_last_window(rng, batch):
    """36 inputs: the last window holds one group, so most of its entries are padding (zero weights).  Column 32,
    the group's first, is infinite and no row of ``W`` uses it: padding that picked it would make NaNs."""
    inputs, outputs = 36, 40
    w = random_values(rng, (outputs, inputs), "float32")
    w[:, 32] = w[:, 35] = 0  # the group's entries are its columns 33 and 34 in every row
    w[:, 33:35][w[:, 33:35] == 0] = 1
    w = prune_nm(w, 2, 4)
    x = random_values(rng, (batch, inputs), "float32")
    finite = x.copy()
    x[:, 32] = np.inf
    got = sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={"W": "2:4"}, dtype="float32")(
        X=x, W=sm.SparseTensor.from_dense(w, "2:4"))
    np.testing.assert_array_equal(got, finite @ w.T)


@pytest.mark.parametrize("fmt", ["2:4", "1:4"])
@pytest.mark.parametrize("batch", [77, 6])
def test_an_epilogue_over_features_and_batch_and_a_residual(rng, fmt, batch):
    """``max(X W^T, s[b]) * 2 - bias[o] + R[b,o]``: the epilogue's vector function in whole chunks, its scalar one
    lane by lane in the partial last chunk (40 features: 16, 16, 8), then the residual."""
    inputs, outputs = 52, 40
    n, m = map(int, fmt.split(":"))
    w = _weight(rng, outputs, inputs, n, m, "float64")
    x = rng.standard_normal((batch, inputs))
    s, bias, r = rng.standard_normal(batch), rng.standard_normal(outputs), rng.standard_normal((batch, outputs))
    kernel = sm.compile("Y[b,o] = max(X[b,i] * W[o,i], s[b]) * 2.0 - bias[o] + R[b,o]", formats={"W": fmt},
                        dtype="float64")
    got = kernel(X=x, W=sm.SparseTensor.from_dense(w, fmt), s=s, bias=bias, R=r)
    np.testing.assert_allclose(got, np.maximum(x @ w.T, s[:, None]) * 2 - bias + r, rtol=1e-12, atol=1e-12)
    assert LANE_PERMUTE in kernel.ir["input"] and "sm_epilogue_scalar" in kernel.ir["input"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(1, 36, 40, 20), (11, 52, 200, 17), (130, 64, 96, 48), (600, 48, 200, 17)])
def test_a_2_4_feed_forward_block_with_a_residual(rng, dtype, shape):
    """Both layers in one kernel: read as stored (1, 11 rows), a batch of one block layer by layer (130 rows, each
    worker packing the chunks it claims), blocks of the batch in a worker's hidden scratch (600 rows: several),
    a partial last chunk of hidden features (40, 200) and of outputs (17), a partial last window (36 inputs)."""
    batch, inputs, hidden, outputs = shape
    w1, w2 = _weight(rng, hidden, inputs, 2, 4, dtype), _weight(rng, outputs, hidden, 2, 4, dtype)
    x, r = random_values(rng, (batch, inputs), dtype), random_values(rng, (batch, outputs), dtype)
    b1, b2 = random_values(rng, hidden, dtype), random_values(rng, outputs, dtype)
    kernel = sm.compile("Y[b,p] = W2[p,o] * relu(X[b,i] * W1[o,i] + b1[o]) + b2[p] + R[b,p]",
                        formats={"W1": "2:4", "W2": "2:4"}, dtype=dtype)
    got = kernel(X=x, W1=sm.SparseTensor.from_dense(w1, "2:4"), W2=sm.SparseTensor.from_dense(w2, "2:4"), b1=b1,
                 b2=b2, R=r)
    np.testing.assert_array_equal(got, np.maximum(x @ w1.T + b1, 0) @ w2.T + b2 + r)
    assert LANE_PERMUTE in kernel.ir["input"] and "call @mlp_first" not in kernel.ir["input"]


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
@pytest.mark.parametrize("batch", [260, 600, 1500])
def test_feed_forward_blocks_evened_out_between_threads(rng, threads, batch):
    """Blocks of the batch are cut to a multiple of the threads with their rows evened out (``balanced_blocks``):
    whatever the count, every row is computed once."""
    w1, w2 = _weight(rng, 200, 64, 2, 4, "float32"), _weight(rng, 40, 200, 2, 4, "float32")
    x, b1 = random_values(rng, (batch, 64), "float32"), random_values(rng, 200, "float32")
    kernel = sm.compile("Y[b,p] = W2[p,o] * relu(X[b,i] * W1[o,i] + b1[o])", formats={"W1": "2:4", "W2": "2:4"},
                        dtype="float32")
    out = np.full((batch, 40), np.nan, np.float32)
    with fixed(threads):
        kernel(X=x, W1=sm.SparseTensor.from_dense(w1, "2:4"), W2=sm.SparseTensor.from_dense(w2, "2:4"), b1=b1,
               out=out)
    np.testing.assert_array_equal(out, np.maximum(x @ w1.T + b1, 0) @ w2.T)


def test_the_operands_are_not_written(rng):
    w = _weight(rng, 24, 32, 2, 4, "float32")
    x, bias = rng.standard_normal((50, 32)).astype(np.float32), rng.standard_normal(24).astype(np.float32)
    weight = sm.SparseTensor.from_dense(w, "2:4")
    saved = [x.copy(), bias.copy(), *(np.array(b, copy=True) for b in weight.buffers)]
    sm.compile("Y[b,o] = X[b,i] * W[o,i] + bias[o]", formats={"W": "2:4"}, dtype="float32")(X=x, W=weight, bias=bias)
    for before, after in zip(saved, [x, bias, *weight.buffers]):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("inputs", [48, 80])  # 24 and 40 entries a row: register tiles of 16 run past a chunk's end
@pytest.mark.parametrize("batch", [300, 64])  # the whole weight packed at once; each worker packing its chunks
def test_threads_repacking_neighbouring_chunks_do_not_overwrite_each_other(rng, inputs, batch):
    """Two threads repack 101 chunks of features at once; a chunk's last (masked) tile of entries writes zeros
    past its last entry, which once landed on the next chunk's first entries when another thread had already
    repacked them (a race: wrong products for whole chunks, now and then).  Packed by the workers, the last item
    holds one chunk of two."""
    w = _weight(rng, 1610, inputs, 2, 4, "float32")
    x = random_values(rng, (batch, inputs), "float32")
    kernel = sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={"W": "2:4"}, dtype="float32")
    weight, want = sm.SparseTensor.from_dense(w, "2:4"), x @ w.T
    with fixed(2):
        for _ in range(20):
            np.testing.assert_array_equal(kernel(X=x, W=weight), want)


@pytest.mark.parametrize("batch, outputs, inputs", [(0, 16, 16), (3, 16, 0), (2, 0, 8), (5, 1, 4), (30, 16, 0),
                                                   (40, 0, 8), (50, 1, 4), (300, 16, 0)])
def test_empty_and_one_feature_shapes(batch, outputs, inputs):
    """No rows, no inputs (only the bias), no outputs, a single output feature: W read as stored, packed by the
    workers chunk by chunk (30-50 rows), packed whole (300 rows)."""
    w = np.zeros((outputs, inputs), np.float32)
    w[:, ::4] = 1
    x, bias = np.ones((batch, inputs), np.float32), np.arange(outputs, dtype=np.float32)
    kernel = sm.compile("Y[b,o] = X[b,i] * W[o,i] + bias[o]", formats={"W": "2:4"}, dtype="float32")
    got = kernel(X=x, W=sm.SparseTensor.from_dense(w, "2:4"), bias=bias)
    np.testing.assert_array_equal(got, x @ w.T + bias)
    assert got.shape == (batch, outputs)


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
@pytest.mark.parametrize("outputs", [1610, 40])  # 101 chunks of features (runs of 12 at 2 threads), 3 chunks
def test_a_small_batch_computes_every_chunk_once_whatever_the_threads(rng, threads, outputs):
    """Below ``SMALL_BATCH`` rows, workers claim contiguous runs of chunks (each chunk prefetches the next one's
    rows of ``W``): the runs must cover every chunk once, however the chunks divide among the threads, including
    fewer chunks than threads."""
    w = _weight(rng, outputs, 96, 2, 4, "float32")
    x = random_values(rng, (10, 96), "float32")
    kernel = sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={"W": "2:4"}, dtype="float32")
    out = np.full((10, outputs), np.nan, np.float32)
    with fixed(threads):
        kernel(X=x, W=sm.SparseTensor.from_dense(w, "2:4"), out=out)
    np.testing.assert_array_equal(out, x @ w.T)


def _offsets_at(crd: np.ndarray, shift: int) -> np.ndarray:
    """``crd`` in read-only memory (bytes) starting ``shift`` bytes past a word boundary: a tensor keeps such a
    buffer as it is (nothing can change it), where it copies (and so aligns) a writable one."""
    for _ in range(64):  # where a bytes object's data falls is up to the allocator: try starts until one fits
        for start in range(4):
            room = np.zeros(crd.size + 8, crd.dtype)
            room[start:start + crd.size] = crd
            view = np.frombuffer(room.tobytes(), crd.dtype)[start:start + crd.size]
            if view.ctypes.data % 4 == shift:
                return view
    raise AssertionError(f"no bytes object put the offsets {shift} bytes past a word")


@pytest.mark.parametrize("inputs", [64, 52])  # 32 entries a row (whole words of offsets), 26 (bytes)
@pytest.mark.parametrize("shift", [0, 1])  # the offsets' buffer on a word boundary, or one byte past it
def test_byte_offsets_are_packed_by_words_or_one_by_one_alike(rng, inputs, shift):
    """Repacking transposes a row's byte offsets four to a 32-bit word when they fill whole words and their buffer
    starts on a word boundary, else byte by byte: both give the same products (batches of one block and of
    several, so both packing paths)."""
    w = _weight(rng, 40, inputs, 2, 4, "float32")
    weight = sm.SparseTensor.from_dense(w, "2:4")
    crd, values = weight.buffers
    moved = sm.SparseTensor.from_buffers(weight.format, weight.shape, (_offsets_at(crd, shift), values))
    assert moved.buffers[0].ctypes.data % 4 == shift
    kernel = sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={"W": "2:4"}, dtype="float32")
    for batch in (40, 300):
        x = random_values(rng, (batch, inputs), "float32")
        np.testing.assert_array_equal(kernel(X=x, W=moved), x @ w.T)
