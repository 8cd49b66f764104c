"""SparseLinear trains: gradients from compiled kernels (gradcheck in float64), fine-tuning keeps the mask,
torch.compile traces through the custom operators, dense checkpoints are re-pruned, torch.jit.script is refused."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
from support.data import require

torch = require("torch")

from sparse_mlir import prune
from sparse_mlir.errors import OptionError, ShapeError
from sparse_mlir.torch import SparseLinear, sparsify

# (pruning options, input features): CSR and 2:4 run the tiled kernels; BSR stores its entries block by block,
# so its values gradient is gathered back from row-major order; COO and DCSR go through the sparsifier
LAYOUTS = [({"sparsity": 0.6}, 12), ({"pattern": "2:4"}, 12), ({"sparsity": 0.5, "format": "coo"}, 12),
           ({"sparsity": 0.5, "format": "dcsr"}, 12)]


def layer(options: dict, in_features: int = 12, out_features: int = 6, bias: bool = True) -> SparseLinear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).double()
    return SparseLinear.from_linear(linear, **options)


def call(sparse: SparseLinear):
    """The layer as a function of (input, stored values, bias), for gradcheck."""
    def f(x, values, *bias):
        params = {"weight_values": values, **({"bias": bias[0]} if bias else {})}
        return torch.func.functional_call(sparse, params, (x,))
    return f


@pytest.mark.parametrize("options, features", LAYOUTS, ids=["csr", "2:4", "coo", "dcsr"])
@pytest.mark.parametrize("batch", [(1,), (5,), (2, 3)], ids=["1", "5", "2x3"])
def test_gradcheck_input_values_and_bias(options, features, batch):
    sparse = layer(options, features)
    x = torch.randn(*batch, features, dtype=torch.float64, requires_grad=True)
    values = sparse.weight_values.detach().clone().requires_grad_()
    bias = sparse.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(call(sparse), (x, values, bias))


def test_gradcheck_with_block_storage_and_without_bias():
    """BSR keeps its entries block by block: the values gradient is put back in that order."""
    torch.manual_seed(1)
    dense = torch.randn(8, 12, dtype=torch.float64)
    weight, _ = prune.block(dense.numpy(), 0.5, (2, 2))
    sparse = SparseLinear(weight)
    assert sparse._pattern_stored.numel() == weight.nnz  # not the identity: the order really differs
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    values = sparse.weight_values.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(call(sparse), (x, values))


@pytest.mark.parametrize("batch_rows", [7, 300, 1100],
                         ids=["7 rows", "300 rows: batch blocks one after the other", "1100 rows: blocks in parallel"])
@pytest.mark.parametrize("options, features", LAYOUTS[:2], ids=["csr", "2:4"])
def test_gradients_match_a_masked_dense_linear(options, features, batch_rows):
    """Against torch's own autograd of the same pruned weight: the input and bias gradients, and the weight
    gradient at the stored entries (in the layer's storage order)."""
    sparse = layer(options, features, out_features=10)
    weight = sparse.weight
    (rows, cols), _ = weight.to_coo()
    dense_w = torch.from_numpy(weight.to_dense()).requires_grad_()
    dense_b = sparse.bias.detach().clone().requires_grad_()
    x = torch.randn(batch_rows, features, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    upstream = torch.randn(batch_rows, 10, dtype=torch.float64)
    torch.testing.assert_close(sparse(x), torch.nn.functional.linear(x_ref, dense_w, dense_b))
    sparse(x).backward(upstream)
    torch.nn.functional.linear(x_ref, dense_w, dense_b).backward(upstream)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(sparse.bias.grad, dense_b.grad)
    torch.testing.assert_close(sparse.weight_values.grad, dense_w.grad[rows, cols])


def test_only_what_needs_a_gradient_gets_one():
    sparse = layer({"sparsity": 0.5})
    sparse.weight_values.requires_grad_(False)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    sparse(x).sum().backward()
    assert x.grad is not None and sparse.weight_values.grad is None and sparse.bias.grad is not None
    with torch.no_grad():
        assert not sparse(x).requires_grad


@pytest.mark.parametrize("options", [{"sparsity": 0.8}, {"pattern": "2:4"}])
def test_fine_tuning_reduces_the_loss_keeps_the_pattern_and_matches_masked_dense_training(options):
    """SGD on the sparse model and on a dense copy whose gradients are masked: the same losses and weights."""
    torch.manual_seed(0)
    model = sparsify(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
                     **options)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    levels = {}
    for i in (0, 2):
        weight = model[i].weight
        levels[i] = [b.copy() for b in weight.buffers[:-1]]
        mask = torch.from_numpy(weight.to_dense() != 0)
        with torch.no_grad():
            reference[i].weight.copy_(torch.from_numpy(weight.to_dense()))
            reference[i].bias.copy_(model[i].bias)
        reference[i].weight.register_hook(lambda grad, mask=mask: grad * mask)
    x = torch.randn(64, 16)
    target = torch.nn.Linear(16, 4)(x).detach()  # a teacher the model can learn
    losses = {}
    for net in (model, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        losses[net] = []
        for _ in range(30):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), target)
            loss.backward()
            optimizer.step()
            losses[net].append(loss.item())
    assert losses[model][-1] < 0.8 * losses[model][0]
    np.testing.assert_allclose(losses[model], losses[reference], rtol=1e-4)
    for i in (0, 2):
        weight = model[i].weight
        for before, now in zip(levels[i], weight.buffers[:-1]):
            np.testing.assert_array_equal(before, now)
        np.testing.assert_allclose(weight.to_dense(), reference[i].weight.detach().numpy(), rtol=1e-4, atol=1e-5)
    assert {name for name, _ in model.named_parameters()} == {"0.weight_values", "0.bias", "2.weight_values",
                                                              "2.bias"}


def test_a_trained_model_round_trips_through_its_state_dict():
    source = sparsify(torch.nn.Sequential(torch.nn.Linear(8, 8)), sparsity=0.5)
    with torch.no_grad():
        source[0].weight_values.add_(1.0)
    target = sparsify(torch.nn.Sequential(torch.nn.Linear(8, 8)), sparsity=0.5)
    parameter = target[0].weight_values
    target.load_state_dict(source.state_dict())
    assert target[0].weight_values is parameter  # same number of entries: loaded in place, an optimizer keeps it
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(source(x), target(x))


def test_a_dense_checkpoint_is_pruned_again_with_a_warning():
    torch.manual_seed(3)
    dense = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model = sparsify(copy.deepcopy(dense), pattern="2:4")
    with torch.no_grad():
        for layer_ in dense:
            if isinstance(layer_, torch.nn.Linear):
                layer_.weight.copy_(torch.randn_like(layer_.weight))  # not the weights the model was pruned from
    with pytest.warns(UserWarning, match=r"0.weight: a dense weight \(8, 16\) .* pruning it again \(2:4 stored as 2:4\): "
                                         r"64 of 128 entries stored, 50.0% sparse"):
        result = model.load_state_dict(dense.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for i in (0, 2):
        want = SparseLinear.from_linear(dense[i], pattern="2:4")
        np.testing.assert_array_equal(model[i].weight.to_dense(), want.weight.to_dense())
        assert torch.equal(model[i].bias, dense[i].bias)
    wrong = torch.nn.Sequential(torch.nn.Linear(12, 8)).state_dict()
    before = model[0].weight.to_dense()
    with pytest.raises(ShapeError, match=r"0.weight: the checkpoint's dense weight has shape \(8, 12\)"):
        model.load_state_dict(wrong, strict=False)
    np.testing.assert_array_equal(model[0].weight.to_dense(), before)


def test_torch_compile_traces_forward_and_backward_without_graph_breaks():
    torch.manual_seed(0)
    model = sparsify(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)),
                     sparsity=0.5)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    got = compiled(x)
    want = model(x_ref)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_torch_jit_script_is_refused_and_trace_works():
    model = sparsify(torch.nn.Sequential(torch.nn.Linear(8, 4)), sparsity=0.5)
    with pytest.raises(OptionError, match="torch.jit.script.*torch.compile"):
        torch.jit.script(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        traced = torch.jit.trace(model, x)
        torch.testing.assert_close(traced(x), model(x))


@pytest.mark.parametrize("duplicate", ["deepcopy", "torch.save"])
def test_a_copy_of_the_model_is_a_model_of_its_own(duplicate):
    model = sparsify(torch.nn.Sequential(torch.nn.Linear(8, 4)), sparsity=0.5)
    if duplicate == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        twin[0].weight_values.zero_()
        twin[0].bias.zero_()
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(twin(x), torch.zeros(2, 4)) and not torch.equal(model(x), torch.zeros(2, 4))


def test_torch_export_keeps_the_layer_as_one_custom_operator():
    model = sparsify(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)),
                     pattern="2:4")
    x = torch.randn(3, 16)
    program = torch.export.export(model, (x,))
    assert program.graph_module.code.count("torch.ops.sparse_mlir.linear.default") == 2
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x))


