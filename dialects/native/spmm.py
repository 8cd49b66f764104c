"""A register-tiled SpMM, ``C[i,j] = A[i,k] * B[k,j]`` with CSR or N:M ``A``, emitted instead of sparsified.

The sparsifier's SpMM loads and stores the whole C row once per nonzero
(the loop over B's columns is innermost).  Here each row's C is computed in
column tiles kept in vector registers (512-bit where the CPU has AVX-512)
while the row's nonzeros stream by: per nonzero, one vector load of B and
one FMA per register, and C is stored once.  Tiles come in tiers of 8, 2
and 1 registers, so a short N (32 columns) still gets independent FMA
chains, then one masked vector takes the last columns (a single last
column is a scalar loop); in tiles narrower than 8 registers CSR rows take
``CSR_UNROLL`` nonzeros a step into as many accumulator sets, so 8 chains
are in flight (DLMC 2048 x 512 at 90%, one thread: N=16 1.33x, N=32
1.2x).  N:M rows walk their groups with the ``n`` entries unrolled and no
position loads (positions are implicit), in blocks of rows that go through
B panel by panel, so a panel stays in L1 for the whole block
(``_rows_loop``; 1.2-1.3x on 2:4).  CSR rows are not walked that way yet: in a
C model (``benchmarks/models/csr_spmm_panels.c``) blocks of 64 rows walking
B in 64 KiB panels, each row resuming at a cursor, ran DLMC 512^2 at 90%
1.2x faster than whole rows, but the same walk emitted here (an
``scf.while`` stopping at the panel's end) measured no gain (session 24).
Rows (or blocks) run as an ``scf.parallel`` loop, which the CPU pipeline
threads like any other.  The kernel stores every element of C
(``FILLS_OUTPUT``: the C entry point skips zeroing it).  The function has exactly the signature
the sparse assembler would have given (level buffers, then dense memrefs,
returning C), so the C entry point and everything after it are shared with
sparsified kernels; sizes left ``None`` (a shape-generic build) are read
from ``C`` (rows) and ``B`` (columns of A, groups of N:M rows).
``native_spmm`` matches a planned spec; ``spmm_module``
builds the module from a ``SpmmProblem`` (format, sizes, inputs, bias or
epilogue: no spec), which ``native_linear`` also uses for its middle stage.
The IR is built with the bindings' op builders; ``tests/ir/test_ir_spmm.py``
reads its structure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from mlir import ir
from mlir.dialects import arith, func, memref, scf, vector
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.epilogue import SCALAR_EPILOGUE, VECTOR_EPILOGUE, Epilogue, epilogue_functions
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.loops import (
    LINE_BYTES,
    add,
    as_index,
    constant_like,
    csr_levels,
    declare_thread_count,
    dynamic_matrix,
    dynamic_vector,
    for_each,
    if_else,
    index,
    load_index,
    multiply_add,
    reduce_loop,
    thread_count,
)
from sparse_mlir.dialects.native.target import CpuTarget

from sparse_mlir.dsl.patterns import is_csr, spmm_epilogue, spmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["ACCUMULATORS", "B_ALIGNMENT", "COPY_REUSE", "CSR_UNROLL", "SpmmProblem", "aligned_b", "column_tiers",
           "last_columns", "native_spmm", "spmm_module"]

ACCUMULATORS = 8  # vector registers of C per column tile: independent FMA chains, half the register file
# N:M rows sharing each panel of B: more rows reuse a panel more, but each row streams its values from its own
# place, and 16-64 rows outran the prefetchers (2:4 at 4096^2, N=32: 8 rows 1.6-1.9 ns per nonzero, 64 rows 2.5)
ROW_BLOCK = 8
# CSR nonzeros a step at most in a tile of fewer than ``ACCUMULATORS`` vectors: a 2-vector tile (N=32 in
# float32) otherwise has two FMA chains, each waiting on the last (DLMC 2048 x 512 at 90%, 1 thread: N=16
# 1.33x, N=32 1.2x, N=64 1.15x; unrolling N:M groups the same way lost 4% at N=32)
CSR_UNROLL = 4
B_ALIGNMENT = LINE_BYTES  # where ``aligned_b`` puts B
COPY_REUSE = 4  # nonzeros of A per row of B at least for B to be copied to that boundary
# ranges of rows ``_work_queue`` cuts per thread: more balance the threads better, each costs an atomic increment
# on a line the threads share
RANGES_PER_THREAD = 16

# ``step(column, value, entry, sums) -> sums``: one nonzero of a row into the sums a loop carries (``entry``: its
# place in the loop's step, 0 when the loop takes one nonzero a step)
Step = Callable[[ir.Value, ir.Value, int, list[ir.Value]], list[ir.Value]]


@dataclass
class _Row:
    """Where row ``i``'s nonzeros are: ``[lo, hi)`` of CSR positions, or (N:M) its first entry ``base`` and the
    groups ``[glo, ghi)`` of the current panel of B."""

    i: ir.Value
    lo: ir.Value | None = None
    hi: ir.Value | None = None
    base: ir.Value | None = None
    glo: ir.Value | None = None
    ghi: ir.Value | None = None


class _Stream:
    """Walking one row's nonzeros: CSR segments, or N:M groups with implicit positions."""

    def __init__(self, fmt: Format, cols: int | None, pos: ir.Value, crd: ir.Value, val: ir.Value):
        self.nm = fmt.levels[-1] if fmt.is_nm else None
        self.pos, self.crd, self.val = pos, crd, val
        # groups per row; None: read at run time from B's rows (a shape-generic build)
        self.groups = (cols // self.nm.m if cols is not None else None) if self.nm else 0
        self.row_len: ir.Value | None = None  # N:M entries per row (``sizes``)
        self.group_count: ir.Value | None = None  # N:M groups per row (``sizes``)

    def sizes(self, b: ir.Value) -> None:
        """N:M groups per row and entries per row: compiled in, or from the rows of ``b`` (A's columns; the C
        entry point has checked that they are a multiple of ``m``)."""
        if not self.nm:
            return
        if self.groups is not None:
            self.group_count, self.row_len = index(self.groups), index(self.groups * self.nm.n)
            return
        self.group_count = arith.divui(memref.dim(b, index(0)), index(self.nm.m))
        self.row_len = arith.muli(self.group_count, index(self.nm.n))

    def row(self, i: ir.Value) -> _Row:
        """Row ``i``'s bounds (CSR) or first entry (N:M)."""
        if self.nm:
            return _Row(i, base=arith.muli(i, self.row_len))
        following = arith.addi(i, index(1))
        lo, hi = memref.load(self.pos, [i]), memref.load(self.pos, [following])
        return _Row(i, lo=as_index(lo), hi=as_index(hi))

    def _entry(self, p: ir.Value) -> tuple[ir.Value, ir.Value]:
        """CSR: the column and value of the nonzero at position ``p``."""
        return load_index(self.crd, p), memref.load(self.val, [p])

    def loop(self, row: _Row, sums: list[ir.Value], step: Step, unroll: int = 1) -> list[ir.Value]:
        """``sums`` through every nonzero of ``row`` (``step`` takes each); returns the final sums.

        CSR rows with ``unroll`` above 1 take that many nonzeros a step
        (entries ``0..unroll-1``), then the rest one a step (entry 0).  N:M
        rows take a group a step (its ``n`` entries, unrolled: no position
        loads, no branches).
        """
        if self.nm:
            n, m = self.nm.n, self.nm.m

            def group(g: ir.Value, values: list[ir.Value]) -> list[ir.Value]:
                first = arith.addi(row.base, arith.muli(g, index(n)))
                columns = arith.muli(g, index(m))
                for e in range(n):
                    p = arith.addi(first, index(e))
                    column = arith.addi(columns, load_index(self.crd, p))
                    values = step(column, memref.load(self.val, [p]), e, values)
                return values

            return reduce_loop(row.glo, row.ghi, sums, group)
        if unroll == 1:
            return reduce_loop(row.lo, row.hi, sums, lambda p, values: step(*self._entry(p), 0, values))
        by = index(unroll)
        over = arith.remui(arith.subi(row.hi, row.lo), by)
        middle = arith.subi(row.hi, over)

        def several(p: ir.Value, values: list[ir.Value]) -> list[ir.Value]:
            for e in range(unroll):
                values = step(*self._entry(arith.addi(p, index(e))), e, values)
            return values

        sums = reduce_loop(row.lo, middle, sums, several, by)
        return reduce_loop(middle, row.hi, sums, lambda p, values: step(*self._entry(p), 0, values))


def column_tiers(tiers: Sequence[int], lanes: int, columns: ir.Value
                 ) -> tuple[list[tuple[int, ir.Value, ir.Value]], ir.Value]:
    """Column tiles of ``tiers[0]`` vectors, then of each smaller count, each tier starting where the last ended.

    Built before the row loop; returns each tier's ``(vectors, start, stop)``
    for the loops inside it, and the first column left for the last columns.
    """
    spans, start = [], index(0)
    for count in tiers:
        left = arith.subi(columns, start)
        stop = arith.addi(start, arith.subi(left, arith.remui(left, index(count * lanes))))
        spans.append((count, start, stop))
        start = stop
    return spans, start


def last_columns(start: ir.Value, columns: ir.Value) -> ir.Value:
    """After the column tiers (``start``: the first column they left), the end of the masked vector tile: it
    takes the last columns when there are two or more (each walks the row once, where a scalar loop per column
    walked it per column); a single last column stays scalar, from the returned end to ``columns`` (as a masked
    vector it was slower: CSR, N=1, 0.054 ms against 0.039)."""
    many = arith.cmpi(arith.CmpIPredicate.ugt, arith.subi(columns, start), index(1))
    return arith.select(many, columns, start)


def _rows_loop(stream: _Stream, row_body: Callable[[_Row, ir.Value, ir.Value | None], None], columns: ir.Value,
               rows: ir.Value, itemsize: int, panel_bytes: int,
               finish_row: Callable[[ir.Value, ir.Value], None] | None, b_in: ir.Value, copy_b: bool) -> None:
    """The threaded loop running ``row_body(row, B, first)`` for every row (``_work_queue`` hands out the rows).

    CSR: rows one by one (``first`` is None).  N:M: blocks of
    ``ROW_BLOCK`` rows, each walked panel by panel (the row's groups
    ``[glo, ghi)`` whose rows of B fit in ``panel_bytes``,
    ``CpuTarget.panel_bytes``), so a panel of B is read from L2 once per
    block instead of once per row; ``first`` (an ``i1``) tells the row body
    whether to start from scratch or from the sums stored in C.  Positions
    are implicit, so a panel's bounds need no search.  ``finish_row(i, B)``
    runs on each row once its sums are complete (the epilogue): after the
    row (CSR), after the block's last panel (N:M).  ``copy_b``: each thread
    may copy ``b_in`` to a line boundary (``b_copy``).
    """
    if stream.nm is None:
        def csr_rows(lo: ir.Value, hi: ir.Value, b: ir.Value) -> None:
            def one_row(i: ir.Value) -> None:
                row_body(stream.row(i), b, None)
                if finish_row is not None:
                    finish_row(i, b)
            for_each(lo, hi, one_row)

        _work_queue(rows, index(1), csr_rows, stream.val, b_in, itemsize, copy_b)
        return
    row_block = index(ROW_BLOCK)
    group_bytes = arith.muli(columns, index(itemsize * stream.nm.m))  # bytes of B one group of columns reads
    panel = arith.maxui(arith.divui(index(panel_bytes), arith.maxui(group_bytes, index(1))), index(1))
    # at least one panel, so that rows without groups still store their zeros (or bias)
    panels_end = (index(max(stream.groups, 1)) if stream.groups is not None
                  else arith.maxui(stream.group_count, index(1)))

    def blocks(lo: ir.Value, hi: ir.Value, b: ir.Value) -> None:
        def block(ib: ir.Value) -> None:
            end = arith.minui(arith.addi(ib, row_block), hi)

            def panel_of_groups(glo: ir.Value) -> None:
                ghi = arith.minui(arith.addi(glo, panel), stream.group_count)
                first = arith.cmpi(arith.CmpIPredicate.eq, glo, index(0))

                def one_row(i: ir.Value) -> None:
                    row = stream.row(i)
                    row.glo, row.ghi = glo, ghi
                    row_body(row, b, first)
                for_each(ib, end, one_row)

            for_each(index(0), panels_end, panel_of_groups, panel)
            if finish_row is not None:
                for_each(ib, end, lambda i: finish_row(i, b))

        for_each(lo, hi, block, row_block)

    _work_queue(rows, row_block, blocks, stream.val, b_in, itemsize, copy_b)


def _work_queue(rows: ir.Value, grain: ir.Value, ranges: Callable[[ir.Value, ir.Value, ir.Value], None],
                values: ir.Value, b_in: ir.Value, itemsize: int, copy_b: bool) -> None:
    """One parallel iteration per thread, each taking ranges of rows (multiples of ``grain`` rows) from a shared
    counter until none are left, and running ``ranges(lo, hi, B)`` on each.

    Why not a parallel loop over the rows: B copied to a line boundary
    (``b_copy``) before such a loop is written by one core and then read
    by the others from that core's cache.  Here each thread copies B for
    itself, so the lines it reads are in its own L2, and skips the copy
    when the other threads have taken every range already.  The ranges are
    handed out as threads come for them (about ``RANGES_PER_THREAD`` per
    thread), so a thread that starts late or runs slowly (a core shared
    with another library's pool) does less, as with a guided schedule.
    """
    i64, i_type = ir.IntegerType.get_signless(64), ir.IndexType.get()
    c0, c1 = index(0), index(1)
    threads = thread_count()
    copied = b_copy_decision(b_in, values, itemsize, threads) if copy_b else None
    wanted = arith.muli(threads, index(RANGES_PER_THREAD))
    grains = arith.maxui(arith.ceildivui(arith.ceildivui(rows, wanted), grain), c1)
    size = arith.muli(grains, grain)
    count = arith.ceildivui(rows, size)
    counter = memref.alloc(ir.MemRefType.get([1], i64), [], [], alignment=LINE_BYTES)
    memref.store(arith.constant(i64, 0), counter, [c0])

    def claim() -> ir.Value:
        return as_index(memref.atomic_rmw(arith.AtomicRMWKind.addi, arith.constant(i64, 1), counter, [c0]))

    def worker(_: ir.Value) -> None:
        first = claim()
        any_left = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, first, count))
        with ir.InsertionPoint(any_left.then_block):
            b = b_copy(b_in, copied) if copy_b else b_in
            loop = scf.WhileOp([i_type], [first])
            head = loop.before.blocks.append(i_type)
            with ir.InsertionPoint(head):
                scf.ConditionOp(arith.cmpi(arith.CmpIPredicate.ult, head.arguments[0], count), [head.arguments[0]])
            step = loop.after.blocks.append(i_type)
            with ir.InsertionPoint(step):
                lo = arith.muli(step.arguments[0], size)
                ranges(lo, arith.minui(arith.addi(lo, size), rows), b)
                scf.YieldOp([claim()])
            if copy_b:
                b_free(b, copied)
            scf.YieldOp([])

    op = scf.ParallelOp([], [c0], [threads], [c1], [])
    block = op.regions[0].blocks.append(i_type)
    with ir.InsertionPoint(block):
        worker(block.arguments[0])
        scf.ReduceOp([], 0)
    memref.dealloc(counter)


