"""Which kernels are shape-generic: one build takes every size at run time (CPU, and CUDA below).

The hand-scheduled CPU emitters (``dialects.native``) take a sparse operand as
plain memrefs (positions, coordinates, values) and read every size from its
buffers or the dense operands, so they need no static shape; the sparsifier
goes through ``sparse_tensor.assemble``, which refuses dynamic sparse
shapes, so its kernels stay one build per sparse shape.  The runtime must
know which applies before it asks for a build, in a process that may never
load MLIR, so the decision is made here from the spec and formats alone,
with the same matchers (``dsl.patterns``) the emitters call, in the order of
``dialects.select.CPU_EMITTERS``.  ``build.build_cpu`` checks on every
shape-generic build that the emitter it ran is the one named here, and
``tests/ir/test_ir_select.py`` that the rows agree, so the two cannot drift
apart silently.  No MLIR here.

On CUDA the hand-scheduled CSR SpMV and SpMM kernels (``dialects.native.gpu_spmv``,
``gpu_spmm``) read their sizes from the buffers' descriptors and size their
grids at launch (``abi.gpu_program.GridRule`` / ``LaneRule``; the SpMM
picks its tiling's variant by ``SizeTest``s; the CSR Linear layer also
sizes its scratch ``X^T`` and ``T`` from the call: ``SizeOf``), and so do the COO, CSC and
DCSR SpMV/SpMM and row sums (``gpu_formats``), the total reductions
(``gpu_reduce``), the CSF fiber kernel (``gpu_fibers``) and the SDDMM (``gpu_sddmm``, a CSR result); they are
shape-generic too: ``SHAPE_GENERIC_CUDA`` names them in the order of
``dialects.select.CUDA_EMITTERS``; ``build.gpu_program`` refuses a
shape-generic build that another emitter would take.
"""

from __future__ import annotations

from collections.abc import Callable

from sparse_mlir.dsl.patterns import (
    bsr_blocks,
    fiber_operands,
    format_kind,
    gpu_sddmm_operands,
    is_csr,
    linear_epilogue,
    linear_operands,
    product_operands,
    scatters,
    sddmm_operands,
    sparse_product_operands,
    sparse_sum_operands,
    spgemm_operands,
    spmm_epilogue,
    spmm_operands,
    spmv_operands,
    total_reduction_operands,
    unscaled,
)
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["SHAPE_GENERIC_CPU", "SHAPE_GENERIC_CUDA", "shape_generic_emitter", "shape_generic_cuda_emitter"]

Match = Callable[[KernelSpec, dict[str, Format]], bool]


def _spmm(spec: KernelSpec, formats: dict[str, Format]) -> bool:
    found = spmm_operands(spec, formats)
    if found is None:
        return spmm_epilogue(spec, formats) is not None
    return is_csr(formats[found[0]]) or formats[found[0]].is_nm


def _bsr(spec: KernelSpec, formats: dict[str, Format]) -> bool:
    found = spmm_operands(spec, formats)
    return found is not None and bsr_blocks(formats[found[0]]) is not None


def _linear(spec: KernelSpec, formats: dict[str, Format]) -> bool:
    return linear_operands(spec, formats, residual=True) is not None \
        or linear_epilogue(spec, formats, residual=True) is not None


def _format_spmv(spec: KernelSpec, formats: dict[str, Format]) -> bool:
    """``dialects.native.format_spmv``: a COO, DCSR or CSC SpMV or row sum summed in its own type."""
    return product_operands(spec, formats) is not None and len(spec.output_indices) == 1 \
        and spec.output_dtype == spec.dtype


# the shape-generic rows of ``dialects.select.CPU_EMITTERS``, by emitter name, in the table's order
SHAPE_GENERIC_CPU: tuple[tuple[str, Match], ...] = (
    ("spmm", _spmm),
    ("bsr_spmm", _bsr),
    ("linear", _linear),
    ("spmv", lambda spec, formats: spmv_operands(unscaled(spec)[0], formats) is not None),
    ("format_spmv", lambda spec, formats: _format_spmv(unscaled(spec)[0], formats)),
    ("sddmm", lambda spec, formats: sddmm_operands(spec, formats) is not None),
    ("spgemm", lambda spec, formats: spgemm_operands(spec, formats) is not None),
    ("sparse_add", lambda spec, formats: sparse_sum_operands(spec, formats) is not None),
    ("sparse_product", lambda spec, formats: sparse_product_operands(spec, formats) is not None),
)


