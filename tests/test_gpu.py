"""The CUDA target: PTX for every kernel and format (checked by ptxas), manifests, launch rules, packing.

Tests marked ``gpu`` run kernels on a device against cupy/cupyx and skip
without CuPy and a GPU; everything else runs here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import prune_nm

import sparse_mlir as sm
from sparse_mlir.lowering import cuda_toolkit
from sparse_mlir.errors import DeviceError, FormatError, OptionError
from sparse_mlir.abi.gpu_program import GridRule, KernelArg, LaneRule, Launch, ParamPacker
from sparse_mlir.runtime.launch import pick_chip

# (expression, format of A, shapes of every input): the core kernels of the CPU tests
CASES = [
    ("y[i] = A[i,j]*x[j]", "csr", {"A": (300, 200), "x": (200,)}),
    ("y[i] = A[i,j]*x[j]", "csc", {"A": (300, 200), "x": (200,)}),
    ("y[i] = A[i,j]*x[j]", "coo", {"A": (300, 200), "x": (200,)}),
    ("y[i] = A[i,j]*x[j]", "dcsr", {"A": (300, 200), "x": (200,)}),
    ("y[i] = A[i,j]*x[j]", "bsr2x2", {"A": (300, 200), "x": (200,)}),
    ("C[i,j] = A[i,k]*B[k,j]", "csr", {"A": (300, 200), "B": (200, 70)}),
    ("C[i,j] = A[i,k]*B[k,j]", "csc", {"A": (300, 200), "B": (200, 70)}),
    ("C[i,j] = A[i,k]*B[k,j]", "bsr4x4", {"A": (300, 200), "B": (200, 70)}),
    ("C[i,j] = A[i,k]*B[k,j]", "2:4", {"A": (300, 200), "B": (200, 70)}),
    ("C[i,j] = A[i,k]*B[k,j] + b[j]", "csr", {"A": (300, 200), "B": (200, 70), "b": (70,)}),
    ("C[i,j] = relu(A[i,k]*B[k,j] + b[i])", "csr", {"A": (300, 200), "B": (200, 70), "b": (300,)}),
    ("Y[b,o] = X[b,i]*A[o,i]", "csr", {"A": (300, 200), "X": (40, 200)}),
    ("Y[b,o] = gelu(X[b,i]*A[o,i] + b[o])", "csr", {"A": (300, 200), "X": (40, 200), "b": (300,)}),
    ("C[i,j] = A[i,j]*(B[i,k]*D[k,j])", "csr", {"A": (60, 50), "B": (60, 30), "D": (30, 50)}),
    ("y[i] = exp(A[i,j]*x[j])", "csr", {"A": (300, 200), "x": (200,)}),
    ("C[i,j] = A[i,j] + D[i,j]", "csr", {"A": (300, 200), "D": (300, 200)}),
    ("A_[i,j] = A[i,j,k]*B[k,j]", "csf", {"A": (20, 30, 40), "B": (40, 30)}),
]


def _ptxas() -> str:
    tool = cuda_toolkit.ptxas()
    if tool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ptxas is needed to validate PTX under CI")
        pytest.skip("ptxas not found")
    return tool


def _entry_params(ptx: str) -> dict[str, int]:
    """Parameters of each ``.entry`` of a PTX module."""
    return {m.group(1): len(re.findall(r"\.param\s", m.group(2)))
            for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S)}


def _function(expr: str, fmt: str, shapes: dict, dtype: str = "float32"):
    """The build for ``shapes`` (fixed: shape-generic kernels too; ``test_shape_generic_gpu`` has their generic one)."""
    expr = expr.replace("A_", "Z")
    return sm.compile(expr, formats={"A": fmt}, dtype=dtype, target="cuda").specialize(shapes, fixed=True)


@pytest.mark.parametrize(("expr", "fmt", "shapes"), CASES, ids=[f"{e}|{f}" for e, f, _ in CASES])
def test_every_kernel_assembles_for_sm80_and_sm90(expr, fmt, shapes, tmp_path):
    tool = _ptxas()
    function = _function(expr, fmt, shapes)
    program = function.program
    assert set(program.ptx) == {"sm_80", "sm_90"}
    for chip, ptx in program.ptx.items():
        src = tmp_path / f"{chip}.ptx"
        src.write_text(ptx)
        done = subprocess.run([tool, f"-arch={chip}", str(src), "-o", str(tmp_path / f"{chip}.cubin")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        # the manifest describes exactly the entry points' parameters
        params = _entry_params(ptx)
        for launch in program.launches:
            assert params[launch.kernel] == launch.param_count()


def test_dense_outer_loops_become_a_multi_block_grid():
    program = _function("C[i,j] = A[i,k]*B[k,j]", "bsr2x2", {"A": (1000, 64), "B": (64, 8)}).program
    assert "serial" not in program.notes
    (launch,) = program.launches
    assert launch.grid[0] == 4 and launch.block == (128, 1, 1)  # 500 block rows, 128 per block


def test_reduction_outer_loops_run_as_one_thread():
    # (CSC, COO and DCSR products and sums have parallel kernels: tests/test_gpu_formats.py; this one does not)
    program = _function("y[i] = exp(A[i,j])", "csc", {"A": (300, 200)}).program
    assert program.notes == ("serial",)


def test_csr_spmv_and_spmm_take_the_load_balanced_kernels():
    spmv = _function("y[i] = A[i,j]*x[j]", "csr", {"A": (1000, 500), "x": (500,)}).program
    launch, split = spmv.launches
    assert spmv.notes == ("native",) and launch.kernel == "spmv" and launch.lanes == LaneRule(1, 1000)
    assert (launch.when, split.kernel, split.when, split.grid) == ("balanced", "spmv_split", "skewed",
                                                                   GridRule(ref=1, per_block=128 * 16))
    spmm = _function("C[i,j] = A[i,k]*B[k,j] + b[j]", "csr", {"A": (1000, 500), "B": (500, 300), "b": (300,)})
    (launch,) = spmm.program.launches
    # 4 rows per block; lanes own one float4 each (few rows): 300 columns are 3 tiles of 128
    assert launch.kernel == "spmm" and launch.grid == (250, 3, 1)
    assert [a.ref for a in launch.args] == [0, 1, 2, 3, 4, 5] and launch.aligned == (3, 4, 5)
    odd = _function("C[i,j] = A[i,k]*B[k,j]", "csr", {"A": (1000, 500), "B": (500, 301)}).program.launches[0]
    assert odd.grid == (250, 10, 1) and odd.aligned == ()  # single floats, one per lane: 32-column tiles


def test_lane_rule_follows_the_mean_row_length():
    rule = LaneRule(ref=1, rows=100)
    assert [rule.lanes(n) for n in (0, 100, 250, 1600, 100_000)] == [1, 1, 2, 8, 32]  # half the mean row
    launch = Launch("spmv", (1, 1, 1), (128, 1, 1), (KernelArg("buffer", 0, (None,)), KernelArg("lanes", 0)),
                    lanes=rule)
    assert launch.grid_for([101, 1600]) == (7, 1, 1)  # 100 rows x 8 lanes / 128
    assert ParamPacker(launch)([(0x1000, 101), (0x2000, 1600)], [])[-1] == 8


def test_parameters_are_expanded_memref_descriptors():
    launch = Launch("k", GridRule(ref=1, per_block=256), (256, 1, 1),
                    (KernelArg("buffer", 1, (None,)), KernelArg("buffer", 0, (3, 4)), KernelArg("index", 7),
                     KernelArg("scratch", 0, (5,))))
    words = ParamPacker(launch)([(0xA0, 12), (0xB0, 1000)], [0xC0])
    assert words == [0xB0, 0xB0, 0, 1000, 1,  # 1-d, size from the buffer
                     0xA0, 0xA0, 0, 3, 4, 4, 1,  # 2-d static, row-major strides
                     7,
                     0xC0, 0xC0, 0, 5, 1]
    assert launch.param_count() == len(words)
    assert launch.grid_for([12, 1000]) == (4, 1, 1)


def test_pick_chip():
    assert pick_chip(["sm_80", "sm_90"], "90") == "sm_90"
    hopper = ["sm_80", "sm_90", "sm_90a"]
    assert pick_chip(hopper, "90", arch_specific=True) == "sm_90a"  # arch-specific code, exactly its chip
    assert pick_chip(hopper, "90", arch_specific=False) == "sm_90"  # not yet checked on a GPU: opt-in
    assert pick_chip(hopper, "100", arch_specific=True) == "sm_90"  # sm_90a code does not run on sm_100
    assert pick_chip(hopper, "89", arch_specific=True) == "sm_80"
    assert pick_chip(["sm_80", "sm_90"], "89") == "sm_80"
    assert pick_chip(["sm_80", "sm_90"], "100") == "sm_90"
    with pytest.raises(DeviceError, match="compute capability 75"):
        pick_chip(["sm_80"], "75")


def test_host_operands_are_refused_not_copied():
    a = sp.random(10, 10, density=0.3, format="csr", dtype=np.float32, random_state=0)
    kernel = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    with pytest.raises(DeviceError, match=r"on the host; move it once with SparseTensor.to\('cuda'\)"):
        kernel(A=a, x=np.ones(10, np.float32))
    dense_first = sm.compile("y[i] = x[j]*A[i,j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    with pytest.raises(DeviceError, match="takes CuPy arrays"):
        dense_first(A=a, x=np.ones(10, np.float32))


def test_unsupported_requests_fail_clearly():
    with pytest.raises(DeviceError, match="sparse result"):
        sm.compile("C[i,j] = A[i,j]*B[i,j]", formats={"A": "csr", "C": "csr"}, target="cuda")
    with pytest.raises(OptionError, match="schedule='auto'"):
        sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, target="cuda", schedule="auto")


def test_export_writes_ptx_cubin_and_a_manifest_that_loads_without_mlir_or_cupy(tmp_path):
    _ptxas()
    kernel = sm.compile("C[i,j] = A[i,k]*B[k,j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    paths = sm.export(kernel, tmp_path, "spmm", shapes={"A": (64, 32), "B": (32, 16)})
    manifest = json.loads(paths["manifest"].read_text())
    assert manifest["kind"] == "cuda" and set(manifest["code"]) == {"sm_80", "sm_90", "sm_80.cubin", "sm_90.cubin"}
    assert manifest["signature"]["operands"][-1]["shape"] == [64, 16]
    script = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('mlir', 'cupy'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import numpy as np, sparse_mlir as sm
from sparse_mlir.errors import DeviceError
kernel = sm.load_kernel({str(paths['manifest'])!r})
try:
    kernel.function(dict(A=None), None)
except DeviceError as exc:
    print('refused:', exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "refused: running on the GPU needs CuPy" in done.stdout
    ptx = tmp_path / "spmm.sm_90.ptx"
    ptx.write_text(ptx.read_text() + "\n// tampered\n")
    with pytest.raises(FormatError, match="checksum"):
        sm.load_kernel(paths["manifest"])


# -- emulated on the CPU: the kernels and launch records that become PTX, run thread by thread -----------------
def _emulate(expr: str, fmt: str, dense: dict, tmp_path, emitter: str = "auto", dtype: str = "float64",
             skewed: bool = False, out_dtype: str | None = None):
    """Run the GPU program of ``expr`` on dense operands (``A`` converted to ``fmt``) through ``gpu_emulation``."""
    from support.gpu_emulation import run_emulated

    spec = sm.compile(expr, formats={"A": fmt}, dtype=dtype, target="cuda", out_dtype=out_dtype).spec
    args = {n: sm.SparseTensor.from_dense(v, fmt) if n == "A" else v for n, v in dense.items()}
    path = tmp_path / f"emulated_{emitter}_{fmt.replace(':', '_')}_{skewed}_{out_dtype}.so"
    return run_emulated(spec, args, path, emitter=emitter, skewed=skewed)[0], spec


EMULATED = [case for case in CASES if case[0] != "y[i] = A[i,j]*x[j]" or case[1] != "csr"]  # csr SpMV shuffles


@pytest.mark.parametrize("emitter", ["auto", "sparsifier"])
@pytest.mark.parametrize(("expr", "fmt", "shapes"), EMULATED, ids=[f"{e}|{f}" for e, f, _ in EMULATED])
def test_gpu_programs_compute_the_right_values_when_emulated(expr, fmt, shapes, emitter, tmp_path):
    from support.reference import evaluate

    rng = np.random.default_rng(7)
    expr = expr.replace("A_", "Z")
    dense = {}
    for name, shape in shapes.items():
        value = rng.standard_normal(shape)
        if name == "A":
            value = prune_nm(value, 2, 4) if fmt == "2:4" else value * (rng.random(shape) < 0.2)
            value[min(3, shape[0] - 1)] = 0  # an empty row
        dense[name] = value
    got, spec = _emulate(expr, fmt, dense, tmp_path, emitter)
    np.testing.assert_allclose(got, evaluate(spec, dense), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("dtype", "cols"), [("float32", 72), ("float32", 600), ("float32", 70), ("float64", 70),
                                             ("float16", 64), ("float16", 70)])
def test_vectorized_gpu_spmm_when_emulated(dtype, cols, tmp_path):
    """float4 / double2 accesses of B, C and a column bias, several tiles, and the scalar fallback."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((50, 40)) * (rng.random((50, 40)) < 0.3)
    dense = {"A": a.astype(dtype), "B": rng.standard_normal((40, cols)).astype(dtype),
             "b": rng.standard_normal(cols).astype(dtype)}
    got, _ = _emulate("C[i,j] = A[i,k]*B[k,j] + b[j]", "csr", dense, tmp_path, dtype=dtype)
    ref = dense["A"].astype(np.float64) @ dense["B"] + dense["b"]
    tol = 2e-3 if dtype == "float16" else 1e-5  # float16: summed in float32, rounded once at the end
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_row_splitting_spmv_for_skewed_rows_when_emulated(dtype, tmp_path):
    """Chunks of 16 nonzeros cut rows anywhere: a 3000-entry row, empty rows (first and last too), short rows."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 6, 300)
    lengths[[0, 299, 150, 151]] = 0
    lengths[77] = 3000
    cols = 4000
    a = np.zeros((300, cols))
    for row, n in enumerate(lengths):
        a[row, rng.choice(cols, n, replace=False)] = rng.integers(1, 4, n)
    x = rng.integers(-2, 3, cols).astype(float)
    got, _ = _emulate("y[i] = A[i,j]*x[j]", "csr", {"A": a.astype(dtype), "x": x.astype(dtype)}, tmp_path,
                      dtype=dtype, skewed=True)
    np.testing.assert_array_equal(got, (a @ x).astype(dtype))  # small integers: exact in any order


def test_skew_picks_the_row_splitting_kernel_unless_deterministic(monkeypatch):
    import support.fake_cupy as fake_cupy

    from sparse_mlir.abi.gpu_program import SKEWED_ROW

    record = fake_cupy.install(monkeypatch)
    rows, cols = 1000, 2 * SKEWED_ROW
    dense = np.zeros((rows, cols), np.float32)
    dense[np.arange(rows), np.arange(rows)] = 1
    dense[3, :] = 1  # one row far longer than the others
    skewed = sm.SparseTensor.from_dense(dense, "csr").to("cuda")
    assert skewed.longest_row == cols
    balanced = sm.SparseTensor.from_dense(np.eye(rows, cols, dtype=np.float32), "csr").to("cuda")
    x = fake_cupy.device(np.ones(cols, np.float32))
    kernel = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    kernel(A=skewed, x=x)
    kernel(A=balanced, x=x)
    assert [(name, grid) for name, grid, *_ in record.launches] == [
        ("spmv_split", (-(-skewed.nnz // (128 * 16)), 1, 1)), ("spmv", (8, 1, 1))]  # 1000 rows x 1 lane
    exact = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float32", target="cuda", deterministic=True)
    exact(A=skewed, x=x)
    assert record.launches[-1][0] == "spmv"


def test_emulation_refuses_what_threads_in_sequence_cannot_reproduce(tmp_path):
    from sparse_mlir.errors import SparseMLIRError

    with pytest.raises(Exception, match="shuffles") as caught:
        _emulate("y[i] = A[i,j]*x[j]", "csr", {"A": np.eye(4), "x": np.ones(4)}, tmp_path)
    assert not isinstance(caught.value, SparseMLIRError)  # a test-harness limit, not a user error


# -- the runtime's call path, with a stand-in for CuPy that records launches -----------------------------------
def test_calls_pack_device_pointers_and_zero_only_outputs_kernels_accumulate_into(monkeypatch):
    import support.fake_cupy as fake_cupy

    record = fake_cupy.install(monkeypatch)
    kernel = sm.compile("C[i,j] = A[i,k]*B[k,j] + b[j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    a = sp.random(50, 40, density=0.2, format="csr", dtype=np.float32, random_state=0)
    A = sm.SparseTensor.from_scipy(a).to("cuda")
    B = fake_cupy.device(np.ones((40, 64), np.float32))
    bias = fake_cupy.device(np.ones(64, np.float32))
    out = kernel(A=A, B=B, b=bias)
    assert out.shape == (50, 64)
    ((name, grid, block, words, shared),) = record.launches  # the generic build's variant for 64 columns, 50 rows
    assert (name, grid, block, shared) == ("spmm_w4_t1", (13, 1, 1), (128, 1, 1), 0)
    pos, crd, values = A.buffers
    assert words[:15] == [pos.data.ptr, pos.data.ptr, 0, 51, 1, crd.data.ptr, crd.data.ptr, 0, a.nnz, 1,
                          values.data.ptr, values.data.ptr, 0, a.nnz, 1]
    assert words[15:22] == [B.data.ptr, B.data.ptr, 0, 40, 64, 64, 1]
    assert words[22:27] == [bias.data.ptr, bias.data.ptr, 0, 64, 1]
    assert words[27:] == [out.data.ptr, out.data.ptr, 0, 50, 64, 64, 1]
    assert len(record.modules) == 1 and record.modules[0].endswith(".sm_90.ptx")  # on a 9.0 device
    kernel(A=A, B=B, b=bias)
    assert len(record.modules) == 1 and len(record.launches) == 2  # loaded once
    offset = np.ones(40 * 64 + 1, np.float32)[1:].reshape(40, 64).view(fake_cupy.FakeArray)
    with pytest.raises(sm.errors.OperandError, match="16-byte boundary"):
        kernel(A=A, B=offset, b=bias)
    assert len(record.launches) == 2
    stale = fake_cupy.device(np.full((50, 64), np.nan, np.float32))
    assert np.isnan(kernel(A=A, B=B, b=bias, out=stale).host).all()  # the hand-scheduled SpMM stores every element
    sparsified = sm.compile("C[i,j] = A[i,k]*B[k,j] + b[j]", formats={"A": "csc"}, dtype="float32", target="cuda")
    csc = sm.SparseTensor.from_scipy(a, "csc").to("cuda")
    assert not sparsified(A=csc, B=B, b=bias, out=stale).host.any()  # its loops accumulate: zeroed first


def test_out_dtype_results_are_float32_arrays_and_out_is_checked_against_it(monkeypatch):
    import support.fake_cupy as fake_cupy

    fake_cupy.install(monkeypatch)
    kernel = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float16", target="cuda",
                        out_dtype="float32")
    a = sm.SparseTensor.from_dense(np.eye(8, dtype=np.float16), "csr").to("cuda")
    x = fake_cupy.device(np.ones(8, np.float16))
    assert kernel(A=a, x=x).dtype == np.float32
    with pytest.raises(sm.errors.DTypeError, match="output dtype is float32"):
        kernel(A=a, x=x, out=fake_cupy.device(np.zeros(8, np.float16)))
    with pytest.raises(sm.errors.DTypeError, match="operand x has dtype float32"):
        kernel(A=a, x=fake_cupy.device(np.ones(8, np.float32)))


def test_exported_kernels_load_cubins_and_size_the_grid_from_nnz(monkeypatch, tmp_path):
    import support.fake_cupy as fake_cupy

    _ptxas()
    record = fake_cupy.install(monkeypatch)
    kernel = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    paths = sm.export(kernel, tmp_path, "spmv", shapes={"A": (1000, 300), "x": (300,)})
    loaded = sm.load_kernel(paths["manifest"])
    a = sp.random(1000, 300, density=0.03, format="csr", dtype=np.float32, random_state=0)  # 9 per row: 8 lanes
    y = loaded(A=sm.SparseTensor.from_scipy(a).to("cuda"), x=fake_cupy.device(np.ones(300, np.float32)))
    assert y.shape == (1000,)
    ((name, grid, block, words, _),) = record.launches
    assert name == "spmv" and words[-1] == 8 and grid == (63, 1, 1)  # 1000 rows x 8 lanes / 128
    assert record.modules[0].endswith("spmv.sm_90.cubin")
    with pytest.raises(sm.errors.ShapeError, match="exported for A of shape"):
        loaded(A=sm.SparseTensor.from_scipy(a[:10]).to("cuda"), x=fake_cupy.device(np.ones(300, np.float32)))


def test_device_tensors_from_cupyx_are_checked_on_the_device(monkeypatch):
    import support.fake_cupy as fake_cupy

    from sparse_mlir.tensor.device import DeviceSparseTensor
    from sparse_mlir.errors import InvalidIndicesError

    fake_cupy.install(monkeypatch)
    a = sp.random(30, 20, density=0.3, format="csr", dtype=np.float32, random_state=1)
    t = DeviceSparseTensor.from_cupyx(fake_cupy.FakeSparseMatrix(a))
    assert t.format.crd_width == 32 and t.shape == (30, 20) and t.nnz == a.nnz
    assert t.longest_row == np.diff(a.indptr).max()  # read back with the checks, for the choice of kernels
    np.testing.assert_array_equal(t.to("cpu").to_dense(), a.toarray())
    bad = a.copy()
    row = int(np.argmax(np.diff(a.indptr) >= 2))
    first = bad.indptr[row]
    bad.indices[[first, first + 1]] = bad.indices[[first + 1, first]]  # unsorted within a row
    with pytest.raises(InvalidIndicesError, match="unsorted or duplicate"):
        DeviceSparseTensor.from_cupyx(fake_cupy.FakeSparseMatrix(bad))
    out_of_range = a.copy()
    out_of_range.indices[-1] = 20
    with pytest.raises(InvalidIndicesError, match="column indices >= 20"):
        DeviceSparseTensor.from_cupyx(fake_cupy.FakeSparseMatrix(out_of_range))


def test_dense_2to4_compressed_on_the_device_matches_the_host_format(monkeypatch, rng):
    import support.fake_cupy as fake_cupy

    from sparse_mlir.tensor.device import DeviceSparseTensor
    from sparse_mlir.errors import PatternError

    fake_cupy.install(monkeypatch)
    dense = prune_nm(rng.standard_normal((16, 32)), 2, 4).astype(np.float16)
    dense[3, 4:8] = [0, 0, 0, 5]  # a group with one nonzero: padded with a stored zero, as on the host
    t = DeviceSparseTensor.from_dense_nm(fake_cupy.device(dense))
    host = sm.SparseTensor.from_dense(dense, "2:4")
    assert t.format == host.format
    for got, want in zip(t.buffers, host.buffers):
        np.testing.assert_array_equal(got.get(), want)
    with pytest.raises(PatternError, match="more than 2 nonzeros"):
        DeviceSparseTensor.from_dense_nm(fake_cupy.device(np.ones((4, 8), np.float16)))
    pruned = DeviceSparseTensor.from_dense_nm(fake_cupy.device(rng.standard_normal((4, 8)).astype(np.float16)),
                                              prune=True)
    assert pruned.nnz == 16


def test_float16_2to4_spmm_runs_on_sparse_tensor_cores(tmp_path):
    tool = _ptxas()
    kernel = sm.compile("C[i,j] = A[i,k]*B[k,j]", formats={"A": "2:4"}, dtype="float16", target="cuda")
    program = kernel.function({"A": sm.NM(2, 4)}, {"A": (64, 128), "B": (128, 96), "C": (64, 96)}).program
    launch = program.launches[0]  # the portable kernel; sm_90a runs the wgmma one (test_hopper_gemm_...)
    assert launch.kernel == "spmm_2to4" and launch.grid == (1, 3, 1)  # 4 warps of 16 rows, 32-column tiles
    assert launch.chips == ("sm_80", "sm_90")
    for chip, ptx in program.ptx.items():
        if chip == "sm_90a":
            assert "spmm_2to4" not in _entry_params(ptx)
            continue
        assert "mma.sp.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32" in ptx  # float16 in, float32 sums
        (tmp_path / "k.ptx").write_text(ptx)
        done = subprocess.run([tool, f"-arch={chip}", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert _entry_params(ptx)["spmm_2to4"] == launch.param_count()
    with pytest.raises(DeviceError, match="float16 on cuda runs"):
        kernel.function({"A": sm.NM(2, 4)}, {"A": (60, 128), "B": (128, 96), "C": (60, 96)})  # not whole tiles


def test_float16_dense_gemm_runs_on_tensor_cores_with_the_same_tiling(tmp_path):
    tool = _ptxas()
    kernel = sm.compile("C[i,j] = A[i,k]*B[k,j]", dtype="float16", target="cuda")
    program = kernel.function({}, {"A": (64, 128), "B": (128, 96), "C": (64, 96)}).program
    launch = program.launches[0]
    assert launch.kernel == "gemm_f16" and launch.grid == (1, 3, 1) and launch.chips == ("sm_80", "sm_90")
    ptx = program.ptx["sm_90"]
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 32  # 2 per step, 4 x 4 tiles
    (tmp_path / "k.ptx").write_text(ptx)
    done = subprocess.run([tool, "-arch=sm_90", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("dtype", "out_dtype"), [("float32", None), ("float64", None), ("float16", "float32")])
@pytest.mark.parametrize("bias", [None, "o", "b"])
def test_linear_layers_run_the_warp_spmm_between_transposes_when_emulated(dtype, out_dtype, bias, tmp_path):
    """``Y[b,o] = X[b,i] * W[o,i]``: transpose into scratch, warp-per-row SpMM, transpose into Y (no zeroing)."""
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((40, 24)) * (rng.random((40, 24)) < 0.3)).astype(dtype)
    w[5] = 0
    dense = {"A": w, "X": rng.standard_normal((24, 24)).astype(dtype)[:9].copy()}
    ref = dense["X"].astype(np.float64) @ w.T.astype(np.float64)
    expr = "Y[b,o] = X[b,i] * A[o,i]" + ("" if bias is None else f" + z[{bias}]")
    if bias is not None:
        dense["z"] = rng.standard_normal(40 if bias == "o" else 9).astype(dtype)
        ref = ref + (dense["z"] if bias == "o" else dense["z"][:, None])
    got, spec = _emulate(expr, "csr", dense, tmp_path, dtype=dtype, out_dtype=out_dtype)
    assert got.dtype == spec.output_dtype
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    program = sm.compile(expr, formats={"A": "csr"}, dtype=dtype, target="cuda", out_dtype=out_dtype).specialize(
        {n: v.shape for n, v in dense.items()}, fixed=True).program
    assert [k.kernel for k in program.launches] == ["transpose_in", "spmm", "transpose_out"]
    assert not program.needs_zeroed_output() and len(program.scratch) == 2


@pytest.mark.parametrize(("expr", "cols", "skewed"), [("C[i,j] = A[i,k]*B[k,j] + b[j]", 64, False),
                                                      ("C[i,j] = A[i,k]*B[k,j] + b[j]", 70, False),
                                                      ("y[i] = A[i,j]*x[j]", None, True)])
def test_float16_kernels_keep_their_float32_sums_with_out_dtype(expr, cols, skewed, tmp_path):
    """``out_dtype="float32"``: the same float32 sums, stored without the final rounding to float16."""
    rng = np.random.default_rng(4)
    a = (rng.standard_normal((300, 40)) * (rng.random((300, 40)) < 0.3)).astype(np.float16)
    if skewed:
        a[7] = rng.standard_normal(40)  # a long row among short ones, for the row-splitting kernel
        dense = {"A": a, "x": rng.standard_normal(40).astype(np.float16)}
        ref = a.astype(np.float64) @ dense["x"]
    else:
        dense = {"A": a, "B": rng.standard_normal((40, cols)).astype(np.float16),
                 "b": rng.standard_normal(cols).astype(np.float16)}
        ref = a.astype(np.float64) @ dense["B"] + dense["b"]
    got, spec = _emulate(expr, "csr", dense, tmp_path, dtype="float16", skewed=skewed, out_dtype="float32")
    assert got.dtype == np.float32 and spec.output_dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())  # float16 would be ~1e-3


@pytest.mark.parametrize("fmt", ["2:4", "dense"])
def test_tensor_core_kernels_store_float32_with_out_dtype(fmt, tmp_path):
    tool = _ptxas()
    formats = {"A": "2:4"} if fmt == "2:4" else {}
    kernel = sm.compile("C[i,j] = A[i,k]*B[k,j]", formats=formats, dtype="float16", target="cuda",
                        out_dtype="float32")
    function = kernel.function({"A": sm.NM(2, 4)} if formats else {}, {"A": (64, 128), "B": (128, 96),
                                                                       "C": (64, 96)})
    assert function.signature.output.dtype == np.float32 and "out_dtype=float32" in repr(kernel)
    ptx = function.program.ptx["sm_90"]
    assert re.search(r"st\.global\.v2\.[bf]32", ptx) and "cvt.rn.f16.f32" not in ptx  # float32 pairs, unrounded
    (tmp_path / "k.ptx").write_text(ptx)
    done = subprocess.run([tool, "-arch=sm_90", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_out_dtype_is_only_for_float16_sums():
    from sparse_mlir.errors import DTypeError

    with pytest.raises(DTypeError, match="float16 kernels may write their float32 sums"):
        sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float32", out_dtype="float64")
    with pytest.raises(DTypeError, match="float16 kernels run on target='cuda'"):
        sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float16", out_dtype="float32")
    same = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float32", out_dtype="float32")
    assert same.spec.out_dtype is None and same is sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"},
                                                              dtype="float32")


def test_float16_is_a_gpu_dtype():
    from sparse_mlir.errors import DTypeError

    with pytest.raises(DTypeError, match="float16 kernels run on target='cuda'"):
        sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float16")


def test_the_device_script_runs_start_to_end_against_the_stand_in(tmp_path):
    """A rehearsal of the one GPU run: small bundle, every step completes (kernels compute nothing here)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bundle = tmp_path / "bundle"
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "prepare_bundle.py"), str(bundle),
                           "--small"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    env = {**os.environ, "OUT": str(tmp_path)}
    run = subprocess.run([sys.executable, os.path.join(root, "tests", "support", "fake_cupy.py"), str(bundle / "device_check.py"),
                          str(bundle)], capture_output=True, text=True, env=env, cwd=root)
    assert run.returncode == 1, run.stderr  # the stand-in's launches compute nothing: every check reports FAIL
    assert "generic_spmm_bias_float16" in run.stdout  # the shape-generic exports ran at several sizes
    results = json.loads((tmp_path / "gpu_results.json").read_text())
    assert len(results["checks"]) == 46 + 4 + 3  # + the SDDMM exports, each at several sizes
    assert not any(str(v).startswith("failed") for v in results["bench"].values())
    assert {"spmv_50M", "spmv_50M_banded", "spmv_skewed", "spmm_4096_90", "dlmc_geomean_vs_cusparse",
            "tensor_core_8192", "launch_overhead_us", "spmv_50M_coo", "spmv_50M_csc", "spmv_50M_dcsr",
            "sddmm_256_0.05_k32"
            } <= results["bench"].keys()


