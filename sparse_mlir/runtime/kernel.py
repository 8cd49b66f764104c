"""``Kernel``: the callable a ``compile()`` returns.

A call checks and converts its operands, works out every index's size,
picks (or compiles, once per process and once per disk cache) the
specialization for the sparse operands' shapes and index widths, and runs its
native entry point.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
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

__all__ = ["Kernel", "Specialization", "BuildOptions", "ENTRY_NAME", "cache_key"]

ENTRY_NAME = "sparse_mlir_kernel"
_compile_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}
# loaded libraries by cache key, least recently used first, shared by every Kernel of the process
_loaded: OrderedDict[str, Specialization] = OrderedDict()
# per process: native compiles, libraries loaded (compiled or cached), compiles that fell back to densified inputs
stats = {"compiled": 0, "loaded": 0, "densified": 0}


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
        return cache.load_ir(self.key)


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
        return cache.load_ir(next(reversed(self._keys.values())))

    def __repr__(self) -> str:
        fmts = ", ".join(f"{k}={v}" for k, v in self.spec.formats.items())
        return f"Kernel({self.spec.expression!r}, formats={{{fmts}}}, dtype={self.spec.dtype}, target={self.target!r})"

    # -- calling ----------------------------------------------------------------------
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
    except LoweringError:
        if spec.sparse_output or not spec.formats:
            raise
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