def b_copy_decision(b_in: ir.Value, values: ir.Value, itemsize: int, copies: ir.Value | None = None) -> ir.Value:
    """Whether ``b_in`` is worth copying to a ``B_ALIGNMENT`` boundary, made ``copies`` times (once per thread,
    ``_work_queue``; once when None), given A's ``values`` (an ``i1``).

    Every nonzero loads whole vectors of a row of B.  When B's rows start
    off a cache-line boundary, each 64-byte load spans two lines and the
    kernel runs at half speed: a DLMC 512^2 pattern at 90%, N=128, float32,
    1 thread, took 0.19 ms with B at 16 or 48 bytes past a line and
    0.093 ms at a line (numpy allocates at 16-byte boundaries).  So B is
    copied (a ``memcpy``, about 7 us for 256 KiB) when it is off the
    boundary, its rows are a whole number of boundaries long (else no copy
    aligns every row) and A has at least ``COPY_REUSE`` nonzeros per row of
    B for each copy (each row of a copy is then read that many times on average).
    """
    align = index(B_ALIGNMENT)
    pointer = memref.extract_aligned_pointer_as_index(b_in)
    b_rows, b_cols = memref.dim(b_in, index(0)), memref.dim(b_in, index(1))
    nonzeros = memref.dim(values, index(0))
    offset = arith.remui(pointer, align)
    row_offset = arith.remui(arith.muli(b_cols, index(itemsize)), align)
    reads = arith.muli(arith.muli(b_rows, index(COPY_REUSE)), copies if copies is not None else index(1))
    off_line = arith.cmpi(arith.CmpIPredicate.ne, offset, index(0))
    rows_whole = arith.cmpi(arith.CmpIPredicate.eq, row_offset, index(0))
    reused = arith.cmpi(arith.CmpIPredicate.uge, nonzeros, reads)
    return arith.andi(arith.andi(off_line, rows_whole), reused)


