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
checked that it is a multiple of ``bm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mlir import ir
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.spmm import aligned_b, column_tiers, last_columns, multiply_add

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
    """What every loop of the emitter shares: block sizes, types and how a row's sum starts."""

    bm: int
    bn: int
    elt: str
    vec: str
    is_float: bool
    bias_dim: int | None  # None: no bias; 0: one per row of C; 1: one per column

    def bias_loads(self, j: str, width: str, mask: str | None = None) -> list[str]:
        """A column bias at ``j`` (``width``: vector or scalar type; a vector masked by ``mask`` when given):
        loaded once, shared by every row."""
        if self.bias_dim != 1:
            return []
        if mask is not None:
            return [f"%bcol{j[1:]} = vector.maskedload %bias[{j}], {mask}, %zv : memref<?x{self.elt}>, "
                    f"{self.mask_type}, {self.vec} into {self.vec}"]
        op = "vector.load" if width == self.vec else "memref.load"
        suffix = f", {self.vec}" if width == self.vec else ""
        return [f"%bcol{j[1:]} = {op} %bias[{j}] : memref<?x{self.elt}>{suffix}"]

    @property
    def mask_type(self) -> str:
        return self.vec.replace(f"x{self.elt}>", "xi1>")

    def seed(self, r: int, j: str, width: str) -> str:
        """The starting value of row ``r``'s sum at column(s) ``j``: zero or the bias (after ``bias_loads``)."""
        if self.bias_dim is None:
            return "%zv" if width == self.vec else "%zero"
        if self.bias_dim == 0:
            return f"%brow{r}" if width == self.vec else f"%bias_r{r}"
        return f"%bcol{j[1:]}"

    def start(self) -> list[str]:
        """Block ``%p``'s first row of B (``%k0``) and its first value (``%v0``)."""
        return ["%kb_raw = memref.load %crd[%p] : memref<?x{crd_t}>",
                "%kb = arith.index_castui %kb_raw : {crd_t} to index",
                f"%k0 = arith.muli %kb, %c{self.bn} : index", f"%v0 = arith.muli %p, %c{self.bm * self.bn} : index"]

    def value(self, tag: str, r: int, c: int) -> list[str]:
        """Load the block's value at row ``r``, column ``c`` into ``%{tag}v{r}_{c}``."""
        at = f"%{tag}at{r}_{c}"
        return [f"{at} = arith.addi %v0, %c{r * self.bn + c} : index",
                f"%{tag}v{r}_{c} = memref.load %val[{at}] : memref<?x{self.elt}>"]


def _block_loop(tag: str, sums: list[tuple[str, str]], width: str, body: list[str], results: list[str]) -> list[str]:
    """``scf.for`` over the block row's blocks carrying ``sums`` (name, start) into ``%{tag}r#n``."""
    types = ", ".join([width] * len(sums))
    return [f"%{tag}r:{len(sums)} = scf.for %p = %lo to %hi step %c1 iter_args("
            + ", ".join(f"{a} = {s}" for a, s in sums) + f") -> ({types}) {{",
            *body, f"scf.yield {', '.join(results)} : {types}", "}"]