LAUNCHERS = [("y[i] = A[i,j]*x[j]", "csr", {"A": (100, 50), "x": (50,)}),  # lanes picked from nnz in C
             ("C[i,j] = A[i,k]*B[k,j]", "2:4", {"A": (40, 64), "B": (64, 16)}),  # N:M positions made in C
             ("C[i,j] = relu(A[i,k]*B[k,j] + b[i])", "csr", {"A": (40, 64), "B": (64, 16), "b": (40,)}),  # scratch
             ("Y[b,o] = X[b,i]*A[o,i] + b[o]", "csr", {"A": (40, 64), "X": (16, 64), "b": (40,)})]  # 3 launches


def launcher_run(tmp_path: Path, name: str, shapes: dict[str, tuple[int, ...]], nnz: int = 37,
                 main: str = "main", skewed: bool = False, values_off: int = 0) -> tuple[int, str, dict[str, Any]]:
    """Compile a program calling the exported launcher ``name`` (``tmp_path/name.h``, ``.json``) against the
    recording stand-in for cuda.h, with fake pointers, level buffer lengths that fit ``shapes`` (``nnz`` stored
    entries per compressed level; ``values_off`` added to the values' length) and the run-time sizes; return its
    status, output and what ParamPacker needs."""
    from sparse_mlir.abi.gpu_program import GpuProgram
    from sparse_mlir.abi.c_signature import Signature
    from sparse_mlir.formats import LevelKind

    manifest = json.loads((tmp_path / f"{name}.json").read_text())
    sig, program = Signature.from_json(manifest["signature"]), GpuProgram.from_json(manifest["program"], ptx={})
    given: dict[tuple[str, str], tuple[int, int]] = {}  # (operand, buffer) -> (fake pointer, length)
    c_args = []
    shape_of = {**shapes}
    for n, op in enumerate(sig.operands):
        shape = shape_of.setdefault(op.name, tuple(s for s in op.shape))
        lengths = {}
        if op.sparse:
            entries = 1
            for i, (level, size) in enumerate(zip(op.format.levels, op.format.level_sizes(shape))):
                if level.kind is LevelKind.DENSE:
                    entries *= size
                elif level.kind is LevelKind.STRUCTURED:
                    entries *= level.n
                    lengths[f"crd{i}"] = entries
                else:
                    lengths[f"pos{i}"], lengths[f"crd{i}"] = entries + 1, nnz
                    entries = nnz
            lengths["values"] = entries + values_off
        for b, (buf, _) in enumerate(op.buffers() if op.sparse else [("", None)]):
            pointer = 0x100000 * (n + 1) + 0x1000 * b
            given[(op.name, buf)] = (pointer, lengths.get(buf, 0))
            c_args += [str(pointer)] + ([str(lengths[buf])] if op.sparse else [])
        c_args += [str(shape[d]) for d, size in enumerate(op.shape) if size is None]
    allocations = iter(range(0xA000, 0xB000, 0x100))  # the stand-in's order: scratch, then N:M positions
    scratch = [next(allocations) for _ in program.scratch]
    buffers, arg_shapes = [], []
    for op, buf in sig.kernel_arguments():
        if op.sparse and (op.name, buf) not in given:  # implicit N:M positions: one per group, plus one
            buffers.append((next(allocations), int(np.prod(op.format.level_sizes(op.shape)[:-1])) + 1))
        else:
            pointer, length = given[(op.name, buf if op.sparse else "")]
            buffers.append((pointer, length if op.sparse else int(np.prod(shape_of[op.name]))))
        arg_shapes.append((buffers[-1][1],) if op.sparse else tuple(shape_of[op.name]))
    launches = [launch for launch in program.launches if launch.runs(skewed) and launch.fits(arg_shapes)]
    if any(launch.when for launch in program.launches):
        c_args.append("1" if skewed else "0")
    counts = "".join(f"fake_param_count[{i}] = {launch.param_count()}; " for i, launch in enumerate(launches))
    (tmp_path / f"{main}.c").write_text(
        f'#include "{name}.h"\nint main(void) {{ {name}_module m; {name}_load(&m, "k.ptx"); {counts}'
        f'return (int){name}(&m, 0, {", ".join(c_args)}); }}\n')
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", f"-I{here}/support/fake_cuda", f"-I{tmp_path}", "-o",
                    str(tmp_path / main), str(tmp_path / f"{main}.c")], check=True)
    run = subprocess.run([str(tmp_path / main)], capture_output=True, text=True)
    return run.returncode, run.stdout, {"sig": sig, "program": program, "buffers": buffers, "shapes": arg_shapes,
                                        "scratch": scratch, "launches": launches, "given": given,
                                        "out_shape": shape_of[sig.output.name]}


