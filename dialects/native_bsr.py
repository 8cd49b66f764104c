"""A BSR SpMM with dense register blocks, ``C[i,j] = A[i,k] * B[k,j] (+ bias)``, emitted instead of sparsified.

CSR pays one vector load of B per nonzero and FMA.  A ``bm x bn`` block
reuses each loaded vector of B for its ``bm`` rows: a block row keeps
``bm x T`` vector accumulators (half the register file) (a tile of ``T`` vectors of C for each of its
rows) in registers while its blocks stream by, and per block and column
``c`` of the block loads ``T`` vectors of B's row ``bn * k + c`` once and
feeds them to ``bm`` FMAs each.  B traffic per FMA drops by ``bm``, which is
what limits CSR SpMM (its rows of B come from L2).  Column tiles come in
tiers (``T`` vectors, then one, then scalars for the last columns); block
rows run as an ``scf.parallel`` loop that the CPU pipeline threads.  Same
function signature as the sparse assembler's, so the C entry point is
shared; every element of C is stored (``FILLS_OUTPUT``).
"""

from __future__ import annotations

from mlir import ir

from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

from .encoding import TYPE_NAMES
from .kernel import FILLS_OUTPUT, KERNEL_NAME
from .native_spmm import column_tiers, multiply_add
from .patterns import bsr_blocks, spmm_operands

__all__ = ["native_bsr_spmm", "accumulators"]


def accumulators(vector_bits: int) -> int:
    """Vector registers of C per block row and column tile: half the register file (32 with AVX-512, else 16)."""
    return 16 if vector_bits >= 512 else 8


