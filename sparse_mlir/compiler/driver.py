"""THE build: (spec, formats, shapes, target, options) -> a cached ``Artifact`` with its IR and signature.

Every kernel the package runs or exports comes from ``build``: JIT kernels on
every target, ``schedule="auto"`` variants, CPU and GPU exports.  It owns the
content-hashed cache key (``cache_key``: spec, formats with index widths,
static shapes, options, entry name, the package's sources and the tool
versions), the disk cache (``cache``), the hop to the compiler process
(``process``, which runs ``build.JOBS``), and the one fallback: a CPU kernel
whose sparse co-iteration the sparsifier refuses is rebuilt on dense copies of
its sparse inputs, when they fit ``knobs.dense_budget()``.  A compiler process
that was killed or timed out is not a refusal and raises, so nothing densified
is cached for a problem that had nothing to do with the kernel.

Nothing here imports MLIR: a process that only runs cached kernels never loads it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sparse_mlir._version import __version__
from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.abi.gpu_program import CHIPS, GpuProgram
from sparse_mlir.compiler import cache, process
from sparse_mlir.compiler.emitters import shape_generic_cuda_emitter, shape_generic_emitter
from sparse_mlir.compiler.extension import c_library, python_extension
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.errors import DeviceError, LoweringError
from sparse_mlir.formats import Format
from sparse_mlir.knobs import knobs
from sparse_mlir.lowering.toolchain import host_cpu_key, tool_versions

__all__ = ["TARGETS", "EMITTERS", "BuildOptions", "Artifact", "build", "kernel_source", "cache_key", "source_hash", "tool_versions",
           "with_operand_formats", "densified_bytes", "stats", "shape_generic", "generic_shapes",
           "c_library", "python_extension"]

TARGETS = ("cpu", "cuda")
EMITTERS = ("auto", "sparsifier")  # "sparsifier": skip the hand-scheduled emitters (to compare them)
# per process: artifacts compiled, compiled on dense copies, and handed out (compiled or read from the disk cache)
stats = {"compiled": 0, "loaded": 0, "densified": 0}
# MLIR stages whose failure is MLIR (building the module, the sparsifier or its lowering) refusing the kernel,
# not a broken toolchain
_REFUSING_STAGES = frozenset({"input", "sparsified", "mapped", "llvm"})
_SUFFIX = {("cpu", False): ".so", ("cpu", True): ".o", ("cuda", False): ".gpu.json"}
Shapes = dict[str, tuple[int | None, ...]]


@dataclass(frozen=True)
class BuildOptions:
    """Everything besides the spec, formats and shapes that decides the code: all of it is in the cache key.

    ``cpu``: the ``-mcpu`` of CPU code; ``openmp``: the OpenMP runtime of
    threaded CPU code (``None``: serial); ``object_file``: an object to embed
    instead of a shared library; ``chips``, ``emitter``, ``deterministic``:
    the GPU program's chips, emitter choice and whether atomics are allowed.
    """

    target: str = "cpu"
    cpu: str = "native"
    openmp: Path | None = None
    object_file: bool = False
    chips: tuple[str, ...] = CHIPS
    emitter: str = "auto"
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise DeviceError(f"unknown target {self.target!r}; targets: {', '.join(TARGETS)}")
        if self.emitter not in EMITTERS:
            raise DeviceError(f"emitter must be one of {', '.join(EMITTERS)}, got {self.emitter!r}")
        if self.target == "cuda" and self.object_file:
            raise DeviceError("target 'cuda' builds GPU programs (PTX per chip), not object files")

    def key(self) -> str:
        if self.target == "cuda":
            return f"cuda;{self.chips};{self.emitter};{self.deterministic}"
        host = f"={host_cpu_key()}" if self.cpu == "native" else ""  # native code is this host's CPU's
        return f"cpu;{self.cpu}{host};{self.openmp};{'object' if self.object_file else 'library'}"


@dataclass(frozen=True)
class Artifact:
    """One compiled specialization in the cache: its file, how it is called, and (for a GPU) its launches."""

    key: str
    path: Path
    signature: Signature
    options: BuildOptions
    program: GpuProgram | None = field(default=None, repr=False)
    compiled: bool = False  # built by this call (not read from the disk cache)
    densified: bool = False  # built on dense copies of its sparse inputs

    @property
    def ir(self) -> dict[str, str]:
        """The IR of every stage (``build.STAGES``), read from the cache on demand."""
        return stored_ir(self.key)


def with_operand_formats(spec: KernelSpec, formats: dict[str, Format]) -> KernelSpec:
    """The spec with the operands' actual formats (index widths may have been widened)."""
    return replace(spec, formats={**spec.formats, **formats})


