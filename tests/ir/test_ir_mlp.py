"""IR of two Linear layers in one kernel (``dialects/native/mlp.py``): one transpose in, two private tiled SpMMs
sharing an L2-sized hidden scratch per batch block, one transpose out."""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.epilogue import SCALAR_EPILOGUE, VECTOR_EPILOGUE
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.loops import THREAD_COUNT
from sparse_mlir.dialects.native.mlp import native_mlp
from sparse_mlir.dialects.native.target import CpuTarget

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"b": 8, "i": 64, "o": 96, "p": 32}
FFN = "Y[b,p] = W2[p,o] * gelu(X[b,i] * W1[o,i] + b1[o]) + b2[p]"


def _build(expression: str, formats: dict, extents: dict = EXTENTS, dtype: str = "float32") -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_mlp(spec, spec.formats, cpu_shapes(spec, extents), CpuTarget(512))


@pytest.mark.parametrize("formats", [("csr", "csr"), ("2:4", "csr"), ("csr", "2:4")])
def test_both_layers_run_in_one_kernel_with_the_hidden_block_in_a_scratch(formats):
    module = verified(_build(FFN, dict(zip(("W1", "W2"), formats))))
    found = functions(module)
    assert set(found) == {KERNEL_NAME, "mlp_first", "mlp_second", THREAD_COUNT, SCALAR_EPILOGUE, VECTOR_EPILOGUE}
    kernel = found[KERNEL_NAME]
    assert FILLS_OUTPUT in kernel.attributes and "llvm.emit_c_interface" in kernel.attributes
    for helper in ("mlp_first", "mlp_second"):
        assert ir.StringAttr(found[helper].attributes["sym_visibility"]).value == "private"
    # the GELU and b1 are the first SpMM's epilogue, b2 the second one's row bias: only the first has an epilogue
    assert "call @" + VECTOR_EPILOGUE in str(found["mlp_first"]) and VECTOR_EPILOGUE not in str(found["mlp_second"])
    ops = op_counts(kernel)
    # two copies of the block (blocks by workers, or one after the other), each: X^T in, T^T out (one masked
    # edge tile each: the hidden block is never transposed), three scratch buffers (X^T, T, hidden) allocated
    # once for the serial blocks and once per worker (plus the workers' counter); the thread count for the workers
    assert ops["vector.transpose"] == 2 * 2
    assert ops["memref.alloc"] == ops["memref.dealloc"] == 2 * 3 + 1
    assert ops["func.call"] == 2 * 2 + 1
    assert "memref<96x" not in str(kernel)  # the hidden width is a compiled-in size of a dynamic scratch


def test_the_signature_is_the_spec_inputs_in_order_then_y():
    module = verified(_build(FFN, {"W1": "csr", "W2": "2:4"}))
    signature = ir.FunctionType(ir.TypeAttr(functions(module)[KERNEL_NAME].attributes["function_type"]).value)
    # the planner's input order: W2, X, W1, b1, b2; each weight as positions, coordinates, values
    assert [str(t) for t in signature.inputs] == [
        "memref<?xi32>", "memref<?xi8>", "memref<?xf32>", "memref<?x?xf32>", "memref<?xi32>", "memref<?xi32>",
        "memref<?xf32>", "memref<?xf32>", "memref<?xf32>", "memref<?x?xf32>"]


@pytest.mark.parametrize("expression", [
    "Y[b,p] = X[b,i] * W1[p,i] + W2[p,o] * b1[o]",  # two layers, but not a chain
    "Y[b,p] = W2[p,o] * gelu(X[b,i] * W1[o,i] + b1[b])",  # the hidden step reads the batch index
    "Y[b,p] = W2[p,o] * gelu(X[b,i] * W1[o,i]) + b2[b]",  # so does the final bias
    "Y[b,p] = W2[o,p] * gelu(X[b,i] * W1[o,i])",  # W2 used transposed
    "Y[b,p] = W2[p,o] * gelu(X[b,i] * W1[o,i]) * W1[p,o]",  # a third sparse factor
])
def test_other_kernels_are_not_taken(expression):
    assert _build(expression, {"W1": "csr", "W2": "csr"}, {**EXTENTS, "p": 96}) is None


def test_dense_or_blocked_weights_are_not_taken():
    assert _build(FFN, {"W1": "csr", "W2": "bsr4x4"}) is None
    assert _build(FFN, {"W1": "csr"}) is None
