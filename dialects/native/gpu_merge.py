"""Deterministic merge-path CSR SpMV for skewed rows (Merrill & Garland), per thread, with a carry fix-up pass.

The deterministic CSR SpMV (``gpu_spmv.gpu_spmv`` without the atomic row
splitting) gives each row a group of lanes, so one row of 500k entries
keeps one warp busy while the rest of the GPU idles (10.7 ms against
cupyx's 0.74 ms on an H200).  Merge path balances rows and nonzeros
together: the ``rows`` row ends (``pos[1:]``) and the ``nnz`` nonzeros are
merged into one path of ``rows + nnz`` items, and each of ``threads``
threads takes an equal share of it, whatever the row lengths:

1. ``spmv_merge``: thread ``t`` finds where diagonal ``t * share`` crosses
   the path by binary search (``row`` ends consumed + nonzeros consumed =
   the diagonal), then walks its share: a nonzero adds ``val * x[crd]`` to
   the running sum, a row end stores the sum as ``y[row]`` and restarts it.
   The sum of the row it stops in (a part of a row that a later thread
   ends) is its carry, kept in scratch with the row;
2. ``spmv_merge_fixup``: the first thread carrying a row adds, in order,
   every carry of that row to ``y[row]`` (one writer per row: no atomics).

Every row end is stored by exactly one thread, so ``y`` needs no zeroing,
and the sums are the same on every run.  This is the partitioning of CUB's
``DeviceSpmv`` at thread granularity, without its shared-memory staging of
tiles (a next step once a GPU run has measured this one); a thread's items
are contiguous, so its loads reuse cache lines but are not coalesced
across the warp.  Built with the bindings' op builders; the program keeps
the lanes-per-row kernel for rows that are not skewed (``Launch.when``),
and the runtime runs the merge path for skewed rows only with
``SPARSE_MLIR_MERGE_SPMV=1`` (``knobs.merge_spmv``) until a GPU run confirms it.
"""

from __future__ import annotations

from dataclasses import replace

from mlir import ir
from mlir.dialects import arith, math, memref, scf
from sparse_mlir.dialects.native.gpu import NativeKernels
from sparse_mlir.dialects.native.gpu_build import (
    BLOCK,
    KernelModule,
    add,
    bisect,
    const,
    dense_type,
    element_type,
    global_thread,
    index_type,
    level_buffer_types,
    load_index,
    when,
    zero,
)
from sparse_mlir.dialects.native.gpu_spmv import gpu_spmv

from sparse_mlir.abi.gpu_program import KernelArg, Launch
from sparse_mlir.dsl.patterns import spmv_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["MAX_THREADS", "carry_fixup", "gpu_spmv_merge", "merge_threads"]

MAX_THREADS = 1 << 18  # about one resident thread per H200 core slot: a share of ~200 items at 50M nonzeros
Shapes = dict[str, tuple[int | None, ...]]


def merge_threads(rows: int) -> int:
    """Threads of the merge path: a power of two at or above ``rows`` (at least a block, at most ``MAX_THREADS``).

    A static count, so the carries fit a scratch buffer of known size; the
    share per thread, ``ceil((rows + nnz) / threads)``, is computed at run time.
    """
    threads = BLOCK
    while threads < rows and threads < MAX_THREADS:
        threads *= 2
    return threads


