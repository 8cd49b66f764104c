"""The Linear orientation ``Y[b,o] = X[b,i] * W[o,i] (+ bias)``, CSR or N:M ``W``: transpose, tiled SpMM, transpose.

This is ``torch.nn.Linear`` with a sparse weight (``SparseLinear``).  The
planner already lays it out as ``XT = X^T``, ``T = W @ XT`` and ``Y = T^T``
so every inner loop is contiguous, but the sparsifier then runs the middle
stage as a generic loop nest (6x slower than ``native_spmm`` on a MiniLM
FFN layer, slower than dense BLAS).  Here the middle stage is the tiled
SpMM itself (``spmm_module``, given the layer's operands directly: no
second spec is planned), as a private function the kernel calls between two
transposes in register tiles (``vector.transpose``) into scratch buffers; a
bias over ``o`` or ``b`` becomes the SpMM's row or column bias, an
elementwise expression of the result its epilogue.  The batch runs in
blocks (``batch_blocks``) of one register tile of columns: each block of
X's rows is transposed into a scratch, multiplied and transposed into its
rows of Y, so the SpMM never streams a whole-batch ``X^T`` from memory,
the block's scratch stays in L2, and X and Y stay row-major for the caller
(torch's layout: no copies around the kernel).  Only a bias or epilogue
that reads the batch index keeps the whole-batch layout (``_whole``).
MiniLM layers, 4096 rows, one thread (session 16, 48 KiB L1 / 2 MiB L2
Xeon): 90% 384->384 2.9-3.0 ms, 384->1536 9.6-10.3, 1536->384 10.6;
2:4 8.1-8.6, 32-35, 32.5-33.5; torch's dense Linear 8.4, 33, 32.  The function has the sparse
assembler's signature (inputs in the spec's order, then ``Y``), so the C
entry point is shared; every element of ``Y`` is stored (``FILLS_OUTPUT``).
The kernel function is built with the MLIR bindings' op builders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import arith, func, memref, scf
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.epilogue import Epilogue
from sparse_mlir.dialects.native import lane_select, row_select
from sparse_mlir.dialects.native.loops import (
    RegisterTranspose,
    by_workers,
    csr_levels,
    dynamic_matrix,
    for_each,
    kernel_entry,
)
from sparse_mlir.dialects.native.spmm import (
    ACCUMULATORS,
    B_ALIGNMENT,
    SpmmProblem,
    spmm_module,
)

from sparse_mlir.dialects.native.target import CpuTarget
from sparse_mlir.dsl.ast import Access, Expr
from sparse_mlir.dsl.patterns import linear_epilogue, linear_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["batch_blocks", "kernel_function", "native_linear"]

_CORE = "linear_spmm"
# scratch starts on a cache line (malloc gives 16 bytes): a vector load of a misaligned XT row straddles two
# lines, and every row of a block shares its first row's alignment (2:4 1536 -> 384 took 38 ms instead of 28);
# the SpMM is told so (``b_aligned``) and makes no aligned copy of its own
SCRATCH_ALIGNMENT = B_ALIGNMENT
PARALLEL_BLOCKS = 4  # fewer blocks than this run one after the other, each SpMM threaded over W's rows


def native_linear(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                  target: CpuTarget = CpuTarget()) -> ir.Module | None:
    """The Linear-layer module for ``spec`` in the current context, or ``None`` when it does not apply."""
    found = _core_problem(spec, formats, shapes)
    if found is None:
        return None
    roles, core = found
    if lane_select.applies(core.fmt, spec.dtype, target):
        return _lane_module(spec, formats[roles["w"]], shapes[roles["w"]][0], roles, core, target)
    # the SpMM (and its epilogue functions) first, then the kernel that calls it goes in before them
    module = spmm_module(core, target, function_name=_CORE, b_aligned=True)  # B: the aligned X^T scratch
    with ir.Location.unknown(), ir.InsertionPoint.at_block_begin(module.body):
        _kernel(spec, formats[roles["w"]], shapes[roles["w"]][0], roles, core, target.vector_bits)
    module.operation.verify()
    return module


def _kernel(spec: KernelSpec, fmt: Format, outputs: int | None, roles: dict[str, str | None], core: SpmmProblem,
            vector_bits: int) -> None:
    """The kernel function at the insertion point: ``Y = (W @ X^T)^T`` through ``_CORE``, block by block of the
    batch when nothing reads the batch index, else ``XT = X^T``, ``T = W @ XT``, ``Y = T^T`` whole.

    Its inputs are the spec's (``W`` as its three level buffers, every other
    input but ``X`` a vector over ``o`` or ``b``), then ``Y``, which it returns.
    ``outputs`` (``W``'s rows) ``None``: read from ``Y``'s columns (a
    shape-generic build; the C entry point has checked that they agree).
    """
    element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
    index = ir.IndexType.get()
    matrix = dynamic_matrix(element)
    residual = roles["residual"]
    block, values = kernel_function(spec, {roles["w"]: fmt}, {roles["x"], residual} - {None}, element)
    (x_value,), y = values[roles["x"]], block.arguments[-1]
    addend = values[residual][0] if residual is not None else None
    tile = vector_bits // 8 // spec.dtype.itemsize
    with ir.InsertionPoint(block):
        tiles = RegisterTranspose(element, tile)
        batch, inputs = memref.dim(x_value, tiles.c0), memref.dim(x_value, tiles.c1)
        rows = arith.constant(index, outputs) if outputs is not None else memref.dim(y, tiles.c1)

        def spmm(xt: ir.Value, t: ir.Value, extra: Sequence[ir.Value] = ()) -> None:
            """``t = W @ xt`` (+ bias or epilogue): W's buffers, XT, then the bias or the epilogue's operands."""
            core_args = [v for name, _ in core.inputs for v in ([xt] if name == roles["xt"] else values[name])]
            func.CallOp([matrix], _CORE, [*core_args, t])

        if _reads_batch_index(core):
            _whole(tiles, matrix, x_value, y, batch, inputs, rows, spmm, addend)
        else:
            batch_blocks(tiles, matrix, x_value, y, batch, inputs, rows, spmm, tile * ACCUMULATORS, spec.dtype.itemsize,
                         addend=addend)
        func.ReturnOp([y])



def _lane_module(spec: KernelSpec, fmt: Format, outputs: int | None, roles: dict[str, str | None],
                 core: SpmmProblem, target: CpuTarget) -> ir.Module:
    """The Linear kernel of an N:M ``W`` with output features across lanes (``lane_select``): ``W`` repacked,
    then items of (a block of ``BLOCK_ROWS`` batch rows, ``CHUNKS_PER_ITEM`` chunks of features) claimed by
    one worker per thread; X and Y are read and written in place, no scratch."""
    element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
    lanes = target.vector_bits // 8 // spec.dtype.itemsize
    epilogue = core.epilogue
    # lanes along the output features: the epilogue's columns are ``o``
    module = lane_select.kernel_module(None if epilogue is None else Epilogue(
        epilogue.expr, epilogue.temp, roles["b"], roles["o"], epilogue.operands), element, lanes)
    with ir.Location.unknown(), ir.InsertionPoint.at_block_begin(module.body):
        residual = roles["residual"]
        block, values = kernel_function(spec, {roles["w"]: fmt}, {roles["x"], residual} - {None}, element)
        (x,), y = values[roles["x"]], block.arguments[-1]
        with ir.InsertionPoint(block):
            c0, c1 = arith.constant(ir.IndexType.get(), 0), arith.constant(ir.IndexType.get(), 1)
            batch, inputs = memref.dim(x, c0), memref.dim(x, c1)
            rows = arith.constant(ir.IndexType.get(), outputs) if outputs is not None else memref.dim(y, c1)
            _, crd, val = values[roles["w"]]
            finish = lane_select.Finish(
                bias=values[core.bias][0] if core.bias is not None else None,
                bias_over="o" if core.bias_dim == 0 else "b", epilogue=epilogue is not None,
                operands=[values[name][0] for name in epilogue.operands] if epilogue is not None else (),
                residual=values[residual][0] if residual is not None else None)

            # a small batch reads W as stored: repacking would cost more
            row_select.by_batch_size(batch, [fmt], lambda: row_select.linear_as_stored(
                fmt, crd, val, rows, element, lanes, finish, x, y, batch), lambda: lane_select.linear_repacked(
                fmt, crd, val, rows, element, lanes, finish, x, y, batch))
            func.ReturnOp([y])
    module.operation.verify()
    return module


def kernel_function(spec: KernelSpec, sparse: dict[str, Format], matrices: set[str], element: ir.Type
                    ) -> tuple[ir.Block, dict[str, list[ir.BlockArgument]]]:
    """The kernel function (``KERNEL_NAME``, C interface, ``FILLS_OUTPUT``) at the insertion point, with the
    sparse assembler's signature: the spec's inputs in order (each ``sparse`` one as its positions, coordinates
    and values, ``matrices`` as 2-D memrefs, the rest as vectors), then the output matrix, which it returns.

    Returns its entry block and each input's arguments.
    """
    dynamic = ir.ShapedType.get_dynamic_size()
    matrix = ir.MemRefType.get([dynamic, dynamic], element)

    def types_of(name: str) -> list[ir.Type]:
        if name in sparse:
            return csr_levels(sparse[name], element)
        return [matrix] if name in matrices else [ir.MemRefType.get([dynamic], element)]

    types = {name: types_of(name) for name in spec.inputs}
    block, buffers, _ = kernel_entry(spec.inputs, types, [matrix], [matrix], fills_output=True)
    return block, buffers


def _whole(tiles: RegisterTranspose, matrix: ir.Type, x: ir.Value, y: ir.Value, batch: ir.Value, inputs: ir.Value,
           rows: ir.Value, spmm: Callable[[ir.Value, ir.Value], None], addend: ir.Value | None = None) -> None:
    """``XT = X^T``, ``T = W @ XT``, ``Y = T^T`` over the whole batch, each stage threaded (an epilogue or bias
    that reads the batch index sees the SpMM's columns as batch rows)."""
    xt = memref.alloc(matrix, [inputs, batch], [], alignment=SCRATCH_ALIGNMENT)
    tiles.transpose(x, xt, batch, inputs, parallel=True)
    t = memref.alloc(matrix, [rows, batch], [], alignment=SCRATCH_ALIGNMENT)
    spmm(xt, t)
    # Y[b, o] = T[o, b]: T's rows are Y's columns
    tiles.transpose(t, y, rows, batch, parallel=True, addend=addend)
    memref.dealloc(xt)
    memref.dealloc(t)


def batch_blocks(tiles: RegisterTranspose, matrix: ir.Type, x: ir.Value, y: ir.Value, batch: ir.Value,
                 inputs: ir.Value, rows: ir.Value, multiply: Callable[[ir.Value, ir.Value, list[ir.Value]], None],
                 full_tile: int, itemsize: int, scratch_rows: Sequence[ir.Value] = (),
                 addend: ir.Value | None = None) -> None:
    """``Y = (W @ X^T)^T`` by blocks of ``full_tile`` rows of the batch (the SpMM's widest register tile of
    columns): each block of X's rows is transposed into a scratch ``XT``, multiplied into a scratch ``T``
    (``multiply(xt, t, extra)``, ``extra`` one scratch of the block's width per ``scratch_rows``) and
    transposed into its rows of Y (plus ``addend``'s same rows, a residual shaped like Y, when given).

    Why blocks: the SpMM streams, for every nonzero of ``W``, a row of
    ``XT``; over the whole batch ``XT`` is far larger than any cache (1536 x
    4096 floats for a MiniLM FFN), so every row of ``W`` read it from memory.
    A block's ``XT`` stays in L2 for all of ``W``'s rows, and the block's X
    rows and Y rows are contiguous memory.

    Why one register tile: ``T`` (``W``'s rows x the block) is written by
    the SpMM and read back by the transpose into Y, so it must stay in L2
    with ``XT``.  Blocks of two tiles (sized by ``XT`` alone, 384 KiB) gave
    a 384 -> 1536 layer a 1.5 MiB ``T`` that spilled from a 2 MiB L2: at
    99.9% sparsity (no arithmetic to speak of) the layer took 7.0-7.6 ms
    against 3.5-4.0 with one tile; at 90% 12.5 against 10.3-11.0.  More
    columns only save re-reading ``W``'s entries (8 bytes each, streamed).

    With at least ``PARALLEL_BLOCKS`` blocks, one worker per thread claims
    blocks one at a time from a shared counter (``loops.by_workers``), with
    its own scratch for all of them (each SpMM's row loop runs serially
    inside, as OpenMP serializes a nested region).  Why not a parallel loop
    over the blocks: its schedule hands a thread half the blocks in one
    chunk, and a thread whose core is busy (torch's OpenMP workers spin for
    a while after each torch operator, on the cores ours need) then holds
    up the call; claimed one by one, the other thread takes them.  Fewer
    blocks (a small batch) run one after the other with the SpMM's rows
    threaded.
    """
    index = ir.IndexType.get()
    columns = arith.constant(index, full_tile)
    count = arith.ceildivui(batch, columns)
    byte_type = ir.MemRefType.get([ir.ShapedType.get_dynamic_size()], ir.IntegerType.get_signless(8))
    element_bytes = arith.constant(index, itemsize)
    heights = [inputs, rows, *scratch_rows]

    def allocate() -> list[ir.Value]:
        """The scratch of one worker: ``XT``, ``T`` and the caller's, each ``columns`` wide, as bytes viewed at
        each block's width (the SpMM reads its column count from its operands)."""
        return [memref.alloc(byte_type, [arith.muli(arith.muli(h, columns), element_bytes)], [],
                             alignment=SCRATCH_ALIGNMENT) for h in heights]

    def release(buffers: list[ir.Value]) -> None:
        for buffer in buffers:
            memref.dealloc(buffer)

    def block(item: ir.Value, buffers: list[ir.Value]) -> None:
        first = arith.muli(item, columns)
        width = arith.minui(columns, arith.subi(batch, first))
        xt, t, *extra = (memref.view(matrix, buffer, tiles.c0, [h, width]) for buffer, h in zip(buffers, heights))
        # X (memory) read along its rows into XT (cache)
        tiles.transpose(x, xt, width, inputs, parallel=False, src_row=first, src_rows_outside=True)
        multiply(xt, t, extra)
        # Y[first + c, o] = T[o, c]
        tiles.transpose(t, y, rows, width, parallel=False, dst_row=first, addend=addend)

    threaded = arith.cmpi(arith.CmpIPredicate.uge, count, arith.constant(index, PARALLEL_BLOCKS))
    branch = scf.IfOp(threaded, [], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        by_workers(count, block, allocate, release)
        scf.YieldOp([])
    with ir.InsertionPoint(branch.else_block):
        buffers = allocate()
        for_each(tiles.c0, count, lambda item: block(item, buffers))
        release(buffers)
        scf.YieldOp([])


def _reads_batch_index(core: SpmmProblem) -> bool:
    """Whether the bias or the epilogue reads an operand over the batch (the SpMM's column index): a block of the
    batch would see its columns from 0, so such kernels run whole."""
    if core.bias is not None:
        return core.bias_dim == 1
    if core.epilogue is None:
        return False
    return any(isinstance(node, Access) and node.tensor != core.epilogue.temp and core.epilogue.j in node.index
               for node in _accesses(core.epilogue.expr))


def _accesses(node: Expr) -> list[Access]:
    """Every tensor access in ``node``, in order of appearance."""
    if isinstance(node, Access):
        return [node]
    return [a for child in node.children() for a in _accesses(child)]


def _core_problem(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]]
                  ) -> tuple[dict[str, str | None], SpmmProblem] | None:
    """The Linear layer's roles and its middle stage as a SpMM ``T[o,b] = W[o,i] * XT[i,b]`` (rows ``o``, columns
    ``b``), with the layer's bias (over ``o``: a row bias, over ``b``: a column bias) or elementwise epilogue over
    ``o`` and ``b``.  ``None`` when the kernel is not a Linear layer.

    The SpMM's inputs are in order of first appearance in ``W @ XT``, then
    the bias or the epilogue's reads (``T`` read as ``W @ XT``).  A residual
    ``R[b,o]`` (``roles["residual"]``) is no input of the SpMM: the
    transpose into ``Y`` adds it.
    """
    plain = linear_operands(spec, formats, residual=True)
    found = linear_epilogue(spec, formats, residual=True) if plain is None else None
    if plain is None and found is None:
        return None
    roles = plain if plain is not None else found[0]
    w, xt = roles["w"], roles["xt"]
    ranks = {w: 2, xt: 2}
    epilogue, bias, bias_dim = None, None, -1
    if plain is not None:
        bias = plain["bias"]
        if bias is not None:
            bias_dim = 0 if plain["bias_index"] == plain["o"] else 1
            ranks[bias] = 1
    else:
        _, expr, operands = found
        epilogue = Epilogue(expr, roles["t"], roles["o"], roles["b"], operands)
        for tensor in _tensors_in_order(expr):
            for name in ((w, xt) if tensor == roles["t"] else (tensor,)):
                ranks.setdefault(name, 1)
    problem = SpmmProblem(spec.dtype, formats[w], shapes[w], tuple(ranks.items()), w, xt, bias, bias_dim, epilogue)
    return roles, problem


def _tensors_in_order(node: Expr) -> list[str]:
    """Every tensor ``node`` reads, in order of appearance (repeats included)."""
    return [access.tensor for access in _accesses(node)]
