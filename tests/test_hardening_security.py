"""Issue 14, items 1-3 and 10: manifests cannot load foreign code, the cache is private, ``cache clear`` is scoped.

Each test reproduces an attack or a clumsy edit that the library used to
accept: a manifest naming a library outside its folder (whose constructor then
ran in the caller), malformed manifest fields (``KeyError``/``TypeError``), a
manifest whose signature disagrees with its library (out-of-bounds reads), a
cache folder other users can write to, and ``cache clear`` deleting whatever
``SPARSE_MLIR_CACHE_DIR`` names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

import sparse_mlir as sm
from sparse_mlir.errors import FormatError, SparseMLIRError
from sparse_mlir.compiler import cache

SPMV = "y[i] = A[i,j] * x[j]"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cpu_export(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cpu_export")
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float64")
    return sm.export(kernel, folder, "spmv", shapes={"A": (8, 6)})


@pytest.fixture(scope="module")
def cpu_export_f32(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cpu_export_f32")
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float32")
    return sm.export(kernel, folder, "spmv", shapes={"A": (8, 6)})


@pytest.fixture(scope="module")
def gpu_export(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gpu_export")
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float32", target="cuda")
    return sm.export(kernel, folder, "spmv", shapes={"A": (64, 32), "x": (32,)})


def copy_export(paths: dict[str, Path], folder: Path) -> Path:
    """A copy of an export's folder (every file of it); returns the copied manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in paths["manifest"].parent.iterdir():
        if file.is_file():
            shutil.copy(file, folder / file.name)
    return folder / paths["manifest"].name


