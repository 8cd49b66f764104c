"""``Format`` -> ``#sparse_tensor.encoding`` and numpy dtype -> MLIR element type."""

from __future__ import annotations

import numpy as np
from mlir import ir
from mlir.dialects import sparse_tensor as st

from sparse_mlir.formats import Format

__all__ = ["encoding_attr", "element_type", "tensor_type"]


def encoding_attr(fmt: Format) -> st.EncodingAttr | None:
    """The encoding attribute of a sparse format (``None`` for dense), parsed from the format's own text."""
    if fmt.is_dense:
        return None
    return st.EncodingAttr(ir.Attribute.parse(fmt.encoding_text()))


def element_type(dtype: np.dtype) -> ir.Type:
    return {"float32": ir.F32Type.get, "float64": ir.F64Type.get, "float16": ir.F16Type.get,
            "int32": lambda: ir.IntegerType.get_signless(32),
            "int64": lambda: ir.IntegerType.get_signless(64)}[np.dtype(dtype).name]()


def tensor_type(shape: tuple[int | None, ...], dtype: np.dtype, fmt: Format) -> ir.RankedTensorType:
    """A ranked tensor type; ``None`` sizes are dynamic."""
    dynamic = ir.ShapedType.get_dynamic_size()
    sizes = [dynamic if s is None else s for s in shape]
    return ir.RankedTensorType.get(sizes, element_type(dtype), encoding_attr(fmt))
