"""Sparse kernels on Dask: row- and column-sharded matrices, kernels shipped to workers, a distributed CG.

Needs ``dask[distributed]`` (``pip install "sparse-mlir[dask]"``); also
importable as ``sparse_mlir.dask``.  See ``matrix`` for the data layout,
``kernels`` for how workers without MLIR get their kernels, ``solvers`` for
conjugate gradients.
"""

from sparse_mlir.distributed.kernels import Artifact, KernelPlan
from sparse_mlir.distributed.matrix import ColumnShardedMatrix, Layout, RowShardedMatrix, row_bounds
from sparse_mlir.distributed.solvers import CGResult, cg, poisson3d

__all__ = ["RowShardedMatrix", "ColumnShardedMatrix", "Layout", "row_bounds", "Artifact", "KernelPlan", "cg",
           "CGResult", "poisson3d"]
