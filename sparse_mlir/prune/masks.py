"""Choosing which weights stay, from a score per weight: unstructured, N:M and block patterns.

Every pruner here (magnitude, Wanda, SparseGPT) differs only in its scores;
the patterns are one piece of code.  A zero score is never kept (keeping it
would store an explicit zero), ties go to the earlier position, and nothing
the caller passed in is modified.
"""

from __future__ import annotations


from dataclasses import dataclass
from typing import Any

import numpy as np

from sparse_mlir import dtypes
from sparse_mlir.dtypes import check_dtype
from sparse_mlir.errors import OperandError, PatternError, ShapeError
from sparse_mlir.formats import BSR, CSR, NM, Format, as_format
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["Pattern", "pattern_of", "weights_array", "keep_largest", "select", "apply_mask", "satisfies_n_m"]


@dataclass(frozen=True)
class Pattern:
    """What a pruning keeps: ``kind`` "unstructured" (``sparsity``, compared over ``scope``: the whole matrix
    or each row), "n:m" (``n`` of every ``m`` along a row) or "block" (whole ``block`` tiles, ``sparsity`` of
    them removed)."""

    kind: str
    sparsity: float = 0.0
    scope: str = "row"
    n: int = 0
    m: int = 0
    block: tuple[int, int] = (1, 1)

    def default_format(self) -> Format:
        return NM(self.n, self.m) if self.kind == "n:m" else BSR(*self.block) if self.kind == "block" else CSR

    def check(self, shape: tuple[int, int]) -> None:
        """``PatternError`` when ``shape`` cannot take this pattern."""
        if self.kind == "n:m" and shape[1] % self.m:
            raise PatternError(f"{self.n}:{self.m} pruning groups columns by {self.m}, but there are {shape[1]}")
        if self.kind == "block" and (shape[0] % self.block[0] or shape[1] % self.block[1]):
            raise PatternError(f"block pruning by {self.block[0]}x{self.block[1]} needs a shape divisible by it, "
                               f"got {shape}")


def whole_number(value: Any, what: str, least: int = 1) -> int:
    """``dtypes.whole_number`` for pruning options: a ``PatternError``, at least 1 unless said otherwise."""
    return dtypes.whole_number(value, what, PatternError, least)


def check_sparsity(sparsity: Any) -> float:
    try:
        value = float(sparsity)
    except (TypeError, ValueError):
        raise PatternError(f"sparsity is the fraction of weights removed, a number in [0, 1), got {sparsity!r}") \
            from None
    if not 0.0 <= value < 1.0:
        raise PatternError(f"sparsity is the fraction of weights removed, in [0, 1), got {sparsity}")
    return value


def pattern_of(*, sparsity: float | None = None, pattern: str | tuple[int, int] | None = None,
               block: tuple[int, int] | None = None, scope: str = "row") -> Pattern:
    """The one ``Pattern`` these options describe; conflicting or missing options raise ``PatternError``.

    ``pattern="2:4"`` (or ``(2, 4)``) alone is N:M; ``block=(4, 4)`` needs
    ``sparsity`` (the fraction of tiles removed); ``sparsity`` alone is
    unstructured, compared per row (``scope="row"``) or over the matrix (``"global"``).
    """
    if pattern is not None:
        if sparsity is not None or block is not None:
            raise PatternError("an N:M pattern fixes the sparsity (1 - n/m) and the shape of what is kept: pass "
                               "pattern alone, without sparsity= or block=")
        n, m = _n_m(pattern)
        return Pattern("n:m", 1.0 - n / m, n=n, m=m)
    if sparsity is None:
        raise PatternError("say what to prune: sparsity= (unstructured, or with block=) or pattern= (N:M)")
    s = check_sparsity(sparsity)
    if block is not None:
        if isinstance(block, (str, bytes)) or not hasattr(block, "__len__") or len(block) != 2:
            raise PatternError(f"block is (rows, columns) of a tile, got {block!r}")
        rows, cols = whole_number(block[0], "block rows"), whole_number(block[1], "block columns")
        return Pattern("block", s, block=(rows, cols))
    if scope not in ("global", "row"):
        raise PatternError(f"scope must be 'global' or 'row', got {scope!r}")
    return Pattern("unstructured", s, scope=scope)


