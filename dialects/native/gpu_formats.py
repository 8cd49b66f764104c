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
from sparse_mlir.dsl.ast import Access, Binary
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import COO, CSC, CSR, DCSR, Format

__all__ = ["CHUNK", "gpu_format_products", "product_operands"]

CHUNK = 16  # nonzeros per thread in the atomic COO SpMV (as the row-splitting CSR SpMV)
Shapes = dict[str, tuple[int | None, ...]]
_KINDS = {"coo": COO, "csc": CSC, "dcsr": DCSR, "csr": CSR}


def _kind(fmt: Format | None) -> str | None:
    """``coo``, ``csc``, ``dcsr`` or ``csr`` for those formats at any index widths, else ``None``."""
    if fmt is None:
        return None
    return next((name for name, preset in _KINDS.items() if fmt.with_widths(32, 32) == preset.with_widths(32, 32)),
                None)


def product_operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str | None] | None:
    """``(A, dense)`` when the kernel is ``y[i] = A[i,j] * x[j]`` or ``C[i,j] = A[i,k] * B[k,j]`` (factors in
    either order) with a dense result, a dense second factor and a COO, CSC or DCSR ``A``, or with ``A``
    transposed (``y[j] = A[i,j] * x[i]``) when it is CSR or CSC; ``(A, None)`` for the sums ``y[i] = A[i,j]``
    of the same operands; else ``None`` (CSR ``A[i,k]``: ``gpu.py``, the sparsifier's parallel rows)."""
    if spec.sparse_output or len(spec.stages) != 1:
        return None
    stage = spec.stages[0]
    body = stage.body
    if len(stage.reduce) != 1 or stage.indices != spec.output_indices or len(stage.indices) not in (1, 2):
        return None
    (k,) = stage.reduce
    i = stage.indices[0]
    dense_index = (k,) if len(stage.indices) == 1 else (k, stage.indices[1])
    allowed = {"coo": ((i, k),), "dcsr": ((i, k),), "csc": ((i, k), (k, i)), "csr": ((k, i),)}
    if isinstance(body, Access) and len(stage.indices) == 1:  # a row (or column) sum
        kind = _kind(formats.get(body.tensor))
        return (body.tensor, None) if kind is not None and body.index in allowed[kind] else None
    if not isinstance(body, Binary) or body.op != "*":
        return None
    for a, b in ((body.lhs, body.rhs), (body.rhs, body.lhs)):
        kind = _kind(formats.get(a.tensor)) if isinstance(a, Access) else None
        if kind is not None and isinstance(b, Access) and b.tensor not in formats and a.tensor != b.tensor \
                and a.index in allowed[kind] and b.index == dense_index:
            return a.tensor, b.tensor
    return None


