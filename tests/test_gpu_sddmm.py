"""The GPU SDDMM ``C[i,j] = S[i,j] * A[i,k] * B[k,j]``, CSR ``S`` and a CSR result (``dialects/native/gpu_sddmm.py``).

Without a GPU: the program's kernels run thread by thread in the CPU
emulation (``tests/support/gpu_emulation.py``) against scipy, at several
sizes from one shape-generic build; ptxas assembles its PTX for sm_80 and
sm_90a; and ``CudaKernel`` runs it end to end on the CuPy stand-in
(``tests/support/fake_cupy.py``): the result is a ``DeviceSparseTensor``
owning device copies of ``S``'s positions and coordinates.  Other
sparse-result kernels are still refused on the GPU; the export loads and its C launcher copies the pattern.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.errors import DeviceError, OperandError
from sparse_mlir.lowering import cuda_toolkit
from sparse_mlir.tensor.device import DeviceSparseTensor

SDDMM = "C[i,j] = S[i,j] * A[i,k] * B[k,j]"
FORMATS = {"S": "csr", "C": "csr"}


def _operands(rng, rows: int, cols: int, inner: int, dtype: str, density: float = 0.2, empty_rows: int = 0):
    s = sp.random(rows, cols, density=density, format="lil", dtype=np.float64, random_state=rng)
    for row in rng.choice(rows, empty_rows, replace=False) if empty_rows else ():
        s[row, :] = 0
    s = sp.csr_matrix(s)
    s.data = rng.uniform(-1, 1, s.nnz).astype(dtype).astype(np.float64)  # values the dtype holds exactly
    a, b = rng.uniform(-1, 1, (rows, inner)), rng.uniform(-1, 1, (inner, cols))
    return s, a.astype(dtype), b.astype(dtype)


def _tensor(s: sp.csr_matrix, dtype: str, widths: int = 32) -> sm.SparseTensor:
    """``s`` as a CSR ``SparseTensor`` of ``dtype`` (scipy holds no float16)."""
    index = np.dtype(f"int{widths}")
    return sm.SparseTensor(sm.CSR.with_widths(widths, widths), s.shape,
                           (s.indptr.astype(index), s.indices.astype(index), s.data.astype(dtype)))


def _reference(s: sp.csr_matrix, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C's values in S's order, computed in float64."""
    rows = np.repeat(np.arange(s.shape[0]), np.diff(s.indptr))
    return s.data * np.einsum("ek,ek->e", a.astype(np.float64)[rows], b.astype(np.float64)[:, s.indices].T)


TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-2}


