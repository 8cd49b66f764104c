"""Checking and converting what a caller passes for each operand, before any native code runs."""

from __future__ import annotations

import difflib
from typing import Any

import numpy as np

from sparse_mlir.errors import DeviceError, DTypeError, FormatError, OperandError, ShapeError
from sparse_mlir.formats import Format
from sparse_mlir.tensor.host import SparseTensor, exactly_tensor, share_scipy

__all__ = ["prepare", "check_names", "sparse_operand", "dense_operand", "dense_output", "check_extents", "new_array"]


def _is_cupy(value: Any) -> bool:
    return type(value).__module__.split(".")[0] in ("cupy", "cupyx")


def _is_scipy_sparse(value: Any) -> bool:
    return type(value).__module__.startswith("scipy.sparse")


def check_names(expression: str, inputs: tuple[str, ...], operands: dict[str, Any]) -> None:
    """Raise ``OperandError`` naming missing and unknown (maybe misspelled) operands."""
    if operands.keys() == set(inputs):
        return
    detail = []
    if missing := [n for n in inputs if n not in operands]:
        detail.append(f"missing {', '.join(missing)}")
    if unknown := [n for n in operands if n not in inputs]:
        close = {n: [i for i in inputs if i.lower() == n.lower()] or difflib.get_close_matches(n, inputs, 1)
                 for n in unknown}
        detail.append("unknown " + ", ".join(n + (f" (did you mean {close[n][0]}?)" if close[n] else "")
                                             for n in unknown))
    raise OperandError(f"kernel {expression!r} takes operands {', '.join(inputs)}: {'; '.join(detail)}")


def prepare(expression: str, inputs: tuple[tuple[str, Format | None, int], ...], operands: dict[str, Any],
            dtype: np.dtype, target: str) -> dict[str, SparseTensor | np.ndarray]:
    """Check names, then convert each ``(name, format or None, rank)`` input; inputs are never modified."""
    if len(operands) != len(inputs):
        check_names(expression, tuple(n for n, _, _ in inputs), operands)
    for n, _, _ in inputs:  # a plain loop, not a set per call: this is on every call's fixed cost
        if n not in operands:
            check_names(expression, tuple(n for n, _, _ in inputs), operands)
    return {n: sparse_operand(n, operands[n], fmt, dtype, target) if fmt is not None
            else dense_operand(n, operands[n], rank, dtype, target) for n, fmt, rank in inputs}


def _refuse_device(name: str, value: Any, target: str) -> None:
    if _is_cupy(value):
        raise DeviceError(f"operand {name} is a CuPy array, but this kernel runs on the {target}; "
                          f"use cupy.asnumpy or compile with target='cuda'")


def sparse_operand(name: str, value: Any, declared: Format, dtype: np.dtype, target: str) -> SparseTensor:
    """A ``SparseTensor`` in the declared format (index widths may differ); scipy input is converted."""
    if type(value) is SparseTensor and value.format is declared and value.dtype == dtype:
        return value  # fast path: built in the declared format
    _refuse_device(name, value, target)
    if _is_scipy_sparse(value):
        if value.dtype != dtype:  # before any work, and naming the operand
            raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {dtype}")
        # zero-copy in its own layout (bounds checked on every call, order from scipy's cached flag), else a copy
        shared = share_scipy(value, declared)
        return shared if shared is not None else SparseTensor.from_scipy(value, declared)
    if not isinstance(value, SparseTensor):
        raise OperandError(f"operand {name} is declared {declared}; pass a SparseTensor or a scipy.sparse "
                           f"matrix, got {type(value).__name__}")
    value = exactly_tensor(value)
    if value.format is not declared and value.format.with_widths(declared.pos_width, declared.crd_width) != declared:
        raise FormatError(f"operand {name} is declared {declared}, but the SparseTensor is {value.format}; "
                          f"convert it (e.g. SparseTensor.from_scipy(t.to_scipy(), '{declared}'))")
    if value.dtype != dtype:
        raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {dtype}")
    return value


def dense_operand(name: str, value: Any, rank: int, dtype: np.dtype, target: str) -> np.ndarray:
    """A C-contiguous, aligned array of exactly ``dtype`` (copied only when the layout requires it)."""
    if type(value) is np.ndarray and value.dtype == dtype and value.ndim == rank \
            and value.flags.c_contiguous and value.flags.aligned:
        return value  # fast path
    _refuse_device(name, value, target)
    if isinstance(value, SparseTensor) or _is_scipy_sparse(value):
        raise FormatError(f"operand {name} is dense in this kernel; pass a numpy array, or declare a sparse "
                          f"format for it with formats={{'{name}': ...}}")
    if not isinstance(value, np.ndarray):
        if rank == 0 and isinstance(value, np.generic):
            value = np.asarray(value)  # a numpy scalar carries its dtype: checked like an array below
        elif rank == 0 and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = _exact_scalar(name, value, dtype)
        elif rank == 0 and isinstance(value, (str, bytes, bool, complex)):
            raise DTypeError(f"operand {name} is a 0-d {dtype} operand; pass a Python int or float, or a numpy "
                             f"scalar or 0-d array of {dtype}, got {type(value).__name__} {value!r}")
        else:
            raise OperandError(f"operand {name} must be a numpy array, got {type(value).__name__}")
    value = _plain(value)
    if value.dtype != dtype:
        raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {dtype} "
                         f"(no implicit casts: use .astype)")
    if value.ndim != rank:
        raise ShapeError(f"operand {name} is used with {rank} indices but has shape {value.shape}")
    return np.array(value, order="C", copy=True)  # the kernel needs contiguous, aligned rows