def gpu_spmv_merge(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, deterministic: bool
                   ) -> NativeKernels | None:
    """The deterministic CSR SpMV with the merge path for skewed rows, or ``None`` (not deterministic, not a
    float32/float64 CSR SpMV: the other SpMV kernels take those)."""
    found = spmv_operands(spec, formats)
    elt = element_type(spec)
    if not deterministic or found is None or elt is None:
        return None
    base = gpu_spmv(spec, formats, shapes, deterministic=True)
    if base is None:
        return None
    a, _ = found
    fmt = formats[a]
    rows, cols = shapes[a]
    threads = merge_threads(rows)
    kernels = KernelModule(base.module)
    pos, crd, val, x_arg, y_arg = base.launches[0].args[:5]
    carry_rows, carry_sums = KernelArg("scratch", 0, (threads,)), KernelArg("scratch", 1, (threads,))
    pos_t, crd_t, val_t = level_buffer_types(fmt, elt)
    rows_t, sums_t = dense_type((threads,), ir.IntegerType.get_signless(64)), dense_type((threads,), elt)
    y_t = dense_type((rows,), elt)
    kernels.kernel("spmv_merge", [pos_t, crd_t, val_t, dense_type((cols,), elt), y_t, rows_t, sums_t],
                   _merge(rows, threads))
    kernels.kernel("spmv_merge_fixup", [rows_t, sums_t, y_t], carry_fixup(rows, threads))
    grid = (threads // BLOCK, 1, 1)
    launches = (replace(base.launches[0], when="balanced"),
                Launch("spmv_merge", grid, (BLOCK, 1, 1), (pos, crd, val, x_arg, y_arg, carry_rows, carry_sums),
                       when="skewed", fills_output=True),
                Launch("spmv_merge_fixup", grid, (BLOCK, 1, 1), (carry_rows, carry_sums, y_arg), when="skewed",
                       fills_output=True))
    return NativeKernels(kernels.module, launches, (((threads,), "int64"), ((threads,), spec.dtype.name)))


def _path_split(pos: ir.Value, diagonal: ir.Value, rows: ir.Value, nnz: ir.Value) -> ir.Value:
    """Row ends consumed where the merge path crosses ``diagonal``: the first ``r`` in
    ``[max(0, diagonal - nnz), min(diagonal, rows))`` with ``pos[r + 1] > diagonal - r - 1``, else the upper end."""
    low = arith.select(arith.cmpi(arith.CmpIPredicate.ugt, diagonal, nnz), arith.subi(diagonal, nnz), const(0))

    def ended(pivot: ir.Value) -> ir.Value:  # row ``pivot`` ends before the path's nonzero on ``diagonal``
        row_end = load_index(pos, arith.addi(pivot, const(1)))
        nonzero = arith.subi(arith.subi(diagonal, pivot), const(1))  # diagonal - pivot - 1 >= 0 inside the range
        return arith.cmpi(arith.CmpIPredicate.ule, row_end, nonzero)

    return bisect(low, arith.minui(diagonal, rows), ended)


def _merge(rows: int, threads: int):
    """Pass 1: walk this thread's share of the merge path; store finished rows, keep the carry."""
    def build(pos, crd, val, x, y, carry_rows, carry_sums) -> None:
        elt = ir.MemRefType(val.type).element_type
        idx = index_type()
        thread = global_thread()
        nnz = memref.dim(crd, const(0))
        n_rows = const(rows)
        total = arith.addi(n_rows, nnz)
        share = arith.divui(arith.addi(total, const(threads - 1)), const(threads))
        first = arith.minui(arith.muli(thread, share), total)
        last = arith.minui(arith.addi(first, share), total)
        row0 = _path_split(pos, first, n_rows, nnz)
        zero = arith.constant(elt, 0.0)
        walk = scf.ForOp(first, last, const(1), [row0, arith.subi(first, row0), zero])
        with ir.InsertionPoint(walk.body):
            row, nz, acc = walk.inner_iter_args
            in_row = arith.cmpi(arith.CmpIPredicate.ult, nz, load_index(pos, arith.addi(row, const(1))))
            step = scf.IfOp(in_row, [idx, idx, elt], has_else=True)
            with ir.InsertionPoint(step.then_block):  # a nonzero of the row
                product = math.fma(memref.load(val, [nz]), memref.load(x, [load_index(crd, nz)]), acc)
                scf.YieldOp([row, arith.addi(nz, const(1)), product])
            with ir.InsertionPoint(step.else_block):  # the row's end: its sum (this thread's part) is stored
                memref.store(acc, y, [row])
                scf.YieldOp([arith.addi(row, const(1)), nz, zero])
            scf.YieldOp(list(step.results))
        memref.store(arith.index_cast(ir.IntegerType.get_signless(64), walk.results[0]), carry_rows, [thread])
        memref.store(walk.results[2], carry_sums, [thread])
    return build


def carry_fixup(rows: int, threads: int):
    """Pass 2: the first thread carrying a row adds every carry of that row, in order, to ``y[row]``.

    Shared with the segmented COO SpMV (``gpu_segments``): ``threads``
    carries ``(row, sum)``, a row's in consecutive threads, row ``rows`` for none.
    """
    def build(carry_rows, carry_sums, y) -> None:
        idx = index_type()
        elt = ir.MemRefType(carry_sums.type).element_type
        thread = global_thread()

        def row_of(at: ir.Value) -> ir.Value:
            return arith.index_cast(idx, memref.load(carry_rows, [at]))

        row = row_of(thread)
        previous = row_of(arith.select(arith.cmpi(arith.CmpIPredicate.eq, thread, const(0)), thread,
                                       arith.subi(thread, const(1))))
        leads = arith.ori(arith.cmpi(arith.CmpIPredicate.eq, thread, const(0)),
                          arith.cmpi(arith.CmpIPredicate.ne, previous, row))
        real = arith.cmpi(arith.CmpIPredicate.ult, row, const(rows))
        with when(arith.andi(leads, real)):
            loop = scf.WhileOp([idx, elt], [thread, zero(elt)])
            before = loop.before.blocks.append(idx, elt)
            with ir.InsertionPoint(before):
                at, acc = before.arguments
                inside = arith.cmpi(arith.CmpIPredicate.ult, at, const(threads))
                same = scf.IfOp(inside, [ir.IntegerType.get_signless(1)], has_else=True)
                with ir.InsertionPoint(same.then_block):
                    scf.YieldOp([arith.cmpi(arith.CmpIPredicate.eq, row_of(at), row)])
                with ir.InsertionPoint(same.else_block):
                    scf.YieldOp([arith.constant(ir.IntegerType.get_signless(1), 0)])
                scf.ConditionOp(same.results[0], [at, acc])
            after = loop.after.blocks.append(idx, elt)
            with ir.InsertionPoint(after):
                at, acc = after.arguments
                scf.YieldOp([arith.addi(at, const(1)), add(acc, memref.load(carry_sums, [at]))])
            memref.store(add(memref.load(y, [row]), loop.results[1]), y, [row])
    return build