def build(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, options: BuildOptions,
          entry: str = "sparse_mlir_kernel") -> Artifact:
    """The artifact of one specialization: from the disk cache, else compiled in the compiler process.

    ``formats`` are the sparse operands' actual formats (their index widths),
    ``shapes`` every operand's sizes (``None``: a run-time size), ``entry``
    the exported function's name.  One compile per key across threads and
    processes (the cache entry's lock).
    """
    special = with_operand_formats(spec, formats)
    sig = Signature.from_spec(special, formats, shapes, entry)
    key = cache_key(spec, formats, shapes, options, entry)
    outcome: dict[str, bool] = {}
    with _key_lock(key):
        path, _ = cache.load_or_build(key, {"expression": spec.expression, "signature": sig.to_json()},
                                      lambda path: _compile(path, special, shapes, sig, options, outcome),
                                      _SUFFIX[options.target, options.object_file])
    program = GpuProgram.from_json(json.loads(path.read_text())) if options.target == "cuda" else None
    stats["loaded"] += 1
    return Artifact(key, path, sig, options, program, outcome.get("compiled", False), outcome.get("densified", False))


def shape_generic(spec: KernelSpec, formats: dict[str, Format], options: BuildOptions) -> bool:
    """Whether one build of ``spec`` with these formats takes every size at run time (``generic_shapes``).

    True for the hand-scheduled CPU kernels (``emitters.SHAPE_GENERIC_CPU``)
    and the hand-scheduled CSR SpMV on CUDA (``emitters.SHAPE_GENERIC_CUDA``,
    unless ``emitter="sparsifier"``); sparsifier kernels and the other GPU
    kernels are built once per sparse shape (GPU: once per operand shape).
    """
    if options.target == "cuda":
        return options.emitter == "auto" and \
            shape_generic_cuda_emitter(spec, formats, options.deterministic) is not None
    return shape_generic_emitter(spec, formats) is not None


def generic_shapes(spec: KernelSpec) -> Shapes:
    """Every operand's sizes left to run time: the ``shapes`` of a shape-generic build."""
    return {name: (None,) * spec.ranks[name] for name in (*spec.inputs, spec.output)}


def kernel_source(spec: KernelSpec) -> str:
    """The generic module before lowering, every size dynamic (``?``): what any specialization starts from.

    Kept per spec for the process: it is a compiler-process round trip, and every kernel kind shows it.
    """
    key = spec.key()
    text = _sources.get(key)
    if text is None:
        text = _sources[key] = process.call("kernel_source", spec)
    return text


_sources: dict[tuple, str] = {}