def b_copy(b_in: ir.Value, copied: ir.Value) -> ir.Value:
    """B: ``b_in``, or when ``copied`` (``b_copy_decision``) a copy of it on a ``B_ALIGNMENT`` boundary."""
    choice = scf.IfOp(copied, [b_in.type], has_else=True)
    with ir.InsertionPoint(choice.then_block):
        fresh = memref.alloc(b_in.type, [memref.dim(b_in, index(0)), memref.dim(b_in, index(1))], [],
                             alignment=B_ALIGNMENT)
        memref.copy(b_in, fresh)
        scf.YieldOp([fresh])
    with ir.InsertionPoint(choice.else_block):
        scf.YieldOp([b_in])
    return choice.results[0]


def b_free(b: ir.Value, copied: ir.Value) -> None:
    """Free ``b`` when it is ``b_copy``'s copy."""
    free = scf.IfOp(copied)
    with ir.InsertionPoint(free.then_block):
        memref.dealloc(b)
        scf.YieldOp([])


def aligned_b(b_in: ir.Value, values: ir.Value, itemsize: int) -> tuple[ir.Value, Callable[[], None]]:
    """B from ``b_in``, copied once to a line boundary when that pays (``b_copy_decision``), and what frees the
    copy at the end of the function.  (The BSR SpMM's; the tiled SpMM copies per thread.)"""
    copied = b_copy_decision(b_in, values, itemsize)
    b = b_copy(b_in, copied)
    return b, lambda: b_free(b, copied)


