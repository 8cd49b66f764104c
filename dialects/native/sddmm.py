"""SDDMM, ``C[i,j] = S[i,j] * A[i,k] * B[k,j]`` with CSR ``S`` and ``C`` (``C`` takes ``S``'s pattern), emitted
instead of sparsified.

The sampled product of attention and graph networks: only the entries of
``S`` are computed, each a dot product of a row of ``A`` and a column of
``B``.  The sparsifier walks ``B`` by columns (stride ``N``) and one scalar
FMA chain per entry.  Here ``B`` is first transposed into a scratch
``[N, K]`` (in register tiles; its rows on cache lines) so both factors of
every dot product are contiguous: each worker its own when that is small,
else one shared (``_ReadCopy`` says why).  Then the workers claim rows of
``S``, all in one parallel region (``loops.in_phases``), a group of up to
``lanes`` entries of a row at a time (a row's entries in
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
    branch,
    constant_like,
    declare_madvise,
    declare_thread_count,
    dynamic_matrix,
    for_each,
    if_else,
    in_phases,
    kernel_entry,
    lane_sums,
    mul,
    multiply_add,
    reduce_loop,
    result_buffer,
    thread_count,
)
from sparse_mlir.dialects.native.loops import index as _index

from sparse_mlir.dsl.patterns import Sddmm, sddmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["GROUP", "K_UNROLL", "LINE_READS", "PRIVATE_BYTES", "PRIVATE_READS", "ROWS_PER_ITEM", "native_sddmm"]

# vectors of K per step of the dot products' loop, so a spilled B^T row address (a group has 16) is reloaded once
# per 4 FMAs; measured the same as 1 (kept: it costs nothing)
K_UNROLL = 4
GROUP = 16  # entries of a row per group at most (and at most the lanes): 8 and 4 measured the same
LINE_READS = 2  # reads per row of an off-line B[j,k] from which copying it onto lines pays
ROWS_PER_ITEM = 16  # rows (of S, or of B[j,k] to copy) a worker claims at a time
PRIVATE_BYTES = 4 << 20  # the largest copy of B each worker makes for itself (``_ReadCopy``)
PRIVATE_READS = 4  # entries of S per row of B and worker from which each worker copies B for itself


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
        declare_thread_count()  # for ``in_phases``
        block, values, _ = kernel_entry(spec.inputs, types, [], level)
        with ir.InsertionPoint(block):
            (pos, crd, val), (a,), (b,) = values[s_name], values[a_name], values[b_name]
            func.ReturnOp(_body(pos, crd, val, a, b, found.b_transposed, rows, cols, element, lanes, level))
    module.operation.verify()
    return module


class _ReadCopy:
    """The matrix the dot products read rows of (``B^T``, or ``B[j,k]`` on cache lines), made by filling it in
    steps of ``step`` rows (``fill(dst, t)`` fills rows ``t * step ..``, ``steps`` of them in all), or ``B``
    itself when ``needed`` is false.

    Whose copy: each worker's own (``private``) when it is small and each
    worker reads its rows several times over (``PRIVATE_BYTES``,
    ``PRIVATE_READS``), else one shared copy that the workers fill together
    first (``loops.in_phases``).  The 2-vCPU VMs measured here run their
    vCPUs on cores of one L3 at times and of two at others (a cache line's
    round trip between the threads 85-140 ns, or 310-380 ns): in the
    second case every row of a shared copy that the other thread wrote is a
    remote fetch, and a 2-thread SDDMM (4096^2 at 1%, K=64) took 0.41 ms,
    no faster than one thread, against 0.29-0.33 ms with a copy per worker;
    on one L3 the two measured the same within noise (0.23-0.26 shared,
    0.24-0.28 private).  With caches cold from a dense product timed in
    between (the benchmark's regime) they were alike on either: 0.57-0.61 ms
    shared and 0.58 private on one L3, 0.74 and 0.67-0.71 on two.
    """

    def __init__(self, needed: ir.Value, source: ir.Value, rows: ir.Value, inner: ir.Value, nnz: ir.Value,
                 element: ir.Type, step: int, fill: Callable[[ir.Value, ir.Value], None]):
        self.c0 = _index(0)
        self.rows, self.inner, self.fill = rows, inner, fill
        self.matrix = dynamic_matrix(element)
        self.steps = arith.ceildivui(rows, _index(step))
        workers = thread_count()
        small = arith.cmpi(arith.CmpIPredicate.ule, arith.muli(arith.muli(rows, inner), _index(element.width // 8)),
                           _index(PRIVATE_BYTES))
        reread = arith.cmpi(arith.CmpIPredicate.uge, nnz, arith.muli(arith.muli(rows, workers),
                                                                      _index(PRIVATE_READS)))
        self.private = arith.andi(needed, arith.andi(small, reread))
        true = arith.constant(ir.IntegerType.get_signless(1), 1)
        self.shared_needed = arith.andi(needed, arith.xori(self.private, true))
        self.shared = if_else(self.shared_needed, lambda: [self._alloc()],
                              lambda: [memref.cast(self.matrix, source)], [self.matrix])[0]

    def _alloc(self) -> ir.Value:
        return memref.alloc(self.matrix, [self.rows, self.inner], [], alignment=LINE_BYTES)

    def phase(self) -> tuple[ir.Value, Callable[[ir.Value, object], None]]:
        """The shared copy's filling, as a phase of ``loops.in_phases`` (no items unless it is made)."""
        return arith.select(self.shared_needed, self.steps, self.c0), lambda t, _: self.fill(self.shared, t)

    def setup(self) -> ir.Value:
        """The copy a worker reads: its own, filled here, or the shared one (or ``B``)."""
        def own() -> list[ir.Value]:
            mine = self._alloc()
            for_each(self.c0, self.steps, lambda t: self.fill(mine, t))
            return [mine]
        return if_else(self.private, own, lambda: [self.shared], [self.matrix])[0]

    def teardown(self, mine: ir.Value) -> None:
        branch(self.private, lambda: memref.dealloc(mine), lambda: None)

    def free(self) -> None:
        """After the workers: the shared copy, if one was made."""
        branch(self.shared_needed, lambda: memref.dealloc(self.shared), lambda: None)


def _on_lines(b: ir.Value, nnz: ir.Value, n_cols: ir.Value, inner: ir.Value, element: ir.Type, lanes: int
              ) -> _ReadCopy:
    """``B[j,k]`` as the dot products read it: a copy on a cache line when ``B`` starts off one, its rows are
    whole lines (so every row is off by the same amount: each vector load straddles two lines) and S reads
    each row at least ``LINE_READS`` times on average.  numpy aligns to 16 bytes; an unaligned B took 0.77 ms
    against 0.53 on a line (4096^2 at 1%, K=64, 1 thread).  A serial ``memref.copy`` in front of the threads
    took 0.14 ms of a 0.46 ms call at 2 threads."""
    c0 = _index(0)
    line = _index(LINE_BYTES)
    itemsize = _index(element.width // 8)
    off_line = arith.cmpi(arith.CmpIPredicate.ne,
                          arith.remui(memref.extract_aligned_pointer_as_index(b), line), c0)
    whole_lines = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(arith.muli(inner, itemsize), line), c0)
    reused = arith.cmpi(arith.CmpIPredicate.uge, nnz, arith.muli(n_cols, _index(LINE_READS)))
    copy = arith.andi(off_line, arith.andi(whole_lines, reused))
    b_rows = memref.dim(b, c0)
    vec = ir.VectorType.get([lanes], element)
    step = _index(ROWS_PER_ITEM)

    def rows(dst: ir.Value, t: ir.Value) -> None:  # whole lines are whole vectors: the lanes' bytes divide a line's
        first = arith.muli(t, step)
        for_each(first, arith.minui(arith.addi(first, step), b_rows), lambda r: for_each(
            c0, inner, lambda kk: vector.store(vector.load(vec, b, [r, kk]), dst, [r, kk]), _index(lanes)))

    return _ReadCopy(copy, b, b_rows, inner, nnz, element, ROWS_PER_ITEM, rows)


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
    if b_transposed:  # B[j,k]: its rows are what each dot product reads
        copy = _on_lines(b, nnz, n_cols, inner, element, lanes)
    else:  # B^T (rows on lines when K fills lines), so each dot product reads two contiguous rows
        transpose = RegisterTranspose(element, lanes)
        copy = _ReadCopy(arith.constant(ir.IntegerType.get_signless(1), 1), b, n_cols, inner, nnz, element, lanes,
                         lambda dst, t: transpose.outer_step(b, dst, inner, n_cols, arith.muli(t, _index(lanes))))
    vec = ir.VectorType.get([lanes], element)
    zeros = constant_like(vec, 0)
    lanes_index = _index(lanes)
    whole = arith.muli(arith.divui(inner, lanes_index), lanes_index)  # K in whole vectors; the rest is masked
    unrolled_step = _index(K_UNROLL * lanes)
    unrolled = arith.muli(arith.divui(inner, unrolled_step), unrolled_step)
    minor = ir.AffineMapAttr.get(ir.AffineMap.get_minor_identity(2, 1))
    masked = ir.ArrayAttr.get([ir.BoolAttr.get(False)])
    pad = constant_like(element, 0)

    def dots(i: ir.Value, js: list[ir.Value], bt: ir.Value) -> ir.Value:
        """Row ``i`` of A times rows ``js`` of ``bt`` (the ``_ReadCopy``; a power of two of them, at most
        ``lanes``): lane ``e`` of the result is entry ``e``'s dot product.  Each loaded vector of A serves every
        entry; each entry has one vector accumulator, all summed at once by ``lane_sums``."""

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

    def group(i: ir.Value, first: ir.Value, count: int, bt: ir.Value) -> None:
        """Entries ``first .. first + count`` of row ``i``: ``C = S * dot``, stored as one vector."""
        coords = vector.load(ir.VectorType.get([count], crd_type), crd, [first])
        vector.store(coords, out_crd, [first])
        js = [arith.index_castui(index, vector.extract(coords, [], [e])) for e in range(count)]
        sums = dots(i, js, bt)
        if count < lanes:
            sums = vector.extract_strided_slice(ir.VectorType.get([count], element), sums, [0], [count], [1])
        vals = vector.load(sums.type, val, [first])
        vector.store(mul(vals, sums), out_val, [first])

    index = ir.IndexType.get()
    crd_type = level[1].element_type
    most = min(lanes, GROUP)
    full = _index(most)

    def row(i: ir.Value, bt: ir.Value) -> None:
        start = arith.index_castui(index, memref.load(pos, [i]))
        stop = arith.index_castui(index, memref.load(pos, [arith.addi(i, c1)]))
        grouped = arith.addi(start, arith.muli(arith.divui(arith.subi(stop, start), full), full))
        for_each(start, grouped, lambda first: group(i, first, most, bt), full)
        rest = arith.subi(stop, grouped)
        count = most // 2
        while count:  # the rest, < most entries, as groups of its binary digits, largest first
            present = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(rest, _index(count)), c0)
            branch = scf.IfOp(present)
            with ir.InsertionPoint(branch.then_block):
                group(i, arith.addi(grouped, arith.andi(rest, _index(~(2 * count - 1)))), count, bt)
                scf.YieldOp([])
            count //= 2

    row_step = _index(ROWS_PER_ITEM)

    def rows(item: ir.Value, bt: ir.Value) -> None:
        first = arith.muli(item, row_step)
        for_each(first, arith.minui(arith.addi(first, row_step), n_rows), lambda i: row(i, bt))

    # one parallel region (``in_phases``): the shared copy's filling, if any, then the rows of S
    in_phases([copy.phase(), (arith.ceildivui(n_rows, row_step), rows)], copy.setup, copy.teardown)
    copy.free()
    return [out_pos, out_crd, out_val]
