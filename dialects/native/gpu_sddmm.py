"""SDDMM ``C[i,j] = S[i,j] * A[i,k] * B[k,j]`` on the GPU, with CSR ``S`` and a CSR result ``C`` of ``S``'s pattern.

Only ``C``'s values are new: its positions and coordinates are copies of
``S``'s, which the runtime makes on the device (``GpuProgram.result_like``),
so the kernels write one ``result`` argument, ``C``'s values.

Two launches:

* ``transpose_b``: ``B`` (``[K, N]``) into a scratch ``B^T`` (``[N, K]``), a
  thread per element (``gpu._transpose``, the Linear layer's).  Every entry
  reads a *column* of ``B``; read in place that is ``K`` loads ``N``
  elements apart, each in its own 32-byte sector.  After the transpose both
  factors of a dot product are contiguous rows.
* ``sddmm``: a thread per stored entry ``e`` (consecutive threads on
  consecutive entries, so the stores of ``C`` are coalesced and threads of
  one row share ``A``'s row, a broadcast); its row is found by a binary
  search over ``S``'s positions (balanced whatever the row lengths: no row
  can hold a warp up), its column is ``crd[e]``, and its dot product runs
  over ``K`` in 16-byte loads of both rows (``K`` a multiple of 16 bytes,
  so every row of ``A`` and ``B^T`` starts aligned; ``A`` itself must be
  16-byte aligned: ``Launch.aligned``) with ``VECTOR_CHAINS`` accumulators,
  or else one element at a time with ``UNROLL`` accumulator chains.  A
  shape-generic build holds both variants and ``K`` picks one at launch
  (``SizeTest``); a build with static sizes holds the one they pick.

No thread talks to another (no shuffles, no barriers), so the program runs
thread by thread in the CPU emulation that tests it.  The cost of that
choice: the lanes of a warp read different rows of ``B^T`` (a sector each
per load; ``A``'s row is shared), where a group of lanes per entry, each a
slice of ``K``, with a shuffle sum, would read them coalesced but could not
be emulated.  Neither has run on a GPU yet: ``benchmarks/gpu/device_check.py``
times this one against torch's ``sampled_addmm`` and the dense route.  Shape-generic: the
sizes are read from the descriptors, the grids from the call (``GridRule``
over ``S``'s entries and ``B``'s elements), the scratch sized from ``B``
(``SizeOf``).  float16 data is summed in float32.  Built with the bindings'
op builders.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, memref, scf, vector
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.native.gpu import NativeKernels, _transpose, _transpose_launch
from sparse_mlir.dialects.native.gpu_build import (
    BLOCK,
    KernelModule,
    accumulator,
    as_float,
    buffer_refs,
    const,
    dense_type,
    float_type,
    fma,
    global_thread,
    level_buffer_types,
    load_index,
    search,
    when,
)

from sparse_mlir.abi.gpu_program import GridRule, KernelArg, Launch, SizeOf, SizeTest
from sparse_mlir.dsl.patterns import gpu_sddmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["UNROLL", "VECTOR_CHAINS", "gpu_sddmm"]

UNROLL = 4  # independent FMA chains per scalar dot product: one chain waits ~4 cycles per FMA on its own result
VECTOR_CHAINS = 2  # with 16-byte loads each chain is already 2-8 independent FMAs; 4 chains took 60-74 registers
Shapes = dict[str, tuple[int | None, ...]]


def gpu_sddmm(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes) -> NativeKernels | None:
    """The SDDMM program for ``spec``, or ``None`` unless it is the SDDMM pattern over floats."""
    found = gpu_sddmm_operands(spec, formats)
    if found is None:
        return None
    s, a, b, _ = found
    rows, cols = shapes[s]
    inner = shapes[a][1]
    elt, out = float_type(TYPE_NAMES[spec.dtype.name]), float_type(TYPE_NAMES[spec.output_dtype.name])
    refs = buffer_refs(spec, formats)  # a sparse result is not a kernel argument
    pos, crd, val = (KernelArg("buffer", refs[s] + k, (None,)) for k in range(3))
    a_arg, b_arg = KernelArg("buffer", refs[a], (rows, inner)), KernelArg("buffer", refs[b], (inner, cols))
    b_t = KernelArg("scratch", 0, (cols, inner))
    values = KernelArg("result", 2, (None,))  # C's values: buffer 2 of its CSR (positions, coordinates, values)
    kernels = KernelModule()
    _transpose(kernels, "transpose_b", elt, elt, (inner, cols))
    params = [*level_buffer_types(formats[s], elt), dense_type((rows, inner), elt), dense_type((cols, inner), elt),
              dense_type((None,), out)]
    launches = [_transpose_launch("transpose_b", b_arg, b_t, (inner, cols), b_arg)]
    vector_width = 16 // spec.dtype.itemsize
    widths = [vector_width if inner % vector_width == 0 else 1] if inner is not None else [vector_width, 1]
    for width in widths:
        name = "sddmm" if len(widths) == 1 else f"sddmm_w{width}"
        kernels.kernel(name, params, _entry_per_thread(width))
        # a shape-generic build holds both; K (A's columns) picks one at launch
        tests = () if len(widths) == 1 else \
            (SizeTest(a_arg.ref, 1, "multiple" if width > 1 else "not_multiple", vector_width),)
        launches.append(Launch(name, GridRule(val.ref, BLOCK), (BLOCK, 1, 1), (pos, crd, val, a_arg, b_t, values),
                               aligned=(a_arg.ref,) if width > 1 else (), fills_output=True, only_if=tests))
    scratch_shape = (cols, inner) if cols is not None and inner is not None else \
        (SizeOf(b_arg.ref, 1), SizeOf(b_arg.ref, 0))
    return NativeKernels(kernels.module, tuple(launches), ((scratch_shape, spec.dtype.name),))


def _entry_per_thread(width: int) -> Callable[..., None]:
    """The body of one variant: ``width`` elements per load (16 bytes: ``K`` is a multiple of it, so every row of
    ``A`` and ``B^T`` starts on a 16-byte boundary), or 1."""

    def build(pos: ir.Value, crd: ir.Value, val: ir.Value, a: ir.Value, b_t: ir.Value, c: ir.Value) -> None:
        """Thread ``e``: ``c[e] = val[e] * sum_k a[row(e), k] * b_t[crd[e], k]``."""
        elt = ir.MemRefType(val.type).element_type
        acc, out = accumulator(elt), ir.MemRefType(c.type).element_type
        entry = global_thread()
        with when(arith.cmpi(arith.CmpIPredicate.ult, entry, memref.dim(val, const(0)))):
            # the row holding entry e: the last r with pos[r] <= e (the search skips empty rows before it)
            row = arith.subi(search(pos, const(0), memref.dim(pos, const(0)), entry, above=True), const(1))
            column = load_index(crd, entry)
            total = _dot(a, row, b_t, column, memref.dim(a, const(1)), acc, width)
            product = arith.mulf(as_float(memref.load(val, [entry]), acc), total)
            memref.store(as_float(product, out), c, [entry])

    return build


def _dot(a: ir.Value, row: ir.Value, b_t: ir.Value, column: ir.Value, inner: ir.Value, acc: ir.Type,
         width: int) -> ir.Value:
    """``sum_k a[row, k] * b_t[column, k]`` in ``acc``: ``UNROLL`` (vectors: ``VECTOR_CHAINS``) chains of
    ``width``-element loads over whole groups, then the tail (whole vectors: ``inner`` is a multiple of
    ``width``), then one horizontal sum."""
    elt = ir.MemRefType(a.type).element_type
    typed = acc if width == 1 else ir.VectorType.get([width], acc)
    zero = arith.constant(acc, 0.0)
    if width > 1:
        zero = vector.BroadcastOp(typed, zero).result

    def load(buffer: ir.Value, at: ir.Value, k: ir.Value) -> ir.Value:
        if width == 1:
            return as_float(memref.load(buffer, [at, k]), acc)
        return as_float(vector.LoadOp(ir.VectorType.get([width], elt), buffer, [at, k], alignment=16).result, typed)

    chains_count = UNROLL if width == 1 else VECTOR_CHAINS
    step = width * chains_count
    whole = arith.muli(arith.divui(inner, const(step)), const(step))
    groups = scf.ForOp(const(0), whole, const(step), [zero] * chains_count)
    with ir.InsertionPoint(groups.body):
        k = groups.induction_variable
        chains = []
        for u, total in enumerate(groups.inner_iter_args):
            at = arith.addi(k, const(u * width)) if u else k
            chains.append(fma(load(a, row, at), load(b_t, column, at), total))
        scf.YieldOp(chains)
    tail = scf.ForOp(whole, inner, const(width), [zero])
    with ir.InsertionPoint(tail.body):
        at = tail.induction_variable
        scf.YieldOp([fma(load(a, row, at), load(b_t, column, at), tail.inner_iter_args[0])])
    total = tail.results[0]
    for chain in groups.results:
        total = arith.addf(total, chain)
    return total if width == 1 else vector.ReductionOp(acc, vector.CombiningKind.ADD, total).result
