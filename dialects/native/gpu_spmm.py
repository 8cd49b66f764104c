"""The warp-per-row CSR SpMM ``C[i,j] = A[i,k] * B[k,j] (+ bias)`` on the GPU, built with the op builders.

A warp per row and column tile; lane ``l`` owns 16-byte vectors
``l, l+32, ...`` of the tile (single elements when the row length is not a
multiple of 16 bytes), so every load of a B row and every store of C is one
coalesced 128-bit access per lane, and each nonzero is read once per warp
(a broadcast).  The bias seeds the sums; float16 is summed in float32.
Vector accesses need 16-byte aligned B, C and bias (``Launch.aligned``).

The tiling follows the sizes: the vector width (16 bytes when the columns
allow it) and the vectors per lane (one under ``FEW_ROWS`` rows, so more
warps share the columns; else as many as the columns need, up to ``TILE``).
A build with static sizes picks one variant; a shape-generic build
(``None`` sizes) holds one kernel per variant, reads every size from ``C``'s
descriptor, and gives each variant's launch the ``SizeTest``s that pick it
and grids sized from ``C`` at launch, so exactly one runs per call and it is
the kernel a build for that shape would have made.
"""

from __future__ import annotations

import math as pymath
from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, gpu, math, memref, scf, vector
from sparse_mlir.dialects.native.gpu_build import (
    BLOCK,
    WARP,
    KernelModule,
    accumulator,
    as_float,
    const,
    dense_type,
    level_buffer_types,
    load_index,
    row_bounds,
    when,
)

from sparse_mlir.abi.gpu_program import GridRule, KernelArg, Launch, SizeTest
from sparse_mlir.formats import Format

__all__ = ["FEW_ROWS", "TILE", "spmm_launches", "spmm_tiling"]

TILE = 4  # most vectors a lane owns in one column tile
FEW_ROWS = 2048  # below this many rows: one vector per lane, more column tiles


def spmm_tiling(element_bytes: int, rows: int, cols: int) -> tuple[int, int]:
    """``(width, per_lane)``: elements per vector access (16 bytes when the rows allow it) and vectors per lane.

    Under ``FEW_ROWS`` rows a lane owns one vector, so more warps share the
    columns: a 512-row layer otherwise leaves SMs idle behind its longest
    rows (DLMC ffn layers at 0.7x cuSPARSE on an H200).
    """
    width = 16 // element_bytes
    if cols % width:
        width = 1
    return width, 1 if rows < FEW_ROWS else max(1, min(TILE, pymath.ceil(cols / (WARP * width))))


def _variants(element_bytes: int) -> list[tuple[int, int, tuple[tuple[int, str, int], ...]]]:
    """Every ``(width, per_lane)`` ``spmm_tiling`` can pick, with the tests on (rows, cols) that pick it:
    ``(0: rows or 1: columns, kind, value)`` triples (``SizeTest`` without the argument that has the size)."""
    vector_width = 16 // element_bytes
    out = []
    for width in (vector_width, 1):
        fits = (1, "multiple" if width > 1 else "not_multiple", vector_width)
        out.append((width, 1, ((0, "below", FEW_ROWS), fits)))
        for per_lane in range(1, TILE + 1):  # ceil(cols / (32 width)) == per_lane, or >= TILE for the last
            tests = [(0, "at_least", FEW_ROWS), fits]
            if per_lane > 1:
                tests.append((1, "at_least", WARP * width * (per_lane - 1) + 1))
            if per_lane < TILE:
                tests.append((1, "below", WARP * width * per_lane + 1))
            out.append((width, per_lane, tuple(tests)))
    return out


