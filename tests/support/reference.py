"""A numpy interpreter of planned kernels: the oracle of the differential fuzz tests.

It evaluates each ``Stage`` of a ``KernelSpec`` with labelled numpy arrays
(broadcasting over index variables, summing reduced ones), so it shares the
DSL's semantics but none of the code generation it checks.
"""

from __future__ import annotations

import numpy as np

from sparse_mlir.dsl.ast import Access, Binary, Call, Expr, Literal, Unary
from sparse_mlir.dsl.plan import KernelSpec


def _gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU, ``x/2 * (1 + erf(x / sqrt 2))``, by scipy's erf."""
    from scipy import special

    return x / 2 * (1 + special.erf(x / np.sqrt(2)))


def _align(value: np.ndarray, labels: tuple[str, ...], loops: tuple[str, ...]) -> np.ndarray:
    """Transpose and reshape a labelled array so it broadcasts over ``loops``."""
    order = [labels.index(i) for i in loops if i in labels]
    value = np.transpose(value, order) if order else value
    shape = [value.shape[[i for i in loops if i in labels].index(idx)] if idx in labels else 1 for idx in loops]
    return value.reshape(shape)


def evaluate(spec: KernelSpec, operands: dict[str, np.ndarray]) -> np.ndarray:
    """The result of ``spec`` on dense numpy operands, computed in the kernel's dtype."""
    dtype = spec.dtype
    values = {name: np.asarray(array, dtype=dtype) for name, array in operands.items()}
    for stage in spec.stages:
        loops = stage.loops

        def ev(node: Expr) -> np.ndarray:
            if isinstance(node, Access):
                return _align(values[node.tensor], node.index, loops)
            if isinstance(node, Literal):
                return np.asarray(node.value, dtype=dtype)
            if isinstance(node, Unary):
                return -ev(node.operand)
            if isinstance(node, Binary):
                a, b = ev(node.lhs), ev(node.rhs)
                return {"+": np.add, "-": np.subtract, "*": np.multiply}[node.op](a, b)
            if isinstance(node, Call):
                args = [ev(a) for a in node.args]
                with np.errstate(all="ignore"):
                    return {"relu": lambda x: np.maximum(x, dtype.type(0)), "abs": np.abs, "exp": np.exp,
                            "sqrt": np.sqrt, "max": np.maximum, "gelu": _gelu}[node.func](*args).astype(dtype)
            raise AssertionError(node)

        body = ev(stage.body)
        sizes = {}
        for acc in stage.accesses():
            for idx, size in zip(acc.index, values[acc.tensor].shape):
                sizes[idx] = size
        body = np.broadcast_to(body, [sizes[i] for i in loops]).astype(dtype)
        result = body.sum(axis=tuple(range(len(stage.indices), len(loops))), dtype=dtype) if stage.reduce else body
        values[stage.result] = np.asarray(result, dtype=dtype)
    return values[spec.output]