def _epilogue_pass(i: ir.Value, c: ir.Value, reads: list[ir.Value], lanes: int, end: ir.Value,
                   columns: ir.Value) -> None:
    """Row ``i`` of ``c`` through the epilogue functions, in place: whole vectors up to ``end``, then the
    scalar tail.  ``reads`` are the kernel parameters the expression reads."""
    matrix = ir.MemRefType(c.type)
    vector_type = ir.VectorType.get([lanes], matrix.element_type)

    def whole(j: ir.Value) -> None:
        sums = vector.load(vector_type, c, [i, j])
        vector.store(func.call([vector_type], ir.FlatSymbolRefAttr.get(VECTOR_EPILOGUE), [sums, i, j, *reads]),
                     c, [i, j])

    def tail(j: ir.Value) -> None:
        sums = memref.load(c, [i, j])
        memref.store(func.call([matrix.element_type], ir.FlatSymbolRefAttr.get(SCALAR_EPILOGUE), [sums, i, j, *reads]),
                     c, [i, j])

    for_each(index(0), end, whole, index(lanes))
    for_each(end, columns, tail)


@dataclass(frozen=True)
class SpmmProblem:
    """``C[i,j] = A[i,k] * B[k,j]`` (+ a bias, or through an epilogue): what the tiled SpMM needs, no ``KernelSpec``.

    ``inputs`` are the function's inputs in order, each a name and a rank:
    ``a`` becomes A's three level buffers, ``b`` the dense ``B``, ``bias``
    a vector over C's rows (``bias_dim`` 0) or columns (1), and any other
    name a dense operand of ``epilogue`` (which may also read ``b``).
    """

    dtype: np.dtype
    fmt: Format  # A's: CSR or N:M, any index widths
    shape: tuple[int | None, int | None]  # A's rows and columns (None: read at run time from C and B)
    inputs: tuple[tuple[str, int], ...]
    a: str
    b: str
    bias: str | None = None
    bias_dim: int = -1
    epilogue: Epilogue | None = None


