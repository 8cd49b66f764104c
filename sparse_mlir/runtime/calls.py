"""The call protocol every kernel kind shares: operands by keyword, torch tensors in and out.

``kernel(A=..., B=..., out=...)`` on a ``Kernel``, ``AutoKernel``,
``CudaKernel`` or an exported kernel goes through ``kernel_call``: a
positional operand is refused with the keyword signature (operands are
named after the expression's tensors, so their order would be a guess), a
kernel's C-level call (``Kernel._native_fast``, see ``fast_call``) gets the
first try, and torch tensors are converted both ways (``torch_tensors``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from sparse_mlir.errors import OperandError
from sparse_mlir.runtime.torch_tensors import call_with_torch

__all__ = ["kernel_call", "keyword_signature", "refuse_positional"]


def keyword_signature(kernel: Any) -> str:
    """``kernel(A=..., B=..., out=None)`` for ``kernel``'s inputs, in the expression's order."""
    spec = getattr(kernel, "spec", None)
    names = spec.inputs if spec is not None else tuple(op.name for op in kernel.signature.inputs)
    return f"kernel({', '.join(f'{name}=...' for name in names)}, out=None)"


def refuse_positional(kernel: Any) -> OperandError:
    """The error for a positional operand: it names the keyword signature."""
    return OperandError(f"operands are passed by keyword, named as in the expression: {keyword_signature(kernel)}")


def kernel_call(call: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a kernel's ``__call__(self, out=None, **operands)`` with the shared call protocol (one extra frame).

    The frame is on every call's fixed cost, so the common case (no torch
    tensor anywhere: torch not even imported) calls straight through.
    """

    @functools.wraps(call)
    def wrapper(self: Any, *positional: Any, out: Any = None, **operands: Any) -> Any:
        if positional:
            raise refuse_positional(self)
        fast = self._native_fast
        if fast is not None:  # the C-level call of the last specialization (``runtime.fast_call``)
            result = fast(operands, out)
            if result is not NotImplemented:
                return result
        if "torch" not in sys.modules:
            return call(self, out, **operands)
        return call_with_torch(call, self, out, operands)

    return wrapper
