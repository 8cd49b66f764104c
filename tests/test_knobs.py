"""Environment settings are read in ``knobs.py`` alone, at use time; files are replaced atomically; benchmark code
changes no environment when imported."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import stat
import sys
from pathlib import Path

import pytest

from sparse_mlir import files
from sparse_mlir.knobs import knobs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("sparse_mlir", "dialects", "lowering", "tools")
# what reads, writes or hands out the environment, besides ``os.environ`` itself
_ENV_FUNCTIONS = {"getenv", "getenvb", "putenv", "unsetenv", "environb"}
_MUTATORS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
# the GPU device scripts run only as ``python BUNDLE/<script> BUNDLE`` on the GPU machine and are never imported
# (their top level reads sys.argv and the bundle); CUPY_TF32 must be set there before cupy loads
DEVICE_SCRIPTS = {"benchmarks/gpu/device_check.py", "benchmarks/gpu/tensor_core_check.py"}


# what prepare_bundle.py / tensor_core_bundle.py write (git-ignored): copies of the device scripts and the package
BUNDLES = (ROOT / "benchmarks" / "gpu" / "bundle", ROOT / "benchmarks" / "gpu" / "tc_bundle")


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts and not any(p.is_relative_to(b) for b in BUNDLES))


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _os_names(tree: ast.AST) -> set[str]:
    names = {"os"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "os" and a.asname}
    return names


def _is_environ(node: ast.AST, os_names: set[str]) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id in os_names)


def _passed_on(node: ast.Attribute, parents: dict[ast.AST, ast.AST]) -> bool:
    """``{**os.environ, ...}``, ``os.environ.copy()`` or ``dict(os.environ)``: a child's environment, not a read."""
    parent = parents.get(node)
    if isinstance(parent, ast.Dict):
        return any(key is None and value is node for key, value in zip(parent.keys, parent.values))
    if isinstance(parent, ast.Attribute) and parent.attr == "copy":
        call = parents.get(parent)
        return isinstance(call, ast.Call) and call.func is parent and not call.args
    if isinstance(parent, ast.Call):
        return isinstance(parent.func, ast.Name) and parent.func.id == "dict" and parent.args == [node]
    return False


def environment_reads(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every use of the environment in ``path`` other than passing it on to a child."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    parents, os_names = _parents(tree), _os_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            bad = [a.name for a in node.names if a.name in _ENV_FUNCTIONS | {"environ", "*"}]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in os_names:
            bad = [node.attr] if node.attr in _ENV_FUNCTIONS or (node.attr == "environ"
                                                                 and not _passed_on(node, parents)) else []
        else:
            continue
        if bad:
            found.append((node.lineno, ast.get_source_segment(text, node) or ""))
    return found


def _runs_at_import(tree: ast.Module) -> list[ast.AST]:
    """The nodes a module runs when imported: not in functions, not under ``if __name__ == "__main__"``."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):  # only these parts run now
            todo += node.decorator_list if not isinstance(node, ast.Lambda) else []
            todo += [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            continue
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            todo += node.orelse
            continue
        out.append(node)
        todo += ast.iter_child_nodes(node)
    return out


def environment_changes_at_import(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every change to the environment that importing ``path`` makes."""
    tree = ast.parse(path.read_text(), str(path))
    os_names = _os_names(tree)
    found = []
    for node in _runs_at_import(tree):
        changed = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            changed = (func.attr in _MUTATORS and _is_environ(func.value, os_names)) or (
                func.attr in ("putenv", "unsetenv") and isinstance(func.value, ast.Name) and func.value.id in os_names)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            changed = any(_is_environ(t.value if isinstance(t, ast.Subscript) else t, os_names) for t in targets)
        if changed:
            found.append((node.lineno, ast.unparse(node)))
    return found


# -- the rules, over the whole tree -------------------------------------------------------------------------------

def test_only_knobs_reads_the_environment():
    reads = [f"{path.relative_to(ROOT)}:{line}: {code}" for path in _sources(*PACKAGE_DIRS)
             if path != ROOT / "sparse_mlir" / "knobs.py" for line, code in environment_reads(path)]
    assert not reads, "read these through a sparse_mlir.knobs accessor (at use time):\n" + "\n".join(reads)


def test_no_module_changes_the_environment_when_imported():
    changes = [f"{path.relative_to(ROOT)}:{line}: {code}" for path in _sources(*PACKAGE_DIRS, "benchmarks")
               if str(path.relative_to(ROOT)) not in DEVICE_SCRIPTS
               for line, code in environment_changes_at_import(path)]
    assert not changes, "set these in main() or in a child's environment:\n" + "\n".join(changes)


def test_the_checks_see_what_they_look_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nimport os as o\nfrom os import getenv\n"
                      "a = os.environ.get('X')\nb = o.environ['Y']\nc = os.getenv('Z')\n"
                      "env = {**os.environ, 'A': '1'}\nd = os.environ.copy()\ne = dict(os.environ)\n"
                      "os.environ.setdefault('K', '0')\no.environ['L'] = '1'\n"
                      "def main():\n    os.environ['M'] = '1'\n"
                      "if __name__ == '__main__':\n    os.environ['N'] = '1'\n"
                      "@decorate(os.environ.pop('P'))\ndef f(x=os.putenv('Q', '1')):\n    pass\n")
    assert sorted(line for line, _ in environment_reads(sample)) == [3, 4, 5, 6, 10, 11, 13, 15, 16, 17]
    assert sorted(line for line, _ in environment_changes_at_import(sample)) == [10, 11, 16, 17]


