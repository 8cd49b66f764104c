"""IR of the CPU format SpMV emitter (``dialects/native/format_spmv.py``): which loops each format gets, the
signature, and what it does not build."""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.format_spmv import native_format_spmv
from sparse_mlir.dialects.native.loops import THREAD_COUNT
from sparse_mlir.dialects.native.target import CpuTarget

from sparse_mlir.formats import COO

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 40, "j": 24, "k": 8}


def _build(expression: str, formats: dict, dtype: str = "float32", out_dtype: str | None = None,
           target: CpuTarget = CpuTarget()):
    spec = planned(expression, formats, dtype, out_dtype)
    return native_format_spmv(spec, spec.formats, cpu_shapes(spec, EXTENTS), target)


def _kernel(module: ir.Module) -> ir.Operation:
    kernel = functions(module)[KERNEL_NAME]
    assert "llvm.emit_c_interface" in kernel.attributes
    assert FILLS_OUTPUT not in kernel.attributes  # the C entry point zeroes y: rows without entries stay zero
    return kernel


def test_coo_runs_equal_chunks_in_parallel_then_adds_the_carries_in_order():
    module = verified(_build("y[i] = A[i,j] * x[j]", {"A": "coo"}))
    _kernel(module)
    ops = op_counts(module)
    assert ops["scf.parallel"] == 1  # the chunks; the carries and the unsorted fallback are serial loops after
    assert ops["scf.while"] == 2  # the head and tail scans of each chunk
    assert ops["memref.alloc"] == 5 and ops["memref.dealloc"] == 5  # carries, their rows, the disorder flags


def test_dcsr_and_transposed_csc_take_the_csr_row_loop():
    for expression, fmt in (("y[i] = A[i,j] * x[j]", "dcsr"), ("y[j] = A[i,j] * x[i]", "csc")):
        ops = op_counts(verified(_build(expression, {"A": fmt})))
        assert ops["scf.parallel"] == 1 and ops["memref.prefetch"] == 1  # spmv.RowSums: unrolled, prefetching


def test_csc_scatters_into_private_vectors_per_thread():
    module = verified(_build("y[i] = A[i,j] * x[j]", {"A": "csc"}))
    assert THREAD_COUNT in functions(module)  # declared: the CPU pipeline resolves it
    ops = op_counts(module)
    assert ops["scf.parallel"] == 2  # the ranges, then the merge of the private vectors
    assert ops["scf.while"] == 2  # a bisection over the positions for each end of a range
    assert ops["memref.alloc"] == 1 and ops["memref.dealloc"] == 1


def test_row_sums_load_no_x_and_integers_use_integer_ops():
    kernel = _kernel(verified(_build("y[i] = A[i,j]", {"A": "coo"}, "int64")))
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    assert [str(t) for t in signature.inputs] == ["memref<?xi32>", "memref<?xi32>", "memref<?xi32>",
                                                  "memref<?xi64>", "memref<?xi64>"]
    ops = op_counts(verified(_build("y[i] = A[i,j] * x[j]", {"A": "csc"}, "int32")))
    assert ops["arith.muli"] >= 1 and not ops["arith.mulf"]


def test_signature_follows_the_index_widths():
    kernel = _kernel(verified(_build("y[i] = x[j] * A[i,j]", {"A": COO.with_widths(64, 16)}, "float64")))
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    assert [str(t) for t in signature.inputs] == ["memref<?xf64>", "memref<?xi64>", "memref<?xi16>",
                                                  "memref<?xi16>", "memref<?xf64>", "memref<?xf64>"]


@pytest.mark.parametrize("expression, formats, out_dtype", [
    ("y[i] = A[i,j] * x[j]", {"A": "csr"}, None),  # the CSR SpMV's own row
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "coo"}, None),  # an SpMM
    ("y[i] = A[i,j] * x[j] + b[i]", {"A": "coo"}, None),
    ("y[i] = A[i,j] * x[j]", {"A": "bsr2x2"}, None),
    ("y[i] = A[i,j] * x[j]", {"A": "coo", "y": "sparse_vector"}, None),
    ("y[i] = A[i,j] * x[j]", {"A": "coo"}, "float32"),  # float16 data summed in float32
])
def test_other_kernels_are_not_format_spmv(expression, formats, out_dtype):
    dtype = "float16" if out_dtype else "float32"
    assert _build(expression, formats, dtype, out_dtype) is None


@pytest.mark.parametrize("expression, fmt, gathers", [
    ("y[i] = A[i,j] * x[j]", "dcsr", 3), ("y[j] = A[i,j] * x[i]", "csc", 3),  # rows as the CSR SpMV's
    ("y[i] = A[i,j]", "dcsr", 0), ("y[j] = A[i,j]", "csc", 0),  # row sums: no x to gather
    ("y[i] = A[i,j] * x[j]", "coo", 0), ("y[i] = A[i,j] * x[j]", "csc", 0),  # runs of entries; a scatter
])
def test_where_gathers_pay_dcsr_and_csc_rows_gather_x_as_csr_rows_do(expression, fmt, gathers):
    fast = op_counts(verified(_build(expression, {"A": fmt}, target=CpuTarget(512, fast_gathers=True))))
    assert fast["vector.gather"] == gathers
    assert not op_counts(verified(_build(expression, {"A": fmt})))["vector.gather"]
