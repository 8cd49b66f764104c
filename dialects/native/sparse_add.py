"""The sparse add, ``C[i,j] = alpha * A[i,j] + beta * B[i,j]`` with CSR ``A``, ``B`` and ``C`` (any index widths),
emitted instead of sparsified.

The sparsifier co-iterates the two rows in one scalar loop nest that
inserts into ``C`` one entry at a time, serially (it never threads
insertion into a sparse output).  Here the rows are merged in two passes,
both threaded over *chunks* of rows that hold about equal numbers of
entries of ``A`` and ``B`` (``MAX_CHUNKS`` at most, none under
``CHUNK_ENTRIES``): chunk ``c`` starts at the first row whose entries
before it reach ``c / chunks`` of the total, found by a binary search over
``A``'s and ``B``'s positions, which are already prefix sums.

1. count: each row's entries of ``C`` are its two rows' lengths less the
   columns they share, found by stamping ``A``'s columns with the row's tag
   and testing ``B``'s (``loops.ColumnStamps``, one array per worker, the
   workers claiming chunks: ``loops.by_workers``); no step waits on the one
   before, where a merge step waits on the last comparison (4096^2 at
   1% + 1%, 1 thread: 1.56 -> 1.13 ms for the whole add).  Below
   ``STAMP_ENTRIES`` operand entries, or where the stamps do not pay
   (``ColumnStamps.pay_off``: more columns than ``STAMP_COLUMNS`` or than
   the entries), each chunk merges its rows' column lists and counts the
   distinct columns (an entry of both counts once) instead;
2. a prefix sum over the chunks' counts (a few dozen numbers) gives each
   chunk's first entry in ``C`` and ``C``'s size;
3. fill: each chunk merges its rows again, writing coordinates and values
   and each row's end position.

The merge step is branch-free (the smaller of the two current columns
written, each pointer advanced by a comparison), since the order in which
two rows' columns interleave is data and would mispredict a branch half the
time; when one row runs out the other's rest is copied, and a row pair with
an empty side is copied without merging.  Rows of the same columns (``A +
A^T`` of a structurally symmetric matrix, a weight plus an update on its
own pattern), found by a compare loop without a dependency chain when their
lengths agree, add entry by entry without a merge (bcsstk13 + its
transpose, 1 thread: 0.36 -> 0.075 ms).  Coordinates are
compared unsigned at the index width.  Rows come out sorted with unique
columns (the SparseTensor invariant), given sorted, duplicate-free operand
rows, which every valid CSR operand has.  Entries are structural: a sum
that cancels to zero stays stored (as in the sparsifier's kernel; scipy
drops it).  The coefficients come from the expression
(``dsl.patterns.sparse_sum_operands``): ``A - B``, ``2*A + B*0.5``.

The elementwise product ``C[i,j] = A[i,j] * B[i,j]`` (``native_sparse_product``)
takes the same two passes over the *intersection* of the rows (its count
is the shared columns the stamps find), found in the fill (and in the
count without stamps) by a scatter and a probe instead of a merge
(``_Intersection``): the shorter row marks its columns in the chunk's
bitmap and notes their positions, the longer one tests each of its
columns, in order, so ``C``'s columns come out sorted; the shorter row
then clears its bits.  No step depends on the one
before (a merge step depends on the last comparison: 5 ns a step, 2.2 ms
against the sparsifier's 1.3 for 4096^2 at 1% times 1%), and a row 30 times
longer than the other costs a bit test an entry, not a merge step.  Rows of
the same columns multiply entry by entry.

The function has the sparse assembler's signature (level buffers in,
``C``'s level buffers out, allocated with ``malloc`` so the C entry point
hands them to the caller).  A ``None`` row count (a shape-generic build) is
read from ``A``'s positions.  Built with the MLIR bindings' op builders.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, memref, scf
from sparse_mlir.dialects.native.loops import (
    STAMP_COLUMNS,
    ColumnStamps,
    add,
    by_workers,
    constant_like,
    csr_product_module,
    dynamic_vector,
    for_each,
    if_else,
    index,
    load_index,
    mul,
    parallel,
    reduce_loop,
    result_buffer,
    store_index,
)

from sparse_mlir.dsl.patterns import SparseSum, sparse_product_operands, sparse_sum_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["CHUNK_ENTRIES", "MAX_CHUNKS", "STAMP_COLUMNS", "STAMP_ENTRIES", "native_sparse_add",
           "native_sparse_product"]

MAX_CHUNKS = 64  # row chunks at most: guided scheduling balances them over up to 16 threads or so
CHUNK_ENTRIES = 4096  # operand entries per chunk at least: below that a chunk's set-up outweighs its merging
# operand entries from which the count pass stamps: below, merging is as fast (random 4096^2 at 0.1% + 0.1%, 34k
# entries, 1 thread: 0.28 ms either way) and a small add pays for the search of the largest column and the
# workers' set-up (cryg2500 + its transpose, 25k entries: 0.059 ms merged, 0.073 stamped)
STAMP_ENTRIES = 1 << 16

Shapes = dict[str, tuple[int | None, ...]]


def native_sparse_add(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes,
                      vector_bits: int = 256) -> ir.Module | None:
    """The sparse-add module for ``spec`` in the current context, or ``None`` when it does not apply.

    ``vector_bits`` is unused (merging is scalar); it keeps the table's signature.
    """
    found = sparse_sum_operands(spec, formats)
    if found is None:
        return None
    with ir.Location.unknown():
        return _module(spec, formats, shapes, found, _Merge)


def native_sparse_product(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes,
                          vector_bits: int = 256) -> ir.Module | None:
    """The elementwise-product module (``A .* B``, all CSR) for ``spec``, or ``None`` when it does not apply."""
    found = sparse_product_operands(spec, formats)
    if found is None:
        return None
    with ir.Location.unknown():
        return _module(spec, formats, shapes, found, _Intersection)


def _module(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, found: SparseSum,
            kind: type[_Merge]) -> ir.Module:
    def body(buffers: dict[str, list[ir.Value]], element: ir.Type, out_types: list[ir.Type]) -> list[ir.Value]:
        merge = kind(buffers[found.a], buffers[found.b], found.alpha, found.beta, element, out_types)
        return merge.emit(shapes[spec.output][0])

    return csr_product_module(spec, formats, body, uses_thread_count=True)


class _Operand:
    """One operand's level buffers and coefficient."""

    def __init__(self, buffers: list[ir.Value], coefficient: float, element: ir.Type) -> None:
        self.pos, self.crd, self.val = buffers
        self.entries = memref.dim(self.crd, index(0))
        self.coefficient = coefficient
        self.scale = None if coefficient == 1 else constant_like(element, coefficient)

    def row(self, i: ir.Value) -> tuple[ir.Value, ir.Value]:
        return load_index(self.pos, i), load_index(self.pos, arith.addi(i, index(1)))

    def value(self, p: ir.Value) -> ir.Value:
        """The coefficient times the value at ``p``."""
        value = memref.load(self.val, [p])
        return value if self.scale is None else mul(self.scale, value)


