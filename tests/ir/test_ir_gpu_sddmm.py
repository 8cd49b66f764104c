"""IR of the GPU SDDMM (``dialects/native/gpu_sddmm.py``): it verifies, transposes B into scratch, gives each stored
entry one thread (a binary search for its row, no shuffles or barriers), writes only C's values, reads every size
from the descriptors in a shape-generic build; other specs are turned down."""

from __future__ import annotations

import pytest
from ir_helpers import functions, op_counts, planned, static_shapes, verified
from sparse_mlir.dialects.native.gpu_sddmm import UNROLL, gpu_sddmm

from sparse_mlir.abi.gpu_program import GridRule, KernelArg, SizeOf
from sparse_mlir.compiler.driver import generic_shapes

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

SDDMM = "C[i,j] = S[i,j] * A[i,k] * B[k,j]"
FORMATS = {"S": "csr", "C": "csr"}
EXTENTS = {"i": 64, "j": 48, "k": 40}


def _built(expression: str = SDDMM, formats: dict | None = None, dtype: str = "float32", generic: bool = True):
    spec = planned(expression, formats or FORMATS, dtype)
    shapes = generic_shapes(spec) if generic else static_shapes(spec, EXTENTS)
    return gpu_sddmm(spec, spec.formats, shapes)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_a_thread_per_entry_over_a_transposed_b(dtype):
    found = _built(dtype=dtype)
    verified(found.module)
    assert set(functions(found.module)) == {"transpose_b", "sddmm"}
    ops = op_counts(found.module)
    assert not ops["gpu.shuffle"] and not ops["gpu.barrier"] and not ops["memref.atomic_rmw"]  # emulated exactly
    assert ops["scf.while"] == 1  # the row of each entry: one binary search over S's positions
    assert ops["math.fma"] == UNROLL + 1  # the unrolled chains and the tail
    assert ops["arith.extf"] == (2 * (UNROLL + 1) + 1 if dtype == "float16" else 0)  # float16 summed in float32
    transpose, sddmm = found.launches
    assert transpose.kernel == "transpose_b" and transpose.grid == GridRule(ref=4, per_block=128)  # B's elements
    assert transpose.args == (KernelArg("buffer", 4, (None, None)), KernelArg("scratch", 0, (None, None)))
    assert sddmm.kernel == "sddmm" and sddmm.grid == GridRule(ref=2, per_block=128) and sddmm.fills_output
    assert sddmm.args[-1] == KernelArg("result", 2, (None,))  # C's values; its pattern is S's (copied)
    assert sddmm.args[4] == KernelArg("scratch", 0, (None, None))
    assert found.scratch == (((SizeOf(4, 1), SizeOf(4, 0)), dtype),)  # B^T sized from B at the call


def test_a_static_build_has_its_sizes_and_the_same_launches():
    found = _built(generic=False)
    verified(found.module)
    assert found.scratch == (((48, 40), "float32"),)
    assert [launch.kernel for launch in found.launches] == ["transpose_b", "sddmm"]
    assert "memref<64x40xf32>" in str(found.module) and "memref<48x40xf32>" in str(found.module)


def test_the_factors_in_any_order_and_their_argument_positions():
    found = _built("C[i,j] = A[i,k] * S[i,j] * B[k,j]")
    _, sddmm = found.launches
    assert [arg.ref for arg in sddmm.args[:4]] == [1, 2, 3, 0]  # A first, then S's three buffers


@pytest.mark.parametrize(("expression", "formats", "dtype"), [
    (SDDMM, FORMATS, "int32"),  # integers: no GPU kernel
    (SDDMM, {"S": "csr"}, "float32"),  # a dense result
    (SDDMM, {"S": "csr", "C": "dcsr"}, "float32"),
    ("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "C": "csr"}, "float32"),
])
def test_other_specs_are_turned_down(expression, formats, dtype):
    assert _built(expression, formats, dtype) is None
