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

from sparse_mlir.dtypes import check_dtype
from sparse_mlir.errors import PatternError, ShapeError
from sparse_mlir.formats import BSR, CSR, NM, Format, as_format
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["magnitude", "n_m", "block", "apply_mask", "satisfies_n_m"]


def _weights(weights: Any) -> np.ndarray:
    """``weights`` as a 2-d numpy array; a sparse input is expanded (its implicit zeros stay zeros)."""
    if isinstance(weights, SparseTensor):
        weights = weights.to_dense()
    elif hasattr(weights, "toarray") and hasattr(weights, "nnz"):  # a scipy sparse matrix or array
        weights = weights.toarray()
    array = np.asarray(weights)
    if array.ndim != 2:
        raise ShapeError(f"pruning works on 2-d weights, got shape {array.shape}")
    check_dtype(array.dtype, "weights")
    return array


def _check_sparsity(sparsity: float) -> float:
    if not 0.0 <= float(sparsity) < 1.0:
        raise PatternError(f"sparsity is the fraction of weights removed, in [0, 1), got {sparsity}")
    return float(sparsity)


def _keep_largest(scores: np.ndarray, keep: int) -> np.ndarray:
    """Boolean mask of the ``keep`` largest nonzero scores along the last axis (earlier position wins ties).

    A zero score is never kept, even when fewer than ``keep`` are nonzero:
    keeping it would store a zero explicitly (a sparse input pruned to 50%
    used to come back with millions of stored zeros).
    """
    order = np.argsort(-scores, axis=-1, kind="stable")
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, order[..., :keep], True, axis=-1)
    return mask & (scores != 0)


def magnitude(weights: Any, sparsity: float, *, scope: str = "global",
              format: Format | str = CSR) -> tuple[SparseTensor, np.ndarray]:
    """Remove the ``sparsity`` fraction of smallest-magnitude weights, over the whole matrix or per row."""
    w = _weights(weights)
    s = _check_sparsity(sparsity)
    if scope == "global":
        keep = int(round((1.0 - s) * w.size))
        mask = _keep_largest(np.abs(w).reshape(1, -1), keep).reshape(w.shape)
    elif scope == "row":
        mask = _keep_largest(np.abs(w), int(round((1.0 - s) * w.shape[1])))
    else:
        raise PatternError(f"scope must be 'global' or 'row', got {scope!r}")
    return apply_mask(w, mask, format), mask


def n_m(weights: Any, n: int = 2, m: int = 4, *, format: Format | str | None = None) -> tuple[SparseTensor, np.ndarray]:
    """Keep the ``n`` largest-magnitude weights of every ``m`` consecutive ones in each row (2:4 by default)."""
    w = _weights(weights)
    if not 0 < n <= m:
        raise PatternError(f"N:M pruning needs 0 < n <= m, got {n}:{m}")
    if w.shape[1] % m:
        raise PatternError(f"{n}:{m} pruning groups columns by {m}, but there are {w.shape[1]}")
    groups = np.abs(w).reshape(w.shape[0], w.shape[1] // m, m)
    mask = _keep_largest(groups, n).reshape(w.shape)
    return apply_mask(w, mask, NM(n, m) if format is None else format), mask


def block(weights: Any, sparsity: float, shape: tuple[int, int] = (4, 4), *,
          format: Format | str | None = None) -> tuple[SparseTensor, np.ndarray]:
    """Remove whole ``shape`` blocks with the smallest L2 norm (for BSR kernels)."""
    w = _weights(weights)
    s = _check_sparsity(sparsity)
    bm, bn = shape
    if w.shape[0] % bm or w.shape[1] % bn:
        raise PatternError(f"block pruning by {bm}x{bn} needs a shape divisible by it, got {w.shape}")
    tiles = w.reshape(w.shape[0] // bm, bm, w.shape[1] // bn, bn).astype(np.float64)
    norms = np.sqrt((tiles ** 2).sum(axis=(1, 3)))
    keep = int(round((1.0 - s) * norms.size))
    kept = _keep_largest(norms.reshape(1, -1), keep).reshape(norms.shape)
    mask = np.repeat(np.repeat(kept, bm, axis=0), bn, axis=1)
    return apply_mask(w, mask, BSR(bm, bn) if format is None else format), mask


def apply_mask(weights: Any, mask: Any, format: Format | str = CSR) -> SparseTensor:
    """Store ``weights`` where ``mask`` is True, in ``format`` (new dense weights, same pruning)."""
    w = _weights(weights)
    keep = np.asarray(mask, dtype=bool)
    if keep.shape != w.shape:
        raise ShapeError(f"mask shape {keep.shape} differs from weights shape {w.shape}")
    fmt = as_format(format, 2)
    coords = np.array(np.nonzero(keep), dtype=np.int64).reshape(2, -1)
    return SparseTensor.from_coo(coords, w[keep], w.shape, fmt)


def satisfies_n_m(weights: Any, n: int, m: int) -> bool:
    """Whether every group of ``m`` consecutive entries in each row has at most ``n`` nonzeros."""
    array = weights.to_dense() if isinstance(weights, SparseTensor) else np.asarray(weights)
    if array.ndim != 2 or array.shape[1] % m:
        return False
    counts = (array != 0).reshape(array.shape[0], -1, m).sum(axis=2)
    return bool((counts <= n).all())