def _while(inits: list[ir.Value], condition: Callable[[list[ir.Value]], ir.Value],
           body: Callable[[list[ir.Value]], list[ir.Value]]) -> list[ir.Value]:
    """``scf.while`` whose carried values pass to ``body`` while ``condition`` holds; returns the last ones."""
    types = [v.type for v in inits]
    loop = scf.WhileOp(types, inits)
    before = loop.before.blocks.append(*types)
    with ir.InsertionPoint(before):
        scf.ConditionOp(condition(list(before.arguments)), list(before.arguments))
    after = loop.after.blocks.append(*types)
    with ir.InsertionPoint(after):
        scf.YieldOp(body(list(after.arguments)))
    return list(loop.results)


def _as_index_width(value: ir.Value) -> ir.Value:
    """A coordinate of any width as a 64-bit integer, to compare two operands' coordinates."""
    if ir.IntegerType(value.type).width == 64:
        return value
    return arith.extui(ir.IntegerType.get_signless(64), value)


def _ule(x: ir.Value, y: ir.Value) -> ir.Value:
    return arith.cmpi(arith.CmpIPredicate.ule, x, y)


def _as_step(flag: ir.Value) -> ir.Value:
    """A comparison as 0 or 1, to advance a pointer by without a branch."""
    return arith.index_castui(ir.IndexType.get(), arith.extui(ir.IntegerType.get_signless(64), flag))