def _vector_chunk(blk: _Block, tag: str, rows: range, js: list[str], mask: str | None = None) -> list[str]:
    """One chunk of rows over one column tile: ``len(rows) x len(js)`` accumulators through the block row (every
    load of B and store of C masked by ``mask`` when given: the last columns)."""
    count = len(js)
    slots = [(r, u) for u in range(count) for r in rows]  # slot n is rows[n % height] of vector n // height
    current = {(r, u): f"%{tag}a{r}_{u}" for r, u in slots}
    sums = [(current[r, u], blk.seed(r, js[u], blk.vec)) for r, u in slots]
    body = blk.start()
    for c in range(blk.bn):
        body.append(f"%{tag}k{c} = arith.addi %k0, %c{c} : index")
        body += [f"%{tag}b{c}_{u} = vector.maskedload %B[%{tag}k{c}, {js[u]}], {mask}, %zv : memref<?x?x{blk.elt}>, "
                 f"{blk.mask_type}, {blk.vec} into {blk.vec}" if mask is not None else
                 f"%{tag}b{c}_{u} = vector.load %B[%{tag}k{c}, {js[u]}] : memref<?x?x{blk.elt}>, {blk.vec}"
                 for u in range(count)]
        for r in rows:
            body += [*blk.value(tag, r, c),
                     f"%{tag}vb{r}_{c} = vector.broadcast %{tag}v{r}_{c} : {blk.elt} to {blk.vec}"]
            for u in range(count):
                new = f"%{tag}n{r}_{u}_{c}"
                body += multiply_add(blk.is_float, current[r, u], f"%{tag}b{c}_{u}", f"%{tag}vb{r}_{c}", new, blk.vec)
                current[r, u] = new
    lines = _block_loop(tag, sums, blk.vec, body, [current[s] for s in slots])
    lines += [f"vector.maskedstore %C[%row{r}, {js[u]}], {mask}, %{tag}r#{n} : memref<?x?x{blk.elt}>, {blk.mask_type}, "
              f"{blk.vec}" if mask is not None else
              f"vector.store %{tag}r#{n}, %C[%row{r}, {js[u]}] : memref<?x?x{blk.elt}>, {blk.vec}"
              for n, (r, u) in enumerate(slots)]
    return lines


def _scalar_chunk(blk: _Block, tag: str, rows: range) -> list[str]:
    """One chunk of rows at the scalar column ``%j``: a sum per row through the block row."""
    current = {r: f"%{tag}s{r}" for r in rows}
    body = blk.start()
    for c in range(blk.bn):
        body += [f"%{tag}k{c} = arith.addi %k0, %c{c} : index",
                 f"%{tag}b{c} = memref.load %B[%{tag}k{c}, %j] : memref<?x?x{blk.elt}>"]
        for r in rows:
            body += blk.value(tag, r, c)
            body += multiply_add(blk.is_float, current[r], f"%{tag}b{c}", f"%{tag}v{r}_{c}", f"%{tag}n{r}_{c}", blk.elt)
            current[r] = f"%{tag}n{r}_{c}"
    sums = [(f"%{tag}s{r}", blk.seed(r, "%j", blk.elt)) for r in rows]
    lines = _block_loop(tag, sums, blk.elt, body, [current[r] for r in rows])
    return lines + [f"memref.store %{tag}r#{n}, %C[%row{r}, %j] : memref<?x?x{blk.elt}>" for n, r in enumerate(rows)]


