"""``DtypeKernel``: what ``compile(..., dtype=None)`` (the default) returns: one kernel per operand dtype.

Like numba's and torch.compile's dispatch, the kernel takes its dtype from
the operands at call time and builds (once per dtype, through
``compile(..., dtype=d)``'s cache, so an explicit-dtype kernel of the same
expression is the same object) the kernel of that dtype.  The rule is strict,
never a promotion: every operand that has a dtype (arrays, sparse tensors,
scipy matrices, numpy scalars, torch tensors) must have the same one, else
``DTypeError`` names the operands that disagree; nothing is ever cast.
Python ``int``/``float`` operands have no dtype: they are checked against the
chosen one, as for an explicit-dtype kernel.  ``out=`` does not choose (a
float16 kernel may write float32 sums); the chosen kernel checks it.

What needs one dtype (``.spec``, ``.signature``, ``.ir``, ``.specialize``
without ``dtype=``, ``sm.export``) uses the current one: float64 (what
``compile`` assumed before; ``out_dtype`` when one is given) until a call
or ``.specialize(shapes, dtype=...)`` picks another, as ``.signature`` and
``.ir`` always describe the most recent specialization.  ``kernel_for(d)``
is the kernel of one dtype (to export it, for one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.dtypes import check_dtype
from sparse_mlir.errors import DTypeError
from sparse_mlir.runtime.calls import kernel_call
from sparse_mlir.runtime.kernel import Kernel

__all__ = ["DtypeKernel", "operand_dtype"]

_MIXED = object()  # operands of more than one dtype object: resolved (and refused) by ``operand_dtype``
_numpy_dtypes: dict[Any, np.dtype] = {}  # an operand's ``.dtype`` (numpy, CuPy or torch) -> numpy dtype


def _as_numpy_dtype(name: str, dtype: Any) -> np.dtype:
    """``dtype`` of operand ``name`` as a numpy dtype (torch's ``torch.float32`` included), remembered."""
    known = _numpy_dtypes.get(dtype)
    if known is not None:
        return known
    try:
        converted = np.dtype(dtype)
    except TypeError:
        text = str(dtype)  # torch dtypes print as "torch.float32"
        try:
            converted = np.dtype(text.removeprefix("torch."))
        except TypeError:
            raise DTypeError(f"operand {name} has dtype {text}, which no kernel takes") from None
    _numpy_dtypes[dtype] = converted
    return converted


def operand_dtype(operands: Mapping[str, Any], default: np.dtype) -> np.dtype:
    """The one dtype of ``operands`` (``default`` when none has a dtype); ``DTypeError`` when they disagree."""
    found: np.dtype | None = None
    first = ""
    for name, value in operands.items():
        raw = getattr(value, "dtype", None)
        if raw is None:
            continue  # a Python number (checked against the chosen dtype), or what the kernel refuses by type
        dtype = _as_numpy_dtype(name, raw)
        if found is None:
            found, first = dtype, name
        elif dtype != found:
            raise DTypeError(f"operand {name} has dtype {dtype} but {first} has {found}: a kernel runs in one dtype "
                             f"and never casts; convert one of them (e.g. {name}.astype('{found}'))")
    return default if found is None else found


class DtypeKernel(Kernel):
    """A kernel whose dtype is its operands': one ``Kernel`` per dtype, built on first use."""

    def __init__(self, build: Callable[[np.dtype], Kernel], default: Kernel):
        """``build(dtype)`` returns the kernel of one dtype (``api.compile`` with ``dtype=``); ``default`` is
        the one for float64 (or ``out_dtype``), which answers questions asked before any call."""
        super().__init__()
        self._build = build
        self._default = default
        self._kernels: dict[np.dtype, Kernel] = {default.spec.dtype: default}
        # the operands' own ``.dtype`` object -> (kernel, its unwrapped ``__call__``)
        self._by_raw: dict[Any, tuple[Kernel, Callable[..., Any]]] = {}
        self._current = default
        self.target = default.target

    def kernel_for(self, dtype: Any) -> Kernel:
        """The kernel of ``dtype`` (built on first use; ``DTypeError`` for a dtype kernels do not take)."""
        dt = check_dtype(dtype, "kernel dtype")
        kernel = self._kernels.get(dt)
        if kernel is None:
            kernel = self._kernels[dt] = self._build(dt)
        return kernel

    @kernel_call  # torch tensors are converted here, once: the kernel of the dtype is entered past its own wrapper
    def __call__(self, out: Any = None, **operands: Any) -> Any:
        # on every call's fixed cost: operands of one dtype carry the very same dtype object, so the common case is
        # an identity test per operand and one dict lookup; anything else goes through ``operand_dtype``
        found = None
        for value in operands.values():
            raw = getattr(value, "dtype", None)
            if raw is not None and raw is not found:
                if found is not None:
                    found = _MIXED
                    break
                found = raw
        entry = self._by_raw.get(found)
        if entry is None:
            entry = self._resolve(operands, found)
        kernel, call = entry
        self._current = kernel
        result = call(kernel, out, **operands)
        # its C-level call checks the dtype itself, so operands of this dtype go straight to it next time
        self._native_fast = kernel._native_fast
        return result

    def _resolve(self, operands: Mapping[str, Any], raw: Any) -> tuple[Kernel, Callable[..., Any]]:
        """The kernel for these operands' dtype (``DTypeError`` if they disagree) and its ``__call__`` without the
        ``kernel_call`` wrapper this call has been through already, remembered by ``raw``."""
        dtype = operand_dtype(operands, self._default.spec.dtype)
        kernel = self._kernels.get(dtype)
        if kernel is None:
            names = ", ".join(n for n, v in operands.items() if getattr(v, "dtype", None) is not None)
            try:
                kernel = self.kernel_for(dtype)
            except DTypeError as exc:  # say which operands chose the dtype
                raise DTypeError(f"operands {names} are {dtype}: {exc}") from None
        call = type(kernel).__call__
        entry = (kernel, getattr(call, "__wrapped__", call))
        if raw is not _MIXED:  # equal dtypes given as different objects are looked up again each time
            self._by_raw[raw] = entry
        return entry

    @property
    def signature(self) -> Signature:
        return self._current.signature

    @property
    def ir(self) -> dict[str, str]:
        return self._current.ir

    def specialize(self, shapes: Mapping[str, tuple[int, ...]], dtype: Any = None) -> DtypeKernel:
        """Compile the specialization for these shapes and ``dtype`` (by default the current one: float64, or
        ``out_dtype``, before any call) without running it; ``.signature`` and ``.ir`` then describe it."""
        kernel = self._current if dtype is None else self.kernel_for(dtype)
        kernel.specialize(shapes)
        self._current = kernel
        self._native_fast = None  # the next call dispatches (and makes ``_current`` its kernel) again
        return self

    @property
    def stats(self) -> dict[str, int]:
        """The counts of every dtype's kernel, summed (each is shared with ``compile(..., dtype=d)``)."""
        total = dict(self._stats)
        for kernel in self._kernels.values():
            for key, count in kernel.stats.items():
                total[key] = total.get(key, 0) + count
        return total

    @property
    def dtypes(self) -> tuple[np.dtype, ...]:
        """The dtypes built so far, the default first."""
        return tuple(self._kernels)

    def __getattr__(self, name: str) -> Any:
        """Everything else a kernel of one dtype offers (``spec``, ``mlir``, ``schedule``, ``function``...),
        from the kernel of the dtype most recently used (the default before any call)."""
        if name.startswith("__") or name in ("_current", "_default", "_kernels", "_build", "_by_raw"):
            raise AttributeError(name)
        return getattr(self._current, name)

    def __repr__(self) -> str:
        spec = self._current.spec
        fmts = ", ".join(f"{k}={v}" for k, v in spec.formats.items())
        built = ", ".join(map(str, self._kernels))
        return (f"Kernel({spec.expression!r}, formats={{{fmts}}}, dtype=None (from the operands; built: {built}), "
                f"target={self.target!r})")
