"""TMA descriptors (``CUtensorMap``) for the ``tensormap`` kernel arguments of Hopper kernels.

A TMA load reads a box of a 2-d view of a buffer through a 128-byte
descriptor the driver encodes on the host (``cuTensorMapEncodeTiled``; CuPy
14 has no binding, so it is called through ctypes).  The kernel takes the
descriptor's device address: descriptors are uploaded once and cached per
device, buffer address and geometry, so a call with the same buffers costs a
dictionary look-up.  The exported C launcher makes the same call
(``gpu_header``).
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from sparse_mlir.errors import DeviceError
from sparse_mlir.abi.gpu_program import TensorMapGeometry

__all__ = ["TensorMaps", "encode_arguments", "DATA_TYPES", "SWIZZLE"]

# CUtensorMapDataType, by numpy dtype name of the buffer (uint16 holds bfloat16 bits)
DATA_TYPES = {"float16": 6, "bfloat16": 9, "uint16": 9, "float32": 7}
SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle by bytes
L2_PROMOTION_128B = 2
CACHED = 1024  # descriptors kept per process (128 bytes of device memory each)


def encode_arguments(pointer: int, geometry: TensorMapGeometry, dtype: str) -> tuple:
    """The arguments after the output pointer of ``cuTensorMapEncodeTiled`` for a row-major 2-d view.

    Checked here so a bad geometry is a ``DeviceError``, not a driver code:
    TMA needs a 16-byte aligned base, 16-byte multiple row strides and boxes
    of at most 256 elements per side whose inner side fits the swizzle span.
    """
    if dtype not in DATA_TYPES:
        raise DeviceError(f"TMA loads take float16 or bfloat16 buffers, not {dtype}")
    stride = geometry.inner * geometry.element_bytes
    if pointer % 16 or stride % 16:
        raise DeviceError(f"a TMA operand needs a 16-byte aligned start and row stride (start {pointer:#x}, "
                          f"{stride} bytes per row): pass a contiguous copy")
    if not (0 < geometry.box_inner <= 256 and 0 < geometry.box_outer <= 256) or geometry.swizzle not in SWIZZLE \
            or (geometry.swizzle and geometry.box_inner * geometry.element_bytes > geometry.swizzle):
        raise DeviceError(f"TMA box {geometry.box_outer}x{geometry.box_inner} does not fit its swizzle")
    dims = (ctypes.c_uint64 * 2)(geometry.inner, geometry.outer)
    strides = (ctypes.c_uint64 * 1)(stride)
    box = (ctypes.c_uint32 * 2)(geometry.box_inner, geometry.box_outer)
    element_strides = (ctypes.c_uint32 * 2)(1, 1)
    return (DATA_TYPES[dtype], 2, ctypes.c_void_p(pointer), dims, strides, box, element_strides, 0,
            SWIZZLE[geometry.swizzle], L2_PROMOTION_128B, 0)


class TensorMaps:
    """Device copies of encoded descriptors, LRU-cached by (device, address, geometry, dtype)."""

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._encode: Any = None

    def _encoder(self) -> Any:
        if self._encode is None:
            try:
                driver = ctypes.CDLL("libcuda.so.1")
            except OSError as err:
                raise DeviceError(f"the CUDA driver (libcuda.so.1) could not be loaded: {err}") from None
            encode = driver.cuTensorMapEncodeTiled
            encode.restype = ctypes.c_int
            self._encode = encode
        return self._encode

    def __call__(self, cp: Any, pointer: int, geometry: TensorMapGeometry, dtype: str) -> int:
        key = (cp.cuda.Device().id, pointer, geometry, dtype)
        with self._lock:
            found = self._maps.get(key)
            if found is not None:
                self._maps.move_to_end(key)
                return found.data.ptr
        arguments = encode_arguments(pointer, geometry, dtype)
        host = (ctypes.c_uint64 * 16)()  # CUtensorMap: 128 bytes, 64-byte aligned on the host
        status = self._encoder()(ctypes.byref(host), *arguments)
        if status != 0:
            raise DeviceError(f"cuTensorMapEncodeTiled failed with CUresult {status} for {geometry}")
        device = cp.asarray(np.frombuffer(bytes(host), dtype=np.uint8))
        with self._lock:
            self._maps[key] = device
            while len(self._maps) > CACHED:
                self._maps.popitem(last=False)
        return device.data.ptr


TENSOR_MAPS = TensorMaps()
