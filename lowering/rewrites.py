"""IR rewrites that upstream passes lack, applied between pipeline stages."""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, func
from sparse_mlir.dialects.native.loops import THREAD_COUNT

__all__ = [
    "allow_contraction",
    "balance_parallel_loops",
    "drop_identity_generics",
    "export_only",
    "inline_alloca_scopes",
    "resolve_thread_count",
    "widen_bool_buffers",
]


def widen_bool_buffers(module: ir.Module) -> None:
    """Store ``memref<?xi1>`` buffers as ``i8``.

    The sparsifier's access-pattern expansion (SpGEMM, sparse outputs with a
    reduction) keeps a ``memref<?xi1>`` "filled" array, and MemRefToLLVM in
    22.1.8 asserts on stores narrower than a byte, aborting the process.
    Loads are truncated back to ``i1`` and stores extended, so the rest of
    the IR is unchanged.
    """
    allocs: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("memref.alloc", "memref.alloca") and _is_bool_memref(op.results[0].type):
            allocs.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    i8 = ir.IntegerType.get_signless(8)
    for alloc in allocs:
        buf = alloc.results[0]
        old = ir.MemRefType(buf.type)
        with alloc.location:
            buf.set_type(ir.MemRefType.get(old.shape, i8, old.layout, old.memory_space))
        for use in list(buf.uses):
            user = use.owner
            name = user.name
            if name == "memref.load":
                result = user.results[0]
                result.set_type(i8)
                with ir.InsertionPoint(user), user.location:
                    trunc = arith.TruncIOp(ir.IntegerType.get_signless(1), result)
                trunc.operation.move_after(user.operation)
                result.replace_all_uses_except(trunc.result, trunc.operation)
            elif name in ("memref.store", "linalg.fill"):
                value_index = 0
                with ir.InsertionPoint(user), user.location:
                    wide = arith.ExtUIOp(i8, user.operands[value_index])
                user.operands[value_index] = wide.result
                for region in user.regions:  # linalg.fill's scalar body
                    for block in region.blocks:
                        for arg in block.arguments:
                            arg.set_type(i8)
            elif name != "memref.dealloc":
                raise AssertionError(f"widen_bool_buffers: unexpected user {name} of an i1 buffer")


def _is_bool_memref(t: ir.Type) -> bool:
    return isinstance(t, ir.MemRefType) and isinstance(t.element_type, ir.IntegerType) and t.element_type.width == 1


def export_only(module: ir.Module, exported: set[str]) -> None:
    """Give every ``llvm.func`` definition except ``exported`` internal linkage.

    Several kernels then link into one program without symbol clashes, and
    LLVM may inline and drop the internal wrappers.
    """
    internal = ir.Attribute.parse("#llvm.linkage<internal>")
    for op in module.body.operations:
        if op.operation.name != "llvm.func" or not op.operation.regions[0].blocks:
            continue
        name = ir.StringAttr(op.operation.attributes["sym_name"]).value
        if name not in exported:
            op.operation.attributes["linkage"] = internal


# float ops that may be fused and reassociated: arithmetic, and the horizontal sums of vectors, which without
# ``reassoc`` are one serial chain of scalar adds (16 dependent adds per 512-bit float32 vector: an SDDMM entry's
# dot product spent more time there than in its FMAs)
_CONTRACTIBLE = frozenset({"llvm.fmul", "llvm.fadd", "llvm.fsub", "llvm.intr.vector.reduce.fadd",
                           "llvm.intr.vector.reduce.fmul"})


def allow_contraction(module: ir.Module) -> None:
    """Mark float multiplies, adds and vector sums ``contract, reassoc`` so LLVM may fuse FMAs and split sums.

    The sparsifier drops ``fastmath`` flags, so without this no FMA is ever
    emitted and every reduction is one serial chain of dependent adds (SpMV
    then runs at the add latency).  Both flags change rounding only, never
    NaN or Inf handling; sums come out in another order, as with BLAS.
    """
    contract = ir.Attribute.parse("#llvm.fastmath<contract, reassoc>")

    def mark(op: ir.Operation) -> ir.WalkResult:
        if op.name in _CONTRACTIBLE:
            op.attributes["fastmathFlags"] = contract
        return ir.WalkResult.ADVANCE

    module.operation.walk(mark)


