"""SDDMM, ``C[i,j] = S[i,j] * A[i,k] * B[k,j]`` with CSR ``S`` and ``C`` (``C`` takes ``S``'s pattern), emitted
instead of sparsified.

The sampled product of attention and graph networks: only the entries of
``S`` are computed, each a dot product of a row of ``A`` and a column of
``B``.  The sparsifier walks ``B`` by columns (stride ``N``) and one scalar
FMA chain per entry.  Here ``B`` is first transposed into a scratch
``[N, K]`` (in register tiles, threaded; its rows on cache lines) so both
factors of every dot product are contiguous; then rows of ``S`` run in
parallel, a group of up to ``lanes`` entries at a time (a row's entries in
groups of ``lanes``, then its rest as groups of its binary digits).  Each
entry of a group has one vector accumulator over ``K`` (each vector of
``A`` loaded once for the group; the last, partial one masked), and the
group's accumulators are summed together by a transposed reduction
(``loops.lane_sums``) into one vector, multiplied by ``S``'s values and
stored at once.  A horizontal sum per entry took about 40% of the time
(4096^2 at 1%, K=64, 1 thread: 0.79 ms before, 0.59 ms after).
Written ``B[j,k]`` (attention's ``Q K^T`` with ``K`` as stored), ``B``'s
rows are already what the dot products read: no transpose, only a copy onto
a cache line when it starts off one (``_on_lines``).  ``C``'s positions are a
copy of ``S``'s; its coordinates are stored by each group, one vector, as it
reads them (a serial copy of them took 0.13 ms of a 1.2 ms call from cold
caches, 4096^2 at 1%); its values are new.  The function has the
sparse assembler's signature (level buffers, then dense memrefs, returning
``C``'s buffers, allocated with ``malloc`` so the C entry point hands them
to the caller), so everything after it is shared with sparsified kernels.
Built with the MLIR bindings' op builders.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, func, memref, scf, vector
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.native.loops import (
    LINE_BYTES,
    RegisterTranspose,
    constant_like,
    declare_madvise,
    dynamic_matrix,
    for_each,
    kernel_entry,
    lane_sums,
    mul,
    multiply_add,
    parallel,
    reduce_loop,
    result_buffer,
)
from sparse_mlir.dialects.native.loops import index as _index

from sparse_mlir.dsl.patterns import Sddmm, sddmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["GROUP", "K_UNROLL", "LINE_READS", "native_sddmm"]

# vectors of K per step of the dot products' loop, so a spilled B^T row address (a group has 16) is reloaded once
# per 4 FMAs; measured the same as 1 (kept: it costs nothing)
K_UNROLL = 4
GROUP = 16  # entries of a row per group at most (and at most the lanes): 8 and 4 measured the same
LINE_READS = 2  # reads per row of an off-line B[j,k] from which copying it onto lines pays


def native_sddmm(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                 vector_bits: int = 256) -> ir.Module | None:
    """The SDDMM module for ``spec`` in the current context, or ``None`` when it does not apply."""
    found = sddmm_operands(spec, formats)
    if found is None:
        return None
    with ir.Location.unknown():
        return _module(spec, formats, shapes, vector_bits, found)


def _module(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
            vector_bits: int, found: Sddmm) -> ir.Module:
    s_name, a_name, b_name = found.s, found.a, found.b
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
        declare_madvise()  # for ``result_buffer``
        block, values, _ = kernel_entry(spec.inputs, types, [], level)
        with ir.InsertionPoint(block):
            (pos, crd, val), (a,), (b,) = values[s_name], values[a_name], values[b_name]
            func.ReturnOp(_body(pos, crd, val, a, b, found.b_transposed, rows, cols, element, lanes, level))
    module.operation.verify()
    return module


def _on_lines(b: ir.Value, nnz: ir.Value, n_cols: ir.Value, inner: ir.Value, element: ir.Type, lanes: int
              ) -> tuple[ir.Value, ir.Value]:
    """``B[j,k]`` as the dot products read it, and whether that is a copy (to free): a copy on a cache line when
    ``B`` starts off one, its rows are whole lines (so every row is off by the same amount: each vector load
    straddles two lines) and S reads each row at least ``LINE_READS`` times on average.  numpy aligns to 16
    bytes; an unaligned B took 0.77 ms against 0.53 on a line (4096^2 at 1%, K=64, 1 thread).  The copy runs
    rows in parallel: a serial ``memref.copy`` took 0.14 ms of a 0.46 ms call at 2 threads."""
    c0 = _index(0)
    line = _index(LINE_BYTES)
    itemsize = _index(element.width // 8)
    off_line = arith.cmpi(arith.CmpIPredicate.ne,
                          arith.remui(memref.extract_aligned_pointer_as_index(b), line), c0)
    whole_lines = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(arith.muli(inner, itemsize), line), c0)
    reused = arith.cmpi(arith.CmpIPredicate.uge, nnz, arith.muli(n_cols, _index(LINE_READS)))
    copy = arith.andi(off_line, arith.andi(whole_lines, reused))
    matrix = dynamic_matrix(element)
    choice = scf.IfOp(copy, [matrix], has_else=True)
    with ir.InsertionPoint(choice.then_block):
        b_rows = memref.dim(b, c0)
        lined = memref.alloc(matrix, [b_rows, inner], [], alignment=LINE_BYTES)
        vec = ir.VectorType.get([lanes], element)

        def row(r: ir.Value) -> None:  # whole lines are whole vectors: the lanes' bytes divide a line's
            for_each(c0, inner, lambda kk: vector.store(vector.load(vec, b, [r, kk]), lined, [r, kk]), _index(lanes))

        parallel(b_rows, row)
        scf.YieldOp([lined])
    with ir.InsertionPoint(choice.else_block):
        scf.YieldOp([memref.cast(matrix, b)])
    return choice.results[0], copy


def _body(pos: ir.Value, crd: ir.Value, val: ir.Value, a: ir.Value, b: ir.Value, b_transposed: bool,
          rows: int | None, cols: int | None, element: ir.Type, lanes: int, level: list[ir.Type]) -> list[ir.Value]:
    """``rows``/``cols`` of ``S`` ``None`` (a shape-generic build): read from ``A``'s rows and ``B``'s columns
    (its rows when ``b_transposed``), which the C entry point has checked against ``S``'s."""
    c0, c1 = _index(0), _index(1)
    n_rows = _index(rows) if rows is not None else memref.dim(a, c0)
    n_cols = _index(cols) if cols is not None else memref.dim(b, c0 if b_transposed else c1)
    nnz = memref.dim(crd, c0)
    inner = memref.dim(a, c1)
    # C's positions: S's, copied into a buffer the caller will own
    out_pos = result_buffer(level[0], memref.dim(pos, c0))
    memref.copy(pos, out_pos)
    out_crd = result_buffer(level[1], nnz)  # filled group by group with the coordinates the dots read
    out_val = result_buffer(level[2], nnz)
    copied = None
    if b_transposed:  # B[j,k]: its rows are what each dot product reads
        bt, copied = _on_lines(b, nnz, n_cols, inner, element, lanes)
    else:  # B^T, so each dot product reads two contiguous rows
        matrix = dynamic_matrix(element)
        bt = memref.alloc(matrix, [n_cols, inner], [], alignment=LINE_BYTES)  # rows on lines when K fills lines
        RegisterTranspose(element, lanes).transpose(b, bt, inner, n_cols, parallel=True)
    vec = ir.VectorType.get([lanes], element)
    zeros = constant_like(vec, 0)
    lanes_index = _index(lanes)
    whole = arith.muli(arith.divui(inner, lanes_index), lanes_index)  # K in whole vectors; the rest is masked
    unrolled_step = _index(K_UNROLL * lanes)
    unrolled = arith.muli(arith.divui(inner, unrolled_step), unrolled_step)
    minor = ir.AffineMapAttr.get(ir.AffineMap.get_minor_identity(2, 1))
    masked = ir.ArrayAttr.get([ir.BoolAttr.get(False)])
    pad = constant_like(element, 0)

    def dots(i: ir.Value, js: list[ir.Value]) -> ir.Value:
        """Row ``i`` of A times rows ``js`` of B^T (a power of two of them, at most ``lanes``): lane ``e`` of
        the result is entry ``e``'s dot product.  Each loaded vector of A serves every entry; each entry has
        one vector accumulator, all summed at once by ``lane_sums``."""

        def chunk(read: Callable[[ir.Value, ir.Value, ir.Value], ir.Value], vectors: int = 1) -> Callable:
            def step(kk: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
                for v in range(vectors):
                    at = arith.addi(kk, _index(v * lanes)) if v else kk
                    a_vec = read(a, i, at)
                    accs = [multiply_add(acc, read(bt, j, at), a_vec) for j, acc in zip(js, accs)]
                return accs
            return step

        def load(matrix: ir.Value, r: ir.Value, kk: ir.Value) -> ir.Value:
            return vector.load(vec, matrix, [r, kk])

        def load_masked(matrix: ir.Value, r: ir.Value, kk: ir.Value) -> ir.Value:
            return vector.transfer_read(vec, matrix, [r, kk], minor, pad, masked)

        accs = reduce_loop(c0, unrolled, [zeros] * len(js), chunk(load, K_UNROLL), unrolled_step)
        accs = reduce_loop(unrolled, whole, accs, chunk(load), lanes_index)
        accs = reduce_loop(whole, inner, accs, chunk(load_masked), lanes_index)  # K % lanes: 0 or 1 step
        return lane_sums(accs)

    def group(i: ir.Value, first: ir.Value, count: int) -> None:
        """Entries ``first .. first + count`` of row ``i``: ``C = S * dot``, stored as one vector."""
        coords = vector.load(ir.VectorType.get([count], crd_type), crd, [first])
        vector.store(coords, out_crd, [first])
        js = [arith.index_castui(index, vector.extract(coords, [], [e])) for e in range(count)]
        sums = dots(i, js)
        if count < lanes:
            sums = vector.extract_strided_slice(ir.VectorType.get([count], element), sums, [0], [count], [1])
        vals = vector.load(sums.type, val, [first])
        vector.store(mul(vals, sums), out_val, [first])

    index = ir.IndexType.get()
    crd_type = level[1].element_type
    most = min(lanes, GROUP)
    full = _index(most)

    def row(i: ir.Value) -> None:
        start = arith.index_castui(index, memref.load(pos, [i]))
        stop = arith.index_castui(index, memref.load(pos, [arith.addi(i, c1)]))
        grouped = arith.addi(start, arith.muli(arith.divui(arith.subi(stop, start), full), full))
        for_each(start, grouped, lambda first: group(i, first, most), full)
        rest = arith.subi(stop, grouped)
        count = most // 2
        while count:  # the rest, < most entries, as groups of its binary digits, largest first
            present = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(rest, _index(count)), c0)
            branch = scf.IfOp(present)
            with ir.InsertionPoint(branch.then_block):
                group(i, arith.addi(grouped, arith.andi(rest, _index(~(2 * count - 1)))), count)
                scf.YieldOp([])
            count //= 2

    parallel(n_rows, row)
    if not b_transposed:
        memref.dealloc(bt)
    else:
        freed = scf.IfOp(copied)
        with ir.InsertionPoint(freed.then_block):
            memref.dealloc(bt)
            scf.YieldOp([])
    return [out_pos, out_crd, out_val]
