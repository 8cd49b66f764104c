"""A CSR SpMV, ``y[i] = A[i,j] * x[j]``, with independent accumulators and a prefetch of ``x``.

On matrices far larger than the caches SpMV waits on memory: the stream of
values and coordinates is sequential (the hardware prefetcher keeps up),
but every ``x[crd[k]]`` is a random access.  The sparsified loop issues
those loads only as it reaches them, one chain of dependent adds per row.
Here each row's nonzeros are taken ``UNROLL`` at a time into that many
accumulators, and the loop prefetches ``x[crd[k + DISTANCE]]`` (clamped to
the last entry) so the random lines are in flight long before they are
needed; rows shorter than ``SHORT_ROW`` skip all that for one plain loop.
Rows run as an ``scf.parallel`` loop (threaded, guided schedule, by the CPU
pipeline).  The function has the sparse assembler's signature, so
everything after it is shared with sparsified kernels.  A ``None`` row count
(a shape-generic build) is read from ``y``, which the C entry point has
checked against ``A``'s rows.
"""

from __future__ import annotations

from mlir import ir
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME

from sparse_mlir.dsl.patterns import spmv_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["DISTANCE", "SHORT_ROW", "UNROLL", "native_spmv"]

UNROLL = 4
# rows shorter than this take one plain loop: no unrolled loop, prefetch or combining adds for them
# (mdual, 4 nonzeros per row: 15% faster in three alternating runs; long-row matrices unchanged)
SHORT_ROW = 2 * UNROLL
DISTANCE = 128  # nonzeros ahead, hundreds of cycles of memory latency (best of 32-256 on 1M x 1M)


def native_spmv(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]]
                ) -> ir.Module | None:
    """The SpMV module for ``spec`` in the current context, or ``None`` when it does not apply."""
    found = spmv_operands(spec, formats)
    if found is None:
        return None
    a_name, x_name = found
    fmt = formats[a_name]
    rows, _ = shapes[a_name]
    elt = TYPE_NAMES[spec.dtype.name]
    is_float = elt.startswith("f")
    pos_t, crd_t = f"i{fmt.pos_width or 64}", f"i{fmt.crd_width or 64}"
    add, mul = ("arith.addf", "arith.mulf") if is_float else ("arith.addi", "arith.muli")
    zero = "0.0" if is_float else "0"
    params = {a_name: f"%pos: memref<?x{pos_t}>, %crd: memref<?x{crd_t}>, %val: memref<?x{elt}>",
              x_name: f"%x: memref<?x{elt}>"}

    def term(k: str, tag: str) -> list[str]:
        """``%m{tag} = val[k] * x[crd[k]]``."""
        return [f"%j{tag}r = memref.load %crd[{k}] : memref<?x{crd_t}>",
                f"%j{tag} = arith.index_castui %j{tag}r : {crd_t} to index",
                f"%v{tag} = memref.load %val[{k}] : memref<?x{elt}>",
                f"%x{tag} = memref.load %x[%j{tag}] : memref<?x{elt}>",
                f"%m{tag} = {mul} %v{tag}, %x{tag} : {elt}"]

    accs = ", ".join(f"%a{u} = %zero" for u in range(UNROLL))
    types = ", ".join([elt] * UNROLL)
    body = [f"%ahead = arith.addi %k, %c{DISTANCE} : index",
            "%ahead_in = arith.minui %ahead, %last : index",
            f"%pj_r = memref.load %crd[%ahead_in] : memref<?x{crd_t}>",
            f"%pj = arith.index_castui %pj_r : {crd_t} to index",
            f"memref.prefetch %x[%pj], read, locality<3>, data : memref<?x{elt}>"]
    for u in range(UNROLL):
        body += [f"%k{u} = arith.addi %k, %c{u} : index", *term(f"%k{u}", str(u)),
                 f"%n{u} = {add} %a{u}, %m{u} : {elt}"]
    total = "%r#0"
    combine = []
    for u in range(1, UNROLL):
        combine.append(f"%t{u} = {add} {total}, %r#{u} : {elt}")
        total = f"%t{u}"
    lines = ["module {",
             (f"func.func @{KERNEL_NAME}({', '.join(params[n] for n in spec.inputs)}, %y: memref<?x{elt}>) "
              f"-> memref<?x{elt}> attributes {{llvm.emit_c_interface, {FILLS_OUTPUT}}} {{"),
             *(f"%c{c} = arith.constant {c} : index"
               for c in sorted({0, 1, UNROLL, DISTANCE, SHORT_ROW, *range(UNROLL)})),
             (f"%rows = arith.constant {rows} : index" if rows is not None
              else f"%rows = memref.dim %y, %c0 : memref<?x{elt}>"), f"%zero = arith.constant {zero} : {elt}",
             f"%nnz = memref.dim %crd, %c0 : memref<?x{crd_t}>",
             "%has = arith.cmpi ugt, %nnz, %c0 : index", "%nnz1 = arith.subi %nnz, %c1 : index",
             "%last = arith.select %has, %nnz1, %c0 : index",
             "scf.parallel (%i) = (%c0) to (%rows) step (%c1) {",
             "%i1 = arith.addi %i, %c1 : index",
             f"%lo_r = memref.load %pos[%i] : memref<?x{pos_t}>", f"%hi_r = memref.load %pos[%i1] : memref<?x{pos_t}>",
             f"%lo = arith.index_castui %lo_r : {pos_t} to index", f"%hi = arith.index_castui %hi_r : {pos_t} to index",
             "%len = arith.subi %hi, %lo : index",
             f"%long = arith.cmpi uge, %len, %c{SHORT_ROW} : index",
             f"%head:2 = scf.if %long -> (index, {elt}) {{",
             f"%over = arith.remui %len, %c{UNROLL} : index",
             "%hi4 = arith.subi %hi, %over : index",
             f"%r:{UNROLL} = scf.for %k = %lo to %hi4 step %c{UNROLL} iter_args({accs}) -> ({types}) {{",
             *body, f"scf.yield {', '.join(f'%n{u}' for u in range(UNROLL))} : {types}", "}",
             *combine, f"scf.yield %hi4, {total} : index, {elt}",
             "} else {", f"scf.yield %lo, %zero : index, {elt}", "}",
             f"%sum = scf.for %k = %head#0 to %hi step %c1 iter_args(%s = %head#1) -> ({elt}) {{",
             *term("%k", "t"), f"%st = {add} %s, %mt : {elt}", f"scf.yield %st : {elt}", "}",
             f"memref.store %sum, %y[%i] : memref<?x{elt}>",
             "scf.reduce", "}",
             f"return %y : memref<?x{elt}>", "}", "}"]
    module = ir.Module.parse("\n".join(lines))
    module.operation.verify()
    return module
