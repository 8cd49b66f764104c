"""N:M Linear layers on a few rows of ``X``, reading ``W`` as stored: no repacking.

The lane kernel (``lane_select``) repacks ``W`` at every call (0.03 ms
for 384 x 384 at 2:4, 0.2 ms for 1536 x 384, one thread): on a batch of a
few rows that is most of the call, and it made a 2:4 MiniLM slower than
dense torch on one sentence.  Here each row of ``W`` is read in its own
storage order.  When ``m = 2 n`` (1:2, 2:4, 4:8, 8:16), a span of
``2 * lanes`` inputs holds exactly ``lanes`` entries of a row: one vector of
values and one of in-group offsets, both contiguous.  The offsets plus each
entry's group start are indices into the span, and a two-source lane
permute (``vpermi2ps``; an LLVM intrinsic, no dialect has it) picks each
entry's input from the span of ``X``'s row held in two registers; one FMA
accumulates.  ``BATCH_ROWS`` rows of the batch share each load of ``W``'s
values and offsets: a pass takes ``lanes / BATCH_ROWS`` rows of ``W`` (16
accumulators), and ``loops.lane_sums`` plus shuffles turn a chunk's passes
into one vector of output features per batch row, which the lane kernel's
``Finish`` (bias, epilogue, residual, a partial last chunk) completes and
stores.

Per useful FMA this does more vector work than the lane kernel (the
offsets are widened and offset on every use, and its sums are reduced
across lanes), so it pays only while the repacking it saves is larger:
below ``SMALL_BATCH`` rows.  Against the lane kernel with each worker
packing the chunks it claims (``lane_select.linear_by_chunks``), one
thread, 2:4, us (as stored / packed by chunks), session 19: 384 x 384 at
8 rows 26 / 34, 16 rows 44 / 42, 24 rows 63 / 53, 31 rows 85 / 71; 1536 x
384 at 8 rows 102 / 138, 16 rows 161 / 183, 24 rows 237 / 214, 31 rows
345 / 284; 384 x 1536 at 16 rows 150 / 169, 24 rows 228 / 211 (18-22
rows: even, within noise).  One batch row at a time (before
``BATCH_ROWS``), 1536 x 384 at 8 rows took 0.168 ms, 0.123 with 4.

In a model, a layer's weight comes from L3 or memory, not L2: a pass
reads 16 rows of ``W`` at once, each only a few lines long, too short for
the hardware prefetcher to follow.  So the first group of ``BATCH_ROWS``
batch rows of a chunk also prefetches, span by span, the next chunk's rows
(into L2), and workers claim contiguous runs of chunks so that the next
chunk is usually their own.  Batches under ``BATCH_ROWS`` rows stream ``W``
at memory speed without it (there the prefetches only cost: 1 row of 384 x
384, warm, 9.4-10.4 us a call against 12.6-13.1 with them).  One thread,
10 rows, 24 different 2:4 layers called in turn (as a forward walks its
layers), us a layer, three runs (before / after): 1536 x 384 301-333 /
212-225, 384 x 1536 247-283 / 199-203, 384 x 384 55-59 / 61-64 (dense
torch: 364-441, 302-352, 50).  MiniLM on one sentence (10 tokens), 2:4,
dense/sparse: 1.06-1.09x / 1.20-1.23x at one thread, 0.95-0.98x /
1.00-1.01x at two (where waking the second worker dominates).  Built with
the MLIR bindings' op builders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from mlir import ir
from mlir.dialects import arith, llvm, memref, vector
from sparse_mlir.dialects.native.lane_select import Finish, LaneProduct, lane_types, widened
from sparse_mlir.dialects.native.loops import (
    LINE_BYTES,
    add,
    branch,
    by_workers,
    constant_like,
    for_each,
    if_else,
    index,
    is_float,
    lane_sums,
    reduce_loop,
    thread_count,
)
from sparse_mlir.formats import Format

__all__ = ["BATCH_ROWS", "SMALL_BATCH", "RowProduct", "RowWeight", "applies", "by_batch_size", "linear_as_stored",
           "row_items"]

BATCH_ROWS = 4  # batch rows per read of a row of W (with lanes / 4 rows of W a pass: 16 accumulators)
PREFETCH_LOCALITY = 2  # into L2 (prefetcht1): a chunk ahead is up to 60 KB, more than L1
CLAIMS_PER_THREAD = 4  # runs of chunks a worker claims, about: few enough that prefetches stay its own
SMALL_BATCH = 24  # batches of fewer rows read W as stored (measured: see the module's docstring)
_TWO_SOURCE = {("f", 32): "llvm.x86.avx512.vpermi2var.ps.512", ("f", 64): "llvm.x86.avx512.vpermi2var.pd.512",
               ("i", 32): "llvm.x86.avx512.vpermi2var.d.512", ("i", 64): "llvm.x86.avx512.vpermi2var.q.512"}


def applies(fmt: Format) -> bool:
    """Whether a span of twice the lanes holds one vector of a row's entries: ``m = 2 n``."""
    nm = fmt.levels[-1]
    return fmt.is_nm and nm.m == 2 * nm.n


