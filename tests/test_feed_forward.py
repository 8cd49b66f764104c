"""Two sparse Linear layers in one kernel (``dialects.native.mlp``): the DSL kernel and ``SparseFeedForward``."""

from __future__ import annotations

import numpy as np
import pytest
from support.data import prune_nm, random_sparse, random_values
from support.kernels import ran_native_mlp

import sparse_mlir as sm
from sparse_mlir.errors import DTypeError, OperandError, OptionError, ShapeError

torch = pytest.importorskip("torch")

from sparse_mlir.torch import SparseFeedForward, SparseLinear  # noqa: E402

EXPRESSIONS = {  # expression -> the reference, from X, W1, W2, b1, b2 (numpy)
    "Y[b,p] = W2[p,o] * relu(X[b,i] * W1[o,i] + b1[o]) + b2[p]":
        lambda x, w1, w2, b1, b2: np.maximum(x @ w1.T + b1, 0) @ w2.T + b2,
    "Y[b,p] = W2[p,o] * exp(X[b,i] * W1[o,i])": lambda x, w1, w2, b1, b2: np.exp(x @ w1.T) @ w2.T,
    "Y[b,p] = W2[p,o] * (X[b,i] * W1[o,i] + b1[o])": lambda x, w1, w2, b1, b2: (x @ w1.T + b1) @ w2.T,
}


def _weight(rng, shape, fmt, dtype):
    if fmt == "2:4":
        return prune_nm(random_values(rng, shape, dtype), 2, 4)
    return random_sparse(rng, shape, 0.3, dtype)


@pytest.mark.parametrize("expression", list(EXPRESSIONS))
@pytest.mark.parametrize("formats", [("csr", "csr"), ("2:4", "2:4"), ("csr", "2:4")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("batch", [1, 37, 300, 700])  # one block, edge tiles, blocks in series, in parallel
def test_the_fused_kernel_matches_the_two_products(rng, expression, formats, dtype, batch):
    inputs, hidden, outputs = 40, 72, 24
    w1, w2 = _weight(rng, (hidden, inputs), formats[0], dtype), _weight(rng, (outputs, hidden), formats[1], dtype)
    x = random_values(rng, (batch, inputs), dtype) * 0.5
    b1, b2 = random_values(rng, hidden, dtype), random_values(rng, outputs, dtype)
    operands = {"X": x, "W1": sm.SparseTensor.from_dense(w1, formats[0]),
                "W2": sm.SparseTensor.from_dense(w2, formats[1]), "b1": b1, "b2": b2}
    kernel = sm.compile(expression, formats=dict(zip(("W1", "W2"), formats)), dtype=dtype)
    used = {name: value for name, value in operands.items() if f"{name}[" in expression}
    out = np.full((batch, outputs), np.nan, dtype)
    kernel(out=out, **used)
    want = EXPRESSIONS[expression](*(v.astype(np.float64) for v in (x, w1, w2, b1, b2)))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert ran_native_mlp(kernel.ir["input"], formats)


def test_each_weight_shape_gets_its_own_build(rng):
    """The hidden width is compiled in: another shape of the same kernel is another build, not a stale one."""
    kernel = sm.compile("Y[b,p] = W2[p,o] * relu(X[b,i] * W1[o,i])", formats={"W1": "csr", "W2": "csr"},
                        dtype="float64")
    for hidden in (16, 48):
        w1, w2 = random_sparse(rng, (hidden, 8), 0.5, "float64"), random_sparse(rng, (5, hidden), 0.5, "float64")
        x = random_values(rng, (20, 8), "float64")
        got = kernel(X=x, W1=sm.SparseTensor.from_dense(w1, "csr"), W2=sm.SparseTensor.from_dense(w2, "csr"))
        np.testing.assert_allclose(got, np.maximum(x @ w1.T, 0) @ w2.T, rtol=1e-12, atol=1e-12)


def test_mismatched_layers_are_refused_by_name(rng):
    kernel = sm.compile("Y[b,p] = W2[p,o] * relu(X[b,i] * W1[o,i])", formats={"W1": "csr", "W2": "csr"},
                        dtype="float32")
    w1 = sm.SparseTensor.from_dense(random_sparse(rng, (72, 40), 0.3, "float32"), "csr")
    w2 = sm.SparseTensor.from_dense(random_sparse(rng, (24, 80), 0.3, "float32"), "csr")
    with pytest.raises(ShapeError, match="index 'o'"):
        kernel(X=random_values(rng, (5, 40), "float32"), W1=w1, W2=w2)


def _layers(kw: dict, dtype=torch.float32, activation: str | None = "gelu") -> tuple[SparseLinear, SparseLinear]:
    torch.manual_seed(0)
    first = SparseLinear.from_linear(torch.nn.Linear(64, 256).to(dtype), **kw)
    second = SparseLinear.from_linear(torch.nn.Linear(256, 48).to(dtype), **kw)
    first.activation = activation
    return first, second


@pytest.mark.parametrize("kw", [{"sparsity": 0.9}, {"pattern": "2:4"}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_feed_forward_is_bit_identical_to_its_two_layers(kw, dtype):
    first, second = _layers(kw, dtype)
    block = SparseFeedForward(first, second)
    x = torch.randn(3, 150, 64, dtype=dtype)
    with torch.inference_mode():
        got, want = block(x), second(first(x))
    assert got.shape == (3, 150, 48) and got.dtype == dtype
    assert torch.equal(got, want)


def test_with_autograd_recording_the_layers_run_their_own_differentiable_operators():
    first, second = _layers({"sparsity": 0.9})
    block = SparseFeedForward(first, second)
    x = torch.randn(20, 64, requires_grad=True)
    block(x).sum().backward()
    want_x = x.grad.clone()
    grads = [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    second(first(x)).sum().backward()
    assert torch.equal(x.grad, want_x)
    assert all(torch.equal(p.grad, g) for p, g in zip(block.parameters(), grads))
    assert set(block.state_dict()) == {f"first.{k}" for k in first.state_dict()} | {
        f"second.{k}" for k in second.state_dict()}


def test_bad_layers_and_inputs_are_refused():
    first, second = _layers({"sparsity": 0.9})
    with pytest.raises(ShapeError, match="48 outputs, the second takes 64"):
        SparseFeedForward(second, first)
    with pytest.raises(OperandError, match="two SparseLinear"):
        SparseFeedForward(torch.nn.Linear(64, 256), second)
    plain, _ = _layers({"sparsity": 0.9}, activation=None)
    plain.bias = None
    with pytest.raises(OperandError, match="activation or a bias"):
        SparseFeedForward(plain, second)
    block = SparseFeedForward(first, second)
    with torch.inference_mode():
        with pytest.raises(OperandError, match="64 features"):
            block(torch.randn(4, 63))
        with pytest.raises(OperandError, match="float32"):
            block(torch.randn(4, 64, dtype=torch.float64))
    mixed = SparseFeedForward(first, _layers({"sparsity": 0.9}, torch.float64)[1])
    with torch.inference_mode(), pytest.raises(DTypeError, match="float64"):
        mixed(torch.randn(4, 64))
    with pytest.raises(OptionError, match="jit.script"):
        torch.jit.script(block)


def test_torch_compile_traces_the_fused_operator_without_graph_breaks():
    block = SparseFeedForward(*_layers({"pattern": "2:4"}))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 33, 64)
    with torch.no_grad():
        assert torch.equal(compiled(x), block(x))
