"""The C-level call path of shape-generic CPU kernels: a cached call at scipy's cost.

A call through the Python checks and ctypes costs 6-10 us before the kernel
does any work (``benchmarks/call_path.py``); scipy's ``A @ x`` costs about
2 us, so small SpMVs lost to scipy on call cost alone.  ``fast_call.c``
(compiled once per machine into the kernel cache by ``driver.python_extension``)
runs the checks of the common case in C and calls the kernel's C entry point
directly, with the GIL released.

The contract that keeps this safe and keeps every error message in one place:
the C path accepts a call only when every operand is exactly what it checks
for (see the file's header) and otherwise returns ``NotImplemented``, with
nothing changed; the caller (``runtime.calls.kernel_call``) then runs the
Python path, which raises the error that names the problem.  A plan is
offered only for what the C path fully covers: shape-generic specializations
(every size is a run-time parameter, so no shape can be "wrong" for the
library), with a dense result or a sparse one (whose buffers the entry point
allocates), on x86-64 and AArch64 (where pointers and ``int64_t`` are
passed alike).

Off with ``SPARSE_MLIR_FAST_CALL=0``; when the module cannot be built here
(no Python headers, no C compiler), ``unavailable()`` says why and every call
takes the Python path.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.compiler import driver
from sparse_mlir.errors import SparseMLIRError
from sparse_mlir.formats import CSR, Format
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime.kernel import extent_sources
from sparse_mlir.runtime.library import NativeFunction
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["MODULE", "plan", "unavailable"]

MODULE = "sparse_mlir_fast_call"
SOURCE = Path(__file__).with_name("fast_call.c")
_MACHINES = ("x86_64", "amd64", "aarch64", "arm64")

_lock = threading.Lock()
_module: ModuleType | None = None
_why_not: str | None = None  # why the module is not available (None: not tried yet, or available)
_tried = False


def unavailable() -> str | None:
    """Why calls take the Python path (turned off, or the module could not be built here), or ``None``."""
    if not knobs.fast_call():
        return "turned off (SPARSE_MLIR_FAST_CALL=0)"
    _extension()
    return _why_not


def _extension() -> ModuleType | None:
    """The compiled module, built and loaded on first use (``None`` when it cannot be: see ``unavailable``)."""
    global _module, _why_not, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            if platform.machine().lower() not in _MACHINES:
                _why_not = f"this machine ({platform.machine()}) may pass pointers and integers differently"
            else:
                try:
                    _module = _load(driver.python_extension(SOURCE, MODULE))
                except (SparseMLIRError, OSError, ImportError) as exc:
                    _why_not = f"the C call path could not be built here: {exc}"
            _tried = True
    return _module


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _scipy_layout(fmt: Format) -> tuple[tuple[type, ...], np.dtype | None, int]:
    """The scipy classes used in place for an operand of ``fmt`` (``indptr``/``indices`` of ``fmt``'s one index
    width), that dtype, and the dimension ``indptr`` runs over; no classes when scipy is not loaded (then no
    operand can be a scipy matrix yet: the owner builds the plan again once it is) or ``fmt`` is another layout."""
    sparse = sys.modules.get("scipy.sparse")
    width = fmt.pos_width
    if sparse is None or width not in (32, 64) or fmt.crd_width != width:
        return (), None, 0
    if fmt == CSR.with_widths(width, width):  # the one layout a shape-generic kernel takes from scipy as it is
        return (sparse.csr_array, sparse.csr_matrix), np.dtype(f"int{width}"), 0
    return (), None, 0


def plan(native: NativeFunction, formats: dict[str, Format]) -> Any | None:
    """The C-level call of one loaded specialization (``.call(operands, out)``; ``.close()`` before its library
    is unloaded), or ``None`` when the C path does not cover it.

    ``formats`` are the very ``Format`` objects the specialization was built for: a ``SparseTensor`` operand
    is taken when its ``format`` is that object.
    """
    sig: Signature = native.signature
    module = _extension() if knobs.fast_call() else None
    result_buffers = sig.result_buffers() if sig.output.sparse else []
    if module is None or not sig.shape_generic or len(sig.inputs) > module.MAX_OPERANDS or \
            len(sig.params()) > module.MAX_PARAMS or any(len(op.shape) > module.MAX_RANK for op in sig.operands) or \
            len(result_buffers) > module.MAX_RESULT_BUFFERS:
        return None
    position = {op.name: i for i, op in enumerate(sig.inputs)}
    sources = dict(extent_sources(sig.inputs))
    order = list(sources)
    try:
        out_extents = tuple(order.index(idx) for idx in sig.output.index)
    except ValueError:  # an output index no input has: not a kernel this path knows
        return None
    operands = []
    for op in sig.inputs:
        dtype = np.dtype(op.dtype.name)  # numpy's own object for the type: compared by identity in C
        if op.sparse:
            types, index_dtype, outer = _scipy_layout(formats[op.name])
            operands.append((op.name, 1, dtype, len(op.shape), formats[op.name], len(op.buffers()), op.size_params,
                             types, index_dtype, outer))
        else:
            operands.append((op.name, 0, dtype, len(op.shape), None, 0, (), (), None, 0))
    extents = tuple(tuple((position[name], dim) for name, dim in sources[idx]) for idx in order)
    address = ctypes.cast(native.function, ctypes.c_void_p).value
    out = (np.dtype(sig.output.dtype.name), out_extents)
    if sig.output.sparse:
        out += (len(result_buffers), native.adopt_result)
    choice = native.thread_choice.before_call if native.thread_choice is not None else None
    return module.FastCall(address, native, choice, np.empty, np.ndarray,
                           SparseTensor, tuple(operands), extents, out)



class Planner:
    """The C-level call of one ``NativeFunction``, built on first use and built again when what it was built
    for changed: the operands' ``Format`` objects, or scipy loaded since (its matrices are then taken in place).
    """

    def __init__(self, native: NativeFunction):
        self.native = native
        self._plan: Any | None = None
        self._built_for: tuple | None = None

    def call_for(self, formats: dict[str, Format]) -> Any | None:
        """The plan's ``call`` for operands of these formats, or ``None`` where the C path does not apply."""
        built_for = (tuple((name, id(fmt)) for name, fmt in formats.items()), "scipy.sparse" in sys.modules)
        if built_for != self._built_for:
            self.close()
            self._plan, self._built_for = plan(self.native, formats), built_for
        return None if self._plan is None else self._plan.call

    @property
    def calls(self) -> int:
        """Calls the current plan ran (0 without one)."""
        return 0 if self._plan is None else self._plan.calls

    @property
    def current(self) -> Any | None:
        """The current plan object (``None`` before the first call or where the C path does not apply)."""
        return self._plan

    def close(self) -> None:
        """Stop the current plan (its library is about to be unloaded, or it is being replaced)."""
        if self._plan is not None:
            self._plan.close()