# -- the kernels, run thread by thread on the CPU ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_emulated_sddmm_matches_scipy_at_every_size_from_one_build(dtype, rng, tmp_path):
    from support.gpu_emulation import SparseResultEmulation

    spec = sm.compile(SDDMM, formats=FORMATS, dtype=dtype, target="cuda").spec
    emulation = SparseResultEmulation(spec, "S", tmp_path)
    # K: below, at and past the unrolled chains, not a multiple of them, and multiples of the 16-byte vectors (the
    # vector variant: 2, 4 or 8 elements); some rows empty, one matrix all empty
    sizes = ((7, 5, 1, 2), (33, 40, 5, 10), (64, 17, 33, 0), (20, 90, 64, 19), (3, 4, 6, 3), (40, 30, 24, 4),
             (9, 70, 40, 1))
    ran = set()
    for rows, cols, inner, empty in sizes:
        s, a, b = _operands(rng, rows, cols, inner, dtype, empty_rows=empty)
        values, program = emulation({"S": _tensor(s, dtype), "A": a, "B": b})
        ran.add(inner % (16 // np.dtype(dtype).itemsize) == 0)
        assert values.dtype == np.dtype(dtype) and values.shape == (s.nnz,)
        np.testing.assert_allclose(values.astype(np.float64), _reference(s, a, b), rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype])
    assert emulation.builds == 1  # every size ran the one shape-generic build
    assert ran == {True, False}  # both variants ran: 16-byte vectors and single elements
    width = 16 // np.dtype(dtype).itemsize
    assert [launch.kernel for launch in program.launches] == ["transpose_b", f"sddmm_w{width}", "sddmm_w1"]
    assert program.result_like == (0, 1, 2) and program.result_written() == {2}  # C: S's pattern, new values


def test_emulated_sddmm_with_64_bit_indices_and_factors_in_another_order(rng, tmp_path):
    from support.gpu_emulation import SparseResultEmulation

    spec = sm.compile("C[i,j] = A[i,k] * B[k,j] * S[i,j]", formats=FORMATS, dtype="float64", target="cuda").spec
    emulation = SparseResultEmulation(spec, "S", tmp_path)
    s, a, b = _operands(rng, 25, 30, 7, "float64", empty_rows=5)
    wide = _tensor(s, "float64", 64)
    values, _ = emulation({"S": wide, "A": a, "B": b})
    np.testing.assert_allclose(values, _reference(s, a, b), rtol=1e-12)


def test_emulated_float16_sddmm_keeps_its_float32_sums_with_out_dtype(rng, tmp_path):
    from support.gpu_emulation import SparseResultEmulation

    spec = sm.compile(SDDMM, formats=FORMATS, dtype="float16", out_dtype="float32", target="cuda").spec
    s, a, b = _operands(rng, 30, 26, 40, "float16", empty_rows=2)
    values, _ = SparseResultEmulation(spec, "S", tmp_path)({"S": _tensor(s, "float16"), "A": a, "B": b})
    assert values.dtype == np.float32
    np.testing.assert_allclose(values, _reference(s, a, b), rtol=1e-5, atol=1e-5)  # float16 inputs, float32 sums


# -- PTX -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_ptx_assembles_for_sm_80_and_sm_90a_without_spills(dtype, tmp_path):
    tool = cuda_toolkit.ptxas()
    if tool is None:
        pytest.skip("ptxas not found")
    kernel = sm.compile(SDDMM, formats=FORMATS, dtype=dtype, target="cuda").specialize({})
    assert kernel.shape_generic and kernel.program.notes == ("native",)
    for chip, arch in (("sm_80", "sm_80"), ("sm_90", "sm_90a")):
        path = tmp_path / f"{dtype}.{chip}.ptx"
        path.write_text(kernel.program.ptx[chip])
        done = subprocess.run([tool, f"-arch={arch}", "-v", str(path), "-o", str(tmp_path / "out.cubin")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "0 bytes spill stores" in done.stderr and "bytes spill stores" in done.stderr
        assert not [line for line in done.stderr.splitlines() if "spill stores" in line and not line.strip()
                    .startswith("0 bytes stack frame, 0 bytes spill stores")]


# -- the runtime, on the CuPy stand-in -----------------------------------------------------------------------------
def test_cuda_kernel_returns_a_device_csr_result_that_owns_copies_of_the_pattern(monkeypatch, rng):
    import support.fake_cupy as fake_cupy

    record = fake_cupy.install(monkeypatch)
    kernel = sm.compile(SDDMM, formats=FORMATS, dtype="float32", target="cuda")
    assert kernel.shape_generic
    s, a, b = _operands(rng, 50, 70, 24, "float32", empty_rows=4)
    S = _tensor(s, "float32").to("cuda")
    A, B = fake_cupy.device(a), fake_cupy.device(b)
    C = kernel(S=S, A=A, B=B)
    assert isinstance(C, DeviceSparseTensor) and C.shape == (50, 70) and C.dtype == np.float32
    assert C.format == S.format and C.longest_row == S.longest_row
    pos, crd, val = S.buffers
    c_pos, c_crd, c_val = C.buffers
    for mine, theirs in ((c_pos, pos), (c_crd, crd)):  # equal, but the result's own device arrays
        np.testing.assert_array_equal(mine, theirs)
        assert mine.data.ptr != theirs.data.ptr and mine.dtype == theirs.dtype
    assert c_val.shape == (s.nnz,) and c_val.data.ptr != val.data.ptr
    (transpose, words_t), (sddmm, words) = [(launch[:3], launch[3]) for launch in record.launches]
    assert transpose == ("transpose_b", (-(-24 * 70 // 128), 1, 1), (128, 1, 1))
    assert sddmm == ("sddmm_w4", (-(-s.nnz // 128), 1, 1), (128, 1, 1))  # K = 24: 16-byte vectors
    scratch = words_t[7]  # B^T: [70, 24], the transpose's destination and the SDDMM's fifth argument
    assert words_t[:7] == [B.data.ptr, B.data.ptr, 0, 24, 70, 70, 1] and words_t[7:] == [scratch, scratch, 0, 70, 24,
                                                                                          24, 1]
    assert words[:15] == [pos.data.ptr, pos.data.ptr, 0, 51, 1, crd.data.ptr, crd.data.ptr, 0, s.nnz, 1,
                          val.data.ptr, val.data.ptr, 0, s.nnz, 1]
    assert words[15:22] == [A.data.ptr, A.data.ptr, 0, 50, 24, 24, 1]
    assert words[22:29] == [scratch, scratch, 0, 70, 24, 24, 1]
    assert words[29:] == [c_val.data.ptr, c_val.data.ptr, 0, s.nnz, 1]  # the kernel writes C's values
    with pytest.raises(OperandError, match="out= is only for dense results"):
        kernel(S=S, A=A, B=B, out=fake_cupy.device(np.zeros((50, 70), np.float32)))
    assert len(record.launches) == 2  # refused before anything ran


def test_64_bit_indices_give_a_64_bit_result(monkeypatch, rng):
    import support.fake_cupy as fake_cupy

    fake_cupy.install(monkeypatch)
    s, a, b = _operands(rng, 12, 9, 5, "float64")
    kernel = sm.compile(SDDMM, formats=FORMATS, dtype="float64", target="cuda")
    C = kernel(S=_tensor(s, "float64", 64).to("cuda"), A=fake_cupy.device(a), B=fake_cupy.device(b))
    assert (C.format.pos_width, C.format.crd_width) == (64, 64)
    assert [buffer.dtype for buffer in C.buffers] == [np.int64, np.int64, np.float64]
    narrow = kernel(S=_tensor(s, "float64").to("cuda"), A=fake_cupy.device(a), B=fake_cupy.device(b))
    assert [buffer.dtype for buffer in narrow.buffers] == [np.int32, np.int32, np.float64]  # a build per widths


# -- what stays refused ---------------------------------------------------------------------------------------------
def test_other_sparse_results_stay_refused_on_the_gpu():
    from sparse_mlir.runtime.cuda import CudaKernel

    refused = "has a sparse result, which target 'cuda' does not produce yet"
    for expression, formats, dtype in (
            ("C[i,j] = A[i,j]*B[i,j]", {"A": "csr", "C": "csr"}, "float32"),
            ("C[i,j] = A[i,j] + B[i,j]", {"A": "csr", "B": "csr", "C": "csr"}, "float32"),
            (SDDMM, FORMATS, "int32"),  # integer SDDMM: no GPU kernel
            (SDDMM, {"S": "csr", "C": "dcsr"}, "float32")):
        with pytest.raises(DeviceError, match=refused):
            sm.compile(expression, formats=formats, dtype=dtype, target="cuda")
    spec = sm.compile(SDDMM, formats=FORMATS, dtype="float32", target="cuda").spec
    with pytest.raises(DeviceError, match=refused):  # the sparsifier makes no sparse result on the GPU
        CudaKernel(spec, emitter="sparsifier")


# -- export: the manifest loads without MLIR, the C launcher copies the pattern and launches ---------------------------
def test_the_export_loads_and_runs_like_the_compiled_kernel(monkeypatch, rng, tmp_path):
    import support.fake_cupy as fake_cupy

    kernel = sm.compile(SDDMM, formats=FORMATS, dtype="float32", target="cuda")
    sm.export(kernel, tmp_path, "k")
    record = fake_cupy.install(monkeypatch)
    loaded = sm.load_kernel(tmp_path / "k.json")
    s, a, b = _operands(rng, 30, 20, 8, "float32", empty_rows=3)
    S = _tensor(s, "float32").to("cuda")
    C = loaded(S=S, A=fake_cupy.device(a), B=fake_cupy.device(b))
    assert isinstance(C, DeviceSparseTensor) and C.shape == (30, 20) and C.format == S.format
    np.testing.assert_array_equal(C.buffers[0], S.buffers[0])
    assert C.buffers[0].data.ptr != S.buffers[0].data.ptr
    assert [launch[0] for launch in record.launches] == ["transpose_b", "sddmm_w4"]
    with pytest.raises(OperandError, match="out= is only for dense results"):
        loaded(S=S, A=fake_cupy.device(a), B=fake_cupy.device(b), out=fake_cupy.device(np.zeros((30, 20), np.float32)))


def _launcher_call(tmp_path, program, rows: int, cols: int, inner: int, nnz: int, result_values: int, main: str):
    """Compile and run a program calling the exported launcher ``k`` against the recording stand-in for cuda.h
    (fake pointers; ``result_values``: the length given for C's values); return status, output, pointers."""
    pointers = {"S_pos": 0x100000, "S_crd": 0x101000, "S_values": 0x102000, "A": 0x200000, "B": 0x300000,
                "C_pos": 0x400000, "C_crd": 0x401000, "C_values": 0x402000}
    lengths = {"pos": rows + 1, "crd": nnz, "values": nnz}
    args = []
    for buf in ("pos", "crd", "values"):
        args += [pointers[f"S_{buf}"], lengths[buf]]
    args += [rows, cols, pointers["A"], rows, inner, pointers["B"], inner, cols]
    for buf in ("pos", "crd", "values"):
        args += [pointers[f"C_{buf}"], result_values if buf == "values" else lengths[buf]]
    transpose, variant = program.launches[:2]  # the two SDDMM variants take the same parameters
    counts = f"fake_param_count[0] = {transpose.param_count()}; fake_param_count[1] = {variant.param_count()}; "
    (tmp_path / f"{main}.c").write_text(
        f'#include "k.h"\nint main(void) {{ k_module m; k_load(&m, "k.ptx"); {counts}'
        f'return (int)k(&m, 0, {", ".join(str(v) for v in args)}); }}\n')
    support = Path(__file__).resolve().parent / "support" / "fake_cuda"
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", f"-I{support}", f"-I{tmp_path}", "-o", str(tmp_path / main),
                    str(tmp_path / f"{main}.c")], check=True)
    run = subprocess.run([str(tmp_path / main)], capture_output=True, text=True)
    return run.returncode, run.stdout, pointers


def test_the_c_launcher_copies_the_pattern_and_packs_what_the_python_runtime_packs(tmp_path):
    from sparse_mlir.abi.gpu_program import GpuProgram, ParamPacker

    kernel = sm.compile(SDDMM, formats=FORMATS, dtype="float32", target="cuda")
    sm.export(kernel, tmp_path, "k")
    program = GpuProgram.from_json(json.loads((tmp_path / "k.json").read_text())["program"], ptx={})
    assert program.result_like == (0, 1, 2)
    rows, cols, inner, nnz = 30, 20, 7, 41  # K = 7: the single-element variant
    status, out, p = _launcher_call(tmp_path, program, rows, cols, inner, nnz, nnz, "main")
    assert status == 0, out
    lines = out.splitlines()
    assert f"device copy {p['C_pos']} {p['S_pos']} {(rows + 1) * 4}" in lines  # S's pattern, copied on the stream
    assert f"device copy {p['C_crd']} {p['S_crd']} {nnz * 4}" in lines
    assert not any(line.startswith("device copy") and line.split()[2] == str(p["C_values"]) for line in lines)
    buffers = [(p["S_pos"], rows + 1), (p["S_crd"], nnz), (p["S_values"], nnz), (p["A"], rows * inner),
               (p["B"], inner * cols)]
    shapes = [(rows + 1,), (nnz,), (nnz,), (rows, inner), (inner, cols)]
    scratch = [0xA000]  # the stand-in's first allocation: B^T
    results = [(p["C_pos"], rows + 1), (p["C_crd"], nnz), (p["C_values"], nnz)]
    launched = [line.split()[1:] for line in lines if line.startswith("launch")]
    running = [launch for launch in program.launches if launch.fits(shapes)]
    assert [line[0] for line in launched] == [launch.kernel for launch in running] == ["transpose_b", "sddmm_w1"]
    for launch, line in zip(running, launched):
        assert [int(v) for v in line[1:4]] == list(launch.grid_for([n for _, n in buffers], shapes))
        assert [int(v) for v in line[8:]] == ParamPacker(launch)(
            buffers, scratch, shapes=shapes, scratch_shapes=program.scratch_shapes(shapes), results=results)
    status, out, _ = _launcher_call(tmp_path, program, rows, cols, inner, nnz, nnz + 1, "bad")  # C's values too long
    assert status == 1 and "launch" not in out and "copy" not in out  # CUDA_ERROR_INVALID_VALUE, nothing enqueued
