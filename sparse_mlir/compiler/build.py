"""What the compiler process runs: a specialized ``KernelSpec`` -> IR, then a library, object or GPU program.

This module and ``driver`` are the only ones that import ``sparse_mlir.dialects``
and ``sparse_mlir.lowering`` (and so MLIR).  It runs inside the compiler
process (``process``), which imports it; a process that only loads and runs
cached or exported kernels never does.  The functions here write their
artifact and return the IR of every stage; they know nothing of the cache
(``driver`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlir import ir

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.abi.gpu_program import GpuProgram
from sparse_mlir.compiler.emitters import shape_generic_cuda_emitter
from sparse_mlir.dialects import select
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.errors import DeviceError, LoweringError
from sparse_mlir.lowering import cpu as cpu_pipeline
from sparse_mlir.lowering import cuda as cuda_pipeline
from sparse_mlir.lowering import toolchain

__all__ = ["STAGES", "JOBS", "kernel_source", "build_cpu", "build_cuda", "gpu_program"]

Shapes = dict[str, tuple[int | None, ...]]
# the IR every artifact records, on every target: the module as built, after the sparsifier (hand-scheduled
# kernels: unchanged), with its loops mapped to threads or GPU launches, and in the LLVM dialect (NVVM on cuda)
STAGES = ("input", "sparsified", "mapped", "llvm")


def kernel_source(spec: KernelSpec) -> str:
    """The generic module before lowering, every size dynamic (``?``): what any specialization starts from."""
    with ir.Context():
        return str(select.generic_module(spec, {n: (None,) * spec.ranks[n] for n in (*spec.inputs, spec.output)}))


def build_cpu(spec: KernelSpec, shapes: Shapes, sig: Signature, out_path: Path, cpu: str,
              openmp: Path | None, object_file: bool) -> dict[str, str]:
    """Write a shared library (or, to embed, an object file) exporting ``sig``; return each stage's IR.

    The first hand-scheduled emitter that applies builds the module (``dialects.select``),
    else the sparsifier lowers the generic one.
    """
    build = cpu_pipeline.build_object if object_file else cpu_pipeline.build_library
    with ir.Context():
        choice = select.cpu_module(spec, shapes, toolchain.cpu_target(cpu))
        # the sparsifier never threads insertion into a sparse output (only hand-scheduled kernels do)
        if choice.emitter == "sparsifier" and not spec.parallelizable:
            openmp = None
        return build(choice.module, sig, out_path,
                     cpu_pipeline.CpuOptions(cpu=cpu, openmp=openmp, vectorize=not choice.scalar))


def build_cuda(spec: KernelSpec, shapes: Shapes, sig: Signature, out_path: Path, chips: tuple[str, ...],
               emitter: str, deterministic: bool) -> dict[str, str]:
    """Write the ``GpuProgram`` (PTX for ``chips``, launches) of one specialization as JSON; return each stage's IR.

    ``emitter="auto"`` takes a hand-scheduled kernel where one applies,
    ``"sparsifier"`` always the sparsified one (to compare them).
    """
    with ir.Context():
        program, stages = gpu_program(spec, shapes, sig, chips, emitter, deterministic)
    out_path.write_text(program.dumps())
    return stages


def gpu_program(spec: KernelSpec, shapes: Shapes, sig: Signature, chips: tuple[str, ...], emitter: str,
                deterministic: bool) -> tuple[GpuProgram, dict[str, str]]:
    """The program and stages of one specialization, in the caller's MLIR context (``chips=()``: no PTX)."""
    choice = select.cuda_choice(spec, shapes, deterministic) if emitter == "auto" else None
    if any(None in shapes[n] for n in spec.inputs if spec.is_sparse(n)):  # shape-generic: as driver.shape_generic
        named = shape_generic_cuda_emitter(spec, spec.formats, deterministic)
        if choice is None or choice.emitter != named:
            raise LoweringError(f"no shape-generic GPU kernel for {spec.expression!r}: emitter "
                                f"{choice.emitter if choice else None!r} applies, emitters.SHAPE_GENERIC_CUDA names "
                                f"{named!r}", stage="input", target="cuda")
    found = None if choice is None else choice.kernels
    if found is not None:
        return cuda_pipeline.lower_to_ptx(found.module, sig, native=found.launches, scratch=found.scratch,
                                          chips=chips)
    if spec.dtype.name == "float16":  # the sparsifier would sum in float16
        raise DeviceError(f"float16 on cuda runs CSR SpMV/SpMM and 2:4 SpMM (rows % 16, K % 32, N % 8 == 0) with "
                          f"float32 sums; {spec.expression!r} with these formats and shapes is not one: use float32")
    return cuda_pipeline.lower_to_ptx(select.generic_module(spec, shapes), sig, chips=chips)


# the compiler process serves exactly these, by name (``process``): never a function looked up at run time
JOBS: dict[str, Callable[..., Any]] = {"kernel_source": kernel_source, "build_cpu": build_cpu,
                                       "build_cuda": build_cuda}
