"""Total reductions of a sparse operand on the GPU: ``s[] = A[i,j]`` and ``s[] = A[i,j] * x[j]``, any format.

The sparsifier maps a reduction to a scalar onto one GPU thread (its loops
are not parallel).  Here the stored entries are summed in passes instead,
built with the bindings' op builders:

1. ``reduce_partials``: ``PARTIALS`` threads stride over the stored values
   (thread ``t`` takes entries ``t, t + PARTIALS, ...``: neighbouring threads
   read neighbouring entries) and each stores its sum in a scratch buffer;
   with a dense factor, ``x`` is read at the entry's coordinate in ``A``'s
   last level (the column of CSR, COO and DCSR, the row of CSC);
2. ``reduce_combine``: ``COMBINE`` threads each sum ``PARTIALS / COMBINE`` of
   those partials (strided, so again coalesced); with ``deterministic=False``
   each adds its sum into ``s`` atomically and the program ends here;
3. ``reduce_final`` (deterministic): one thread adds the ``COMBINE`` sums
   in order.  Its 256 loads hit L2; the sum is the same on every run.

Values stored as explicit zeros (BSR blocks, N:M groups) add nothing, so the
plain sum takes every format; the product needs a last level that stores
coordinates of one dimension (not N:M in-group offsets, not a block's).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, memref
from sparse_mlir.dialects.native.gpu import NativeKernels
from sparse_mlir.dialects.native.gpu_build import (
    BLOCK,
    KernelModule,
    atomic_add,
    buffer_refs,
    const,
    dense_type,
    element_type,
    global_thread,
    level_buffer_types,
    load_index,
    sum_range,
    when,
    zero,
)

from sparse_mlir.abi.gpu_program import KernelArg, Launch
from sparse_mlir.dsl.patterns import total_reduction_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["COMBINE", "PARTIALS", "gpu_total_reduction"]

PARTIAL_BLOCKS = 256
PARTIALS = PARTIAL_BLOCKS * BLOCK  # threads of the first pass: 32768 running sums, 128 KiB of float32
COMBINE = 256  # threads of the second pass, each summing PARTIALS / COMBINE = 128 partials
Shapes = dict[str, tuple[int | None, ...]]


def gpu_total_reduction(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, deterministic: bool
                        ) -> NativeKernels | None:
    """The passes of the module docstring for ``s[] = A[...] (* x[...])``, or ``None`` when they do not apply."""
    elt, found = element_type(spec), total_reduction_operands(spec, formats)
    if elt is None or found is None:
        return None
    a, x = found
    fmt = formats[a]  # shape-generic with None sizes: x's size is its descriptor's, nothing else has one
    names = fmt.codegen_format.buffer_names
    refs = buffer_refs(spec, formats)
    buffer_types = level_buffer_types(fmt, elt)
    values = KernelArg("buffer", refs[a] + len(names) - 1, (None,))
    partials, sums = KernelArg("scratch", 0, (PARTIALS,)), KernelArg("scratch", 1, (COMBINE,))
    output = KernelArg("buffer", refs[spec.output], ())
    scalar = dense_type((), elt)
    kernels = KernelModule()
    if x is None:
        kernels.kernel("reduce_partials", [buffer_types[-1], dense_type((PARTIALS,), elt)], _partials(None))
        first = (values, partials)
    else:
        crd = names.index(f"crd{len(fmt.levels) - 1}")
        vector = KernelArg("buffer", refs[x], shapes[x])
        kernels.kernel("reduce_partials", [buffer_types[crd], buffer_types[-1], dense_type(shapes[x], elt),
                                           dense_type((PARTIALS,), elt)], _partials(x))
        first = (KernelArg("buffer", refs[a] + crd, (None,)), values, vector, partials)
    launches = [Launch("reduce_partials", (PARTIAL_BLOCKS, 1, 1), (BLOCK, 1, 1), first, fills_output=True)]
    combined = dense_type((COMBINE,), elt) if deterministic else scalar
    kernels.kernel("reduce_combine", [dense_type((PARTIALS,), elt), combined], _combine(deterministic))
    launches.append(Launch("reduce_combine", (COMBINE // BLOCK, 1, 1), (BLOCK, 1, 1),
                           (partials, sums if deterministic else output), fills_output=deterministic))
    scratch = [((PARTIALS,), spec.dtype.name)]
    if deterministic:
        kernels.kernel("reduce_final", [combined, scalar], _final)
        launches.append(Launch("reduce_final", (1, 1, 1), (1, 1, 1), (sums, output), fills_output=True))
        scratch.append(((COMBINE,), spec.dtype.name))
    return NativeKernels(kernels.module, tuple(launches), tuple(scratch))


def _zero(buffer: ir.Value) -> ir.Value:
    return zero(ir.MemRefType(buffer.type).element_type)


def _partials(x: str | None):
    """Pass 1: thread ``t`` sums entries ``t, t + PARTIALS, ...`` (times ``x`` at their coordinates)."""
    def build(*args: ir.Value) -> None:
        *inputs, partials = args
        values = inputs[-1] if x is None else inputs[1]
        thread = global_thread()
        nnz = memref.dim(values, const(0))
        if x is None:
            def term(k: ir.Value) -> ir.Value:
                return memref.load(values, [k])
        else:
            crd, _, vector = inputs

            def term(k: ir.Value) -> tuple[ir.Value, ir.Value]:
                return memref.load(values, [k]), memref.load(vector, [load_index(crd, k)])
        memref.store(sum_range(thread, nnz, const(PARTIALS), _zero(partials), term), partials, [thread])
    return build


def _combine(deterministic: bool):
    """Pass 2: thread ``t < COMBINE`` sums partials ``t, t + COMBINE, ...``; stores it, or adds it to ``s``."""
    def build(partials: ir.Value, target: ir.Value) -> None:
        thread = global_thread()
        with when(arith.cmpi(arith.CmpIPredicate.ult, thread, const(COMBINE))):
            total = sum_range(thread, const(PARTIALS), const(COMBINE), _zero(partials),
                              lambda k: memref.load(partials, [k]))
            if deterministic:
                memref.store(total, target, [thread])
            else:
                atomic_add(total, target, [])
    return build


def _final(sums: ir.Value, output: ir.Value) -> None:
    """Pass 3 (deterministic): the ``COMBINE`` sums added in order by one thread."""
    memref.store(sum_range(const(0), const(COMBINE), const(1), _zero(sums), lambda k: memref.load(sums, [k])),
                 output, [])
