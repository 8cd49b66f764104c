"""A residual connection ``+ R[b,o]`` (a dense operand shaped like the output) in the Linear and MLP kernels:
added while the kernel writes ``Y`` (the transpose into ``Y``), instead of sending the layer to the sparsifier
(4096 x 384 at 90%: 25 ms there, 1.4 ms for the layer without ``R``)."""

from __future__ import annotations

import numpy as np
import pytest
from support.data import prune_nm, random_sparse, random_values
from support.kernels import ran_native_linear

import sparse_mlir as sm
from sparse_mlir.dsl.patterns import linear_epilogue, linear_operands, mlp_operands
from sparse_mlir.dsl.plan import plan

LINEAR = {  # expression -> reference from X, W (dense), R, bias over o, c over b
    "Y[b,o] = X[b,i] * W[o,i] + R[b,o]": lambda x, w, r, bias, c: x @ w.T + r,
    "Y[b,o] = R[b,o] + X[b,i] * W[o,i] + bias[o]": lambda x, w, r, bias, c: x @ w.T + bias + r,
    "Y[b,o] = X[b,i] * W[o,i] + bias[o] + R[b,o]": lambda x, w, r, bias, c: x @ w.T + bias + r,
    "Y[b,o] = X[b,i] * W[o,i] + c[b] + R[b,o]": lambda x, w, r, bias, c: x @ w.T + c[:, None] + r,  # whole batch
    "Y[b,o] = max(X[b,i] * W[o,i] + bias[o], 0) + R[b,o]": lambda x, w, r, bias, c: np.maximum(x @ w.T + bias, 0) + r,
}


@pytest.mark.parametrize("expression", list(LINEAR))
@pytest.mark.parametrize("fmt", ["csr", "2:4"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("shape", [(37, 52, 70), (700, 64, 40)])  # edge tiles; blocks by workers
def test_a_linear_layer_adds_its_residual_while_writing_y(rng, expression, fmt, dtype, shape):
    batch, inputs, outputs = shape
    w = prune_nm(random_values(rng, (outputs, inputs), dtype), 2, 4) if fmt == "2:4" else \
        random_sparse(rng, (outputs, inputs), 0.2, dtype)
    x, r = random_values(rng, (batch, inputs), dtype), random_values(rng, (batch, outputs), dtype)
    bias, c = random_values(rng, outputs, dtype), random_values(rng, batch, dtype)
    operands = {"X": x, "W": sm.SparseTensor.from_dense(w, fmt), "R": r, "bias": bias, "c": c}
    kernel = sm.compile(expression, formats={"W": fmt}, dtype=dtype)
    out = np.full((batch, outputs), np.nan if dtype != "int32" else -7, dtype)
    kernel(out=out, **{name: value for name, value in operands.items() if f"{name}[" in expression})
    want = LINEAR[expression](x, w, r, bias, c)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * max(1, np.abs(want).max()))
    assert ran_native_linear(kernel.ir["input"], fmt)
    np.testing.assert_array_equal(r, operands["R"])  # read, not written


def test_a_feed_forward_block_adds_its_residual(rng):
    w1, w2 = random_sparse(rng, (96, 40), 0.3, "float64"), random_sparse(rng, (40, 96), 0.3, "float64")
    x, r = random_values(rng, (300, 40), "float64"), random_values(rng, (300, 40), "float64")
    kernel = sm.compile("Y[b,p] = W2[p,o] * relu(X[b,i] * W1[o,i]) + R[b,p]", formats={"W1": "csr", "W2": "csr"},
                        dtype="float64")
    got = kernel(X=x, W1=sm.SparseTensor.from_dense(w1, "csr"), W2=sm.SparseTensor.from_dense(w2, "csr"), R=r)
    np.testing.assert_allclose(got, np.maximum(x @ w1.T, 0) @ w2.T + r, rtol=1e-12, atol=1e-12)
    assert "call @mlp_second" in kernel.ir["input"]


def test_a_residual_is_matched_only_where_the_kernel_adds_it():
    """The CPU kernels ask for residuals; the GPU Linear emitters do not (they would drop ``R``), nor does an
    operand that is not the output's shape or is read inside the expression count as one."""
    spec = plan("Y[b,o] = X[b,i] * W[o,i] + bias[o] + R[b,o]", {"W": "csr"}, "float32")
    assert linear_operands(spec, spec.formats) is None
    assert linear_operands(spec, spec.formats, residual=True)["residual"] == "R"
    inside = plan("Y[b,o] = relu(X[b,i] * W[o,i] + R[b,o])", {"W": "csr"}, "float32")
    assert linear_epilogue(inside, inside.formats, residual=True) is None
    transposed = plan("Y[b,o] = X[b,i] * W[o,i] + R[o,b]", {"W": "csr"}, "float32")
    assert linear_operands(transposed, transposed.formats, residual=True) is None
    mlp = plan("Y[b,p] = W2[p,o] * relu(X[b,i] * W1[o,i]) + b2[p] + R[b,p]", {"W1": "csr", "W2": "csr"}, "float32")
    found = mlp_operands(mlp, mlp.formats)
    assert (found.bias, found.residual) == ("b2", "R")
