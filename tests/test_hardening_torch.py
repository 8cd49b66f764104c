"""A sparsified model's state dict holds its sparse weights and round-trips exactly (issue 14 item 13)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from support.data import require

torch = require("torch")

from sparse_mlir.errors import FormatError, InvalidIndicesError
from sparse_mlir.torch import sparsify


def model(seed: int, **prune) -> torch.nn.Module:
    """A small MLP, sparsified: the same architecture gets different weights from a different seed."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8, bias=False))
    return sparsify(net, **(prune or {"sparsity": 0.5}))


def outputs(net: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(99)
    with torch.inference_mode():
        return net(torch.randn(5, 32))


def saved(net: torch.nn.Module) -> dict:
    """``state_dict()`` through ``torch.save`` and a weights-only ``torch.load``, as a checkpoint travels."""
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_state_dict_holds_every_level_buffer_of_the_sparse_weights():
    net = model(0)
    state = net.state_dict()
    for layer in ("0", "2"):
        weight = net[int(layer)].weight
        for name, buffer in zip(weight.format.buffer_names, weight.buffers):
            np.testing.assert_array_equal(state[f"{layer}.weight_{name}"].numpy(), buffer)
        assert state[f"{layer}._extra_state"]["shape"] == list(weight.shape)


@pytest.mark.parametrize("prune", [{"sparsity": 0.5}, {"pattern": "2:4"}, {"sparsity": 0.5, "formats": "coo"}])
def test_load_state_dict_into_another_sparsified_model_round_trips_exactly(prune):
    source, target = model(0, **prune), model(1, **prune)
    assert not torch.equal(outputs(source), outputs(target))
    result = target.load_state_dict(saved(source))
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(outputs(source), outputs(target))
    for layer in (0, 2):
        for a, b in zip(source[layer].weight.buffers, target[layer].weight.buffers):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def test_a_checkpoint_with_another_number_of_entries_is_loaded_whole():
    """Level buffers are replaced, not copied into: a 90% model takes a 50% checkpoint."""
    source, target = model(0, sparsity=0.5), model(1, sparsity=0.9)
    target.load_state_dict(saved(source))
    assert target[0].weight.nnz == source[0].weight.nnz
    assert torch.equal(outputs(source), outputs(target))


def test_a_checkpoint_of_another_format_is_refused_before_anything_changes():
    target = model(1, pattern="2:4")
    before = outputs(target)
    with pytest.raises(FormatError, match="csr of shape .* built for 2:4"):
        target.load_state_dict(saved(model(0, sparsity=0.5)))
    assert torch.equal(outputs(target), before)


def test_corrupt_level_buffers_are_refused_before_anything_changes():
    state = saved(model(0))
    state["0.weight_crd1"][0] = 1000
    target = model(1)
    before = outputs(target)
    with pytest.raises(InvalidIndicesError, match="0.weight: .*crd1 holds 1000"):
        target.load_state_dict(state)
    assert torch.equal(outputs(target), before)


def test_a_checkpoint_without_the_sparse_weights_does_not_silently_match():
    """What ``state_dict()`` used to be (biases only) now reports the weights missing."""
    state = {key: value for key, value in saved(model(0)).items() if "weight_" not in key and "extra" not in key}
    with pytest.raises(RuntimeError, match="Missing key.*0.weight_values"):
        model(1).load_state_dict(state)


def test_a_checkpoint_with_part_of_a_weight_raises_even_when_not_strict():
    state = saved(model(0))
    del state["2.weight_crd1"]
    with pytest.raises(RuntimeError, match="2.weight: the checkpoint has .* but not .*2.weight_crd1"):
        model(1).load_state_dict(state, strict=False)


def test_the_buffers_are_the_weight():
    """The kernel reads the buffers' memory: an in-place change shows, and ``.to()`` keeps them in step."""
    net = model(0)
    before = outputs(net)
    net.to(torch.float32)
    assert torch.equal(outputs(net), before)
    with torch.no_grad():
        net[2].weight_values.mul_(2)
    assert torch.allclose(outputs(net), 2 * before)


def test_sparse_linear_edges_are_refused_by_name_or_work():
    """An audit's finds: ``activation=["gelu"]`` was a bare TypeError, a sparse input a RuntimeError from deep in
    the forward, a Linear with no input features could not reshape its input, and a dense checkpoint weight on
    the meta device or with complex values (its imaginary part silently dropped) was pruned."""
    from sparse_mlir.errors import OperandError
    from sparse_mlir.torch import SparseLinear

    layer = SparseLinear.from_linear(torch.nn.Linear(8, 4), sparsity=0.5)
    with pytest.raises(OperandError, match="activation"):
        SparseLinear.from_linear(torch.nn.Linear(8, 4), sparsity=0.5).activation = ["gelu"]
    with pytest.raises(OperandError, match="dense"):
        layer(torch.randn(3, 8).to_sparse())
    for weight in (torch.empty(4, 8, device="meta"), torch.randn(4, 8, dtype=torch.complex64)):
        with pytest.raises(OperandError, match="real values"):
            layer.load_state_dict({"weight": weight, "bias": torch.zeros(4)})
    empty = SparseLinear.from_linear(torch.nn.Linear(0, 4), sparsity=0.5)
    torch.testing.assert_close(empty(torch.randn(3, 0)), empty.bias.detach().expand(3, 4))


def test_level_buffers_changed_in_place_are_checked_again():
    """A SparseLinear's coordinate set to 10**9 in place (under no_grad), or an operator called with its own
    buffers, crashed the kernel: the operators wrapped the buffers unchecked."""
    from sparse_mlir.errors import FormatError
    from sparse_mlir.torch import SparseLinear

    layer = SparseLinear.from_linear(torch.nn.Linear(16, 8), sparsity=0.5)
    x = torch.randn(3, 16)
    want, first = layer(x), int(layer.weight_crd1[0])
    with torch.no_grad():
        layer.weight_crd1[0] = 10 ** 9
    with pytest.raises(InvalidIndicesError, match="out of range"):
        layer(x)
    with torch.no_grad():
        layer.weight_crd1[0] = first  # put back: checked again, and right
    torch.testing.assert_close(layer(x), want)
    torch.ops.sparse_mlir.linear(x, layer.weight_values.detach(), None, [layer.weight_pos1, layer.weight_crd1], [],
                                 layer._format_key, list(layer._shape), "")
    with pytest.raises(FormatError, match="format key"):
        torch.ops.sparse_mlir.linear(x, layer.weight_values.detach(), None, [layer.weight_pos1, layer.weight_crd1],
                                     [], "[1,2]", list(layer._shape), "")
