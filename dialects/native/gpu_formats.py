"""SpMV and SpMM on the GPU for COO, CSC and DCSR operands: parallel kernels where the sparsifier ran one thread.

The sparsifier's GPU mapping runs any loop nest that is not only parallel
loops as a single-thread kernel (``lowering.cuda``: ``notes=("serial",)``);
a COO, CSC or DCSR SpMV is such a nest (its outer level is compressed, or
the reduction is the outer loop).  These kernels map the same products onto
many threads instead, built with the bindings' op builders:

* **COO** (row-sorted coordinates ``crd0``, ``crd1``): the SpMV gives every
  thread ``CHUNK`` consecutive nonzeros whatever their rows (balanced for
  skewed rows) and adds each run of one row's partial sum into ``y``
  atomically; deterministic, it is a segmented reduction with carries fixed
  up in order instead (``gpu_segments``).  The SpMM gives a warp per row,
  which finds the row's entries by binary search over ``crd0``, sums them
  in order and stores the row.
* **DCSR** (stored rows ``crd0`` with positions ``pos1``): a thread (SpMV)
  or a warp (SpMM) per stored row, the grid sized from the stored rows at
  launch (``GridRule``); rows not stored stay zero (the runtime zeroes ``y``).
* **CSC** (columns ``pos1``, rows ``crd1``), and CSR read transposed
  (``y[j] = A[i,j] * x[i]``): a thread (SpMV) or a warp (SpMM) per outer
  entry scatters ``A[i,j] * x[j]`` into ``y[i]`` atomically, so for floats
  only with ``deterministic=False``; CSC read transposed gathers instead, a
  thread or warp per outer entry (no atomics).  With ``deterministic=True``
  a float scatter is left to the sparsifier (one thread): a deterministic
  kernel needs a transposed copy kept with the tensor, not built yet.

Row and column sums (``y[i] = A[i,j]``) run the SpMV kernels without ``x``.
The SpMM kernels give lanes consecutive columns of ``B`` and ``C``
(coalesced), and each stored entry of ``A`` is read once per warp.
"""

from __future__ import annotations

import math as pymath
from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, gpu, memref, scf
from sparse_mlir.dialects.native.gpu import NativeKernels
from sparse_mlir.dialects.native.gpu_build import (
    BLOCK,
    WARP,
    KernelModule,
    add,
    atomic_add,
    buffer_refs,
    const,
    dense_type,
    element_type,
    fma,
    global_thread,
    level_buffer_types,
    load_index,
    mul,
    search,
    sum_range,
    when,
    zero,
)
from sparse_mlir.dialects.native.gpu_segments import segmented_spmv

from sparse_mlir.abi.gpu_program import GridRule, KernelArg, Launch
from sparse_mlir.dsl.patterns import format_kind, product_operands, scatters
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["CHUNK", "gpu_format_products"]

CHUNK = 16  # nonzeros per thread in the atomic COO SpMV (as the row-splitting CSR SpMV)
Shapes = dict[str, tuple[int | None, ...]]


