"""GELU as MLIR ops: ``gelu(x) = x/2 * (1 + erf(x / sqrt(2)))``, the exact form of ``torch.nn.GELU()`` and BERT.

One builder for every path that emits the DSL's ``gelu`` (the sparsifier's
loop bodies, the hand-scheduled kernels' epilogues, scalar or vector
values).  Why not ``math.erf`` alone: on the CPU it lowers to a libm call
per element (a vector is split into scalars), about ten times the cost of
torch's vectorized GELU on a MiniLM FFN output, which would undo the point
of fusing the activation into the Linear kernel.  So float32 uses Eigen's
rational approximation of erf (``x * P(x^2) / Q(x^2)`` on ``[-4, 4]``,
clamped outside, where erf is 1 to float32 precision): only multiplies,
adds, one divide and a clamp, all vectorizable; its error is below 5e-7
(GELU's below 1.5e-6 absolute over [-12, 12] against scipy's erf,
``tests/test_gelu.py``).  float64, where users expect full precision, keeps
``math.erf`` (libm on the CPU, libdevice on the GPU).
"""

from __future__ import annotations

import math as pymath
from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, math

__all__ = ["ERF_CLAMP", "gelu"]

# Eigen's generic_fast_erf_float coefficients, highest power first
_ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                  -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                    -1.42647390514189e-02)
ERF_CLAMP = 4.0  # |x| past which the approximation returns its value at the clamp


def _element(value: ir.Value) -> ir.Type:
    kind = value.type
    return kind.element_type if isinstance(kind, ir.ShapedType) else kind


def _horner(z: ir.Value, coefficients: tuple[float, ...], constant: Callable[[float], ir.Value]) -> ir.Value:
    """``c0 z^n + ... + cn`` by Horner's rule (a multiply and an add per coefficient, fused by LLVM)."""
    total = constant(coefficients[0])
    for c in coefficients[1:]:
        total = arith.addf(arith.mulf(total, z), constant(c))
    return total


def _erf_float32(x: ir.Value, constant: Callable[[float], ir.Value]) -> ir.Value:
    clamped = arith.minimumf(arith.maximumf(x, constant(-ERF_CLAMP)), constant(ERF_CLAMP))
    square = arith.mulf(clamped, clamped)
    numerator = arith.mulf(clamped, _horner(square, _ERF_NUMERATOR, constant))
    return arith.divf(numerator, _horner(square, _ERF_DENOMINATOR, constant))


def gelu(x: ir.Value, constant: Callable[[float], ir.Value]) -> ir.Value:
    """``x/2 * (1 + erf(x / sqrt(2)))`` of a float scalar or vector ``x``; ``constant(v)`` builds ``v`` in x's
    type (a scalar, or a splat vector)."""
    scaled = arith.mulf(x, constant(1.0 / pymath.sqrt(2.0)))
    erf = _erf_float32(scaled, constant) if isinstance(_element(x), ir.F32Type) else math.erf(scaled)
    half = arith.mulf(x, constant(0.5))
    return arith.addf(half, arith.mulf(half, erf))