def shape_generic_emitter(spec: KernelSpec, formats: dict[str, Format]) -> str | None:
    """The name of the shape-generic CPU emitter that builds ``spec`` with ``formats`` (the operands' actual
    formats, index widths included), or ``None``: the kernel is built once per sparse shape."""
    formats = {**spec.formats, **formats}
    for name, matches in SHAPE_GENERIC_CPU:
        if matches(spec, formats):
            return name
    return None


CudaMatch = Callable[[KernelSpec, dict[str, Format], bool], bool]


def _cuda_spmv(spec: KernelSpec, formats: dict[str, Format], deterministic: bool) -> bool:
    if spec.dtype.kind != "f" or spmv_operands(spec, formats) is None:
        return False
    # a deterministic float32/float64 SpMV takes the merge path (``spmv_merge``, the row before ``spmv``), whose
    # carries fill a scratch buffer sized by the rows: one build per shape
    return not (deterministic and spec.dtype.name in ("float32", "float64") and spec.output_dtype == spec.dtype)


def _cuda_spmm(spec: KernelSpec, formats: dict[str, Format], deterministic: bool) -> bool:
    # CSR only (2:4 is the Tensor Core rows, before it), and not a Linear layer (its own row, before it)
    found = spmm_operands(spec, formats)
    return spec.dtype.kind == "f" and found is not None and is_csr(formats[found[0]]) and \
        linear_operands(spec, formats) is None


def _cuda_format_products(spec: KernelSpec, formats: dict[str, Format], deterministic: bool) -> bool:
    found = product_operands(spec, formats)
    if found is None or not _own_type_sums(spec):
        return False
    if scatters(spec, formats, found[0]) and deterministic and spec.dtype.kind == "f":
        return False  # left to the sparsifier: its atomic float sums are not deterministic
    # the deterministic COO SpMV's carries fill scratch sized by the rows: one build per shape
    return not (format_kind(formats[found[0]]) == "coo" and len(spec.output_indices) == 1 and deterministic)


def _own_type_sums(spec: KernelSpec) -> bool:
    """Summed in the data's own type (``gpu_build.element_type``: no float16, no out_dtype)."""
    return spec.dtype.name in ("float32", "float64", "int32", "int64") and spec.output_dtype == spec.dtype


def _cuda_linear(spec: KernelSpec, formats: dict[str, Format], deterministic: bool) -> bool:
    roles = linear_operands(spec, formats)
    return spec.dtype.kind == "f" and roles is not None and is_csr(formats[roles["w"]])


# the shape-generic rows of ``dialects.select.CUDA_EMITTERS``, by emitter name, in the table's order
SHAPE_GENERIC_CUDA: tuple[tuple[str, CudaMatch], ...] = (
    ("spmv", _cuda_spmv),
    ("linear", _cuda_linear),
    ("spmm", _cuda_spmm),
    ("format_products", _cuda_format_products),
    ("total_reduction", lambda spec, formats, _: _own_type_sums(spec) and
     total_reduction_operands(spec, formats) is not None),
    ("csf_fibers", lambda spec, formats, _: _own_type_sums(spec) and fiber_operands(spec, formats) is not None),
    ("sddmm", lambda spec, formats, _: gpu_sddmm_operands(spec, formats) is not None),
)


def shape_generic_cuda_emitter(spec: KernelSpec, formats: dict[str, Format], deterministic: bool) -> str | None:
    """The name of the shape-generic CUDA emitter that builds ``spec`` with ``formats`` (``deterministic``: no
    atomics), or ``None``: the GPU program is built once per operand shape."""
    formats = {**spec.formats, **formats}
    for name, matches in SHAPE_GENERIC_CUDA:
        if matches(spec, formats, deterministic):
            return name
    return None