def _tile_loop(blk: _Block, chunks: list[range], lanes: int) -> Callable[..., list[str]]:
    """``column_tiers``'s loop builder: column tiles of ``count`` vectors, each walked by every row chunk
    (``masked``: one vector over the last columns, fewer than its lanes)."""

    def tile_loop(tag: str, count: int, start: str, stop: str, masked: bool = False) -> list[str]:
        js = [f"%{tag}j{u}" for u in range(count)]
        mask = f"%{tag}mask" if masked else None
        lines = [f"scf.for %{tag}jj = {start} to {stop} step %c{count * lanes} {{",
                 *(f"{js[u]} = arith.addi %{tag}jj, %c{u * lanes} : index" for u in range(count))]
        if masked:
            lines += [f"%{tag}left = arith.subi %N, %{tag}jj : index",
                      f"{mask} = vector.create_mask %{tag}left : {blk.mask_type}"]
        for j in js:
            lines += blk.bias_loads(j, blk.vec, mask)
        for h, rows in enumerate(chunks):
            lines += _vector_chunk(blk, f"{tag}h{h}", rows, js, mask)
        return [*lines, "}"]

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
    budget = accumulators(vector_bits)
    a_name, b_name, bias, bias_dim = found
    bm, bn = blocks
    fmt = formats[a_name]
    rows, _ = shapes[a_name]
    elt = TYPE_NAMES[spec.dtype.name]
    lanes = vector_bits // 8 // spec.dtype.itemsize
    blk = _Block(bm, bn, elt, f"vector<{lanes}x{elt}>", elt.startswith("f"), None if bias is None else bias_dim)
    zero = "0.0" if blk.is_float else "0"
    pos_t, crd_t = f"i{fmt.pos_width or 64}", f"i{fmt.crd_width or 64}"
    params = {a_name: f"%pos: memref<?x{pos_t}>, %crd: memref<?x{crd_t}>, %val: memref<?x{elt}>",
              b_name: f"%B_in: memref<?x?x{elt}>"}
    if bias is not None:
        params[bias] = f"%bias: memref<?x{elt}>"

    # column tiers: as many vectors per row as the tallest chunk's accumulators allow, then one, then scalars
    chunks = row_chunks(bm, budget)
    tile = max(1, budget // max(len(c) for c in chunks))
    tile_loop = _tile_loop(blk, chunks, lanes)
    tier_lines, tier_loops, start = column_tiers(sorted({tile, 1}, reverse=True), lanes, tile_loop)
    # the last columns as one masked vector (``last_columns``): column by column, each walked the block row again
    # (4x4 blocks, 1536 x 384 at 10% of blocks: N=8 0.064 ms, N=16 0.021)
    bounds, masked_end = last_columns(start)
    tier_lines += bounds
    tier_loops += tile_loop("tm", 1, start, masked_end, masked=True)
    scalar_loop = [f"scf.for %j = {masked_end} to %N step %c1 {{", *blk.bias_loads("%j", elt)]
    for h, chunk in enumerate(chunks):
        scalar_loop += _scalar_chunk(blk, f"sh{h}", chunk)
    scalar_loop.append("}")
    row_bias = []
    if bias is not None and bias_dim == 0:
        for r in range(bm):
            row_bias += [f"%bias_r{r} = memref.load %bias[%row{r}] : memref<?x{elt}>",
                         f"%brow{r} = vector.broadcast %bias_r{r} : {elt} to {blk.vec}"]
    constants = {0, 1, bn, bm * bn, *range(bm * bn), *(u * lanes for u in range(tile + 1)), lanes}
    b_prologue, b_epilogue = aligned_b(elt, np.dtype(spec.dtype).itemsize)  # B's rows on cache lines
    lines = ["module {",
             (f"func.func @{KERNEL_NAME}({', '.join(params[n] for n in spec.inputs)}, %C: memref<?x?x{elt}>) "
              f"-> memref<?x?x{elt}> attributes {{llvm.emit_c_interface, {FILLS_OUTPUT}}} {{"),
             *(f"%c{c} = arith.constant {c} : index" for c in sorted(constants)),
             f"%c{bm}bm = arith.constant {bm} : index",
             (f"%block_rows = arith.constant {rows // bm} : index" if rows is not None  # else C's rows / bm:
              else f"%c_rows = memref.dim %C, %c0 : memref<?x?x{elt}>\n"  # the C entry point checked bm | rows
                   f"%block_rows = arith.divui %c_rows, %c{bm}bm : index"),
             f"%N = memref.dim %C, %c1 : memref<?x?x{elt}>",
             *b_prologue,
             *tier_lines,
             f"%zero = arith.constant {zero} : {elt}", f"%zv = arith.constant dense<{zero}> : {blk.vec}",
             "scf.parallel (%ib) = (%c0) to (%block_rows) step (%c1) {",
             "%ib1 = arith.addi %ib, %c1 : index",
             f"%lo_raw = memref.load %pos[%ib] : memref<?x{pos_t}>",
             f"%hi_raw = memref.load %pos[%ib1] : memref<?x{pos_t}>",
             f"%lo = arith.index_castui %lo_raw : {pos_t} to index",
             f"%hi = arith.index_castui %hi_raw : {pos_t} to index",
             f"%row0 = arith.muli %ib, %c{bm} : index",
             *(f"%row{r} = arith.addi %row0, %c{r} : index" for r in range(1, bm)),
             *row_bias, *tier_loops, *scalar_loop,
             "scf.reduce", "}",
             *b_epilogue,
             f"return %C : memref<?x?x{elt}>", "}", "}"]
    text = "\n".join(lines).replace("{crd_t}", crd_t).replace("{pos_t}", pos_t)
    module = ir.Module.parse(text)
    module.operation.verify()
    return module