def gpu_format_products(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, deterministic: bool
                        ) -> NativeKernels | None:
    """The parallel SpMV or SpMM for a COO, CSC or DCSR ``A`` (module docstring), or ``None`` when it does not apply.

    ``None`` too for float16 (summed in float16 otherwise), for dynamic
    sizes, and for float CSC when ``deterministic`` (its kernels add
    atomically; integer sums do not depend on the order).
    """
    elt, found = element_type(spec), product_operands(spec, formats)
    if elt is None or found is None:
        return None
    a, b = found
    fmt, kind = formats[a], _kind(formats[a])
    out_shape = shapes[spec.output]
    # the scatter kernels add atomically; integer sums are the same in any order, float sums are not
    scatter = kind in ("csc", "csr") and spec.operand_index(a)[fmt.dim_to_lvl[0].dim] == spec.stages[0].reduce[0]
    dense_shape = shapes[b] if b is not None else ()
    if any(s is None for s in (*shapes[a], *dense_shape, *out_shape)) or \
            (scatter and deterministic and spec.dtype.kind == "f"):
        return None
    refs = buffer_refs(spec, formats)
    buffers = tuple(KernelArg("buffer", refs[a] + n, (None,)) for n in range(len(fmt.buffer_names)))
    dense = ((KernelArg("buffer", refs[b], shapes[b]),) if b is not None else ()) + \
        (KernelArg("buffer", refs[spec.output], out_shape),)
    params = [*level_buffer_types(fmt, elt), *((dense_type(shapes[b], elt),) if b is not None else ()),
              dense_type(out_shape, elt)]
    rows = shapes[a][0]
    cols = out_shape[1] if len(out_shape) == 2 else 0
    kernels = KernelModule()
    args = (*buffers, *dense)

    def spmv(build: Callable[..., None]) -> Callable[..., None]:
        return build if b is not None else _without_x(build)

    if kind == "coo" and not cols and not deterministic:
        kernels.kernel("coo_spmv_chunks", params, spmv(_coo_spmv_chunks))
        launch = Launch("coo_spmv_chunks", GridRule(buffers[1].ref, BLOCK * CHUNK), (BLOCK, 1, 1), args)
    elif kind == "coo" and not cols:
        launches, scratch = segmented_spmv(kernels, params, args, rows, has_x=b is not None)
        return NativeKernels(kernels.module, launches, scratch)
    elif kind == "coo":
        kernels.kernel("coo_spmm", params, _coo_spmm(rows, cols))
        launch = Launch("coo_spmm", _threads(rows * WARP), (BLOCK, 1, 1), args, fills_output=True)
    elif kind == "dcsr":
        name = "dcsr_spmm" if cols else "dcsr_spmv"
        kernels.kernel(name, params, _dcsr_spmm(cols) if cols else spmv(_dcsr_spmv))
        launch = Launch(name, GridRule(buffers[1].ref, BLOCK // WARP if cols else BLOCK), (BLOCK, 1, 1), args)
    elif spec.operand_index(a)[fmt.dim_to_lvl[0].dim] == spec.stages[0].reduce[0]:
        # CSC, or CSR transposed: the outer level is the sum's index, so each outer entry scatters into the result
        name = "csc_spmm" if cols else "csc_spmv"
        outer = shapes[a][fmt.dim_to_lvl[0].dim]
        kernels.kernel(name, params, _csc_spmm(outer, cols) if cols else spmv(_csc_spmv(outer)))
        launch = Launch(name, _threads(outer * (WARP if cols else 1)), (BLOCK, 1, 1), args)
    else:  # CSC transposed: the outer level is the result's index, each outer entry gathers its sum
        name = "gather_spmm" if cols else "gather_spmv"
        outer = shapes[a][fmt.dim_to_lvl[0].dim]
        kernels.kernel(name, params, _gather_spmm(outer, cols) if cols else spmv(_gather_spmv(outer)))
        launch = Launch(name, _threads(outer * (WARP if cols else 1)), (BLOCK, 1, 1), args, fills_output=True)
    return NativeKernels(kernels.module, (launch,))


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


def _gather_spmv(outer: int) -> Callable[..., None]:
    """A thread per outer entry ``o`` (CSC read as ``A[j,i]``): ``y[o] = sum over its stored entries``."""
    def build(pos1, crd1, val, x, y) -> None:
        at = global_thread()
        with when(_below(at, const(outer))):
            start, end = load_index(pos1, at), load_index(pos1, arith.addi(at, const(1)))
            memref.store(sum_range(start, end, const(1), _zero(y), _product(val, crd1, x)), y, [at])
    return build


def _gather_spmm(outer: int, cols: int) -> Callable[..., None]:
    """A warp per outer entry ``o``, lanes over consecutive columns: ``C[o,j] = sum of A * B[crd, j]``."""
    def build(pos1, crd1, val, b, c) -> None:
        at = _warp()
        with when(_below(at, const(outer))):
            start, end = load_index(pos1, at), load_index(pos1, arith.addi(at, const(1)))
            _warp_columns(cols, lambda j: memref.store(_row_times_b(val, crd1, b, start, end, j, _zero(c)), c,
                                                       [at, j]))
    return build


def _csc_spmv(columns: int) -> Callable[..., None]:
    """A thread per column ``j``: ``y[i] += A[i,j] * x[j]`` atomically for each stored ``i``."""
    def build(pos1, crd1, val, x, y) -> None:
        column = global_thread()
        with when(_below(column, const(columns))):
            xj = None if x is None else memref.load(x, [column])
            loop = scf.ForOp(load_index(pos1, column), load_index(pos1, arith.addi(column, const(1))), const(1))
            with ir.InsertionPoint(loop.body):
                k = loop.induction_variable
                value = memref.load(val, [k])
                atomic_add(value if xj is None else mul(value, xj), y, [load_index(crd1, k)])
                scf.YieldOp([])
    return build


def _warp_columns(cols: int, body: Callable[[ir.Value], None]) -> None:
    """``body(j)`` for this lane's columns ``lane, lane + 32, ...`` below ``cols``."""
    lane = arith.remui(gpu.thread_id(gpu.Dimension.x), const(WARP))
    loop = scf.ForOp(lane, const(cols), const(WARP))
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


def _coo_spmm(rows: int, cols: int) -> Callable[..., None]:
    """A warp per row (binary search over ``crd0``), lanes over consecutive columns; every ``C[i,j]`` stored."""
    def build(pos0, crd0, crd1, val, b, c) -> None:
        row = _warp()
        with when(_below(row, const(rows))):
            start, end = _coo_row(crd0, row)
            _warp_columns(cols, lambda j: memref.store(_row_times_b(val, crd1, b, start, end, j, _zero(c)), c,
                                                       [row, j]))
    return build


def _dcsr_spmm(cols: int) -> Callable[..., None]:
    """A warp per stored row, lanes over consecutive columns; rows not stored stay zero."""
    def build(pos0, crd0, pos1, crd1, val, b, c) -> None:
        stored = _warp()
        with when(_below(stored, load_index(pos0, const(1)))):
            row = load_index(crd0, stored)
            start, end = load_index(pos1, stored), load_index(pos1, arith.addi(stored, const(1)))
            _warp_columns(cols, lambda j: memref.store(_row_times_b(val, crd1, b, start, end, j, _zero(c)), c,
                                                       [row, j]))
    return build


def _csc_spmm(inner: int, cols: int) -> Callable[..., None]:
    """A warp per column ``k`` of ``A``: ``C[i,j] += A[i,k] * B[k,j]`` atomically, lanes over ``j``."""
    def build(pos1, crd1, val, b, c) -> None:
        column = _warp()
        with when(_below(column, const(inner))):
            loop = scf.ForOp(load_index(pos1, column), load_index(pos1, arith.addi(column, const(1))), const(1))
            with ir.InsertionPoint(loop.body):
                k = loop.induction_variable
                a, row = memref.load(val, [k]), load_index(crd1, k)

                def scatter(j: ir.Value) -> None:
                    atomic_add(mul(a, memref.load(b, [column, j])), c, [row, j])

                _warp_columns(cols, scatter)
                scf.YieldOp([])
    return build
