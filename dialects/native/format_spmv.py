"""SpMV and row sums on the CPU for COO, DCSR and CSC operands (and CSR read transposed), threaded.

The sparsifier runs these serially: a COO or DCSR outer level is
compressed, and a CSC SpMV's outer loop is the reduction, so its loop nest
is not a parallel one (``KernelSpec.parallelizable``).  Here each format gets
the parallel form that fits it, built with the bindings' op builders:

* **DCSR** (stored rows ``crd0`` with positions ``pos1``) and a **CSC read
  transposed** (``y[j] = A[i,j] * x[i]``: the outer level is the result's
  index): the CSR SpMV's row loop (``spmv.RowSums``: unrolled long rows, a
  prefetch of ``x``), over the stored rows; a DCSR row goes to ``y[crd0[r]]``.
* **COO** (row-sorted coordinates ``crd0``, ``crd1``): ``COO_CHUNKS`` at most
  equal runs of consecutive nonzeros, whatever their rows (balanced for
  skewed rows), in parallel.  The rows strictly inside a chunk are its own:
  each entry adds its product to ``y[row]``, with no branch (a register sum
  reset by a select at each row change was latency-bound: 2.2-2.5 ns an
  entry against 1.3-2.2 for this, the form of scipy's loop).  The chunk's
  first and last row, which it may share with its neighbours, are summed
  into per-chunk carries, added to ``y`` in chunk order after the loop.  The
  chunking depends only on the entry count, so the sums are the same on any
  number of threads.  A row lower than the one before it (a scipy matrix
  whose canonical flag lied) is noticed on the way, and ``y`` is then summed
  again serially, entry by entry: chunks sharing rows would have raced.
* **CSC** (columns ``pos1``, rows ``crd1``) and a **CSR read transposed**: each
  outer entry scatters ``A[i,j] * x[j]`` into ``y[i]``.  With ``T`` threads
  (``loops.thread_count``) the outer entries are split into ``T`` ranges of
  about equal entries (bisection over the positions); range 0 scatters into
  ``y``, the others into ``T - 1`` private vectors, summed into ``y`` by a
  parallel loop after.  One thread scatters straight into ``y``.  The sums
  are the same on every call with the same ``T``; the runtime's thread choice
  (``runtime.thread_choice``) may run a call on fewer threads (its timed
  trials of cold calls), whose sums then differ in the last bits.

Row and column sums (``y[i] = A[i,j]``) are the same kernels without ``x``.
``y`` is zeroed by the C entry point (no ``FILLS_OUTPUT``): rows that hold no
entry stay zero.  Sizes come from the buffers (shape-generic), integers and
floats alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, func, memref, scf
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.native.loops import (
    add,
    constant_like,
    declare_thread_count,
    dynamic_vector,
    for_each,
    if_else,
    index,
    kernel_entry,
    level_types,
    load_index,
    lower_bound,
    mul,
    parallel,
    reduce_loop,
    thread_count,
)
from sparse_mlir.dialects.native.spmv import RowSums, gather_lanes, row_term
from sparse_mlir.dialects.native.target import CpuTarget

from sparse_mlir.dsl.patterns import format_kind, product_operands, scatters, unscaled
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["COO_CHUNKS", "COO_CHUNK_ENTRIES", "native_format_spmv"]

COO_CHUNKS = 64  # runs of a COO at most: enough for guided scheduling over 16 threads or so
COO_CHUNK_ENTRIES = 4096  # and at least this many entries each: a chunk's carries cost two adds

Shapes = dict[str, tuple[int | None, ...]]


def native_format_spmv(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes,
                       target: CpuTarget = CpuTarget()) -> ir.Module | None:
    """The SpMV or row-sum module for a COO, DCSR or CSC ``A`` (module docstring), or ``None`` when it does not
    apply (an SpMM, a CSR ``A[i,j]``: the CSR SpMV's own row, a result summed in another type).

    ``target`` says whether the DCSR and CSC rows gather ``x`` a vector at a time, as the CSR SpMV's do.
    """
    core, scale = unscaled(spec)
    found = product_operands(core, formats)
    if found is None or len(spec.output_indices) != 1 or spec.output_dtype != spec.dtype:
        return None
    a, x = found
    kind = format_kind(formats[a])
    lanes = gather_lanes(target, spec.dtype.itemsize * 8)  # for the row loops (RowSums) of DCSR and CSC
    if kind == "coo":
        body: Callable[..., None] = _coo
    elif kind == "dcsr":
        body = functools.partial(_dcsr, lanes=lanes)
    elif scatters(core, formats, a):
        body = _scatter
    else:
        body = functools.partial(_gather, lanes=lanes)
    with ir.Location.unknown():
        return _module(spec, formats[a], a, x, body, scale)


def _module(spec: KernelSpec, fmt: Format, a: str, x: str | None, body: Callable[..., None],
            scale: float | int) -> ir.Module:
    element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
    types = {a: level_types(fmt, element), **({x: [dynamic_vector(element)]} if x is not None else {})}
    y_type = dynamic_vector(element)
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
        block, buffers, (y,) = kernel_entry(spec.inputs, types, [y_type], [y_type])
        with ir.InsertionPoint(block):
            body(*buffers[a], buffers[x][0] if x is not None else None, y, element, scale)
            func.ReturnOp([y])
        if body is _scatter:
            declare_thread_count()
    module.operation.verify()
    return module


def _add_to(y: ir.Value, at: ir.Value, value: ir.Value) -> None:
    memref.store(add(memref.load(y, [at]), value), y, [at])


def _scaled(y: ir.Value, element: ir.Type, scale: float | int) -> None:
    """``y *= scale`` in parallel, unless ``scale`` is 1: the literals of ``2 * A[i,j] * x[j]`` for the kernels
    that add into ``y`` entry by entry (a pass over the rows instead of a multiply a nonzero)."""
    if scale != 1:
        factor = constant_like(element, scale)
        parallel(memref.dim(y, index(0)), lambda i: memref.store(mul(memref.load(y, [i]), factor), y, [i]))


def _dcsr(pos0: ir.Value, crd0: ir.Value, pos1: ir.Value, crd1: ir.Value, val: ir.Value, x: ir.Value | None,
          y: ir.Value, element: ir.Type, scale: float | int, lanes: int = 0) -> None:
    """The stored rows in parallel, each into ``y[crd0[r]]``."""
    RowSums(pos1, crd1, val, x, y, element, stored=crd0, scale=scale, lanes=lanes).emit(load_index(pos0, index(1)))


def _gather(pos1: ir.Value, crd1: ir.Value, val: ir.Value, x: ir.Value | None, y: ir.Value,
            element: ir.Type, scale: float | int, lanes: int = 0) -> None:
    """A CSC read transposed: its columns are the result's entries, each a row sum as in CSR."""
    columns = arith.subi(memref.dim(pos1, index(0)), index(1))
    RowSums(pos1, crd1, val, x, y, element, scale=scale, lanes=lanes).emit(columns)


def _coo(pos0: ir.Value, crd0: ir.Value, crd1: ir.Value, val: ir.Value, x: ir.Value | None, y: ir.Value,
         element: ir.Type, scale: float | int) -> None:
    """Equal runs of entries in parallel; each chunk's first and last row through carries (module docstring)."""
    c0, c1 = index(0), index(1)
    i_type, zero = ir.IndexType.get(), constant_like(element, 0)
    nnz = load_index(pos0, c1)
    # ceil(nnz / COO_CHUNK_ENTRIES), at most COO_CHUNKS: every chunk holds at least one entry (0 chunks if none)
    chunks = arith.minui(arith.ceildivui(nnz, index(COO_CHUNK_ENTRIES)), index(COO_CHUNKS))
    head, tail = (memref.alloc(dynamic_vector(element), [chunks], []) for _ in range(2))
    head_row, tail_row, disorder = (memref.alloc(dynamic_vector(i_type), [chunks], []) for _ in range(3))
    term = functools.partial(row_term, val, crd1, x)

    def chunk(c: ir.Value) -> None:
        lo = arith.divui(arith.muli(c, nnz), chunks)
        hi = arith.divui(arith.muli(arith.addi(c, c1), nnz), chunks)
        first, last = load_index(crd0, lo), load_index(crd0, arith.subi(hi, c1))
        # the head: entries of the first row from ``lo`` on; the tail: of the last row back from ``hi``
        middle_start, head_sum = _scan(lo, lambda k: arith.cmpi(arith.CmpIPredicate.ult, k, hi),
                                       lambda k: k, c1, lambda k: _row_is(crd0, k, first), term, zero)
        middle_end, tail_sum = _scan(hi, lambda k: arith.cmpi(arith.CmpIPredicate.ugt, k, middle_start),
                                     lambda k: arith.subi(k, c1), index(-1),
                                     lambda k: _row_is(crd0, arith.subi(k, c1), last), term, zero)

        def entry(k: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
            # rows strictly inside the chunk are its own: y[row] += product, branch-free; a row lower than the one
            # before it means the rows are not sorted
            previous, unsorted = carried
            now = load_index(crd0, k)
            _add_to(y, now, term(k))
            return [now, arith.ori(unsorted, _descends(previous, now))]

        previous, unsorted = reduce_loop(middle_start, middle_end, [first, c0], entry)
        unsorted = arith.ori(unsorted, _descends(previous, last))
        for buffer, value in ((head, head_sum), (tail, tail_sum), (head_row, first), (tail_row, last),
                              (disorder, unsorted)):
            memref.store(value, buffer, [c])

    parallel(chunks, chunk)

    def check(c: ir.Value, unsorted: list[ir.Value]) -> list[ir.Value]:  # and across each chunk boundary
        previous = if_else(arith.cmpi(arith.CmpIPredicate.eq, c, c0), lambda: [memref.load(head_row, [c0])],
                           lambda: [memref.load(tail_row, [arith.subi(c, c1)])], [i_type])[0]
        return [arith.ori(arith.ori(unsorted[0], memref.load(disorder, [c])),
                          _descends(previous, memref.load(head_row, [c])))]

    unsorted = reduce_loop(c0, chunks, [c0], check)[0]

    def carries() -> list[ir.Value]:  # in chunk order, so the sums do not depend on the threads
        def carry(c: ir.Value) -> None:
            _add_to(y, memref.load(head_row, [c]), memref.load(head, [c]))
            _add_to(y, memref.load(tail_row, [c]), memref.load(tail, [c]))

        for_each(c0, chunks, carry)
        return []

    def serially() -> list[ir.Value]:  # rows out of order (a scipy matrix whose canonical flag lied): y += A x
        for_each(c0, memref.dim(y, c0), lambda i: memref.store(zero, y, [i]))
        for_each(c0, nnz, lambda k: _add_to(y, load_index(crd0, k), term(k)))
        return []

    if_else(arith.cmpi(arith.CmpIPredicate.ne, unsorted, c0), serially, carries, [])
    for buffer in (head, tail, head_row, tail_row, disorder):
        memref.dealloc(buffer)
    _scaled(y, element, scale)


def _row_is(crd0: ir.Value, k: ir.Value, row: ir.Value) -> ir.Value:
    return arith.cmpi(arith.CmpIPredicate.eq, load_index(crd0, k), row)


def _descends(previous: ir.Value, now: ir.Value) -> ir.Value:
    """1 (an ``index``) when ``now < previous``, else 0."""
    return arith.index_castui(ir.IndexType.get(), arith.cmpi(arith.CmpIPredicate.ult, now, previous))


def _scan(start: ir.Value, inside: Callable[[ir.Value], ir.Value], entry_of: Callable[[ir.Value], ir.Value],
          step: ir.Value, same_row: Callable[[ir.Value], ir.Value], term: Callable[[ir.Value], ir.Value],
          zero: ir.Value) -> tuple[ir.Value, ir.Value]:
    """From ``start``, step while ``inside(k)`` and ``same_row(k)``, summing ``term(entry_of(k))``; returns where
    it stopped and the sum.  ``same_row`` is only evaluated inside (an ``scf.if``), so it may read at ``k``."""
    i_type = ir.IndexType.get()
    loop = scf.WhileOp([i_type, zero.type], [start, zero])
    before = loop.before.blocks.append(i_type, zero.type)
    with ir.InsertionPoint(before):
        k, total = before.arguments
        going = if_else(inside(k), lambda: [same_row(k)], lambda: [arith.constant(ir.IntegerType.get_signless(1), 0)],
                        [ir.IntegerType.get_signless(1)])[0]
        scf.ConditionOp(going, [k, total])
    after = loop.after.blocks.append(i_type, zero.type)
    with ir.InsertionPoint(after):
        k, total = after.arguments
        scf.YieldOp([arith.addi(k, step), add(total, term(entry_of(k)))])
    return loop.results[0], loop.results[1]


def _scatter(pos1: ir.Value, crd1: ir.Value, val: ir.Value, x: ir.Value | None, y: ir.Value,
             element: ir.Type, scale: float | int) -> None:
    """Each outer entry ``o`` adds ``A[i,o] * x[o]`` to ``y[i]``: ``T`` equal ranges of entries, range 0 into
    ``y`` and the others into private vectors, summed into ``y`` after (module docstring)."""
    c0, c1 = index(0), index(1)
    outer = arith.subi(memref.dim(pos1, c0), c1)
    nnz = memref.dim(val, c0)
    rows = memref.dim(y, c0)
    threads = arith.maxui(arith.minui(thread_count(), arith.maxui(outer, c1)), c1)

    def scatter_range(first: ir.Value, last: ir.Value, target: ir.Value, at: Callable[[ir.Value], list[ir.Value]]
                      ) -> None:
        def column(o: ir.Value) -> None:
            scale = None if x is None else memref.load(x, [o])

            def entry(k: ir.Value) -> None:
                value = memref.load(val, [k])
                where = at(load_index(crd1, k))
                memref.store(add(memref.load(target, where), value if scale is None else mul(value, scale)),
                             target, where)

            for_each(load_index(pos1, o), load_index(pos1, arith.addi(o, c1)), entry)

        for_each(first, last, column)

    def serial() -> list[ir.Value]:
        scatter_range(c0, outer, y, lambda i: [i])
        return []

    def threaded() -> list[ir.Value]:
        extra = arith.subi(threads, c1)
        private = memref.alloc(ir.MemRefType.get([ir.ShapedType.get_dynamic_size()] * 2, element), [extra, rows], [])

        def split(t: ir.Value) -> ir.Value:  # the first outer entry of range t: its entries start at t*nnz/T
            return lower_bound(pos1, c0, outer, arith.divui(arith.muli(t, nnz), threads))

        def one_range(t: ir.Value) -> None:
            first, last = split(t), split(arith.addi(t, c1))
            last = arith.select(arith.cmpi(arith.CmpIPredicate.eq, arith.addi(t, c1), threads), outer, last)

            def into_y() -> list[ir.Value]:
                scatter_range(first, last, y, lambda i: [i])
                return []

            def into_private() -> list[ir.Value]:
                slot = arith.subi(t, c1)
                zero = constant_like(element, 0)
                for_each(c0, rows, lambda i: memref.store(zero, private, [slot, i]))  # touched by its own thread
                scatter_range(first, last, private, lambda i: [slot, i])
                return []

            if_else(arith.cmpi(arith.CmpIPredicate.eq, t, c0), into_y, into_private, [])

        parallel(threads, one_range)

        def merge(i: ir.Value) -> None:
            total = reduce_loop(c0, extra, [memref.load(y, [i])],
                                lambda s, acc: [add(acc[0], memref.load(private, [s, i]))])[0]
            memref.store(total, y, [i])

        parallel(rows, merge)
        memref.dealloc(private)
        return []

    if_else(arith.cmpi(arith.CmpIPredicate.ugt, threads, c1), threaded, serial, [])
    _scaled(y, element, scale)
