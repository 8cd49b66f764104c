"""A loaded kernel library and its plain C entry point, called through ctypes.

The argument list follows ``Signature.params()``; ctypes releases the GIL
for the duration of the native call.  Used for JIT-compiled, disk-cached and
ahead-of-time exported kernels alike.
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from sparse_mlir.errors import FormatError, InvalidIndicesError, LoweringError, OperandError, ShapeError
from sparse_mlir.abi.c_signature import (
    BAD_LEVELS,
    NULL_POINTER,
    RESULT_OVERFLOW,
    SIZE_MISMATCH,
    STATUS_TEXT,
    Signature,
)
from sparse_mlir.tensor.host import SparseTensor
from sparse_mlir.runtime import threads
from sparse_mlir.runtime import descriptors as abi
from sparse_mlir.runtime.thread_choice import ThreadChoice

__all__ = ["NativeFunction"]

_buffer_args: weakref.WeakKeyDictionary[SparseTensor, list[int]] = weakref.WeakKeyDictionary()
_dlclose = ctypes.CDLL(None).dlclose
_dlclose.argtypes = [ctypes.c_void_p]
_STATUS_ERRORS = {NULL_POINTER: OperandError, SIZE_MISMATCH: ShapeError, BAD_LEVELS: InvalidIndicesError}


def _tensor_args(tensor: SparseTensor) -> list[int]:
    """``(pointer, length)`` per buffer, computed once per tensor (its buffers never change)."""
    args = _buffer_args.get(tensor)
    if args is None:
        args = []
        for buf in tensor.buffers:
            args += [abi.data_pointer(buf), buf.size]
        _buffer_args[tensor] = args
    return args


class NativeFunction:
    """``int32_t NAME(...)`` of one library, callable with prepared operands."""

    def __init__(self, path: Path, sig: Signature, *, threaded: bool = False, runtime: Path | None = None):
        self.path = Path(path)
        self.signature = sig
        self.threaded = threaded
        # serial or threaded for calls that find the pool asleep, measured (shared with the C call path)
        self.thread_choice = ThreadChoice() if threaded else None
        if threaded:
            threads.load_runtime(runtime)  # the OpenMP runtime it links (``None``: ``openmp_library``'s), first
        try:
            self.library = ctypes.CDLL(str(path))
        except OSError as exc:  # not a shared library, or one that needs what this machine lacks
            raise FormatError(f"{path}: cannot load this kernel library ({exc})") from exc
        try:
            self.function = getattr(self.library, sig.name)
        except AttributeError:
            raise FormatError(f"{path}: the library has no function {sig.name!r}, which its signature "
                              f"names") from None
        self.function.restype = ctypes.c_int32
        self.function.argtypes = [ctypes.c_int64 if p.ctype == "int64_t" else ctypes.c_void_p
                                  for p in sig.params()]
        # (name, sparse, the sparse input's dimensions passed as sizes: shape-generic kernels)
        self._inputs = tuple((op.name, op.sparse, op.size_params if op.sparse else ()) for op in sig.inputs)
        self._result_buffers = sig.result_buffers()
        self._result_format = sig.output.format
        self._local = threading.local()

    def __call__(self, args: dict[str, Any], out: np.ndarray | None, out_shape: tuple[int, ...]) -> Any:
        params: list[int] = []
        entries = 0  # how much data the call touches, to decide whether threads pay off
        for name, sparse, sizes in self._inputs:
            value = args[name]
            if sparse:
                params += _tensor_args(value)
                for d in sizes:
                    params.append(value.shape[d])
                entries += value.buffers[-1].size
            else:
                params.append(abi.data_pointer(value))
                params += value.shape
                entries += value.size
        if out is not None:
            params.append(abi.data_pointer(out))
            params += out.shape
        else:
            words = self._result_words()
            params.append(ctypes.addressof(words))
        report = self.thread_choice.before_call(entries) if self.thread_choice is not None else None
        if report is None:
            status = self.function(*params)
        else:
            start = time.perf_counter()
            status = self.function(*params)
            if status == 0:
                report(time.perf_counter() - start)
        if status == RESULT_OVERFLOW:
            out_op = self.signature.output
            raise FormatError(f"the result {out_op.name} of {self.signature.expression!r} has more entries or larger "
                              f"coordinates than its format {out_op.format} holds (index widths "
                              f"{out_op.format.pos_width}/{out_op.format.crd_width} bits); declare it with wider "
                              f"indices, e.g. formats={{'{out_op.name}': sm.CSR.with_widths(64, 64)}}")
        if status:
            raise _STATUS_ERRORS.get(status, LoweringError)(
                f"kernel {self.signature.name} refused its arguments: {STATUS_TEXT.get(status, 'internal error')} "
                f"(status {status})", **({} if status in _STATUS_ERRORS else {"stage": "run", "target": "cpu"}))
        if out is not None:
            return out
        return self.adopt_result(words, out_shape)

    def __del__(self, _dlclose: Any = _dlclose) -> None:
        # nothing can call the library any more (a running call, or a C-level call's plan, holds a reference to
        # self): unmap it.  ``_dlclose`` is bound here because a plan may let go of it during interpreter
        # shutdown, after this module's globals are gone
        handle = getattr(getattr(self, "library", None), "_handle", None)
        if handle:
            _dlclose(handle)

    def _result_words(self) -> ctypes.Array:
        words = getattr(self._local, "words", None)
        if words is None:
            words = self._local.words = (ctypes.c_int64 * (3 * len(self._result_buffers)))()
        return words

    def adopt_result(self, words: Any, shape: tuple[int, ...]) -> SparseTensor:
        """The sparse result an entry point reported in its result words (``(data, length)`` per buffer, then
        each buffer's allocation), owning those buffers.

        The entry point built them and checked their sizes against the
        format's widths (``RESULT_OVERFLOW`` otherwise), so nothing is
        checked again: this runs on every call of a sparse-output kernel.
        """
        k = len(self._result_buffers)
        buffers = tuple(abi.adopt_buffer(words[2 * k + i], words[2 * i], words[2 * i + 1], dtype)
                        for i, (_, dtype) in enumerate(self._result_buffers))
        return SparseTensor._trusted(self._result_format, shape, buffers)
