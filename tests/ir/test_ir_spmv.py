"""IR of the CPU SpMV emitter (``dialects/native/spmv.py``): unrolled rows, a prefetch of ``x``, rows in parallel;
where gathers pay, long rows a vector of entries at a time."""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.spmv import UNROLL, native_spmv
from sparse_mlir.dialects.native.target import CpuTarget

from sparse_mlir.formats import CSR

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 40, "j": 24}


def _build(expression: str, formats: dict, dtype: str = "float32", target: CpuTarget = CpuTarget()) -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_spmv(spec, spec.formats, cpu_shapes(spec, EXTENTS), target)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_float_spmv_unrolls_rows_prefetches_x_and_runs_rows_in_parallel(dtype):
    module = verified(_build("y[i] = A[i,j] * x[j]", {"A": "csr"}, dtype))
    (kernel,) = functions(module).values()
    assert ir.StringAttr(kernel.attributes["sym_name"]).value == KERNEL_NAME
    assert "llvm.emit_c_interface" in kernel.attributes and FILLS_OUTPUT in kernel.attributes
    ops = op_counts(module)
    assert ops["scf.parallel"] == 1 and ops["memref.prefetch"] == 1
    assert ops["scf.for"] == 2 and ops["scf.if"] == 1  # the unrolled loop for long rows, then the tail
    # one accumulator per unrolled entry, combined after the loop, plus the tail's chain
    assert ops["arith.mulf"] == UNROLL + 1 and ops["arith.addf"] == 2 * UNROLL


@pytest.mark.parametrize("dtype, bits, lanes", [("float32", 512, 16), ("float64", 512, 8), ("float32", 256, 8),
                                                ("int64", 512, 8)])
def test_where_gathers_pay_long_rows_gather_x_a_vector_register_at_a_time(dtype, bits, lanes):
    module = verified(_build("y[i] = A[i,j] * x[j]", {"A": "csr"}, dtype, CpuTarget(bits, fast_gathers=True)))
    ops = op_counts(module)
    # a pair of vectors a step, then one more: three gathers, three loads of values and three of coordinates
    assert ops["vector.gather"] == 3 and ops["vector.load"] == 6 and ops["vector.reduction"] == 1
    assert not ops["memref.prefetch"]  # the gathers are the loads of x: nothing to prefetch
    assert f"vector<{lanes}x" in str(module)
    assert ops["scf.parallel"] == 1 and ops["scf.for"] == 2  # the pairs of vectors, then the scalar tail
    scalar = op_counts(verified(_build("y[i] = A[i,j] * x[j]", {"A": "csr"}, dtype, CpuTarget(bits))))
    assert not scalar["vector.gather"] and scalar["memref.prefetch"] == 1


def test_integer_spmv_multiplies_with_integer_ops():
    ops = op_counts(verified(_build("y[i] = A[i,j] * x[j]", {"A": "csr"}, "int32")))
    assert ops["arith.addi"] >= 2 * UNROLL and not ops["arith.mulf"] and not ops["arith.addf"]


def test_signature_follows_the_spec_order_and_the_index_widths():
    fmt = CSR.with_widths(64, 16)
    module = verified(_build("y[i] = x[j] * A[i,j]", {"A": fmt}, "float64"))
    kernel = functions(module)[KERNEL_NAME]
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    assert [str(t) for t in signature.inputs] == ["memref<?xf64>", "memref<?xi64>", "memref<?xi16>", "memref<?xf64>",
                                                  "memref<?xf64>"]
    assert [str(t) for t in signature.results] == ["memref<?xf64>"]


@pytest.mark.parametrize("expression, formats", [
    ("y[i] = A[i,j] * x[j]", {"A": "csc"}),
    ("y[i] = A[i,j] * x[j]", {"A": "2:4"}),
    ("y[i] = A[i,j] * x[j] + b[i]", {"A": "csr"}),
    ("y[i] = A[i,j] * x[j]", {"A": "csr", "y": "sparse_vector"}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}),
])
def test_other_kernels_are_not_spmv(expression, formats):
    spec = planned(expression, formats)
    extents = {"i": 8, "j": 8, "k": 8}
    assert native_spmv(spec, spec.formats, cpu_shapes(spec, extents)) is None
