"""A BSR SpMM with dense register blocks, ``C[i,j] = A[i,k] * B[k,j] (+ bias)``, emitted instead of sparsified.

CSR pays one vector load of B per nonzero and FMA.  A ``bm x bn`` block
reuses each loaded vector of B for its ``bm`` rows: a block row keeps
``bm x T`` vector accumulators (half the register file) (a tile of ``T`` vectors of C for each of its
rows) in registers while its blocks stream by, and per block and column
``c`` of the block loads ``T`` vectors of B's row ``bn * k + c`` once and
feeds them to ``bm`` FMAs each.  B traffic per FMA drops by ``bm``, which is
what limits CSR SpMM (its rows of B come from L2).  Blocks taller than the
accumulator budget (16x1 on AVX2) are walked in row chunks of at most the
budget, one pass over the block row's blocks per chunk and column tile: each
chunk keeps its own sums in registers, and the B vectors the next chunk
reloads were loaded moments before (L1).  Column tiles come in
tiers (``T`` vectors, then one, then scalars for the last columns); block
rows run as an ``scf.parallel`` loop that the CPU pipeline threads.  Same
function signature as the sparse assembler's, so the C entry point is
shared; every element of C is stored (``FILLS_OUTPUT``).  A ``None`` row
count (a shape-generic build) is read from ``C``; the C entry point has
checked that it is a multiple of ``bm``.  Built with the bindings' op
builders, like the CSR SpMM whose column tiers and B alignment it shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mlir import ir
from mlir.dialects import arith, func, memref, vector
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.native.loops import (
    as_index,
    constant_like,
    csr_levels,
    dynamic_matrix,
    dynamic_vector,
    for_each,
    index,
    kernel_entry,
    load_index,
    multiply_add,
    parallel,
    reduce_loop,
)
from sparse_mlir.dialects.native.spmm import aligned_b, column_tiers, last_columns

from sparse_mlir.dsl.patterns import bsr_blocks, spmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["accumulators", "native_bsr_spmm", "row_chunks"]


def accumulators(vector_bits: int) -> int:
    """Vector registers of C per block row and column tile: half the register file (32 with AVX-512, else 16)."""
    return 16 if vector_bits >= 512 else 8


def row_chunks(bm: int, budget: int) -> list[range]:
    """The rows of a ``bm``-row block split into the fewest chunks of at most ``budget`` rows, heights within one.

    Balanced rather than greedy (20 rows, budget 8: 7, 7, 6 and not 8, 8, 4)
    so that every chunk gets the same column tile: the tile is sized for the
    tallest chunk.  A block that fits is one chunk, the kernel it always had.
    """
    count = -(-bm // budget)
    small, extra = divmod(bm, count)
    chunks, first = [], 0
    for c in range(count):
        height = small + (c < extra)
        chunks.append(range(first, first + height))
        first += height
    return chunks


@dataclass(frozen=True)
class _Block:
    """What every loop of the emitter shares: block sizes, types, buffers, and how a row's sum starts."""

    bm: int
    bn: int
    element: ir.Type
    vector: ir.VectorType
    crd: ir.Value
    val: ir.Value
    b: ir.Value
    c: ir.Value
    bias: ir.Value | None
    bias_dim: int | None  # None: no bias; 0: one per row of C; 1: one per column
    zero: ir.Value
    zero_vector: ir.Value

    @property
    def mask_type(self) -> ir.VectorType:
        return ir.VectorType.get(self.vector.shape, ir.IntegerType.get_signless(1))

    def bias_column(self, j: ir.Value, scalar: bool = False, mask: ir.Value | None = None) -> ir.Value | None:
        """A column bias at ``j`` (a vector, masked by ``mask`` when given; a scalar when ``scalar``): loaded
        once, shared by every row; None without a column bias."""
        if self.bias_dim != 1:
            return None
        if scalar:
            return memref.load(self.bias, [j])
        if mask is not None:
            return vector.maskedload(self.vector, self.bias, [j], mask, self.zero_vector)
        return vector.load(self.vector, self.bias, [j])

    def seed(self, row_bias: tuple[ir.Value, ir.Value] | None, column_bias: ir.Value | None, scalar: bool
             ) -> ir.Value:
        """The starting value of a row's sum: zero, the row's bias (``row_bias``: scalar and broadcast) or the
        column's (``column_bias``)."""
        if self.bias_dim is None:
            return self.zero if scalar else self.zero_vector
        if self.bias_dim == 0:
            return row_bias[0] if scalar else row_bias[1]
        return column_bias

    def start(self, p: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Block ``p``'s first row of B and the position of its first value."""
        return arith.muli(load_index(self.crd, p), index(self.bn)), arith.muli(p, index(self.bm * self.bn))

    def value(self, first: ir.Value, r: int, c: int) -> ir.Value:
        """The block's value at row ``r``, column ``c`` (``first``: the position of its first value)."""
        return memref.load(self.val, [arith.addi(first, index(r * self.bn + c))])


@dataclass
class _BlockRow:
    """Block row ``ib``: its blocks ``[lo, hi)``, the rows of C it covers and their biases (``bias_dim`` 0)."""

    lo: ir.Value
    hi: ir.Value
    rows: list[ir.Value]
    biases: list[tuple[ir.Value, ir.Value]] | None


def _vector_chunk(blk: _Block, row: _BlockRow, rows: range, js: list[ir.Value], columns_bias: list[ir.Value | None],
                  mask: ir.Value | None = None) -> None:
    """One chunk of rows over one column tile: ``len(rows) x len(js)`` accumulators through the block row (every
    load of B and store of C masked by ``mask`` when given: the last columns)."""
    count = len(js)
    slots = [(r, u) for u in range(count) for r in rows]  # slot n is rows[n % height] of vector n // height
    seeds = [blk.seed(row.biases[r] if row.biases else None, columns_bias[u], False) for r, u in slots]

    def block(p: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:
        current = dict(zip(slots, sums))
        k0, first = blk.start(p)
        for c in range(blk.bn):
            k = arith.addi(k0, index(c))
            bs = [vector.maskedload(blk.vector, blk.b, [k, j], mask, blk.zero_vector) if mask is not None else
                  vector.load(blk.vector, blk.b, [k, j]) for j in js]
            for r in rows:
                broadcast = vector.broadcast(blk.vector, blk.value(first, r, c))
                for u in range(count):
                    current[r, u] = multiply_add(current[r, u], bs[u], broadcast)
        return [current[s] for s in slots]

    sums = reduce_loop(row.lo, row.hi, seeds, block)
    for total, (r, u) in zip(sums, slots):
        if mask is not None:
            vector.maskedstore(blk.c, [row.rows[r], js[u]], mask, total)
        else:
            vector.store(total, blk.c, [row.rows[r], js[u]])


def _scalar_chunk(blk: _Block, row: _BlockRow, rows: range, j: ir.Value, column_bias: ir.Value | None) -> None:
    """One chunk of rows at the scalar column ``j``: a sum per row through the block row."""
    seeds = [blk.seed(row.biases[r] if row.biases else None, column_bias, True) for r in rows]

    def block(p: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:
        current = dict(zip(rows, sums))
        k0, first = blk.start(p)
        for c in range(blk.bn):
            b = memref.load(blk.b, [arith.addi(k0, index(c)), j])
            for r in rows:
                current[r] = multiply_add(current[r], b, blk.value(first, r, c))
        return [current[r] for r in rows]

    for total, r in zip(reduce_loop(row.lo, row.hi, seeds, block), rows):
        memref.store(total, blk.c, [row.rows[r], j])


def _tile_loop(blk: _Block, chunks: list[range], lanes: int, columns: ir.Value
               ) -> Callable[[_BlockRow, int, ir.Value, ir.Value, bool], None]:
    """The loop over column tiles of ``count`` vectors from ``start`` to ``stop``, each walked by every row chunk
    (``masked``: one vector over the last columns, fewer than its lanes)."""

    def tile_loop(row: _BlockRow, count: int, start: ir.Value, stop: ir.Value, masked: bool = False) -> None:
        def tile(jj: ir.Value) -> None:
            js = [arith.addi(jj, index(u * lanes)) for u in range(count)]
            mask = vector.create_mask(blk.mask_type, [arith.subi(columns, jj)]) if masked else None
            columns_bias = [blk.bias_column(j, mask=mask) for j in js]
            for rows in chunks:
                _vector_chunk(blk, row, rows, js, columns_bias, mask)

        for_each(start, stop, tile, index(count * lanes))

    return tile_loop


def native_bsr_spmm(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                    vector_bits: int = 256) -> ir.Module | None:
    """The register-blocked BSR SpMM module for ``spec`` in the current context, or ``None`` if it does not apply.

    Applies to every BSR ``A``; blocks taller than ``accumulators(vector_bits)``
    rows are walked in row chunks (``row_chunks``).
    """
    found = spmm_operands(spec, formats)
    if found is None or (blocks := bsr_blocks(formats[found[0]])) is None:
        return None
    a_name, b_name, bias, bias_dim = found
    fmt = formats[a_name]
    with ir.Location.unknown():
        module = ir.Module.create()
        element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
        matrix = dynamic_matrix(element)
        types = {a_name: csr_levels(fmt, element), b_name: [matrix],
                 **({bias: [dynamic_vector(element)]} if bias is not None else {})}
        with ir.InsertionPoint(module.body):
            entry, operands, (c,) = kernel_entry(spec.inputs, types, [matrix], [matrix], fills_output=True)
            with ir.InsertionPoint(entry):
                _body(spec, blocks, shapes[a_name][0], operands[a_name], operands[b_name][0],
                      operands[bias][0] if bias is not None else None, bias_dim, c, element, vector_bits)
    module.operation.verify()
    return module


def _body(spec: KernelSpec, blocks: tuple[int, int], rows: int | None, levels: list[ir.Value], b_in: ir.Value,
          bias: ir.Value | None, bias_dim: int, c: ir.Value, element: ir.Type, vector_bits: int) -> None:
    """The kernel's body at the insertion point: block rows in parallel, each through the column tiers (as many
    vectors per row as the tallest chunk's accumulators allow, then one), one masked vector and scalar columns."""
    bm, bn = blocks
    lanes = vector_bits // 8 // spec.dtype.itemsize
    pos, crd, val = levels
    block_rows = index(rows // bm) if rows is not None else arith.divui(memref.dim(c, index(0)), index(bm))
    columns = memref.dim(c, index(1))
    b, free_b = aligned_b(b_in, val, np.dtype(spec.dtype).itemsize)  # B's rows on cache lines
    vector_type = ir.VectorType.get([lanes], element)
    blk = _Block(bm, bn, element, vector_type, crd, val, b, c, bias, None if bias is None else bias_dim,
                 constant_like(element, 0), constant_like(vector_type, 0))
    chunks = row_chunks(bm, accumulators(vector_bits))
    tile = max(1, accumulators(vector_bits) // max(len(c) for c in chunks))
    tile_loop = _tile_loop(blk, chunks, lanes, columns)
    spans, left = column_tiers(sorted({tile, 1}, reverse=True), lanes, columns)
    # the last columns as one masked vector (``last_columns``): column by column, each walked the block row again
    # (4x4 blocks, 1536 x 384 at 10% of blocks: N=8 0.064 ms, N=16 0.021)
    masked_end = last_columns(left, columns)

    def block_row(ib: ir.Value) -> None:
        following = arith.addi(ib, index(1))
        lo, hi = memref.load(pos, [ib]), memref.load(pos, [following])
        lo, hi = as_index(lo), as_index(hi)
        first = arith.muli(ib, index(bm))
        row_of = [first] + [arith.addi(first, index(r)) for r in range(1, bm)]
        biases = None
        if bias is not None and bias_dim == 0:
            biases = []
            for r in range(bm):
                scalar = memref.load(bias, [row_of[r]])
                biases.append((scalar, vector.broadcast(vector_type, scalar)))
        row = _BlockRow(lo, hi, row_of, biases)
        for count, start, stop in spans:
            tile_loop(row, count, start, stop)
        tile_loop(row, 1, left, masked_end, True)

        def scalar_column(j: ir.Value) -> None:
            column_bias = blk.bias_column(j, scalar=True)
            for rows in chunks:
                _scalar_chunk(blk, row, rows, j, column_bias)

        for_each(masked_end, columns, scalar_column)

    parallel(block_rows, block_row)
    free_b()
    func.ReturnOp([c])
