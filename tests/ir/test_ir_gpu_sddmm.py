"""IR of the GPU SDDMM (``dialects/native/gpu_sddmm.py``): it verifies, transposes B into scratch, gives each stored
entry one thread (a binary search for its row, no shuffles or barriers), writes only C's values, reads every size
from the descriptors in a shape-generic build, holds a 16-byte-vector variant and a single-element one that K picks
at launch; other specs are turned down."""

from __future__ import annotations

import pytest
from ir_helpers import functions, op_counts, planned, static_shapes, verified
from sparse_mlir.dialects.native.gpu_sddmm import UNROLL, VECTOR_CHAINS, gpu_sddmm

from sparse_mlir.abi.gpu_program import GridRule, KernelArg, SizeOf, SizeTest
from sparse_mlir.compiler.driver import generic_shapes

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

SDDMM = "C[i,j] = S[i,j] * A[i,k] * B[k,j]"
FORMATS = {"S": "csr", "C": "csr"}
EXTENTS = {"i": 64, "j": 48, "k": 40}


def _built(expression: str = SDDMM, formats: dict | None = None, dtype: str = "float32", generic: bool = True,
           extents: dict | None = None):
    spec = planned(expression, formats or FORMATS, dtype)
    shapes = generic_shapes(spec) if generic else static_shapes(spec, extents or EXTENTS)
    return gpu_sddmm(spec, spec.formats, shapes)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_a_thread_per_entry_over_a_transposed_b(dtype):
    found = _built(dtype=dtype)
    verified(found.module)
    width = 16 // {"float32": 4, "float64": 8, "float16": 2}[dtype]
    assert set(functions(found.module)) == {"transpose_b", f"sddmm_w{width}", "sddmm_w1"}
    ops = op_counts(found.module)
    assert not ops["gpu.shuffle"] and not ops["gpu.barrier"] and not ops["memref.atomic_rmw"]  # emulated exactly
    assert ops["scf.while"] == 2  # the row of each entry: one binary search over S's positions, per variant
    assert ops["math.fma"] == (UNROLL + 1) + (VECTOR_CHAINS + 1)  # the unrolled chains and the tail, per variant
    assert ops["vector.load"] == 2 * (VECTOR_CHAINS + 1) and ops["vector.reduction"] == 1
    transpose, *variants = found.launches
    assert transpose.kernel == "transpose_b" and transpose.grid == GridRule(ref=4, per_block=128)  # B's elements
    assert transpose.args == (KernelArg("buffer", 4, (None, None)), KernelArg("scratch", 0, (None, None)))
    # K (A's columns) picks the variant at launch: 16-byte loads when every row starts on a 16-byte boundary
    assert [(v.kernel, v.only_if, v.aligned) for v in variants] == [
        (f"sddmm_w{width}", (SizeTest(3, 1, "multiple", width),), (3,)),
        ("sddmm_w1", (SizeTest(3, 1, "not_multiple", width),), ())]
    for sddmm in variants:
        assert sddmm.grid == GridRule(ref=2, per_block=128) and sddmm.fills_output
        assert sddmm.args[-1] == KernelArg("result", 2, (None,))  # C's values; its pattern is S's (copied)
        assert sddmm.args[4] == KernelArg("scratch", 0, (None, None))
    assert found.scratch == (((SizeOf(4, 1), SizeOf(4, 0)), dtype),)  # B^T sized from B at the call


@pytest.mark.parametrize(("k", "kernel"), [(40, "sddmm_w4"), (42, "sddmm_w1")])
def test_a_static_build_has_its_sizes_and_the_one_variant_they_pick(k, kernel):
    found = _built(generic=False, extents={**EXTENTS, "k": k})
    verified(found.module)
    assert found.scratch == (((48, k), "float32"),)
    assert [(launch.kernel, launch.only_if) for launch in found.launches] == [("transpose_b", ()), ("sddmm", ())]
    assert functions(found.module).keys() == {"transpose_b", "sddmm"}
    assert (op_counts(found.module)["vector.load"] > 0) == (kernel == "sddmm_w4")
    assert f"memref<64x{k}xf32>" in str(found.module) and f"memref<48x{k}xf32>" in str(found.module)


def test_the_factors_in_any_order_and_their_argument_positions():
    found = _built("C[i,j] = A[i,k] * S[i,j] * B[k,j]")
    for sddmm in found.launches[1:]:
        assert [arg.ref for arg in sddmm.args[:4]] == [1, 2, 3, 0]  # A first, then S's three buffers
        assert sddmm.only_if[0].ref == 0  # K is A's columns


@pytest.mark.parametrize(("expression", "formats", "dtype"), [
    (SDDMM, FORMATS, "int32"),  # integers: no GPU kernel
    (SDDMM, {"S": "csr"}, "float32"),  # a dense result
    (SDDMM, {"S": "csr", "C": "dcsr"}, "float32"),
    ("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "C": "csr"}, "float32"),
])
def test_other_specs_are_turned_down(expression, formats, dtype):
    assert _built(expression, formats, dtype) is None
