"""The CPU pipeline: kernel module -> sparsified loops -> LLVM dialect -> shared library.

Stages (each one's IR is kept for ``kernel.ir``):

* ``input``: the module built from the DSL (sparse shapes static, except in
  the hand-scheduled shape-generic kernels, which read every size at run time).
* ``sparsified``: after ``sparse-assembler{direct-out}`` (level buffers become
  plain memref arguments and results) and the sparsifier with direct codegen
  (no runtime library on the hot path), bufferized.
* ``mapped``: loops mapped to the machine's parallelism: for threaded kernels
  the dense outer loops become OpenMP worksharing loops with a guided
  schedule (a serial kernel's is its ``sparsified`` module).
* ``llvm``: the LLVM dialect plus the plain C entry point (``c_abi``), every
  other symbol internal, float multiply/add marked ``contract`` (FMA).
* then ``mlir-translate | opt | llc`` and the C compiler (``toolchain``).

The sparsifier pipeline is spelled out rather than taken from ``--sparsifier``
so project rewrites can run between its halves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlir import ir

from sparse_mlir.dialects.linalg import KERNEL_NAME, fills_output
from sparse_mlir.errors import LoweringError, SparseMLIRError
from sparse_mlir.abi.c_signature import Signature

from sparse_mlir.lowering import rewrites, toolchain
from sparse_mlir.lowering import sparsify as frontend
from sparse_mlir.lowering.c_entry import add_c_entry_point

__all__ = ["CpuOptions", "TO_LLVM", "lower_to_llvm", "loops_to_llvm", "build_library", "build_object"]


@dataclass(frozen=True)
class CpuOptions:
    """Options that change generated code (all part of cache keys).

    ``openmp`` is the OpenMP runtime to link for threaded kernels, ``None``
    for serial ones; ``vectorize=False`` keeps LLVM's loop and SLP
    vectorizers off (a kernel scalar by design: ``select.CpuChoice``).
    """

    cpu: str = "native"
    opt_level: int = 3
    openmp: Path | None = None
    vectorize: bool = True


TO_OPENMP = "builtin.module(convert-scf-to-openmp)"

TO_LLVM = ("builtin.module("
           "func.func(convert-linalg-to-loops),"
           "func.func(convert-vector-to-scf),"
           "func.func(expand-realloc),"
           "func.func(convert-scf-to-cf),"
           "expand-strided-metadata,"
           "lower-affine,"
           "convert-vector-to-llvm,"
           "func.func(arith-expand),"
           "func.func(convert-math-to-llvm),"
           "convert-math-to-libm,"
           "convert-to-llvm,"
           "reconcile-unrealized-casts)")


def _run(module: ir.Module, pipeline: str, stage: str) -> None:
    frontend.run(module, pipeline, stage, "cpu")


def lower_to_llvm(module: ir.Module, sig: Signature, options: CpuOptions) -> dict[str, str]:
    """Lower ``module`` in place to the LLVM dialect with ``sig``'s C entry point; return each stage's IR.

    A shape-generic signature (sparse sizes given at run time) is only for
    hand-scheduled modules: the sparse assembler needs static sparse shapes,
    so a generic module reaching here with one is the runtime and the
    emitter table disagreeing (``compiler.emitters``), refused by name.
    """
    stages = {"input": str(module)}
    if sig.shape_generic and "#sparse_tensor.encoding" in stages["input"]:
        raise LoweringError(f"{sig.expression!r} is built by the sparsifier, which needs static sparse shapes, but "
                            f"it was asked for a shape-generic build (compiler.emitters disagrees with "
                            f"dialects.select)", stage="input", target="cpu")
    parallel = options.openmp is not None
    parallel = frontend.sparsify(module, parallel=parallel, target="cpu", compressed_outer=True)
    rewrites.resolve_thread_count(module, parallel)
    stages["sparsified"] = str(module)
    if parallel:
        _run(module, TO_OPENMP, "mapped")
        rewrites.inline_alloca_scopes(module)
        rewrites.balance_parallel_loops(module)
    stages["mapped"] = str(module)
    stages["llvm"] = loops_to_llvm(module, sig)
    return stages


def loops_to_llvm(module: ir.Module, sig: Signature) -> str:
    """The back half: a bufferized ``func @kernel`` over memrefs -> LLVM dialect with the C entry point."""
    zero_fill = not fills_output(module)
    unread = unread_arguments(module)
    _run(module, TO_LLVM, "llvm")
    try:
        add_c_entry_point(module, sig, f"_mlir_ciface_{KERNEL_NAME}", zero_fill, unread)
    except SparseMLIRError:  # a name the kernel's own symbols take
        raise
    except Exception as exc:  # a malformed wrapper is a bug here, reported with its diagnostics
        raise LoweringError("the C entry point could not be built", stage="llvm", target="cpu",
                            diagnostics=str(exc)) from exc
    rewrites.export_only(module, {sig.name, f"{sig.name}_free"})
    rewrites.allow_contraction(module)
    return str(module)


def unread_arguments(module: ir.Module) -> frozenset[int]:
    """The positions of the kernel function's arguments that nothing in it uses (``func @kernel`` over memrefs,
    before it is lowered to LLVM): buffers the C entry point need not build, such as the implicit positions of
    an N:M operand, which the hand-scheduled N:M kernels compute instead of reading (``dialects.native.spmm``).
    """
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == KERNEL_NAME:
            entry = op.operation.regions[0].blocks[0]
            return frozenset(i for i, argument in enumerate(entry.arguments) if not list(argument.uses))
    return frozenset()


def build_library(module: ir.Module, sig: Signature, out_path: Path, options: CpuOptions) -> dict[str, str]:
    """Lower and compile ``module`` to a shared library exporting ``sig.name`` (and ``sig.name + '_free'``)."""
    stages = lower_to_llvm(module, sig, options)
    toolchain.compile_shared_library(stages["llvm"], out_path, cpu=options.cpu, opt_level=options.opt_level,
                                     openmp=options.openmp, vectorize=options.vectorize)
    return stages


def build_object(module: ir.Module, sig: Signature, obj_path: Path, options: CpuOptions) -> dict[str, str]:
    """Lower and compile ``module`` to an object file for embedding (ahead-of-time export)."""
    stages = lower_to_llvm(module, sig, options)
    toolchain.compile_object(stages["llvm"], obj_path, cpu=options.cpu, opt_level=options.opt_level,
                             vectorize=options.vectorize)
    return stages
