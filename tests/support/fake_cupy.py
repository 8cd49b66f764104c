"""A stand-in for the slice of CuPy the GPU runtime uses, backed by numpy, recording launches.

It lets CI run ``CudaKernel`` / ``LoadedCudaKernel`` calls and the device
tensor constructors end to end (operand checks, module loading, parameter
packing, output zeroing, launch order, device-side validation and N:M
compression) without a GPU; what the kernels compute is checked by the
emulation tests and on a device.  ``install(monkeypatch)`` puts it in
``sys.modules``.

The stand-in is built from real CuPy (``cupy-cuda13x`` imports without a
GPU), because a hand-written one once let the runtime call ``.ptr`` on a
``RawKernel`` (which has none) and every GPU call crashed on real hardware:

- its modules (``cupy``, ``cupy.cuda``, ``cupy.cuda.driver``, ...) hold only
  names the real module has; any other name is an ``AttributeError``;
- the objects it hands out (``RawModule``, ``RawKernel``, ``Function``,
  ``Device``, ``Stream``, ``Event``) are ``create_autospec`` mocks of the real
  classes with ``spec_set``: an attribute the real class lacks can be neither
  read nor set;
- every function it implements is called through the real signature (from
  ``inspect`` or, for Cython built-ins, the signature line CuPy embeds in the
  docstring), and C-typed arguments are converted as Cython would convert
  them (``intptr_t f`` refuses a kernel object, ``unsigned int`` a negative).
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import itertools
import operator
import re
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import numpy as np

import cupy as real_cupy  # the real package: importable without a GPU, it is the specification here
import cupyx.scipy.sparse as real_sparse

__all__ = ["FakeArray", "FakeSparseMatrix", "build", "install", "device", "fake_tensor_map_encoder",
           "real_signature", "documented_attributes", "MirrorModule"]

# -- the real API as a specification --------------------------------------------------------------------------

# C integer types in Cython signatures and the range Cython converts without OverflowError
_C_INTEGERS = {"int": (-2 ** 31, 2 ** 31), "unsigned int": (0, 2 ** 32), "unsigned": (0, 2 ** 32),
               "long": (-2 ** 63, 2 ** 63), "long long": (-2 ** 63, 2 ** 63), "unsigned long": (0, 2 ** 64),
               "unsigned long long": (0, 2 ** 64), "intptr_t": (-2 ** 63, 2 ** 63), "size_t": (0, 2 ** 64),
               "ssize_t": (-2 ** 63, 2 ** 63), "uintptr_t": (0, 2 ** 64)}
_PYTHON_TYPES = {"str": str, "tuple": tuple, "bytes": bytes, "list": list, "dict": dict}


def _split_top_level(text: str) -> list[str]:
    """Split a parameter list at commas outside brackets (``tuple options=()`` keeps its parentheses)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _docstring_signature(obj: Any) -> tuple[inspect.Signature, dict[str, str]] | None:
    """The signature Cython embeds as the first docstring line (``launchKernel(intptr_t f, ...)``), with C types.

    Cython built-ins have no ``__signature__``, so ``inspect`` and
    ``create_autospec`` would accept any call; this line is what the
    compiled function actually parses.
    """
    doc = (getattr(obj, "__doc__", None) or "").strip()
    found = re.fullmatch(r"[\w.]+\((.*)\)\s*(?:->\s*.+)?", doc.splitlines()[0] if doc else "")
    if found is None:
        return None
    params, c_types, kind = [], {}, inspect.Parameter.POSITIONAL_OR_KEYWORD
    for piece in _split_top_level(found.group(1).replace("\\*", "*")):
        if piece == "/":  # everything before is positional-only (ufuncs: ``absolute(x, /, out=None, *, ...)``)
            params = [p.replace(kind=inspect.Parameter.POSITIONAL_ONLY) for p in params]
            continue
        if piece == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        declaration, _, default_text = piece.partition("=")
        words = declaration.split()
        if words and words[-1].startswith("**"):
            params.append(inspect.Parameter(words[-1][2:], inspect.Parameter.VAR_KEYWORD))
            continue
        if words and words[-1].startswith("*"):
            params.append(inspect.Parameter(words[-1][1:], inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        name, c_type = words[-1], " ".join(words[:-1])
        default: Any = inspect.Parameter.empty
        if default_text:
            try:
                default = ast.literal_eval(default_text.strip())
            except (ValueError, SyntaxError):
                default = default_text.strip()  # a name such as ``None``-like constants: its presence is what counts
        params.append(inspect.Parameter(name, kind, default=default))
        if c_type:
            c_types[name] = c_type
    try:
        return inspect.Signature(params), c_types
    except ValueError:  # a line this parser misreads: no check rather than a wrong one
        return None


def real_signature(obj: Any, *, method: bool = False) -> tuple[inspect.Signature, dict[str, str]] | None:
    """The signature a real CuPy callable checks, and the C types of its parameters; ``None`` if unknowable.

    ``method``: drop ``self`` (the signature of a call through an instance).
    A class gives its constructor's signature.
    """
    found: tuple[inspect.Signature, dict[str, str]] | None
    try:
        found = inspect.signature(obj), {}
        if isinstance(obj, type) and list(found[0].parameters) == ["args", "kwargs"]:
            found = _docstring_signature(obj) or found  # an extension type's __init__ hides its parameters
    except (TypeError, ValueError):
        found = _docstring_signature(obj)
    if found is None:
        return None
    signature, c_types = found
    parameters = list(signature.parameters.values())
    if method and parameters and parameters[0].name == "self":
        signature = signature.replace(parameters=parameters[1:])
    return signature, c_types


def _convert(where: str, name: str, c_type: str, value: Any) -> None:
    """Refuse ``value`` for a parameter of C type ``c_type`` where Cython would (TypeError / OverflowError)."""
    if c_type in _C_INTEGERS:
        if isinstance(value, float):
            raise TypeError(f"{where}: {name} ({c_type}) got a float")
        try:
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{where}: {name} ({c_type}) got {type(value).__name__}, not an integer") from None
        low, high = _C_INTEGERS[c_type]
        if not low <= number < high:
            raise OverflowError(f"{where}: {name} ({c_type}) = {number} is out of range")
    elif c_type in _PYTHON_TYPES and value is not None and not isinstance(value, _PYTHON_TYPES[c_type]):
        raise TypeError(f"{where}: {name} must be {c_type}, not {type(value).__name__}")


def checked(real: Any, implementation: Callable[..., Any], *, method: bool = False) -> Callable[..., Any]:
    """``implementation`` called only as ``real`` may be called: its signature, and its C argument types.

    The result is a ``create_autospec`` of a stub carrying the real
    signature, so calls are also recorded (``.mock.call_args_list``).
    """
    where = getattr(real, "__qualname__", None) or getattr(real, "__name__", repr(real))
    found = real_signature(real, method=method)
    if found is None:
        raise AssertionError(f"no signature for {where}: the stand-in cannot check its calls")
    signature, c_types = found

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("replaced by the side effect")

    stub.__signature__ = signature  # type: ignore[attr-defined]
    stub.__name__ = stub.__qualname__ = where.rsplit(".", 1)[-1]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            if name in c_types:
                _convert(where, name, c_types[name], value)
        return implementation(*args, **kwargs)

    return mock.create_autospec(stub, side_effect=call)


def documented_attributes(cls: type) -> set[str]:
    """Instance attributes a CuPy class documents (``~Stream.ptr``) but sets in ``__init__`` (so not in ``dir``)."""
    return set(re.findall(rf"~{re.escape(cls.__name__)}\.(\w+)", cls.__doc__ or ""))


def _spec_class(cls: type) -> type:
    """``cls`` with its documented instance attributes as class attributes, so ``spec_set`` allows exactly them."""
    extra = documented_attributes(cls) - set(dir(cls))
    if not extra:
        return cls
    return type(cls.__name__, (cls,), {name: None for name in sorted(extra)})


def instance(cls: type, **attributes: Any) -> Any:
    """A ``spec_set`` autospec of an instance of the real ``cls``: only its real attributes exist.

    A method is set by passing a callable for it; it is then called through
    the real method's signature (``checked``).  A method not given raises
    ``NotImplementedError`` rather than returning a mock that would pass for
    a real value.
    """
    spec = _spec_class(cls)
    made = mock.create_autospec(spec, instance=True, spec_set=True)
    for name in dir(cls):
        if name.startswith("_") or name in attributes:
            continue
        member = inspect.getattr_static(cls, name, None)
        if callable(member) and not isinstance(member, (property, type)) and \
                type(member).__name__ not in ("getset_descriptor", "member_descriptor"):
            getattr(made, name).side_effect = NotImplementedError(f"the CuPy stand-in does not implement "
                                                                  f"{cls.__name__}.{name}")
    for name, value in attributes.items():
        member = inspect.getattr_static(cls, name, None)
        if callable(value) and callable(member) and type(member).__name__ not in (
                "getset_descriptor", "member_descriptor") and not isinstance(member, property):
            getattr(made, name).side_effect = checked(getattr(cls, name), value, method=True)
        else:
            setattr(made, name, value)  # spec_set: AttributeError unless the real class has it
    return made


class MirrorModule(types.ModuleType):
    """A module that may hold only names its real counterpart has.

    Setting a name the real module lacks fails when the stand-in is built;
    reading one fails like real CuPy would (``AttributeError``).  A real name
    the stand-in does not set comes from ``fallback`` or is refused as not
    implemented (still ``AttributeError``, with a message that says which).
    """

    def __init__(self, real: types.ModuleType, fallback: Callable[[str], Any] | None = None, **names: Any):
        super().__init__(real.__name__, real.__doc__)
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_fallback", fallback)
        for name, value in names.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if not (name.startswith("__") and name.endswith("__")) and not hasattr(self._real, name):
            raise AttributeError(f"real {self._real.__name__} has no {name!r}: the stand-in may not offer it")
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:  # only for names not set
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if not hasattr(self._real, name):
            raise AttributeError(f"module {self._real.__name__!r} has no attribute {name!r} (real CuPy has none)")
        if self._fallback is not None:
            return self._fallback(name)
        raise AttributeError(f"the CuPy stand-in does not implement {self._real.__name__}.{name}")


# -- arrays ---------------------------------------------------------------------------------------------------

class _MemoryPointer:
    """``cupy.cuda.MemoryPointer`` reduced to ``ptr`` (checked against the real class below)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def _numpy_only(name: str) -> property:
    def refuse(self: Any) -> Any:
        raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r} (numpy has it, CuPy does not)")

    return property(refuse)


class FakeArray(np.ndarray):
    """A numpy array with CuPy's ``.data.ptr`` and ``.get()``, without numpy's attributes that CuPy lacks.

    ``host`` (the numpy view) is the stand-in's own, for tests to read results.
    """

    STAND_IN_ONLY = frozenset({"host", "STAND_IN_ONLY"})

    @property
    def data(self) -> Any:  # type: ignore[override]
        return _MemoryPointer(self.__array_interface__["data"][0])

    @property
    def host(self) -> np.ndarray:
        return np.asarray(self)

    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        return np.array(self, order=order)


_REFUSED = frozenset(n for n in set(dir(np.ndarray)) - set(dir(real_cupy.ndarray)) if not n.startswith("_"))
for _name in _REFUSED:
    setattr(FakeArray, _name, _numpy_only(_name))  # ctypes, resize, setflags, ...
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


# -- the driver -----------------------------------------------------------------------------------------------

class FakeDriver:
    """``cuLaunchKernel``: reads the parameter words through the address array, as the driver does.

    ``functions`` maps a ``Function.ptr`` (the ``CUfunction``) to the kernel's
    name and parameter count; anything else passed as ``f`` is refused.
    """

    def __init__(self, launches: list):
        self.launches = launches
        self.functions: dict[int, types.SimpleNamespace] = {}

    def launchKernel(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, stream: int,
                     params: int, extra: int) -> None:
        assert f in self.functions, f"launchKernel: {f!r} is not a loaded CUfunction (Function.ptr)"
        function = self.functions[f]
        assert params and not extra and stream == 0
        addresses = (ctypes.c_uint64 * function.params).from_address(params)
        words = [ctypes.c_uint64.from_address(a).value for a in addresses]
        self.launches.append((function.name, (gx, gy, gz), (bx, by, bz), words, shared))

    def funcSetAttribute(self, f: int, attribute: int, value: int) -> None:
        assert f in self.functions, f"funcSetAttribute: {f!r} is not a loaded CUfunction (Function.ptr)"
        assert attribute == 8 and 48 * 1024 < value <= 227 * 1024  # dynamic shared bytes
        self.functions[f].shared_limit = value


def fake_tensor_map_encoder(*args: Any) -> int:
    """``cuTensorMapEncodeTiled`` as the runtime calls it through ctypes: checks the argument kinds, fills bytes."""
    out, dtype, rank, base, dims, strides, box, steps, interleave, swizzle, promotion, fill = args
    assert rank == 2 and len(dims) == 2 and len(strides) == 1 and len(box) == 2 and len(steps) == 2
    assert strides[0] >= dims[0] * 2 and strides[0] % 16 == 0 and base.value % 16 == 0
    ctypes.memmove(ctypes.addressof(out._obj), bytes(range(128)), 128)  # out is ctypes.byref(the host CUtensorMap)
    return 0


# -- numpy behind CuPy's names --------------------------------------------------------------------------------

def _numpy_function(name: str) -> Any:
    """``cupy.NAME`` as numpy's, returning fake arrays, called through real CuPy's signature where it has one."""
    if not hasattr(np, name):
        raise AttributeError(f"the CuPy stand-in does not implement cupy.{name} (numpy has no {name})")
    found = getattr(np, name)
    if isinstance(found, type) or not callable(found):
        return found
    spec = real_signature(getattr(real_cupy, name))

    def call(*args: Any, **kwargs: Any) -> Any:
        if spec is not None:
            spec[0].bind(*args, **kwargs)  # e.g. numpy's argsort(stable=...) is not CuPy's
        result = found(*args, **kwargs)
        return result.view(FakeArray) if isinstance(result, np.ndarray) else result

    return call


class FakeSparseMatrix:
    """``cupyx.scipy.sparse.csr_matrix``: ``(data, indices, indptr)`` with ``shape``, or a dense array; scipy computes."""

    format = "csr"

    def __init__(self, arg: Any, shape: tuple[int, int] | None = None):
        import scipy.sparse as sp

        if isinstance(arg, tuple):
            matrix = sp.csr_matrix(tuple(np.asarray(a) for a in arg), shape=shape)
        elif isinstance(arg, np.ndarray):
            matrix = sp.csr_matrix(np.asarray(arg), shape=shape)
        else:
            matrix = arg
        self.shape = matrix.shape
        self._host = matrix
        self.indptr, self.indices, self.data = (device(matrix.indptr), device(matrix.indices), device(matrix.data))

    def __matmul__(self, other: Any) -> FakeArray:
        return device(self._host @ np.asarray(other))

    def toarray(self) -> FakeArray:
        return device(self._host.toarray())


FakeSparseMatrix.__module__ = "cupyx.scipy.sparse._csr"


def _check_surfaces() -> None:
    """The hand-written classes offer nothing their real counterparts lack (``STAND_IN_ONLY`` aside)."""
    pairs = [(FakeArray, real_cupy.ndarray), (FakeSparseMatrix, real_sparse.csr_matrix),
             (_MemoryPointer, real_cupy.cuda.MemoryPointer)]
    for fake, real in pairs:
        own = {n for n in vars(fake) if not n.startswith("_")} - _REFUSED - getattr(fake, "STAND_IN_ONLY", set())
        extra = sorted(n for n in own if not hasattr(real, n))
        assert not extra, f"{fake.__name__} offers {extra} that real {real.__name__} does not have"


_check_surfaces()


# -- the modules ----------------------------------------------------------------------------------------------

def build(capability: str = "90") -> tuple[types.ModuleType, dict[str, types.ModuleType], types.SimpleNamespace]:
    """The fake ``cupy`` module, the ``cupyx`` modules, and the record of module loads and launches."""
    record = types.SimpleNamespace(launches=[], modules=[])
    rc = real_cupy.cuda
    fake_driver = FakeDriver(record.launches)
    handles = itertools.count(0x7F0000001000, 0x40)

    def load_module(code: Any = None, *, path: Any = None, **options: Any) -> Any:
        assert code is None and path is not None, "the runtime loads compiled modules from files"
        record.modules.append(path)
        ptx = Path(path).with_suffix(".ptx").read_text()  # a cubin's PTX lies beside it
        return instance(real_cupy.RawModule, get_function=lambda name: get_function(ptx, name))

    def get_function(ptx: str, name: str) -> Any:
        handle = next(handles)  # a CUfunction-looking address, new for each load (as the driver's are)
        fake_driver.functions[handle] = types.SimpleNamespace(name=name, params=_entry_params(ptx, name))
        function = instance(rc.function.Function, ptr=handle)
        return instance(real_cupy.RawKernel, kernel=function, name=name)

    raw_module = mock.create_autospec(real_cupy.RawModule, spec_set=True,
                                      side_effect=checked(real_cupy.RawModule, load_module))
    the_device = instance(rc.Device, id=0, compute_capability=capability, synchronize=lambda: None)
    times: dict[int, float] = {}

    def event(block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> Any:
        made = instance(rc.Event, ptr=0)
        made.record.side_effect = checked(rc.Event.record,
                                          lambda stream=None: times.__setitem__(id(made), time.perf_counter()),
                                          method=True)
        made.synchronize.side_effect = checked(rc.Event.synchronize, lambda: None, method=True)
        return made

    driver = MirrorModule(rc.driver,
                          launchKernel=checked(rc.driver.launchKernel, fake_driver.launchKernel),
                          funcSetAttribute=checked(rc.driver.funcSetAttribute, fake_driver.funcSetAttribute))
    runtime = MirrorModule(rc.runtime,
                           getDeviceCount=checked(rc.runtime.getDeviceCount, lambda: 1),
                           CUDARuntimeError=rc.runtime.CUDARuntimeError,
                           free=checked(rc.runtime.free, lambda ptr: None),
                           getDeviceProperties=checked(rc.runtime.getDeviceProperties,
                                                       lambda device: {"name": b"stand-in"}))
    stream = instance(rc.Stream, ptr=0, device_id=-1)
    cuda = MirrorModule(rc, driver=driver, runtime=runtime,
                        Device=checked(rc.Device, lambda device=None: the_device),
                        Event=checked(rc.Event, event),
                        get_elapsed_time=checked(rc.get_elapsed_time,
                                                 lambda start_event, end_event:
                                                 (times[id(end_event)] - times[id(start_event)]) * 1e3),
                        get_current_stream=checked(rc.get_current_stream, lambda device_id=-1: stream))

    rng = np.random.default_rng(0)

    def seed(seed: Any = None) -> None:
        nonlocal rng
        rng = np.random.default_rng(seed)

    random = MirrorModule(
        real_cupy.random,
        seed=checked(real_cupy.random.seed, seed),
        standard_normal=checked(real_cupy.random.standard_normal, lambda size=None, dtype=float:
                                device(rng.standard_normal(size).astype(dtype))),
        randint=checked(real_cupy.random.randint, lambda low, high=None, size=None, dtype="l":
                        device(rng.integers(low, high, size).astype(dtype))),
        random_sample=checked(real_cupy.random.random_sample, lambda size=None, dtype=float:
                              device(rng.random(size).astype(dtype))))
    cp = MirrorModule(real_cupy, _numpy_function,  # zeros, arange, argsort, diff, ... as numpy, returning fake arrays
                      RawModule=raw_module, cuda=cuda, random=random,
                      asarray=checked(real_cupy.asarray, lambda a, dtype=None, order=None, *, blocking=False:
                                      device(np.asarray(a, dtype))),
                      asnumpy=checked(real_cupy.asnumpy, lambda a, stream=None, order="C", out=None, *,
                                      blocking=True: np.asarray(a)))
    cp.__version__ = "stand-in for " + real_cupy.__version__
    import cupyx
    import cupyx.scipy

    sparse = MirrorModule(real_sparse, csr_matrix=FakeSparseMatrix)
    scipy_module = MirrorModule(cupyx.scipy, sparse=sparse)
    cupyx_modules = {"cupyx": MirrorModule(cupyx, scipy=scipy_module), "cupyx.scipy": scipy_module,
                     "cupyx.scipy.sparse": sparse}
    return cp, cupyx_modules, record


def install(monkeypatch: Any, capability: str = "90") -> types.SimpleNamespace:
    """Make ``import cupy`` give the fake; returns a namespace with ``launches`` and ``modules`` (paths loaded)."""
    cp, cupyx, record = build(capability)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    for name, module in cupyx.items():
        monkeypatch.setitem(sys.modules, name, module)
    for module in ("sparse_mlir.tensor.device", "sparse_mlir.runtime.launch", "sparse_mlir.runtime.torch_tensors"):
        monkeypatch.setattr(f"{module}.cupy", lambda: cp)  # every module that imported the package's loader
    monkeypatch.setattr("sparse_mlir.runtime.tensor_maps.TENSOR_MAPS._encode", fake_tensor_map_encoder)
    # a fresh stand-in is a fresh device: kernels compiled before it (sm.compile keeps them per process) hold
    # modules loaded into an earlier stand-in, so this test starts from kernels of its own
    monkeypatch.setattr("sparse_mlir.api._kernels", {})
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
