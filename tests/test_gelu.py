"""The DSL's ``gelu`` (exact, erf form: torch's ``nn.GELU()``, BERT's), one builder for every path
(``dialects/activations.py``): float32 by a rational erf, float64 by ``math.erf``."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from scipy import special

import sparse_mlir as sm
from sparse_mlir.errors import DSLError


def exact_gelu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / 2 * (1 + special.erf(x / np.sqrt(2)))


@pytest.mark.parametrize("dtype, atol", [("float32", 1.5e-6), ("float64", 1e-15)])
def test_dense_gelu_over_the_whole_range(dtype, atol):
    """Both sides of the approximation's clamp (|x / sqrt 2| = 4), zero, tiny and huge values."""
    x = np.concatenate([np.linspace(-12, 12, 4001), [0.0, 1e-30, -1e-30, 1e30, -1e30, 5.6568, -5.6569]]).astype(dtype)
    got = sm.compile("y[i] = gelu(x[i])", dtype=dtype)(x=x)
    np.testing.assert_allclose(got, exact_gelu(x), rtol=2e-7 if dtype == "float32" else 1e-15, atol=atol)
    assert got.dtype == dtype


def test_float32_uses_the_rational_erf_and_float64_the_exact_one():
    """float32 must not call libm's erf per element (a vector split into scalars); float64 keeps full precision."""
    f32 = sm.compile("C[i,j] = gelu(A[i,k]*B[k,j])", formats={"A": "csr"}, dtype="float32")
    f64 = sm.compile("C[i,j] = gelu(A[i,k]*B[k,j])", formats={"A": "csr"}, dtype="float64")
    A = sp.random(20, 16, density=0.3, format="csr", random_state=0)
    B = np.random.default_rng(0).standard_normal((16, 40))
    f32(A=A.astype(np.float32), B=B.astype(np.float32))
    f64(A=A, B=B)
    assert "math.erf" not in f32.ir["input"] and "arith.divf" in f32.ir["input"]
    assert "math.erf" in f64.ir["input"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_sparse_gelu_keeps_the_pattern(dtype):
    """gelu(0) == 0: a sparse operand gives a sparse result with the same pattern (the planner's zero analysis)."""
    a = sp.random(50, 40, density=0.2, format="csr", dtype=dtype, random_state=2) * 6 - 3 * sp.random(
        50, 40, density=0.2, format="csr", dtype=dtype, random_state=2).astype(bool)
    a = sp.csr_matrix(a, dtype=dtype)
    kernel = sm.compile("C[i,j] = gelu(A[i,j])", formats={"A": "csr", "C": "csr"}, dtype=dtype)
    got = kernel(A=sm.SparseTensor.from_scipy(a)).to_scipy()
    np.testing.assert_array_equal(got.indptr, a.indptr)
    np.testing.assert_array_equal(got.indices, a.indices)
    np.testing.assert_allclose(got.data, exact_gelu(a.data), rtol=2e-6 if dtype == "float32" else 1e-15, atol=2e-6)


def test_a_linear_layer_applies_gelu_in_its_epilogue(rng):
    x = rng.standard_normal((70, 24)).astype(np.float32)
    w = sp.random(36, 24, density=0.3, format="csr", dtype=np.float32, random_state=4).toarray() * 3
    bias = rng.standard_normal(36).astype(np.float32)
    kernel = sm.compile("Y[b,o] = gelu(X[b,i] * W[o,i] + bias[o])", formats={"W": "csr"}, dtype="float32")
    got = kernel(X=x, W=sm.SparseTensor.from_dense(w, "csr"), bias=bias)
    np.testing.assert_allclose(got, exact_gelu(x.astype(np.float64) @ w.T + bias), rtol=1e-5, atol=1e-5)
    assert "call @linear_spmm" in kernel.ir["input"] and "sm_epilogue_vector" in kernel.ir["input"]


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_gelu_needs_a_float_dtype(dtype):
    with pytest.raises(DSLError, match="gelu needs a floating-point dtype"):
        sm.compile("y[i] = gelu(x[i])", dtype=dtype)
