"""Deterministic COO SpMV as a segmented reduction: equal shares of nonzeros per thread, carries fixed up in order.

A row-sorted COO operand stores each nonzero's row (``crd0``), so a thread
can take any run of nonzeros and know where rows change without searching
the positions.  ``threads`` threads (a static count, ``merge_threads(rows)``)
each take ``ceil(nnz / threads)`` consecutive nonzeros, whatever the row
lengths, and sum each run of one row:

* a run that starts a row (the first nonzero, or a row change) is the row's
  *head*: its sum is stored as ``y[row]``, by this thread alone;
* a run that continues a row from the previous share (only a share's first
  run can) is a *carry*, kept in scratch with its row;

then ``coo_spmv_fixup`` (``gpu_merge.carry_fixup``) has the first thread
carrying each row add that row's carries, in order, to ``y[row]``.  No
atomics, so the sums are the same on every run, and one long row is split
across as many threads as its length needs.  Rows with no nonzeros are
never stored: the runtime zeroes ``y`` first.  Built with the bindings' op
builders; it replaces a thread per row that found its nonzeros by binary
search (two searches per row, and one thread for a whole long row).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, memref, scf
from sparse_mlir.dialects.native.gpu_build import (
    BLOCK,
    KernelModule,
    add,
    const,
    fma,
    global_thread,
    load_index,
    when,
    zero,
)
from sparse_mlir.dialects.native.gpu_merge import carry_fixup, merge_threads

from sparse_mlir.abi.gpu_program import KernelArg, Launch

__all__ = ["segmented_spmv"]


def segmented_spmv(kernels: KernelModule, params: list[ir.Type], args: tuple[KernelArg, ...], rows: int,
                   has_x: bool = True) -> tuple[tuple[Launch, ...], tuple[tuple[tuple[int, ...], str], ...]]:
    """Add ``coo_spmv_segments`` and ``coo_spmv_fixup`` to ``kernels``; their launches and scratch.

    ``params`` and ``args`` are the COO SpMV's (``pos0``, ``crd0``, ``crd1``,
    ``values``, ``x``, ``y``), as ``gpu_formats`` builds them; without ``x``
    (``has_x=False``) it is the row sum ``y[i] = A[i,j]``.
    """
    threads = merge_threads(rows)
    elt = ir.MemRefType(params[3]).element_type
    rows_t = ir.MemRefType.get([threads], ir.IntegerType.get_signless(64), loc=ir.Location.unknown())
    sums_t = ir.MemRefType.get([threads], elt, loc=ir.Location.unknown())
    kernels.kernel("coo_spmv_segments", [*params, rows_t, sums_t], _segments(rows, threads, has_x))
    kernels.kernel("coo_spmv_fixup", [rows_t, sums_t, params[-1]], carry_fixup(rows, threads))
    carries = (KernelArg("scratch", 0, (threads,)), KernelArg("scratch", 1, (threads,)))
    grid = (threads // BLOCK, 1, 1)
    launches = (Launch("coo_spmv_segments", grid, (BLOCK, 1, 1), (*args, *carries)),
                Launch("coo_spmv_fixup", grid, (BLOCK, 1, 1), (*carries, args[-1])))
    return launches, (((threads,), "int64"), ((threads,), str(_numpy_name(elt))))


def _numpy_name(elt: ir.Type) -> str:
    if isinstance(elt, ir.IntegerType):
        return f"int{ir.IntegerType(elt).width}"
    return "float32" if isinstance(elt, ir.F32Type) else "float64"


def _segments(rows: int, threads: int, has_x: bool):
    """Pass 1: sum this thread's share run by run; store heads, keep the carry."""
    def build(*args: ir.Value) -> None:
        _, crd0, crd1, val, *x, y, carry_rows, carry_sums = args
        x = x[0] if has_x else None
        elt = ir.MemRefType(val.type).element_type
        i64 = ir.IntegerType.get_signless(64)
        thread = global_thread()
        memref.store(arith.constant(i64, rows), carry_rows, [thread])  # no carry unless one is found
        memref.store(zero(elt), carry_sums, [thread])
        nnz = memref.dim(val, const(0))
        share = arith.divui(arith.addi(nnz, const(threads - 1)), const(threads))
        first = arith.minui(arith.muli(thread, share), nnz)
        last = arith.minui(arith.addi(first, share), nnz)

        def flush(acc: ir.Value, row: ir.Value, head: ir.Value) -> None:
            """A finished run: a head is stored as the row's sum, a continuation kept as the carry."""
            branch = scf.IfOp(head, has_else=True)
            with ir.InsertionPoint(branch.then_block):
                memref.store(acc, y, [row])
                scf.YieldOp([])
            with ir.InsertionPoint(branch.else_block):
                memref.store(arith.index_cast(i64, row), carry_rows, [thread])
                memref.store(acc, carry_sums, [thread])
                scf.YieldOp([])

        with when(arith.cmpi(arith.CmpIPredicate.ult, first, last)):
            row0 = load_index(crd0, first)
            before = load_index(crd0, arith.select(arith.cmpi(arith.CmpIPredicate.eq, first, const(0)), first,
                                                   arith.subi(first, const(1))))
            head0 = arith.ori(arith.cmpi(arith.CmpIPredicate.eq, first, const(0)),
                              arith.cmpi(arith.CmpIPredicate.ne, before, row0))
            loop = scf.ForOp(first, last, const(1), [zero(elt), row0, head0])
            with ir.InsertionPoint(loop.body):
                k = loop.induction_variable
                acc, row, head = loop.inner_iter_args
                current = load_index(crd0, k)
                changed = arith.cmpi(arith.CmpIPredicate.ne, current, row)
                with when(changed):
                    flush(acc, row, head)
                start = arith.select(changed, zero(elt), acc)
                head_now = arith.ori(changed, head)
                value = memref.load(val, [k])
                total = fma(value, memref.load(x, [load_index(crd1, k)]), start) if x is not None else \
                    add(start, value)
                scf.YieldOp([total, current, head_now])
            flush(*loop.results)
    return build
