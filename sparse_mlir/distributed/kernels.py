"""How a Dask worker gets the kernel it maps over its row blocks.

Two ways, chosen per matrix (``ship=``):

* ``"artifact"`` (default): the client compiles the kernel once and exports
  it (``sm.export``) for every distinct block shape; the exported files
  travel as bytes inside the task graph (an :class:`Artifact`, about 20 kB),
  and the worker writes them to a private folder and runs them with
  ``sm.load_kernel``.  The worker needs numpy and this package only: it
  never imports MLIR nor starts a compiler process, so workers may be
  installed without the MLIR wheels.  A shape-generic kernel (the
  hand-scheduled ones, ``kernel.shape_generic``) is exported once per index
  widths and serves every block; a sparsifier kernel fixes the sparse
  operand's shape, hence one export per block shape and index widths there
  (dense sizes stay free either way).
* ``"compile"``: the worker calls ``sm.compile`` itself.  With a shared
  ``SPARSE_MLIR_CACHE_DIR`` the first worker to need a specialization
  compiles it and every other process loads it from the disk cache in a
  few milliseconds.

Nothing here imports MLIR or CuPy at module import.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparse_mlir.api import compile as compile_kernel
from sparse_mlir.errors import OperandError
from sparse_mlir.export.artifacts import export
from sparse_mlir.formats import Format
from sparse_mlir.runtime.artifact import load_kernel

__all__ = ["Artifact", "KernelPlan", "BlockKey", "SHIP_MODES", "block_key", "make_plan"]

SHIP_MODES = ("artifact", "compile")
# (block shape, pos width, crd width): what a CPU export of the sharded operand is specialized for; the shape is
# None for a shape-generic export, which serves blocks of every shape with those widths
BlockKey = tuple[tuple[int, ...] | None, int, int]


def block_key(block: Any) -> BlockKey:
    """The export a block needs: its shape and index widths (a 64-bit block cannot run a 32-bit export)."""
    return tuple(int(s) for s in block.shape), int(block.format.pos_width), int(block.format.crd_width)


def _any_shape(key: BlockKey) -> BlockKey:
    """The key of the shape-generic export a block of ``key`` runs."""
    return None, key[1], key[2]


@dataclass(frozen=True)
class Artifact:
    """An exported CPU kernel as bytes: every file ``load_kernel`` checks, plus the manifest.

    Shipped inside the task graph; ``digest`` (the manifest's
    ``manifest_sha256``) names it, so tokenizing it does not hash the bytes
    and a worker loads each artifact once.
    """

    name: str
    digest: str
    files: tuple[tuple[str, bytes], ...] = field(repr=False)

    def __dask_tokenize__(self) -> tuple[str, str]:
        return ("sparse_mlir.Artifact", self.digest)

    @classmethod
    def from_folder(cls, folder: Path, name: str) -> Artifact:
        """Read the files of ``sm.export(kernel, folder, name, ...)`` (the manifest and what it checksums)."""
        manifest_path = folder / f"{name}.json"
        manifest = json.loads(manifest_path.read_text())
        names = [manifest_path.name, *manifest["sha256"]]
        return cls(name, manifest["manifest_sha256"], tuple((n, (folder / n).read_bytes()) for n in names))

    def load(self) -> Any:
        """The ``LoadedKernel`` of this artifact in this process (written to a private folder once)."""
        with _loaded_lock:
            kernel = _loaded.get(self.digest)
            if kernel is None:
                kernel = _loaded[self.digest] = _load_artifact(self)
            return kernel


_loaded: dict[str, Any] = {}
_loaded_lock = threading.Lock()
_folder: Path | None = None


def _artifact_root() -> Path:
    """This process's folder for shipped kernels (private, removed at exit)."""
    global _folder
    if _folder is None:
        _folder = Path(tempfile.mkdtemp(prefix="sparse_mlir_dask_"))
        atexit.register(shutil.rmtree, _folder, True)
    return _folder


def _load_artifact(artifact: Artifact) -> Any:
    """Write the files and load them: ``load_kernel`` re-checks every checksum and the embedded digest."""
    folder = _artifact_root() / artifact.digest
    folder.mkdir(exist_ok=True)
    for name, data in artifact.files:
        (folder / name).write_bytes(data)
    return load_kernel(folder / f"{artifact.name}.json")


