"""The one place that turns a ``KernelSpec`` into IR and native code.

MLIR is imported here lazily, only when something is compiled or shown, so a
process can load and run cached or exported kernels without the MLIR
packages installed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import __version__
from .dsl.plan import KernelSpec
from .errors import DeviceError
from .formats import Format
from .signature import Signature

__all__ = ["TARGETS", "specialize", "kernel_source", "build_library", "build_gpu_program", "build_gpu_emulation",
           "source_hash"]

TARGETS = ("cpu", "cuda")


def specialize(spec: KernelSpec, formats: dict[str, Format]) -> KernelSpec:
    """The spec with the operands' actual formats (index widths may have been widened)."""
    return replace(spec, formats={**spec.formats, **formats})


def kernel_source(spec: KernelSpec) -> str:
    """The module before lowering, with every size dynamic (``?``): what any specialization starts from."""
    from mlir import ir

    from .dialects.kernel import build_kernel_module

    with ir.Context():
        shapes = {n: (None,) * spec.ranks[n] for n in (*spec.inputs, spec.output)}
        return str(build_kernel_module(spec, shapes))


def build_library(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], sig: Signature, out_path: Path,
                  target: str, cpu: str, *, openmp: Path | None = None, object_file: bool = False) -> dict[str, str]:
    """Compile one specialization exporting ``sig``: a shared library, or an object file to embed.

    Returns the IR of each stage.
    """
    if target != "cpu":
        raise DeviceError(f"target {target!r} builds GPU programs (build_gpu_program), not libraries")
    from mlir import ir

    from .dialects.kernel import build_kernel_module
    from .dialects.native_bsr import native_bsr_spmm
    from .dialects.native_linear import native_linear
    from .dialects.native_sddmm import native_sddmm
    from .dialects.native_spmm import native_spmm
    from .dialects.native_spmv import native_spmv
    from .lowering import cpu as cpu_pipeline
    from .lowering import toolchain

    build = cpu_pipeline.compile_object if object_file else cpu_pipeline.compile_module
    with ir.Context():
        # patterns with a hand-scheduled emitter first; everything else goes through the sparsifier
        bits = toolchain.vector_bits(cpu)
        module = native_spmm(spec, spec.formats, shapes, bits) or native_bsr_spmm(spec, spec.formats, shapes, bits) \
            or native_linear(spec, spec.formats, shapes, bits) or native_spmv(spec, spec.formats, shapes) \
            or native_sddmm(spec, spec.formats, shapes, bits)
        if module is None:
            module = build_kernel_module(spec, shapes)
            # the sparsifier never threads insertion into a sparse output (only hand-scheduled kernels do)
            openmp = openmp if spec.parallelizable else None
        return build(module, sig, out_path, cpu_pipeline.CpuOptions(cpu=cpu, openmp=openmp))


def build_gpu_program(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], sig: Signature,
                      out_path: Path, chips: tuple[str, ...], emitter: str = "auto",
                      deterministic: bool = False) -> dict[str, str]:
    """Compile one specialization to PTX for ``chips``; write its ``GpuProgram`` as JSON to ``out_path``.

    ``emitter="auto"`` takes a hand-scheduled kernel where one applies,
    ``"sparsifier"`` always the sparsified one (to compare them).  Returns
    the IR of each stage.
    """
    from mlir import ir

    with ir.Context():
        program, stages = _gpu_program(spec, shapes, sig, chips, emitter, deterministic)
    out_path.write_text(program.dumps())
    return stages


def build_gpu_emulation(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], sig: Signature,
                        out_path: Path, emitter: str = "auto", skewed: bool = False) -> dict[str, str]:
    """A CPU library that runs the GPU program of one specialization thread by thread (``gpu_emulation``).

    It exports ``sig`` like any CPU kernel, so tests call it with numpy
    operands and compare; returns the IR of each stage.
    """
    from mlir import ir

    from .lowering import cpu, gpu_emulation, toolchain

    with ir.Context():
        program, stages = _gpu_program(spec, shapes, sig, (), emitter, False)
        module = gpu_emulation.emulation_module(program, stages["gpu"], sig, skewed)
        stages["llvm"] = cpu.loops_to_llvm(module, sig)
    toolchain.compile_shared_library(stages["llvm"], out_path, cpu="native", opt_level=1)
    return stages


def _gpu_program(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], sig: Signature,
                 chips: tuple[str, ...], emitter: str, deterministic: bool) -> tuple[Any, dict[str, str]]:
    from .dialects.kernel import build_kernel_module
    from .dialects.native_gpu import native_gpu
    from .lowering import gpu

    found = native_gpu(spec, spec.formats, shapes, deterministic) if emitter == "auto" else None
    if found is not None:
        return gpu.lower_to_ptx(found.module, sig, native=found.launches, scratch=found.scratch, chips=chips)
    if spec.dtype.name == "float16":  # the sparsifier would sum in float16
        raise DeviceError(f"float16 on cuda runs CSR SpMV/SpMM and 2:4 SpMM (rows % 16, K % 32, N % 8 == 0) with "
                          f"float32 sums; {spec.expression!r} with these formats and shapes is not one: use float32")
    return gpu.lower_to_ptx(build_kernel_module(spec, shapes), sig, chips=chips)


@functools.cache
def source_hash() -> str:
    """Hash of the package's own sources: a change in codegen invalidates cached kernels."""
    roots = {Path(__file__).resolve().parent}
    for sub in ("sparse_mlir.dialects", "sparse_mlir.lowering"):  # may live outside the package folder
        found = importlib.util.find_spec(sub)
        roots.update(Path(p).resolve() for p in (found.submodule_search_locations or []) if found)
    digest = hashlib.sha256(__version__.encode())
    for path in sorted({p for root in roots for p in root.rglob("*.py")}):
        digest.update(path.read_bytes())
    return digest.hexdigest()
