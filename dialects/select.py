"""Which emitter builds a kernel: one ordered table per target, tried in order, the sparsifier last.

Why a table: each hand-scheduled emitter recognizes its own kernels (the
matchers of ``sparse_mlir.dsl.patterns``) and returns ``None`` for every
other spec, so the first row whose emitter returns a module wins, and the
order of the rows is the only precedence there is.  When no row applies,
the kernel goes through the generic ``linalg.generic`` module that the
sparsifier lowers (CPU), or that is sparsified and mapped to GPU threads
(CUDA: ``cuda_kernels`` returns ``None``).  Emitters take a planned
``KernelSpec`` and never plan one themselves.

Adding a kernel family is one emitter module under ``dialects/native/``
and one row here; nothing else chooses between emitters.  The compiler
(``sparse_mlir.compiler.build``) calls exactly ``cpu_module``,
``cuda_kernels`` and ``generic_module``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from mlir import ir
from sparse_mlir.dialects.linalg import build_kernel_module
from sparse_mlir.dialects.native.bsr import native_bsr_spmm
from sparse_mlir.dialects.native.format_spmv import native_format_spmv
from sparse_mlir.dialects.native.gpu import (
    NativeKernels,
    gpu_gemm_f16,
    gpu_linear,
    gpu_linear_2to4,
    gpu_spmm,
    gpu_spmm_2to4,
)
from sparse_mlir.dialects.native.gpu_fibers import gpu_csf_fibers
from sparse_mlir.dialects.native.gpu_formats import gpu_format_products
from sparse_mlir.dialects.native.gpu_merge import gpu_spmv_merge
from sparse_mlir.dialects.native.gpu_reduce import gpu_total_reduction
from sparse_mlir.dialects.native.gpu_sddmm import gpu_sddmm
from sparse_mlir.dialects.native.gpu_spmv import gpu_spmv
from sparse_mlir.dialects.native.linear import native_linear
from sparse_mlir.dialects.native.mlp import native_mlp
from sparse_mlir.dialects.native.sddmm import native_sddmm
from sparse_mlir.dialects.native.sparse_add import native_sparse_add, native_sparse_product
from sparse_mlir.dialects.native.spgemm import native_spgemm
from sparse_mlir.dialects.native.spmm import native_spmm
from sparse_mlir.dialects.native.spmv import native_spmv
from sparse_mlir.dialects.native.target import CpuTarget

from sparse_mlir.dsl.plan import KernelSpec

__all__ = [
    "CPU_EMITTERS",
    "CUDA_EMITTERS",
    "SPARSIFIER",
    "CpuChoice",
    "CudaChoice",
    "Emitter",
    "cpu_module",
    "cuda_choice",
    "cuda_kernels",
    "generic_module",
]

Shapes = dict[str, tuple[int | None, ...]]
SPARSIFIER = "sparsifier"  # the emitter name of the generic module


class Emitter(NamedTuple):
    """One row of a table: a name (what ``CpuChoice.emitter`` reports) and ``build(spec, shapes, option)``.

    ``option`` is the vector register width in bits on the CPU and whether
    sums must be deterministic on CUDA; ``build`` returns ``None`` for a spec
    it does not handle.
    """

    name: str
    build: Callable[[KernelSpec, Shapes, object], object]
    scalar: bool = False  # CPU: scalar by design: LLVM must not vectorize it unless gathers pay (CpuChoice)


# CPU: build(spec, shapes, target: CpuTarget) -> ir.Module | None, in the current context
CPU_EMITTERS: tuple[Emitter, ...] = (
    Emitter("spmm", lambda spec, shapes, target: native_spmm(spec, spec.formats, shapes, target)),
    Emitter("bsr_spmm", lambda spec, shapes, target: native_bsr_spmm(spec, spec.formats, shapes, target.vector_bits)),
    Emitter("linear", lambda spec, shapes, target: native_linear(spec, spec.formats, shapes, target)),
    Emitter("mlp", lambda spec, shapes, target: native_mlp(spec, spec.formats, shapes, target)),
    Emitter("spmv", lambda spec, shapes, target: native_spmv(spec, spec.formats, shapes, target), scalar=True),
    Emitter("format_spmv", lambda spec, shapes, target: native_format_spmv(spec, spec.formats, shapes, target),
            scalar=True),
    Emitter("sddmm", lambda spec, shapes, target: native_sddmm(spec, spec.formats, shapes, target.vector_bits)),
    Emitter("spgemm", lambda spec, shapes, target: native_spgemm(spec, spec.formats, shapes, target.vector_bits)),
    Emitter("sparse_add", lambda spec, shapes, target:
            native_sparse_add(spec, spec.formats, shapes, target.vector_bits)),
    Emitter("sparse_product", lambda spec, shapes, target:
            native_sparse_product(spec, spec.formats, shapes, target.vector_bits)),
)

# CUDA: build(spec, shapes, deterministic) -> NativeKernels | None, in the current context
CUDA_EMITTERS: tuple[Emitter, ...] = (
    Emitter("spmv_merge", lambda spec, shapes, deterministic:
            gpu_spmv_merge(spec, spec.formats, shapes, deterministic)),
    Emitter("spmv", lambda spec, shapes, deterministic: gpu_spmv(spec, spec.formats, shapes, deterministic)),
    Emitter("spmm_2to4", lambda spec, shapes, deterministic: gpu_spmm_2to4(spec, spec.formats, shapes)),
    Emitter("gemm_f16", lambda spec, shapes, deterministic: gpu_gemm_f16(spec, spec.formats, shapes)),
    Emitter("linear", lambda spec, shapes, deterministic: gpu_linear(spec, spec.formats, shapes)),
    Emitter("linear_2to4", lambda spec, shapes, deterministic: gpu_linear_2to4(spec, spec.formats, shapes)),
    Emitter("spmm", lambda spec, shapes, deterministic: gpu_spmm(spec, spec.formats, shapes)),
    Emitter("format_products", lambda spec, shapes, deterministic:
            gpu_format_products(spec, spec.formats, shapes, deterministic)),
    Emitter("total_reduction", lambda spec, shapes, deterministic:
            gpu_total_reduction(spec, spec.formats, shapes, deterministic)),
    Emitter("csf_fibers", lambda spec, shapes, deterministic: gpu_csf_fibers(spec, spec.formats, shapes)),
    Emitter("sddmm", lambda spec, shapes, deterministic: gpu_sddmm(spec, spec.formats, shapes)),
)


class CpuChoice(NamedTuple):
    """The module to lower and the emitter that built it (``SPARSIFIER``: the generic module).

    ``scalar``: the emitter's loops are scalar on purpose, and LLVM's
    vectorizers stay off for them.  The SpMV's independent accumulators
    were packed by the SLP vectorizer into 4-lane gathers of ``x``: on a
    Zen 4 host 1.25-1.35x slower than the scalar loads (session 10), on a
    Sapphire-Rapids-class Xeon 1.1-1.3x faster where the gathers miss the
    caches (session 15), on a Zen 5 host 5-10% slower on long rows, and
    the scatters of CSC and CSR-transposed SpMVs 2-6% slower (session 23).
    Where gathers pay (``CpuTarget.fast_gathers``) the SpMV's long rows now
    gather whole registers of ``x`` themselves (``spmv.RowSums``, vector
    ops the vectorizers' switch does not touch), so the rest stays scalar
    on every host.
    """

    module: ir.Module
    emitter: str
    scalar: bool = False


class CudaChoice(NamedTuple):
    """The hand-scheduled kernels with their launches, and the emitter that built them."""

    kernels: NativeKernels
    emitter: str


def cpu_module(spec: KernelSpec, shapes: Shapes, target: CpuTarget) -> CpuChoice:
    """The first hand-scheduled CPU module that applies, else the generic module for the sparsifier.

    ``shapes`` gives every operand's sizes (``None``: dynamic); ``target``
    is the CPU's vector width and L1 size (``toolchain.cpu_target``).
    """
    for emitter in CPU_EMITTERS:
        module = emitter.build(spec, shapes, target)
        if module is not None:
            return CpuChoice(module, emitter.name, emitter.scalar)
    return CpuChoice(generic_module(spec, shapes), SPARSIFIER)


def cuda_choice(spec: KernelSpec, shapes: Shapes, deterministic: bool) -> CudaChoice | None:
    """The first hand-scheduled CUDA emitter that applies and what it built, or ``None``."""
    for emitter in CUDA_EMITTERS:
        kernels = emitter.build(spec, shapes, deterministic)
        if kernels is not None:
            return CudaChoice(kernels, emitter.name)
    return None


def cuda_kernels(spec: KernelSpec, shapes: Shapes, deterministic: bool) -> NativeKernels | None:
    """Hand-scheduled GPU kernels with their launches, or ``None``: the sparsified module is mapped instead.

    ``deterministic`` drops kernels whose atomic additions make float sums
    differ from run to run (the row-splitting SpMV).
    """
    choice = cuda_choice(spec, shapes, deterministic)
    return None if choice is None else choice.kernels


def generic_module(spec: KernelSpec, shapes: Shapes) -> ir.Module:
    """The ``linalg.generic`` module of ``spec`` (``None`` sizes stay dynamic), what the sparsifier lowers."""
    return build_kernel_module(spec, shapes)
