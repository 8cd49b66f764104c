"""The element and index dtypes kernels use (numpy only): one place every layer checks them against.

Low in the stack on purpose: the planner (``dsl``), tensors (``tensor``), the C
ABI (``abi``) and file readers (``io``) all check dtypes, and none of them may
import another just for that.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from sparse_mlir.errors import DTypeError, SparseMLIRError

__all__ = ["SUPPORTED_DTYPES", "check_dtype", "index_dtype", "whole_number"]

SUPPORTED_DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "int32", "int64", "float16"))


def check_dtype(dtype: Any, what: str) -> np.dtype:
    """Return ``dtype`` as a numpy dtype, or raise ``DTypeError`` if kernels cannot use it."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:  # ("f8", -1) and repeated field names raise ValueError
        raise DTypeError(f"{what}: {dtype!r} is not a dtype") from exc
    if dt not in SUPPORTED_DTYPES:
        raise DTypeError(f"{what} has dtype {dt}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    return dt


def index_dtype(width: int) -> np.dtype:
    """numpy dtype of an index buffer of ``width`` bits (0 = MLIR ``index``).

    Signed, and values are kept below the signed maximum, so the buffers read
    the same whether codegen sign- or zero-extends them.
    """
    return np.dtype({0: np.int64, 8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}[width])


def whole_number(value: Any, what: str, error: type[SparseMLIRError], least: int | None = None) -> int:
    """``value`` as an int (of at least ``least``), or ``error`` naming ``what``: an int or numpy integer, never
    a bool or a float, which were truncated where counts and sizes were taken with ``int()`` (``block=(2.9, 4)``
    pruned 2x4, ``gradual=0.5`` pruned nothing)."""
    if isinstance(value, (bool, np.bool_)):
        raise error(f"{what} must be a whole number, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise error(f"{what} must be a whole number, got {value!r}") from None
    if least is not None and number < least:
        raise error(f"{what} must be at least {least}, got {number}")
    return number
