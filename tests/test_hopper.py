"""The Hopper (sm_90a) TMA + wgmma GEMMs: PTX that ptxas accepts without spills, launches, descriptors, launchers.

What needs a GPU (the numbers) is ``benchmarks/gpu/tensor_core_check.py``.
"""

from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest

import sparse_mlir as sm
from sparse_mlir.errors import DeviceError
from sparse_mlir.gpu_program import GpuProgram, TensorMapGeometry
from sparse_mlir.runtime.tensor_maps import encode_arguments

import fake_cupy
from test_gpu import _entry_params, _ptxas

GEMM = "C[i,j] = A[i,k]*B[k,j]"


def _program(sparse: bool, shape=(256, 512, 256)):
    m, k, n = shape
    kernel = sm.compile(GEMM, formats={"A": "2:4"} if sparse else {}, dtype="float16", target="cuda")
    return kernel.specialize({"A": (m, k), "B": (k, n)}).program


@pytest.mark.parametrize("sparse", [True, False])
def test_hopper_gemm_assembles_without_spills(sparse, tmp_path):
    tool = _ptxas()
    program = _program(sparse)
    ptx = program.ptx["sm_90a"]
    name = "gemm_2to4_sm90" if sparse else "gemm_f16_sm90"
    instruction = "wgmma.mma_async.sp.sync.aligned.m64n256k32" if sparse else "wgmma.mma_async.sync.aligned.m64n256k16"
    per_step = 2 if sparse else 4  # MMAs per K step of 64 (the loop may be peeled: whole steps)
    assert ptx.count(instruction) and ptx.count(instruction) % per_step == 0
    assert "cp.async.bulk.tensor.2d" in ptx and "setmaxnreg.inc" in ptx and ".maxntid 384, 1, 1" in ptx
    assert name not in _entry_params(program.ptx["sm_90"])  # the portable code keeps only the portable kernel
    (tmp_path / "k.ptx").write_text(ptx)
    done = subprocess.run([tool, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert " 0 bytes spill stores" in done.stderr and "0 bytes spill loads" in done.stderr
    launch = next(launch for launch in program.launches if launch.kernel == name)
    assert _entry_params(ptx)[name] == launch.param_count()


def test_hopper_launches_and_their_manifest_round_trip():
    program = _program(True, (1040, 1056, 1000))
    meta, gemm = [launch for launch in program.launches if launch.chips == ("sm_90a",)]
    assert meta.kernel == "nm_metadata" and gemm.kernel == "gemm_2to4_sm90"
    assert gemm.grid == (9, 4, 1) and gemm.block == (384, 1, 1)  # 128 x 256 tiles, masked edges
    assert 48 * 1024 < gemm.shared_bytes <= 227 * 1024
    a_map, b_map = (TensorMapGeometry(*arg.shape) for arg in gemm.args[:2])
    assert a_map == TensorMapGeometry(528, 1040, 32, 128, 64, 2)  # 2:4 values: K/2 per row, 64-byte swizzle
    assert b_map == TensorMapGeometry(1000, 1056, 64, 64, 128, 2)
    assert GpuProgram.from_json(program.to_json()) == program


def test_tma_needs_16_byte_rows():
    from sparse_mlir.dialects.native_wgmma import fits_wgmma

    assert fits_wgmma(64, 96, 40, sparse=True)  # 2:4 rows of 48 values: 96 bytes
    assert not fits_wgmma(64, 104, 40, sparse=True)  # 52 values: 104 bytes
    assert fits_wgmma(64, 104, 40, sparse=False) and not fits_wgmma(64, 96, 36, sparse=False)


def test_tensor_map_arguments_are_checked_before_the_driver_sees_them():
    geometry = TensorMapGeometry(512, 256, 64, 64, 128, 2)
    dtype, rank, base, dims, strides, box, steps, interleave, swizzle, promotion, fill = \
        encode_arguments(0x1000, geometry, "float16")
    assert (dtype, rank, base.value, list(dims), list(strides), list(box), swizzle) == \
        (6, 2, 0x1000, [512, 256], [1024], [64, 64], 3)
    assert encode_arguments(0x1000, geometry, "uint16")[0] == 9  # bfloat16 bits
    with pytest.raises(DeviceError, match="16-byte aligned"):
        encode_arguments(0x1008, geometry, "float16")
    with pytest.raises(DeviceError, match="16-byte aligned"):
        encode_arguments(0x1000, geometry._replace(inner=500), "float16")
    with pytest.raises(DeviceError, match="does not fit its swizzle"):
        encode_arguments(0x1000, geometry._replace(box_inner=128), "float16")
    with pytest.raises(DeviceError, match="float16 or bfloat16"):
        encode_arguments(0x1000, geometry, "float64")


def test_hopper_kernels_launch_with_tensor_maps_on_compute_capability_9_0_only(monkeypatch):
    monkeypatch.setenv("SPARSE_MLIR_HOPPER", "1")
    record = fake_cupy.install(monkeypatch, capability="90")
    kernel = sm.compile(GEMM, formats={"A": "2:4"}, dtype="float16", target="cuda")
    a = np.zeros((256, 512), np.float16)
    a[:, ::2] = 1
    from sparse_mlir.device_tensor import DeviceSparseTensor

    left = DeviceSparseTensor.from_dense_nm(fake_cupy.device(a))
    kernel(A=left, B=fake_cupy.device(np.ones((512, 256), np.float16)))
    assert [name for name, *_ in record.launches] == ["nm_metadata", "gemm_2to4_sm90"]
    words = record.launches[1][3]
    assert all(w % 16 == 0 and w for w in words[:2])  # device addresses of the two descriptors
    record.launches.clear()
    monkeypatch.setattr("sparse_mlir.runtime.cuda.cupy", lambda: fake_cupy.build("89")[0])
    other = sm.compile(GEMM, formats={"A": "2:4"}, dtype="float16", target="cuda")
    assert [launch.kernel for launch in other.specialize({"A": (256, 512), "B": (512, 256)}).program.launches
            if launch.on("sm_80")] == ["spmm_2to4"]


def test_the_c_launcher_encodes_tensor_maps_and_skips_other_chips_kernels(tmp_path):
    from sparse_mlir.gpu_header import cuda_header

    kernel = sm.compile(GEMM, formats={"A": "2:4"}, dtype="float16", target="cuda")
    function = kernel.specialize({"A": (256, 512), "B": (512, 256)})
    text = cuda_header(function.signature, function.program)
    assert text.count("cuTensorMapEncodeTiled") == 2 and "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES" in text
    assert re.search(r"if \(m->functions\[2\]\)", text)
    (tmp_path / "kernel.h").write_text(text)
    (tmp_path / "main.c").write_text('#include "kernel.h"\nint main(void) { return 0; }\n')
    import os

    fake = os.path.join(os.path.dirname(__file__), "fake_cuda")
    done = subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-I", fake, "-I", str(tmp_path),
                           str(tmp_path / "main.c"), "-o", str(tmp_path / "main")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert ctypes.sizeof(ctypes.c_uint64 * 16) == 128  # the CUtensorMap the runtime encodes into