class RowWeight:
    """An N:M ``W`` (``rows x cols``) as stored: its values and in-group offsets, row-major, ``cols / m * n``
    entries a row; what ``LaneProduct``'s finishing reads of a weight (``rows``, ``cols``, ``lanes``,
    ``vector``)."""

    def __init__(self, fmt: Format, crd: ir.Value, values: ir.Value, rows: ir.Value, cols: ir.Value,
                 element: ir.Type, lanes: int):
        nm = fmt.levels[-1]
        self.n, self.m, self.lanes = nm.n, nm.m, lanes
        self.crd, self.values, self.rows, self.cols = crd, values, rows, cols
        self.vector, self.index_vector, _ = lane_types(element, lanes)
        self.permute = _TWO_SOURCE["f" if is_float(element) else "i", element.width]
        self.per_row = arith.muli(arith.divui(cols, index(self.m)), index(self.n))
        self.chunks = arith.ceildivui(rows, index(lanes))


class RowProduct(LaneProduct):
    """``y[y_row + r, o] = finish(x[x_row + r, :] . W[o, :])`` for rows ``r < count`` and the chunks of
    features ``[chunk_lo, chunk_hi)``: per chunk, the batch rows ``BATCH_ROWS`` at a time (the chunk's rows of
    ``W`` stay in cache between them)."""

    def __init__(self, weight: RowWeight, element: ir.Type, finish: Finish):
        super().__init__(weight, element, finish)
        span = 2 * weight.lanes
        self.full_spans = arith.divui(weight.cols, index(span))
        self.tail = arith.remui(weight.cols, index(span))  # inputs of a partial last span (whole groups)
        starts = [(e // weight.n) * weight.m for e in range(weight.lanes)]  # entry e's group start in the span
        self.group_starts = arith.constant(weight.index_vector, ir.DenseElementsAttr.get(
            np.array(starts, dtype=f"int{weight.index_vector.element_type.width}"), type=weight.index_vector))

    def product(self, x: ir.Value, x_row: ir.Value, y: ir.Value, y_row: ir.Value, count: ir.Value,
                chunk_lo: ir.Value, chunk_hi: ir.Value) -> None:
        """Per chunk, ``BATCH_ROWS`` batch rows at a time (each read of a row of ``W`` serves them all), the rest
        in halving groups (2, then 1 with ``BATCH_ROWS`` 4)."""
        def rows(chunk: ir.Value, first: ir.Value, together: int) -> None:
            # the first full group of the chunk prefetches the next chunk's rows of W (see the module's docstring)
            ahead = arith.cmpi(arith.CmpIPredicate.eq, first, index(0)) if together == BATCH_ROWS else None
            self._rows(x, [arith.addi(x_row, arith.addi(first, index(r))) for r in range(together)],
                       y, [arith.addi(y_row, arith.addi(first, index(r))) for r in range(together)], chunk, ahead)

        def chunk(c: ir.Value) -> None:
            done, together = index(0), BATCH_ROWS
            while together:
                end = arith.subi(count, arith.remui(arith.subi(count, done), index(together)))
                for_each(done, end, lambda r, t=together: rows(c, r, t), index(together))
                done, together = end, together // 2

        for_each(chunk_lo, chunk_hi, chunk)

    def _rows(self, x: ir.Value, x_rows: list[ir.Value], y: ir.Value, y_rows: list[ir.Value], chunk: ir.Value,
              ahead: ir.Value | None) -> None:
        """A chunk's outputs for ``x_rows``: with ``k`` batch rows, ``k`` passes over ``lanes / k`` rows of ``W``
        each (``lanes`` accumulators in all), each pass's sums in the low lanes of one vector per batch row,
        then the passes' parts put side by side, pairwise."""
        lanes, together = self.lanes, len(x_rows)
        feature = arith.muli(chunk, index(lanes))
        width = lanes // together
        passes = [self._pass(x, x_rows, arith.addi(feature, index(p * width)), width, ahead)
                  for p in range(together)]
        for r, y_row in enumerate(y_rows):
            parts, valid = [found[r] for found in passes], width
            while len(parts) > 1:  # two vectors with ``valid`` low lanes each -> one with twice as many
                mask = [*range(valid), *range(lanes, lanes + valid)] + [0] * (lanes - 2 * valid)
                parts = [vector.shuffle(a, b, mask) for a, b in zip(parts[::2], parts[1::2])]
                valid *= 2
            sums = parts[0]
            if self.finish.bias is not None:
                sums = add(sums, self._start(feature, y_row))
            self._store(sums, y, y_row, feature)

    def _pass(self, x: ir.Value, x_rows: list[ir.Value], first: ir.Value, group: int, ahead: ir.Value | None
              ) -> list[ir.Value]:
        """Rows ``first .. first + group`` of ``W`` times ``x_rows``: per batch row, a vector whose lane ``e``
        is row ``first + e``'s dot product; where ``ahead`` holds, each span also prefetches the same span of
        the rows a chunk on (``_prefetch_next_chunk``)."""
        w, lanes = self.w, self.lanes
        last = arith.subi(w.rows, index(1))
        # rows of W past the last (a partial last chunk) read the last row again: their lanes are not stored
        starts = [arith.muli(arith.minui(arith.addi(first, index(e)), last), w.per_row) for e in range(group)]
        offsets_type = ir.VectorType.get([lanes], ir.MemRefType(w.crd.type).element_type)

        def span(s: ir.Value, accs: list[ir.Value], masked: bool) -> list[ir.Value]:
            column = arith.muli(s, index(2 * lanes))
            entry = arith.muli(s, index(lanes))
            if masked:  # the partial last span: lanes past the inputs read as zeros, entries past a row's as 0
                low = vector.create_mask(self.mask_type, [arith.minui(self.tail, index(lanes))])
                high = vector.create_mask(self.mask_type, [arith.subi(self.tail, arith.minui(self.tail,
                                                                                            index(lanes)))])
                high_column = arith.minui(arith.addi(column, index(lanes)), arith.subi(w.cols, index(1)))
                xs = [(vector.maskedload(w.vector, x, [row, column], low, self.zero),
                       vector.maskedload(w.vector, x, [row, high_column], high, self.zero)) for row in x_rows]
                entries = vector.create_mask(self.mask_type, [arith.divui(self.tail, index(2))])
            else:
                xs = [(vector.load(w.vector, x, [row, column]),
                       vector.load(w.vector, x, [row, arith.addi(column, index(lanes))])) for row in x_rows]
            out = list(accs)
            if ahead is not None and not masked:
                branch(ahead, lambda: self._prefetch_next_chunk(first, group, entry), lambda: None)
            for e in range(group):
                at = arith.addi(starts[e], entry)
                if masked:
                    weights = vector.maskedload(w.vector, w.values, [at], entries, self.zero)
                    offsets = vector.maskedload(offsets_type, w.crd, [at], entries,
                                                constant_like(offsets_type, 0))
                else:
                    weights = vector.load(w.vector, w.values, [at])
                    offsets = vector.load(offsets_type, w.crd, [at])
                # entries past a row's last (offset 0) point at their group's start, past the span's inputs:
                # a zero lane, so no padding multiplies a value of X
                picks = arith.addi(widened(offsets, w.index_vector), self.group_starts)
                for r, (low_x, high_x) in enumerate(xs):
                    chosen = llvm.call_intrinsic(w.vector, w.permute, [low_x, picks, high_x], [], [])
                    k = e * len(x_rows) + r
                    out[k] = (vector.fma(weights, chosen, out[k]) if is_float(self.element)
                              else arith.addi(arith.muli(weights, chosen), out[k]))
            return out

        inits = [self.zero] * (group * len(x_rows))
        accs = reduce_loop(index(0), self.full_spans, inits, lambda s, a: span(s, a, False))
        has_tail = arith.cmpi(arith.CmpIPredicate.ne, self.tail, index(0))
        accs = if_else(has_tail, lambda: span(self.full_spans, accs, True), lambda: accs, [a.type for a in accs])
        return [lane_sums([accs[e * len(x_rows) + r] for e in range(group)]) for r in range(len(x_rows))]

    def _prefetch_next_chunk(self, first: ir.Value, group: int, entry: ir.Value) -> None:
        """Prefetch into L2 the values and offsets at ``entry`` of the rows ``first + lanes ..`` (``group`` of
        them, the last row of ``W`` standing in past it): one line of values a row per span; a span's offsets
        fill ``1 / stride`` of a line, so the line ``stride`` spans on is asked for (past the row's end: the next
        rows', needed soon too), and a row's offset lines are all requested early."""
        w = self.w
        last = arith.subi(w.rows, index(1))
        stride = max(1, LINE_BYTES // (w.lanes * ir.MemRefType(w.crd.type).element_type.width // 8))
        crd_last = arith.subi(memref.dim(w.crd, index(0)), index(1))
        for e in range(group):
            start = arith.muli(arith.minui(arith.addi(first, index(w.lanes + e)), last), w.per_row)
            memref.prefetch(w.values, [arith.addi(start, entry)], False, PREFETCH_LOCALITY, True)
            memref.prefetch(w.crd, [arith.minui(arith.addi(start, arith.muli(entry, index(stride))), crd_last)],
                            False, PREFETCH_LOCALITY, True)


def row_items(product: RowProduct, x: ir.Value, y: ir.Value, batch: ir.Value) -> None:
    """``y = product(x)`` for a small batch: items of ``CLAIMS_PER_THREAD``-th of a thread's share of the chunks
    of features (every row of the batch), contiguous, claimed by one worker per thread (``loops.by_workers``).

    Contiguous runs because each chunk prefetches the next one's rows of
    ``W`` (``RowProduct._pass``): claimed one by one, the next chunk was
    as often the other worker's, prefetched into the wrong core's L2.
    """
    chunks = product.w.chunks
    threads = arith.maxui(thread_count(), index(1))
    run = arith.maxui(arith.divui(chunks, arith.muli(threads, index(CLAIMS_PER_THREAD))), index(1))

    def item(claim: ir.Value, _state: object) -> None:
        first = arith.muli(claim, run)
        product.product(x, index(0), y, index(0), batch, first, arith.minui(arith.addi(first, run), chunks))

    by_workers(arith.ceildivui(chunks, run), item)


def linear_as_stored(fmt: Format, crd: ir.Value, values: ir.Value, rows: ir.Value, element: ir.Type, lanes: int,
                     finish: Finish, x: ir.Value, y: ir.Value, batch: ir.Value) -> None:
    """``y = finish(x W^T)`` for the ``rows x cols`` N:M ``W`` (``crd``, ``values``; ``cols``: ``x``'s), ``W``
    read as stored: what the Linear and MLP kernels run for a small batch."""
    weight = RowWeight(fmt, crd, values, rows, memref.dim(x, index(1)), element, lanes)
    row_items(RowProduct(weight, element, finish), x, y, batch)


def by_batch_size(batch: ir.Value, formats: Sequence[Format], small: Callable[[], None],
                  large: Callable[[], None]) -> None:
    """``small()`` below ``SMALL_BATCH`` rows, else ``large()``: the choice between reading ``W`` as stored and
    repacking it, made at run time (the batch is a run-time size); always ``large()`` when a weight's format
    cannot be read as stored (``applies``)."""
    if not all(applies(fmt) for fmt in formats):
        large()
        return
    branch(arith.cmpi(arith.CmpIPredicate.ult, batch, index(SMALL_BATCH)), small, large)
