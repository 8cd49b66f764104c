"""``Kernel``: the callable a ``compile()`` returns.

A call checks and converts its operands, works out every index's size,
picks (or compiles once) the specialization for the sparse operands' shapes
and formats, packs memref descriptors without copying the user's arrays,
runs the native function (ctypes releases the GIL) and wraps the results.
"""

from __future__ import annotations

import ctypes
import difflib
import hashlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dsl.plan import KernelSpec
from ..errors import DeviceError, DTypeError, FormatError, OperandError, ShapeError
from ..formats import Format, LevelKind
from ..tensor import SparseTensor
from . import abi, cache

__all__ = ["Kernel", "Specialization"]

_ENTRY = "_mlir_ciface_kernel"
_descriptor_cache: weakref.WeakKeyDictionary[SparseTensor, list[int]] = weakref.WeakKeyDictionary()
_compile_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}
_loaded: dict[str, Specialization] = {}  # by cache key, shared by every Kernel of the process


@dataclass
class Specialization:
    """One compiled variant: a loaded library for fixed sparse shapes and formats."""

    key: str
    shapes: dict[str, tuple[int | None, ...]]
    formats: dict[str, Format]
    ir: dict[str, str]
    function: Any = field(repr=False)
    library: Any = field(repr=False)
    sizes: tuple[int, ...] = field(repr=False, default=())  # words of each pointer argument, result first
    _local: threading.local = field(repr=False, default_factory=threading.local)

    def block(self) -> abi.DescriptorBlock:
        """This thread's argument buffer (calls on several threads never share one)."""
        block = getattr(self._local, "block", None)
        if block is None:
            offsets = tuple(8 * sum(self.sizes[:i]) for i in range(len(self.sizes)))
            block = self._local.block = abi.DescriptorBlock(self.sizes[0], offsets, sum(self.sizes))
        return block


def _is_cupy(value: Any) -> bool:
    return type(value).__module__.split(".")[0] in ("cupy", "cupyx")


def _is_scipy_sparse(value: Any) -> bool:
    return type(value).__module__.startswith("scipy.sparse")


