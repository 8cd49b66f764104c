"""Loading and calling compiled kernels: no MLIR needed here."""

from .kernel import Kernel, Specialization

__all__ = ["Kernel", "Specialization"]
