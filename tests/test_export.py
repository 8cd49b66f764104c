"""Ahead-of-time export: artifacts, symbols, the C ABI from Python without MLIR, and CMake embedding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import random_sparse

import sparse_mlir as sm
from sparse_mlir.errors import FormatError, OptionError, ShapeError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exported")
    spmm = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32")
    add = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": "csr", "B": "csr", "C": "csr"})
    nm = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "2:4"})
    return {"spmm": sm.export(spmm, folder, "spmm_csr", shapes={"A": (40, 24)}),
            "add": sm.export(add, folder, "add_csr", shapes={"A": (10, 12), "B": (10, 12)}),
            "nm": sm.export(nm, folder, "spmv_24", shapes={"A": (8, 16)}, cpu="native")}


def test_artifacts_and_manifest(exported):
    paths = exported["spmm"]
    assert all(p.exists() for p in paths.values())
    manifest = json.loads(paths["manifest"].read_text())
    assert manifest["schema"] == 1 and manifest["kind"] == "cpu" and manifest["cpu"] == "x86-64-v2"
    assert [o["name"] for o in manifest["signature"]["operands"]] == ["A", "B", "C"]
    header = paths["header"].read_text()
    assert "int32_t spmm_csr(" in header and "const int32_t* A_pos1" in header and "float* C" in header
    assert "void add_csr_free(add_csr_result* result);" in exported["add"]["header"].read_text()


def test_only_the_entry_points_are_exported(exported):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not installed")
    for name, paths in exported.items():
        out = subprocess.run([nm, "--defined-only", "--extern-only", str(paths["object"])], capture_output=True,
                             text=True, check=True).stdout.split()
        symbols = sorted(s for s in out[2::3])
        expected = {"spmm": ["spmm_csr"], "add": ["add_csr", "add_csr_free"], "nm": ["spmv_24"]}[name]
        assert symbols == expected


def test_load_kernel_runs_exported_artifacts(exported, rng):
    a = random_sparse(rng, (40, 24), 0.3, "float32")
    b = rng.standard_normal((24, 5)).astype(np.float32)
    spmm = sm.load_kernel(exported["spmm"]["library"])
    np.testing.assert_allclose(spmm(A=sm.SparseTensor.from_dense(a, "csr"), B=b), a @ b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match="exported for A of shape"):
        spmm(A=sp.csr_matrix(np.ones((41, 24), np.float32)), B=b)
    x, y = random_sparse(rng, (10, 12), 0.3, "float64"), random_sparse(rng, (10, 12), 0.3, "float64")
    add = sm.load_kernel(exported["add"]["manifest"])
    C = add(A=sp.csr_matrix(x), B=sp.csr_matrix(y))
    np.testing.assert_array_equal(C.to_dense(), x + y)


def test_checksum_is_verified(exported, tmp_path):
    for path in exported["spmm"].values():
        shutil.copy(path, tmp_path / path.name)
    lib = tmp_path / exported["spmm"]["library"].name
    lib.write_bytes(lib.read_bytes() + b"\0")
    with pytest.raises(FormatError, match="checksum"):
        sm.load_kernel(lib)


def test_export_of_a_sparsifier_kernel_needs_sparse_shapes(tmp_path):
    k = sm.compile("y[i] = A[i,j] * x[j] + A[i,j]", formats={"A": "csr"})  # no hand-scheduled emitter: per shape
    with pytest.raises(ShapeError, match="give shapes for A"):
        sm.export(k, tmp_path / "never", "spmv")
    with pytest.raises(FormatError, match="C identifier"):
        sm.export(k, tmp_path / "never", "bad-name", shapes={"A": (2, 2)})
    assert not (tmp_path / "never").exists()


def test_exported_kernel_runs_where_mlir_cannot_be_imported(exported, rng):
    script = textwrap.dedent(f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "mlir" or name.startswith("mlir."):
                    raise ImportError("MLIR is not installed here")
        sys.meta_path.insert(0, Block())
        import numpy as np
        import sparse_mlir as sm
        k = sm.load_kernel({str(exported["nm"]["manifest"])!r})
        dense = np.zeros((8, 16)); dense[:, ::4] = 1.0; dense[:, 2::4] = 2.0
        y = k(A=sm.SparseTensor.from_dense(dense, "2:4"), x=np.arange(16.0))
        assert np.array_equal(y, dense @ np.arange(16.0)), y
        assert "mlir" not in sys.modules
        print("ran without mlir")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ran without mlir" in out.stdout


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_builds_and_tests_the_embedding_examples(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    build = tmp_path / "build"
    for cmd in (["cmake", "-S", str(ROOT), "-B", str(build)], ["cmake", "--build", str(build), "-j2"],
                ["ctest", "--test-dir", str(build), "--output-on-failure"]):
        result = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "100% tests passed" in result.stdout


def test_threaded_export_names_its_runtime(tmp_path, rng):
    from sparse_mlir.runtime.threads import openmp_library

    if openmp_library() is None:
        pytest.skip("no OpenMP runtime installed")
    k = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype="float32")
    paths = sm.export(k, tmp_path, "spmm_omp", shapes={"A": (64, 32)}, threads=True)
    manifest = json.loads(paths["manifest"].read_text())
    assert manifest["threads"] and manifest["openmp_runtime"] == openmp_library().name
    assert "OpenMP" in paths["header"].read_text()
    needed = subprocess.run(["readelf", "-d", str(paths["library"])], capture_output=True, text=True).stdout
    assert openmp_library().name in needed
    a = random_sparse(rng, (64, 32), 0.2, "float32")
    b = rng.standard_normal((32, 300)).astype(np.float32)
    got = sm.load_kernel(paths["manifest"])(A=sm.SparseTensor.from_dense(a, "csr"), B=b)
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name, why", [("exp", "C runtime"), ("memset", "C runtime"), ("malloc", "C runtime"),
                                       ("kernel", "kernel's own code"), ("int", "reserved"), ("_mlir_x", "reserved"),
                                       ("omp_get_num_threads", "reserved")])
def test_export_names_the_code_or_the_c_runtime_take_are_refused(tmp_path, name, why):
    """``exp`` exported fine and then called itself where the kernel computes exp (wrong results from C);
    ``kernel`` and ``malloc`` failed in mlir-translate with a page of IR; ``int`` made a header that does not
    compile."""
    k = sm.compile("y[i] = exp(x[i])", dtype="float64")
    with pytest.raises(FormatError, match=why):
        sm.export(k, tmp_path / "out", name, shapes={"x": (4,)})
    written = list((tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert written == []


def test_export_returns_every_file_it_writes_and_refuses_a_folder_that_is_a_file(tmp_path):
    k = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})
    paths = sm.export(k, tmp_path / "out", "spmv")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in paths.values())
    assert paths["source"].read_text().startswith("module")  # NAME.mlir was written and not reported
    (tmp_path / "a_file").write_text("x")
    for folder in (tmp_path / "a_file", tmp_path / "a_file" / "below"):
        with pytest.raises(OptionError, match="cannot be made"):
            sm.export(k, folder, "spmv")


@pytest.mark.parametrize("shape", [(-1, 4), (4.7, 4), (True, 4), "44", 4, None, (2 ** 64, 4)])
def test_export_and_specialize_refuse_shapes_that_are_not_sizes(tmp_path, shape):
    """-1, 4.7 (built as 4) and True were exported (a header saying ``-1x4``); 4 and None were bare TypeErrors."""
    k = sm.compile("y[i] = A[i,j] * x[j] + A[i,j]", formats={"A": "csr"})  # sparsified: built per shape
    with pytest.raises(ShapeError):
        sm.export(k, tmp_path / "out", "spmv", shapes={"A": shape})
    with pytest.raises(ShapeError):
        k.specialize({"A": shape})
