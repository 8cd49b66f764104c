"""Tensor index notation: parser, AST and planner (no MLIR imports)."""

from sparse_mlir.dsl.parser import parse
from sparse_mlir.dsl.plan import KernelSpec, Stage, plan

__all__ = ["parse", "plan", "KernelSpec", "Stage"]
