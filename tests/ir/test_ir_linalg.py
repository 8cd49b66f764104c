"""IR of the generic module (``dialects/linalg.py``): one ``linalg.generic`` per stage over tensors with their
``#sparse_tensor.encoding``, what the sparsifier lowers when no hand-scheduled emitter applies."""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from mlir.dialects import sparse_tensor as st
from sparse_mlir.dialects.linalg import (
    FILLS_OUTPUT,
    KERNEL_NAME,
    build_kernel_module,
    fills_output,
)
from sparse_mlir.dialects.native.spmm import native_spmm

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process


def _build(expression: str, formats: dict, dtype: str = "float32", extents: dict | None = None,
           name: str = KERNEL_NAME) -> ir.Module:
    spec = planned(expression, formats, dtype)
    shapes = cpu_shapes(spec, extents or {"i": 16, "j": 24, "k": 8})
    return verified(build_kernel_module(spec, shapes, name))


def _signature(module: ir.Module, name: str = KERNEL_NAME) -> ir.FunctionType:
    return ir.FunctionType(ir.TypeAttr(functions(module)[name].attributes["function_type"]).value)


def test_a_stage_is_a_linalg_generic_over_encoded_tensors():
    module = _build("y[i] = A[i,j] * x[j]", {"A": "csr"})
    kernel = functions(module)[KERNEL_NAME]
    assert "llvm.emit_c_interface" in kernel.attributes and FILLS_OUTPUT not in kernel.attributes
    assert not fills_output(module)  # the sparsified loops accumulate into the zeroed output
    ops = op_counts(module)
    assert ops["linalg.generic"] == 1 and ops["arith.mulf"] == 1 and ops["arith.addf"] == 1
    inputs = _signature(module).inputs
    encoding = st.EncodingAttr(ir.RankedTensorType(inputs[0]).encoding)
    assert (encoding.pos_width, encoding.crd_width, len(encoding.lvl_types)) == (32, 32, 2)
    assert "(d0 : dense, d1 : compressed)" in str(encoding) and str(inputs[0]).startswith("tensor<16x24xf32")
    assert str(inputs[1]) == "tensor<24xf32>" and str(inputs[2]) == "tensor<16xf32>"  # x, then the dense output
    assert "reduction" in str(module)


def test_sizes_no_sparse_operand_fixes_stay_dynamic():
    module = _build("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"})
    assert [str(t).split(",")[0] for t in _signature(module).inputs[1:]] == ["tensor<8x?xf32>", "tensor<16x?xf32>"]
    spec = planned("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"})
    dynamic = verified(build_kernel_module(spec, {n: (None,) * spec.ranks[n] for n in (*spec.inputs, spec.output)}))
    assert str(_signature(dynamic).inputs[0]).startswith("tensor<?x?xf32, #sparse_tensor.encoding")


def test_a_sum_inside_an_expression_is_a_stage_of_its_own():
    module = _build("C[i,j] = relu(A[i,k]*B[k,j] + bias[j])", {"A": "csc"})
    ops = op_counts(module)
    assert ops["linalg.generic"] == 2 and ops["tensor.empty"] == 1 and ops["linalg.fill"] == 1  # a zeroed temporary
    assert ops["arith.maximumf"] == 1 and not ops["sparse_tensor.unary"]  # relu of dense values: plain arith


def test_functions_of_sparse_values_say_what_happens_where_they_are_absent():
    module = _build("C[i,j] = relu(A[i,j]) + max(A[i,j], D[i,j]) + exp(A[i,j])", {"A": "csr"})
    ops = op_counts(module)
    assert ops["sparse_tensor.unary"] == 2 and ops["sparse_tensor.binary"] == 1 and ops["math.exp"] == 1


def test_a_sparse_result_starts_from_an_empty_sparse_tensor():
    module = _build("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "B": "csr", "C": "csr"}, "int32")
    signature = _signature(module)
    assert len(signature.inputs) == 2 and "#sparse_tensor.encoding" in str(signature.results[0])  # no output arg
    ops = op_counts(module)
    assert ops["tensor.empty"] == 1 and ops["arith.muli"] == 1 and not ops["arith.addi"]


def test_block_formats_carry_their_block_map_and_the_name_is_the_callers():
    module = _build("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr2x2"}, name="other")
    assert set(functions(module)) == {"other"}
    assert "floordiv 2" in str(_signature(module, "other").inputs[0])


@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_hand_scheduled_modules_fill_their_output_and_generic_ones_do_not(dtype):
    spec = planned("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}, dtype)
    shapes = cpu_shapes(spec, {"i": 8, "j": 8, "k": 8})
    assert fills_output(verified(native_spmm(spec, spec.formats, shapes)))
    assert not fills_output(verified(build_kernel_module(spec, shapes)))
