"""Test data and optional dependencies every test module may use (imported as ``support.data``)."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

__all__ = ["DTYPES", "random_values", "random_sparse", "prune_nm", "require"]

DTYPES = ["float32", "float64", "int32", "int64"]


def random_values(rng: np.random.Generator, shape: tuple[int, ...] | int, dtype: str) -> np.ndarray:
    """Values that are exact in every dtype (small integers), so results compare exactly."""
    return rng.integers(-4, 5, size=shape).astype(dtype)


def random_sparse(rng: np.random.Generator, shape: tuple[int, ...], density: float, dtype: str) -> np.ndarray:
    """A dense array with about ``density`` of its entries nonzero."""
    values = rng.integers(1, 5, size=shape) * rng.choice([-1, 1], size=shape)
    return (values * (rng.random(shape) < density)).astype(dtype)


def prune_nm(dense: np.ndarray, n: int, m: int) -> np.ndarray:
    """Keep the ``n`` largest-magnitude entries of every group of ``m`` along rows."""
    rows, cols = dense.shape
    groups = dense.reshape(rows, cols // m, m).copy()
    order = np.argsort(-np.abs(groups), axis=2, kind="stable")
    np.put_along_axis(groups, order[:, :, n:], 0, axis=2)
    return groups.reshape(rows, cols)


def require(module: str):
    """Import an optional test dependency: skipped when absent, but a failure under CI (CI=true)."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[test]')")
