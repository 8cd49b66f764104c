"""Two sparse Linear layers in one kernel: ``Y[b,p] = W2[p,o] * f(X[b,i] * W1[o,i], ...) (+ bias[p]) (+ R[b,p])``.

A transformer's feed-forward block (``W1``, GELU, ``W2``) run as two
``native_linear`` kernels writes its hidden activations (4096 x 1536 floats,
25 MB for a MiniLM batch) to memory, transposed back to rows, then reads
them again and transposes them into the second layer's scratch.  Here the
batch runs in the Linear kernel's blocks (``linear.batch_blocks``), and in
each block the first SpMM's result, ``f`` applied in its epilogue, is
already the second SpMM's ``B`` operand in the layout it wants: it stays in
an L2-sized scratch, never transposed, never in memory.  Both SpMMs are the
tiled ``spmm_module`` (CSR or N:M, each weight its own format), as private
functions.  MiniLM's FFN at 90% (4096 rows, 1 thread, session 16):
23.5-24.8 ms as two layers, 18.9-19.3 ms fused (2:4: 72-73 and 63-65).
The hidden width is compiled in (the kernel is built per weight shape).
The kernel function is built with the MLIR bindings' op builders.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, func, memref
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.epilogue import Epilogue
from sparse_mlir.dialects.native import lane_select, row_select
from sparse_mlir.dialects.native.linear import batch_blocks, kernel_function
from sparse_mlir.dialects.native.loops import LINE_BYTES, RegisterTranspose, branch, by_workers, dynamic_matrix
from sparse_mlir.dialects.native.spmm import ACCUMULATORS, SpmmProblem, spmm_module
from sparse_mlir.dialects.native.target import CpuTarget
from sparse_mlir.dsl.patterns import Mlp, mlp_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["native_mlp"]

_FIRST, _SECOND = "mlp_first", "mlp_second"
_HIDDEN = "_hidden"  # the second SpMM's B: the first one's result, through ``f``


def native_mlp(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
               target: CpuTarget = CpuTarget()) -> ir.Module | None:
    """The fused two-layer module for ``spec`` in the current context, or ``None`` when it does not apply (not an
    ``Mlp``, or a weight's shape unknown at build time)."""
    found = mlp_operands(spec, formats)
    if found is None or None in (*shapes[found.w1], *shapes[found.w2]):
        return None
    if all(lane_select.applies(formats[w], spec.dtype, target) for w in (found.w1, found.w2)):
        return _lane_module(spec, formats, shapes, found, target)
    xt = spec.stages[0].result
    first = SpmmProblem(spec.dtype, formats[found.w1], shapes[found.w1],
                        ((found.w1, 2), (xt, 2), *((name, 1) for name in found.operands)), found.w1, xt,
                        epilogue=Epilogue(found.middle, found.t0, found.o, found.b, found.operands))
    second = SpmmProblem(spec.dtype, formats[found.w2], shapes[found.w2],
                         ((found.w2, 2), (_HIDDEN, 2), *(((found.bias, 1),) if found.bias else ())), found.w2, _HIDDEN,
                         found.bias, 0 if found.bias else -1)
    # both SpMMs (the first with its epilogue functions), then the kernel that calls them goes in before them
    module = spmm_module(first, target, function_name=_FIRST, b_aligned=True)
    _merge(module, spmm_module(second, target, function_name=_SECOND, b_aligned=True))
    with ir.Location.unknown(), ir.InsertionPoint.at_block_begin(module.body):
        _kernel(spec, formats, shapes, found, first, second, target.vector_bits)
    module.operation.verify()
    return module


def _lane_module(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                 found: Mlp, target: CpuTarget) -> ir.Module:
    """Both N:M layers with features across lanes (``lane_select``): per block of batch rows (as many as
    ``lane_select.rows_per_block`` gives the hidden width), claimed by one worker per thread,
    ``H = f(X W1^T)`` into the worker's hidden scratch (rows of ``H``: already the second product's ``X``),
    then ``Y = H W2^T`` (+ bias, + residual) in place."""
    element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
    index = ir.IndexType.get()
    lanes = target.vector_bits // 8 // spec.dtype.itemsize
    module = lane_select.kernel_module(Epilogue(found.middle, found.t0, found.b, found.o, found.operands), element,
                                       lanes)
    sparse = {found.w1: formats[found.w1], found.w2: formats[found.w2]}
    with ir.Location.unknown(), ir.InsertionPoint.at_block_begin(module.body):
        block, values = kernel_function(spec, sparse, {found.x, found.residual} - {None}, element)
        (x,), y = values[found.x], block.arguments[-1]
        with ir.InsertionPoint(block):
            c0, c1 = arith.constant(index, 0), arith.constant(index, 1)
            batch, inputs = memref.dim(x, c0), memref.dim(x, c1)
            hidden = arith.constant(index, shapes[found.w1][0])
            rows = arith.constant(index, shapes[found.w2][0])
            first_finish = lane_select.Finish(epilogue=True, operands=[values[name][0] for name in found.operands])
            second_finish = lane_select.Finish(bias=values[found.bias][0] if found.bias else None,
                                               residual=values[found.residual][0] if found.residual else None)
            matrix = dynamic_matrix(element)

            def repacked() -> None:
                first_w = lane_select.PackedWeight(formats[found.w1], values[found.w1][1], values[found.w1][2],
                                                   hidden, inputs, element, lanes)
                second_w = lane_select.PackedWeight(formats[found.w2], values[found.w2][1], values[found.w2][2],
                                                    rows, hidden, element, lanes)
                first = lane_select.LaneProduct(first_w, element, first_finish)
                second = lane_select.LaneProduct(second_w, element, second_finish)
                block_rows = lane_select.balanced_blocks(batch, lane_select.rows_per_block(hidden, element))
                byte_type = ir.MemRefType.get([ir.ShapedType.get_dynamic_size()], ir.IntegerType.get_signless(8))

                def allocate() -> ir.Value:
                    size = arith.muli(arith.muli(block_rows, hidden), arith.constant(index, spec.dtype.itemsize))
                    return memref.alloc(byte_type, [size], [], alignment=LINE_BYTES)

                def rows_block(item: ir.Value, scratch: ir.Value) -> None:
                    row = arith.muli(item, block_rows)
                    count = arith.minui(block_rows, arith.subi(batch, row))
                    h = memref.view(matrix, scratch, c0, [count, hidden])
                    first.product(x, row, h, c0, count, c0, first_w.chunks)
                    second.product(h, c0, y, row, count, c0, second_w.chunks)

                by_workers(arith.ceildivui(batch, block_rows), rows_block, allocate, memref.dealloc)
                first_w.free()
                second_w.free()

            def layer_by_layer(linear: Callable[..., None]) -> None:
                """A batch of one block: each layer over chunks of its features (``linear``: ``W`` read as stored,
                or packed chunk by chunk where it is used), the whole batch's hidden rows in one scratch between
                them."""
                h = memref.alloc(matrix, [batch, hidden], [], alignment=LINE_BYTES)
                for w, out_rows, finish, source, dest in ((found.w1, hidden, first_finish, x, h),
                                                          (found.w2, rows, second_finish, h, y)):
                    linear(formats[w], values[w][1], values[w][2], out_rows, element, lanes, finish, source, dest,
                           batch)
                memref.dealloc(h)

            def past_small() -> None:
                block_rows = arith.minui(lane_select.rows_per_block(inputs, element),
                                         lane_select.rows_per_block(hidden, element))
                branch(arith.cmpi(arith.CmpIPredicate.ule, batch, block_rows),
                       lambda: layer_by_layer(lane_select.linear_by_chunks), repacked)

            row_select.by_batch_size(batch, [formats[found.w1], formats[found.w2]],
                                     lambda: layer_by_layer(row_select.linear_as_stored), past_small)
            func.ReturnOp([y])
    module.operation.verify()
    return module


def _merge(into: ir.Module, other: ir.Module) -> None:
    """Every function of ``other`` whose name ``into`` lacks, cloned into ``into`` (both declare the thread count
    function)."""
    names = {op.attributes["sym_name"].value for op in into.body.operations}
    for op in other.body.operations:
        if op.attributes["sym_name"].value not in names:
            op.operation.clone(ip=ir.InsertionPoint(into.body))


def _kernel(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]], found: Mlp,
            first: SpmmProblem, second: SpmmProblem, vector_bits: int) -> None:
    """The kernel function at the insertion point: ``Y`` block by block of the batch, each block through
    ``X^T``, the first SpMM into the hidden scratch, the second into ``T`` and ``T^T`` into ``Y``."""
    element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
    index = ir.IndexType.get()
    matrix = dynamic_matrix(element)
    sparse = {found.w1: formats[found.w1], found.w2: formats[found.w2]}
    block, values = kernel_function(spec, sparse, {found.x, found.residual} - {None}, element)
    (x_value,), y = values[found.x], block.arguments[-1]
    addend = values[found.residual][0] if found.residual is not None else None
    tile = vector_bits // 8 // spec.dtype.itemsize
    with ir.InsertionPoint(block):
        tiles = RegisterTranspose(element, tile)
        batch, inputs = memref.dim(x_value, tiles.c0), memref.dim(x_value, tiles.c1)
        hidden = arith.constant(index, shapes[found.w1][0])
        rows = arith.constant(index, shapes[found.w2][0])

        def arguments(problem: SpmmProblem, b_value: ir.Value) -> list[ir.Value]:
            return [v for name, _ in problem.inputs for v in ([b_value] if name == problem.b else values[name])]

        def both(xt: ir.Value, t: ir.Value, extra: list[ir.Value]) -> None:
            """``h = f(W1 @ xt)``, ``t = W2 @ h`` (+ bias), ``h`` the hidden scratch of the block."""
            (h,) = extra
            func.CallOp([matrix], _FIRST, [*arguments(first, xt), h])
            func.CallOp([matrix], _SECOND, [*arguments(second, h), t])

        batch_blocks(tiles, matrix, x_value, y, batch, inputs, rows, both, tile * ACCUMULATORS, spec.dtype.itemsize,
                     [hidden], addend)
        func.ReturnOp([y])
