"""``Kernel``: the callable a ``compile()`` returns.

A call checks and converts its operands, works out every index's size,
picks (or compiles, once per process and once per disk cache) the
specialization for the sparse operands' shapes and index widths, and runs its
native entry point.

A compile that the sparsifier refuses (an error from its passes, or a crash
inside them) is retried on dense copies of the sparse inputs, but only when
those copies fit ``dense_budget()``; a compiler process that was killed or
timed out is not a refusal and raises, so nothing densified is cached for
a problem that had nothing to do with the kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..dsl.plan import KernelSpec
from ..errors import LoweringError, OperandError, ShapeError
from ..formats import Format
from ..knobs import knobs
from ..signature import Signature
from . import cache
from .library import NativeFunction
from .operands import check_extents, dense_output, prepare
from .calls import kernel_call

__all__ = ["Kernel", "Specialization", "BuildOptions", "ENTRY_NAME", "cache_key", "dense_budget"]

ENTRY_NAME = "sparse_mlir_kernel"
_compile_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}
# loaded libraries by cache key, least recently used first, shared by every Kernel of the process
_loaded: OrderedDict[str, Specialization] = OrderedDict()
# per process: native compiles, libraries loaded (compiled or cached), compiles that fell back to densified inputs
stats = {"compiled": 0, "loaded": 0, "densified": 0}
DENSE_BUDGET_FRACTION = 0.25  # of the memory available now: a dense copy must leave room for everything else
# MLIR stages whose failure is MLIR (building the module, the sparsifier or its lowering) refusing the kernel,
# not a broken toolchain
_REFUSING_STAGES = frozenset({"input", "sparsified", "llvm"})


def _after_fork_in_child() -> None:
    """A fork inherits these locks in whatever state another thread held them: start free in the child."""
    global _compile_lock, _key_locks
    _compile_lock = threading.Lock()
    _key_locks = {}


os.register_at_fork(after_in_child=_after_fork_in_child)


def dense_budget() -> int:
    """Bytes a dense copy made by this package may take.

    ``SPARSE_MLIR_DENSE_BUDGET`` (bytes), else ``DENSE_BUDGET_FRACTION`` of
    the memory available now: the kernel's ``MemAvailable``, lowered to
    what the cgroup's limit leaves.  Dense copies that do not fit are never
    planned: ``schedule="auto"`` leaves out its dense candidate and a
    refused compile is not retried densified.
    """
    text = os.environ.get("SPARSE_MLIR_DENSE_BUDGET", "").strip()
    if text:
        if text.isdigit():
            return int(text)
        warnings.warn(f"SPARSE_MLIR_DENSE_BUDGET={text!r} is not a number of bytes; using the default",
                      RuntimeWarning, stacklevel=2)
    return int(_available_memory() * DENSE_BUDGET_FRACTION)


def _available_memory() -> int:
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            available = int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):  # cgroup v2: the container's own limit, when it has one
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    return available


def densified_bytes(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]]) -> int:
    """Bytes of the dense copies ``spec.densified()`` makes of the sparse inputs (their shapes are static)."""
    return sum(math.prod(shapes[n]) for n in spec.inputs if spec.is_sparse(n)) * spec.dtype.itemsize


def _refused(error: LoweringError) -> bool:
    """Whether ``error`` is the sparsifier refusing the kernel (so dense copies may compile), not a compiler
    process stopped from outside (killed, out of memory, timed out) or a broken toolchain."""
    from ..worker import CompilerDied

    if isinstance(error, CompilerDied):
        return error.crashed
    return error.stage in _REFUSING_STAGES


@dataclass(frozen=True)
class BuildOptions:
    """What besides the spec and shapes decides the machine code: all of it is in the cache key."""

    target: str
    cpu: str
    openmp: Path | None  # the OpenMP runtime of threaded kernels; None: serial

    def key(self) -> str:
        return f"{self.target};{self.cpu};{self.openmp}"


@dataclass
class Specialization:
    """One compiled variant: a loaded library for fixed sparse shapes and index widths."""

    key: str
    shapes: dict[str, tuple[int | None, ...]]
    formats: dict[str, Format]
    native: NativeFunction = field(repr=False)

    @property
    def ir(self) -> dict[str, str]:
        """The IR of every stage (``input``, ``sparsified``, ``llvm``), read from the cache on demand."""
        return stored_ir(self.key)


def stored_ir(key: str) -> dict[str, str]:
    """The IR of a cache entry; a missing, unreadable or malformed IR file is a ``CacheError`` naming it."""
    try:
        ir = cache.load_ir(key)
    except (OSError, ValueError) as exc:
        raise cache.CacheError(f"{cache.ir_path(key)}: the kernel's IR cannot be read ({exc})") from exc
    if not isinstance(ir, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ir.items()):
        raise cache.CacheError(f"{cache.ir_path(key)}: the kernel's IR file is not a mapping of stage to text")
    return ir


class Kernel:
    """A compiled tensor-index-notation kernel; call it with keyword operands."""

    def __init__(self, spec: KernelSpec, options: BuildOptions):
        self.spec = spec
        self.options = options
        self.target = options.target
        self._keys: dict[tuple, str] = {}  # call-site key -> cache key (the library itself may be evicted)
        self._mlir: str | None = None
        # facts every call needs, computed once
        self._inputs = tuple((n, spec.formats.get(n), spec.ranks[n]) for n in spec.inputs)
        self._sparse_inputs = tuple(n for n in spec.inputs if spec.is_sparse(n))
        self._sources = tuple((idx, tuple(places)) for idx, places in spec.extent_sources().items())
        self._static = tuple(sorted(spec.static_indices))
        self._sparse_output = spec.sparse_output

    # -- introspection --------------------------------------------------------------
    @property
    def mlir(self) -> str:
        """The module before lowering, sparse sizes still ``?`` (each call specializes them)."""
        if self._mlir is None:
            from .. import worker

            self._mlir = worker.call("kernel_source", self.spec)
        return self._mlir

    @property
    def specializations(self) -> list[Specialization]:
        """The variants compiled for this kernel that are loaded now."""
        return [_loaded[k] for k in self._keys.values() if k in _loaded]

    @property
    def ir(self) -> dict[str, str]:
        """IR of every stage of the most recent specialization (``input``, ``sparsified``, ``llvm``)."""
        if not self._keys:
            raise ShapeError("the kernel has not been specialized yet: call it (or use .specializations) first")
        return stored_ir(next(reversed(self._keys.values())))

    def __repr__(self) -> str:
        fmts = ", ".join(f"{k}={v}" for k, v in self.spec.formats.items())
        return f"Kernel({self.spec.expression!r}, formats={{{fmts}}}, dtype={self.spec.dtype}, target={self.target!r})"

    # -- calling ----------------------------------------------------------------------
    @kernel_call
    def __call__(self, out: np.ndarray | None = None, **operands: Any) -> Any:
        spec = self.spec
        args = prepare(spec.expression, self._inputs, operands, spec.dtype, self.target)
        extents = check_extents(self._sources, args)
        special = self._specialization(args, extents)
        out_shape = tuple([extents[i] for i in spec.output_indices])
        if self._sparse_output:
            if out is not None:
                raise OperandError(f"out= is only for dense results; {spec.output} is {spec.formats[spec.output]}")
            return special.native(args, None, out_shape)
        return special.native(args, dense_output(spec.output, out, out_shape, spec.dtype, args), out_shape)

    def _specialization(self, args: dict[str, Any], extents: dict[str, int]) -> Specialization:
        # the declared formats fix everything but the index widths, so widths + static sizes identify it
        local_key = (tuple([(args[n].format.pos_width, args[n].format.crd_width) for n in self._sparse_inputs]),
                     tuple([extents[i] for i in self._static]))
        key = self._keys.get(local_key)
        special = _loaded.get(key) if key is not None else None
        if special is not None:
            with contextlib.suppress(KeyError):  # another thread may have just evicted it
                _loaded.move_to_end(key)
            return special
        formats = {n: args[n].format for n in self._sparse_inputs}
        shapes = self.spec.specialized_shapes(extents)
        special = _load_or_compile(self.spec, formats, shapes, self.options)
        self._keys[local_key] = special.key
        return special


def cache_key(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
              options: str) -> str:
    """The content hash naming a compiled specialization (``options``: what else decides the code)."""
    from ..compiler import source_hash
    from ..lowering.toolchain import tool_versions

    text = repr((spec.key(), sorted((n, repr(f), f.pos_width, f.crd_width) for n, f in formats.items()),
                 sorted(shapes.items()), options, source_hash(), tool_versions()))
    return hashlib.sha256(text.encode()).hexdigest()


def _compile(lib_path: Path, spec: KernelSpec, formats: dict[str, Format],
             shapes: dict[str, tuple[int | None, ...]], sig: Signature, options: BuildOptions) -> dict[str, str]:
    """Build the library at ``lib_path`` in the compiler process; return the IR of each stage."""
    from .. import worker
    from ..compiler import specialize

    special = specialize(spec, formats)
    try:
        stages = worker.call("build_library", special, shapes, sig, lib_path, options.target, options.cpu,
                             openmp=options.openmp)
    except LoweringError as exc:
        if spec.sparse_output or not spec.formats or not _refused(exc):
            raise
        need, budget = densified_bytes(spec, shapes), dense_budget()
        if need > budget:
            raise LoweringError(f"the sparsifier refused this kernel ({exc.message}), and computing it on dense "
                                f"copies of its sparse inputs needs {need:,} bytes, over the dense budget of "
                                f"{budget:,} (SPARSE_MLIR_DENSE_BUDGET)", stage=exc.stage, target=exc.target,
                                diagnostics=exc.diagnostics) from exc
        # the sparsifier failed on this co-iteration: copy the sparse inputs to dense and compute densely
        stages = worker.call("build_library", special.densified(), shapes, sig, lib_path, options.target,
                             options.cpu, openmp=options.openmp)
        stats["densified"] += 1
    stats["compiled"] += 1
    return stages


def _load_or_compile(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                     options: BuildOptions) -> Specialization:
    key = cache_key(spec, formats, shapes, options.key())
    with _compile_lock:
        special = _loaded.get(key)
        if special is not None:
            return special
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:  # one compile per key; other threads wait for it
        special = _loaded.get(key)
        if special is not None:
            return special
        sig = Signature.from_spec(spec, formats, shapes, ENTRY_NAME)
        lib_path, _ = cache.load_or_build(key, {"expression": spec.expression, "signature": sig.to_json()},
                                          lambda path: _compile(path, spec, formats, shapes, sig, options))
        special = Specialization(key, shapes, formats, NativeFunction(lib_path, sig, threaded=bool(options.openmp)))
        _loaded[key] = special
        while len(_loaded) > knobs.max_loaded_kernels():
            _loaded.popitem(last=False)  # unloaded once no call still runs it (NativeFunction.__del__)
        stats["loaded"] += 1
        return special
