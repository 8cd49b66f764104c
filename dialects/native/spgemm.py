"""SpGEMM, ``C[i,j] = A[i,k] * B[k,j]`` with CSR ``A``, ``B`` and ``C`` (any index widths), emitted instead of
sparsified.

The sparsifier lowers this product to one scalar loop nest over rows that
inserts into ``C`` through its expanded access pattern, serially (it never
threads insertion into a sparse output).  Here it is Gustavson's algorithm,
row by row, in two passes over the rows, both threaded:

1. the work of each row (the entries of ``B`` it reads) and its prefix sum
   split the rows into contiguous *chunks* of about equal work
   (``MAX_CHUNKS`` at most, fewer when the work is small for the width);
2. symbolic pass: each row counts the columns it touches;
3. a prefix sum of the counts gives ``C``'s positions and its exact size;
4. numeric pass: the same chunks, with a dense accumulator over ``B``'s
   columns; a row's entries come out in column order, so ``C``'s columns
   are sorted and unique within each row (the SparseTensor invariant).

Both passes tell a column's first product in a row from the others by a
*stamp* per column of ``B`` (``ColumnStamps``: the row's tag ``i + 1``, so no
clearing between rows, and no read-modify-write chain through a bitmap
word), in one array per worker (a worker per thread, claiming chunks from
a shared counter).  When ``B`` has more than ``STAMP_COLUMNS`` columns, or
more columns than the product has work (the stamps would cost more to zero
than the rows to compute), each chunk instead takes a bitmap (one bit per
column) from its own parallel iteration, and the bitmap tells first
products apart.  Stamped: 1 thread, the benchmark's SuiteSparse squares,
hangGlider_2 10.4 -> 6.5 ms, bcsstk13 9.9 -> 7.6, rajat01 26 -> 20,
cryg2500 0.28 -> 0.23.

Each walk over a row's products prefetches the rows of ``B`` that ``A``'s
entries ``AHEAD`` positions on will read (a random row of ``B`` each).
A row with many columns for the width (``WIDE_ROW``) sets a bit per column
and is read back from the bitmap 64 columns at a time (``cttz``); any
other lists its columns as it first touches them and sorts the list
(``sparse_tensor.sort``).  Entries are structural: a sum that cancels to
zero stays stored (as in the sparsifier's kernel).  The function has the
sparse assembler's signature (level buffers in, ``C``'s level buffers out,
allocated with ``malloc`` so the C entry point hands them to the caller).
``None`` sizes (a shape-generic build) are read from the buffers: the rows
from ``A``'s positions, ``B``'s columns as its largest coordinate plus one.
Built with the MLIR bindings' op builders.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, math, memref, scf, vector
from mlir.dialects import sparse_tensor as st
from sparse_mlir.dialects.native.loops import (
    STAMP_COLUMNS,
    ColumnStamps,
    by_workers,
    csr_product_module,
    reduce_loop,
    result_buffer,
)
from sparse_mlir.dialects.native.loops import dynamic_vector as _vector
from sparse_mlir.dialects.native.loops import for_each as _for
from sparse_mlir.dialects.native.loops import if_else as _if
from sparse_mlir.dialects.native.loops import index as _index
from sparse_mlir.dialects.native.loops import load_index as _load_index
from sparse_mlir.dialects.native.loops import parallel as _parallel
from sparse_mlir.dialects.native.loops import store_index as _store_as

from sparse_mlir.dsl.patterns import spgemm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["BLOCK_WORDS", "MAX_CHUNKS", "PARALLEL_ESTIMATE", "SHORT_LIST", "STAMP_COLUMNS", "WIDE_ROW",
           "native_spgemm"]

MAX_CHUNKS = 64  # row chunks at most: guided scheduling balances them over up to 16 threads or so
PARALLEL_ESTIMATE = 1 << 18  # entries of A from which the work per row is estimated in parallel
WIDE_ROW = 1024  # a row with at least cols / WIDE_ROW columns is collected from a bitmap, not sorted
AHEAD = 4  # entries of A ahead whose rows of B are prefetched
SHORT_LIST = 32  # a sorted row this short is insertion-sorted inline; longer ones call sparse_tensor.sort
BLOCK_WORDS = 8  # bitmap words a wide row's read-back tests at once (512 bits: one AVX-512 compare)

Shapes = dict[str, tuple[int | None, ...]]


def native_spgemm(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes,
                  vector_bits: int = 256) -> ir.Module | None:
    """The SpGEMM module for ``spec`` in the current context, or ``None`` when it does not apply.

    ``vector_bits`` is unused (the kernel is scalar gathers and scatters); it keeps the table's signature.
    """
    found = spgemm_operands(spec, formats)
    if found is None:
        return None
    with ir.Location.unknown():
        return _module(spec, formats, shapes, *found)


def _module(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, a_name: str, b_name: str) -> ir.Module:
    def body(buffers: dict[str, list[ir.Value]], element: ir.Type, out_types: list[ir.Type]) -> list[ir.Value]:
        kernel = _Gustavson(*buffers[a_name], *buffers[b_name], element, out_types)
        return kernel.emit(shapes[spec.output][0], shapes[b_name][1])

    return csr_product_module(spec, formats, body, uses_thread_count=True)


def _reduce(lower: ir.Value, upper: ir.Value, init: ir.Value,
            body: Callable[[ir.Value, ir.Value], ir.Value]) -> ir.Value:
    """``scf.for`` carrying one value: ``body(index, value)`` returns the next value."""
    return reduce_loop(lower, upper, [init], lambda i, values: [body(i, values[0])])[0]


_I64 = 64  # bits per bitmap word


class _Scratch:
    """One chunk's column bitmap, column list and (numeric pass) accumulator over ``B``'s columns, allocated by
    the chunk inside its parallel iteration, so each thread reuses its own heap memory from chunk to chunk.

    Between rows the bitmap (one bit per column: it stays in L1 or L2) is
    clear: each row clears what it set while it writes its entries out (or
    counts them).  The accumulator and the column list need no setting up:
    a column's first product in a row overwrites its slot.
    """

    def __init__(self, n_cols: ir.Value, element: ir.Type | None) -> None:
        c0, c1 = _index(0), _index(1)
        self.n_cols = n_cols
        span = arith.maxui(n_cols, c1)
        self.words = arith.maxui(arith.divui(arith.addi(n_cols, _index(_I64 - 1)), _index(_I64)), c1)
        # whole blocks of BLOCK_WORDS words, the padding zero like the rest: ``drain`` reads a block at a time
        self.blocks = arith.divui(arith.addi(self.words, _index(BLOCK_WORDS - 1)), _index(BLOCK_WORDS))
        padded = arith.muli(self.blocks, _index(BLOCK_WORDS))
        self.i64 = ir.IntegerType.get_signless(_I64)
        self.zero = arith.constant(self.i64, 0)
        self.bits = memref.alloc(_vector(self.i64), [padded], [])
        _for(c0, padded, lambda w: memref.store(self.zero, self.bits, [w]))
        self.columns = memref.alloc(_vector(ir.IndexType.get()), [span], [])
        self.values = memref.alloc(_vector(element), [span], []) if element is not None else None

    def free(self) -> None:
        for buffer in (self.bits, self.columns, self.values):
            if buffer is not None:
                memref.dealloc(buffer)

    def _word_and_bit(self, j: ir.Value) -> tuple[ir.Value, ir.Value]:
        at = arith.shrui(j, _index(6))
        return at, arith.shli(arith.constant(self.i64, 1), arith.index_castui(self.i64, arith.andi(j, _index(63))))

    def mark(self, j: ir.Value, count: ir.Value) -> ir.Value:
        """Set column ``j``'s bit, branch-free; ``count`` (the walk's carried value) passes through."""
        at, bit = self._word_and_bit(j)
        memref.store(arith.ori(memref.load(self.bits, [at]), bit), self.bits, [at])
        return count

    def mark_first(self, j: ir.Value, count: ir.Value, first: Callable[[], None] = lambda: None,
                   again: Callable[[], None] = lambda: None, listed: bool = True,
                   new: ir.Value | None = None) -> ir.Value:
        """The first time column ``j`` comes in this row, ``first()`` and (``listed``) list ``j`` at ``count``
        and count it; else ``again()``.  Returns the count.

        ``new`` (an ``i1``, from ``ColumnStamps``) says whether it is the first time, and only an unlisted
        row's columns get their bits (to be read back); without it the bit says, and every column gets it.
        """
        if new is None:
            at, bit = self._word_and_bit(j)
            word = memref.load(self.bits, [at])
            clear = arith.cmpi(arith.CmpIPredicate.eq, arith.andi(word, bit), self.zero)

            def set_bit() -> None:
                memref.store(arith.ori(word, bit), self.bits, [at])
        else:
            clear = new

            def set_bit() -> None:
                if not listed:
                    self.mark(j, count)

        def fresh() -> list[ir.Value]:
            set_bit()
            first()
            if not listed:
                return [count]
            memref.store(j, self.columns, [count])
            return [arith.addi(count, _index(1))]

        def seen() -> list[ir.Value]:
            again()
            return [count]

        return _if(clear, fresh, seen, [ir.IndexType.get()])[0]

    def unset(self, j: ir.Value) -> None:
        at, bit = self._word_and_bit(j)
        keep = arith.xori(bit, arith.constant(self.i64, -1))
        memref.store(arith.andi(memref.load(self.bits, [at]), keep), self.bits, [at])

    def count_and_clear(self) -> ir.Value:
        """How many bits are set; clears them."""
        def word(w: ir.Value, total: ir.Value) -> ir.Value:
            value = memref.load(self.bits, [w])
            memref.store(self.zero, self.bits, [w])
            return arith.addi(total, arith.index_castui(ir.IndexType.get(), math.ctpop(value)))

        return _reduce(_index(0), self.words, _index(0), word)

    def drain(self, visit: Callable[[ir.Value, ir.Value], None]) -> None:
        """``visit(column, e)`` for every set bit in column order (``e`` counts from 0), clearing the bitmap.

        A block of ``BLOCK_WORDS`` words is tested at once (one vector
        compare gives a mask of its non-zero words); only those words are
        read, cleared and walked, ``cttz`` finding each bit.  A row of a few
        columns in a wide bitmap skips its empty words eight at a time (the
        word-by-word scan was a quarter of SuiteSparse cryg2500's product).
        """
        block_type = ir.VectorType.get([BLOCK_WORDS], self.i64)
        mask_type = ir.VectorType.get([1], ir.IntegerType.get_signless(BLOCK_WORDS))
        no_bits = arith.constant(block_type, ir.DenseElementsAttr.get_splat(block_type, ir.IntegerAttr.get(
            self.i64, 0)))

        def block(b: ir.Value, e: ir.Value) -> ir.Value:
            first = arith.muli(b, _index(BLOCK_WORDS))
            nonzero = arith.cmpi(arith.CmpIPredicate.ne, vector.load(block_type, self.bits, [first]), no_bits)
            mask = vector.extract(vector.bitcast(mask_type, nonzero), [], [0])

            def word(offset: ir.Value, k: ir.Value) -> ir.Value:
                w = arith.addi(first, offset)
                value = memref.load(self.bits, [w])
                memref.store(self.zero, self.bits, [w])
                base = arith.muli(w, _index(_I64))

                def bit(at: ir.Value, entry: ir.Value) -> ir.Value:
                    visit(arith.addi(base, at), entry)
                    return arith.addi(entry, _index(1))

                return _each_set_bit(value, k, bit)

            return _each_set_bit(mask, e, word)

        _reduce(_index(0), self.blocks, _index(0), block)


def _each_set_bit(value: ir.Value, carried: ir.Value, body: Callable[[ir.Value, ir.Value], ir.Value]) -> ir.Value:
    """``body(bit, carried)`` for each set bit of the integer ``value``, lowest first (``cttz``, then the bit
    cleared); ``body`` returns the next carried value, and the last one is returned."""
    loop = scf.ForOp(_index(0), arith.index_castui(ir.IndexType.get(), math.ctpop(value)), _index(1),
                     [value, carried])
    with ir.InsertionPoint(loop.body):
        rest, now = loop.inner_iter_args
        after = body(arith.index_castui(ir.IndexType.get(), math.cttz(rest)), now)
        scf.YieldOp([arith.andi(rest, arith.subi(rest, arith.constant(value.type, 1))), after])
    return loop.results[1]


def _sort(buffer: ir.Value, count: ir.Value) -> None:
    """Sort ``buffer[0:count]`` ascending: short lists by an inline insertion sort (the library sort's calls
    cost more than the sorting for a row's few columns), longer ones by ``sparse_tensor.sort``."""
    def insertion() -> list[ir.Value]:
        index, c0, c1 = ir.IndexType.get(), _index(0), _index(1)

        def place(e: ir.Value) -> None:
            value = memref.load(buffer, [e])
            shift = scf.WhileOp([index], [e])
            before = shift.before.blocks.append(index)
            with ir.InsertionPoint(before):
                p = before.arguments[0]
                inside = arith.cmpi(arith.CmpIPredicate.ugt, p, c0)
                previous = memref.load(buffer, [arith.select(inside, arith.subi(p, c1), c0)])
                scf.ConditionOp(arith.andi(inside, arith.cmpi(arith.CmpIPredicate.ugt, previous, value)), [p])
            after = shift.after.blocks.append(index)
            with ir.InsertionPoint(after):
                p = after.arguments[0]
                below = arith.subi(p, c1)
                memref.store(memref.load(buffer, [below]), buffer, [p])
                scf.YieldOp([below])
            memref.store(value, buffer, [shift.results[0]])

        _for(c1, count, place)
        return []

    def library() -> list[ir.Value]:
        st.sort(count, buffer, [], ir.AffineMapAttr.get(ir.AffineMap.get_identity(1)),
                ir.Attribute.parse("#sparse_tensor<SparseTensorSortAlgorithm hybrid_quick_sort>"), ny=0)
        return []

    _if(arith.cmpi(arith.CmpIPredicate.ule, count, _index(SHORT_LIST)), insertion, library, [])


class _Gustavson:
    """The body of the kernel over ``A``'s and ``B``'s level buffers; ``emit`` returns ``C``'s."""

    def __init__(self, a_pos: ir.Value, a_crd: ir.Value, a_val: ir.Value, b_pos: ir.Value, b_crd: ir.Value,
                 b_val: ir.Value, element: ir.Type, out_types: list[ir.Type]) -> None:
        self.a_pos, self.a_crd, self.a_val = a_pos, a_crd, a_val
        self.b_pos, self.b_crd, self.b_val = b_pos, b_crd, b_val
        self.element, self.out_types = element, out_types
        self.is_float = isinstance(element, ir.FloatType)
        self.index = ir.IndexType.get()
        self.c0, self.c1 = _index(0), _index(1)

    def _row(self, pos: ir.Value, row: ir.Value) -> tuple[ir.Value, ir.Value]:
        return _load_index(pos, row), _load_index(pos, arith.addi(row, self.c1))

    def _products(self, row: ir.Value, visit: Callable[[ir.Value, ir.Value, ir.Value], ir.Value]) -> ir.Value:
        """Walk ``A[row, k] * B[k, j]`` for every stored pair, counting from 0: ``visit(p, q, count)`` with ``p``
        the position in ``A`` and ``q`` in ``B`` returns the next count."""
        start, stop = self._row(self.a_pos, row)

        def entry(p: ir.Value, carried: ir.Value) -> ir.Value:
            self._prefetch(p)
            b_start, b_stop = self._row(self.b_pos, _load_index(self.a_crd, p))
            return _reduce(b_start, b_stop, carried, lambda q, value: visit(p, q, value))

        return _reduce(start, stop, self.c0, entry)

    def _prefetch(self, p: ir.Value) -> None:
        """Start loading the rows of ``B`` that ``A``'s entries ``AHEAD`` positions on will read (their
        positions ``2 * AHEAD`` on), across row ends: each is a random row of ``B``, a cache miss otherwise."""
        last = arith.subi(arith.maxui(memref.dim(self.a_crd, self.c0), self.c1), self.c1)

        def ahead(distance: int) -> ir.Value:
            return _load_index(self.a_crd, arith.minui(arith.addi(p, _index(distance)), last))

        memref.prefetch(self.b_pos, [ahead(2 * AHEAD)], False, 3, True)
        row = _load_index(self.b_pos, ahead(AHEAD))
        for buffer in (self.b_crd, self.b_val):
            memref.prefetch(buffer, [row], False, 3, True)

    def _work(self, row: ir.Value) -> ir.Value:
        """How many entries of ``B`` row ``row`` of the product reads (its multiply-adds)."""
        start, stop = self._row(self.a_pos, row)

        def entry(p: ir.Value, work: ir.Value) -> ir.Value:
            b_start, b_stop = self._row(self.b_pos, _load_index(self.a_crd, p))
            return arith.addi(work, arith.subi(b_stop, b_start))

        return _reduce(start, stop, self.c0, entry)

    def emit(self, rows: int | None, cols: int | None) -> list[ir.Value]:
        c0, c1 = self.c0, self.c1
        n_rows = _index(rows) if rows is not None else arith.subi(memref.dim(self.a_pos, c0), c1)
        n_cols = _index(cols) if cols is not None else self._column_count()
        rows1 = arith.addi(n_rows, c1)
        # 1. the work of each row, prefix-summed in place: offsets[i] = entries of B rows before row i read
        offsets = memref.alloc(_vector(self.index), [rows1], [])

        def estimate(i: ir.Value) -> None:
            memref.store(self._work(i), offsets, [arith.addi(i, c1)])

        # a few loads per entry of A: threads pay only for a large A (a fork that finds the workers asleep waits
        # longer than this pass takes below that)
        many = arith.cmpi(arith.CmpIPredicate.uge, memref.dim(self.a_crd, c0), _index(PARALLEL_ESTIMATE))
        _if(many, lambda: _parallel(n_rows, estimate) or [], lambda: _for(c0, n_rows, estimate) or [], [])
        work = self._prefix_sum(offsets, n_rows)
        chunks, starts = self._chunks(offsets, n_rows, n_cols, work)
        # 2. symbolic: each row's column count, into offsets[i + 1]
        stamped = ColumnStamps.pay_off(n_cols, work, n_rows)
        _if(stamped, lambda: self._by_workers(chunks, starts, n_cols, None,
                                              lambda i, stamps, _: self._stamped_count(i, stamps, offsets)),
            lambda: _parallel(chunks, lambda c: self._symbolic(c, starts, n_cols, offsets)) or [], [])
        # 3. positions
        nnz = self._prefix_sum(offsets, n_rows)
        out_pos = memref.alloc(self.out_types[0], [rows1], [])
        _for(c0, rows1, lambda i: _store_as(memref.load(offsets, [i]), out_pos, i))
        out = (result_buffer(self.out_types[1], nnz), result_buffer(self.out_types[2], nnz))
        # 4. numeric
        _if(stamped, lambda: self._by_workers(chunks, starts, n_cols, self.element,
                                              lambda i, stamps, scratch: self._numeric_row(
                                                  i, scratch, n_cols, offsets, out, stamps)),
            lambda: _parallel(chunks, lambda c: self._numeric(c, starts, n_cols, offsets, out)) or [], [])
        memref.dealloc(offsets)
        memref.dealloc(starts)
        return [out_pos, *out]

    def _column_count(self) -> ir.Value:
        """``B``'s columns in a shape-generic build: its largest coordinate plus one (0 when empty)."""
        return _reduce(self.c0, memref.dim(self.b_crd, self.c0), self.c0,
                       lambda q, most: arith.maxui(most, arith.addi(_load_index(self.b_crd, q), self.c1)))

    def _prefix_sum(self, offsets: ir.Value, n_rows: ir.Value) -> ir.Value:
        """``offsets[0] = 0`` and ``offsets[i + 1] += offsets[i]``; returns the total."""
        memref.store(self.c0, offsets, [self.c0])

        def step(i: ir.Value, total: ir.Value) -> ir.Value:
            after = arith.addi(i, self.c1)
            total = arith.addi(total, memref.load(offsets, [after]))
            memref.store(total, offsets, [after])
            return total

        return _reduce(self.c0, n_rows, self.c0, step)

    def _chunks(self, offsets: ir.Value, n_rows: ir.Value, n_cols: ir.Value,
                work: ir.Value) -> tuple[ir.Value, ir.Value]:
        """How many chunks, and ``starts`` (``chunks + 1`` rows): chunk ``c`` is rows ``starts[c]..starts[c+1]``.

        At most ``MAX_CHUNKS``, the rows, and one per 64 columns' worth of
        work (a chunk clears its bitmap, a word per 64 columns, once); at
        least one.  Row ``i`` goes to chunk
        ``offsets[i] * chunks / work``, so chunks carry about equal work.
        """
        c0, c1 = self.c0, self.c1
        words = arith.maxui(arith.divui(n_cols, _index(_I64)), c1)
        chunks = arith.minui(arith.minui(_index(MAX_CHUNKS), n_rows), arith.divui(work, words))
        chunks = arith.maxui(chunks, c1)
        starts = memref.alloc(_vector(self.index), [arith.addi(chunks, c1)], [])
        _for(c0, arith.addi(chunks, c1), lambda c: memref.store(n_rows, starts, [c]))
        total = arith.maxui(work, c1)
        last = arith.subi(chunks, c1)

        def owner(r: ir.Value) -> None:  # rows from the last: each chunk ends up with its first row
            i = arith.subi(arith.subi(n_rows, c1), r)
            chunk = arith.minui(arith.divui(arith.muli(memref.load(offsets, [i]), chunks), total), last)
            memref.store(i, starts, [chunk])

        _for(c0, n_rows, owner)

        def close_gap(r: ir.Value) -> None:  # a chunk no row fell into starts where the next one does
            c = arith.subi(last, r)
            following = memref.load(starts, [arith.addi(c, c1)])
            memref.store(arith.minui(memref.load(starts, [c]), following), starts, [c])

        _for(c0, chunks, close_gap)
        return chunks, starts

    def _rows_of(self, chunk: ir.Value, starts: ir.Value, body: Callable[[ir.Value], None]) -> None:
        _for(memref.load(starts, [chunk]), memref.load(starts, [arith.addi(chunk, self.c1)]), body)

    def _wide(self, size: ir.Value, n_cols: ir.Value) -> ir.Value:
        """Whether a row of ``size`` entries (or products) is read back from the bitmap rather than sorted."""
        return arith.cmpi(arith.CmpIPredicate.uge, arith.muli(size, _index(WIDE_ROW)), n_cols)

    def _symbolic(self, chunk: ir.Value, starts: ir.Value, n_cols: ir.Value, offsets: ir.Value) -> None:
        """Count each row's distinct columns into ``offsets[i + 1]``: a row with many products for the width
        sets bits and counts them; any other lists each column the first time and clears its bits after."""
        scratch = _Scratch(n_cols, None)

        def row(i: ir.Value) -> None:
            def wide() -> list[ir.Value]:
                self._products(i, lambda p, q, count: scratch.mark(_load_index(self.b_crd, q), count))
                return [scratch.count_and_clear()]

            def narrow() -> list[ir.Value]:
                count = self._products(i, lambda p, q, count: scratch.mark_first(_load_index(self.b_crd, q), count))
                _for(self.c0, count, lambda e: scratch.unset(memref.load(scratch.columns, [e])))
                return [count]

            count = _if(self._wide(self._work(i), n_cols), wide, narrow, [self.index])[0]
            memref.store(count, offsets, [arith.addi(i, self.c1)])

        self._rows_of(chunk, starts, row)
        scratch.free()

    def _by_workers(self, chunks: ir.Value, starts: ir.Value, n_cols: ir.Value, element: ir.Type | None,
                    row: Callable[[ir.Value, ColumnStamps, _Scratch | None], None]) -> list[ir.Value]:
        """``row(i, stamps, scratch)`` for every row, by one worker per thread (``loops.by_workers``), each
        with its own ``ColumnStamps`` (and ``_Scratch`` for ``element``, when given)."""
        def setup() -> tuple[ColumnStamps, _Scratch | None]:
            return ColumnStamps(n_cols), (_Scratch(n_cols, element) if element is not None else None)

        def teardown(state: tuple[ColumnStamps, _Scratch | None]) -> None:
            for scratch in state:
                if scratch is not None:
                    scratch.free()

        by_workers(chunks, lambda c, state: self._rows_of(c, starts, lambda i: row(i, *state)), setup, teardown)
        return []

    def _stamped_count(self, i: ir.Value, stamps: ColumnStamps, offsets: ir.Value) -> None:
        """Row ``i``'s distinct columns into ``offsets[i + 1]``: each product adds whether its column is new."""
        tag = stamps.tag(i)

        def visit(p: ir.Value, q: ir.Value, count: ir.Value) -> ir.Value:
            new = stamps.renew(_load_index(self.b_crd, q), tag)
            return arith.addi(count, arith.index_castui(self.index, new))

        memref.store(self._products(i, visit), offsets, [arith.addi(i, self.c1)])

    def _numeric(self, chunk: ir.Value, starts: ir.Value, n_cols: ir.Value, offsets: ir.Value,
                 out: tuple[ir.Value, ir.Value]) -> None:
        """The rows of ``chunk`` (``_numeric_row``) with the chunk's own scratch, its bitmap telling first
        products apart."""
        scratch = _Scratch(n_cols, self.element)
        self._rows_of(chunk, starts, lambda i: self._numeric_row(i, scratch, n_cols, offsets, out))
        scratch.free()

    def _numeric_row(self, i: ir.Value, scratch: _Scratch, n_cols: ir.Value, offsets: ir.Value,
                     out: tuple[ir.Value, ir.Value], stamps: ColumnStamps | None = None) -> None:
        """Row ``i`` of ``C``: a column's first product overwrites its accumulator slot, the others add; then the
        row is written in column order.

        ``stamps`` (or, without them, the bitmap) tell a column's first
        product in the row.  A row with many columns for the width
        (``WIDE_ROW``) is read back from the bitmap, 64 columns a word; any
        other row lists its columns and sorts them (and clears their bits
        one by one when the bitmap told the first products).
        """
        values = scratch.values
        start = memref.load(offsets, [i])
        size = arith.subi(memref.load(offsets, [arith.addi(i, self.c1)]), start)
        tag = stamps.tag(i) if stamps is not None else None

        def accumulate(listed: bool) -> None:
            def visit(p: ir.Value, q: ir.Value, count: ir.Value) -> ir.Value:
                j = _load_index(self.b_crd, q)
                product = self._mul(memref.load(self.a_val, [p]), memref.load(self.b_val, [q]))
                return scratch.mark_first(
                    j, count, lambda: memref.store(product, values, [j]),
                    lambda: memref.store(self._add(memref.load(values, [j]), product), values, [j]), listed,
                    stamps.renew(j, tag) if stamps is not None else None)

            self._products(i, visit)

        def write(j: ir.Value, e: ir.Value) -> None:
            at = arith.addi(start, e)
            _store_as(j, out[0], at)
            memref.store(memref.load(values, [j]), out[1], [at])

        def wide() -> list[ir.Value]:
            accumulate(listed=False)
            scratch.drain(write)
            return []

        def narrow() -> list[ir.Value]:
            accumulate(listed=True)
            _sort(scratch.columns, size)

            def entry(e: ir.Value) -> None:
                j = memref.load(scratch.columns, [e])
                write(j, e)
                if stamps is None:
                    scratch.unset(j)

            _for(self.c0, size, entry)
            return []

        _if(self._wide(size, n_cols), wide, narrow, [])

    def _add(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return arith.addf(x, y) if self.is_float else arith.addi(x, y)

    def _mul(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return arith.mulf(x, y) if self.is_float else arith.muli(x, y)