# -- the accessors ------------------------------------------------------------------------------------------------

def test_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSE_MLIR_DATA", str(tmp_path))
    assert knobs.data_dir() == tmp_path
    monkeypatch.delenv("SPARSE_MLIR_DATA")
    assert files.checkout_root() == ROOT  # the tests run from the source checkout
    assert knobs.data_dir() == ROOT.parent / "shared" / "data"
    monkeypatch.setattr(importlib.import_module("sparse_mlir.knobs"), "checkout_root", lambda: None)  # a wheel
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert knobs.data_dir() == tmp_path / "xdg" / "sparse_mlir"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert knobs.data_dir() == tmp_path / ".local" / "share" / "sparse_mlir"


def test_tool_settings(monkeypatch):
    for name in ("CC", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    assert knobs.c_compiler() is None and knobs.cuda_roots() == () and knobs.library_path() == ()
    assert knobs.kmp_blocktime() is None
    monkeypatch.setenv("CC", "")
    assert knobs.c_compiler() is None
    monkeypatch.setenv("CC", "clang")
    monkeypatch.setenv("CUDA_PATH", "/b")
    monkeypatch.setenv("CUDA_HOME", "/a")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/x{os.pathsep}{os.pathsep}/y")
    monkeypatch.setenv("KMP_BLOCKTIME", "0")
    assert knobs.c_compiler() == "clang" and knobs.cuda_roots() == (Path("/a"), Path("/b"))
    assert knobs.library_path() == (Path("/x"), Path("/y")) and knobs.kmp_blocktime() == "0"


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_c_compiler_follows_cc_at_use_time(monkeypatch, tmp_path):
    from sparse_mlir.lowering import toolchain

    fake = _executable(tmp_path / "my-cc")
    monkeypatch.setenv("CC", str(fake))
    assert toolchain.c_compiler() == str(fake)
    monkeypatch.delenv("CC")
    assert toolchain.c_compiler() != str(fake)


def test_the_cuda_toolkit_follows_cuda_home_at_use_time(monkeypatch, tmp_path):
    from sparse_mlir.lowering import cuda_toolkit

    monkeypatch.delenv("CUDA_PATH", raising=False)
    for name in ("one", "two"):
        ptxas = _executable(tmp_path / name / "bin" / "ptxas")
        bitcode = tmp_path / name / "nvvm" / "libdevice" / "libdevice.10.bc"
        bitcode.parent.mkdir(parents=True)
        bitcode.write_bytes(b"BC")
        monkeypatch.setenv("CUDA_HOME", str(tmp_path / name))
        assert cuda_toolkit.ptxas() == str(ptxas) and cuda_toolkit.libdevice() == str(bitcode)


@pytest.fixture
def fresh_openmp_search():
    from sparse_mlir.runtime import threads

    threads._find_openmp.cache_clear()
    yield threads
    threads._find_openmp.cache_clear()


def test_the_openmp_runtime_follows_its_settings_at_use_time(monkeypatch, tmp_path, fresh_openmp_search):
    threads = fresh_openmp_search
    monkeypatch.setattr(threads, "_NAMES", ("libsparse_mlir_test_omp.so",))  # found nowhere but here
    (tmp_path / "libsparse_mlir_test_omp.so").write_bytes(b"")
    monkeypatch.delenv("SPARSE_MLIR_PARALLEL", raising=False)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert threads.openmp_library() is None
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    assert threads.openmp_library() == (tmp_path / "libsparse_mlir_test_omp.so").resolve()
    monkeypatch.setenv("SPARSE_MLIR_PARALLEL", "0")
    assert threads.openmp_library() is None
    monkeypatch.setenv("SPARSE_MLIR_PARALLEL", "1")
    assert threads.openmp_library() == (tmp_path / "libsparse_mlir_test_omp.so").resolve()
    assert threads._find_openmp.cache_info().misses == 2  # searched once per LD_LIBRARY_PATH, not per call


# -- atomic writes ------------------------------------------------------------------------------------------------

def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_write_atomically(tmp_path):
    target = tmp_path / "f.json"
    files.write_atomically(target, "é{}")
    assert target.read_bytes() == "é{}".encode()
    files.write_atomically(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01" and not _leftovers(tmp_path)


def test_write_atomically_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        files.write_atomically(tmp_path / "private", "x")
        files.write_atomically(tmp_path / "shared", "x", mode=0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f"
    target.write_text("old")
    with pytest.raises(TypeError):
        files.write_atomically(target, 12345)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError), files.open_atomically(target) as f:
        f.write(b"half")
        raise RuntimeError("interrupted")
    with pytest.raises(RuntimeError), files.replace_atomically(target) as tmp:
        tmp.write_text("written by a tool that then failed")
        raise RuntimeError("the tool failed")
    assert target.read_text() == "old" and not _leftovers(tmp_path)


def test_a_symbolic_link_at_the_target_is_replaced_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep")
    (tmp_path / "link").symlink_to(elsewhere)
    files.write_atomically(tmp_path / "link", "new")
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "link").read_text() == "new"
    assert elsewhere.read_text() == "keep"


def test_replace_atomically_moves_what_the_tool_wrote(tmp_path):
    with files.replace_atomically(tmp_path / "lib.so") as tmp:
        assert tmp.parent == tmp_path and not tmp.exists()
        tmp.write_bytes(b"\x7fELF")
    assert (tmp_path / "lib.so").read_bytes() == b"\x7fELF" and not _leftovers(tmp_path)


def test_every_writer_uses_the_one_helper(tmp_path):
    import numpy as np

    import sparse_mlir as sm
    from sparse_mlir.compiler import cache
    from sparse_mlir.io.smt import save_tensor

    assert cache.write_atomically is files.write_atomically
    old = os.umask(0o022)
    try:
        save_tensor(sm.SparseTensor.from_dense(np.eye(3), "csr"), tmp_path / "t.smt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.smt").stat().st_mode) == 0o644  # as open(path, "wb") would make it
    assert not _leftovers(tmp_path)