def _n_m(pattern: str | tuple[int, int]) -> tuple[int, int]:
    try:
        parts = [int(v) if isinstance(v, str) else v for v in (pattern.split(":") if isinstance(pattern, str)
                                                                else pattern)]
        n, m = parts
    except (TypeError, ValueError):
        raise PatternError(f"pattern is N:M like '2:4', got {pattern!r}") from None
    n, m = whole_number(n, "N of N:M"), whole_number(m, "M of N:M")
    if not 0 < n <= m:
        raise PatternError(f"N:M pruning needs 0 < n <= m, got {n}:{m}")
    return n, m


def weights_array(weights: Any) -> np.ndarray:
    """``weights`` as a 2-d numpy array; a sparse input is expanded (its implicit zeros stay zeros)."""
    if isinstance(weights, SparseTensor):
        weights = weights.to_dense()
    elif hasattr(weights, "toarray") and hasattr(weights, "nnz"):  # a scipy sparse matrix or array
        weights = weights.toarray()
    try:
        array = np.asarray(weights)
    except (TypeError, ValueError) as exc:  # a ragged list
        raise OperandError(f"weights must be a 2-d array of numbers ({exc})") from None
    if array.ndim != 2:
        raise ShapeError(f"pruning works on 2-d weights, got shape {array.shape}")
    check_dtype(array.dtype, "weights")
    if array.dtype.kind == "f" and not np.isfinite(array).all():  # ranks and refits would spread it (a row of NaNs)
        row, col = np.argwhere(~np.isfinite(array))[0]
        raise PatternError(f"weights hold {array[row, col]} at ({row}, {col}); prune finite weights")
    return array


def keep_largest(scores: np.ndarray, keep: int) -> np.ndarray:
    """Boolean mask of the ``keep`` largest nonzero scores along the last axis (earlier position wins ties).

    A zero score is never kept, even when fewer than ``keep`` are nonzero:
    keeping it would store a zero explicitly (a sparse input pruned to 50%
    used to come back with millions of stored zeros).
    """
    order = np.argsort(-scores, axis=-1, kind="stable")
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, order[..., :keep], True, axis=-1)
    return mask & (scores != 0)


def select(scores: np.ndarray, pattern: Pattern) -> np.ndarray:
    """The mask ``pattern`` keeps, given a non-negative score per weight (larger: more worth keeping)."""
    rows, cols = scores.shape
    pattern.check((rows, cols))
    if pattern.kind == "n:m":
        groups = scores.reshape(rows, cols // pattern.m, pattern.m)
        return keep_largest(groups, pattern.n).reshape(rows, cols)
    if pattern.kind == "block":
        bm, bn = pattern.block
        tiles = scores.reshape(rows // bm, bm, cols // bn, bn).sum(axis=(1, 3))
        kept = keep_largest(tiles.reshape(1, -1), int(round((1.0 - pattern.sparsity) * tiles.size)))
        return np.repeat(np.repeat(kept.reshape(tiles.shape), bm, axis=0), bn, axis=1)
    if pattern.scope == "global":
        keep = int(round((1.0 - pattern.sparsity) * scores.size))
        return keep_largest(scores.reshape(1, -1), keep).reshape(rows, cols)
    return keep_largest(scores, int(round((1.0 - pattern.sparsity) * cols)))


def apply_mask(weights: Any, mask: Any, format: Format | str = CSR) -> SparseTensor:
    """Store ``weights`` where ``mask`` is True, in ``format`` (new dense weights, same pruning)."""
    w = weights_array(weights)
    keep = np.asarray(mask, dtype=bool)
    if keep.shape != w.shape:
        raise ShapeError(f"mask shape {keep.shape} differs from weights shape {w.shape}")
    return SparseTensor.from_dense(w, as_format(format, 2), where=keep)


def satisfies_n_m(weights: Any, n: int, m: int) -> bool:
    """Whether every group of ``m`` consecutive entries in each row has at most ``n`` nonzeros."""
    array = weights.to_dense() if isinstance(weights, SparseTensor) else np.asarray(weights)
    n, m = whole_number(n, "n", least=0), whole_number(m, "m")
    if array.ndim != 2 or array.shape[1] % m:
        return False
    counts = (array != 0).reshape(array.shape[0], -1, m).sum(axis=2)
    return bool((counts <= n).all())
