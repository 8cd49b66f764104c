"""Magnitude pruning: unstructured, N:M and block, returning the sparse tensor and its mask.

The mask is what a training loop keeps between steps (``apply_mask`` prunes
new dense weights with it); the tensor is what kernels run on.  Every
function reads its input and never modifies it.  Ties in magnitude are
broken by position, so results are deterministic.

``sparsity`` is the fraction of entries that are zero afterwards, and a
zero is never kept: a weight that is already zero (an implicit zero of a
sparse input, or an exact zero of a dense one) is pruned first, so pruning
never stores more entries than the input has nonzeros, and an input already
sparser than asked for keeps all of them.  Sparse inputs (``SparseTensor``,
scipy matrices) are accepted and read through their stored entries.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparse_mlir.formats import CSR, Format
from sparse_mlir.prune.masks import (
    Pattern,
    apply_mask,
    pattern_of,
    select,
    weights_array,
)
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["magnitude", "n_m", "block", "by_magnitude"]


def by_magnitude(weights: Any, pattern: Pattern, format: Format | str | None = None
                       ) -> tuple[SparseTensor, np.ndarray]:
    """Keep what ``pattern`` keeps of ``weights`` ranked by magnitude (blocks by their L2 norm)."""
    w = weights_array(weights)
    scores = np.square(w, dtype=np.float64) if pattern.kind == "block" else np.abs(w)
    mask = select(scores, pattern)
    return apply_mask(w, mask, pattern.default_format() if format is None else format), mask


def magnitude(weights: Any, sparsity: float, *, scope: str = "global",
              format: Format | str = CSR) -> tuple[SparseTensor, np.ndarray]:
    """Remove the ``sparsity`` fraction of smallest-magnitude weights, over the whole matrix or per row."""
    return by_magnitude(weights, pattern_of(sparsity=sparsity, scope=scope), format)


def n_m(weights: Any, n: int = 2, m: int = 4, *, format: Format | str | None = None
        ) -> tuple[SparseTensor, np.ndarray]:
    """Keep the ``n`` largest-magnitude weights of every ``m`` consecutive ones in each row (2:4 by default)."""
    return by_magnitude(weights, pattern_of(pattern=(n, m)), format)


def block(weights: Any, sparsity: float, shape: tuple[int, int] = (4, 4), *,
          format: Format | str | None = None) -> tuple[SparseTensor, np.ndarray]:
    """Remove whole ``shape`` blocks with the smallest L2 norm (for BSR kernels)."""
    return by_magnitude(weights, pattern_of(sparsity=sparsity, block=shape), format)
