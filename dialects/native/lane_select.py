"""N:M Linear layers with the output features across vector lanes: ``Y[b,o] = X[b,i] * W[o,i]``, no transposes.

The CSR-style SpMM (``spmm``) computes ``W @ X^T`` one row of ``W`` at a
time: per nonzero a broadcast of the weight and one 64-byte load of a row
of ``X^T`` per FMA.  On a Sapphire-Rapids-class core that caps at about
1.15 loads a cycle from L1 (3.8 G FMAs/s measured, 6.6 G with operands in
registers), and the Linear layer pays two transposes around it: a 2:4 layer
ran at dense BLAS speed (384 -> 384, 4096 rows: 8.7 ms against 8.4).

Here lane ``l`` of a vector is output feature ``o0 + l``.  Within a window
of ``lanes`` inputs (whole groups of ``m``), every row of ``W`` has the
same number ``E`` of entries (``lanes / m * n``), so entry ``j`` of the 16
rows of a chunk is one vector of weights and one vector of in-window input
indices; a lane permute (``vpermps``, an LLVM intrinsic: no dialect has a
variable permute) picks each lane's input from the window of ``X``'s row,
already in a register, and one FMA adds it.  No load per FMA, no
transposes: ``X`` and ``Y`` are read and written along their rows.  A
register tile is ``ROW_TILE`` rows of ``X`` by ``CHUNKS_PER_TILE`` chunks
(16 accumulators, 8 windows, 4 weight vectors: 28 of 32 registers); the
permute and the FMA share the vector ports, so the bound is about one FMA a
cycle.  MiniLM's 384 -> 384 at 2:4, 4096 rows, one thread: 6.2-6.7 ms in
C, against 8.1-8.4 for torch's dense Linear.

``W``'s entries are repacked at each call into that layout
(``PackedWeight``: register-tile transposes; 0.03 ms for 384 x 384, 0.2-0.3
ms for 1536 x 384 at one thread, threaded) so the kernel keeps the sparse
assembler's signature.  That is about 1% of a 4096-row layer, but it was
most of a small batch's time (MiniLM 2:4 on one 10-token sentence: 14.5 ms
against 9 for dense torch), so batches under ``row_select.SMALL_BATCH``
rows read ``W`` as stored instead (``row_select``, when ``m = 2 n``: 9.4-9.8
ms), and a batch of one block (up to 256 rows of 384 inputs) is multiplied
chunk by chunk, each worker packing the chunks it claims just before using
them (``linear_by_chunks``): one parallel region, the packed chunks in L1
or L2.  1536 x 384 at 2:4, one thread, 32 rows: 0.366 -> 0.259 ms, 64 rows
0.579 -> 0.441, 128 rows 0.927 -> 0.813 (dense torch: 0.31, 0.53, 0.92).
AVX-512 only (the 16-lane ``vpermps`` and its 64-bit and integer
siblings); narrower hosts keep the transposing kernel.  Built with the
MLIR bindings' op builders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mlir import ir
from mlir.dialects import arith, func, llvm, memref, scf, vector
from sparse_mlir.dialects.epilogue import SCALAR_EPILOGUE, VECTOR_EPILOGUE, Epilogue, epilogue_functions
from sparse_mlir.dialects.native.loops import (
    LINE_BYTES,
    RegisterTranspose,
    add,
    branch,
    by_workers,
    constant_like,
    declare_thread_count,
    dynamic_vector,
    for_each,
    index,
    is_float,
    parallel,
    reduce_loop,
    thread_count,
)
from sparse_mlir.dialects.native.target import CpuTarget
from sparse_mlir.formats import Format

__all__ = ["BLOCK_ROWS", "CHUNKS_PER_ITEM", "ROW_TILE", "Finish", "LaneProduct", "PackedWeight", "applies",
           "balanced_blocks", "kernel_module", "lane_types", "linear_by_chunks", "linear_items", "linear_repacked",
           "rows_per_block", "widened"]

ROW_TILE = 8  # rows of X per register tile: 8 windows of X and 16 accumulators with two chunks
CHUNKS_PER_TILE = 2  # chunks of output features per register tile: each window of X serves both
BLOCK_ROWS = 256  # rows of X a worker takes at a time, at most: their rows stay in L2 for every chunk of W
# ... and at most this much of X (MiniLM's 384 -> 1536 in float64, 4096 rows, took 73 ms in blocks of 256 rows)
BLOCK_BYTES = 1 << 20
WORD_BYTES = 4  # byte offsets transposed four to a 32-bit word (``PackedWeight._pack_chunk``)
CHUNKS_PER_ITEM = 2  # chunks of a block a Linear layer's worker claims at once (128 features of float32)
MIN_BLOCK_ROWS = 4 * ROW_TILE  # rows a fused MLP block keeps, however many threads (``balanced_blocks``)
_PERMUTES = {("f", 32): "llvm.x86.avx512.permvar.sf.512", ("f", 64): "llvm.x86.avx512.permvar.df.512",
             ("i", 32): "llvm.x86.avx512.permvar.si.512", ("i", 64): "llvm.x86.avx512.permvar.di.512"}


def applies(fmt: Format, dtype: np.dtype, target: CpuTarget) -> bool:
    """Whether an N:M weight of ``dtype`` runs here: AVX-512 (``vector_bits`` 512 is chosen only with it) and a
    window of ``lanes`` columns holding whole groups.

    Not on 256-bit targets: AVX2's ``vpermps`` exists, but there loads are
    cheap (three 256-bit loads a cycle) and the transposing kernel wins.
    The lane kernel as AVX2 code on this Xeon, 4096 rows, one thread: 2:4
    384 -> 384 14.1-15.9 ms against 11.5-11.7, 384 -> 1536 65-67 against
    44-46.
    """
    dtype = np.dtype(dtype)
    if not fmt.is_nm or target.vector_bits != 512 or dtype.kind not in "fi" or dtype.itemsize not in (4, 8):
        return False
    return (target.vector_bits // 8 // dtype.itemsize) % fmt.levels[-1].m == 0


def lane_types(element: ir.Type, lanes: int) -> tuple[ir.VectorType, ir.VectorType, str]:
    """The vector of ``lanes`` elements, the vector of in-window indices of the same width, the permute."""
    width = element.width
    kind = "f" if is_float(element) else "i"
    return (ir.VectorType.get([lanes], element), ir.VectorType.get([lanes], ir.IntegerType.get_signless(width)),
            _PERMUTES[kind, width])


class PackedWeight:
    """``W`` (``rows x cols``, N:M level buffers) repacked: per chunk of ``lanes`` rows, per window of ``lanes``
    columns, per entry ``j < E``, a vector of values and a vector of in-window column indices (``values``,
    ``indices``: ``chunk, window, j`` major, ``lanes`` minor), chunk ``c`` at ``c - base``.

    Either the whole weight, packed at the insertion point by every thread
    (``held=None``, ``base`` 0), or room for ``held`` chunks that ``pack``
    fills with a range of them: a worker's own scratch, packed where it is
    used.  Rows past ``rows`` get zeros; entries past a row's last (a partial
    last window) get zeros at index ``lanes - 1``, a lane the masked load of
    that window leaves zero, so no padding multiplies a value of ``X``.
    """

    def __init__(self, fmt: Format, crd: ir.Value, values: ir.Value, rows: ir.Value, cols: ir.Value,
                 element: ir.Type, lanes: int, held: int | None = None):
        nm = fmt.levels[-1]
        self.lanes, self.n, self.m = lanes, nm.n, nm.m
        self.entries = lanes // nm.m * nm.n  # E: entries of a row in one window
        self.vector, self.index_vector, self.permute = lane_types(element, lanes)
        self.rows, self.cols, self.element = rows, cols, element
        self.full_windows = arith.divui(cols, index(lanes))
        self.windows = arith.ceildivui(cols, index(lanes))
        self.chunks = arith.ceildivui(rows, index(lanes))
        self.chunk_size = arith.muli(self.windows, index(self.entries * lanes))  # elements of one chunk
        self.base = index(0)  # the first chunk held
        size = arith.muli(self.chunks if held is None else index(held), self.chunk_size)
        self.values = memref.alloc(dynamic_vector(element), [size], [], alignment=LINE_BYTES)
        self.indices = memref.alloc(dynamic_vector(self.index_vector.element_type), [size], [], alignment=LINE_BYTES)
        self._source = (crd, values)
        self._offsets = memref.alloc(dynamic_vector(ir.MemRefType(crd.type).element_type), [size], [])
        # byte offsets four at a time (``_pack_chunk``): a chunk's words hold as many bytes as ``_offsets``
        by_words = ir.MemRefType(crd.type).element_type.width == 8 and self.entries % WORD_BYTES == 0
        self._words = (memref.alloc(dynamic_vector(ir.IntegerType.get_signless(32)),
                                    [arith.divui(size, index(WORD_BYTES))], [], alignment=LINE_BYTES)
                       if by_words else None)
        if held is None:
            parallel(self.chunks, self._pack_chunk)

    def pack(self, first: ir.Value, last: ir.Value) -> None:
        """Chunks ``[first, last)`` (at most ``held``) into the scratch, serially; ``base`` becomes ``first``."""
        self.base = first
        for_each(first, last, self._pack_chunk)

    def _pack_chunk(self, c: ir.Value) -> None:
        """Chunk ``c``'s rows of values and of coordinates, seen as ``rows x per_row`` matrices, transposed in
        register tiles (``loops.RegisterTranspose``) into ``entries x lanes``: entry ``e`` of a row is at
        ``chunk_start + e * lanes + lane``, as a row's entries in order are its windows' ``j`` in order.  The
        masked edge tiles write zeros for rows past the last and entries past a row's last; a vector pass then
        turns coordinates (bytes, in-group) into in-window indices, and padding into ``lanes - 1``.  Element by
        element, repacking a 1536 x 384 weight took 0.4 ms at one thread.

        Byte offsets are transposed four to a 32-bit word where a row's entries fill whole words: a tile of
        bytes takes as many shuffles as a tile of words, and the byte transpose was 40 of the 92 us a 1536 x
        384 2:4 weight took to pack (one thread, warm)."""
        lanes, idx_type = self.lanes, self.index_vector.element_type
        crd, values = self._source
        per_row = arith.muli(arith.divui(self.cols, index(self.m)), index(self.n))
        padded = arith.muli(self.windows, index(self.entries))
        crd_type = ir.MemRefType(crd.type).element_type
        dynamic = ir.ShapedType.get_dynamic_size()

        def matrix(buffer: ir.Value, height: ir.Value, width: ir.Value, offset: ir.Value | None = None) -> ir.Value:
            """``buffer`` (1-D) from ``offset`` seen as a row-major ``height x width`` matrix."""
            element_type = ir.MemRefType(buffer.type).element_type
            strided = ir.MemRefType.get([dynamic, dynamic], element_type,
                                        ir.Attribute.parse("strided<[?, 1], offset: ?>"))
            return memref.reinterpret_cast(strided, buffer, [offset if offset is not None else index(0)],
                                           [height, width], [width], [dynamic], [dynamic, dynamic], [dynamic, 1])

        # the chunk's own rows only: an edge tile past its last entry writes zeros, which must not land on the
        # next chunk's entries (another thread's)
        first, start = arith.muli(c, index(lanes)), arith.muli(arith.subi(c, self.base), self.chunk_size)
        RegisterTranspose(self.element, lanes).transpose(
            matrix(values, self.rows, per_row), matrix(self.values, padded, index(lanes), start), index(lanes), padded,
            parallel=False, src_row=first)

        def finish(e: ir.Value, offsets: ir.Value) -> None:
            """Entry ``e``'s in-group ``offsets`` (a vector of lanes) as in-window indices, padding as
            ``lanes - 1``, stored."""
            wide = ir.VectorType.get([lanes], idx_type)
            group_start = arith.remui(arith.muli(arith.divui(e, index(self.n)), index(self.m)), index(lanes))
            column = arith.addi(widened(offsets, wide), vector.broadcast(wide, arith.index_cast(idx_type,
                                                                                                group_start)))
            stored = arith.cmpi(arith.CmpIPredicate.ult, e, per_row)
            vector.store(arith.select(stored, column, constant_like(wide, lanes - 1)), self.indices,
                         [arith.addi(start, arith.muli(e, index(lanes)))])

        def by_bytes() -> None:
            target = matrix(self._offsets, padded, index(lanes), start)
            RegisterTranspose(crd_type, lanes).transpose(matrix(crd, self.rows, per_row), target, index(lanes),
                                                         padded, parallel=False, src_row=first)
            narrow = ir.VectorType.get([lanes], crd_type)
            for_each(index(0), padded, lambda e: finish(e, vector.load(narrow, target, [e, index(0)])))

        if self._words is None:
            by_bytes()
            return

        def by_words() -> None:
            """Byte offsets four to a 32-bit word: a quarter of the tiles to transpose (a byte tile takes as many
            shuffles as a word tile), the bytes taken apart again in the index pass."""
            word = ir.IntegerType.get_signless(32)
            words = memref.view(dynamic_vector(word), crd, index(0),
                                [arith.divui(memref.dim(crd, index(0)), index(WORD_BYTES))])
            word_start = arith.divui(start, index(WORD_BYTES))
            per_word_row, padded_words = (arith.divui(v, index(WORD_BYTES)) for v in (per_row, padded))
            target = matrix(self._words, padded_words, index(lanes), word_start)
            RegisterTranspose(word, lanes).transpose(matrix(words, self.rows, per_word_row), target, index(lanes),
                                                     padded_words, parallel=False, src_row=first)
            vector_type = ir.VectorType.get([lanes], word)
            low_byte = constant_like(vector_type, 0xFF)

            def split(w: ir.Value) -> None:
                packed = vector.load(vector_type, target, [w, index(0)])
                for q in range(WORD_BYTES):  # little-endian: entry 4w + q is byte q of the word
                    byte = packed if q == 0 else arith.shrui(packed, constant_like(vector_type, 8 * q))
                    finish(arith.addi(arith.muli(w, index(WORD_BYTES)), index(q)), arith.andi(byte, low_byte))

            for_each(index(0), padded_words, split)

        # whole words a row, and the offsets' buffer on a word boundary: the words' loads claim their alignment
        unaligned = arith.ori(arith.remui(per_row, index(WORD_BYTES)),
                              arith.remui(memref.extract_aligned_pointer_as_index(crd), index(WORD_BYTES)))
        branch(arith.cmpi(arith.CmpIPredicate.eq, unaligned, index(0)), by_words, by_bytes)

    def free(self) -> None:
        memref.dealloc(self.values)
        memref.dealloc(self.indices)
        memref.dealloc(self._offsets)
        if self._words is not None:
            memref.dealloc(self._words)


def widened(offsets: ir.Value, wide: ir.VectorType) -> ir.Value:
    """In-group offsets (unsigned, of the coordinates' width) as lanes of ``wide``'s integer width."""
    have, want = ir.VectorType(offsets.type).element_type.width, wide.element_type.width
    if have == want:
        return offsets
    return arith.extui(wide, offsets) if have < want else arith.trunci(wide, offsets)


@dataclass(frozen=True)
class Finish:
    """What happens to a finished accumulator vector: a bias (over the output features ``"o"`` or the batch
    ``"b"``) it starts from, or an elementwise epilogue (``kernel_module``'s functions, reading
    ``operands``), then a residual ``residual[b, o]`` added before the store."""

    bias: ir.Value | None = None
    bias_over: str = "o"
    epilogue: bool = False
    operands: Sequence[ir.Value] = ()
    residual: ir.Value | None = None


class LaneProduct:
    """``y[y_row + r, o] = finish(x[x_row + r, :] . W[o, :])`` for rows ``r < count`` and the chunks of
    features ``[chunk_lo, chunk_hi)``, in register tiles (``product``)."""

    def __init__(self, weight: PackedWeight, element: ir.Type, finish: Finish):
        self.w, self.element, self.finish = weight, element, finish
        self.lanes = weight.lanes
        self.zero = constant_like(weight.vector, 0)
        # the last window of inputs, when partial: read masked, by a copy of the tile's window step (one masked
        # step for every window was 8-15% slower)
        tail = arith.remui(weight.cols, index(self.lanes))
        self.has_tail = arith.cmpi(arith.CmpIPredicate.ne, tail, index(0))
        self.mask_type = ir.VectorType.get([self.lanes], ir.IntegerType.get_signless(1))
        self.tail_mask = vector.create_mask(self.mask_type, [tail])

    def product(self, x: ir.Value, x_row: ir.Value, y: ir.Value, y_row: ir.Value, count: ir.Value,
                chunk_lo: ir.Value, chunk_hi: ir.Value) -> None:
        """Pairs of chunks over tiles of ``ROW_TILE`` rows, then single rows; an odd last chunk alone."""
        pairs_end = arith.subi(chunk_hi, arith.remui(arith.subi(chunk_hi, chunk_lo), index(CHUNKS_PER_TILE)))
        tiles_end = arith.subi(count, arith.remui(count, index(ROW_TILE)))

        def over_rows(chunk: ir.Value, chunks: int) -> None:
            for_each(index(0), tiles_end,
                     lambda r: self._tile(x, x_row, y, y_row, r, ROW_TILE, chunk, chunks), index(ROW_TILE))
            for_each(tiles_end, count, lambda r: self._tile(x, x_row, y, y_row, r, 1, chunk, chunks))

        for_each(chunk_lo, pairs_end, lambda c: over_rows(c, CHUNKS_PER_TILE), index(CHUNKS_PER_TILE))
        for_each(pairs_end, chunk_hi, lambda c: over_rows(c, 1))

    def _tile(self, x: ir.Value, x_row: ir.Value, y: ir.Value, y_row: ir.Value, r0: ir.Value, rows: int,
              chunk0: ir.Value, chunks: int) -> None:
        w, lanes = self.w, self.lanes
        chunk_of = [arith.addi(chunk0, index(c)) for c in range(chunks)]
        features = [arith.muli(c, index(lanes)) for c in chunk_of]
        x_rows = [arith.addi(x_row, arith.addi(r0, index(t))) for t in range(rows)]
        y_rows = [arith.addi(y_row, arith.addi(r0, index(t))) for t in range(rows)]
        starts = [self._start(features[c], y_rows[t]) for c in range(chunks) for t in range(rows)]

        def window(wi: ir.Value, accs: list[ir.Value], masked: bool) -> list[ir.Value]:
            column = arith.muli(wi, index(lanes))
            if masked:
                xs = [vector.maskedload(w.vector, x, [xr, column], self.tail_mask, self.zero) for xr in x_rows]
            else:
                xs = [vector.load(w.vector, x, [xr, column]) for xr in x_rows]
            accs = list(accs)
            for j in range(w.entries):
                for c in range(chunks):
                    at = arith.addi(arith.muli(arith.subi(chunk_of[c], w.base), w.chunk_size),
                                    arith.muli(arith.addi(arith.muli(wi, index(w.entries)), index(j)), index(lanes)))
                    weights = vector.load(w.vector, w.values, [at])
                    picks = vector.load(w.index_vector, w.indices, [at])
                    for t in range(rows):
                        chosen = llvm.call_intrinsic(w.vector, w.permute, [xs[t], picks], [], [])
                        k = c * rows + t
                        accs[k] = (vector.fma(weights, chosen, accs[k]) if is_float(self.element)
                                   else arith.addi(arith.muli(weights, chosen), accs[k]))
            return accs

        sums = reduce_loop(index(0), w.full_windows, starts, lambda wi, accs: window(wi, accs, False))
        last = scf.IfOp(self.has_tail, [s.type for s in sums], has_else=True)
        with ir.InsertionPoint(last.then_block):
            scf.YieldOp(window(w.full_windows, sums, True))
        with ir.InsertionPoint(last.else_block):
            scf.YieldOp(sums)
        for c in range(chunks):
            for t in range(rows):
                self._store(last.results[c * rows + t], y, y_rows[t], features[c])

    def _start(self, feature: ir.Value, row: ir.Value) -> ir.Value:
        """An accumulator's first value: the bias (over features: a masked load, the last chunk may be partial;
        over the batch: broadcast) or zero."""
        bias = self.finish.bias
        if bias is None:
            return self.zero
        if self.finish.bias_over == "b":
            return vector.broadcast(self.w.vector, memref.load(bias, [row]))
        return vector.maskedload(self.w.vector, bias, [feature], self._feature_mask(feature), self.zero)

    def _feature_mask(self, feature: ir.Value) -> ir.Value:
        left = arith.minui(arith.subi(self.w.rows, feature), index(self.lanes))
        return vector.create_mask(self.mask_type, [left])

    def _store(self, sums: ir.Value, y: ir.Value, row: ir.Value, feature: ir.Value) -> None:
        """The epilogue and residual, then the store: whole vectors, or lane by lane in a partial last chunk
        (the epilogue's vector function reads its operands unmasked)."""
        whole = arith.cmpi(arith.CmpIPredicate.ule, arith.addi(feature, index(self.lanes)), self.w.rows)
        branch = scf.IfOp(whole, [], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            value = sums
            if self.finish.epilogue:
                value = func.call([self.w.vector], ir.FlatSymbolRefAttr.get(VECTOR_EPILOGUE),
                                  [value, row, feature, *self.finish.operands])
            if self.finish.residual is not None:
                value = add(value, vector.load(self.w.vector, self.finish.residual, [row, feature]))
            vector.store(value, y, [row, feature])
            scf.YieldOp([])
        with ir.InsertionPoint(branch.else_block):
            def lane(lane_: ir.Value) -> None:
                feature_l = arith.addi(feature, lane_)
                value = vector.extract(sums, [lane_], [ir.ShapedType.get_dynamic_size()])
                if self.finish.epilogue:
                    value = func.call([self.element], ir.FlatSymbolRefAttr.get(SCALAR_EPILOGUE),
                                      [value, row, feature_l, *self.finish.operands])
                if self.finish.residual is not None:
                    value = add(value, memref.load(self.finish.residual, [row, feature_l]))
                memref.store(value, y, [row, feature_l])

            for_each(index(0), arith.subi(self.w.rows, feature), lane)
            scf.YieldOp([])


def kernel_module(epilogue: Epilogue | None, element: ir.Type, lanes: int) -> ir.Module:
    """The module a lane kernel is built into: the epilogue's vector and scalar functions (its operands vectors,
    lanes along ``epilogue.j``, the output features) when there is one, and the thread count's declaration."""
    module = ir.Module.create(ir.Location.unknown())
    with ir.Location.unknown(), ir.InsertionPoint(module.body):
        declare_thread_count()
        if epilogue is not None:
            epilogue_functions(epilogue.expr, epilogue.temp, epilogue.i, epilogue.j,
                               {name: 1 for name in epilogue.operands}, element, lanes)
    return module


def linear_items(product: LaneProduct, x: ir.Value, y: ir.Value, batch: ir.Value) -> None:
    """``y = product(x)`` over items of (a block of ``BLOCK_ROWS`` rows, ``CHUNKS_PER_ITEM`` chunks), block
    by block, claimed one at a time by one worker per thread (``loops.by_workers``): a small batch still
    splits its features between the threads, and a thread whose core is busy takes fewer items."""
    groups = arith.ceildivui(product.w.chunks, index(CHUNKS_PER_ITEM))
    block_rows = rows_per_block(product.w.cols, product.element)
    blocks = arith.ceildivui(batch, block_rows)

    def item(at: ir.Value, _state: object) -> None:
        row = arith.muli(arith.divui(at, groups), block_rows)
        count = arith.minui(block_rows, arith.subi(batch, row))
        chunk = arith.muli(arith.remui(at, groups), index(CHUNKS_PER_ITEM))
        product.product(x, row, y, row, count, chunk, arith.minui(arith.addi(chunk, index(CHUNKS_PER_ITEM)),
                                                                  product.w.chunks))

    by_workers(arith.muli(blocks, groups), item)


def linear_repacked(fmt: Format, crd: ir.Value, values: ir.Value, rows: ir.Value, element: ir.Type, lanes: int,
                    finish: Finish, x: ir.Value, y: ir.Value, batch: ir.Value) -> None:
    """``y = finish(x W^T)`` for the ``rows x cols`` N:M ``W`` (``crd``, ``values``; ``cols``: ``x``'s), repacked:
    what the Linear kernel runs past a small batch.  A batch of one block (``rows_per_block``) goes by chunks
    (``linear_by_chunks``); larger ones pack the whole weight first, as ``linear_items`` reads each chunk once
    per block."""
    cols = memref.dim(x, index(1))

    def whole() -> None:
        weight = PackedWeight(fmt, crd, values, rows, cols, element, lanes)
        linear_items(LaneProduct(weight, element, finish), x, y, batch)
        weight.free()

    branch(arith.cmpi(arith.CmpIPredicate.ule, batch, rows_per_block(cols, element)),
           lambda: linear_by_chunks(fmt, crd, values, rows, element, lanes, finish, x, y, batch), whole)


def linear_by_chunks(fmt: Format, crd: ir.Value, values: ir.Value, rows: ir.Value, element: ir.Type, lanes: int,
                     finish: Finish, x: ir.Value, y: ir.Value, batch: ir.Value) -> None:
    """``y = finish(x W^T)`` by items of ``CHUNKS_PER_ITEM`` chunks of features over every row of the batch, each
    worker packing the chunks it claims into its own scratch just before using them (``PackedWeight.pack``).

    For a batch whose rows of ``X`` stay in L2 while every item reads them
    (one block): packing and multiplying are one parallel region instead of
    two (one wake-up of the workers less), and the packed chunks are read
    from L1 or L2, where the whole packed weight (2.4 MB for 1536 x 384)
    outgrows L2.
    """
    cols = memref.dim(x, index(1))
    chunks = arith.ceildivui(rows, index(lanes))

    def item(group: ir.Value, weight: PackedWeight) -> None:
        first = arith.muli(group, index(CHUNKS_PER_ITEM))
        last = arith.minui(arith.addi(first, index(CHUNKS_PER_ITEM)), chunks)
        weight.pack(first, last)
        LaneProduct(weight, element, finish).product(x, index(0), y, index(0), batch, first, last)

    by_workers(arith.ceildivui(chunks, index(CHUNKS_PER_ITEM)), item,
               lambda: PackedWeight(fmt, crd, values, rows, cols, element, lanes, held=CHUNKS_PER_ITEM),
               PackedWeight.free)


def balanced_blocks(batch: ir.Value, most: ir.Value) -> ir.Value:
    """Rows per block for ``batch`` rows in blocks of at most ``most`` (a multiple of ``ROW_TILE``), cut so that
    every thread gets as many blocks of about as many rows: the fewest blocks of at most ``most``, rounded up to a
    multiple of the threads, with their rows evened out (to whole register tiles).

    Why: the fused MLP's workers claim whole blocks, and 192 rows of MiniLM
    (blocks of 168) made one block of 168 rows and one of 24, so at two threads
    one worker did seven eighths of the work.  Blocks keep at least
    ``MIN_BLOCK_ROWS`` rows (or ``most``): each block streams both packed
    weights, so on a host with many threads blocks of one register tile would
    read them far more often than they compute (a model, not measured here:
    this host has two cores).
    """
    threads = arith.maxui(thread_count(), index(1))
    blocks = arith.muli(arith.ceildivui(arith.ceildivui(batch, most), threads), threads)
    rows = arith.ceildivui(arith.maxui(batch, index(1)), arith.maxui(blocks, index(1)))
    rows = arith.maxui(rows, arith.minui(most, index(MIN_BLOCK_ROWS)))
    return arith.muli(arith.ceildivui(rows, index(ROW_TILE)), index(ROW_TILE))


def rows_per_block(cols: ir.Value, element: ir.Type) -> ir.Value:
    """Rows of X per block: ``BLOCK_ROWS``, fewer when they would hold more than ``BLOCK_BYTES`` (a whole number
    of register tiles, at least one)."""
    row_bytes = arith.maxui(arith.muli(cols, index(element.width // 8)), index(1))
    fit = arith.divui(index(BLOCK_BYTES), row_bytes)
    tiles = arith.maxui(arith.divui(arith.minui(fit, index(BLOCK_ROWS)), index(ROW_TILE)), index(1))
    return arith.muli(tiles, index(ROW_TILE))
