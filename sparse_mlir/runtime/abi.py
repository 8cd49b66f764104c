"""Memref descriptors for ``_mlir_ciface_`` functions, and adoption of returned buffers.

A rank-``r`` memref descriptor is ``{allocated, aligned, offset, sizes[r],
strides[r]}``: all 64-bit on x86-64, so a whole call's descriptors are one
``int64`` array and each argument is a pointer into it.  Strides count
elements, not bytes as in numpy (``np_to_memref`` upstream notes the same
trap).  Buffers a kernel returns were ``malloc``-ed by it; they become
numpy arrays that ``free`` them when collected, without a copy.
"""

from __future__ import annotations

import ctypes
import numpy as np

__all__ = ["data_pointer", "descriptor", "descriptor_size", "DescriptorBlock", "adopt_buffer"]

_libc = ctypes.CDLL(None)
_free = _libc.free
_free.argtypes = [ctypes.c_void_p]
_free.restype = None


def descriptor_size(rank: int) -> int:
    """Number of int64 words of a rank-``rank`` descriptor."""
    return 3 + 2 * rank


def data_pointer(array: np.ndarray) -> int:
    """Address of an array's first element (the buffer protocol is 5x faster than ``__array_interface__``)."""
    if array.flags.writeable and array.size:
        return ctypes.addressof(_Byte.from_buffer(array))
    return array.__array_interface__["data"][0]


_Byte = ctypes.c_char


def descriptor(array: np.ndarray) -> list[int]:
    """Descriptor words of a C-contiguous, aligned numpy array (not copied)."""
    ptr = data_pointer(array)
    itemsize = array.itemsize
    return [ptr, ptr, 0, *array.shape, *[s // itemsize for s in array.strides]]


class DescriptorBlock:
    """One call's descriptors in one int64 buffer after space for the result; reused per thread."""

    __slots__ = ("words", "pointers", "result_words")

    def __init__(self, result_words: int, offsets: tuple[int, ...], total_words: int):
        self.words = (ctypes.c_int64 * total_words)()
        base = ctypes.addressof(self.words)
        self.pointers = [base + o for o in offsets]
        self.result_words = result_words

    def fill(self, argument_words: list[int]) -> None:
        self.words[self.result_words:] = argument_words

    def result(self, start: int, count: int) -> list[int]:
        return self.words[start:start + count]


class _MallocBuffer:
    """Exposes a ``malloc``-ed block to numpy and frees it when the last view dies."""

    __slots__ = ("allocated", "__array_interface__")

    def __init__(self, allocated: int, data: int, length: int, dtype: np.dtype):
        self.allocated = allocated
        self.__array_interface__ = {"data": (data, False), "shape": (length,), "typestr": dtype.str, "version": 3}

    def __del__(self) -> None:
        if self.allocated:
            _free(self.allocated)


def adopt_buffer(words: list[int], dtype: np.dtype, length: int | None = None) -> np.ndarray:
    """Take ownership of a returned rank-1 memref; ``length`` may trim it to the used size."""
    allocated, aligned, offset, size = (int(x) for x in words[:4])
    n = size if length is None else length
    assert 0 <= n <= size, "kernel returned a buffer shorter than its used size"
    owner = _MallocBuffer(allocated, aligned + offset * dtype.itemsize, n, dtype)
    array = np.asarray(owner)
    array.flags.writeable = False
    return array