class Kernel:
    """A compiled tensor-index-notation kernel; call it with keyword operands."""

    def __init__(self, spec: KernelSpec, target: str, cpu: str):
        self.spec = spec
        self.target = target
        self.cpu = cpu
        self._specializations: dict[tuple, Specialization] = {}
        self._mlir: str | None = None
        # facts every call needs, computed once
        self._input_set = set(spec.inputs)
        self._sparse_inputs = tuple(n for n in spec.inputs if spec.is_sparse(n))
        self._sources = tuple(spec.extent_sources().items())
        self._static = tuple(sorted(spec.static_indices))
        self._dense_out = not spec.sparse_output
        self._result_words = abi.descriptor_size(len(spec.output_indices)) if self._dense_out else \
            abi.descriptor_size(1) * len(spec.formats[spec.output].codegen_format.buffer_names)

    # -- introspection --------------------------------------------------------------
    @property
    def mlir(self) -> str:
        """The module before lowering, sparse sizes still ``?`` (each call specializes them)."""
        if self._mlir is None:
            from ..compiler import kernel_source

            self._mlir = kernel_source(self.spec)
        return self._mlir

    @property
    def specializations(self) -> list[Specialization]:
        return list(self._specializations.values())

    @property
    def ir(self) -> dict[str, str]:
        """IR of every stage of the most recent specialization (``input``, ``sparsified``, ``llvm``)."""
        if not self._specializations:
            raise ShapeError("the kernel has not been specialized yet: call it (or use .specializations) first")
        return next(reversed(self._specializations.values())).ir

    def __repr__(self) -> str:
        fmts = ", ".join(f"{k}={v}" for k, v in self.spec.formats.items())
        return f"Kernel({self.spec.expression!r}, formats={{{fmts}}}, dtype={self.spec.dtype}, target={self.target!r})"

    # -- calling ----------------------------------------------------------------------
    def __call__(self, out: np.ndarray | None = None, **operands: Any) -> Any:
        spec = self.spec
        if operands.keys() != self._input_set:
            self._raise_operand_names(operands)
        args = {n: self._operand(n, operands[n]) for n in spec.inputs}
        extents = self._extents(args)
        special = self._specialization(args, extents)
        words: list[int] = []
        for name in spec.inputs:
            value = args[name]
            if type(value) is SparseTensor:
                words += _tensor_descriptors(value)
            else:
                words += abi.descriptor(value)
        result = None
        out_shape = tuple([extents[i] for i in spec.output_indices])
        if self._dense_out:
            result = self._dense_output(out, out_shape)
            words += abi.descriptor(result)
        elif out is not None:
            raise OperandError(f"out= is only for dense results; {spec.output} is {spec.formats[spec.output]}")
        block = special.block()
        block.fill(words)
        special.function(*block.pointers)
        if not self._dense_out:
            return self._sparse_result(block, out_shape)
        assert block.words[1] == abi.data_pointer(result) or result.size == 0, \
            "dense result was not written in place"
        return result

    def _raise_operand_names(self, operands: dict[str, Any]) -> None:
        inputs = self.spec.inputs
        detail = []
        if missing := [n for n in inputs if n not in operands]:
            detail.append(f"missing {', '.join(missing)}")
        if unknown := [n for n in operands if n not in inputs]:
            close = {n: [i for i in inputs if i.lower() == n.lower()] or difflib.get_close_matches(n, inputs, 1)
                     for n in unknown}
            detail.append("unknown " + ", ".join(n + (f" (did you mean {close[n][0]}?)" if close[n] else "")
                                                 for n in unknown))
        raise OperandError(f"kernel {self.spec.expression!r} takes operands {', '.join(inputs)}: "
                           f"{'; '.join(detail)}")

    def _operand(self, name: str, value: Any) -> SparseTensor | np.ndarray:
        spec = self.spec
        kind = type(value)
        if kind is SparseTensor and value.format is spec.formats.get(name) and value.dtype == spec.dtype:
            return value  # fast path: a tensor built in the declared format
        if kind is np.ndarray and name not in spec.formats and value.dtype == spec.dtype \
                and value.ndim == spec.ranks[name] and value.flags.c_contiguous and value.flags.aligned:
            return value  # fast path: a ready dense operand
        if _is_cupy(value):
            raise DeviceError(f"operand {name} is a CuPy array, but this kernel runs on the {self.target}; "
                              f"use cupy.asnumpy or compile with target='cuda'")
        if spec.is_sparse(name):
            declared = spec.formats[name]
            if _is_scipy_sparse(value):
                value = SparseTensor.from_scipy(value, declared)  # validated and converted on every call
            if not isinstance(value, SparseTensor):
                raise OperandError(f"operand {name} is declared {declared}; pass a SparseTensor or a scipy.sparse "
                                   f"matrix, got {type(value).__name__}")
            if value.format.with_widths(declared.pos_width, declared.crd_width) != declared:
                raise FormatError(f"operand {name} is declared {declared}, but the SparseTensor is {value.format}; "
                                  f"convert it (e.g. SparseTensor.from_scipy(m.to_scipy(), '{declared}'))")
            if value.dtype != spec.dtype:
                raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {spec.dtype}")
            return value
        if isinstance(value, SparseTensor) or _is_scipy_sparse(value):
            raise FormatError(f"operand {name} is dense in this kernel; pass a numpy array, or declare a sparse "
                              f"format for it with formats={{'{name}': ...}}")
        if not isinstance(value, np.ndarray):
            if np.isscalar(value) and spec.ranks[name] == 0:
                value = np.asarray(value, dtype=spec.dtype)
            else:
                raise OperandError(f"operand {name} must be a numpy array, got {type(value).__name__}")
        if value.dtype != spec.dtype:
            raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {spec.dtype} "
                             f"(no implicit casts: use .astype)")
        if value.ndim != spec.ranks[name]:
            raise ShapeError(f"operand {name} is used with {spec.ranks[name]} indices but has shape {value.shape}")
        if not (value.flags.c_contiguous and value.flags.aligned):
            value = np.array(value, order="C", copy=True)  # the kernel needs contiguous, aligned rows
        return value

    def _extents(self, args: dict[str, SparseTensor | np.ndarray]) -> dict[str, int]:
        extents: dict[str, int] = {}
        first: dict[str, tuple[str, int]] = {}
        for idx, sources in self._sources:
            for name, dim in sources:
                size = args[name].shape[dim]
                if idx not in extents:
                    extents[idx], first[idx] = size, (name, dim)
                elif extents[idx] != size:
                    other, odim = first[idx]
                    raise ShapeError(f"index {idx!r}: {other} dimension {odim} has size {extents[idx]} but {name} "
                                     f"dimension {dim} has size {size}")
        return extents

    def _dense_output(self, out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
        name = self.spec.output
        if out is None:
            return np.zeros(shape, dtype=self.spec.dtype)
        if not isinstance(out, np.ndarray):
            raise OperandError(f"out= must be a numpy array, got {type(out).__name__}")
        if out.dtype != self.spec.dtype:
            raise DTypeError(f"out= has dtype {out.dtype}, the kernel's dtype is {self.spec.dtype}")
        if out.shape != shape:
            raise ShapeError(f"out= has shape {out.shape}, but {name} has shape {shape}")
        if not (out.flags.c_contiguous and out.flags.aligned and out.flags.writeable):
            raise OperandError("out= must be a writeable, C-contiguous, aligned array")
        out.fill(0)  # documented: out= is overwritten
        return out

    # -- specialization -------------------------------------------------------------
    def _specialization(self, args: dict[str, Any], extents: dict[str, int]) -> Specialization:
        # the declared formats fix everything but the index widths, so widths + static sizes identify it
        local_key = (tuple([(args[n].format.pos_width, args[n].format.crd_width) for n in self._sparse_inputs]),
                     tuple([extents[i] for i in self._static]))
        found = self._specializations.get(local_key)
        if found is not None:
            return found
        spec = self.spec
        formats = {n: args[n].format for n in self._sparse_inputs}
        static = spec.static_indices
        shapes = {}
        for name in (*spec.inputs, spec.output):
            if name == spec.output:
                index = spec.output_indices
            else:
                index = next(a.index for st in spec.stages for a in st.accesses() if a.tensor == name)
            sparse = name in formats or (name == spec.output and spec.sparse_output)
            shapes[name] = tuple(extents[i] if (sparse or i in static) else None for i in index)
        special = _load_or_compile(spec, formats, shapes, self.target, self.cpu)
        self._specializations[local_key] = special
        return special

    def _sparse_result(self, block: abi.DescriptorBlock, shape: tuple[int, ...]) -> SparseTensor:
        fmt = self.spec.formats[self.spec.output]
        sizes = fmt.level_sizes(shape)
        buffers: list[np.ndarray] = []
        step = abi.descriptor_size(1)
        slot = iter(range(0, step * len(fmt.buffer_names), step))
        n_entries = 1
        from ..storage import index_dtype

        for i, level in enumerate(fmt.levels):
            if level.kind is LevelKind.DENSE:
                n_entries *= sizes[i]
                continue
            if level.has_positions:
                pos = abi.adopt_buffer(block.result(next(slot), step), index_dtype(fmt.pos_width), n_entries + 1)
                buffers.append(pos)
                n_entries = int(pos[-1])
            buffers.append(abi.adopt_buffer(block.result(next(slot), step), index_dtype(fmt.crd_width), n_entries))
        buffers.append(abi.adopt_buffer(block.result(next(slot), step), self.spec.dtype, n_entries))
        return SparseTensor(fmt, shape, tuple(buffers), validate=False)


def _tensor_descriptors(tensor: SparseTensor) -> list[int]:
    words = _descriptor_cache.get(tensor)
    if words is None:
        words = [w for b in tensor.kernel_buffers for w in abi.descriptor(b)]
        _descriptor_cache[tensor] = words
    return words


def _argument_words(spec: KernelSpec, formats: dict[str, Format]) -> list[int]:
    """Words of each pointer argument of the C interface: the result, then one descriptor per buffer or array."""
    out_rank = len(spec.output_indices)
    sizes = [abi.descriptor_size(out_rank) if not spec.sparse_output else
             abi.descriptor_size(1) * len(spec.formats[spec.output].codegen_format.buffer_names)]
    for name in spec.inputs:
        if name in formats:
            sizes += [abi.descriptor_size(1)] * len(formats[name].codegen_format.buffer_names)
        else:
            sizes.append(abi.descriptor_size(spec.ranks[name]))
    if not spec.sparse_output:
        sizes.append(abi.descriptor_size(out_rank))
    return sizes


def _cache_key(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
               target: str, cpu: str) -> str:
    from ..compiler import source_hash
    from ..lowering.toolchain import tool_versions

    text = repr((spec.key(), sorted((n, repr(f), f.pos_width, f.crd_width) for n, f in formats.items()),
                 sorted(shapes.items()), target, cpu, source_hash(), tool_versions()))
    return hashlib.sha256(text.encode()).hexdigest()


def _load_or_compile(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                     target: str, cpu: str) -> Specialization:
    key = _cache_key(spec, formats, shapes, target, cpu)
    with _compile_lock:
        special = _loaded.get(key)
        if special is not None:
            return special
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:  # one compile per key; other threads wait for it
        special = _loaded.get(key)
        if special is not None:
            return special
        entry = cache.load_entry(key)
        if entry is None:
            from ..compiler import build_library, specialize

            lib_path, _ = cache.entry_paths(key)
            stages = build_library(specialize(spec, formats), shapes, lib_path, target, cpu)
            cache.store_metadata(key, {"expression": spec.expression, "ir": stages})
            entry = cache.load_entry(key)
            assert entry is not None, "kernel cache entry vanished right after it was written"
        lib_path, meta = entry
        library = ctypes.CDLL(str(lib_path))
        function = getattr(library, _ENTRY)
        function.restype = None
        sizes = _argument_words(spec, formats)
        function.argtypes = [ctypes.c_void_p] * len(sizes)
        special = Specialization(key, shapes, formats, meta["ir"], function, library, tuple(sizes))
        _loaded[key] = special
        return special