def check_launches(out: str, found: dict[str, Any]) -> None:
    """The launcher's grids and parameter words are what ``Launch.grid_for`` and ``ParamPacker`` give."""
    launched = [line.split()[1:] for line in out.splitlines() if line.startswith("launch")]
    assert len(launched) == len(found["launches"])
    lengths = [n for _, n in found["buffers"]]
    for launch, line in zip(found["launches"], launched):
        name, dims, words = line[0], [int(v) for v in line[1:8]], [int(v) for v in line[8:]]
        assert name == launch.kernel
        assert dims[:3] == list(launch.grid_for(lengths, found["shapes"])) and dims[3:6] == list(launch.block)
        assert words == ParamPacker(launch)(found["buffers"], found["scratch"], shapes=found["shapes"],
                                            scratch_shapes=found["program"].scratch_shapes(found["shapes"]))


@pytest.mark.parametrize(("expr", "fmt", "shapes"), LAUNCHERS, ids=[f"{e}|{f}" for e, f, _ in LAUNCHERS])
def test_the_c_launcher_packs_what_the_python_runtime_packs(expr, fmt, shapes, tmp_path):
    """Compile the exported header against a recording stand-in for cuda.h and compare with ``ParamPacker``."""
    kernel = sm.compile(expr, formats={"A": fmt}, dtype="float32", target="cuda")
    sm.export(kernel, tmp_path, "k", shapes=shapes)
    status, out, found = launcher_run(tmp_path, "k", {})
    assert status == 0, out
    check_launches(out, found)
    sig, program = found["sig"], found["program"]
    zeroed = f"memset {found['given'][(sig.output.name, '')][0]} 0 {int(np.prod(sig.output.shape)) * 4}" in out
    assert zeroed == program.needs_zeroed_output()  # only where a kernel accumulates into the output
    # level buffers that do not fit the exported shape: refused before anything is enqueued
    status, out, _ = launcher_run(tmp_path, "k", {}, main="bad", values_off=1)
    assert status == 1 and "launch" not in out and "alloc" not in out  # CUDA_ERROR_INVALID_VALUE


