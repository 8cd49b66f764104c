"""A stand-in for the slice of CuPy the GPU runtime uses, backed by numpy, recording launches.

It lets CI run ``CudaKernel`` / ``LoadedCudaKernel`` calls end to end (operand
checks, module loading, parameter packing, output zeroing, launch order)
without a GPU; what the kernels compute is checked by the emulation tests
and on a device.  ``install(monkeypatch)`` puts it in ``sys.modules``.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np


class FakeArray:
    """A numpy array with CuPy's ``.data.ptr`` and ``.get()``."""

    __module__ = "cupy"

    def __init__(self, array: np.ndarray):
        self.host = np.ascontiguousarray(array)
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)

    size = property(lambda self: self.host.size)
    shape = property(lambda self: self.host.shape)
    ndim = property(lambda self: self.host.ndim)
    dtype = property(lambda self: self.host.dtype)
    flags = property(lambda self: self.host.flags)

    def fill(self, value: Any) -> None:
        self.host.fill(value)

    def get(self) -> np.ndarray:
        return self.host.copy()

    def astype(self, dtype: Any, copy: bool = True) -> FakeArray:
        return self if self.host.dtype == np.dtype(dtype) and not copy else FakeArray(self.host.astype(dtype))

    def __mul__(self, other: Any) -> FakeArray:
        return FakeArray(self.host * other)


class FakeFunction:
    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        assert all(isinstance(a, np.uint64) for a in args), "every parameter goes as one 64-bit word"
        self.launches.append((self.name, tuple(grid), tuple(block), [int(a) for a in args], shared_mem))


def install(monkeypatch: Any, capability: str = "90") -> types.SimpleNamespace:
    """Make ``import cupy`` give the fake; returns a namespace with ``launches`` and ``modules`` (paths loaded)."""
    record = types.SimpleNamespace(launches=[], modules=[])

    class RawModule:
        def __init__(self, path: str):
            record.modules.append(path)

        def get_function(self, name: str) -> FakeFunction:
            return FakeFunction(name, record.launches)

    cp = types.ModuleType("cupy")
    cp.__version__ = "fake"
    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0, compute_capability=capability),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, CUDARuntimeError=RuntimeError))
    cp.zeros = lambda shape, dtype=float: FakeArray(np.zeros(shape, dtype))
    cp.asarray = lambda a, dtype=None: FakeArray(np.asarray(a, dtype))
    cp.arange = lambda n, dtype=None: FakeArray(np.arange(n, dtype=dtype))
    cp.ndarray = FakeArray
    monkeypatch.setitem(sys.modules, "cupy", cp)
    from sparse_mlir.device_tensor import cupy

    cupy.cache_clear()
    monkeypatch.setattr("sparse_mlir.device_tensor.cupy", lambda: cp)
    monkeypatch.setattr("sparse_mlir.runtime.cuda.cupy", lambda: cp)
    return record
