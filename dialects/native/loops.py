"""Small op-builder helpers the row-wise CPU emitters (``spmv``, ``sparse_add``, ``spgemm``, ``sddmm``) share: index constants and casts,
``scf`` loops that carry values, a one-dimensional ``scf.parallel``, workers claiming items (``by_workers``) and
their column stamps, ``scf.if`` with results, and arithmetic that picks the float or integer op from the element
type.

Why a module: each emitter otherwise grows its own copy of these few lines
(one idea, one piece of code).  Every helper builds at the current insertion
point and location, like the bindings' own builders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlir import ir
from mlir.dialects import arith, func, llvm, math, memref, scf, vector
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME

from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = [
    "HUGE_FROM_BYTES",
    "LINE_BYTES",
    "MADVISE",
    "SCHED_YIELD",
    "STAMP_COLUMNS",
    "THREAD_COUNT",
    "ColumnStamps",
    "RegisterTranspose",
    "add",
    "as_index",
    "bisect",
    "branch",
    "by_workers",
    "constant_like",
    "csr_levels",
    "csr_product_module",
    "declare_madvise",
    "declare_thread_count",
    "dynamic_matrix",
    "dynamic_vector",
    "each_claimed",
    "for_each",
    "if_else",
    "in_phases",
    "index",
    "is_float",
    "kernel_entry",
    "lane_sums",
    "level_types",
    "load_index",
    "lower_bound",
    "mul",
    "multiply_add",
    "parallel",
    "reduce_loop",
    "result_buffer",
    "store_index",
    "sub",
    "thread_count",
]


# a cache line, and one 512-bit vector: scratch whose rows are read as whole vectors starts on one (a vector load
# across two lines costs two loads: the tiled SpMM ran at half speed with B off a line)
LINE_BYTES = 64

# columns up to which a kernel may give each worker a stamp per column (``ColumnStamps``: 4 bytes each, 1 MiB)
STAMP_COLUMNS = 1 << 18

# a function an emitter may call (``() -> index``) for the threads its parallel loop will get: the CPU pipeline
# replaces each call with ``omp_get_max_threads()`` in a threaded build and with 1 otherwise
# (``lowering.rewrites.resolve_thread_count``), so a kernel can give each thread its own scratch
THREAD_COUNT = "sparse_mlir_thread_count"


def index(value: int) -> ir.Value:
    """An ``index`` constant."""
    return arith.constant(ir.IndexType.get(), value)


def as_index(value: ir.Value) -> ir.Value:
    """An unsigned integer (a position or coordinate of any width) as an ``index``."""
    return arith.index_castui(ir.IndexType.get(), value)


def load_index(buffer: ir.Value, at: ir.Value) -> ir.Value:
    """``buffer[at]`` (an integer buffer: positions or coordinates) as an ``index``."""
    return as_index(memref.load(buffer, [at]))


def store_index(value: ir.Value, buffer: ir.Value, at: ir.Value) -> None:
    """Store an ``index`` into an integer buffer of its own width (positions and coordinates)."""
    memref.store(arith.index_castui(ir.MemRefType(buffer.type).element_type, value), buffer, [at])


def dynamic_vector(element: ir.Type) -> ir.MemRefType:
    """``memref<?xelement>``."""
    return ir.MemRefType.get([ir.ShapedType.get_dynamic_size()], element)


def dynamic_matrix(element: ir.Type) -> ir.MemRefType:
    """``memref<?x?xelement>``."""
    return ir.MemRefType.get([ir.ShapedType.get_dynamic_size()] * 2, element)


def is_float(element: ir.Type) -> bool:
    """Whether ``element`` (a scalar or a vector type) holds floats."""
    if isinstance(element, ir.VectorType):
        element = element.element_type
    return isinstance(element, ir.FloatType)


def constant_like(element: ir.Type, value: float) -> ir.Value:
    """``value`` as a constant of a scalar or vector (splat) type, float or integer."""
    scalar = element.element_type if isinstance(element, ir.VectorType) else element
    attr = ir.FloatAttr.get(scalar, float(value)) if is_float(scalar) else ir.IntegerAttr.get(scalar, int(value))
    if isinstance(element, ir.VectorType):
        return arith.constant(element, ir.DenseElementsAttr.get_splat(element, attr))
    return arith.constant(element, attr)


def add(x: ir.Value, y: ir.Value) -> ir.Value:
    return arith.addf(x, y) if is_float(x.type) else arith.addi(x, y)


def sub(x: ir.Value, y: ir.Value) -> ir.Value:
    return arith.subf(x, y) if is_float(x.type) else arith.subi(x, y)


def mul(x: ir.Value, y: ir.Value) -> ir.Value:
    return arith.mulf(x, y) if is_float(x.type) else arith.muli(x, y)


def multiply_add(acc: ir.Value, b: ir.Value, v: ir.Value) -> ir.Value:
    """``v * b + acc`` (scalars or vectors of one type): one FMA for floats, a multiply and an add for integers."""
    if is_float(acc.type):
        return vector.fma(v, b, acc) if isinstance(acc.type, ir.VectorType) else math.fma(v, b, acc)
    return add(acc, mul(v, b))


MADVISE = "madvise"
SCHED_YIELD = "sched_yield"  # libc: ``in_phases`` gives its CPU away while it waits on a phase
MADV_HUGEPAGE = 14  # Linux's; elsewhere the call fails harmlessly (EINVAL) and the pages stay small
HUGE_FROM_BYTES = 4 << 20  # numpy's rule for its own arrays (it advises huge pages from 4 MiB)
PAGE_BYTES = 4096


def _declare(name: str, function_type: ir.FunctionType) -> None:
    """Declare the external function ``name`` (private: resolved at link time) at the insertion point."""
    func.FuncOp(name, function_type, visibility="private")


def _declare_in_module(name: str, function_type: ir.FunctionType) -> None:
    """``_declare`` in the module around the insertion point, unless ``name`` is there already."""
    operation = ir.InsertionPoint.current.block.owner
    while operation.name != "builtin.module":
        operation = operation.parent
    body = operation.regions[0].blocks[0]
    if any("sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == name
           for op in body.operations):
        return
    with ir.InsertionPoint.at_block_begin(body):
        _declare(name, function_type)


def declare_madvise() -> None:
    """Declare libc's ``madvise`` at the insertion point (a module's body), for ``result_buffer``."""
    ptr = ir.Type.parse("!llvm.ptr")
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    _declare(MADVISE, ir.FunctionType.get([ptr, i64, i32], [i32]))


def result_buffer(vector_type: ir.MemRefType, size: ir.Value) -> ir.Value:
    """``memref.alloc`` of a ``size``-element result buffer (``malloc``: the caller will own it) that asks for
    transparent huge pages when it is at least ``HUGE_FROM_BYTES``; the module must ``declare_madvise``.

    Large results are fresh ``mmap`` memory on every call, and each 4 KiB page faults on first touch: a SpGEMM
    writing 56 MB (rajat01 A @ A) spent about a third of its time in the page-fault path.  numpy advises huge
    pages for the same reason, so scipy did not pay it.
    """
    buffer = memref.alloc(vector_type, [size], [])
    element = vector_type.element_type
    bits = element.width if isinstance(element, (ir.IntegerType, ir.FloatType)) else 64  # index: 64 bits
    nbytes = arith.muli(size, index(max(1, bits // 8)))
    large = arith.cmpi(arith.CmpIPredicate.uge, nbytes, index(HUGE_FROM_BYTES))
    advise = scf.IfOp(large)
    with ir.InsertionPoint(advise.then_block):
        start = memref.extract_aligned_pointer_as_index(buffer)
        page = index(PAGE_BYTES)
        first = arith.muli(arith.divui(arith.addi(start, index(PAGE_BYTES - 1)), page), page)
        last = arith.muli(arith.divui(arith.addi(start, nbytes), page), page)
        i64 = ir.IntegerType.get_signless(64)
        pointer = llvm.inttoptr(ir.Type.parse("!llvm.ptr"), arith.index_cast(i64, first))
        func.call([ir.IntegerType.get_signless(32)], ir.FlatSymbolRefAttr.get(MADVISE),
                  [pointer, arith.index_cast(i64, arith.subi(last, first)),
                   arith.constant(ir.IntegerType.get_signless(32), MADV_HUGEPAGE)])
        scf.YieldOp([])
    return buffer


def lane_sums(vectors: Sequence[ir.Value]) -> ir.Value:
    """A vector whose lane ``e`` holds the sum of ``vectors[e]``'s lanes (a power of two of them, at most the
    lane count; the lanes past them are zero).

    A transposed reduction: each level halves the lanes an entry's partial sums take, packing two vectors into
    one with two shuffles and an add, so ``g`` sums take ``g - 1`` shuffle pairs (and one more for each level the
    group is short of the lanes) instead of ``g`` horizontal sums of ``log2(lanes)`` dependent steps each (the
    SDDMM's dot products).
    """
    vector_type = ir.VectorType(vectors[0].type)
    lanes = vector_type.shape[0]
    assert len(vectors) & (len(vectors) - 1) == 0 and len(vectors) <= lanes, "a power of two, at most the lanes"
    zero = constant_like(vector_type, 0)
    level, block = list(vectors), lanes  # each vector holds lanes // block entries, their partials in blocks
    while block > 1:
        half = block // 2
        low = [b * block + t for b in range(lanes // block) for t in range(half)]
        high = [lane + half for lane in low]
        pairs = [(level[e], level[e + 1] if e + 1 < len(level) else zero) for e in range(0, len(level), 2)]
        level = [add(vector.shuffle(x, y, low + [lanes + lane for lane in low]),
                      vector.shuffle(x, y, high + [lanes + lane for lane in high])) for x, y in pairs]
        block = half
    return level[0]


def for_each(lower: ir.Value, upper: ir.Value, body: Callable[[ir.Value], None], step: ir.Value | None = None) -> None:
    """``scf.for`` without carried values: ``body(index)``."""
    loop = scf.ForOp(lower, upper, step if step is not None else index(1))
    with ir.InsertionPoint(loop.body):
        body(loop.induction_variable)
        scf.YieldOp([])


def reduce_loop(lower: ir.Value, upper: ir.Value, inits: Sequence[ir.Value],
                body: Callable[[ir.Value, list[ir.Value]], Sequence[ir.Value]],
                step: ir.Value | None = None) -> list[ir.Value]:
    """``scf.for`` carrying values: ``body(index, values)`` returns the next values; returns the last ones."""
    loop = scf.ForOp(lower, upper, step if step is not None else index(1), list(inits))
    with ir.InsertionPoint(loop.body):
        scf.YieldOp(list(body(loop.induction_variable, list(loop.inner_iter_args))))
    return list(loop.results)


def parallel(upper: ir.Value, body: Callable[[ir.Value], None], step: ir.Value | None = None) -> None:
    """A one-dimensional ``scf.parallel`` from 0 (the CPU pipeline threads it, guided schedule)."""
    op = scf.ParallelOp([], [index(0)], [upper], [step if step is not None else index(1)], [])
    block = op.regions[0].blocks.append(ir.IndexType.get())
    with ir.InsertionPoint(block):
        body(block.arguments[0])
        scf.ReduceOp([], 0)


def if_else(condition: ir.Value, then: Callable[[], Sequence[ir.Value]],
            otherwise: Callable[[], Sequence[ir.Value]], types: Sequence[ir.Type]) -> list[ir.Value]:
    """``scf.if`` with an else branch; each branch returns the values it yields (of ``types``)."""
    op = scf.IfOp(condition, list(types), has_else=True)
    with ir.InsertionPoint(op.then_block):
        scf.YieldOp(list(then()))
    with ir.InsertionPoint(op.else_block):
        scf.YieldOp(list(otherwise()))
    return list(op.results)


def branch(condition: ir.Value, then: Callable[[], object], otherwise: Callable[[], object]) -> None:
    """``scf.if`` with an else branch and no results: ``then()`` or ``otherwise()`` emits each side's ops."""
    def run(side: Callable[[], object]) -> list[ir.Value]:
        side()  # what it returns (an op, say) is not yielded
        return []

    if_else(condition, lambda: run(then), lambda: run(otherwise), [])


def level_types(fmt: Format, element: ir.Type) -> list[ir.Type]:
    """The ``memref<?x...>`` of each buffer of ``fmt``'s codegen format, in the kernel signature's order
    (positions and coordinates at their widths, 0 meaning ``index``: 64 bits; the values of ``element``)."""
    types = []
    for name in fmt.codegen_format.buffer_names:
        if name == "values":
            types.append(dynamic_vector(element))
        else:
            width = (fmt.pos_width if name.startswith("pos") else fmt.crd_width) or 64
            types.append(dynamic_vector(ir.IntegerType.get_signless(width)))
    return types


def each_claimed(counter: ir.Value, limit: ir.Value, body: Callable[[ir.Value], None],
                 slot: ir.Value | None = None) -> ir.Value:
    """``body(item)`` for each item ``counter[slot]`` (an ``i64``, slot 0 by default) hands out, by an atomic
    fetch-and-add of 1, until it reaches ``limit``: workers that share ``counter`` split the items dynamically,
    however late one starts.  Returns how many items this worker ran (``in_phases`` publishes it)."""
    i_type = ir.IndexType.get()
    loop = scf.WhileOp([i_type, i_type], [index(0)])
    head = loop.before.blocks.append(i_type)
    with ir.InsertionPoint(head):
        one = arith.constant(ir.IntegerType.get_signless(64), 1)
        item = arith.index_castui(i_type, memref.AtomicRMWOp(arith.AtomicRMWKind.addi, one, counter,
                                                             [slot if slot is not None else index(0)]).result)
        scf.ConditionOp(arith.cmpi(arith.CmpIPredicate.ult, item, limit), [item, head.arguments[0]])
    step = loop.after.blocks.append(i_type, i_type)
    with ir.InsertionPoint(step):
        body(step.arguments[0])
        scf.YieldOp([arith.addi(step.arguments[1], index(1))])
    return loop.results[1]


def by_workers(items: ir.Value, body: Callable[[ir.Value, Any], None], setup: Callable[[], Any] = lambda: None,
               teardown: Callable[[Any], None] = lambda state: None) -> None:
    """``body(item, state)`` for items ``0..items``, by one worker per thread (``THREAD_COUNT``: the module
    must declare it), each with its own ``state = setup()`` (``teardown(state)`` after), claiming items from a
    shared counter (``each_claimed``): ``in_phases`` with one phase.

    For scratch that costs more to set up than an item does to compute
    (``ColumnStamps``: zeroed once per worker, not once per item), where a
    parallel loop over the items would set it up in every iteration.  The
    counter balances the items as a guided schedule does, and a worker that
    starts late finds them taken.
    """
    in_phases([(items, body)], setup, teardown)


# ``i64`` counters per cache line: ``in_phases`` gives each counter a line of its own, so the workers claiming a
# phase's items do not contend with one spinning on the phase's done count
_COUNTERS_PER_LINE = LINE_BYTES // 8


def in_phases(phases: Sequence[tuple[ir.Value, Callable[[ir.Value, Any], None]]],
              setup: Callable[[], Any] = lambda: None, teardown: Callable[[Any], None] = lambda state: None) -> None:
    """Items ``0..count`` of each ``(count, body)`` phase in turn, ``body(item, state)`` each, all inside one
    parallel region of one worker per thread (``THREAD_COUNT``: the module must declare it), each worker with
    its own ``state = setup()`` (``teardown(state)`` after): a worker claims a phase's items from a shared
    counter (``each_claimed``), adds how many it ran to the phase's done count, and spins until that count
    reaches ``count`` before it starts on the next phase, yielding its CPU between looks (``SCHED_YIELD``).

    Why one region, not a parallel loop per phase: every region waits again
    for workers that sleep between calls (``KMP_BLOCKTIME=0``, torch's
    operators in between, or a call after the blocktime).  No barrier
    either: the pool closes a region's team at its first one, and a worker
    that wakes late must still find work.  Here it joins wherever items are
    left.  A phase waits only for items already claimed, which workers are
    running (none of them waits inside an item), so the wait is short and
    cannot deadlock, even when the runtime runs every worker on one thread;
    the yield lets a worker that was preempted onto the waiting thread's CPU
    finish its item (a pure spin made session 14's in-kernel barriers stall
    for milliseconds behind a queued worker).
    """
    if len(phases) > 1:
        _declare_in_module(SCHED_YIELD, ir.FunctionType.get([], [ir.IntegerType.get_signless(32)]))
    i64 = ir.IntegerType.get_signless(64)
    zero = arith.constant(i64, 0)
    lines = _COUNTERS_PER_LINE
    # a line per phase's claim counter, and one per done count of every phase but the last (none waits on it)
    counters = memref.alloc(dynamic_vector(i64), [index((2 * len(phases) - 1) * lines)], [], alignment=LINE_BYTES)
    claimed = [index(2 * lines * p) for p in range(len(phases))]
    done = [index(2 * lines * p + lines) for p in range(len(phases) - 1)]
    for slot in claimed + done:
        memref.store(zero, counters, [slot])
    most = phases[0][0]
    for count, _ in phases[1:]:
        most = arith.maxui(most, count)

    def worker(_: ir.Value) -> None:
        state = setup()
        for p, (count, body) in enumerate(phases):
            ran = each_claimed(counters, count, lambda item, body=body: body(item, state), claimed[p])
            if p + 1 < len(phases):
                memref.atomic_rmw(arith.AtomicRMWKind.addi, arith.index_castui(i64, ran), counters, [done[p]])
                wait = scf.WhileOp([], [])
                with ir.InsertionPoint(wait.before.blocks.append()):
                    finished = memref.atomic_rmw(arith.AtomicRMWKind.addi, zero, counters, [done[p]])  # a read
                    scf.ConditionOp(arith.cmpi(arith.CmpIPredicate.ult,
                                               arith.index_castui(ir.IndexType.get(), finished), count), [])
                with ir.InsertionPoint(wait.after.blocks.append()):
                    func.call([ir.IntegerType.get_signless(32)], ir.FlatSymbolRefAttr.get(SCHED_YIELD), [])
                    scf.YieldOp([])
        teardown(state)

    parallel(arith.maxui(arith.minui(thread_count(), most), index(1)), worker)
    memref.dealloc(counters)


class ColumnStamps:
    """A worker's ``i32`` stamp per column, zeroed once: row ``i``'s tag is ``i + 1``, so a column whose stamp
    is the row's tag has been seen in this row, and nothing is cleared between rows.

    The alternative, a bitmap, is read, or-ed and stored per entry, and the
    next entry (often a neighbouring column: the same word) waits for that
    store, a chain through memory; the stamps' loads and stores depend on
    nothing but a repeated column.  SpGEMM's symbolic pass took 1.4-2.7x
    the stamps' time with a bitmap (C, SuiteSparse matrices).  Needs fewer
    than ``LAST_TAG`` rows.
    """

    LAST_TAG = 2**31 - 1

    @staticmethod
    def pay_off(n_cols: ir.Value, work: ir.Value, n_rows: ir.Value) -> ir.Value:
        """Whether stamps serve a kernel of ``n_cols`` columns, ``work`` entries to visit and ``n_rows`` rows
        (an ``i1``): columns up to ``STAMP_COLUMNS`` (1 MiB of stamps a worker) and up to the work (zeroing
        them must cost less than the rows they serve), rows below ``LAST_TAG``."""
        within = arith.andi(arith.cmpi(arith.CmpIPredicate.ule, n_cols, index(STAMP_COLUMNS)),
                            arith.cmpi(arith.CmpIPredicate.ule, n_cols, work))
        return arith.andi(within, arith.cmpi(arith.CmpIPredicate.ult, n_rows, index(ColumnStamps.LAST_TAG)))

    def __init__(self, n_cols: ir.Value) -> None:
        self.i32 = ir.IntegerType.get_signless(32)
        self.stamps = memref.alloc(dynamic_vector(self.i32), [n_cols], [])
        zero = arith.constant(self.i32, 0)
        for_each(index(0), n_cols, lambda j: memref.store(zero, self.stamps, [j]))

    def tag(self, row: ir.Value) -> ir.Value:
        return arith.index_castui(self.i32, arith.addi(row, index(1)))

    def stamp(self, j: ir.Value, tag: ir.Value) -> None:
        memref.store(tag, self.stamps, [j])

    def holds(self, j: ir.Value, tag: ir.Value) -> ir.Value:
        """Whether column ``j`` carries ``tag`` (an ``i1``)."""
        return arith.cmpi(arith.CmpIPredicate.eq, memref.load(self.stamps, [j]), tag)

    def renew(self, j: ir.Value, tag: ir.Value) -> ir.Value:
        """Whether column ``j`` is new to the row of ``tag`` (an ``i1``); stamps it, without a branch."""
        new = arith.cmpi(arith.CmpIPredicate.ne, memref.load(self.stamps, [j]), tag)
        self.stamp(j, tag)
        return new

    def free(self) -> None:
        memref.dealloc(self.stamps)


def thread_count() -> ir.Value:
    """A call of ``THREAD_COUNT`` (the threads the kernel's parallel loops get); the module must declare it
    (``declare_thread_count``)."""
    return func.call([ir.IndexType.get()], ir.FlatSymbolRefAttr.get(THREAD_COUNT), [])


def declare_thread_count() -> None:
    """Declare ``THREAD_COUNT`` at the insertion point (a module's body)."""
    _declare(THREAD_COUNT, ir.FunctionType.get([], [ir.IndexType.get()]))


def bisect(lo: ir.Value, hi: ir.Value, before: Callable[[ir.Value], ir.Value]) -> ir.Value:
    """The first ``k`` in ``[lo, hi)`` that ``before(k)`` (an ``i1``, true for a prefix of the range) is false
    for, else ``hi``: a binary search of ``log2(hi - lo)`` steps (CPU and GPU builders alike)."""
    i_type = ir.IndexType.get()
    loop = scf.WhileOp([i_type, i_type], [lo, hi])
    head = loop.before.blocks.append(i_type, i_type)
    with ir.InsertionPoint(head):
        left, right = head.arguments
        scf.ConditionOp(arith.cmpi(arith.CmpIPredicate.ult, left, right), [left, right])
    body = loop.after.blocks.append(i_type, i_type)
    with ir.InsertionPoint(body):
        left, right = body.arguments
        mid = arith.addi(left, arith.divui(arith.subi(right, left), index(2)))
        go_right = before(mid)
        scf.YieldOp([arith.select(go_right, arith.addi(mid, index(1)), left), arith.select(go_right, right, mid)])
    return loop.results[0]


def lower_bound(buffer: ir.Value, lo: ir.Value, hi: ir.Value, value: ir.Value) -> ir.Value:
    """The first ``p`` in ``[lo, hi)`` with ``buffer[p] >= value`` (``hi`` if none) in an ascending integer
    buffer (positions): ``value`` is an ``index``."""
    return bisect(lo, hi, lambda mid: arith.cmpi(arith.CmpIPredicate.ult, load_index(buffer, mid), value))


def csr_levels(fmt: Format, element: ir.Type) -> list[ir.Type]:
    """The memref types of a CSR tensor's positions, coordinates and values (a width of 0 is ``index``: 64 bits)."""
    widths = (fmt.pos_width or 64, fmt.crd_width or 64)
    return [dynamic_vector(t) for t in (*(ir.IntegerType.get_signless(w) for w in widths), element)]


def kernel_entry(inputs: Sequence[str], types: dict[str, Sequence[ir.Type]], outputs: Sequence[ir.Type],
                    results: Sequence[ir.Type], fills_output: bool = False
                    ) -> tuple[ir.Block, dict[str, list[ir.Value]], list[ir.Value]]:
    """The kernel function at the insertion point (a module's body), with the signature the sparse assembler
    would give: ``KERNEL_NAME`` with a C interface, taking each of ``inputs``' buffers (``types``, by name) and
    then ``outputs`` (dense results the caller passes in), returning ``results``.

    ``fills_output`` marks a kernel that stores every element of its dense
    result itself (``FILLS_OUTPUT``), so its C entry point skips zeroing
    it.  Returns the entry block, each input's arguments by name and the
    outputs' arguments.
    """
    fn = func.FuncOp(KERNEL_NAME, ([t for name in inputs for t in types[name]] + list(outputs), list(results)))
    fn.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
    if fills_output:
        fn.attributes[FILLS_OUTPUT] = ir.UnitAttr.get()
    block = fn.add_entry_block()
    arguments = iter(block.arguments)
    buffers = {name: [next(arguments) for _ in types[name]] for name in inputs}
    return block, buffers, list(arguments)


def csr_product_module(spec: KernelSpec, formats: dict[str, Format],
                       body: Callable[[dict[str, list[ir.Value]], ir.Type, list[ir.Type]], Sequence[ir.Value]],
                       uses_thread_count: bool = False) -> ir.Module:
    """A kernel module with the sparse assembler's signature over CSR operands and a CSR result: every input's
    level buffers in, the result's out (allocated by the kernel, ``result_buffer``; the C entry point hands them
    to the caller).

    ``body(buffers by input name, element type, result types)`` builds the function's body and returns the
    result's buffers; ``uses_thread_count`` declares ``THREAD_COUNT`` for it.  Shared by the emitters whose
    operands and result are all CSR (SpGEMM, the sparse add).
    """
    element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
    types = {name: csr_levels(formats[name], element) for name in spec.inputs}
    out_types = csr_levels(formats[spec.output], element)
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
        declare_madvise()  # for ``result_buffer``
        if uses_thread_count:
            declare_thread_count()
        block, buffers, _ = kernel_entry(spec.inputs, types, [], out_types)
        with ir.InsertionPoint(block):
            func.ReturnOp(list(body(buffers, element, out_types)))
    module.operation.verify()
    return module


class RegisterTranspose:
    """Transposes between memrefs in ``tile x tile`` register tiles (butterflies of shuffles inside both memrefs,
    a masked ``vector.transpose`` at their edges), for the kernels that
    need a transposed operand in scratch (the Linear layer's ``X^T`` and ``Y``, the SDDMM's ``B^T``).

    A scalar transpose writes each element to another cache line (7 ns
    an element for a column of B at an 8-16 KiB stride); a register tile
    reads and writes whole vectors.  Its constants are built at the
    insertion point of the constructor.
    """

    def __init__(self, element: ir.Type, tile: int):
        index = ir.IndexType.get()
        self.c0, self.c1 = arith.constant(index, 0), arith.constant(index, 1)
        self.tile = tile
        self.step = arith.constant(index, tile)
        self.pad = arith.constant(element, 0.0 if isinstance(element, ir.FloatType) else 0)
        self.square = ir.VectorType.get([tile, tile], element)
        self.identity = ir.AffineMapAttr.get(ir.AffineMap.get_minor_identity(2, 2))
        self.masked = ir.ArrayAttr.get([ir.BoolAttr.get(False)] * 2)  # not in bounds: edge tiles are masked
        self.unmasked = ir.ArrayAttr.get([ir.BoolAttr.get(True)] * 2)

    def _inside(self, corners: Sequence[tuple[ir.Value, ir.Value, ir.Value]]) -> ir.Value:
        """Whether the tile at each ``(memref, row, col)`` lies inside that memref: such tiles are read and written
        without masks (a masked tile computes a mask for each of its rows)."""
        inside = None
        for buffer, row, col in corners:
            for dim, at in ((0, row), (1, col)):
                fits = arith.cmpi(arith.CmpIPredicate.ule, arith.addi(at, self.step), memref.dim(buffer, index(dim)))
                inside = fits if inside is None else arith.andi(inside, fits)
        return inside

    def _interior(self, src: ir.Value, dst: ir.Value, src_row: ir.Value, src_col: ir.Value, dst_row: ir.Value,
                  dst_col: ir.Value, addend: ir.Value | None) -> None:
        """One tile inside both memrefs, transposed by butterflies: at each of log2(tile) stages, rows ``a`` and
        ``a + d`` swap the halves of their ``2d``-lane blocks (two two-source shuffles), ``tile * log2(tile)``
        shuffles in all.  Measured against ``vector.transpose`` of an unmasked tile on the Linear kernel
        (4096 x 384, 10% CSR, 2 threads): 1.36-1.46 ms before, 1.26-1.34 ms after."""
        row_type = ir.VectorType.get([self.tile], self.square.element_type)
        rows = [vector.load(row_type, src, [arith.addi(src_row, index(t)), src_col]) for t in range(self.tile)]
        distance = self.tile // 2
        while distance:
            low = [lane if lane & distance == 0 else self.tile + lane - distance for lane in range(self.tile)]
            high = [lane + distance if lane & distance == 0 else self.tile + lane for lane in range(self.tile)]
            for a in range(self.tile):
                if a & distance == 0:
                    rows[a], rows[a + distance] = (vector.shuffle(rows[a], rows[a + distance], low),
                                                   vector.shuffle(rows[a], rows[a + distance], high))
            distance //= 2
        for t, row in enumerate(rows):
            at = [arith.addi(dst_row, index(t)), dst_col]
            if addend is not None:
                row = add(row, vector.load(row_type, addend, at))
            vector.store(row, dst, at)

    def transpose(self, src: ir.Value, dst: ir.Value, rows: ir.Value, cols: ir.Value, parallel: bool,
                  src_row: ir.Value | None = None, dst_row: ir.Value | None = None,
                  src_rows_outside: bool = False, addend: ir.Value | None = None) -> None:
        """``dst[dst_row + k, r] = src[src_row + r, k]`` (``+ addend[dst_row + k, r]``, a memref shaped like
        dst: the Linear kernels' residual) for ``r < rows``, ``k < cols``, in ``tile x tile``
        register tiles (tiles of dst's rows in parallel or not: with ``K = 64`` the rows of src made 4 parallel
        iterations, and B's transpose took 0.10 ms at 1 and 2 threads, 0.053 at 2 after; tiles past either memref's
        end are masked).

        Which loop is outside decides which memref is walked along its rows.
        By default tiles of dst's rows are: each of them is written whole,
        and src is read a tile's width down its rows, ``tile`` of them at a
        time.  ``src_rows_outside`` (serial only) reverses that, for a src
        in memory and a dst in cache: the Linear kernel's ``X``, 4096 rows of
        6 KiB for a MiniLM FFN, was read 128 rows (128 pages) at a time
        into an L2-sized ``X^T``; reading 16 rows along their length instead
        took the 1536 -> 384 layer (4096 rows, 90%, 1 thread) from 11.2-11.5
        to 10.6 ms.
        """
        index = ir.IndexType.get()
        outer = rows if src_rows_outside else cols
        if parallel:  # tiles of dst's rows (src's columns) outside: each writes whole lines of dst
            if src_rows_outside:
                raise ValueError("a parallel transpose splits dst's rows")
            loop = scf.ParallelOp([], [self.c0], [outer], [self.step], [])
            body = loop.regions[0].blocks.append(index)
        else:
            loop = scf.ForOp(self.c0, outer, self.step)
            body = loop.body
        with ir.InsertionPoint(body):
            self.outer_step(src, dst, rows, cols, body.arguments[0], src_row, dst_row, src_rows_outside, addend)
            if parallel:
                scf.ReduceOp([], 0)
            else:
                scf.YieldOp([])

    def outer_step(self, src: ir.Value, dst: ir.Value, rows: ir.Value, cols: ir.Value, at: ir.Value,
                   src_row: ir.Value | None = None, dst_row: ir.Value | None = None,
                   src_rows_outside: bool = False, addend: ir.Value | None = None) -> None:
        """One step of ``transpose``'s outer loop, the ``tile`` rows of dst (of src when ``src_rows_outside``)
        from ``at``: for a caller that hands the steps out itself (``in_phases``)."""
        inner = cols if src_rows_outside else rows
        tiles = scf.ForOp(self.c0, inner, self.step)
        with ir.InsertionPoint(tiles.body):
            r, k = at, tiles.induction_variable
            if not src_rows_outside:
                r, k = k, r
            write_row = k if dst_row is None else arith.addi(dst_row, k)
            read_row = r if src_row is None else arith.addi(src_row, r)
            inside = self._inside([(src, read_row, k), (dst, write_row, r)])
            whole = scf.IfOp(inside, [], has_else=True)
            with ir.InsertionPoint(whole.then_block):
                self._interior(src, dst, read_row, k, write_row, r, addend)
                scf.YieldOp([])
            with ir.InsertionPoint(whole.else_block):
                tile_in = vector.transfer_read(self.square, src, [read_row, k], self.identity, self.pad,
                                               self.masked)
                tile_out = vector.transpose(self.square, tile_in, [1, 0])
                if addend is not None:
                    tile_out = add(tile_out, vector.transfer_read(self.square, addend, [write_row, r],
                                                                  self.identity, self.pad, self.masked))
                vector.transfer_write(None, tile_out, dst, [write_row, r], self.identity, self.masked)
                scf.YieldOp([])
            scf.YieldOp([])