def cache_key(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes, options: BuildOptions,
              entry: str = "sparse_mlir_kernel") -> str:
    """The content hash naming a compiled specialization.

    Every format is spelled with its index widths (a format's ``repr`` leaves them out): the declared ones
    of the spec, a sparse output's included, and the operands' actual ones in ``formats``.
    """
    declared = sorted((n, repr(f), f.pos_width, f.crd_width) for n, f in spec.formats.items())
    text = repr((spec.key(), declared, sorted((n, repr(f), f.pos_width, f.crd_width) for n, f in formats.items()),
                 sorted(shapes.items()), options.key(), entry, source_hash(), tool_versions()))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def source_hash() -> str:
    """Hash of the package's own sources: a change in codegen invalidates cached kernels.

    Each file is hashed with its name as installed (``sparse_mlir/dialects/linalg.py``) and
    its length, so moving text between files changes the hash, and an editable install and a
    wheel of the same sources agree.
    """
    roots = {"sparse_mlir": Path(__file__).resolve().parents[1]}
    for sub in ("sparse_mlir.dialects", "sparse_mlir.lowering"):  # may live outside the package folder
        found = importlib.util.find_spec(sub)
        for location in (found.submodule_search_locations or []) if found else []:
            roots[sub.replace(".", "/")] = Path(location).resolve()
    files: dict[str, Path] = {}
    for name, root in roots.items():
        for path in root.rglob("*.py"):
            files.setdefault(f"{name}/{path.relative_to(root).as_posix()}", path)
    digest = hashlib.sha256(__version__.encode())
    for name in sorted(files):
        data = files[name].read_bytes()
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def stored_ir(key: str) -> dict[str, str]:
    """The IR of a cache entry; a missing, unreadable or malformed IR file is a ``CacheError`` naming it."""
    try:
        ir = cache.load_ir(key)
    except (OSError, ValueError) as exc:
        raise cache.CacheError(f"{cache.ir_path(key)}: the kernel's IR cannot be read ({exc})") from exc
    if not isinstance(ir, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ir.items()):
        raise cache.CacheError(f"{cache.ir_path(key)}: the kernel's IR file is not a mapping of stage to text")
    return ir


def densified_bytes(spec: KernelSpec, shapes: Shapes) -> int:
    """Bytes of the dense copies ``spec.densified()`` makes of the sparse inputs (their shapes are static)."""
    return sum(math.prod(shapes[n]) for n in spec.inputs if spec.is_sparse(n)) * spec.dtype.itemsize


def refused(error: LoweringError) -> bool:
    """Whether ``error`` is the sparsifier refusing the kernel (so dense copies may compile), not a compiler
    process stopped from outside (killed, out of memory, timed out) or a broken toolchain."""
    if isinstance(error, process.CompilerDied):
        return error.crashed
    return error.stage in _REFUSING_STAGES


def _compile(path: Path, spec: KernelSpec, shapes: Shapes, sig: Signature, options: BuildOptions,
             outcome: dict[str, bool]) -> dict[str, str]:
    """Write the artifact at ``path`` in the compiler process; return the IR of each stage."""
    if options.target == "cuda":
        stages = process.call("build_cuda", spec, shapes, sig, path, options.chips, options.emitter,
                              options.deterministic)
    else:
        try:
            stages = process.call("build_cpu", spec, shapes, sig, path, options.cpu, options.openmp,
                                  options.object_file)
        except LoweringError as exc:
            generic = any(None in shapes[n] for n in spec.inputs if spec.is_sparse(n))  # dense copies need sizes
            if spec.sparse_output or not spec.formats or generic or not refused(exc):
                raise
            need, budget = densified_bytes(spec, shapes), knobs.dense_budget()
            if need > budget:
                raise LoweringError(f"the sparsifier refused this kernel ({exc.message}), and computing it on dense "
                                    f"copies of its sparse inputs needs {need:,} bytes, over the dense budget of "
                                    f"{budget:,} (SPARSE_MLIR_DENSE_BUDGET)", stage=exc.stage, target=exc.target,
                                    diagnostics=exc.diagnostics) from exc
            # the sparsifier failed on this co-iteration: copy the sparse inputs to dense and compute densely
            stages = process.call("build_cpu", spec.densified(), shapes, sig, path, options.cpu, options.openmp,
                                  options.object_file)
            stats["densified"] += 1
            outcome["densified"] = True
    stats["compiled"] += 1
    outcome["compiled"] = True
    return stages


_locks_guard = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}


@contextlib.contextmanager
def _key_lock(key: str) -> Any:
    """One compile per key among this process's threads (the cache's file lock serializes processes)."""
    with _locks_guard:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        yield


def _after_fork_in_child() -> None:
    """A fork inherits these locks in whatever state another thread held them: start free in the child."""
    global _locks_guard, _key_locks
    _locks_guard = threading.Lock()
    _key_locks = {}


os.register_at_fork(after_in_child=_after_fork_in_child)
