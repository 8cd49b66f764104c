"""IR of the CPU SpGEMM (``dialects/native/spgemm.py``): CSR x CSR -> CSR by rows, a symbolic and a numeric pass
over chunks of rows in parallel (by workers with column stamps, or by chunks with a bitmap), sorted or
bitmap-read rows, any index widths."""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.linalg import KERNEL_NAME
from sparse_mlir.dialects.native.spgemm import native_spgemm

from sparse_mlir.formats import CSR

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 24, "j": 40, "k": 32}
EXPRESSION = "C[i,j] = A[i,k] * B[k,j]"


def _build(expression: str, formats: dict, dtype: str = "float32", shapes: dict | None = None) -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_spgemm(spec, spec.formats, shapes or cpu_shapes(spec, EXTENTS))


def _signature(module: ir.Module) -> tuple[list[str], list[str]]:
    kernel = functions(module)[KERNEL_NAME]
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    return [str(t) for t in signature.inputs], [str(t) for t in signature.results]


def test_spgemm_takes_and_returns_level_buffers_with_two_parallel_passes():
    module = verified(_build(EXPRESSION, {"A": "csr", "B": "csr", "C": "csr"}))
    level = ["memref<?xi32>", "memref<?xi32>", "memref<?xf32>"]
    assert _signature(module) == (level * 2, level)  # A's buffers, B's, then C's (the sparse assembler's order)
    ops = op_counts(module)
    # the work per row; then each pass twice: by workers with stamps (B's columns up to STAMP_COLUMNS and the
    # work) or by chunks with the bitmap alone
    assert ops["scf.parallel"] == 1 + 2 * 2
    assert ops["memref.atomic_rmw"] == 2  # each pass's workers claim chunks from a shared counter
    assert ops["sparse_tensor.sort"] == 2  # short rows' columns, in each numeric pass
    # wide rows: the bitmap counted (a ctpop per word: the bitmap symbolic pass only), then in each numeric pass
    # read back a block of words at a time: one vector compare masks the block's non-zero words (a cttz and
    # ctpop over the mask), then each word's bits
    assert ops["math.cttz"] == 2 * 2 and ops["math.ctpop"] == 1 + 2 * 2
    assert ops["vector.load"] == 2 and ops["vector.bitcast"] == 2
    assert ops["arith.mulf"] == 4 and ops["arith.addf"] == 4  # a multiply-add per product, each kind of row
    # B's rows AHEAD entries on (positions, coordinates, values), in each walk over a row's products: wide and
    # narrow rows in both bitmap passes and the stamped numeric one, all rows alike in the stamped count
    assert ops["memref.prefetch"] == 3 * (2 + 2 + 2 + 1)
    # C's three buffers, offsets and chunk starts; per chunk in the bitmap passes the bitmap and column list
    # (and the accumulator: numeric); per worker in the stamped passes the stamps (and the bitmap, list and
    # accumulator: numeric) and each pass's counter; every scratch buffer is freed
    assert ops["memref.alloc"] == 3 + 2 + (2 + 3) + (2 + 5)
    assert ops["memref.dealloc"] == 2 + (2 + 3) + (2 + 5)


def test_integer_values_and_index_widths():
    formats = {"A": CSR.with_widths(64, 64), "B": CSR.with_widths(32, 16), "C": CSR.with_widths(64, 32)}
    module = verified(_build(EXPRESSION, formats, "int64"))
    inputs, results = _signature(module)
    assert inputs == ["memref<?xi64>", "memref<?xi64>", "memref<?xi64>", "memref<?xi32>", "memref<?xi16>",
                      "memref<?xi64>"]
    assert results == ["memref<?xi64>", "memref<?xi32>", "memref<?xi64>"]
    ops = op_counts(module)
    assert ops["arith.muli"] > 0 and not ops["arith.mulf"]


def test_one_operand_twice_and_the_factor_order():
    module = verified(_build("C[i,j] = A[i,k] * A[k,j]", {"A": "csr", "C": "csr"}, shapes={"A": (24, 24),
                                                                                            "C": (24, 24)}))
    assert len(_signature(module)[0]) == 3  # A's buffers once, read as both factors
    swapped = verified(_build("C[i,j] = B[k,j] * A[i,k]", {"A": "csr", "B": CSR.with_widths(64, 64), "C": "csr"}))
    assert _signature(swapped)[0][:3] == ["memref<?xi64>"] * 2 + ["memref<?xf32>"]  # B first: spec.inputs order


def test_sizes_left_to_run_time_are_read_from_the_buffers():
    spec = planned(EXPRESSION, {"A": "csr", "B": "csr", "C": "csr"})
    generic = {name: (None, None) for name in (*spec.inputs, spec.output)}
    module = verified(native_spgemm(spec, spec.formats, generic))
    ops = op_counts(module)
    assert ops["memref.dim"] >= 2  # A's rows from its positions, B's columns from its coordinates


@pytest.mark.parametrize("expression, formats", [
    (EXPRESSION, {"A": "csr", "B": "csr"}),  # a dense result
    (EXPRESSION, {"A": "csr", "C": "csr"}),  # a dense B
    (EXPRESSION, {"A": "csr", "B": "csc", "C": "csr"}),
    (EXPRESSION, {"A": "csr", "B": "csr", "C": "dcsr"}),
    ("C[i,j] = A[i,k] * B[k,j] + D[i,j]", {"A": "csr", "B": "csr", "C": "csr", "D": "csr"}),
    ("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": "csr"}),  # an SDDMM
])
def test_other_kernels_are_not_spgemm(expression, formats):
    assert _build(expression, formats) is None
