"""A CSR SpMV, ``y[i] = A[i,j] * x[j]``, with independent accumulators and a prefetch of ``x``.

On matrices far larger than the caches SpMV waits on memory: the stream of
values and coordinates is sequential (the hardware prefetcher keeps up),
but every ``x[crd[k]]`` is a random access.  The sparsified loop issues
those loads only as it reaches them, one chain of dependent adds per row.
Here each row's nonzeros are taken ``UNROLL`` at a time into that many
accumulators, and the loop prefetches ``x[crd[k + DISTANCE]]`` (clamped to
the last entry) so the random lines are in flight long before they are
needed; rows shorter than ``SHORT_ROW`` skip all that for one plain loop.

Short rows (meshes, graphs: a handful of nonzeros each) were measured in
three more forms on a Zen 5 host with 1 thread (METIS mdual, 4 nonzeros a
row, against scipy's time; session 6 figures): a row as one masked vector
(masked loads, a gather of ``x``, a horizontal sum) 0.66x with 4 lanes and
0.25-0.38x with 8 (the gathers are slow there); a fixed-width branch-free
row (every lane loaded, clamped, the lanes past the end selected away)
0.90-1.02x; the plain loop kept here 0.98-1.11x; a prefetch of ``x`` for
short rows at 32-256 entries ahead, any locality, changed nothing (the
out-of-order window already covers the random reads of ``x``, which are
half the time: the same rows with local columns take half as long).
Session 27, C prototypes against gcc's plain loop on mdual (2 threads,
0.29 ms; torch's MKL 0.30 ms): eight rows a vector, a lane a row (masked
gathers of coordinates, values and ``x``, one vector store of ``y``)
1.85x slower; the plain loop without its values (an iso-valued matrix)
only 10% faster, so the values' bytes are not what bounds it.

Where vector gathers pay (``CpuTarget.fast_gathers``: recent Xeons, Zen 5)
long rows instead take a vector register of entries at a time: a load of
values, a load of coordinates, a gather of ``x`` and a vector FMA, two
accumulators deep, then one more vector and the scalar tail
(``RowSums._gathered``).  On a Zen 5 host, 2 threads, against the scalar
loop (session 23, alternating processes): 4096^2 at 10% 1.26-1.40x, mdual
in float64 1.2x, bcsstk13 and DLMC rows 1.1x.  The LLVM-packed 4-lane
gathers of the four scalar accumulators lost 5-10% on the same long rows.
Coordinates are gathered as stored, sign-extended: every index buffer is
kept below its signed maximum (``dtypes.index_dtype``).

Rows run as an ``scf.parallel`` loop (threaded, guided schedule, by the CPU
pipeline).  The function has the sparse assembler's signature, so
everything after it is shared with sparsified kernels.  A ``None`` row count
(a shape-generic build) is read from ``y``, which the C entry point has
checked against ``A``'s rows.  Built with the MLIR bindings' op builders.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, func, memref, vector
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.native.loops import (
    add,
    constant_like,
    dynamic_vector,
    if_else,
    index,
    is_float,
    kernel_entry,
    load_index,
    mul,
    parallel,
    reduce_loop,
)

from sparse_mlir.dialects.native.target import CpuTarget
from sparse_mlir.dsl.patterns import spmv_operands, unscaled
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["DISTANCE", "SHORT_ROW", "UNROLL", "RowSums", "gather_lanes", "native_spmv", "row_term"]

UNROLL = 4
# rows shorter than this take one plain loop: no unrolled loop, prefetch or combining adds for them
# (mdual, 4 nonzeros per row: 15% faster in three alternating runs; long-row matrices unchanged)
SHORT_ROW = 2 * UNROLL
DISTANCE = 128  # nonzeros ahead, hundreds of cycles of memory latency (best of 32-256 on 1M x 1M)


def native_spmv(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                target: CpuTarget = CpuTarget()) -> ir.Module | None:
    """The SpMV module for ``spec`` in the current context, or ``None`` when it does not apply.

    ``target`` says whether long rows gather ``x`` a vector at a time (``gather_lanes``).
    """
    core, scale = unscaled(spec)
    found = spmv_operands(core, formats)
    if found is None:
        return None
    with ir.Location.unknown():
        return _module(spec, formats[found[0]], shapes[found[0]][0], *found, scale, target)


def _module(spec: KernelSpec, fmt: Format, rows: int | None, a_name: str, x_name: str,
            scale: float | int, target: CpuTarget) -> ir.Module:
    element = ir.Type.parse(TYPE_NAMES[spec.dtype.name])
    levels = [dynamic_vector(ir.IntegerType.get_signless(w)) for w in (fmt.pos_width or 64, fmt.crd_width or 64)]
    types = {a_name: [*levels, dynamic_vector(element)], x_name: [dynamic_vector(element)]}
    y_type = dynamic_vector(element)
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
        block, buffers, (y,) = kernel_entry(spec.inputs, types, [y_type], [y_type], fills_output=True)
        with ir.InsertionPoint(block):
            sums = RowSums(*buffers[a_name], *buffers[x_name], y, element, scale=scale,
                           lanes=gather_lanes(target, element.width))
            sums.emit(index(rows) if rows is not None else memref.dim(y, index(0)))
            func.ReturnOp([y])
    module.operation.verify()
    return module


def gather_lanes(target: CpuTarget, element_bits: int) -> int:
    """Entries of a long row taken a vector at a time on ``target`` (``RowSums``' ``lanes``): a full vector
    register where gathers pay (``CpuTarget.fast_gathers``), else 0 (scalar loads)."""
    return target.vector_bits // element_bits if target.fast_gathers else 0


def row_term(val: ir.Value, crd: ir.Value, x: ir.Value | None, k: ir.Value) -> ir.Value:
    """``val[k] * x[crd[k]]``, or ``val[k]`` for a row sum (no ``x``): one term of a sparse row times ``x``."""
    value = memref.load(val, [k])
    return value if x is None else mul(value, memref.load(x, [load_index(crd, k)]))


class RowSums:
    """The parallel loop over compressed rows: ``y[row] = sum of val[k] * x[crd[k]]`` (or of ``val[k]``: a row
    sum, ``x`` is ``None``) over each row's entries ``pos[r]..pos[r+1]``.

    ``row`` is the stored row ``r`` itself (CSR, or a CSC read transposed:
    the outer level is the result's index), or ``stored[r]`` when the outer
    level stores only some rows (DCSR: ``stored`` is its outer coordinates).
    Long rows are unrolled into independent accumulators and prefetch
    ``x`` ahead, or with ``lanes`` (``gather_lanes``) gather ``x`` that many
    entries a step (see the module docstring); short ones take one plain loop.
    Each finished sum is multiplied by ``scale`` (``y[i] = 2 * A[i,j] * x[j]``)
    unless it is 1.
    """

    def __init__(self, pos: ir.Value, crd: ir.Value, val: ir.Value, x: ir.Value | None, y: ir.Value,
                 element: ir.Type, stored: ir.Value | None = None, scale: float | int = 1, lanes: int = 0) -> None:
        self.pos, self.crd, self.val, self.x, self.y, self.stored = pos, crd, val, x, y, stored
        self.lanes = lanes if x is not None else 0
        self.element = element
        self.zero = constant_like(element, 0)
        self.scale = None if scale == 1 else constant_like(element, scale)
        nnz = memref.dim(crd, index(0))
        # the last entry (0 when there is none): where the prefetch of a row near the end stops
        self.last = arith.subi(arith.maxui(nnz, index(1)), index(1))

    def emit(self, count: ir.Value) -> None:
        """Rows ``0..count`` of the outer level, in parallel."""
        parallel(count, self._row)

    def _row(self, r: ir.Value) -> None:
        lo = load_index(self.pos, r)
        hi = load_index(self.pos, arith.addi(r, index(1)))
        length = arith.subi(hi, lo)
        long = arith.cmpi(arith.CmpIPredicate.uge, length, index(SHORT_ROW))
        wide = self._gathered if self.lanes else self._unrolled
        start, partial = if_else(long, lambda: wide(lo, hi, length), lambda: [lo, self.zero],
                                 [ir.IndexType.get(), self.element])
        (total,) = reduce_loop(start, hi, [partial], lambda k, s: [add(s[0], self._term(k))])
        if self.scale is not None:
            total = mul(total, self.scale)
        memref.store(total, self.y, [r if self.stored is None else load_index(self.stored, r)])

    def _term(self, k: ir.Value) -> ir.Value:
        return row_term(self.val, self.crd, self.x, k)

    def _unrolled(self, lo: ir.Value, hi: ir.Value, length: ir.Value) -> list[ir.Value]:
        """A long row's entries ``UNROLL`` a step into as many accumulators, prefetching ``x`` ahead; returns
        where the remaining entries start and the sum so far."""
        unroll = index(UNROLL)
        body_end = arith.subi(hi, arith.remui(length, unroll))

        def step(k: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:
            if self.x is not None:
                ahead = arith.minui(arith.addi(k, index(DISTANCE)), self.last)
                memref.prefetch(self.x, [load_index(self.crd, ahead)], False, 3, True)
            return [add(s, self._term(arith.addi(k, index(u)))) for u, s in enumerate(sums)]

        sums = reduce_loop(lo, body_end, [self.zero] * UNROLL, step, unroll)
        total = sums[0]
        for s in sums[1:]:
            total = add(total, s)
        return [body_end, total]

    def _gathered(self, lo: ir.Value, hi: ir.Value, length: ir.Value) -> list[ir.Value]:
        """A long row's entries ``lanes`` at a time: a vector of values, a vector of coordinates, a gather of
        ``x`` and a vector FMA, in two accumulators; returns where the remaining entries start and the sum."""
        lanes = self.lanes
        vec = ir.VectorType.get([lanes], self.element)
        crd_vec = ir.VectorType.get([lanes], ir.MemRefType(self.crd.type).element_type)
        mask = vector.constant_mask(ir.VectorType.get([lanes], ir.IntegerType.get_signless(1)), [lanes])
        zeros = constant_like(vec, 0)
        floating = is_float(self.element)

        def chunk(k: ir.Value, acc: ir.Value) -> ir.Value:
            values = vector.load(vec, self.val, [k])
            xs = vector.gather(vec, self.x, [index(0)], vector.load(crd_vec, self.crd, [k]), mask, zeros)
            return vector.fma(values, xs, acc) if floating else add(acc, mul(values, xs))

        pair = index(2 * lanes)
        pair_end = arith.subi(hi, arith.remui(length, pair))
        accs = reduce_loop(lo, pair_end, [zeros, zeros],
                           lambda k, s: [chunk(k, s[0]), chunk(arith.addi(k, index(lanes)), s[1])], pair)
        one = arith.cmpi(arith.CmpIPredicate.uge, arith.subi(hi, pair_end), index(lanes))
        (acc,) = if_else(one, lambda: [chunk(pair_end, accs[0])], lambda: [accs[0]], [vec])
        start = arith.select(one, arith.addi(pair_end, index(lanes)), pair_end)
        total = vector.reduction(self.element, vector.CombiningKind.ADD, add(acc, accs[1]))
        return [start, total]