def gpu_format_products(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, deterministic: bool
                        ) -> NativeKernels | None:
    """The parallel SpMV or SpMM for a COO, CSC or DCSR ``A`` (module docstring), or ``None`` when it does not apply.

    ``None`` too for float16 (summed in float16 otherwise) and for float CSC
    when ``deterministic`` (its kernels add atomically; integer sums do not
    depend on the order).  Shape-generic with ``None`` sizes: the kernels
    read the rows and columns from the result's descriptor and the outer
    entries of a CSC from its positions, and the grids come from those at
    launch; the deterministic COO SpMV (its carries fill scratch sized by the
    rows) needs static sizes.
    """
    elt, found = element_type(spec), product_operands(spec, formats)
    if elt is None or found is None:
        return None
    a, b = found
    fmt, kind = formats[a], format_kind(formats[a])
    out_shape = shapes[spec.output]
    # the scatter kernels add atomically; integer sums are the same in any order, float sums are not
    if scatters(spec, formats, a) and deterministic and spec.dtype.kind == "f":
        return None
    refs = buffer_refs(spec, formats)
    buffers = tuple(KernelArg("buffer", refs[a] + n, (None,)) for n in range(len(fmt.buffer_names)))
    dense = ((KernelArg("buffer", refs[b], shapes[b]),) if b is not None else ()) + \
        (KernelArg("buffer", refs[spec.output], out_shape),)
    params = [*level_buffer_types(fmt, elt), *((dense_type(shapes[b], elt),) if b is not None else ()),
              dense_type(out_shape, elt)]
    rows = shapes[a][0]
    matrix = len(out_shape) == 2  # an SpMM (C has columns), else an SpMV or a row sum
    kernels = KernelModule()
    args = (*buffers, *dense)
    out = dense[-1]

    def spmv(build: Callable[..., None]) -> Callable[..., None]:
        return build if b is not None else _without_x(build)

    if kind == "coo" and not matrix and not deterministic:
        kernels.kernel("coo_spmv_chunks", params, spmv(_coo_spmv_chunks))
        launch = Launch("coo_spmv_chunks", GridRule(buffers[1].ref, BLOCK * CHUNK), (BLOCK, 1, 1), args)
    elif kind == "coo" and not matrix:
        if rows is None:
            return None
        launches, scratch = segmented_spmv(kernels, params, args, rows, has_x=b is not None)
        return NativeKernels(kernels.module, launches, scratch)
    elif kind == "coo":
        kernels.kernel("coo_spmm", params, _coo_spmm)
        launch = Launch("coo_spmm", _per_unit(out, 0, rows, BLOCK // WARP), (BLOCK, 1, 1), args,
                        fills_output=True)
    elif kind == "dcsr":
        name = "dcsr_spmm" if matrix else "dcsr_spmv"
        kernels.kernel(name, params, _dcsr_spmm if matrix else spmv(_dcsr_spmv))
        launch = Launch(name, GridRule(buffers[1].ref, BLOCK // WARP if matrix else BLOCK), (BLOCK, 1, 1), args)
    else:
        # CSC, or CSR transposed (scatter: the outer level is the sum's index, each outer entry scatters into the
        # result), or CSC transposed (gather: the outer level is the result's index, each outer entry sums)
        name = ("csc" if scatters(spec, formats, a) else "gather") + ("_spmm" if matrix else "_spmv")
        builders = {"csc_spmm": _csc_spmm, "csc_spmv": spmv(_csc_spmv), "gather_spmm": _gather_spmm,
                    "gather_spmv": spmv(_gather_spmv)}
        kernels.kernel(name, params, builders[name])
        outer = shapes[a][fmt.dim_to_lvl[0].dim]
        per_block = BLOCK // WARP if matrix else BLOCK  # a warp, or a thread, per outer entry
        # the outer entries: compiled in, or (shape-generic) one fewer than the positions' length
        grid = _threads(outer * (BLOCK // per_block)) if outer is not None else GridRule(buffers[0].ref, per_block)
        launch = Launch(name, grid, (BLOCK, 1, 1), args, fills_output=name.startswith("gather"))
    return NativeKernels(kernels.module, (launch,))


def _per_unit(out: KernelArg, dim: int, count: int | None, per_block: int) -> tuple[int, int, int] | GridRule:
    """Blocks of ``per_block`` units (warps or threads) over dimension ``dim`` of ``out``: constant when
    ``count`` (its size) is compiled in, else a ``GridRule`` over it."""
    if count is not None:
        return _threads(count * (BLOCK // per_block))
    return GridRule(out.ref, per_block, dim=dim)


def _threads(count: int) -> tuple[int, int, int]:
    """A grid of ``BLOCK``-thread blocks covering ``count`` threads."""
    return (max(1, pymath.ceil(count / BLOCK)), 1, 1)


def _product(val: ir.Value, crd: ir.Value, x: ir.Value | None
             ) -> Callable[[ir.Value], ir.Value | tuple[ir.Value, ir.Value]]:
    """The term ``val[k] * x[crd[k]]`` of a sparse row times a dense vector, or ``val[k]`` (a row sum: no ``x``)."""
    if x is None:
        return lambda k: memref.load(val, [k])
    return lambda k: (memref.load(val, [k]), memref.load(x, [load_index(crd, k)]))


def _accumulate(term: ir.Value | tuple[ir.Value, ir.Value], acc: ir.Value) -> ir.Value:
    return fma(*term, acc) if isinstance(term, tuple) else add(acc, term)


def _without_x(build: Callable[..., None]) -> Callable[..., None]:
    """A SpMV builder for a row sum: the same arguments without ``x`` (the output last), ``x`` given as ``None``."""
    return lambda *args: build(*args[:-1], None, args[-1])


def _zero(memref_value: ir.Value) -> ir.Value:
    return zero(ir.MemRefType(memref_value.type).element_type)


def _below(value: ir.Value, bound: ir.Value) -> ir.Value:
    return arith.cmpi(arith.CmpIPredicate.ult, value, bound)


def _coo_row(crd0: ir.Value, row: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``[start, end)`` of ``row``'s entries in a row-sorted COO: two binary searches over ``crd0``."""
    nnz = memref.dim(crd0, const(0))
    start = search(crd0, const(0), nnz, row, above=False)
    return start, search(crd0, start, nnz, row, above=True)


def _coo_spmv_chunks(pos0, crd0, crd1, val, x, y) -> None:
    """``CHUNK`` consecutive nonzeros per thread; each run of one row's entries is added to ``y`` atomically."""
    nnz = memref.dim(val, const(0))
    first = arith.muli(global_thread(), const(CHUNK))
    with when(_below(first, nnz)):
        last = arith.minui(arith.addi(first, const(CHUNK)), nnz)
        loop = scf.ForOp(first, last, const(1), [_zero(y), load_index(crd0, first)])
        with ir.InsertionPoint(loop.body):
            k = loop.induction_variable
            acc, current = loop.inner_iter_args
            row = load_index(crd0, k)
            changed = arith.cmpi(arith.CmpIPredicate.ne, row, current)
            with when(changed):  # the previous row's run ended: add it
                atomic_add(acc, y, [current])
            start = arith.select(changed, _zero(y), acc)
            scf.YieldOp([_accumulate(_product(val, crd1, x)(k), start), row])
        atomic_add(loop.results[0], y, [loop.results[1]])


def _dcsr_spmv(pos0, crd0, pos1, crd1, val, x, y) -> None:
    """A thread per stored row: ``y[crd0[r]] = sum over pos1[r]..pos1[r+1]``."""
    stored = global_thread()
    with when(_below(stored, load_index(pos0, const(1)))):
        start, end = load_index(pos1, stored), load_index(pos1, arith.addi(stored, const(1)))
        memref.store(sum_range(start, end, const(1), _zero(y), _product(val, crd1, x)), y,
                     [load_index(crd0, stored)])


def _outer_entries(pos1: ir.Value) -> ir.Value:
    """The entries of a CSC's outer level: one fewer than its positions (so no size is compiled in)."""
    return arith.subi(memref.dim(pos1, const(0)), const(1))


def _gather_spmv(pos1, crd1, val, x, y) -> None:
    """A thread per outer entry ``o`` (CSC read as ``A[j,i]``): ``y[o] = sum over its stored entries``."""
    at = global_thread()
    with when(_below(at, _outer_entries(pos1))):
        start, end = load_index(pos1, at), load_index(pos1, arith.addi(at, const(1)))
        memref.store(sum_range(start, end, const(1), _zero(y), _product(val, crd1, x)), y, [at])


def _gather_spmm(pos1, crd1, val, b, c) -> None:
    """A warp per outer entry ``o``, lanes over consecutive columns: ``C[o,j] = sum of A * B[crd, j]``."""
    at = _warp()
    with when(_below(at, _outer_entries(pos1))):
        start, end = load_index(pos1, at), load_index(pos1, arith.addi(at, const(1)))
        _warp_columns(c, lambda j: memref.store(_row_times_b(val, crd1, b, start, end, j, _zero(c)), c, [at, j]))


def _csc_spmv(pos1, crd1, val, x, y) -> None:
    """A thread per column ``j``: ``y[i] += A[i,j] * x[j]`` atomically for each stored ``i``."""
    column = global_thread()
    with when(_below(column, _outer_entries(pos1))):
        xj = None if x is None else memref.load(x, [column])
        loop = scf.ForOp(load_index(pos1, column), load_index(pos1, arith.addi(column, const(1))), const(1))
        with ir.InsertionPoint(loop.body):
            k = loop.induction_variable
            value = memref.load(val, [k])
            atomic_add(value if xj is None else mul(value, xj), y, [load_index(crd1, k)])
            scf.YieldOp([])


def _warp_columns(c: ir.Value, body: Callable[[ir.Value], None]) -> None:
    """``body(j)`` for this lane's columns ``lane, lane + 32, ...`` below the columns of ``c``."""
    lane = arith.remui(gpu.thread_id(gpu.Dimension.x), const(WARP))
    loop = scf.ForOp(lane, memref.dim(c, const(1)), const(WARP))
    with ir.InsertionPoint(loop.body):
        body(loop.induction_variable)
        scf.YieldOp([])


def _warp() -> ir.Value:
    """This thread's warp across the grid."""
    return arith.divui(global_thread(), const(WARP))


def _row_times_b(val: ir.Value, crd: ir.Value, b: ir.Value, start: ir.Value, end: ir.Value, j: ir.Value,
                 zero: ir.Value) -> ir.Value:
    """``sum over k in [start, end)`` of ``val[k] * B[crd[k], j]``."""
    return sum_range(start, end, const(1), zero,
                     lambda k: (memref.load(val, [k]), memref.load(b, [load_index(crd, k), j])))


def _coo_spmm(pos0, crd0, crd1, val, b, c) -> None:
    """A warp per row (binary search over ``crd0``), lanes over consecutive columns; every ``C[i,j]`` stored."""
    row = _warp()
    with when(_below(row, memref.dim(c, const(0)))):
        start, end = _coo_row(crd0, row)
        _warp_columns(c, lambda j: memref.store(_row_times_b(val, crd1, b, start, end, j, _zero(c)), c, [row, j]))


def _dcsr_spmm(pos0, crd0, pos1, crd1, val, b, c) -> None:
    """A warp per stored row, lanes over consecutive columns; rows not stored stay zero."""
    stored = _warp()
    with when(_below(stored, load_index(pos0, const(1)))):
        row = load_index(crd0, stored)
        start, end = load_index(pos1, stored), load_index(pos1, arith.addi(stored, const(1)))
        _warp_columns(c, lambda j: memref.store(_row_times_b(val, crd1, b, start, end, j, _zero(c)), c, [row, j]))


def _csc_spmm(pos1, crd1, val, b, c) -> None:
    """A warp per column ``k`` of ``A``: ``C[i,j] += A[i,k] * B[k,j]`` atomically, lanes over ``j``."""
    column = _warp()
    with when(_below(column, _outer_entries(pos1))):
        loop = scf.ForOp(load_index(pos1, column), load_index(pos1, arith.addi(column, const(1))), const(1))
        with ir.InsertionPoint(loop.body):
            k = loop.induction_variable
            a, row = memref.load(val, [k]), load_index(crd1, k)

            def scatter(j: ir.Value) -> None:
                atomic_add(mul(a, memref.load(b, [column, j])), c, [row, j])

            _warp_columns(c, scatter)
            scf.YieldOp([])