def _exact_scalar(name: str, value: int | float, dtype: np.dtype) -> np.ndarray:
    """A Python number as a 0-d array of ``dtype``, only when the conversion loses nothing.

    Dense operands are never cast, and a Python number has no dtype to check:
    so it is accepted exactly when ``dtype`` represents it (``2.0`` in an int32
    kernel, ``0.5`` in a float32 one), and refused otherwise (``2.7`` in an
    int32 kernel, ``0.1`` in a float32 one, ``2**40`` in an int32 one).
    """
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        exact = (isinstance(value, int) or value.is_integer()) and info.min <= value <= info.max
    else:
        with np.errstate(over="ignore"):
            converted = dtype.type(value)
        # compared as Python numbers (exact for int against float), not in dtype, which would round value too
        exact = float(converted) == value or (value != value and converted != converted)  # NaN stays NaN
    if not exact:
        raise DTypeError(f"operand {name}: {value!r} is not exactly representable as {dtype} (no implicit casts: "
                         f"pass np.{dtype.name}(...) to round it yourself)")
    return np.asarray(value, dtype=dtype)


def dense_output(name: str, out: Any, shape: tuple[int, ...], dtype: np.dtype,
                 args: dict[str, Any] | None = None) -> np.ndarray:
    """The array a dense result is written to: ``out`` (checked) or a new one (the kernel zero-fills it).

    ``out`` must not overlap an operand: kernels are compiled assuming it does not (``noalias``).
    """
    if out is None:
        return new_array(shape, dtype, name)
    if not isinstance(out, np.ndarray):
        raise OperandError(f"out= must be a numpy array, got {type(out).__name__}")
    out = _plain(out)  # a subclass is written through a plain view of its memory (and that view returned)
    if out.dtype != dtype:
        raise DTypeError(f"out= has dtype {out.dtype}, the kernel's dtype is {dtype}")
    if out.shape != shape:
        raise ShapeError(f"out= has shape {out.shape}, but {name} has shape {shape}")
    if not (out.flags.c_contiguous and out.flags.aligned and out.flags.writeable):
        raise OperandError("out= must be a writeable, C-contiguous, aligned array")
    for operand, value in (args or {}).items():
        buffers = value.buffers if isinstance(value, SparseTensor) else (value,)
        if any(np.may_share_memory(out, b) for b in buffers):
            raise OperandError(f"out= overlaps operand {operand}; pass a separate array")
    return out


def _plain(array: np.ndarray) -> np.ndarray:
    """``array`` as a plain ndarray over the same memory: what a kernel reads or writes.  A subclass may report
    another ``dtype`` or ``shape`` than its memory has (a property), and every check must be of the memory:
    one claiming float64 over int8 memory was read, and written, past its end."""
    return array if type(array) is np.ndarray else np.ndarray.view(array, np.ndarray)


def new_array(shape: tuple[int, ...], dtype: np.dtype, name: str) -> np.ndarray:
    """``np.empty(shape, dtype)``, or a ``ShapeError`` naming the result when it cannot be allocated (a DCSR of
    shape (2**40, 4) with two entries asked for an 8 TiB result: numpy's ``MemoryError`` or ``ValueError``)."""
    try:
        return np.empty(shape, dtype=dtype)
    except (MemoryError, ValueError) as exc:
        raise ShapeError(f"the result {name} of shape {shape} ({dtype}) cannot be allocated: {exc}") from None


def check_extents(sources: tuple[tuple[str, tuple[tuple[str, int], ...]], ...],
                  args: dict[str, Any]) -> dict[str, int]:
    """Each index's size, checked equal wherever the index appears (``ShapeError`` names both operands)."""
    extents: dict[str, int] = {}
    for idx, places in sources:
        name, dim = places[0]
        size = args[name].shape[dim]
        for other, odim in places[1:]:
            if args[other].shape[odim] != size:
                raise ShapeError(f"index {idx!r}: {name} dimension {dim} has size {size} but {other} "
                                 f"dimension {odim} has size {args[other].shape[odim]}")
        extents[idx] = size
    return extents
