"""``Format`` -> ``#sparse_tensor.encoding`` and numpy dtype -> MLIR element type."""

from __future__ import annotations

import numpy as np
from mlir import ir
from mlir.dialects import sparse_tensor as st

from sparse_mlir.dsl.patterns import bsr_blocks
from sparse_mlir.errors import FormatError
from sparse_mlir.formats import Format

__all__ = ["TYPE_NAMES", "element_type", "encoding_attr", "level_to_dimension", "tensor_type"]

# MLIR (and LLVM dialect) element type of each numpy dtype kernels and buffers use
TYPE_NAMES = {"float16": "f16", "float32": "f32", "float64": "f64", "int8": "i8", "int16": "i16", "int32": "i32",
              "int64": "i64"}


def encoding_attr(fmt: Format) -> st.EncodingAttr | None:
    """The encoding attribute of a sparse format (``None`` for dense), parsed from the format's MLIR text.

    MLIR infers the level-to-dimension map from the text, and its inverse of
    a block map lists the unblocked dimensions first: for ``(d0 floordiv 16,
    d1, d0 mod 16)`` (BSR 16x1 once its unit level is collapsed) it infers
    ``(d1, d0 * 16 + d2)``, dimensions swapped, and the sparsifier then walks
    the buffers out of bounds.  A format whose inferred map is not its own
    is refused here with a ``FormatError``, before any code is generated.
    """
    if fmt.is_dense:
        return None
    attr = st.EncodingAttr(ir.Attribute.parse(fmt.mlir_encoding_text()))
    expected = level_to_dimension(fmt)
    inferred = attr.lvl_to_dim
    if inferred is not None and str(inferred) != str(expected):
        raise FormatError(f"format {fmt} cannot go through MLIR's sparsifier: from the map "
                          f"{attr.dim_to_lvl} MLIR infers the level-to-dimension map {inferred}, not "
                          f"{expected} (upstream's inverse of a block map lists the unblocked dimensions first)"
                          + _hint(fmt))
    return attr


def level_to_dimension(fmt: Format) -> ir.AffineMap:
    """The map from ``fmt``'s MLIR level coordinates back to its dimensions (``d * f + r`` for a block pair)."""
    pairs = fmt.mlir_levels()
    level = {(e.dim, e.op): i for i, (e, _) in enumerate(pairs)}
    exprs = []
    for d in range(fmt.ndim or 0):
        if (d, "") in level:
            exprs.append(ir.AffineDimExpr.get(level[d, ""]))
            continue
        factor = ir.AffineConstantExpr.get(fmt.block_factors[d])
        block = ir.AffineMulExpr.get(ir.AffineDimExpr.get(level[d, "floordiv"]), factor)
        exprs.append(ir.AffineAddExpr.get(block, ir.AffineDimExpr.get(level[d, "mod"])))
    return ir.AffineMap.get(len(pairs), 0, exprs)


def _hint(fmt: Format) -> str:
    """What to do instead, for the BSR formats that hit this (a block one column wide)."""
    blocks = bsr_blocks(fmt)
    if blocks is None or blocks[1] != 1:
        return ""
    bm = blocks[0]
    return (f"; a bsr{bm}x1 operand runs only in the register-blocked SpMM C[i,j] = A[i,k] * B[k,j] (+ bias) on "
            f"the CPU: store it as bsr{bm}x2 or csr for other kernels")


def element_type(dtype: np.dtype) -> ir.Type:
    return ir.Type.parse(TYPE_NAMES[np.dtype(dtype).name])


def tensor_type(shape: tuple[int | None, ...], dtype: np.dtype, fmt: Format) -> ir.RankedTensorType:
    """A ranked tensor type; ``None`` sizes are dynamic."""
    dynamic = ir.ShapedType.get_dynamic_size()
    sizes = [dynamic if s is None else s for s in shape]
    return ir.RankedTensorType.get(sizes, element_type(dtype), encoding_attr(fmt))