def native_spmm(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                target: CpuTarget = CpuTarget(), accumulators: int = ACCUMULATORS) -> ir.Module | None:
    """The tiled SpMM module for ``spec`` in the current context, or ``None`` when it does not apply.

    ``target`` gives the vector register width and the L1 size (``toolchain.cpu_target``).
    """
    found = spmm_operands(spec, formats)
    matched = spmm_epilogue(spec, formats) if found is None else None
    epilogue = None
    if matched is not None:  # an elementwise expression of the sums, applied to each finished row
        found = (matched.a, matched.b, None, -1)
        epilogue = Epilogue(matched.expr, matched.temp, matched.i, matched.j, matched.operands)
    if found is None or not (is_csr(formats[found[0]]) or formats[found[0]].is_nm):
        return None  # BSR has its own emitter (native_bsr)
    a_name, b_name, bias, bias_dim = found
    rows, cols = shapes[a_name]
    problem = SpmmProblem(spec.dtype, formats[a_name], (rows, cols), tuple((n, spec.ranks[n]) for n in spec.inputs),
                          a_name, b_name, bias, bias_dim, epilogue)
    return spmm_module(problem, target, accumulators)


def spmm_module(problem: SpmmProblem, target: CpuTarget = CpuTarget(), accumulators: int = ACCUMULATORS,
                function_name: str = KERNEL_NAME, b_aligned: bool = False) -> ir.Module:
    """The tiled SpMM module of ``problem`` in the current context.

    The function is the kernel (``KERNEL_NAME``: C interface, ``FILLS_OUTPUT``);
    another ``function_name`` makes it a private helper of a larger kernel
    (``native_linear``).  ``b_aligned``: the caller guarantees B starts at a
    ``B_ALIGNMENT`` boundary (its own scratch), so no copy is considered.
    """
    with ir.Location.unknown():
        module = ir.Module.create()
        element = ir.Type.parse(TYPE_NAMES[np.dtype(problem.dtype).name])
        lanes = target.vector_bits // 8 // np.dtype(problem.dtype).itemsize  # one vector register
        c_type = dynamic_matrix(element)
        with ir.InsertionPoint(module.body):
            kernel = func.FuncOp(function_name, ([*_parameter_types(problem, element), c_type], [c_type]),
                                 visibility=None if function_name == KERNEL_NAME else "private")
            if function_name == KERNEL_NAME:
                kernel.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
                kernel.attributes[FILLS_OUTPUT] = ir.UnitAttr.get()
            entry = kernel.add_entry_block()
            with ir.InsertionPoint(entry):
                _Kernel(problem, target, accumulators, element, lanes, entry.arguments, b_aligned).build()
            declare_thread_count()
            if problem.epilogue is not None:
                ranks = dict(problem.inputs)
                epilogue = problem.epilogue
                epilogue_functions(epilogue.expr, epilogue.temp, epilogue.i, epilogue.j,
                                   {name: ranks[name] for name in epilogue.operands}, element, lanes)
    module.operation.verify()
    return module