class _Merge:
    """The body of the kernel over ``A``'s and ``B``'s level buffers; ``emit`` returns ``C``'s."""

    def __init__(self, a: list[ir.Value], b: list[ir.Value], alpha: float, beta: float,
                 element: ir.Type, out_types: list[ir.Type]) -> None:
        self.a, self.b = _Operand(a, alpha, element), _Operand(b, beta, element)
        self.element, self.out_types = element, out_types
        self.index = ir.IndexType.get()

    def emit(self, rows: int | None) -> list[ir.Value]:
        c0, c1 = index(0), index(1)
        n_rows = index(rows) if rows is not None else arith.subi(memref.dim(self.a.pos, c0), c1)
        total = self._entries_before(n_rows)
        chunks = arith.minui(arith.minui(index(MAX_CHUNKS), n_rows), arith.divui(total, index(CHUNK_ENTRIES)))
        chunks = arith.maxui(chunks, c1)
        bounds = _Chunks(self, n_rows, total, chunks)
        # 1. each chunk's entries of C, into firsts[c + 1]; 2. their prefix sum: firsts[c] is chunk c's first
        firsts = memref.alloc(dynamic_vector(self.index), [arith.addi(chunks, c1)], [])
        memref.store(c0, firsts, [c0])
        many = arith.cmpi(arith.CmpIPredicate.uge, total, index(STAMP_ENTRIES))
        self.n_cols = self._column_bound(n_rows, many)
        stamped = arith.andi(many, ColumnStamps.pay_off(self.n_cols, total, n_rows))

        def count_by_workers() -> list[ir.Value]:
            by_workers(chunks, lambda c, stamps: memref.store(self._stamped_count(bounds, c, stamps), firsts,
                                                              [arith.addi(c, c1)]),
                       lambda: ColumnStamps(self.n_cols), ColumnStamps.free)
            return []

        def count_by_chunks() -> list[ir.Value]:
            parallel(chunks, lambda c: memref.store(self._count(bounds, c), firsts, [arith.addi(c, c1)]))
            return []

        if_else(stamped, count_by_workers, count_by_chunks, [])

        def running(c: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:
            at = arith.addi(c, c1)
            so_far = arith.addi(sums[0], memref.load(firsts, [at]))
            memref.store(so_far, firsts, [at])
            return [so_far]

        (nnz,) = reduce_loop(c0, chunks, [c0], running)
        out_pos = memref.alloc(self.out_types[0], [arith.addi(n_rows, c1)], [])
        store_index(c0, out_pos, c0)
        out = (out_pos, result_buffer(self.out_types[1], nnz), result_buffer(self.out_types[2], nnz))
        # 3. fill
        parallel(chunks, lambda c: self._fill(bounds, c, memref.load(firsts, [c]), out))
        memref.dealloc(firsts)
        return list(out)

    def _combine(self, x: ir.Value, y: ir.Value) -> ir.Value:
        """An entry of ``C`` from the two operands' (scaled) entries at one column."""
        return add(x, y)

    def _column_bound(self, n_rows: ir.Value, stamping: ir.Value) -> ir.Value:
        """One more than the operands' largest column when ``stamping`` may happen (else 0: the merge count
        needs none, and a small add would pay a visible share for the search)."""
        return if_else(stamping, lambda: [self._columns(n_rows)], lambda: [index(0)], [self.index])[0]

    def _columns(self, n_rows: ir.Value) -> ir.Value:
        """One more than the operands' largest column: the largest last column of their (sorted) rows."""
        def last(i: ir.Value, most: list[ir.Value]) -> list[ir.Value]:
            for operand in (self.a, self.b):
                start, end = operand.row(i)
                column = load_index(operand.crd, arith.subi(arith.maxui(end, index(1)), index(1)))
                most = [arith.select(arith.cmpi(arith.CmpIPredicate.ult, start, end),
                                     arith.maxui(most[0], arith.addi(column, index(1))), most[0])]
            return most

        return reduce_loop(index(0), n_rows, [index(0)], last)[0]

    def _entries_before(self, row: ir.Value) -> ir.Value:
        """Entries of ``A`` and ``B`` in the rows before ``row``: the sum of their positions there."""
        return arith.addi(load_index(self.a.pos, row), load_index(self.b.pos, row))

    def _merge(self, i: ir.Value, inits: list[ir.Value], step: Callable[..., list[ir.Value]]
               ) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value, list[ir.Value]]:
        """Walk row ``i`` of both operands while both have entries left: ``step(p, q, ja, jb, take_a, take_b,
        carried)`` returns the next carried values, and ``p`` (``A``'s position, column ``ja``) and ``q``
        (``B``'s, ``jb``) advance past the column written.  Returns where each stopped, each row's end, and the
        carried values.

        The columns travel with the positions, and each step loads the
        column after each position before it compares: the loop's
        dependency chain is then a compare and a select, not a load (a
        merge step that loaded its columns took 7 cycles).
        """
        p0, p_end = self.a.row(i)
        q0, q_end = self.b.row(i)
        index_type = self.index

        def merged(clamped: bool) -> list[ir.Value]:
            p_last, q_last = arith.subi(p_end, index(1)), arith.subi(q_end, index(1))

            def after(k: ir.Value, last: ir.Value) -> ir.Value:
                return arith.minui(arith.addi(k, index(1)), last) if clamped else arith.addi(k, index(1))

            def both_left(values: list[ir.Value]) -> ir.Value:
                p, q = values[:2]
                return arith.andi(arith.cmpi(arith.CmpIPredicate.ult, p, p_end),
                                  arith.cmpi(arith.CmpIPredicate.ult, q, q_end))

            def advance(values: list[ir.Value]) -> list[ir.Value]:
                p, q, ja, jb, *carried = values
                next_a, next_b = load_index(self.a.crd, after(p, p_last)), load_index(self.b.crd, after(q, q_last))
                take_a, take_b = _ule(ja, jb), _ule(jb, ja)
                carried = step(p, q, ja, jb, take_a, take_b, carried)
                return [arith.addi(p, _as_step(take_a)), arith.addi(q, _as_step(take_b)),
                        arith.select(take_a, next_a, ja), arith.select(take_b, next_b, jb), *carried]

            first = [load_index(self.a.crd, p0), load_index(self.b.crd, q0)]
            p, q, _, _, *carried = _while([p0, q0, *first, *inits], both_left, advance)
            return [p, q, *carried]

        types = [index_type, index_type, *(v.type for v in inits)]
        # a row that ends before its buffer does reads the column after its last without a clamp
        inside = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, p_end, self.a.entries),
                            arith.cmpi(arith.CmpIPredicate.ult, q_end, self.b.entries))
        both = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, p0, p_end),
                          arith.cmpi(arith.CmpIPredicate.ult, q0, q_end))
        p, q, *carried = if_else(
            both, lambda: if_else(inside, lambda: merged(False), lambda: merged(True), types),
            lambda: [p0, q0, *inits], types)
        return p, q, p_end, q_end, carried

    def _same_columns(self, i: ir.Value) -> ir.Value:
        """Whether row ``i`` of ``A`` and of ``B`` hold the same columns (``A + A^T`` of a structurally
        symmetric matrix, a matrix plus an update on its own pattern): checked by a loop without a
        dependency chain, and then added entry by entry without a merge."""
        p0, p_end = self.a.row(i)
        q0, q_end = self.b.row(i)
        length = arith.subi(p_end, p0)
        flag = ir.IntegerType.get_signless(1)

        def compare() -> list[ir.Value]:
            def equal(k: ir.Value, same: list[ir.Value]) -> list[ir.Value]:
                ja = memref.load(self.a.crd, [arith.addi(p0, k)])
                jb = memref.load(self.b.crd, [arith.addi(q0, k)])
                return [arith.andi(same[0], arith.cmpi(arith.CmpIPredicate.eq, _as_index_width(ja),
                                                       _as_index_width(jb)))]

            return reduce_loop(index(0), length, [arith.constant(flag, 1)], equal)

        return if_else(arith.cmpi(arith.CmpIPredicate.eq, length, arith.subi(q_end, q0)), compare,
                       lambda: [arith.constant(flag, 0)], [flag])[0]

    def _count(self, bounds: _Chunks, chunk: ir.Value) -> ir.Value:
        """How many entries of ``C`` the rows of ``chunk`` hold."""
        scratch = self._scratch()

        def row(i: ir.Value, count: list[ir.Value]) -> list[ir.Value]:
            return if_else(self._same_columns(i), lambda: [arith.addi(count[0], self._same_count(i))],
                           lambda: [self._count_row(i, count[0], scratch)], [self.index])

        begin, end = bounds.rows(chunk)
        count = reduce_loop(begin, end, [index(0)], row)[0]
        self._free(scratch)
        return count

    def _count_row(self, i: ir.Value, count: ir.Value, scratch: object) -> ir.Value:
        """``count`` plus the entries of ``C``'s row ``i`` (its operand rows' columns differ)."""
        p, q, p_end, q_end, (count,) = self._merge(
            i, [count], lambda p, q, ja, jb, take_a, take_b, carried: [arith.addi(carried[0], index(1))])
        return arith.addi(count, arith.addi(arith.subi(p_end, p), arith.subi(q_end, q)))

    def _stamped_count(self, bounds: _Chunks, chunk: ir.Value, stamps: ColumnStamps) -> ir.Value:
        """How many entries of ``C`` the rows of ``chunk`` hold, by ``_union`` of each row's lengths and the
        columns its two rows share: ``A``'s columns stamped with the row's tag, ``B``'s tested.

        Every step is a load and a store or a compare that depends on no
        other step (a merge step waits on the comparison before it; 4096^2
        at 1% + 1%, 1 thread: the count pass was 43% of the kernel).
        """
        def stamped(i: ir.Value) -> ir.Value:
            tag = stamps.tag(i)
            p0, p_end = self.a.row(i)
            q0, q_end = self.b.row(i)
            for_each(p0, p_end, lambda p: stamps.stamp(load_index(self.a.crd, p), tag))
            common = reduce_loop(q0, q_end, [index(0)], lambda q, shared: [arith.addi(shared[0], _as_step(
                stamps.holds(load_index(self.b.crd, q), tag)))])[0]
            return self._union(arith.subi(p_end, p0), arith.subi(q_end, q0), common)

        def row(i: ir.Value, count: list[ir.Value]) -> list[ir.Value]:
            # rows of the same columns (A + A^T of a structurally symmetric matrix) by the cheaper compare loop
            # (bcsstk13 + its transpose, 1 thread: 0.24 ms so, 0.33 ms stamped)
            return [arith.addi(count[0], if_else(self._same_columns(i), lambda: [self._same_count(i)],
                                                 lambda: [stamped(i)], [self.index])[0])]

        begin, end = bounds.rows(chunk)
        return reduce_loop(begin, end, [index(0)], row)[0]

    @staticmethod
    def _union(a_entries: ir.Value, b_entries: ir.Value, common: ir.Value) -> ir.Value:
        """Entries of a row of ``C`` whose rows of ``A`` and ``B`` hold these many, ``common`` of them shared."""
        return arith.subi(arith.addi(a_entries, b_entries), common)

    def _same_count(self, i: ir.Value) -> ir.Value:
        """Entries of ``C``'s row ``i`` when ``A``'s and ``B``'s rows hold the same columns: their length."""
        start, end = self.a.row(i)
        return arith.subi(end, start)

    def _scratch(self) -> object:
        """Per-chunk scratch, allocated inside the chunk's parallel iteration (none for the merge)."""
        return None

    def _free(self, scratch: object) -> None:
        pass

    def _fill(self, bounds: _Chunks, chunk: ir.Value, first: ir.Value, out: tuple[ir.Value, ...]) -> None:
        """Write the rows of ``chunk`` from entry ``first`` of ``C`` on, and each row's end position."""
        out_pos, out_crd, out_val = out

        def same(i: ir.Value, o: ir.Value) -> list[ir.Value]:
            p0, p_end = self.a.row(i)
            q0 = load_index(self.b.pos, i)

            def entry(k: ir.Value) -> None:
                at = arith.addi(o, arith.subi(k, p0))
                store_index(load_index(self.a.crd, k), out_crd, at)
                memref.store(self._combine(self.a.value(k), self.b.value(arith.addi(q0, arith.subi(k, p0)))),
                             out_val, [at])

            for_each(p0, p_end, entry)
            return [arith.addi(o, arith.subi(p_end, p0))]

        scratch = self._scratch()

        def row(i: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
            (o,) = if_else(self._same_columns(i), lambda: same(i, carried[0]),
                           lambda: [self._fill_row(i, carried[0], out, scratch)], [self.index])
            store_index(o, out_pos, arith.addi(i, index(1)))
            return [o]

        begin, end = bounds.rows(chunk)
        reduce_loop(begin, end, [first], row)
        self._free(scratch)

    def _fill_row(self, i: ir.Value, o: ir.Value, out: tuple[ir.Value, ...], scratch: object) -> ir.Value:
        """Write ``C``'s row ``i`` (its operand rows' columns differ) from entry ``o`` on; returns where it ends:
        a merge, then the rest of whichever row is left."""
        _, out_crd, out_val = out

        def both(p: ir.Value, q: ir.Value, ja: ir.Value, jb: ir.Value, take_a: ir.Value, take_b: ir.Value,
                 carried: list[ir.Value]) -> list[ir.Value]:
            (o,) = carried
            va, vb = self.a.value(p), self.b.value(q)
            value = arith.select(take_a, arith.select(take_b, add(va, vb), va), vb)
            store_index(arith.minui(ja, jb), out_crd, o)
            memref.store(value, out_val, [o])
            return [arith.addi(o, index(1))]

        def rest(operand: _Operand, start: ir.Value, stop: ir.Value, o: ir.Value) -> ir.Value:
            """Copy ``operand``'s entries ``start..stop`` to ``C`` from ``o`` on; returns where they end."""
            def copy(k: ir.Value) -> None:
                at = arith.addi(o, arith.subi(k, start))
                store_index(load_index(operand.crd, k), out_crd, at)
                memref.store(operand.value(k), out_val, [at])

            for_each(start, stop, copy)
            return arith.addi(o, arith.subi(stop, start))

        p, q, p_end, q_end, (o,) = self._merge(i, [o], both)
        return rest(self.b, q, q_end, rest(self.a, p, p_end, o))


class _Intersection(_Merge):
    """The elementwise product's body: each row pair's common columns by a scatter of the shorter row into the
    chunk's bitmap and a probe of the longer one (module docstring)."""

    _I64 = 64

    def _combine(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return mul(x, y)

    def _scratch(self) -> tuple[ir.Value, ir.Value]:
        """A cleared bitmap over the columns and (uninitialized) each marked column's position in its row."""
        i64 = ir.IntegerType.get_signless(self._I64)
        words = arith.maxui(arith.ceildivui(self.n_cols, index(self._I64)), index(1))
        bits = memref.alloc(dynamic_vector(i64), [words], [])
        zero = arith.constant(i64, 0)
        for_each(index(0), words, lambda w: memref.store(zero, bits, [w]))
        return bits, memref.alloc(dynamic_vector(self.index), [arith.maxui(self.n_cols, index(1))], [])

    def _free(self, scratch: tuple[ir.Value, ir.Value]) -> None:
        for buffer in scratch:
            memref.dealloc(buffer)

    @staticmethod
    def _bit(bits: ir.Value, j: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Column ``j``'s word index and its bit in that word."""
        i64 = ir.IntegerType.get_signless(64)
        return arith.shrui(j, index(6)), arith.shli(arith.constant(i64, 1),
                                                     arith.index_castui(i64, arith.andi(j, index(63))))

    def _marked(self, bits: ir.Value, j: ir.Value) -> ir.Value:
        at, bit = self._bit(bits, j)
        return arith.cmpi(arith.CmpIPredicate.ne, arith.andi(memref.load(bits, [at]), bit),
                          arith.constant(ir.IntegerType.get_signless(64), 0))

    def _pair(self, i: ir.Value, visit: Callable[[_Operand, _Operand, ir.Value, ir.Value, ir.Value], ir.Value],
              init: ir.Value, scratch: tuple[ir.Value, ir.Value], positions: bool) -> ir.Value:
        """Scatter the shorter of row ``i``'s two operand rows, then ``visit(long, short, m, j, carried)`` for
        each entry ``m`` (column ``j``) of the longer one whose column the shorter holds, in order; the
        shorter row's bits are cleared after.  ``positions``: note where each scattered column sits."""
        bits, where = scratch
        a_start, a_end = self.a.row(i)
        b_start, b_end = self.b.row(i)

        def scatter_and_probe(short: _Operand, long: _Operand) -> list[ir.Value]:
            s_start, s_end = short.row(i)
            l_start, l_end = long.row(i)

            def mark(k: ir.Value) -> None:
                j = load_index(short.crd, k)
                at, bit = self._bit(bits, j)
                memref.store(arith.ori(memref.load(bits, [at]), bit), bits, [at])
                if positions:
                    memref.store(k, where, [j])

            for_each(s_start, s_end, mark)

            def probe(m: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
                j = load_index(long.crd, m)
                return if_else(self._marked(bits, j), lambda: [visit(long, short, m, j, carried[0])],
                               lambda: [carried[0]], [init.type])

            result = reduce_loop(l_start, l_end, [init], probe)[0]

            def unmark(k: ir.Value) -> None:
                at, bit = self._bit(bits, load_index(short.crd, k))
                keep = arith.xori(bit, arith.constant(ir.IntegerType.get_signless(64), -1))
                memref.store(arith.andi(memref.load(bits, [at]), keep), bits, [at])

            for_each(s_start, s_end, unmark)
            return [result]

        a_shorter = arith.cmpi(arith.CmpIPredicate.ule, arith.subi(a_end, a_start), arith.subi(b_end, b_start))
        return if_else(a_shorter, lambda: scatter_and_probe(self.a, self.b),
                       lambda: scatter_and_probe(self.b, self.a), [init.type])[0]

    @staticmethod
    def _union(a_entries: ir.Value, b_entries: ir.Value, common: ir.Value) -> ir.Value:
        return common  # the product's row holds the shared columns only

    def _column_bound(self, n_rows: ir.Value, stamping: ir.Value) -> ir.Value:
        """One more than the operands' largest column, always: the fill's bitmap spans it."""
        return self._columns(n_rows)

    def _count_row(self, i: ir.Value, count: ir.Value, scratch: object) -> ir.Value:
        return self._pair(i, lambda long, short, m, j, carried: arith.addi(carried, index(1)), count,
                          scratch, positions=False)

    def _fill_row(self, i: ir.Value, o: ir.Value, out: tuple[ir.Value, ...], scratch: object) -> ir.Value:
        _, out_crd, out_val = out
        where = scratch[1]

        def write(long: _Operand, short: _Operand, m: ir.Value, j: ir.Value, o: ir.Value) -> ir.Value:
            store_index(j, out_crd, o)
            memref.store(mul(long.value(m), short.value(memref.load(where, [j]))), out_val, [o])
            return arith.addi(o, index(1))

        return self._pair(i, write, o, scratch, positions=True)


class _Chunks:
    """Chunk ``c`` of ``chunks`` is the rows from the first whose entries before it reach ``c * total / chunks``
    to the next chunk's first; the last chunk ends at the last row (trailing empty rows included)."""

    def __init__(self, merge: _Merge, n_rows: ir.Value, total: ir.Value, chunks: ir.Value) -> None:
        self.merge, self.n_rows, self.total, self.chunks = merge, n_rows, total, chunks

    def rows(self, chunk: ir.Value) -> tuple[ir.Value, ir.Value]:
        next_chunk = arith.addi(chunk, index(1))
        end = arith.select(arith.cmpi(arith.CmpIPredicate.eq, next_chunk, self.chunks), self.n_rows,
                           self._first_row(next_chunk))
        return self._first_row(chunk), end

    def _first_row(self, chunk: ir.Value) -> ir.Value:
        """The first row whose entries before it reach ``chunk * total / chunks`` (binary search; row 0 for
        chunk 0)."""
        target = arith.divui(arith.muli(chunk, self.total), self.chunks)

        def halve(values: list[ir.Value]) -> list[ir.Value]:
            low, high = values
            middle = arith.divui(arith.addi(low, high), index(2))
            below = arith.cmpi(arith.CmpIPredicate.ult, self.merge._entries_before(middle), target)
            return [arith.select(below, arith.addi(middle, index(1)), low), arith.select(below, high, middle)]

        low, _ = _while([index(0), self.n_rows],
                        lambda values: arith.cmpi(arith.CmpIPredicate.ult, values[0], values[1]), halve)
        return low
