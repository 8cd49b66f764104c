"""Tensor index notation: parser, AST and planner (no MLIR imports)."""

from .parser import parse
from .plan import KernelSpec, Stage, plan

__all__ = ["parse", "plan", "KernelSpec", "Stage"]