def _parameter_types(problem: SpmmProblem, element: ir.Type) -> list[ir.Type]:
    """The function's parameter types before C: A's three level buffers (positions and coordinates at their
    widths), then B, the bias and the epilogue's operands where ``problem.inputs`` puts them."""
    fmt = problem.fmt.codegen_format if problem.fmt.is_nm else problem.fmt
    level = len(fmt.levels) - 1
    assert fmt.buffer_names == (f"pos{level}", f"crd{level}", "values"), "one compressed level expected"
    types: list[ir.Type] = []
    for name, rank in problem.inputs:
        if name == problem.a:
            types += csr_levels(problem.fmt, element)
        elif name == problem.b:
            types.append(dynamic_matrix(element))
        elif name == problem.bias:
            types.append(dynamic_vector(element))
        else:
            assert problem.epilogue is not None and name in problem.epilogue.operands, \
                f"{name} is no operand of the SpMM"
            types.append(ir.MemRefType.get([ir.ShapedType.get_dynamic_size()] * rank, element))
    return types


class _Kernel:
    """The body of one tiled SpMM function, built at the insertion point from its arguments."""

    def __init__(self, problem: SpmmProblem, target: CpuTarget, accumulators: int, element: ir.Type, lanes: int,
                 arguments: Sequence[ir.Value], b_aligned: bool):
        self.problem, self.target, self.accumulators, self.lanes = problem, target, accumulators, lanes
        self.b_aligned = b_aligned
        self.element = element
        self.vector = ir.VectorType.get([lanes], element)
        self.mask_type = ir.VectorType.get([lanes], ir.IntegerType.get_signless(1))
        args = iter(arguments)
        self.operands: dict[str, ir.Value] = {}
        for name, _ in problem.inputs:
            if name == problem.a:
                pos, crd, val = next(args), next(args), next(args)
            else:
                self.operands[name] = next(args)
        self.c = next(args)
        self.b_in = self.operands[problem.b]
        self.bias = self.operands.get(problem.bias) if problem.bias is not None else None
        self.stream = _Stream(problem.fmt, problem.shape[1], pos, crd, val)
        self.panels = self.stream.nm is not None  # N:M rows are walked in panels of groups (``_rows_loop``)

    def build(self) -> None:
        """The function-wide values the rows share (sizes, the column tiers' bounds, zeros, the epilogue's
        vector end), then the threaded rows and the return of C."""
        problem, stream, c = self.problem, self.stream, self.c
        rows = index(problem.shape[0]) if problem.shape[0] is not None else memref.dim(c, index(0))
        stream.sizes(self.b_in)
        self.columns = memref.dim(c, index(1))
        # column tiers: tiles of `accumulators` vectors, then of 2, then of 1 (a short N still gets independent
        # FMA chains); each tier starts where the previous one ended
        self.spans, left = column_tiers(sorted({self.accumulators, 2, 1}, reverse=True), self.lanes, self.columns)
        # the last columns (fewer than a vector's lanes) as one masked vector; column by column, each walked the
        # row's nonzeros again (CSR 1536 x 384 at 10%, N=8: 0.25 ms, 2x scipy's time; N=16: 0.045)
        self.masked = (left, last_columns(left, self.columns))
        self.zero = constant_like(self.element, 0)
        self.zero_vector = constant_like(self.vector, 0)
        finish_row = None
        if problem.epilogue is not None:
            whole = arith.subi(self.columns, arith.remui(self.columns, index(self.lanes)))
            names = problem.epilogue.operands

            def finish_row(i: ir.Value, b: ir.Value) -> None:
                reads = [b if name == problem.b else self.operands[name] for name in names]
                _epilogue_pass(i, c, reads, self.lanes, whole, self.columns)

        _rows_loop(stream, self._row, self.columns, rows, np.dtype(problem.dtype).itemsize, self.target.panel_bytes,
                   finish_row, self.b_in, not self.b_aligned)
        func.ReturnOp([c])

    def _row(self, row: _Row, b: ir.Value, first: ir.Value | None) -> None:
        """Row ``row.i`` of C (its part in the current panel of B, N:M): the column tiers, the masked vector,
        the scalar last column."""
        bias_row = None
        if self.bias is not None and self.problem.bias_dim == 0:
            bias_i = memref.load(self.bias, [row.i])
            bias_row = (bias_i, vector.broadcast(self.vector, bias_i))
        for count, start, stop in self.spans:
            self._tiles(row, b, first, bias_row, count, start, stop)
        start, masked_end = self.masked
        self._tiles(row, b, first, bias_row, 1, start, masked_end, masked=True)
        for_each(masked_end, self.columns, lambda j: self._scalar_column(row, b, first, bias_row, j))

    def _tiles(self, row: _Row, b: ir.Value, first: ir.Value | None, bias_row: tuple[ir.Value, ir.Value] | None,
               count: int, start: ir.Value, stop: ir.Value, masked: bool = False) -> None:
        """Column tiles of ``count`` vectors from ``start`` to ``stop``: accumulate in registers, store once.

        The unrolled entries of an N:M group go to ``sets`` separate
        accumulator sets while registers allow, so their FMAs do not wait on
        each other; the sets are added up after the row.  ``masked``: one
        vector over the last columns (fewer than a vector's lanes), every
        load and the store masked to them.
        """
        entries = self.stream.nm.n if self.stream.nm else 1  # nonzeros per loop iteration
        # CSR rows take several nonzeros a step when the tile is narrow, so that its FMAs go to enough
        # accumulator sets not to wait on each other (N:M groups already unroll their n entries)
        unroll = 1 if self.panels else max(1, min(CSR_UNROLL, self.accumulators // count))
        sets = max(1, min(entries * unroll, self.accumulators // count))
        vec, zv, c, i = self.vector, self.zero_vector, self.c, row.i

        def tile(jj: ir.Value) -> None:
            js = [arith.addi(jj, index(u * self.lanes)) for u in range(count)]
            mask = vector.create_mask(self.mask_type, [arith.subi(self.columns, jj)]) if masked else None

            def load(buffer: ir.Value, at: list[ir.Value]) -> ir.Value:
                return vector.maskedload(vec, buffer, at, mask, zv) if masked else vector.load(vec, buffer, at)

            def seeds() -> list[ir.Value]:  # what the sums start from: zero or the bias
                if self.bias is None:
                    return [zv] * count
                if self.problem.bias_dim == 0:
                    return [bias_row[1]] * count
                return [load(self.bias, [j]) for j in js]

            if first is not None:  # later panels continue from the partial sums stored in C
                start_from = if_else(first, seeds, lambda: [load(c, [i, j]) for j in js], [vec] * count)
            else:
                start_from = seeds()

            def step(k: ir.Value, v: ir.Value, e: int, sums: list[ir.Value]) -> list[ir.Value]:
                s = e % sets
                broadcast = vector.broadcast(vec, v)
                sums = list(sums)
                for u in range(count):
                    sums[u * sets + s] = multiply_add(sums[u * sets + s], load(b, [k, js[u]]), broadcast)
                return sums

            sums = self.stream.loop(row, [start_from[u] if s == 0 else zv for u in range(count) for s in range(sets)],
                                    step, unroll)
            for u in range(count):
                total = sums[u * sets]
                for s in range(1, sets):
                    total = add(total, sums[u * sets + s])
                if masked:
                    vector.maskedstore(c, [i, js[u]], mask, total)
                else:
                    vector.store(total, c, [i, js[u]])

        for_each(start, stop, tile, index(count * self.lanes))

    def _scalar_column(self, row: _Row, b: ir.Value, first: ir.Value | None,
                       bias_row: tuple[ir.Value, ir.Value] | None, j: ir.Value) -> None:
        """Column ``j`` of row ``row.i``, one scalar sum."""
        c = self.c

        def seed() -> list[ir.Value]:
            if self.bias is None:
                return [self.zero]
            return [bias_row[0]] if self.problem.bias_dim == 0 else [memref.load(self.bias, [j])]

        start = if_else(first, seed, lambda: [memref.load(c, [row.i, j])], [self.element]) if first is not None \
            else seed()

        def step(k: ir.Value, v: ir.Value, e: int, sums: list[ir.Value]) -> list[ir.Value]:
            return [multiply_add(sums[0], memref.load(b, [k, j]), v)]

        memref.store(self.stream.loop(row, start, step)[0], c, [row.i, j])
