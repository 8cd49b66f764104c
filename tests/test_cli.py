"""The sparse-mlir command, through the installed console script, doing real work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.kernels import SPARSIFIED_SPMV_T

EXE = shutil.which("sparse-mlir") or str(Path(sys.executable).parent / "sparse-mlir")


def cli(*args: str, cache: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if cache is not None:
        env["SPARSE_MLIR_CACHE_DIR"] = str(cache)
    result = subprocess.run([EXE, *args], capture_output=True, text=True, env=env)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_info(tmp_path):
    out = cli("info", cache=tmp_path).stdout
    assert "sparse_mlir" in out and "targets: cpu" in out and str(tmp_path) in out
    assert "C call path: available" in out  # this machine has Python's headers and a C compiler


def test_show_every_stage():
    # a CSC SpMM goes through the sparsifier (its SpMV has a hand-scheduled kernel): every stage has IR of its own
    out = cli("show", "C[i,j] = A[i,k] * B[k,j]", "--format", "A=csc", "--shape", "A=8x6", "--shape", "B=6x4").stdout
    for stage in ("input", "sparsified", "llvm"):
        assert f"// ----- {stage} -----" in out
    assert "tensor<8x6xf64, #sparse" in out and "llvm.func @sparse_mlir_kernel(" in out


def test_show_and_export_for_the_gpu(tmp_path):
    out = cli("show", "C[i,j] = A[i,k] * B[k,j]", "--format", "A=2:4", "--dtype", "float16", "--target", "cuda",
              "--shape", "A=32x64", "--shape", "B=64x32", "--stage", "nvvm").stdout
    assert "// ----- llvm -----" in out and "mma.sp" in out
    out = cli("export", "y[i] = A[i,j] * x[j]", "--format", "A=csr", "--target", "cuda", "--dtype", "float32",
              "--shape", "A=100x50", "--shape", "x=50", "--name", "spmv", "-o", str(tmp_path)).stdout
    assert "manifest" in out and (tmp_path / "spmv.sm_90.ptx").is_file()
    cli("export", "y[i] = A[i,j] * x[j]", "--format", "A=csr", "--target", "cuda", "--dtype", "float16",
        "--out-dtype", "float32", "--shape", "A=100x50", "--shape", "x=50", "--name", "wide", "-o", str(tmp_path))
    manifest = json.loads((tmp_path / "wide.json").read_text())
    assert [op["dtype"] for op in manifest["signature"]["operands"]] == ["float16", "float16", "float32"]
    assert "cuMemsetD8Async(y, 0, 400, stream)" in (tmp_path / "wide.h").read_text()  # 100 float32 sums


def test_show_without_shapes_prints_the_generic_module():
    out = cli("show", "C[i,j] = A[i,k] * B[k,j]", "--format", "A=2:4", "--stage", "input").stdout
    assert "tensor<?x?xf64, #sparse" in out


def test_export_then_load(tmp_path):
    out = cli("export", "C[i,j] = A[i,k] * B[k,j]", "--format", "A=ds:1,0", "--shape", "A=16x8", "--dtype",
              "float32", "--name", "spmm_csc", "-o", str(tmp_path)).stdout
    assert "library" in out
    manifest = json.loads((tmp_path / "spmm_csc.json").read_text())
    assert manifest["signature"]["operands"][0]["format"]["name"] == "ds:1,0"
    assert (tmp_path / "libspmm_csc.so").exists() and (tmp_path / "spmm_csc.h").exists()


def test_compile_warms_the_cache_and_export_writes_files(tmp_path):
    out = cli("compile", "C[i,j] = A[i,k] * B[k,j]", "--format", "A=coo", "--shape", "A=4x4", "--shape", "B=4x3",
              cache=tmp_path / "c").stdout
    assert "compiled for A=4x4, B=4x3" in out and "stages: input, sparsified, mapped, llvm" in out
    assert any((tmp_path / "c").rglob("*.so"))  # a later process loads it from the cache
    assert "planned" in cli("compile", "C[i,j] = A[i,k] * B[k,j]", "--format", "A=coo").stdout  # per shape: planned
    assert cli("compile", "--help").stdout.count("-o OUTPUT") == 0 and "-o OUTPUT" in cli("export", "--help").stdout


def test_version_defaults_in_help_and_one_line_errors(tmp_path):
    import sparse_mlir as sm

    assert cli("--version").stdout.strip() == f"sparse-mlir {sm.__version__}"
    assert "(default: float64)" in cli("export", "--help").stdout and "(default: .)" in cli("export", "--help").stdout
    assert "``" not in cli("--help").stdout  # plain text, not reStructuredText
    missing = cli("convert", str(tmp_path / "nope.smt"), str(tmp_path / "out.smt"), check=False)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and missing.stderr.count("\n") == 1


def test_cache_clear(tmp_path):
    cli("show", "y[i] = A[i,j] * x[j] + 1", "--format", "A=csr", "--shape", "A=4x4", "--shape", "x=4",
        cache=tmp_path / "c")
    assert any((tmp_path / "c").rglob("*.so"))
    cli("cache", "clear", cache=tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_cmake_dir():
    folder = Path(cli("--cmake-dir").stdout.strip())
    assert (folder / "SparseMLIRConfig.cmake").exists()


def test_demo_prints_a_result_table():
    out = cli("demo").stdout
    assert "max err" in out and "SpMM N=128" in out and "west0479" in out


@pytest.mark.parametrize("args,message", [
    (["show", "y[i] = A[i,j] * x[j", "--format", "A=csr"], "expected"),
    (["export", "y[i] = A[i,j] * x[j]", "--format", "A=nope"], "unknown format"),
    (["export", SPARSIFIED_SPMV_T, "--format", "A=csr"], "give shapes for A"),  # sparsified: per shape
    (["export", "y[i] = A[i,j] * x[j]", "--format", "Acsr", "--shape", "A=2x2"], "NAME=VALUE"),
])
def test_errors_go_to_stderr_with_nonzero_status(args, message):
    result = cli(*args, check=False)
    assert result.returncode != 0 and message in result.stderr and result.stdout == ""


def test_every_subcommand_has_help():
    for command in ("export", "compile", "show", "info", "cache", "demo", "convert", "prune"):
        assert "usage:" in cli(command, "--help").stdout


def test_convert_between_files(tmp_path):
    import numpy as np

    import sparse_mlir as sm

    src = str(Path(sm.__file__).parent / "data" / "west0479.mtx.gz")
    out = cli("convert", src, str(tmp_path / "w.smt"), "--format", "dcsr").stdout
    assert "dcsr" in out
    back = tmp_path / "w.mtx"
    cli("convert", str(tmp_path / "w.smt"), str(back))
    t = sm.load_tensor(tmp_path / "w.smt")
    assert t.format == sm.DCSR and t.shape == (479, 479)
    from sparse_mlir.io.matrix_files import load_any

    np.testing.assert_allclose(load_any(back).to_dense(), t.to_dense())


def test_prune_weights(tmp_path):
    import numpy as np

    import sparse_mlir as sm
    from sparse_mlir.prune import satisfies_n_m

    weights = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    np.save(tmp_path / "w.npy", weights)
    cli("prune", str(tmp_path / "w.npy"), str(tmp_path / "w24.smt"), "--pattern", "2:4", "--mask",
        str(tmp_path / "mask.npy"))
    t = sm.load_tensor(tmp_path / "w24.smt")
    assert t.format == sm.NM(2, 4) and satisfies_n_m(t, 2, 4)
    assert np.load(tmp_path / "mask.npy").sum() == t.nnz
    cli("prune", str(tmp_path / "w.npy"), str(tmp_path / "w90.npz"), "--sparsity", "0.9", "--scope", "row")
    assert "kept" in cli("prune", str(tmp_path / "w.npy"), str(tmp_path / "b.smt"), "--sparsity", "0.5",
                         "--block", "4x4").stdout
    assert cli("prune", str(tmp_path / "w.npy"), str(tmp_path / "x.smt"), check=False).returncode == 2


def test_bench_quick_does_real_work(tmp_path):
    out = cli("bench", "--quick", "--rounds", "1", "--out", str(tmp_path)).stdout
    assert "STREAM add bandwidth" in out and "| random768/0.9 | SpMM N=128 |" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["bandwidth"] > 0 and all(r["times"]["sparse_mlir"] > 0 for r in results["results"])


def test_compile_builds_a_shape_generic_kernel_without_shapes():
    out = cli("compile", "y[i] = A[i,j] * x[j]", "--format", "A=csr", "--dtype", "float32").stdout
    assert "compiled for every size (shape-generic)" in out and "stages: input, sparsified, mapped, llvm" in out
    out = cli("compile", SPARSIFIED_SPMV_T, "--format", "A=csr").stdout  # the sparsifier's
    assert "planned" in out and "once per sparse shape" in out


def test_export_without_a_name_works_and_bad_npy_weights_are_one_line_errors(tmp_path):
    """The default ``--name kernel`` was the kernel's own internal function: every export without ``--name``
    failed in mlir-translate.  An object or truncated ``.npy`` to prune was a Python traceback."""
    out = cli("export", "y[i] = A[i,j] * x[j]", "--format", "A=csr", "-o", str(tmp_path)).stdout
    assert (tmp_path / "sparse_kernel.h").exists() and "sparse_kernel" in out
    import numpy as np

    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "short.npy").write_bytes(b"\x93NUMPY\x01\x00\xff\xff{")
    for name in ("objects.npy", "short.npy"):
        result = cli("prune", str(tmp_path / name), str(tmp_path / "o.npz"), "--sparsity", "0.5", check=False)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert result.stderr.startswith("sparse-mlir: error:") and "not a .npy file" in result.stderr
