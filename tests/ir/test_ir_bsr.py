"""IR of the register-blocked BSR SpMM (``dialects/native/bsr.py``): block rows in parallel, row chunks."""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.bsr import native_bsr_spmm

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 32, "k": 64, "j": 40}


def _build(expression: str, formats: dict, dtype: str = "float32", bits: int = 256) -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_bsr_spmm(spec, spec.formats, cpu_shapes(spec, EXTENTS), bits)


def _loop_results(module: ir.Module) -> list[int]:
    """How many values each ``scf.for`` carries, in order."""
    found = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "scf.for":
            found.append(len(op.results))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def test_bsr_blocks_reuse_each_vector_of_b_for_every_row_of_the_block():
    module = verified(_build("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr2x2"}))
    kernel = functions(module)[KERNEL_NAME]
    assert FILLS_OUTPUT in kernel.attributes and "llvm.emit_c_interface" in kernel.attributes
    ops = op_counts(module)
    assert ops["scf.parallel"] == 1
    # per block column: tiles of 4 vectors (8 accumulators over 2 rows), then 1 vector, then 1 masked vector for
    # the last columns: 2 rows each
    assert ops["vector.fma"] == 2 * 2 * (4 + 1 + 1)
    assert ops["vector.maskedload"] == 2 and ops["vector.maskedstore"] == 2  # B's 2 rows of a block, C's 2 rows
    # tile loops and the block loops carrying the sums (the masked tile's, then the scalar column's)
    assert _loop_results(module) == [0, 8, 0, 2, 0, 2, 0, 2]


@pytest.mark.parametrize("bits, chunks", [(256, [8, 8]), (512, [16])])
def test_tall_blocks_are_walked_in_row_chunks(bits, chunks):
    module = verified(_build("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr16x1"}, bits=bits))
    carried = [n for n in _loop_results(module) if n]
    assert carried == chunks * 3  # one vector tier, the masked one and the scalar column, each chunk's rows' sums


@pytest.mark.parametrize("bias", ["bias[i]", "bias[j]"])
def test_a_bias_seeds_the_block_sums(bias):
    module = verified(_build(f"C[i,j] = A[i,k] * B[k,j] + {bias}", {"A": "bsr2x2"}, "float64"))
    ops = op_counts(module)
    assert ops["vector.fma"] == 2 * 2 * (4 + 1 + 1) and "vector<4xf64>" in str(module)
    kernel = functions(module)[KERNEL_NAME]
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    assert str(signature.inputs[-2]) == "memref<?xf64>"  # the bias, before C


def test_integer_blocks_multiply_and_add():
    ops = op_counts(verified(_build("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr2x2"}, "int64")))
    assert not ops["vector.fma"] and ops["arith.muli"] > 0


@pytest.mark.parametrize("expression, formats", [
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "2:4"}),
    ("C[i,j] = relu(A[i,k] * B[k,j])", {"A": "bsr2x2"}),
    ("y[i] = A[i,j] * x[j]", {"A": "bsr2x2"}),
])
def test_other_kernels_are_not_bsr_spmm(expression, formats):
    spec = planned(expression, formats)
    assert native_bsr_spmm(spec, spec.formats, cpu_shapes(spec, {"i": 8, "j": 8, "k": 8})) is None
