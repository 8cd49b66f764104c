"""SDDMM, ``C[i,j] = S[i,j] * A[i,k] * B[k,j]`` with CSR ``S`` and ``C`` (``C`` takes ``S``'s pattern), emitted
instead of sparsified.

The sampled product of attention and graph networks: only the entries of
``S`` are computed, each a dot product of a row of ``A`` and a column of
``B``.  The sparsifier walks ``B`` by columns (stride ``N``) and one scalar
FMA chain per entry.  Here ``B`` is first transposed into a scratch
``[N, K]`` (in register tiles, threaded; its rows on cache lines) so both
factors of every dot product are contiguous; then rows of ``S`` run in
parallel and each entry's dot product is a vector FMA loop over ``K`` with two independent accumulator
chains, a horizontal sum and a scalar tail.  ``C``'s positions and
coordinates are copies of ``S``'s; its values are new.  The function has the
sparse assembler's signature (level buffers, then dense memrefs, returning
``C``'s buffers, allocated with ``malloc`` so the C entry point hands them
to the caller), so everything after it is shared with sparsified kernels.
Built with the MLIR bindings' op builders.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, func, memref, scf, vector
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.linalg import KERNEL_NAME
from sparse_mlir.dialects.native.loops import (
    LINE_BYTES,
    RegisterTranspose,
    add,
    for_each,
    mul,
    parallel,
)
from sparse_mlir.dialects.native.loops import index as _index

from sparse_mlir.dsl.patterns import sddmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["native_sddmm"]

ENTRIES = 2  # entries of a row computed together (their B^T rows gathered at once, A's vectors shared); 4 and 8 measured no faster


def native_sddmm(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                 vector_bits: int = 256) -> ir.Module | None:
    """The SDDMM module for ``spec`` in the current context, or ``None`` when it does not apply."""
    found = sddmm_operands(spec, formats)
    if found is None:
        return None
    with ir.Location.unknown():
        return _module(spec, formats, shapes, vector_bits, *found)


def _module(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
            vector_bits: int, s_name: str, a_name: str, b_name: str) -> ir.Module:
    fmt = formats[s_name]
    rows, cols = shapes[s_name]
    element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
    lanes = vector_bits // 8 // spec.dtype.itemsize
    pos_t = ir.IntegerType.get_signless(fmt.pos_width or 64)
    crd_t = ir.IntegerType.get_signless(fmt.crd_width or 64)
    dynamic = ir.ShapedType.get_dynamic_size()

    def dense(name: str) -> ir.Type:
        return ir.MemRefType.get([dynamic if s is None else s for s in shapes[name]], element)

    level = [ir.MemRefType.get([dynamic], t) for t in (pos_t, crd_t, element)]
    types = {s_name: level, a_name: [dense(a_name)], b_name: [dense(b_name)]}
    inputs = [t for name in spec.inputs for t in types[name]]
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
        fn = func.FuncOp(KERNEL_NAME, (inputs, level))
        fn.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
        block = fn.add_entry_block()
        args = iter(block.arguments)
        values = {name: [next(args) for _ in types[name]] for name in spec.inputs}
        with ir.InsertionPoint(block):
            (pos, crd, val), (a,), (b,) = values[s_name], values[a_name], values[b_name]
            func.ReturnOp(_body(pos, crd, val, a, b, rows, cols, element, lanes, level))
    module.operation.verify()
    return module


def _body(pos: ir.Value, crd: ir.Value, val: ir.Value, a: ir.Value, b: ir.Value, rows: int | None,
          cols: int | None, element: ir.Type, lanes: int, level: list[ir.Type]) -> list[ir.Value]:
    """``rows``/``cols`` of ``S`` ``None`` (a shape-generic build): read from ``A``'s rows and ``B``'s columns,
    which the C entry point has checked against ``S``'s."""
    c0, c1 = _index(0), _index(1)
    n_rows = _index(rows) if rows is not None else memref.dim(a, c0)
    n_cols = _index(cols) if cols is not None else memref.dim(b, c1)
    is_float = isinstance(element, ir.FloatType)
    nnz = memref.dim(crd, c0)
    inner = memref.dim(a, c1)
    # C's positions and coordinates: S's, copied into buffers the caller will own
    out_pos = memref.alloc(level[0], [memref.dim(pos, c0)], [])
    memref.copy(pos, out_pos)
    out_crd = memref.alloc(level[1], [nnz], [])
    memref.copy(crd, out_crd)
    out_val = memref.alloc(level[2], [nnz], [])
    # B^T, so each dot product reads two contiguous rows
    matrix = ir.MemRefType.get([ir.ShapedType.get_dynamic_size()] * 2, element)
    bt = memref.alloc(matrix, [n_cols, inner], [], alignment=LINE_BYTES)  # rows on lines when K fills whole ones
    RegisterTranspose(element, lanes).transpose(b, bt, inner, n_cols, parallel=True)
    vec = ir.VectorType.get([lanes], element)
    zeros = arith.constant(vec, ir.DenseElementsAttr.get_splat(
        vec, ir.FloatAttr.get(element, 0.0) if is_float else ir.IntegerAttr.get(element, 0)))
    step = _index(2 * lanes)
    pairs = arith.muli(arith.divui(inner, step), step)  # K covered by the two-accumulator vector loop
    lanes_index = _index(lanes)
    single = arith.muli(arith.divui(inner, lanes_index), lanes_index)  # then one more vector, if it fits

    def fma(x: ir.Value, y: ir.Value, acc: ir.Value) -> ir.Value:
        return vector.fma(x, y, acc) if is_float and isinstance(acc.type, ir.VectorType) else \
            add(acc, mul(x, y))

    def dots(i: ir.Value, js: list[ir.Value]) -> list[ir.Value]:
        """Row ``i`` of A times rows ``js`` of B^T: each loaded vector of A serves every entry, and each entry
        has two FMA chains, so the gathers of B^T rows overlap."""
        count = len(js)
        chains = scf.ForOp(c0, pairs, step, [zeros] * (2 * count))
        with ir.InsertionPoint(chains.body):
            kk = chains.induction_variable
            k2 = arith.addi(kk, lanes_index)
            a1, a2 = vector.load(vec, a, [i, kk]), vector.load(vec, a, [i, k2])
            sums = []
            for e, j in enumerate(js):
                sums += [fma(a1, vector.load(vec, bt, [j, kk]), chains.inner_iter_args[2 * e]),
                         fma(a2, vector.load(vec, bt, [j, k2]), chains.inner_iter_args[2 * e + 1])]
            scf.YieldOp(sums)
        accs = [add(chains.results[2 * e], chains.results[2 * e + 1]) for e in range(count)]
        extra = scf.ForOp(pairs, single, lanes_index, accs)
        with ir.InsertionPoint(extra.body):
            kk = extra.induction_variable
            a1 = vector.load(vec, a, [i, kk])
            scf.YieldOp([fma(a1, vector.load(vec, bt, [j, kk]), extra.inner_iter_args[e]) for e, j in enumerate(js)])
        totals = [vector.reduction(element, vector.CombiningKind.ADD, extra.results[e]) for e in range(count)]
        tail = scf.ForOp(single, inner, c1, totals)
        with ir.InsertionPoint(tail.body):
            kk = tail.induction_variable
            scalar = memref.load(a, [i, kk])
            scf.YieldOp([fma(scalar, memref.load(bt, [j, kk]), tail.inner_iter_args[e]) for e, j in enumerate(js)])
        return list(tail.results)

    def store(p: ir.Value, total: ir.Value) -> None:
        memref.store(mul(memref.load(val, [p]), total), out_val, [p])

    index = ir.IndexType.get()
    group = _index(ENTRIES)

    def row(i: ir.Value) -> None:
        start = arith.index_castui(index, memref.load(pos, [i]))
        stop = arith.index_castui(index, memref.load(pos, [arith.addi(i, c1)]))
        grouped = arith.addi(start, arith.muli(arith.divui(arith.subi(stop, start), group), group))

        def together(first: ir.Value) -> None:  # ENTRIES entries at a time
            ps = [arith.addi(first, _index(e)) for e in range(ENTRIES)]
            js = [arith.index_castui(index, memref.load(crd, [x])) for x in ps]
            for x, total in zip(ps, dots(i, js)):
                store(x, total)

        for_each(start, grouped, together, group)
        for_each(grouped, stop, lambda p: store(p, dots(i, [arith.index_castui(index, memref.load(crd, [p]))])[0]))

    parallel(n_rows, row)
    memref.dealloc(bt)
    return [out_pos, out_crd, out_val]
