"""IR of the plain C entry point (``lowering/c_entry.py``): argument checks, descriptors, the call, results.

The wrapper is built with the LLVM dialect's op builders into a module that
declares only the kernel it calls, so each case checks that it verifies on its
own and holds what its contract says.
"""

from __future__ import annotations

import pytest
from ir_helpers import cpu_shapes, op_counts, planned, verified
from mlir import ir
from sparse_mlir.abi.c_signature import BAD_LEVELS, NULL_POINTER, SIZE_MISMATCH, Signature
from sparse_mlir.lowering.c_entry import add_c_entry_point

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

KERNEL = "_mlir_ciface_kernel"
CASES = [  # expression, formats, extents
    ("y[i] = A[i,j] * x[j]", {"A": "csr"}, {"i": 8, "j": 6}),
    ("y[i] = A[i,j] * x[j]", {"A": "coo"}, {"i": 8, "j": 6}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "2:4"}, {"i": 8, "k": 16, "j": 5}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr2x2"}, {"i": 8, "k": 6, "j": 3}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr", "B": "csr", "C": "csr"}, {"i": 4, "k": 5, "j": 6}),
    ("s[] = A[i,j]", {"A": "dcsr"}, {"i": 4, "j": 5}),
]


def _wrapper(expression: str, formats: dict, extents: dict, zero_fill: bool = True) -> tuple[ir.Module, Signature]:
    spec = planned(expression, formats, "float64")
    sig = Signature.from_spec(spec, spec.formats, cpu_shapes(spec, extents), "entry")
    module = ir.Module.create(ir.Location.unknown())
    add_c_entry_point(module, sig, KERNEL, zero_fill)
    return verified(module), sig


def _function(module: ir.Module, name: str) -> ir.Operation | None:
    for op in module.body.operations:
        if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == name:
            return op
    return None


def _constants(module: ir.Module) -> set[int]:
    """The i32 constants: the statuses the entry point returns (sizes and counts are i64)."""
    found: set[int] = set()

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "llvm.mlir.constant":
            value = op.attributes["value"]
            if str(value.type) == "i32":
                found.add(ir.IntegerAttr(value).value)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


@pytest.mark.parametrize(("expression", "formats", "extents"), CASES, ids=[f"{e}|{f}" for e, f, _ in CASES])
def test_the_entry_point_verifies_takes_every_parameter_and_calls_the_kernel(expression, formats, extents):
    module, sig = _wrapper(expression, formats, extents)
    entry = _function(module, "entry")
    assert entry is not None
    assert len(entry.regions[0].blocks[0].arguments) == len(sig.params())
    ops = op_counts(module)
    assert ops["llvm.call"] >= 1 and ops["llvm.return"] >= 2  # the call, and early returns with a status
    # the statuses the C header documents: null pointers always, sizes where a dense operand has them
    statuses = _constants(module)
    assert NULL_POINTER in statuses
    assert (SIZE_MISMATCH in statuses) == any(not op.sparse and op.shape for op in sig.operands)


def test_sparse_inputs_get_their_positions_checked():
    module, _ = _wrapper(*CASES[0])
    assert BAD_LEVELS in _constants(module)
    assert op_counts(module)["llvm.load"] >= 2  # positions are read to check they start at 0 and never fall


def test_a_sparse_result_comes_with_its_free_function():
    module, sig = _wrapper(*CASES[4])
    assert sig.output.sparse
    free = _function(module, "entry_free")
    assert free is not None
    assert op_counts(module)["llvm.call"] >= 2  # the kernel, and free() of each result buffer


def test_zero_fill_is_a_memset_only_when_asked_for():
    with_fill, _ = _wrapper(*CASES[2])
    without, _ = _wrapper(*CASES[2], zero_fill=False)
    assert op_counts(with_fill)["llvm.intr.memset"] == 1
    assert op_counts(without)["llvm.intr.memset"] == 0
