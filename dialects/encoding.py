"""``Format`` -> ``#sparse_tensor.encoding`` and numpy dtype -> MLIR element type."""

from __future__ import annotations

import numpy as np
from mlir import ir
from mlir.dialects import sparse_tensor as st

from sparse_mlir.formats import Format

__all__ = ["encoding_attr", "element_type", "tensor_type", "TYPE_NAMES"]

# MLIR (and LLVM dialect) element type of each numpy dtype kernels and buffers use
TYPE_NAMES = {"float16": "f16", "float32": "f32", "float64": "f64", "int8": "i8", "int16": "i16", "int32": "i32",
              "int64": "i64"}


def encoding_attr(fmt: Format) -> st.EncodingAttr | None:
    """The encoding attribute of a sparse format (``None`` for dense), parsed from the format's own text."""
    if fmt.is_dense:
        return None
    return st.EncodingAttr(ir.Attribute.parse(fmt.encoding_text()))


def element_type(dtype: np.dtype) -> ir.Type:
    return ir.Type.parse(TYPE_NAMES[np.dtype(dtype).name])


def tensor_type(shape: tuple[int | None, ...], dtype: np.dtype, fmt: Format) -> ir.RankedTensorType:
    """A ranked tensor type; ``None`` sizes are dynamic."""
    dynamic = ir.ShapedType.get_dynamic_size()
    sizes = [dynamic if s is None else s for s in shape]
    return ir.RankedTensorType.get(sizes, element_type(dtype), encoding_attr(fmt))
