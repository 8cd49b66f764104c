"""IR of the hand-scheduled CUDA kernels (``dialects/native/gpu.py``): one ``gpu.module`` of ``gpu.func``s and its
launches per kernel family; each family's emitter turns down every other kernel."""

from __future__ import annotations

import pytest
from ir_helpers import functions, op_counts, planned, static_shapes, verified
from sparse_mlir.dialects.native import gpu, gpu_spmv
from sparse_mlir.dialects.native.wgmma import HOPPER

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 64, "k": 64, "j": 32, "b": 16, "o": 48}

# (emitter, expression, formats, dtype): one kernel each family builds
FAMILIES = {
    "spmv": (gpu_spmv.gpu_spmv, "y[i] = A[i,j] * x[j]", {"A": "csr"}, "float32"),
    "spmm": (gpu.gpu_spmm, "C[i,j] = A[i,k] * B[k,j] + bias[j]", {"A": "csr"}, "float32"),
    "spmm_2to4": (gpu.gpu_spmm_2to4, "C[i,j] = A[i,k] * B[k,j]", {"A": "2:4"}, "float16"),
    "gemm_f16": (gpu.gpu_gemm_f16, "C[i,j] = A[i,k] * B[k,j]", {}, "float16"),
    "linear": (gpu.gpu_linear, "Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "csr"}, "float32"),
    "linear_2to4": (gpu.gpu_linear_2to4, "Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "2:4"}, "float16"),
}


def _build(family: str, expression: str | None = None, formats: dict | None = None, dtype: str | None = None,
           extents: dict | None = None, **options) -> gpu.NativeKernels | None:
    emit, default_expression, default_formats, default_dtype = FAMILIES[family]
    spec = planned(expression or default_expression, default_formats if formats is None else formats,
                   dtype or default_dtype)
    return emit(spec, spec.formats, static_shapes(spec, {**EXTENTS, **(extents or {})}), **options)


def _kernels(found: gpu.NativeKernels) -> list[str]:
    """The kernels of the ``gpu.module``, after checking that it verifies and that every launch names one."""
    verified(found.module)
    assert "gpu.container_module" in found.module.operation.attributes
    names = list(functions(found.module))
    assert {launch.kernel for launch in found.launches} <= set(names)
    return names


@pytest.mark.parametrize("deterministic", [False, True])
def test_csr_spmv_reduces_rows_with_warp_shuffles(deterministic):
    found = _build("spmv", deterministic=deterministic)
    ops = op_counts(found.module)
    assert ops["gpu.shuffle"] == 5  # a butterfly over up to a warp
    if deterministic:  # no atomic additions: run-to-run identical sums
        assert _kernels(found) == ["spmv"] and not ops["memref.atomic_rmw"]
        assert [launch.when for launch in found.launches] == [""]
    else:  # a second kernel for skewed rows, picked at launch
        assert _kernels(found) == ["spmv", "spmv_split"] and ops["memref.atomic_rmw"] == 2
        assert [launch.when for launch in found.launches] == ["balanced", "skewed"]
    assert found.launches[0].lanes is not None


def test_float16_spmv_sums_in_float32():
    found = _build("spmv", dtype="float16")
    ops = op_counts(found.module)
    assert ops["arith.extf"] == 4 and ops["math.fma"] == 2  # both factors widened, in both kernels
    assert ops["arith.truncf"] == 3  # the sums rounded when stored: y, and twice in the split kernel


def test_csr_spmm_stores_16_byte_vectors_from_a_warp_per_row():
    found = _build("spmm")
    assert _kernels(found) == ["spmm"]
    ops = op_counts(found.module)
    assert ops["vector.load"] > 0 and ops["vector.store"] > 0 and ops["math.fma"] > 0
    assert "vector<4xf32>" in str(found.module) and "alignment = 16" in str(found.module)
    (launch,) = found.launches
    assert launch.aligned and launch.fills_output


def test_sparse_tensor_core_spmm_has_a_portable_and_a_hopper_kernel():
    found = _build("spmm_2to4")
    assert _kernels(found) == ["spmm_2to4", "gemm_2to4_sm90", "nm_metadata"]
    ops = op_counts(found.module)
    assert ops["nvgpu.mma.sp.sync"] > 0 and ops["llvm.inline_asm"] == 2  # mma.sp, and wgmma.mma_async.sp
    assert [(launch.kernel, launch.chips) for launch in found.launches] == [
        ("spmm_2to4", ("sm_80", "sm_90")), ("nm_metadata", (HOPPER,)), ("gemm_2to4_sm90", (HOPPER,))]
    assert found.scratch == (((2 * 128,), "int32"),)  # wgmma metadata: a word per thread and k32 step of K = 64


def test_dense_tensor_core_gemm_is_the_2to4_kernels_reference():
    found = _build("gemm_f16")
    assert _kernels(found) == ["gemm_f16", "gemm_f16_sm90"]
    ops = op_counts(found.module)
    assert ops["nvgpu.mma.sync"] > 0 and ops["nvvm.wgmma.mma_async"] == 4 and not ops["nvgpu.mma.sp.sync"]
    assert not found.scratch


def test_linear_transposes_around_the_warp_per_row_spmm():
    found = _build("linear")
    assert sorted(_kernels(found)) == ["spmm", "transpose_in", "transpose_out"]
    assert [launch.kernel for launch in found.launches] == ["transpose_in", "spmm", "transpose_out"]
    assert found.scratch == (((64, 16), "float32"), ((48, 16), "float32"))  # X^T and T


def test_float16_linear_with_2to4_weights_runs_on_tensor_cores():
    found = _build("linear_2to4")
    assert sorted(_kernels(found)) == ["gemm_2to4_sm90_linear", "nm_metadata", "spmm_2to4", "transpose_in",
                                       "transpose_out"]
    portable = [launch.kernel for launch in found.launches if HOPPER not in launch.chips]
    assert portable == ["transpose_in", "spmm_2to4", "transpose_out"]
    assert found.scratch[0] == ((2 * 128,), "int32")  # Hopper's metadata first, then X^T and T
    assert found.scratch[1:] == (((64, 16), "float16"), ((48, 16), "float32"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_turns_down_the_others(family):
    emit = FAMILIES[family][0]
    for other, (_, expression, formats, dtype) in FAMILIES.items():
        spec = planned(expression, formats, dtype)
        built = emit(spec, spec.formats, static_shapes(spec, EXTENTS))
        assert (built is not None) == (other == family), (family, other)


@pytest.mark.parametrize("family, change", [
    ("spmv", {"dtype": "int32"}),
    ("spmv", {"formats": {"A": "csc"}}),
    ("spmm", {"formats": {"A": "2:4"}}),
    ("spmm", {"dtype": "float64", "formats": {"A": "bsr2x2"}}),
    ("spmm_2to4", {"extents": {"i": 40}}),  # whole 16-row MMA tiles only
    ("spmm_2to4", {"dtype": "float32"}),
    ("spmm_2to4", {"expression": "C[i,j] = A[i,k] * B[k,j] + bias[j]"}),
    ("gemm_f16", {"extents": {"k": 48}}),
    ("gemm_f16", {"dtype": "float32"}),
    ("linear", {"formats": {"W": "2:4"}}),
    ("linear_2to4", {"extents": {"b": 12}}),
])
def test_kernels_outside_a_family_are_turned_down(family, change):
    assert _build(family, **change) is None