# -- on a device --------------------------------------------------------------------------------------------
def _cupy():
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cp


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "bsr2x2", "2:4"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kernels_on_the_device_match_cupyx(fmt, dtype, rng):
    cp = _cupy()
    dense = (rng.standard_normal((96, 64)) * (rng.random((96, 64)) < 0.2)).astype(dtype)
    if fmt == "2:4":
        dense = prune_nm(rng.standard_normal((96, 64)), 2, 4).astype(dtype)
    a = sm.SparseTensor.from_dense(dense, fmt).to("cuda")
    b = rng.standard_normal((64, 40)).astype(dtype)
    x = rng.standard_normal(64).astype(dtype)
    spmm = sm.compile("C[i,j] = A[i,k]*B[k,j]", formats={"A": fmt}, dtype=dtype, target="cuda")
    spmv = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": fmt}, dtype=dtype, target="cuda")
    tol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(cp.asnumpy(spmm(A=a, B=cp.asarray(b))), dense @ b, rtol=tol, atol=tol)
    np.testing.assert_allclose(cp.asnumpy(spmv(A=a, x=cp.asarray(x))), dense @ x, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_cupyx_operands_and_skewed_rows_on_the_device(rng):
    cp = _cupy()
    import cupyx.scipy.sparse as csp

    a = sp.random(2000, 3000, density=0.002, format="csr", dtype=np.float32, random_state=3).tolil()
    a[7, :] = 1.0  # one dense row among short ones
    a = a.tocsr()
    x = rng.standard_normal(3000).astype(np.float32)
    kernel = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    got = kernel(A=csp.csr_matrix(a), x=cp.asarray(x))
    np.testing.assert_allclose(cp.asnumpy(got), a @ x, rtol=1e-4, atol=1e-3)


def test_gpu_out_may_not_overlap_an_operand(monkeypatch):
    """``GpuFunction`` zeroes ``out`` before an accumulating kernel: ``out=B`` zeroed the caller's ``B`` and the
    kernel read zeros.  The CPU path always refused it."""
    import support.fake_cupy as fake_cupy

    from sparse_mlir.errors import OperandError

    fake_cupy.install(monkeypatch)
    a = sp.random(8, 8, density=0.4, format="csr", dtype=np.float32, random_state=0)
    memory = fake_cupy.device(np.arange(128, dtype=np.float32) + 1)
    b = memory[:64].reshape(8, 8)
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csc"}, dtype="float32", target="cuda")
    operand = sm.SparseTensor.from_scipy(a, "csc").to("cuda")
    for out in (b, memory[32:96].reshape(8, 8)):  # the same array; one that overlaps half of it
        with pytest.raises(OperandError, match="overlaps operand B"):
            kernel(A=operand, B=b, out=out)
    assert np.asarray(memory).all()  # untouched
    kernel(A=operand, B=b, out=memory[64:].reshape(8, 8))  # right after B: no overlap
    kernel(A=operand, B=b, out=fake_cupy.device(np.zeros((8, 8), np.float32)))  # a separate array is fine


def test_device_nm_offsets_follow_the_format_and_cupyx_buffers_must_agree(monkeypatch):
    """m > 128 stored offsets as int8 (150 read back as -106) under a format of 32-bit offsets; m = 0 divided by
    zero; a cupyx CSR with fewer values than column indices was taken (a kernel reads past the values)."""
    import support.fake_cupy as fake_cupy

    from sparse_mlir.errors import FormatError, InvalidIndicesError
    from sparse_mlir.tensor.device import DeviceSparseTensor

    fake_cupy.install(monkeypatch)
    dense = np.zeros((2, 400), np.float32)
    dense[0, 150], dense[1, 205] = 1.0, 2.0
    t = DeviceSparseTensor.from_dense_nm(fake_cupy.device(dense), 2, 200)
    assert t.buffers[0].dtype == np.dtype(f"int{t.format.crd_width}")
    np.testing.assert_array_equal(t.to("cpu").to_dense(), dense)
    with pytest.raises(FormatError):
        DeviceSparseTensor.from_dense_nm(fake_cupy.device(dense), 2, 0)
    a = sp.random(30, 20, density=0.3, format="csr", dtype=np.float32, random_state=1)
    short = fake_cupy.FakeSparseMatrix(a)
    short.data = short.data[:-3]
    with pytest.raises(InvalidIndicesError, match="values"):
        DeviceSparseTensor.from_cupyx(short)