def edit(manifest: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``change`` to the manifest's JSON; a list it returns replaces the whole manifest."""
    data = json.loads(manifest.read_text())
    result = change(data)
    manifest.write_text(json.dumps(result if isinstance(result, list) else data))


def evil_library(folder: Path, witness: Path) -> Path:
    """A shared library whose constructor creates ``witness``: proof that it was loaded."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "evil.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) {\n'
                      f'  FILE* f = fopen("{witness}", "w"); if (f) fclose(f);\n}}\nint spmv(void) {{ return 0; }}\n')
    lib = folder / "libevil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    return lib


# -- item 1: only checksummed files inside the artifact folder are loaded ----------------------------------------

@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink", "unlisted"])
def test_a_library_outside_the_folder_or_unlisted_is_never_loaded(cpu_export, tmp_path, where):
    manifest = copy_export(cpu_export, tmp_path / "artifact")
    witness = tmp_path / "constructor-ran"
    evil = evil_library(tmp_path / "outside", witness)
    if where == "absolute":
        name = str(evil)
    elif where == "dotdot":
        name = "../outside/libevil.so"
    elif where == "symlink":
        name = "libsneaky.so"
        (manifest.parent / name).symlink_to(evil)
    else:
        name = "libevil.so"
        shutil.copy(evil, manifest.parent / name)

    def point_at_evil(data: dict[str, Any]) -> None:
        data["library"] = name
        if where != "unlisted":
            data["sha256"][name] = sha256(evil)
    edit(manifest, point_at_evil)
    with pytest.raises(FormatError, match="artifact folder|no sha256"):
        sm.load_kernel(manifest)
    assert not witness.exists()


@pytest.mark.parametrize("change", [
    lambda m: m.__delitem__("sha256"),
    lambda m: m.update(sha256=None),
    lambda m: m.update(sha256=["libspmv.so"]),
    lambda m: m.__delitem__("library"),
    lambda m: m.update(library=None),
    lambda m: m.update(library=5),
    lambda m: m.__delitem__("signature"),
    lambda m: m.update(signature=None),
    lambda m: m.update(signature={"name": "spmv"}),
    lambda m: [m],
], ids=["sha256 missing", "sha256 null", "sha256 a list", "library missing", "library null", "library a number",
        "signature missing", "signature null", "signature without operands", "manifest a list"])
def test_malformed_manifest_fields_raise_format_error(cpu_export, tmp_path, change):
    manifest = copy_export(cpu_export, tmp_path)
    edit(manifest, change)
    with pytest.raises(FormatError):
        sm.load_kernel(manifest)


def test_a_checksummed_file_outside_the_folder_is_not_read(cpu_export, tmp_path):
    # (a listed /dev/zero would be read forever: names are checked before anything is read)
    manifest = copy_export(cpu_export, tmp_path / "artifact")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the manifest's business")
    edit(manifest, lambda m: m["sha256"].update({str(secret): "0" * 64}))
    with pytest.raises(FormatError, match="artifact folder"):
        sm.load_kernel(manifest)


@pytest.mark.parametrize("where", ["absolute", "dotdot", "unlisted"])
def test_gpu_code_files_outside_the_folder_or_unlisted_are_refused(gpu_export, tmp_path, where):
    manifest = copy_export(gpu_export, tmp_path / "artifact")
    ptx = manifest.parent / json.loads(manifest.read_text())["code"]["sm_90"]
    outside = tmp_path / "outside" / "other.ptx"
    outside.parent.mkdir()
    shutil.copy(ptx, outside)
    name = {"absolute": str(outside), "dotdot": "../outside/other.ptx", "unlisted": "copy.ptx"}[where]
    if where == "unlisted":
        shutil.copy(ptx, manifest.parent / name)

    def point_outside(data: dict[str, Any]) -> None:
        data["code"]["sm_90"] = name
        if where != "unlisted":
            data["sha256"][name] = sha256(outside)
    edit(manifest, point_outside)
    with pytest.raises(FormatError, match="artifact folder|no sha256"):
        sm.load_kernel(manifest)


def test_gpu_manifest_with_malformed_code_raises_format_error(gpu_export, tmp_path):
    manifest = copy_export(gpu_export, tmp_path)
    edit(manifest, lambda m: m.update(code=None))
    with pytest.raises(FormatError, match="'code'"):
        sm.load_kernel(manifest)


# -- item 3: a manifest that disagrees with its code is refused before any call -----------------------------------

@pytest.mark.parametrize("field,value", [("dtype", "float32"), ("shape", [800, 600])])
def test_a_manifest_whose_signature_was_edited_is_refused(cpu_export, tmp_path, field, value):
    manifest = copy_export(cpu_export, tmp_path)

    def tamper(data: dict[str, Any]) -> None:
        for op in data["signature"]["operands"]:
            if field == "dtype" or op["format"] is not None:
                op[field] = value
        data.pop("manifest_sha256", None)  # as a careful forger would: only the library can tell
    edit(manifest, tamper)
    with pytest.raises(FormatError, match="does not match spmv.json|does not match libspmv.so|does not match lib"):
        sm.load_kernel(manifest)


def test_a_manifest_paired_with_another_exports_library_is_refused(cpu_export, cpu_export_f32, tmp_path):
    manifest = copy_export(cpu_export, tmp_path)  # float64 signature
    shutil.copy(cpu_export_f32["library"], manifest.parent / "libspmv.so")  # float32 code: reads half the bytes
    edit(manifest, lambda m: m["sha256"].update({"libspmv.so": sha256(manifest.parent / "libspmv.so")}))
    with pytest.raises(FormatError, match="does not match"):
        sm.load_kernel(manifest)


def test_a_library_without_the_manifest_digest_is_refused(cpu_export, tmp_path):
    from sparse_mlir.runtime.artifact import DIGEST_MARK

    manifest = copy_export(cpu_export, tmp_path)
    lib = manifest.parent / "libspmv.so"
    lib.write_bytes(lib.read_bytes().replace(DIGEST_MARK, b"x" * len(DIGEST_MARK)))
    edit(manifest, lambda m: m["sha256"].update({"libspmv.so": sha256(lib)}))
    with pytest.raises(FormatError, match="carries no manifest digest"):
        sm.load_kernel(manifest)


def test_the_manifest_records_its_digest_and_the_library_embeds_it(cpu_export):
    from sparse_mlir.runtime.artifact import DIGEST_MARK, manifest_digest

    data = json.loads(cpu_export["manifest"].read_text())
    assert data["manifest_sha256"] == manifest_digest(data)
    assert cpu_export["library"].read_bytes().count(DIGEST_MARK + data["manifest_sha256"].encode()) == 1


@pytest.mark.parametrize("tamper", ["launch grid", "dtype"])
def test_a_gpu_manifest_whose_launches_or_signature_were_edited_is_refused(gpu_export, tmp_path, tamper):
    manifest = copy_export(gpu_export, tmp_path)

    def change(data: dict[str, Any]) -> None:
        if tamper == "launch grid":
            data["program"]["launches"][0]["block"] = [1024, 1, 1]
        else:
            for op in data["signature"]["operands"]:
                op["dtype"] = "float64"
        data.pop("manifest_sha256", None)
    edit(manifest, change)
    with pytest.raises(FormatError, match="does not match"):
        sm.load_kernel(manifest)


# -- item 2: the cache uses only folders nobody else can write to -------------------------------------------------

def use_cache(monkeypatch, root: Path) -> None:
    monkeypatch.setenv("SPARSE_MLIR_CACHE_DIR", str(root))


def assert_private(path: Path) -> None:
    info = path.stat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700, (path, oct(info.st_mode))


def test_a_world_writable_cache_root_is_replaced_by_a_private_folder(monkeypatch, tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    use_cache(monkeypatch, root)
    with pytest.warns(cache.CacheWarning, match="writable by others"):
        used = cache.cache_dir()
    assert used != root and not used.is_relative_to(root)
    assert_private(used)
    lib, meta = cache.entry_paths("ab" + "0" * 62)
    assert not lib.is_relative_to(root) and not any(root.iterdir())


def test_a_group_writable_cache_root_is_not_used(monkeypatch, tmp_path):
    root = tmp_path / "group"
    root.mkdir()
    root.chmod(0o770)
    use_cache(monkeypatch, root)
    with pytest.warns(cache.CacheWarning, match="writable by its group"):
        assert cache.cache_dir() != root


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_root_owned_by_another_user_is_not_used(monkeypatch, tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    use_cache(monkeypatch, root)
    with pytest.warns(cache.CacheWarning, match="owned by user 12345"):
        assert cache.cache_dir() != root


def test_a_cache_root_under_a_world_writable_parent_is_not_used(monkeypatch, tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)  # without the sticky bit anyone may rename the cache away and put theirs in its place
    root = parent / "cache"
    root.mkdir(mode=0o700)
    use_cache(monkeypatch, root)
    with pytest.warns(cache.CacheWarning, match="sticky"):
        assert cache.cache_dir() != root


def test_an_entry_folder_others_can_write_to_is_not_used(monkeypatch, tmp_path):
    root = tmp_path / "c"
    use_cache(monkeypatch, root)
    cache.cache_dir()
    key = "cd" + "1" * 62
    planted = root / "cd"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.warns(cache.CacheWarning, match="writable by others"):
        lib, _ = cache.entry_paths(key)
    assert not lib.is_relative_to(root)
    assert_private(lib.parent)


def test_an_entry_folder_that_is_a_symlink_is_not_used(monkeypatch, tmp_path):
    root = tmp_path / "c"
    use_cache(monkeypatch, root)
    cache.cache_dir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / "ef").symlink_to(elsewhere)
    with pytest.warns(cache.CacheWarning, match="symbolic link"):
        lib, _ = cache.entry_paths("ef" + "2" * 62)
    assert not lib.resolve().is_relative_to(elsewhere)


def test_new_cache_folders_and_files_are_private_whatever_the_umask(monkeypatch, tmp_path):
    root = tmp_path / "c"
    use_cache(monkeypatch, root)
    old = os.umask(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", cache.CacheWarning)
            lib, meta = cache.entry_paths("12" + "3" * 62)
            cache.write_atomically(meta, "{}")
    finally:
        os.umask(old)
    assert_private(root)
    assert_private(lib.parent)
    assert stat.S_IMODE(meta.stat().st_mode) == 0o600


def test_a_readable_entry_folder_of_ours_is_tightened(monkeypatch, tmp_path):
    root = tmp_path / "c"
    use_cache(monkeypatch, root)
    cache.cache_dir()
    (root / "34").mkdir(mode=0o755)
    (root / "34").chmod(0o755)
    lib, _ = cache.entry_paths("34" + "5" * 62)
    assert lib.parent == root / "34"
    assert_private(root / "34")


def test_a_kernel_compiled_with_a_shared_cache_never_writes_there(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    script = ("import numpy as np, sparse_mlir as sm\n"
              f"k = sm.compile({SPMV!r}, formats={{'A': 'csr'}})\n"
              "print(k(A=sm.SparseTensor.from_dense(np.eye(3), 'csr'), x=np.ones(3)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "SPARSE_MLIR_CACHE_DIR": str(root)})
    assert done.returncode == 0, done.stderr
    assert "[1. 1. 1.]" in done.stdout and "CacheWarning" in done.stderr
    assert not any(root.iterdir())


# -- item 10: cache clear deletes the cache's own entries only ----------------------------------------------------

def clear_cli(root: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("sparse-mlir") or str(Path(sys.executable).parent / "sparse-mlir")
    return subprocess.run([exe, "cache", "clear"], capture_output=True, text=True,
                          env={**os.environ, "SPARSE_MLIR_CACHE_DIR": str(root)})


def test_cache_clear_keeps_files_that_are_not_cache_entries(monkeypatch, tmp_path):
    root = tmp_path / "mine"
    use_cache(monkeypatch, root)
    key = "56" + "7" * 62
    lib, meta = cache.entry_paths(key)
    lib.write_bytes(b"\x7fELF")
    cache.write_atomically(meta, "{}")
    (lib.parent / f"{key}.lock").touch()
    (root / "notes.txt").write_text("mine")
    (root / "56" / "photo.jpg").write_bytes(b"jpeg")  # a stranger in an entry folder
    (root / "project").mkdir()
    (root / "project" / "main.c").write_text("int main;")
    done = clear_cli(root)
    assert done.returncode == 0, done.stderr
    assert not lib.exists() and not meta.exists() and not (lib.parent / f"{key}.lock").exists()
    assert (root / "notes.txt").read_text() == "mine"
    assert (root / "56" / "photo.jpg").exists() and (root / "project" / "main.c").exists()
    assert "kept 3" in done.stdout


def test_cache_clear_refuses_a_folder_that_is_not_a_cache(tmp_path):
    root = tmp_path / "home"
    (root / "ab").mkdir(parents=True)
    (root / "ab" / ("ab" + "0" * 62 + ".so")).write_bytes(b"looks like an entry")
    (root / "thesis.tex").write_text("years of work")
    done = clear_cli(root)
    assert done.returncode != 0 and "not a kernel cache" in done.stderr
    assert (root / "thesis.tex").exists() and (root / "ab" / ("ab" + "0" * 62 + ".so")).exists()


def test_cache_clear_errors_are_sparse_mlir_errors(monkeypatch, tmp_path):
    root = tmp_path / "plain"
    root.mkdir()
    use_cache(monkeypatch, root)
    with pytest.raises(SparseMLIRError, match="not a kernel cache"):
        cache.clear()


def test_a_deeply_nested_manifest_raises_format_error(tmp_path):
    manifest = tmp_path / "deep.json"
    manifest.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FormatError, match="no readable kernel manifest"):
        sm.load_kernel(manifest)


def test_a_damaged_ir_file_in_the_cache_raises_cache_error(monkeypatch, tmp_path):
    use_cache(monkeypatch, tmp_path / "c")
    key = "9a" + "b" * 62
    cache.ir_path(key).write_text("{ truncated")
    with pytest.raises(cache.CacheError, match="unreadable"):
        cache.load_ir(key)