def native_bsr_spmm(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                    vector_bits: int = 256) -> ir.Module | None:
    """The register-blocked BSR SpMM module for ``spec`` in the current context, or ``None`` if it does not apply.

    Applies to BSR ``A`` with blocks of at most ``accumulators(vector_bits)`` rows.
    """
    found = spmm_operands(spec, formats)
    budget = accumulators(vector_bits)
    if found is None or (blocks := bsr_blocks(formats[found[0]])) is None or blocks[0] > budget:
        return None
    a_name, b_name, bias, bias_dim = found
    bm, bn = blocks
    fmt = formats[a_name]
    rows, _ = shapes[a_name]
    elt = TYPE_NAMES[spec.dtype.name]
    lanes = vector_bits // 8 // spec.dtype.itemsize
    vec = f"vector<{lanes}x{elt}>"
    is_float = elt.startswith("f")
    zero = "0.0" if is_float else "0"
    pos_t, crd_t = f"i{fmt.pos_width or 64}", f"i{fmt.crd_width or 64}"
    params = {a_name: f"%pos: memref<?x{pos_t}>, %crd: memref<?x{crd_t}>, %val: memref<?x{elt}>",
              b_name: f"%B: memref<?x?x{elt}>"}
    if bias is not None:
        params[bias] = f"%bias: memref<?x{elt}>"

    # block %p: its first row of B (%k0) and its first value (%v0)
    block_start = ["%kb_raw = memref.load %crd[%p] : memref<?x{crd_t}>",
                   "%kb = arith.index_castui %kb_raw : {crd_t} to index",
                   f"%k0 = arith.muli %kb, %c{bn} : index", f"%v0 = arith.muli %p, %c{bm * bn} : index"]

    def seed(r: int, j: str, width: str) -> tuple[list[str], str]:
        """The starting value of row ``r``'s sum at column(s) ``j``: zero, or the bias (``width`` is the type)."""
        if bias is None:
            return [], "%zv" if width == vec else "%zero"
        if bias_dim == 0:
            return [], f"%brow{r}" if width == vec else f"%bias_r{r}"
        if width == vec:
            return [f"%bcol{j[1:]} = vector.load %bias[{j}] : memref<?x{elt}>, {vec}"], f"%bcol{j[1:]}"
        return [f"%bcol{j[1:]} = memref.load %bias[{j}] : memref<?x{elt}>"], f"%bcol{j[1:]}"

    def tile_loop(tag: str, count: int, start: str, stop: str) -> list[str]:
        """Column tiles of ``count`` vectors: ``bm x count`` accumulators through the block row, stored once."""
        js = [f"%{tag}j{u}" for u in range(count)]
        lines = [f"scf.for %{tag}jj = {start} to {stop} step %c{count * lanes} {{",
                 *(f"{js[u]} = arith.addi %{tag}jj, %c{u * lanes} : index" for u in range(count))]
        starts = []
        for u in range(count):
            seeds = [seed(r, js[u], vec) for r in range(bm)]
            lines += seeds[0][0]  # a column bias is one load per tile, shared by the rows
            starts += [s for _, s in seeds]
        accs = [f"%{tag}a{r}_{u}" for u in range(count) for r in range(bm)]
        types = ", ".join([vec] * len(accs))
        body = list(block_start)
        current = dict(zip(accs, accs))
        for c in range(bn):
            body.append(f"%{tag}k{c} = arith.addi %k0, %c{c} : index")
            for u in range(count):
                body.append(f"%{tag}b{c}_{u} = vector.load %B[%{tag}k{c}, {js[u]}] : memref<?x?x{elt}>, {vec}")
            for r in range(bm):
                at = f"%{tag}at{r}_{c}"
                body += [f"{at} = arith.addi %v0, %c{r * bn + c} : index",
                         f"%{tag}v{r}_{c} = memref.load %val[{at}] : memref<?x{elt}>",
                         f"%{tag}vb{r}_{c} = vector.broadcast %{tag}v{r}_{c} : {elt} to {vec}"]
                for u in range(count):
                    acc = f"%{tag}a{r}_{u}"
                    new = f"%{tag}n{r}_{u}_{c}"
                    body += multiply_add(is_float, current[acc], f"%{tag}b{c}_{u}", f"%{tag}vb{r}_{c}", new, vec)
                    current[acc] = new
        lines += [f"%{tag}r:{len(accs)} = scf.for %p = %lo to %hi step %c1 iter_args("
                  + ", ".join(f"{a} = {s}" for a, s in zip(accs, starts)) + f") -> ({types}) {{",
                  *body, f"scf.yield {', '.join(current[a] for a in accs)} : {types}", "}"]
        for n in range(len(accs)):  # accumulator n is row n % bm of vector n // bm
            r, u = n % bm, n // bm
            lines.append(f"vector.store %{tag}r#{n}, %C[%row{r}, {js[u]}] : memref<?x?x{elt}>, {vec}")
        return [*lines, "}"]

    # column tiers: as many vectors per row as the accumulators allow, then one, then the scalar rest
    tile = max(1, budget // bm)
    tier_lines, tier_loops, start = column_tiers(sorted({tile, 1}, reverse=True), lanes, tile_loop)
    # the last columns, one at a time: bm scalar sums through the block row
    scalar_seeds = [seed(r, "%j", elt) for r in range(bm)]
    scalar_body = list(block_start)
    current = {r: f"%s{r}" for r in range(bm)}
    for c in range(bn):
        scalar_body += [f"%sk{c} = arith.addi %k0, %c{c} : index",
                        f"%sb{c} = memref.load %B[%sk{c}, %j] : memref<?x?x{elt}>"]
        for r in range(bm):
            scalar_body += [f"%sat{r}_{c} = arith.addi %v0, %c{r * bn + c} : index",
                            f"%sv{r}_{c} = memref.load %val[%sat{r}_{c}] : memref<?x{elt}>"]
            scalar_body += multiply_add(is_float, current[r], f"%sb{c}", f"%sv{r}_{c}", f"%sn{r}_{c}", elt)
            current[r] = f"%sn{r}_{c}"
    scalars = ", ".join([elt] * bm)
    scalar_loop = [f"scf.for %j = {start} to %N step %c1 {{", *scalar_seeds[0][0],
                   f"%sr:{bm} = scf.for %p = %lo to %hi step %c1 iter_args("
                   + ", ".join(f"%s{r} = {s}" for r, (_, s) in enumerate(scalar_seeds)) + f") -> ({scalars}) {{",
                   *scalar_body, f"scf.yield {', '.join(current[r] for r in range(bm))} : {scalars}", "}",
                   *(f"memref.store %sr#{r}, %C[%row{r}, %j] : memref<?x?x{elt}>" for r in range(bm)), "}"]
    row_bias = []
    if bias is not None and bias_dim == 0:
        for r in range(bm):
            row_bias += [f"%bias_r{r} = memref.load %bias[%row{r}] : memref<?x{elt}>",
                         f"%brow{r} = vector.broadcast %bias_r{r} : {elt} to {vec}"]
    constants = {0, 1, bn, bm * bn, *range(bm * bn), *(u * lanes for u in range(tile + 1)), lanes}
    lines = ["module {",
             f"func.func @{KERNEL_NAME}({', '.join(params[n] for n in spec.inputs)}, %C: memref<?x?x{elt}>) "
             f"-> memref<?x?x{elt}> attributes {{llvm.emit_c_interface, {FILLS_OUTPUT}}} {{",
             *(f"%c{c} = arith.constant {c} : index" for c in sorted(constants)),
             f"%block_rows = arith.constant {rows // bm} : index",
             f"%N = memref.dim %C, %c1 : memref<?x?x{elt}>",
             *tier_lines,
             f"%zero = arith.constant {zero} : {elt}", f"%zv = arith.constant dense<{zero}> : {vec}",
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
             f"return %C : memref<?x?x{elt}>", "}", "}"]
    text = "\n".join(lines).replace("{crd_t}", crd_t).replace("{pos_t}", pos_t)
    module = ir.Module.parse(text)
    module.operation.verify()
    return module
