"""A stand-in for the slice of CuPy the GPU runtime uses, backed by numpy, recording launches.

It lets CI run ``CudaKernel`` / ``LoadedCudaKernel`` calls and the device
tensor constructors end to end (operand checks, module loading, parameter
packing, output zeroing, launch order, device-side validation and N:M
compression) without a GPU; what the kernels compute is checked by the
emulation tests and on a device.  ``install(monkeypatch)`` puts it in
``sys.modules``.
"""

from __future__ import annotations

import ctypes
import re
import sys
import types
from pathlib import Path
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


def _entry_params(ptx: str, name: str) -> int:
    """How many parameters the PTX entry ``name`` declares (each must be one 64-bit word)."""
    found = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    assert found is not None, f"no entry {name} in the PTX"
    params = re.findall(r"\.param\s+\.(\w+)", found.group(1))
    assert all(p in ("u64", "b64", "s64") for p in params), f"{name}: a parameter is not one 64-bit word: {params}"
    return len(params)


class FakeFunction:
    """A kernel of a loaded module: ``ptr`` is its handle for ``cuda.driver.launchKernel``."""

    def __init__(self, name: str, params: int):
        self.name, self.params = name, params
        self.ptr = id(self)


class FakeDriver:
    """``cuLaunchKernel``: reads the parameter words through the address array, as the driver does."""

    def __init__(self, launches: list):
        self.launches = launches
        self.functions: dict[int, FakeFunction] = {}

    def launchKernel(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, stream: int,
                     params: int, extra: int) -> None:
        function = self.functions[f]
        assert params and not extra and stream == 0
        addresses = (ctypes.c_uint64 * function.params).from_address(params)
        words = [ctypes.c_uint64.from_address(a).value for a in addresses]
        self.launches.append((function.name, (gx, gy, gz), (bx, by, bz), words, shared))

    def funcSetAttribute(self, f: int, attribute: int, value: int) -> None:
        assert f in self.functions and attribute == 8 and 48 * 1024 < value <= 227 * 1024  # dynamic shared bytes
        self.functions[f].shared_limit = value


def fake_tensor_map_encoder(*args: Any) -> int:
    """``cuTensorMapEncodeTiled`` as the runtime calls it through ctypes: checks the argument kinds, fills bytes."""
    out, dtype, rank, base, dims, strides, box, steps, interleave, swizzle, promotion, fill = args
    assert rank == 2 and len(dims) == 2 and len(strides) == 1 and len(box) == 2 and len(steps) == 2
    assert strides[0] >= dims[0] * 2 and strides[0] % 16 == 0 and base.value % 16 == 0
    ctypes.memmove(ctypes.addressof(out._obj), bytes(range(128)), 128)  # out is ctypes.byref(the host CUtensorMap)
    return 0


def _numpy_function(name: str) -> Any:
    found = getattr(np, name)
    if isinstance(found, type) or not callable(found):
        return found

    def call(*args: Any, **kwargs: Any) -> Any:
        result = found(*args, **kwargs)
        return result.view(FakeArray) if isinstance(result, np.ndarray) else result

    return call


class _Event:
    def __init__(self) -> None:
        self.time = 0.0

    def record(self) -> None:
        import time

        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass


class FakeSparseMatrix:
    """``cupyx.scipy.sparse.csr_matrix((data, indices, indptr), shape)`` computing with scipy."""

    format = "csr"

    def __init__(self, arg: Any, shape: tuple[int, int] | None = None):
        import scipy.sparse as sp

        matrix = sp.csr_matrix(tuple(np.asarray(a) for a in arg), shape=shape) if isinstance(arg, tuple) else arg
        self.shape = matrix.shape
        self.host = matrix
        self.indptr, self.indices, self.data = (device(matrix.indptr), device(matrix.indices), device(matrix.data))

    def __matmul__(self, other: Any) -> FakeArray:
        return device(self.host @ np.asarray(other))

    def toarray(self) -> FakeArray:
        return device(self.host.toarray())


FakeSparseMatrix.__module__ = "cupyx.scipy.sparse._csr"


def build(capability: str = "90") -> tuple[types.ModuleType, dict[str, types.ModuleType], types.SimpleNamespace]:
    """The fake ``cupy`` module, the ``cupyx`` modules, and the record of module loads and launches."""
    record = types.SimpleNamespace(launches=[], modules=[])

    driver = FakeDriver(record.launches)

    class RawModule:
        def __init__(self, path: str):
            record.modules.append(path)
            self.ptx = Path(path).with_suffix(".ptx").read_text()  # a cubin's PTX lies beside it

        def get_function(self, name: str) -> FakeFunction:
            function = FakeFunction(name, _entry_params(self.ptx, name))
            driver.functions[function.ptr] = function
            return function

    rng = np.random.default_rng(0)
    cp = types.ModuleType("cupy")
    cp.__getattr__ = _numpy_function  # zeros, arange, argsort, diff, ... as numpy, returning fake arrays
    cp.__version__ = "fake"
    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0, compute_capability=capability, synchronize=lambda: None),
        Event=_Event, get_elapsed_time=lambda start, stop: (stop.time - start.time) * 1e3, driver=driver,
        get_current_stream=lambda: types.SimpleNamespace(ptr=0),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, CUDARuntimeError=RuntimeError, free=lambda ptr: None,
                                      getDeviceProperties=lambda i: {"name": b"stand-in"}))
    cp.asarray = lambda a, dtype=None: device(np.asarray(a, dtype))
    cp.random = types.SimpleNamespace(
        standard_normal=lambda size, dtype=np.float64: device(rng.standard_normal(size).astype(dtype)),
        randint=lambda low, high, size, dtype=np.int64: device(rng.integers(low, high, size).astype(dtype)),
        random_sample=lambda size: device(rng.random(size)))
    sparse = types.ModuleType("cupyx.scipy.sparse")
    sparse.csr_matrix = FakeSparseMatrix
    cupyx = {"cupyx": types.ModuleType("cupyx"), "cupyx.scipy": types.ModuleType("cupyx.scipy"),
             "cupyx.scipy.sparse": sparse}
    return cp, cupyx, record


def install(monkeypatch: Any, capability: str = "90") -> types.SimpleNamespace:
    """Make ``import cupy`` give the fake; returns a namespace with ``launches`` and ``modules`` (paths loaded)."""
    cp, cupyx, record = build(capability)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    for name, module in cupyx.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("sparse_mlir.device_tensor.cupy", lambda: cp)
    monkeypatch.setattr("sparse_mlir.runtime.cuda.cupy", lambda: cp)
    monkeypatch.setattr("sparse_mlir.runtime.tensor_maps.TENSOR_MAPS._encode", fake_tensor_map_encoder)
    return record


if __name__ == "__main__":  # python fake_cupy.py SCRIPT ARGS...: run a script against the stand-in
    import runpy

    cp, cupyx, _ = build()
    sys.modules["cupy"] = cp
    sys.modules.update(cupyx)
    from sparse_mlir.runtime.tensor_maps import TENSOR_MAPS

    TENSOR_MAPS._encode = fake_tensor_map_encoder
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
