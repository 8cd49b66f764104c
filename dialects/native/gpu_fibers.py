"""CSF contractions over the last level on the GPU, a thread per fiber: ``Z[i,j] = A[i,j,k] * D[...k...]``.

A third-order CSF tensor (levels ``i``, ``j``, ``k``, all compressed, in
order) times a dense tensor indexed by ``k`` and any of ``i``, ``j`` (TTV
``Z[i,j] = A[i,j,k] * x[k]``, ``Z[i,j] = A[i,j,k] * B[k,j]``, ...), summed
over ``k`` into a dense ``Z[i,j]``.  The sparsifier runs it on one thread
(its outer levels are compressed); here every stored ``(i, j)`` fiber is one
thread, the grid sized from the stored fibers at launch (``GridRule`` over
``crd1``).  A thread finds its ``i`` by binary search over ``pos1`` (the
parent whose range holds the fiber), sums the fiber in order, and stores
``Z[i,j]``; fibers not stored stay zero (the runtime zeroes ``Z``).  No
atomics: the sums are the same on every run.  Built with the bindings' op
builders.
"""

from __future__ import annotations

from mlir.dialects import arith, memref
from sparse_mlir.dialects.native.gpu import NativeKernels
from sparse_mlir.dialects.native.gpu_build import (
    BLOCK,
    KernelModule,
    buffer_refs,
    const,
    dense_type,
    element_type,
    global_thread,
    level_buffer_types,
    load_index,
    search,
    sum_range,
    when,
    zero,
)

from sparse_mlir.abi.gpu_program import GridRule, KernelArg, Launch
from sparse_mlir.dsl.patterns import fiber_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["gpu_csf_fibers"]

Shapes = dict[str, tuple[int | None, ...]]


def gpu_csf_fibers(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes) -> NativeKernels | None:
    """The fiber-parallel kernel of the module docstring, or ``None`` when it does not apply."""
    elt, found = element_type(spec), fiber_operands(spec, formats)
    if elt is None or found is None:
        return None
    a, d = found
    out_shape = shapes[spec.output]  # shape-generic with None sizes: the kernel reads no size but the positions'
    fmt = formats[a]
    stage = spec.stages[0]
    names = (*stage.indices, *stage.reduce)
    d_index = tuple(names.index(v) for v in spec.operand_index(d))  # D's subscripts among (i, j, k)
    refs = buffer_refs(spec, formats)
    args = (*(KernelArg("buffer", refs[a] + n, (None,)) for n in range(len(fmt.buffer_names))),
            KernelArg("buffer", refs[d], shapes[d]), KernelArg("buffer", refs[spec.output], out_shape))
    kernels = KernelModule()

    def build(pos0, crd0, pos1, crd1, pos2, crd2, val, dense, z) -> None:
        fiber = global_thread()
        with when(arith.cmpi(arith.CmpIPredicate.ult, fiber, load_index(pos1, load_index(pos0, const(1))))):
            parents = arith.addi(load_index(pos0, const(1)), const(1))  # pos1 holds one start per stored i, + 1
            parent = arith.subi(search(pos1, const(0), parents, fiber, above=True), const(1))
            i, j = load_index(crd0, parent), load_index(crd1, fiber)

            def term(k):
                coords = (i, j, load_index(crd2, k))
                return memref.load(val, [k]), memref.load(dense, [coords[n] for n in d_index])

            start, end = load_index(pos2, fiber), load_index(pos2, arith.addi(fiber, const(1)))
            memref.store(sum_range(start, end, const(1), zero(elt), term), z, [i, j])

    kernels.kernel("csf_fibers", [*level_buffer_types(fmt, elt), dense_type(shapes[d], elt),
                                  dense_type(out_shape, elt)], build)
    launch = Launch("csf_fibers", GridRule(args[3].ref, BLOCK), (BLOCK, 1, 1), args)
    return NativeKernels(kernels.module, (launch,))
