"""IR of the Hopper GEMMs (``dialects/native/wgmma.py``): TMA loads into an mbarrier ring, ``wgmma`` on shared
memory descriptors, warp specialization; built straight into a ``gpu.module`` (the CUDA emitters add them for
float16 2:4 SpMM, dense GEMM and 2:4 Linear layers: ``test_ir_gpu.py``)."""

from __future__ import annotations

import pytest
from ir_helpers import functions, op_counts, verified
from mlir import ir
from sparse_mlir.dialects.native.wgmma import (
    HOPPER,
    META_FILL,
    TILING,
    HopperGemm,
    fits_wgmma,
    metadata_words,
    wgmma_gemm,
)

from sparse_mlir.abi.gpu_program import KernelArg

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process


def _module(gemm: HopperGemm, bias: bool = False):
    """A ``gpu.module`` holding the GEMM (and the metadata kernel), and the launches."""
    module = ir.Module.parse("module attributes {gpu.container_module} { gpu.module @kernels {} }")
    kernels = module.body.operations[0].regions[0].blocks[0]
    a, b, c = (KernelArg("buffer", ref) for ref in range(3))
    crd = KernelArg("buffer", 3) if gemm.sparse else None
    with ir.InsertionPoint(kernels), ir.Location.unknown():
        launches = wgmma_gemm(gemm, a, b, c, crd, KernelArg("buffer", 4) if bias else None)
    return verified(module), launches


def _asm(module: ir.Module) -> list[str]:
    found = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "llvm.inline_asm":
            found.append(ir.StringAttr(op.attributes["asm_string"]).value)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def test_dense_gemm_is_warp_specialized_around_an_mbarrier_ring():
    gemm = HopperGemm(256, 512, 256, sparse=False)
    module, launches = _module(gemm)
    (kernel,) = functions(module).values()
    assert str(kernel.attributes["nvvm.maxntid"]) == "array<i32: 384, 1, 1>"  # a producer and two consumers
    ops = op_counts(module)
    assert ops["nvvm.setmaxregister"] == 2 and ops["gpu.dynamic_shared_memory"] == 1
    assert ops["nvgpu.mbarrier.create"] == 2 and ops["nvgpu.mbarrier.init"] == 2 * gemm.stages  # full and empty
    assert ops["nvgpu.tma.async.load"] == 1 + TILING.block_n // 64  # A, then B in 64-column boxes
    assert ops["nvvm.wgmma.mma_async"] == TILING.block_k // 16 and not _asm(module)  # k16 steps per stage
    assert ops["nvvm.wgmma.fence.aligned"] == 1 and ops["nvvm.wgmma.wait.group.sync.aligned"] == 2
    (launch,) = launches
    assert launch.kernel == "gemm_f16_sm90" and launch.chips == (HOPPER,) and launch.block == (384, 1, 1)
    assert launch.grid == (2, 1, 1) and launch.shared_bytes == gemm.shared_bytes <= 227 * 1024
    assert [arg.kind for arg in launch.args] == ["tensormap", "tensormap", "buffer"]


def test_2to4_gemm_uses_inline_wgmma_sp_with_metadata_made_by_a_kernel():
    gemm = HopperGemm(128, 256, 256, sparse=True)
    module, launches = _module(gemm)
    assert set(functions(module)) == {"gemm_2to4_sm90", "nm_metadata"}
    assert len(_asm(module)) == TILING.block_k // 32
    assert all("wgmma.mma_async.sp.sync.aligned.m64n256k32.f32.f16.f16" in text for text in _asm(module))
    assert not op_counts(module)["nvvm.wgmma.mma_async"]
    meta, product = launches
    assert meta.kernel == "nm_metadata" and meta.derives and meta.chips == (HOPPER,)
    assert meta.args[1] == KernelArg("scratch", 0, (metadata_words(128, 256),))
    assert product.kernel == "gemm_2to4_sm90" and product.args[-1] == meta.args[1]
    assert str(META_FILL & 0xFFFF) in str(module)  # padding past the matrix: a valid pattern


@pytest.mark.parametrize("bias_dim", [0, 1])
def test_linear_orientation_reads_b_k_major_and_stores_c_transposed(bias_dim):
    gemm = HopperGemm(48, 64, 16, True, "f32", b_k_major=True, c_transposed=True, bias_dim=bias_dim)
    module, launches = _module(gemm, bias=True)
    kernel = functions(module)["gemm_2to4_sm90_linear"]
    signature = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value)
    bias = "memref<48xf16>" if bias_dim == 0 else "memref<16xf16>"
    assert [str(t) for t in signature.inputs] == ["!llvm.ptr", "!llvm.ptr", "memref<16x48xf32>", bias,
                                                  f"memref<{metadata_words(48, 64)}xi32>"]
    ops = op_counts(module)
    assert ops["nvgpu.tma.async.load"] == 2  # K-major B: one box of the whole tile
    assert ops["arith.extf"] > 0 and not ops["arith.truncf"]  # the f16 bias added to f32 sums, stored as f32
    assert len(launches[-1].args) == 5


def test_tma_needs_16_byte_rows_and_a_whole_k_step():
    assert fits_wgmma(64, 96, 40, sparse=True) and not fits_wgmma(64, 104, 40, sparse=True)
    assert fits_wgmma(64, 104, 40, sparse=False) and not fits_wgmma(64, 96, 36, sparse=False)
    assert not fits_wgmma(64, 16, 40, sparse=False)
