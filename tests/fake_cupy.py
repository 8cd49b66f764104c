"""A stand-in for the slice of CuPy the GPU runtime uses, backed by numpy, recording launches.

It lets CI run ``CudaKernel`` / ``LoadedCudaKernel`` calls and the device
tensor constructors end to end (operand checks, module loading, parameter
packing, output zeroing, launch order, device-side validation and N:M
compression) without a GPU; what the kernels compute is checked by the
emulation tests and on a device.  ``install(monkeypatch)`` puts it in
``sys.modules``.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np


class FakeArray(np.ndarray):
    """A numpy array with CuPy's ``.data.ptr`` and ``.get()``."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def host(self) -> np.ndarray:
        return np.asarray(self)

    def get(self) -> np.ndarray:
        return np.array(self)


FakeArray.__module__ = "cupy"


def device(array: Any) -> FakeArray:
    return np.ascontiguousarray(array).view(FakeArray)


class FakeCSR:
    """``cupyx.scipy.sparse.csr_matrix`` over fake device arrays."""

    format = "csr"

    def __init__(self, matrix: Any):
        self.shape = matrix.shape
        self.indptr, self.indices, self.data = (device(matrix.indptr), device(matrix.indices), device(matrix.data))


FakeCSR.__module__ = "cupyx.scipy.sparse._csr"


class FakeFunction:
    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        assert all(isinstance(a, np.uint64) for a in args), "every parameter goes as one 64-bit word"
        self.launches.append((self.name, tuple(grid), tuple(block), [int(a) for a in args], shared_mem))


def _numpy_function(name: str) -> Any:
    found = getattr(np, name)
    if isinstance(found, type) or not callable(found):
        return found

    def call(*args: Any, **kwargs: Any) -> Any:
        result = found(*args, **kwargs)
        return result.view(FakeArray) if isinstance(result, np.ndarray) else result

    return call


def install(monkeypatch: Any, capability: str = "90") -> types.SimpleNamespace:
    """Make ``import cupy`` give the fake; returns a namespace with ``launches`` and ``modules`` (paths loaded)."""
    record = types.SimpleNamespace(launches=[], modules=[])

    class RawModule:
        def __init__(self, path: str):
            record.modules.append(path)

        def get_function(self, name: str) -> FakeFunction:
            return FakeFunction(name, record.launches)

    cp = types.ModuleType("cupy")
    cp.__getattr__ = _numpy_function  # zeros, arange, argsort, diff, ... as numpy, returning fake arrays
    cp.__version__ = "fake"
    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0, compute_capability=capability),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, CUDARuntimeError=RuntimeError))
    cp.asarray = lambda a, dtype=None: device(np.asarray(a, dtype))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr("sparse_mlir.device_tensor.cupy", lambda: cp)
    monkeypatch.setattr("sparse_mlir.runtime.cuda.cupy", lambda: cp)
    return record
