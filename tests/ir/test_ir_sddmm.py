"""IR of the CPU SDDMM (``dialects/native/sddmm.py``): S's pattern copied, B transposed, vector dot products."""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.linalg import KERNEL_NAME
from sparse_mlir.dialects.native.sddmm import native_sddmm

from sparse_mlir.formats import CSR

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 24, "j": 40, "k": 32}


def _build(expression: str, formats: dict, dtype: str = "float32") -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_sddmm(spec, spec.formats, cpu_shapes(spec, EXTENTS))


def test_sddmm_copies_the_pattern_and_sums_groups_of_entries_by_shuffles():
    module = verified(_build("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": "csr"}))
    kernel = functions(module)[KERNEL_NAME]
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    level = ["memref<?xi32>", "memref<?xi32>", "memref<?xf32>"]
    assert [str(t) for t in signature.inputs] == [*level, "memref<24x?xf32>", "memref<?x40xf32>"]
    assert [str(t) for t in signature.results] == level  # C's buffers: S's pattern, new values
    ops = op_counts(module)
    # S's positions are copied; its coordinates are stored by the groups that read them, one vector each
    # B^T, shared or each worker's own (``_ReadCopy``), and the phases' counters are freed
    assert ops["memref.copy"] == 1 and ops["memref.alloc"] == 6 and ops["memref.dealloc"] == 3
    coordinate_stores = [line for line in str(module).splitlines() if "vector.store" in line and "xi32>" in line]
    assert len(coordinate_stores) == 4  # a full group of 8 lanes, then the rest's groups of 4, 2 and 1
    assert ops["scf.parallel"] == 1  # one region: the transpose, then the rows of S (``loops.in_phases``)
    assert ops["memref.atomic_rmw"] == 4  # claims of each phase, the transpose's done count, the wait's reads
    assert ops["vector.fma"] > 0 and ops["vector.shuffle"] > 0  # the dot products' transposed reduction
    assert not ops["vector.reduction"]  # no horizontal sum per entry


def test_integer_sddmm_and_the_factor_order():
    module = verified(_build("C[i,j] = A[i,k] * B[k,j] * S[i,j]", {"S": CSR.with_widths(64, 64),
                                                                    "C": CSR.with_widths(64, 64)}, "int32"))
    ops = op_counts(module)
    assert not ops["vector.fma"] and ops["arith.muli"] > 0
    kernel = functions(module)[KERNEL_NAME]
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    assert [str(t) for t in signature.inputs][:2] == ["memref<24x?xi32>", "memref<?x40xi32>"]  # A, B, then S


@pytest.mark.parametrize("expression, formats", [
    ("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr"}),  # a dense result
    ("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csc", "C": "csr"}),
    ("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": CSR.with_widths(64, 64)}),  # other index widths
    ("C[i,j] = S[i,j] * A[i,j]", {"S": "csr", "C": "csr"}),
])
def test_other_kernels_are_not_sddmm(expression, formats):
    spec = planned(expression, formats)
    assert native_sddmm(spec, spec.formats, cpu_shapes(spec, EXTENTS)) is None


def test_b_by_rows_is_read_without_a_transpose():
    """``B[j,k]`` (attention's ``K`` as stored): no transpose, only a conditional copy onto a cache line."""
    module = verified(_build("C[i,j] = S[i,j] * A[i,k] * B[j,k]", {"S": "csr", "C": "csr"}))
    ops = op_counts(module)
    assert ops["scf.parallel"] == 1  # one region: B's rows onto lines (when it is off one), then the rows of S
    # S's positions are copied; the counters are freed, and B's copy if made (shared or each worker's own)
    assert ops["memref.copy"] == 1 and ops["memref.dealloc"] == 3
    assert "memref.extract_aligned_pointer_as_index" in str(module)