def test_a_layer_built_from_a_block_weight_re_prunes_a_dense_checkpoint_into_blocks():
    torch.manual_seed(2)
    dense = torch.nn.Linear(12, 8)
    weight, _ = prune.block(dense.weight.detach().numpy(), 0.5, (2, 2))
    sparse = SparseLinear(weight, dense.bias)
    other = torch.nn.Linear(12, 8)
    with pytest.warns(UserWarning, match=r"sparsity=0.5 stored as bsr2x2\): 48 of 96 entries stored"):
        sparse.load_state_dict(other.state_dict())
    want, _ = prune.block(other.weight.detach().numpy(), 0.5, (2, 2))
    np.testing.assert_array_equal(sparse.weight.to_dense(), want.to_dense())


def test_a_second_derivative_is_refused_not_silently_wrong():
    sparse = layer({"sparsity": 0.5})
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(sparse(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        grad.sum().backward()


@pytest.mark.parametrize("options", [LAYOUTS[0][0], LAYOUTS[1][0], LAYOUTS[3][0]], ids=["csr", "2:4", "dcsr"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_fused_gelu_matches_torch_and_passes_gradcheck(options, bias):
    """``activation="gelu"``: the kernel's epilogue computes ``gelu(x W^T + b)``; its backward goes through torch's
    GELU derivative at the recomputed pre-activation, then the Linear's own gradients."""
    sparse = layer(options, bias=bias)
    sparse.activation = "gelu"
    torch.manual_seed(1)
    x = (3 * torch.randn(7, 12, dtype=torch.float64)).requires_grad_()
    dense = torch.from_numpy(sparse.weight.to_dense())
    want = torch.nn.functional.gelu(x @ dense.T + (sparse.bias if bias else 0))
    torch.testing.assert_close(sparse(x), want, rtol=1e-12, atol=1e-12)
    values = sparse.weight_values.detach().clone().requires_grad_()
    extra = (sparse.bias.detach().clone().requires_grad_(),) if bias else ()
    assert torch.autograd.gradcheck(call(sparse), (x, values, *extra))
    assert "activation=gelu" in repr(sparse)


def test_a_float32_fused_gelu_is_within_its_approximation_of_torch():
    """float32 computes erf by a rational approximation (``dialects.activations``): within 2e-6 of torch."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40)
    sparse = SparseLinear.from_linear(linear, sparsity=0.5)
    sparse.activation = "gelu"
    x = 4 * torch.randn(33, 64)
    with torch.no_grad():
        want = torch.nn.functional.gelu(x.double() @ torch.from_numpy(sparse.weight.to_dense()).double().T
                                        + sparse.bias.double())
        got = sparse(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)  # the products' float32 rounding included


def test_an_unknown_activation_is_refused():
    from sparse_mlir.errors import OperandError

    with pytest.raises(OperandError, match="activation must be None or one of gelu"):
        layer(LAYOUTS[0][0]).activation = "tanh"
    with pytest.raises(OperandError, match="activation"):
        SparseLinear(layer(LAYOUTS[0][0]).weight, activation="swish")
