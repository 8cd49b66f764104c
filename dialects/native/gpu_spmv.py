"""CSR SpMV ``y[i] = A[i,j] * x[j]`` on the GPU: a group of lanes per row, and row splitting for skewed rows.

* ``spmv``: a row is a group of ``lanes`` threads (a power of two up to a
  warp, picked at launch from the mean row length: ``LaneRule``) that read
  the row's nonzeros contiguously and combine their partial sums with warp
  shuffles (a butterfly over the whole warp; offsets below the group size
  stay inside the group).
* ``spmv_split``: for skewed rows, thread ``t`` takes nonzeros
  ``[16 t, 16 t + 16)`` whatever rows they belong to, finds the row of its
  first one by binary search over the positions, walks them and adds each
  finished row's partial sum to ``y`` atomically (rows cut by a chunk
  border get several additions; ``y`` starts zeroed).  ``Launch.when``
  picks one of the two at launch; ``deterministic`` drops this one.

Shape-generic: no size is compiled in.  ``x`` and ``y`` are ``memref<?x..>``
(static when the build has shapes), the rows are ``y``'s size, and the
grids come from the call (``LaneRule.rows_of``: ``y``'s length;
``GridRule``: the stored entries), so one build per index widths takes
every size.  float16 data is summed in float32.  Built with the bindings'
op builders.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, gpu, math, memref, scf
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.native.gpu import BLOCK, WARP, NativeKernels
from sparse_mlir.dialects.native.gpu_build import (
    KernelModule,
    accumulator,
    as_float,
    buffer_refs,
    const,
    dense_type,
    float_type,
    global_thread,
    index_type,
    level_buffer_types,
    load_index,
    row_bounds,
    search,
    when,
)

from sparse_mlir.abi.gpu_program import GridRule, KernelArg, LaneRule, Launch
from sparse_mlir.dsl.patterns import spmv_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["SPLIT_CHUNK", "gpu_spmv"]

SPLIT_CHUNK = 16  # nonzeros per thread in the row-splitting SpMV
Shapes = dict[str, tuple[int | None, ...]]


def gpu_spmv(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, deterministic: bool = False
             ) -> NativeKernels | None:
    """CSR SpMV: the lanes-per-row kernel (and, unless ``deterministic``, the row-splitting one for skewed rows,
    whose atomic additions make float sums differ from run to run in their last bits); ``None`` unless floats."""
    found = spmv_operands(spec, formats)
    if found is None or spec.dtype.kind != "f":
        return None
    a, x = found
    rows, cols = shapes[a]
    elt, out = float_type(TYPE_NAMES[spec.dtype.name]), float_type(TYPE_NAMES[spec.output_dtype.name])
    refs = buffer_refs(spec, formats)
    args = (*(KernelArg("buffer", refs[a] + k, (None,)) for k in range(3)), KernelArg("buffer", refs[x], (cols,)),
            KernelArg("buffer", refs[spec.output], (rows,)))
    params = [*level_buffer_types(formats[a], elt), dense_type((cols,), elt), dense_type((rows,), out)]
    kernels = KernelModule()
    kernels.kernel("spmv", [*params, index_type()], _lanes_per_row)
    # the rows compiled in, or (shape-generic) the length of y at the call
    lanes = LaneRule(ref=args[1].ref, rows=rows, rows_of=None if rows is not None else args[-1].ref)
    split = not deterministic
    launches = (Launch("spmv", (1, 1, 1), (BLOCK, 1, 1), (*args, KernelArg("lanes", 0)), lanes=lanes,
                       when="balanced" if split else "", fills_output=True),)
    if split:  # skewed rows: fixed chunks of nonzeros per thread, partial row sums added atomically
        kernels.kernel("spmv_split", params, _split_rows)
        launches += (Launch("spmv_split", GridRule(ref=args[1].ref, per_block=BLOCK * SPLIT_CHUNK), (BLOCK, 1, 1),
                            args, when="skewed"),)
    return NativeKernels(kernels.module, launches)


def _product(val: ir.Value, crd: ir.Value, x: ir.Value, acc: ir.Type) -> Callable[[ir.Value, ir.Value], ir.Value]:
    """``sum + val[k] * x[crd[k]]`` in the accumulator type (one fused multiply-add)."""
    def step(k: ir.Value, total: ir.Value) -> ir.Value:
        a, xj = memref.load(val, [k]), memref.load(x, [load_index(crd, k)])
        return math.fma(as_float(a, acc), as_float(xj, acc), total)
    return step


def _lanes_per_row(pos: ir.Value, crd: ir.Value, val: ir.Value, x: ir.Value, y: ir.Value, lanes: ir.Value) -> None:
    """Thread ``t`` is lane ``t % lanes`` of row ``t / lanes``; lane 0 stores the group's sum."""
    acc = accumulator(ir.MemRefType(val.type).element_type)
    thread = global_thread()
    row, lane = arith.divui(thread, lanes), arith.remui(thread, lanes)
    valid = arith.cmpi(arith.CmpIPredicate.ult, row, memref.dim(y, const(0)))
    _, start, end = row_bounds(pos, row, valid)
    step = _product(val, crd, x, acc)
    loop = scf.ForOp(arith.addi(start, lane), end, lanes, [arith.constant(acc, 0.0)])
    with ir.InsertionPoint(loop.body):
        scf.YieldOp([step(loop.induction_variable, loop.inner_iter_args[0])])
    # butterfly over the warp: every lane takes part, offsets below the group size stay inside the group
    i32 = ir.IntegerType.get_signless(32)
    width, group = arith.constant(i32, WARP), arith.index_cast(i32, lanes)
    value = loop.results[0]
    for offset in (16, 8, 4, 2, 1):
        shift = arith.constant(i32, offset)
        other = gpu.ShuffleOp(value, shift, width, gpu.ShuffleMode.XOR).results[0]
        value = arith.select(arith.cmpi(arith.CmpIPredicate.ult, shift, group), arith.addf(value, other), value)
    leader = arith.cmpi(arith.CmpIPredicate.eq, lane, const(0))
    with when(arith.andi(valid, leader)):
        memref.store(as_float(value, ir.MemRefType(y.type).element_type), y, [row])