def inline_alloca_scopes(module: ir.Module) -> None:
    """Dissolve the ``memref.alloca_scope`` that ``convert-scf-to-openmp`` wraps loop bodies in.

    They hold no allocas here, and ``convert-scf-to-cf`` later breaks them
    (UPSTREAM-NOTES), so their bodies move in front of them.
    """
    scopes: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "memref.alloca_scope":
            scopes.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    for scope in scopes:
        body = list(scope.regions[0].blocks[0].operations)
        for op in body[:-1]:
            op.move_before(scope)
        for result, value in zip(scope.results, body[-1].operands):
            result.replace_all_uses_with(value)
        scope.erase()


def balance_parallel_loops(module: ir.Module) -> None:
    """Schedule OpenMP loops ``guided``: big chunks first, then smaller ones.

    Upstream lowers with a static schedule, which a few long rows stall
    (1.07x on power-law rows in UPSTREAM-NOTES); guided chunks let idle
    threads take the remaining rows at little bookkeeping cost.
    """
    guided = ir.Attribute.parse("#omp<schedulekind guided>")

    def mark(op: ir.Operation) -> ir.WalkResult:
        if op.name == "omp.wsloop":
            op.attributes["schedule_kind"] = guided
        return ir.WalkResult.ADVANCE

    module.operation.walk(mark)


def drop_identity_generics(module: ir.Module) -> None:
    """Replace a ``linalg.generic`` whose body just yields its output value by that output.

    Folding can reduce a body to that (``x - x`` on integers), and the
    sparsifier then crashes on the reduction (found by the fuzzer); the
    result of such a generic is its initial value anyway.
    """
    found: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "linalg.generic":
            block = op.regions[0].blocks[0]
            yielded = list(block.operations)[-1].operands
            n_in = len(block.arguments) - len(op.results)
            if len(yielded) == len(op.results) and all(
                    v == block.arguments[n_in + i] for i, v in enumerate(yielded)):
                found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    for op in found:
        n_out = len(op.results)
        for result, init in zip(op.results, list(op.operands)[-n_out:]):
            result.replace_all_uses_with(init)
        op.erase()


OPENMP_THREADS = "omp_get_max_threads"  # the OpenMP runtime's team size for the next parallel region


def resolve_thread_count(module: ir.Module, parallel: bool) -> None:
    """Replace the calls to ``loops.THREAD_COUNT`` with the thread count: ``omp_get_max_threads()`` when
    ``parallel`` (the runtime has set it for this call), else 1; its declaration goes.

    Emitters cannot know whether their module will be threaded (that is the
    build's choice), but a kernel giving each thread its own scratch needs
    the number of threads its parallel loop will get.
    """
    calls: list[ir.Operation] = []
    declarations: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "func.call" and ir.FlatSymbolRefAttr(op.attributes["callee"]).value == THREAD_COUNT:
            calls.append(op)
        elif op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == THREAD_COUNT:
            declarations.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    if not calls and not declarations:
        return
    index, i32 = ir.IndexType.get(), ir.IntegerType.get_signless(32)
    if parallel and calls:
        with ir.InsertionPoint.at_block_begin(module.body), module.operation.location:
            func.FuncOp(OPENMP_THREADS, ir.FunctionType.get([], [i32]), visibility="private")
    for call in calls:
        with ir.InsertionPoint(call), call.location:
            if parallel:
                count = arith.index_cast(index, func.call([i32], ir.FlatSymbolRefAttr.get(OPENMP_THREADS), []))
            else:
                count = arith.constant(index, 1)
        call.results[0].replace_all_uses_with(count)
        call.erase()
    for declaration in declarations:
        declaration.erase()
