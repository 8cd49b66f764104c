"""Operands of GPU kernels: CuPy arrays and ``DeviceSparseTensor``s, checked, never copied behind the caller's back.

A host array or matrix is refused with the one call that moves it; a
``cupyx.scipy.sparse`` matrix is wrapped (checked on every call).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparse_mlir.errors import DeviceError, DTypeError, FormatError, OperandError, ShapeError
from sparse_mlir.formats import Format
from sparse_mlir.runtime.operands import check_names
from sparse_mlir.tensor.device import DeviceSparseTensor
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["device_operands", "checked_device_output"]


def _is_cupy_array(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "cupy" and hasattr(value, "data") and hasattr(value, "ndim")


def device_operands(expression: str, inputs: tuple[tuple[str, Format | None, int], ...], operands: dict[str, Any],
                    dtype: np.dtype) -> dict[str, Any]:
    """Check each operand is on the device with the declared format, dtype and rank; nothing is copied."""
    check_names(expression, tuple(n for n, _, _ in inputs), operands)
    out: dict[str, Any] = {}
    for name, fmt, rank in inputs:
        value = operands[name]
        if fmt is not None:
            value = _sparse_operand(name, value, fmt, dtype)
        elif not _is_cupy_array(value):
            if isinstance(value, (np.ndarray, SparseTensor, DeviceSparseTensor)):
                raise DeviceError(f"operand {name} is a {type(value).__name__}; this kernel runs on the GPU and "
                                  f"takes CuPy arrays for dense operands (cupy.asarray copies once)")
            raise OperandError(f"operand {name} must be a CuPy array, got {type(value).__name__}")
        else:
            if value.dtype != dtype:
                raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {dtype}")
            if value.ndim != rank:
                raise ShapeError(f"operand {name} is used with {rank} indices but has shape {value.shape}")
            if not value.flags.c_contiguous:
                raise OperandError(f"operand {name} must be C-contiguous (cupy.ascontiguousarray)")
        out[name] = value
    return out


def _sparse_operand(name: str, value: Any, declared: Format, dtype: np.dtype) -> DeviceSparseTensor:
    if isinstance(value, SparseTensor) or type(value).__module__.startswith("scipy.sparse"):
        raise DeviceError(f"operand {name} is on the host; move it once with SparseTensor.to('cuda') "
                          f"(or pass a cupyx.scipy.sparse matrix)")
    if type(value).__module__.startswith("cupyx.scipy.sparse"):
        value = DeviceSparseTensor.from_cupyx(value, declared)  # checked on every call: convert once instead
    if not isinstance(value, DeviceSparseTensor):
        raise OperandError(f"operand {name} is declared {declared}; pass a DeviceSparseTensor or a cupyx sparse "
                           f"matrix, got {type(value).__name__}")
    if value.format != declared and value.format.with_widths(declared.pos_width, declared.crd_width) != declared:
        raise FormatError(f"operand {name} is declared {declared}, but the tensor is {value.format}")
    if value.dtype != dtype:
        raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {dtype}")
    return value


def checked_device_output(name: str, out: Any, shape: tuple[int, ...], dtype: np.dtype,
                          args: dict[str, Any]) -> Any:
    """``out`` checked, or ``None``: it must not overlap an operand of ``args``, because ``GpuFunction`` zeroes it
    before the launch when its kernels accumulate (``out=B`` zeroed the caller's ``B`` and the kernel read
    zeros)."""
    if out is None:
        return None
    if not _is_cupy_array(out):
        raise OperandError(f"out= must be a CuPy array, got {type(out).__name__}")
    if out.dtype != dtype:
        raise DTypeError(f"out= has dtype {out.dtype}, the kernel's output dtype is {dtype}")
    if tuple(out.shape) != shape:
        raise ShapeError(f"out= has shape {tuple(out.shape)}, but {name} has shape {shape}")
    if not out.flags.c_contiguous:
        raise OperandError("out= must be C-contiguous")
    first, end = _device_span(out)
    for operand, value in args.items():
        buffers = value.buffers if isinstance(value, DeviceSparseTensor) else (value,)
        if any(b_first < end and first < b_end for b_first, b_end in map(_device_span, buffers)):
            raise OperandError(f"out= overlaps operand {operand}; pass a separate array")
    return out


def _device_span(array: Any) -> tuple[int, int]:
    """The device bytes ``[first, end)`` a CuPy array can reach, from its pointer, shape and strides (what
    ``numpy.may_share_memory`` compares on the host)."""
    start = int(array.data.ptr)
    if array.size == 0:
        return start, start
    low = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s > 0)
    return start + low, start + high + array.itemsize