@dataclass(frozen=True)
class KernelPlan:
    """What a worker needs to run one kernel on its blocks: the kernel's source, and its exports if shipped.

    ``operand`` names the sharded sparse operand; ``artifacts`` maps each
    block key to its export (``None``: the worker compiles).
    """

    expression: str
    operand: str
    formats: tuple[tuple[str, Format], ...]
    dtype: str
    target: str = "cpu"
    artifacts: tuple[tuple[BlockKey, Artifact], ...] | None = None

    def __dask_tokenize__(self) -> tuple:
        arts = None if self.artifacts is None else tuple((k, a.digest) for k, a in self.artifacts)
        return ("sparse_mlir.KernelPlan", self.expression, self.operand, self.formats, self.dtype, self.target, arts)

    def kernel_for(self, block: Any) -> Any:
        """The callable for ``block`` in this worker: its shipped export, or the compiled kernel."""
        if self.artifacts is None:
            return compile_kernel(self.expression, formats=dict(self.formats), dtype=self.dtype, target=self.target)
        key = block_key(block)
        for known, artifact in self.artifacts:
            if known == key or known == _any_shape(key):
                return artifact.load()
        raise OperandError(f"no exported kernel for a block of shape {key[0]} with {key[1]}/{key[2]}-bit indices "
                           f"(exports: {[k for k, _ in self.artifacts]}); the matrix's layout changed after planning")


_exports: dict[tuple, Artifact] = {}
_exports_lock = threading.Lock()
_export_root: Path | None = None


def _export(expression: str, operand: str, formats: dict[str, Format], dtype: str, key: BlockKey) -> Artifact:
    """Compile (or reuse) the kernel on the client and export it for one block key; cached per process."""
    global _export_root
    shape, pos_width, crd_width = key
    fmts = {**formats, operand: formats[operand].with_widths(pos_width, crd_width)}
    cache_key = (expression, operand, tuple(sorted((n, repr(f)) for n, f in fmts.items())), dtype, key)
    with _exports_lock:
        artifact = _exports.get(cache_key)
        if artifact is not None:
            return artifact
        if _export_root is None:
            _export_root = Path(tempfile.mkdtemp(prefix="sparse_mlir_dask_exports_"))
            atexit.register(shutil.rmtree, _export_root, True)
        kernel = compile_kernel(expression, formats=fmts, dtype=dtype)
        # a unique C name per export: two libraries of one name must never meet in a worker's dynamic loader
        name = "k_" + hashlib.sha256(repr(cache_key).encode()).hexdigest()[:16]
        folder = _export_root / name
        export(kernel, folder, name, shapes={} if shape is None else {operand: shape})
        artifact = _exports[cache_key] = Artifact.from_folder(folder, name)
        return artifact


def make_plan(expression: str, operand: str, formats: dict[str, Format], dtype: str, keys: set[BlockKey], *,
              ship: str, target: str = "cpu") -> KernelPlan:
    """A plan for ``keys`` (the distinct block keys of a matrix): exports them now when ``ship == "artifact"``.

    GPU kernels (``target="cuda"``) are specialized for every operand's
    shape, so they are compiled on the workers (``ship="compile"``).
    """
    if ship not in SHIP_MODES:
        raise OperandError(f"ship must be one of {SHIP_MODES}, got {ship!r}")
    frozen = tuple(sorted(formats.items()))
    if ship == "compile" or target != "cpu":
        return KernelPlan(expression, operand, frozen, dtype, target)
    exports = {_any_shape(k) if _shape_generic(expression, operand, formats, dtype, k) else k for k in keys}
    artifacts = tuple((k, _export(expression, operand, formats, dtype, k))
                      for k in sorted(exports, key=lambda k: (k[0] is not None, k)))
    return KernelPlan(expression, operand, frozen, dtype, target, artifacts)


def _shape_generic(expression: str, operand: str, formats: dict[str, Format], dtype: str, key: BlockKey) -> bool:
    """Whether the kernel for blocks of ``key``'s index widths takes every block shape (asked without a build)."""
    fmts = {**formats, operand: formats[operand].with_widths(key[1], key[2])}
    return bool(compile_kernel(expression, formats=fmts, dtype=dtype).shape_generic)