# -- the benchmark ------------------------------------------------------------------------------------------------

def test_the_efficiency_gap_benchmark_changes_nothing_when_imported(monkeypatch):
    before = dict(os.environ)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run as a script: its siblings import
    spec = importlib.util.spec_from_file_location("efficiency_gap", ROOT / "benchmarks" / "efficiency_gap.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    assert dict(os.environ) == before
    pools = module.POOL_SETTINGS
    assert module.fresh_environment({**pools, "PATH": "/bin"}) is None
    fresh = module.fresh_environment({"KMP_BLOCKTIME": "7", "OPENBLAS_CORETYPE": "Haswell", "PATH": "/bin"})
    assert fresh == {**pools, "KMP_BLOCKTIME": "7", "PATH": "/bin"}  # what the user set stays
    assert module.fresh_environment(fresh) is None  # so the restart happens once


def test_the_benchmark_measures_how_far_apart_its_threads_run(monkeypatch):
    """``benchmarks/core_latency.py``: a cache line's round trip between the first two usable CPUs, which tells
    whether they share an L3 (recorded by the efficiency-gap benchmark before and after its workloads)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import core_latency

    ns = core_latency.round_trip_ns()
    if len(os.sched_getaffinity(0)) < 2:
        assert ns is None and core_latency.describe(ns) == "thread round trip: not measured"
        return
    assert ns is not None and 1 < ns < 1e6
    assert core_latency.describe(50.0).endswith("(one L3)")
    assert "two L3s" in core_latency.describe(350.0)
    monkeypatch.setattr(core_latency, "SOURCE", ROOT / "benchmarks" / "no_such_probe.c")
    assert core_latency.round_trip_ns() is None  # a probe that cannot be built is not fatal


def test_the_environment_is_read_as_os_environ_reads_it(monkeypatch):
    """``knobs`` reads the environment through ``os.environ``'s own dict (no KeyError for unset names): every
    change made through ``os.environ`` shows at once, and values decode as ``os.environ`` decodes them."""
    from sparse_mlir import knobs as module

    name = "SPARSE_MLIR_TEST_SETTING"
    monkeypatch.delenv(name, raising=False)
    assert module._env(name) is None and module._env(name, "d") == "d"
    for value in ("1", "", " 4, 2", "é\udcff"):
        monkeypatch.setenv(name, value)
        assert module._env(name) == os.environ.get(name) == value
    monkeypatch.delenv(name)
    assert module._env(name, "gone") == "gone"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("SPARSE_MLIR_NUM_THREADS", raising=False)
    assert knobs.num_threads() == 3
    monkeypatch.setattr(module, "_FAST", False)  # an interpreter without that dict: os.environ.get
    monkeypatch.setenv(name, "slow")
    assert module._env(name) == "slow" and module._env(name + "_UNSET", "x") == "x"