def _split_rows(pos: ir.Value, crd: ir.Value, val: ir.Value, x: ir.Value, y: ir.Value) -> None:
    """Thread ``t`` walks nonzeros ``[16 t, min(16 t + 16, nnz))``, adding each row's part to ``y`` atomically."""
    idx, acc = index_type(), accumulator(ir.MemRefType(val.type).element_type)
    out = ir.MemRefType(y.type).element_type
    rows, nnz = memref.dim(y, const(0)), memref.dim(crd, const(0))
    zero = arith.constant(acc, 0.0)
    first = arith.muli(global_thread(), const(SPLIT_CHUNK))
    last = arith.minui(arith.addi(first, const(SPLIT_CHUNK)), nnz)

    def flush(total: ir.Value, row: ir.Value) -> None:
        memref.atomic_rmw(arith.AtomicRMWKind.addf, as_float(total, out), y, [row])

    with when(arith.cmpi(arith.CmpIPredicate.ult, first, nnz)):
        # the row holding nonzero ``first``: the last r with pos[r] <= first (the first with pos[r] > first, less 1)
        row0 = arith.subi(search(pos, const(0), arith.addi(rows, const(1)), first, above=True), const(1))
        step = _product(val, crd, x, acc)
        walk = scf.ForOp(first, last, const(1), [zero, row0, load_index(pos, arith.addi(row0, const(1)))])
        with ir.InsertionPoint(walk.body):
            k = walk.induction_variable
            total, row, row_end = walk.inner_iter_args
            total = step(k, total)
            following = arith.addi(k, const(1))
            done = scf.IfOp(arith.cmpi(arith.CmpIPredicate.eq, following, row_end), [acc, idx, idx], has_else=True)
            with ir.InsertionPoint(done.then_block):
                flush(total, row)
                scf.YieldOp([zero, *_next_row(pos, rows, row, row_end, following)])
            with ir.InsertionPoint(done.else_block):
                scf.YieldOp([total, row, row_end])
            scf.YieldOp(list(done.results))
        total, row, _ = walk.results
        # what is left belongs to a row the chunk did not finish (a zero sum adds nothing)
        unfinished = arith.andi(arith.cmpf(arith.CmpFPredicate.ONE, total, zero),
                                arith.cmpi(arith.CmpIPredicate.ult, row, rows))
        with when(unfinished):
            flush(total, row)


def _next_row(pos: ir.Value, rows: ir.Value, row: ir.Value, row_end: ir.Value, k: ir.Value) -> list[ir.Value]:
    """``(row, end of row)`` of the next row holding nonzero ``k``, skipping empty rows (at most the last row)."""
    idx = index_type()
    loop = scf.WhileOp([idx, idx], [row, row_end])
    before = loop.before.blocks.append(idx, idx)
    with ir.InsertionPoint(before):
        r, e = before.arguments
        more = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, arith.addi(r, const(1)), rows),
                          arith.cmpi(arith.CmpIPredicate.ule, e, k))
        scf.ConditionOp(more, [r, e])
    after = loop.after.blocks.append(idx, idx)
    with ir.InsertionPoint(after):
        following = arith.addi(after.arguments[0], const(1))
        scf.YieldOp([following, load_index(pos, arith.addi(following, const(1)))])
    return list(loop.results)
