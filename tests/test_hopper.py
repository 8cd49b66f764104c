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
from sparse_mlir.abi.gpu_program import GpuProgram, TensorMapGeometry
from sparse_mlir.runtime.tensor_maps import encode_arguments

import support.fake_cupy as fake_cupy
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
    from sparse_mlir.dialects.native.wgmma import fits_wgmma

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
    from sparse_mlir.tensor.device import DeviceSparseTensor

    left = DeviceSparseTensor.from_dense_nm(fake_cupy.device(a))
    kernel(A=left, B=fake_cupy.device(np.ones((512, 256), np.float16)))
    assert [name for name, *_ in record.launches] == ["nm_metadata", "gemm_2to4_sm90"]
    words = record.launches[1][3]
    assert all(w % 16 == 0 and w for w in words[:2])  # device addresses of the two descriptors
    metadata = record.launches[0][3][-5]  # the metadata words: the scratch the GEMM reads, kept on the tensor
    record.launches.clear()
    kernel(A=left, B=fake_cupy.device(np.ones((512, 256), np.float16)))
    assert [name for name, *_ in record.launches] == ["gemm_2to4_sm90"]  # metadata made once per tensor
    assert metadata in record.launches[0][3]
    record.launches.clear()
    monkeypatch.setattr("sparse_mlir.runtime.launch.cupy", lambda: fake_cupy.build("89")[0])
    other = sm.compile(GEMM, formats={"A": "2:4"}, dtype="float16", target="cuda")
    assert [launch.kernel for launch in other.specialize({"A": (256, 512), "B": (512, 256)}).program.launches
            if launch.on("sm_80")] == ["spmm_2to4"]


def test_the_c_launcher_encodes_tensor_maps_and_skips_other_chips_kernels(tmp_path):
    from sparse_mlir.export.cuda_header import cuda_header

    kernel = sm.compile(GEMM, formats={"A": "2:4"}, dtype="float16", target="cuda")
    function = kernel.specialize({"A": (256, 512), "B": (512, 256)})
    text = cuda_header(function.signature, function.program)
    assert text.count("cuTensorMapEncodeTiled") == 2 and "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES" in text
    assert re.search(r"if \(m->functions\[2\]\)", text)
    (tmp_path / "kernel.h").write_text(text)
    (tmp_path / "main.c").write_text('#include "kernel.h"\nint main(void) { return 0; }\n')
    import os

    fake = os.path.join(os.path.dirname(__file__), "support", "fake_cuda")
    done = subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-I", fake, "-I", str(tmp_path),
                           str(tmp_path / "main.c"), "-o", str(tmp_path / "main")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert ctypes.sizeof(ctypes.c_uint64 * 16) == 128  # the CUtensorMap the runtime encodes into


@pytest.mark.parametrize("bias", [None, "o", "b"])
def test_float16_linear_with_a_2to4_weight_runs_on_sparse_tensor_cores(bias, tmp_path, monkeypatch):
    """``Y[b,o] = X[b,i] * W[o,i] (+ bias)``: transposes around the mma.sp SpMM on sm_80/sm_90; on sm_90a one
    wgmma.sp GEMM reading X as stored (K-major B), storing Y transposed, the bias in its epilogue."""
    tool = _ptxas()
    expr = "Y[b,o] = X[b,i]*W[o,i]" + (f" + bias[{bias}]" if bias else "")
    kernel = sm.compile(expr, formats={"W": "2:4"}, dtype="float16", target="cuda")
    shapes = {"X": (96, 128), "W": (64, 128), **({"bias": (64,) if bias == "o" else (96,)} if bias else {})}
    program = kernel.specialize(shapes).program
    assert [(launch.kernel, launch.chips) for launch in program.launches] == [
        ("transpose_in", ("sm_80", "sm_90")), ("spmm_2to4", ("sm_80", "sm_90")), ("transpose_out", ("sm_80", "sm_90")),
        ("nm_metadata", ("sm_90a",)), ("gemm_2to4_sm90_linear", ("sm_90a",))]
    gemm = program.launches[-1]
    assert TensorMapGeometry(*gemm.args[1].shape) == TensorMapGeometry(128, 96, 64, 256, 128, 2)  # X, K-major
    for chip, ptx in program.ptx.items():
        (tmp_path / "k.ptx").write_text(ptx)
        done = subprocess.run([tool, f"-arch={chip}", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                              capture_output=True, text=True)
        assert done.returncode == 0 and "bytes spill stores" in done.stderr, done.stderr
        assert " 0 bytes spill stores" in done.stderr
        for launch in program.launches:
            if launch.on(chip):
                assert _entry_params(ptx)[launch.kernel] == launch.param_count()
    assert ", 0, p, 1, 1, 0, 0;" in program.ptx["sm_90a"]  # wgmma.sp reads X untransposed: tnspB = 0
    monkeypatch.setenv("SPARSE_MLIR_HOPPER", "1")
    for batch, capability, launched in ((96, "90", ["nm_metadata", "gemm_2to4_sm90_linear"]),
                                        (104, "89", ["transpose_in", "spmm_2to4", "transpose_out"])):
        record = fake_cupy.install(monkeypatch, capability=capability)  # a new batch: a new specialization
        fresh = sm.compile(expr, formats={"W": "2:4"}, dtype="float16", target="cuda")
        from sparse_mlir.tensor.device import DeviceSparseTensor

        weight = np.zeros((64, 128), np.float16)
        weight[:, 1::2] = 1
        operands = {"X": fake_cupy.device(np.ones((batch, 128), np.float16)),
                    "W": DeviceSparseTensor.from_dense_nm(fake_cupy.device(weight))}
        if bias:
            operands["bias"] = fake_cupy.device(np.ones(64 if bias == "o" else batch, np.float16))
        fresh(**operands)
        assert [name for name, *_ in record.launches] == launched


def test_the_tensor_core_device_script_runs_start_to_end_against_the_stand_in(tmp_path):
    """A rehearsal of the Tensor Core device run: small bundle, every step runs (the stand-in computes nothing,
    so every check reports FAIL and the script exits 1; the Hopper first calls fail in a child without a GPU)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bundle = tmp_path / "bundle"
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "tensor_core_bundle.py"),
                           str(bundle), "--small"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    env = {**os.environ, "OUT": str(tmp_path), "SPARSE_MLIR_REHEARSAL": "1"}
    run = subprocess.run([sys.executable, os.path.join(root, "tests", "support", "fake_cupy.py"),
                          str(bundle / "tensor_core_check.py"), str(bundle)], capture_output=True, text=True, env=env)
    assert run.returncode == 1 and "a correctness check failed" in run.stderr, run.stderr[-3000:]
    import json

    results = json.loads((tmp_path / "tc_results.json").read_text())
    assert {c["name"] for c in results["checks"]} == {"nm_256x512x256", "dense_256x512x256", "nm_144x96x136",
                                                      "dense_144x96x136"}


def test_a_tensor_named_like_a_launcher_variable_is_refused_not_miscompiled():
    from sparse_mlir.errors import DSLError
    from sparse_mlir.export.cuda_header import cuda_header

    kernel = sm.compile("y[i] = A[i,j] * w[j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    function = kernel.specialize({"A": (8, 8), "w": (8,)})
    with pytest.raises(DSLError, match="'w' clashes"):
        cuda_header(function.signature, function.program)
