"""Elementwise epilogues fused into the register-tiled SpMM (``dialects/epilogue.py``): no temporary, same answers."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from scipy import special
from support.kernels import ran_native_linear

import sparse_mlir as sm
from sparse_mlir.dsl.patterns import spmm_epilogue
from sparse_mlir.prune import n_m


def _matrix(fmt: str, rows: int, cols: int, dtype: str):
    a = sp.random(rows, cols, density=0.3, format="csr", random_state=3).toarray()
    if dtype.startswith("int"):
        a = np.round(a * 10)
    a = a.astype(dtype)
    if fmt == "2:4":
        a = a * n_m(a, 2, 4)[1]
    return a, sm.SparseTensor.from_dense(a, fmt)


CASES = [
    ("C[i,j] = relu(A[i,k]*B[k,j] + bias[j])",
     lambda p, o: np.maximum(p + o["bias"], 0)),
    ("C[i,j] = max(relu(A[i,k]*B[k,j] + bias[j]), D[i,j]) - e[i]*2.0",
     lambda p, o: np.maximum(np.maximum(p + o["bias"], 0), o["D"]) - o["e"][:, None] * 2),
    ("C[i,j] = exp(0.0 - A[i,k]*B[k,j]) * 0.5 + sqrt(abs(D[i,j]))",
     lambda p, o: np.exp(-p) * 0.5 + np.sqrt(np.abs(o["D"]))),
    ("C[i,j] = gelu(A[i,k]*B[k,j] + bias[j])",
     lambda p, o: (p + o["bias"]) / 2 * (1 + special.erf((p + o["bias"]) / np.sqrt(2)))),
]


@pytest.mark.parametrize("fmt", ["csr", "2:4"])
@pytest.mark.parametrize("n", [3, 37, 130])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_epilogues_run_in_the_tiled_spmm(fmt, n, case, rng):
    expr, reference = CASES[case]
    rows, inner = 40, 48
    a, A = _matrix(fmt, rows, inner, "float32")
    operands = {"B": rng.standard_normal((inner, n)).astype(np.float32),
                "bias": rng.standard_normal(n).astype(np.float32),
                "D": rng.standard_normal((rows, n)).astype(np.float32),
                "e": rng.standard_normal(rows).astype(np.float32)}
    kernel = sm.compile(expr, formats={"A": fmt}, dtype="float32")
    used = {name: operands[name] for name in kernel.spec.inputs if name != "A"}
    before = {name: value.copy() for name, value in used.items()}
    out = np.full((rows, n), np.nan, np.float32)
    kernel(A=A, out=out, **used)
    want = reference(a.astype(np.float64) @ operands["B"].astype(np.float64), operands)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert "sm_epilogue_vector" in kernel.ir["input"] and "linalg.generic" not in kernel.ir["input"]
    for name, value in used.items():
        np.testing.assert_array_equal(value, before[name])


def test_integer_epilogue_and_one_that_reads_b(rng):
    a, A = _matrix("csr", 24, 24, "int32")
    B = rng.integers(-5, 5, (24, 24)).astype(np.int32)
    kernel = sm.compile("C[i,j] = relu(A[i,k]*B[k,j] - B[i,j]) * 3", formats={"A": "csr"}, dtype="int32")
    got = kernel(A=A, B=B)
    np.testing.assert_array_equal(got, np.maximum(a @ B - B, 0) * 3)
    assert "sm_epilogue_vector" in kernel.ir["input"]


def test_what_is_not_an_epilogue_is_left_to_the_planner():
    def matched(expr: str, formats: dict) -> bool:
        kernel = sm.compile(expr, formats=formats, dtype="float32")
        return spmm_epilogue(kernel.spec, kernel.spec.formats) is not None

    assert matched("C[i,j] = relu(A[i,k]*B[k,j])", {"A": "csr"})
    assert not matched("C[i,j] = A[i,k]*B[k,j] + bias[j]", {"A": "csr"})  # the bias seeds the sums instead
    assert not matched("C[i,j] = relu(A[i,k]*B[k,j]) + D[j,i]", {"A": "csr"})  # a transposed read
    assert not matched("C[i,j] = relu(A[i,k]*B[k,j]) * S[i,j]", {"A": "csr", "S": "csr"})  # a sparse read
    assert not matched("C[i,j] = relu(A[i,k]*B[k,j])", {"A": "bsr2x2"})  # BSR has its own emitter


@pytest.mark.parametrize("fmt", ["csr", "2:4"])
@pytest.mark.parametrize("batch", [1, 37, 300, 1100])  # one block of the batch, several in turn, in parallel
def test_linear_layers_with_an_activation_run_their_epilogue_in_the_tiled_spmm(fmt, batch, rng):
    """``Y[b,o] = relu(X[b,i] * W[o,i] + bias[o])`` and friends: the epilogue rewritten over the middle SpMM's
    rows (o) and columns (b); operands over o or b only."""
    w, W = _matrix(fmt, 48, 64, "float32")
    X = rng.standard_normal((batch, 64)).astype(np.float32)
    bias, scale = rng.standard_normal(48).astype(np.float32), rng.standard_normal(batch).astype(np.float32)
    product = X.astype(np.float64) @ w.T.astype(np.float64)
    for expr, operands, want in [
            ("Y[b,o] = relu(X[b,i]*W[o,i] + bias[o])", {"bias": bias}, np.maximum(product + bias, 0)),
            ("Y[b,o] = max(X[b,i]*W[o,i], s[b]) * 2.0 - bias[o]", {"s": scale, "bias": bias},
             np.maximum(product, scale[:, None]) * 2 - bias)]:
        kernel = sm.compile(expr, formats={"W": fmt}, dtype="float32")
        got = kernel(X=X, W=W, **operands)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        assert ran_native_linear(kernel.ir["input"], fmt) and "sm_epilogue_vector" in kernel.ir["input"]


@pytest.mark.parametrize("fmt", ["csr", "2:4"])
@pytest.mark.parametrize("expr, factor", [("C[i,j] = 2 * A[i,k] * B[k,j]", 2.0),
                                          ("C[i,j] = -(A[i,k] * B[k,j]) * 0.25", -0.25),
                                          ("C[i,j] = 3 * A[i,k] * (B[k,j] * 2)", 6.0)])
def test_literal_factors_of_a_spmm_scale_its_sums_in_the_tiled_kernel(fmt, expr, factor, rng):
    """A one-stage ``2 * A@B`` is the tiled SpMM with the sums times 2 as its epilogue (before, the
    sparsifier's loop nest)."""
    a, A = _matrix(fmt, 40, 48, "float32")
    B = rng.standard_normal((48, 37)).astype(np.float32)
    kernel = sm.compile(expr, formats={"A": fmt}, dtype="float32")
    want = factor * (a.astype(np.float64) @ B)
    np.testing.assert_allclose(kernel(A=A, B=B), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert "sm_epilogue_vector" in kernel.ir["input"] and "linalg.generic" not in kernel.ir["input"]
