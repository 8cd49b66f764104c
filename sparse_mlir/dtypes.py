"""The element and index dtypes kernels use (numpy only): one place every layer checks them against.

Low in the stack on purpose: the planner (``dsl``), tensors (``tensor``), the C
ABI (``abi``) and file readers (``io``) all check dtypes, and none of them may
import another just for that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparse_mlir.errors import DTypeError

__all__ = ["SUPPORTED_DTYPES", "check_dtype", "index_dtype"]

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
