"""IR of the CPU sparse add (``dialects/native/sparse_add.py``): CSR + CSR -> CSR by row chunks, a counting and a
filling pass in parallel, branch-free merge steps, coefficients folded from the expression, any index widths."""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.sparse_add import native_sparse_add

from sparse_mlir.formats import CSR

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 24, "j": 40, "k": 32}
EXPRESSION = "C[i,j] = A[i,j] + B[i,j]"
CSR3 = {"A": "csr", "B": "csr", "C": "csr"}


def _build(expression: str, formats: dict, dtype: str = "float32", shapes: dict | None = None) -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_sparse_add(spec, spec.formats, shapes or cpu_shapes(spec, EXTENTS))


def _signature(module: ir.Module) -> tuple[list[str], list[str]]:
    kernel = functions(module)[KERNEL_NAME]
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    return [str(t) for t in signature.inputs], [str(t) for t in signature.results]


def test_sparse_add_takes_and_returns_level_buffers_with_two_parallel_passes():
    module = verified(_build(EXPRESSION, CSR3))
    level = ["memref<?xi32>", "memref<?xi32>", "memref<?xf32>"]
    assert _signature(module) == (level * 2, level)  # A's buffers, B's, then C's (the sparse assembler's order)
    kernel = functions(module)[KERNEL_NAME]
    assert "llvm.emit_c_interface" in kernel.attributes and FILLS_OUTPUT not in kernel.attributes
    ops = op_counts(module)
    # the counting pass in two forms (by workers with column stamps, B's columns up to STAMP_COLUMNS and the
    # entries, or by chunks merging), the filling pass
    assert ops["scf.parallel"] == 3
    assert ops["memref.atomic_rmw"] == 1 and ops["scf.while"] >= 1  # the workers claim chunks from a counter
    # two merge loops in the chunks' count and the fill (the column after a row's last read with and without a
    # clamp), a binary search for each end of a chunk's rows in each pass, and the workers' claiming loop
    assert ops["scf.while"] == 2 * 2 + 3 * 2 + 1
    # per merging pass: an empty side skips the merge, the clamp is for rows at the buffers' end, and rows of the
    # same columns (checked when of the same length) add entry by entry; the merge steps are selects.  C's
    # coordinates and values each ask for huge pages when large (``loops.result_buffer``); which count pass
    # runs, and whether the largest column is looked for (only for operands that may stamp); in the stamped
    # count, rows of the same columns (and the length check before that) too
    assert ops["scf.if"] == 2 * 4 + 2 + 2 + 2
    assert ops["func.call"] == 2 + 1 and "func.func private @madvise" in str(module)  # and the thread count
    assert ops["arith.select"] >= 2 * 2 * 2 + 2 * 3  # each merge loop: the next columns; fill: the value
    assert ops["arith.addf"] == 3 and not ops["arith.mulf"]  # two merge loops, same-column rows; coefficients 1
    # C's three buffers, the chunks' first entries, the workers' counter and stamps; all but C's are freed
    assert ops["memref.alloc"] == 3 + 1 + 2 and ops["memref.dealloc"] == 1 + 2


@pytest.mark.parametrize("expression, multiplies", [
    # each operand's values scaled where they are read: the two merge loops, its copied rest, same-column rows
    ("C[i,j] = A[i,j] - B[i,j]", 4),
    ("C[i,j] = 2*A[i,j] + B[i,j]", 4),
    ("C[i,j] = 2*A[i,j] + B[i,j]*0.5", 8),
])
def test_coefficients_multiply_only_the_scaled_operand(expression, multiplies):
    ops = op_counts(verified(_build(expression, CSR3)))
    assert ops["arith.mulf"] == multiplies and ops["arith.addf"] == 3


def test_integer_values_and_index_widths():
    formats = {"A": CSR.with_widths(64, 64), "B": CSR.with_widths(32, 16), "C": CSR.with_widths(64, 32)}
    module = verified(_build("C[i,j] = A[i,j] - B[i,j]", formats, "int64"))
    inputs, results = _signature(module)
    assert inputs == ["memref<?xi64>", "memref<?xi64>", "memref<?xi64>", "memref<?xi32>", "memref<?xi16>",
                      "memref<?xi64>"]
    assert results == ["memref<?xi64>", "memref<?xi32>", "memref<?xi64>"]
    ops = op_counts(module)
    assert ops["arith.muli"] >= 4 and not ops["arith.mulf"] and not ops["arith.addf"]  # B scaled by -1


def test_operand_order_follows_the_spec():
    module = verified(_build("C[i,j] = B[i,j] + A[i,j]", {"A": CSR.with_widths(64, 64), "B": "csr", "C": "csr"}))
    assert _signature(module)[0][:3] == ["memref<?xi32>"] * 2 + ["memref<?xf32>"]  # B first: spec.inputs order


def test_sizes_left_to_run_time_are_read_from_the_buffers():
    spec = planned(EXPRESSION, CSR3)
    generic = {name: (None, None) for name in (*spec.inputs, spec.output)}
    ops = op_counts(verified(native_sparse_add(spec, spec.formats, generic)))
    assert ops["memref.dim"] >= 1  # the rows from A's positions


@pytest.mark.parametrize("expression, formats", [
    (EXPRESSION, {"A": "csr", "B": "csr"}),  # a dense result
    ("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "C": "csr"}),  # a dense B
    (EXPRESSION, {"A": "csr", "B": "csc", "C": "csr"}),
    (EXPRESSION, {"A": "csr", "B": "csr", "C": "coo"}),
    ("C[i,j] = A[i,j] + B[j,i]", CSR3),
    ("C[i,j] = A[i,j] * B[i,j]", CSR3),
    ("C[i,j] = A[i,j] + B[i,j] + D[i,j]", {**CSR3, "D": "csr"}),
    ("C[i,j] = A[i,k] * B[k,j]", CSR3),  # an SpGEMM
])
def test_other_kernels_are_not_sparse_adds(expression, formats):
    assert _build(expression, formats) is None


def test_elementwise_product_scatters_and_probes_instead_of_merging():
    """``A .* B`` (``native_sparse_product``): the same passes, each row pair's common columns counted by stamps
    (or a bitmap) and found for the fill by a bitmap scatter of the shorter row and a probe of the longer (both
    orders built), no merge loop."""
    from sparse_mlir.dialects.native.sparse_add import native_sparse_product

    spec = planned("C[i,j] = A[i,j] * B[i,j]", CSR3, "float64")
    module = verified(native_sparse_product(spec, spec.formats, cpu_shapes(spec, EXTENTS)))
    ops = op_counts(module)
    assert ops["scf.parallel"] == 3  # the count by workers with stamps or by chunks with a bitmap, the fill
    # the bitmap passes' bitmap and positions; the stamped count's stamps and counter; firsts and C's buffers
    assert ops["memref.alloc"] == 2 * 2 + 2 + 4
    assert ops["arith.mulf"] >= 2 and not ops["arith.addf"]
    assert native_sparse_add(spec, spec.formats, cpu_shapes(spec, EXTENTS)) is None
    for expression, formats in (("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "C": "csr"}),  # a dense B
                                ("C[i,j] = A[i,j] * A[i,j]", {"A": "csr", "C": "csr"}),
                                ("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "B": "csr"}),  # a dense result
                                ("C[i,j] = A[i,j] * B[j,i]", CSR3)):
        other = planned(expression, formats, "float64")
        assert native_sparse_product(other, other.formats, cpu_shapes(other, EXTENTS)) is None
