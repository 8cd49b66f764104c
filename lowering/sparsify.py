"""The target-independent front half: kernel module -> sparsified, bufferized loops over plain buffers.

After ``sparse-assembler{direct-out}`` the level buffers are plain memref
arguments and results, and the sparsifier runs with direct codegen (no
runtime library on the hot path).  The pipeline is spelled out rather than
taken from ``--sparsifier`` so project rewrites can run between its halves;
the CPU and CUDA back ends continue from its result.
"""

from __future__ import annotations

from mlir import ir
from mlir.passmanager import PassManager

from sparse_mlir.errors import LoweringError

from sparse_mlir.lowering import rewrites

__all__ = ["CANONICALIZE", "sparsify_pipeline", "sparsify"]

CANONICALIZE = "builtin.module(func.func(canonicalize))"


def sparsify_pipeline(parallel: bool, compressed_outer: bool = False) -> str:
    """Assembler + sparsifier with direct codegen; ``parallel`` makes dense outer loops ``scf.parallel``, and
    with ``compressed_outer`` outer loops over a compressed level too (DCSR's stored rows, CSF's slices).

    Unlike ``--sparsifier`` there is no ``linalg-fuse-elementwise-ops``: the
    planner already fused what can be fused, and the stages it keeps apart
    (dense copies of sparse inputs in ``KernelSpec.densified``) must stay apart.
    The CPU threads compressed outer loops; the GPU mapping does not take
    them (their bounds live in device memory).
    """
    strategy = ("any-storage-outer-loop" if compressed_outer else "dense-outer-loop") if parallel else "none"
    return ("builtin.module("
            "sparse-assembler{direct-out=true},"
            "func.func(linalg-generalize-named-ops),"
            f"sparsification-and-bufferization{{enable-simd-index32=true parallelization-strategy={strategy} vl=0}},"
            "sparse-storage-specifier-to-llvm,"
            "func.func(canonicalize))")


def sparsify(module: ir.Module, *, parallel: bool, target: str, compressed_outer: bool = False) -> bool:
    """Sparsify and bufferize ``module`` in place (``target`` only labels errors); return whether it is parallel.

    Parallel loops are only requested when every stage's outermost loop is
    free of reductions (``outer_loops_parallel``); ``compressed_outer`` as in
    ``sparsify_pipeline``.
    """
    run(module, CANONICALIZE, "sparsified", target)
    rewrites.drop_identity_generics(module)
    parallel = parallel and outer_loops_parallel(module)
    run(module, sparsify_pipeline(parallel, compressed_outer), "sparsified", target)
    rewrites.widen_bool_buffers(module)
    return parallel


def outer_loops_parallel(module: ir.Module) -> bool:
    """Whether the outermost loop the sparsifier will emit for every ``linalg.generic`` is a parallel one.

    ``dense-outer-loop`` makes the outer loop ``scf.parallel`` whenever it is
    dense, even when it is a reduction (CSC SpMV: ``j`` outer, scattering
    into ``y[i]``), which races.  ``sparse-reinterpret-map`` puts each
    generic's iterators in the order the loops will have, so it is run on a
    copy and the first iterator of every generic is inspected.
    """
    probe = ir.Module.parse(str(module))
    run(probe, "builtin.module(func.func(linalg-generalize-named-ops),sparse-reinterpret-map)", "sparsified",
        "probe")
    reduction = ir.Attribute.parse("#linalg.iterator_type<reduction>")
    outer: list[ir.Attribute] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "linalg.generic":
            outer.append(ir.ArrayAttr(op.attributes["iterator_types"])[0])
        return ir.WalkResult.ADVANCE

    probe.operation.walk(collect)
    return reduction not in outer


def run(module: ir.Module, pipeline: str, stage: str, target: str) -> None:
    """Run a pass pipeline; a failure becomes a ``LoweringError`` naming the stage and carrying the diagnostics."""
    try:
        PassManager.parse(pipeline).run(module.operation)
    except Exception as exc:  # MLIRError carries the diagnostics
        raise LoweringError(str(exc).splitlines()[0], stage=stage, target=target, diagnostics=str(exc)) from exc