def spmm_launches(kernels: KernelModule, elt: ir.Type, out: ir.Type, fmt: Format, rows: int | None,
                  inner: int | None, cols: int | None, bias_dim: int, args: tuple[KernelArg, ...],
                  extents: tuple[tuple[int, int], tuple[int, int]] | None = None) -> tuple[Launch, ...]:
    """Add the SpMM kernel(s) over ``args`` (A's three buffers, B, [bias], C) to ``kernels``; return the launches.

    ``bias_dim``: -1 none, 0 a bias per row, 1 per column.  Static sizes:
    one kernel and launch.  ``None`` sizes: a kernel per tiling, each
    launched only for the sizes that call for it (``SizeTest``), with grids
    from the rows and columns at launch: ``extents`` names the
    ``(kernel argument, dimension)`` of each (by default C's own; the
    Linear layer's C is scratch, whose sizes are its output's).
    """
    element_bytes = ir.FloatType(elt).width // 8
    params = [*level_buffer_types(fmt, elt), dense_type((inner, cols), elt)]
    if bias_dim >= 0:
        params.append(dense_type(((rows,) if bias_dim == 0 else (cols,)), elt))
    params.append(dense_type((rows, cols), out))
    (rows_of, rows_dim), (cols_of, cols_dim) = extents or ((args[-1].ref, 0), (args[-1].ref, 1))
    if rows is not None and cols is not None:
        picked = spmm_tiling(element_bytes, rows, cols)
        variants = [(*picked, ())]
    else:
        variants = _variants(element_bytes)
    launches = []
    made: set[str] = set()
    for width, per_lane, tests in variants:
        name = "spmm" if len(variants) == 1 else f"spmm_w{width}_t{per_lane}"
        if name not in made:
            kernels.kernel(name, params, _warp_per_row(width, per_lane, bias_dim))
            made.add(name)
        columns = WARP * width * per_lane  # per column tile
        if rows is not None and cols is not None:
            grid: tuple = (pymath.ceil(rows / (BLOCK // WARP)), pymath.ceil(cols / columns), 1)
        else:
            grid = (GridRule(rows_of, BLOCK // WARP, dim=rows_dim), GridRule(cols_of, columns, dim=cols_dim), 1)
        # vector accesses need 16-byte aligned user buffers (scratch buffers are fresh allocations)
        aligned = tuple(arg.ref for arg in args[3:] if arg.kind == "buffer") if width > 1 else ()
        where = ((rows_of, rows_dim), (cols_of, cols_dim))
        launches.append(Launch(name, grid, (BLOCK, 1, 1), args, aligned=aligned, fills_output=True,
                               only_if=tuple(SizeTest(*where[d], k, v) for d, k, v in tests)))
    return tuple(launches)


def _warp_per_row(width: int, per_lane: int, bias_dim: int) -> Callable[..., None]:
    """The body of one variant: a warp per row of C and column tile (``block_id.y``)."""

    def build(pos: ir.Value, crd: ir.Value, val: ir.Value, b: ir.Value, *rest: ir.Value) -> None:
        bias, c = (rest[0], rest[1]) if bias_dim >= 0 else (None, rest[0])
        elt, out = ir.MemRefType(val.type).element_type, ir.MemRefType(c.type).element_type
        acc = accumulator(elt)

        def typed(element: ir.Type) -> ir.Type:
            return element if width == 1 else ir.VectorType.get([width], element)

        acc_t = typed(acc)

        def load(buffer: ir.Value, indices: list[ir.Value]) -> ir.Value:
            """The data at ``indices`` (a vector of ``width``), widened to the accumulator type."""
            if width == 1:
                return as_float(memref.load(buffer, indices), acc)
            return as_float(vector.LoadOp(typed(elt), buffer, indices, alignment=16).result, acc_t)

        def spread(value: ir.Value) -> ir.Value:
            return value if width == 1 else vector.BroadcastOp(acc_t, value).result

        rows, cols = memref.dim(c, const(0)), memref.dim(c, const(1))
        tid = gpu.thread_id(gpu.Dimension.x)
        lane = arith.remui(tid, const(WARP))
        row = arith.addi(arith.muli(gpu.block_id(gpu.Dimension.x), const(BLOCK // WARP)),
                         arith.divui(tid, const(WARP)))
        valid = arith.cmpi(arith.CmpIPredicate.ult, row, rows)
        safe_row, start, end = row_bounds(pos, row, valid)
        first = arith.addi(arith.muli(gpu.block_id(gpu.Dimension.y), const(WARP * width * per_lane)),
                           arith.muli(lane, const(width)))
        # this lane's columns (whole vectors: cols is a multiple of the width), clamped for loads, guarded for stores
        columns, inside, safe = [], [], []
        for t in range(per_lane):
            column = arith.addi(first, const(t * WARP * width))
            columns.append(column)
            inside.append(arith.cmpi(arith.CmpIPredicate.ult, column, cols))
            safe.append(arith.select(inside[-1], column, const(0)))
        if bias_dim == 0:
            seeds = [spread(as_float(memref.load(bias, [safe_row]), acc))] * per_lane
        elif bias_dim == 1:
            seeds = [load(bias, [s]) for s in safe]
        else:
            zero = arith.constant(acc, 0.0)
            seeds = [spread(zero)] * per_lane
        loop = scf.ForOp(start, end, const(1), seeds)
        with ir.InsertionPoint(loop.body):
            k = loop.induction_variable
            a = spread(as_float(memref.load(val, [k]), acc))
            kk = load_index(crd, k)
            scf.YieldOp([math.fma(a, load(b, [kk, s]), total) for s, total in zip(safe, loop.inner_iter_args)])
        for t in range(per_lane):
            with when(arith.andi(valid, inside[t])):
                value = as_float(loop.results[t], typed(out))
                if width == 1:
                    memref.store(value, c, [row, columns[t]])
                else:
                    vector.StoreOp(value, c, [row, columns[t]], alignment=16)

    return build
