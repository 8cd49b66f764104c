"""``CpuKernel``: what ``compile()`` returns for ``target="cpu"``.

A call checks and converts its operands, works out every index's size, picks
(or has the driver build, once per process and once per disk cache) the
specialization for the sparse operands' index widths (and, unless the kernel
is shape-generic, their shapes), and runs its native entry point.  A
shape-generic kernel (a hand-scheduled one: ``driver.shape_generic``) has
one build per index widths that takes every size at run time; the others
(the sparsifier's) one per sparse shape.  Loaded libraries are shared by every kernel of the
process, least recently used first out (``SPARSE_MLIR_MAX_LOADED_KERNELS``).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.compiler import driver
from sparse_mlir.compiler.driver import Artifact, BuildOptions
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.errors import OperandError, ShapeError
from sparse_mlir.formats import Format
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime import fast_call
from sparse_mlir.runtime.calls import kernel_call
from sparse_mlir.runtime.kernel import (
    Kernel,
    check_shapes_given,
    not_compiled,
    operand_table,
)
from sparse_mlir.runtime.library import NativeFunction
from sparse_mlir.runtime.operands import check_extents, dense_output, prepare

__all__ = ["ENTRY_NAME", "CpuKernel", "Specialization"]

ENTRY_NAME = "sparse_mlir_kernel"
_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}


def _after_fork_in_child() -> None:
    """A fork inherits these locks in whatever state another thread held them: start free in the child."""
    global _lock, _key_locks
    _lock = threading.Lock()
    _key_locks = {}


os.register_at_fork(after_in_child=_after_fork_in_child)
# loaded libraries by cache key, least recently used first, shared by every kernel of the process
_loaded: OrderedDict[str, Specialization] = OrderedDict()


class Specialization:
    """One compiled variant: its artifact (index widths, and sparse shapes unless generic) and the loaded library."""

    def __init__(self, artifact: Artifact, formats: dict[str, Format]):
        self.artifact = artifact
        self.key = artifact.key
        self.formats = formats
        self.native = NativeFunction(artifact.path, artifact.signature, threaded=bool(artifact.options.openmp),
                                     runtime=artifact.options.openmp)
        self.fresh = True  # not yet counted in a kernel's stats
        self.planner = fast_call.Planner(self.native)  # its C-level call, built on first use
        self._calls_seen = 0  # the C-level calls when eviction last looked at it

    def fast_call(self) -> Callable[[dict[str, Any], Any], Any] | None:
        """The C-level call of this specialization (``fast_call``), or ``None`` where it does not apply."""
        return self.planner.call_for(self.formats)

    def used_since_last_look(self) -> bool:
        """Whether its C-level call ran since the last time this was asked (such calls do not reorder the
        table of loaded libraries, so eviction asks before it unloads: a second chance, as in CLOCK)."""
        calls = self.planner.calls
        used, self._calls_seen = calls != self._calls_seen, calls
        return used

    def unload(self) -> None:
        """Leaving the table of loaded libraries: the C-level call stops, so the library can be unmapped once
        no call runs it (``NativeFunction.__del__``)."""
        self.planner.close()

    @property
    def shapes(self) -> dict[str, tuple[int | None, ...]]:
        return {op.name: op.shape for op in self.artifact.signature.operands}

    @property
    def ir(self) -> dict[str, str]:
        """The IR of every stage, read from the cache on demand."""
        return self.artifact.ir


class CpuKernel(Kernel):
    """A compiled tensor-index-notation kernel for the CPU; call it with keyword operands."""

    # whether a call may go straight to the last specialization's C-level call (``fast_call``); a subclass that
    # decides per call what to run (``AutoKernel``) must not be bypassed
    direct_calls = True

    def __init__(self, spec: KernelSpec, options: BuildOptions):
        super().__init__()
        self.spec = spec
        self.options = options
        self.target = options.target
        self._keys: dict[tuple, str] = {}  # call-site key -> cache key (the library itself may be evicted)
        self._last: Specialization | None = None
        self._fast: tuple[tuple[Format, ...], tuple | None, Specialization] | None = None  # the last call's lookup
        # facts every call needs, computed once
        self._inputs = operand_table(spec)
        self._sparse_inputs = tuple(n for n in spec.inputs if spec.is_sparse(n))
        self._sources = tuple((idx, tuple(places)) for idx, places in spec.extent_sources().items())
        self._static = tuple(sorted(spec.static_indices))
        self._sparse_output = spec.sparse_output
        self._generic: dict[tuple, bool] = {}  # index widths of the sparse inputs -> shape-generic?

    # -- introspection --------------------------------------------------------------
    @property
    def shape_generic(self) -> bool:
        """Whether one build takes every size at run time (operands with the declared index widths): the
        hand-scheduled CPU kernels; a sparsifier kernel compiles once per sparse shape."""
        return driver.shape_generic(self.spec, {n: self.spec.formats[n] for n in self._sparse_inputs}, self.options)

    @property
    def mlir(self) -> str:
        """The module before lowering, sparse sizes still ``?`` (each call specializes them)."""
        return driver.kernel_source(self.spec)

    @property
    def specializations(self) -> list[Specialization]:
        """The variants compiled for this kernel that are loaded now."""
        return [_loaded[k] for k in self._keys.values() if k in _loaded]

    @property
    def signature(self) -> Signature:
        if self._last is None:
            raise not_compiled(self)
        return self._last.artifact.signature

    @property
    def ir(self) -> dict[str, str]:
        """IR of every stage of the most recent specialization (``input``, ``sparsified``, ``mapped``, ``llvm``)."""
        if self._last is None:
            raise not_compiled(self)
        return self._last.ir

    def specialize(self, shapes: Mapping[str, tuple[int, ...]]) -> CpuKernel:
        """Compile (or load) the specialization for the declared formats and these shapes, without running it.

        Only the sizes a sparse operand fixes are compiled in; ``shapes``
        must give every sparse operand (and whatever fixes a sparse output's size),
        unless the kernel is ``shape_generic`` (then ``{}`` builds the one variant).
        """
        spec = self.spec
        formats = {n: spec.formats[n] for n in self._sparse_inputs}
        if self._is_generic(formats):
            check_shapes_given(spec, shapes, ())
            self._remember(self._local_key(formats, {}), formats, driver.generic_shapes(spec))
            return self
        checked = check_shapes_given(spec, shapes, self._sparse_inputs)
        extents = {}
        for name, shape in checked.items():
            for idx, size in zip(spec.operand_index(name), shape):
                if extents.setdefault(idx, size) != size:
                    raise ShapeError(f"index {idx!r} has size {extents[idx]} in one operand and {size} in {name}")
        if missing := sorted(spec.static_indices - extents.keys()):
            raise ShapeError(f"the sizes of {', '.join(missing)} are compiled in: give the shapes of the operands "
                             f"that have them")
        self._remember(self._local_key(formats, extents), formats, spec.specialized_shapes(extents))
        return self

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
            result = special.native(args, None, out_shape)
        else:
            result = special.native(args, dense_output(spec.output, out, out_shape, spec.dtype, args), out_shape)
        if self.direct_calls:  # the next call with operands like these skips all of the above
            self._native_fast = special.fast_call()
        return result

    def _local_key(self, formats: Mapping[str, Format], extents: Mapping[str, int]) -> tuple:
        # the declared formats fix everything but the index widths, so widths (+ static sizes unless the kernel
        # is shape-generic: None) identify it
        widths = tuple([(formats[n].pos_width, formats[n].crd_width) for n in self._sparse_inputs])
        generic = self._generic.get(widths)
        if generic is None:
            generic = self._is_generic(formats)
        return widths, None if generic else tuple([extents[i] for i in self._static])

    def _is_generic(self, formats: Mapping[str, Format]) -> bool:
        """Whether the build for these actual formats is shape-generic (asked once per index widths: the
        formats are the declared ones but for their widths)."""
        widths = tuple([(formats[n].pos_width, formats[n].crd_width) for n in self._sparse_inputs])
        if widths not in self._generic:
            self._generic[widths] = driver.shape_generic(self.spec, dict(formats), self.options)
        return self._generic[widths]

    def _specialization(self, args: dict[str, Any], extents: dict[str, int]) -> Specialization:
        # the common case first: the operands' formats are the very objects of the last call, and that
        # specialization is still loaded (a shape-generic one serves any size; a per-shape one needs the same
        # static sizes): no key to build (about 2 us of a 13 us call)
        fast = self._fast
        if fast is not None:
            formats_then, static_then, special = fast
            if all([args[n].format is f for n, f in zip(self._sparse_inputs, formats_then)]) and \
                    (static_then is None or static_then == tuple([extents[i] for i in self._static])) and \
                    _loaded.get(special.key) is special:
                try:
                    _loaded.move_to_end(special.key)  # still the most recently used
                except KeyError:  # another thread may have just evicted it: the call still holds it
                    pass
                return special
        formats = {n: args[n].format for n in self._sparse_inputs}
        local_key = self._local_key(formats, extents)
        key = self._keys.get(local_key)
        special = _loaded.get(key) if key is not None else None
        if special is not None:
            try:
                _loaded.move_to_end(key)
            except KeyError:  # another thread may have just evicted it
                pass
        else:
            shapes = driver.generic_shapes(self.spec) if local_key[1] is None else self.spec.specialized_shapes(extents)
            special = self._remember(local_key, formats, shapes)
        self._last = special
        self._fast = (tuple(formats.values()), local_key[1], special)
        return special

    def _remember(self, local_key: tuple, formats: dict[str, Format],
                  shapes: dict[str, tuple[int | None, ...]]) -> Specialization:
        special = _load(self.spec, formats, shapes, self.options)
        if special.fresh:
            self._count(special.artifact)
            special.fresh = False
        self._keys[local_key] = special.key
        self._last = special
        return special


def _load(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
          options: BuildOptions) -> Specialization:
    """The loaded specialization: from this process's table, else from the driver (disk cache or a compile)."""
    key = driver.cache_key(spec, formats, shapes, options, ENTRY_NAME)
    special = _loaded.get(key)
    if special is not None:
        return special
    with _lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:  # one load per key in this process (the driver compiles once per key across processes)
        special = _loaded.get(key)
        if special is not None:
            return special
        special = Specialization(driver.build(spec, formats, shapes, options, ENTRY_NAME), formats)
        _loaded[key] = special
        while len(_loaded) > knobs.max_loaded_kernels():
            old_key, old = _loaded.popitem(last=False)
            # the one just loaded stays (it reaches the front when every other was called since the last look,
            # and was unloaded before its first call: the next call loaded it again); one called through C
            # since we last looked is most recently used after all
            if old_key == key or old.used_since_last_look():
                _loaded[old_key] = old
                continue
            old.unload()  # unmapped once no call still runs it (NativeFunction.__del__)
        return special
