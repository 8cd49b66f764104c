"""SparseLinear and SparseFeedForward call their kernels directly when nothing records the call, and through the
custom operators whenever something does (autograd, the profiler, tracing, dispatch modes): same numbers either
way, and a kept weight operand that never goes stale."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from support.data import require

torch = require("torch")

import sparse_mlir.torch as sparse_torch  # noqa: E402
from sparse_mlir.torch import SparseFeedForward, SparseLinear  # noqa: E402

OPTIONS = [{"pattern": "2:4"}, {"sparsity": 0.8}]


def _layer(options: dict, inputs: int = 32, outputs: int = 24, dtype=torch.float32, seed: int = 0
           ) -> SparseLinear:
    torch.manual_seed(seed)
    return SparseLinear.from_linear(torch.nn.Linear(inputs, outputs).to(dtype), **options)


@pytest.fixture
def operator_calls(monkeypatch) -> list[str]:
    """The names of the custom operators' wrappers ``sparse_mlir.torch`` called (the dispatcher path)."""
    calls: list[str] = []
    for name in ("linear", "feed_forward"):
        original = getattr(sparse_torch, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(sparse_torch, name, counted)
    return calls


@pytest.mark.parametrize("options", OPTIONS)
def test_inference_calls_the_kernel_directly_with_the_operators_numbers(options, operator_calls):
    layer = _layer(options)
    x = torch.randn(5, 3, 32)
    with torch.inference_mode():
        direct = layer(x)
    assert operator_calls == []
    with torch.no_grad():
        assert torch.equal(layer(x), direct)
    assert operator_calls == []
    through_operator = layer(x)  # the parameters want gradients: autograd records the operator
    assert operator_calls == ["linear"] and through_operator.requires_grad
    assert torch.equal(through_operator.detach(), direct)
    want = x @ torch.from_numpy(layer.weight.to_dense()).T + layer.bias.detach()
    np.testing.assert_allclose(direct.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", OPTIONS)
def test_the_profiler_a_dispatch_mode_and_tracing_see_the_operator(options, operator_calls):
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    layer = _layer(options)
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = layer(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = layer(x)
        assert "sparse_mlir::linear" in {event.key for event in prof.key_averages()}
        assert torch.equal(got, want) and operator_calls == ["linear"]
        with FlopCounterMode(display=False):
            assert torch.equal(layer(x), want)
        assert operator_calls == ["linear"] * 2
        with torch.device("cpu"):  # a function mode
            assert torch.equal(layer(x), want)
        assert operator_calls == ["linear"] * 3
        traced = torch.jit.trace(layer, x, check_trace=False)
    assert operator_calls == ["linear"] * 4
    assert "sparse_mlir::linear" in str(traced.graph)  # a traced call, not the result baked in as a constant
    other = torch.randn(6, 32)
    with torch.no_grad():
        assert torch.equal(traced(other), layer(other))


def test_values_changed_in_place_are_read_by_the_next_call():
    layer = _layer({"sparsity": 0.8})
    x = torch.randn(3, 32)
    with torch.no_grad():
        before = layer(x) - layer.bias
        layer.weight_values.mul_(2)  # a torch in-place op (an optimizer step does the same)
        np.testing.assert_allclose((layer(x) - layer.bias).numpy(), 2 * before.numpy(), rtol=1e-6, atol=1e-6)
        layer.weight_values.numpy()[:] *= 0.5  # through a numpy view of the same memory
        np.testing.assert_allclose((layer(x) - layer.bias).numpy(), before.numpy(), rtol=1e-6, atol=1e-6)


def test_the_bias_kept_with_the_weight_follows_changes_replacement_and_removal():
    layer = _layer({"pattern": "2:4"})
    x = torch.randn(3, 32)
    with torch.no_grad():
        plain = layer(x) - layer.bias
        layer.bias.add_(1.0)  # in place: the kept array is a view of the same memory
        assert torch.allclose(layer(x), plain + layer.bias, atol=1e-6)
        layer.bias = torch.nn.Parameter(torch.full((24,), 3.0))  # a new tensor: a new array
        assert torch.allclose(layer(x), plain + 3.0, atol=1e-6)
        layer.bias.data = torch.full((24,), -2.0)  # the same parameter over new memory
        assert torch.allclose(layer(x), plain - 2.0, atol=1e-6)
        layer.bias = None
        assert torch.allclose(layer(x), plain, atol=1e-6)


@pytest.mark.parametrize("options", OPTIONS)
def test_a_recast_or_reloaded_layer_is_not_served_its_old_weight(options):
    layer = _layer(options)
    x = torch.randn(3, 32)
    with torch.no_grad():
        layer(x)
        layer.double()  # new tensors for every buffer
        got = layer(x.double())
        assert got.dtype == torch.float64
        want = x.double() @ torch.from_numpy(layer.weight.to_dense()).T + layer.bias
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)
        other = _layer(options, dtype=torch.float64, seed=1)  # other weights (at 80%: other positions)
        layer.load_state_dict(other.state_dict())
        assert torch.equal(layer(x.double()), other(x.double()))


def test_copies_and_pickles_do_not_share_the_kept_operand():
    layer = _layer({"pattern": "2:4"})
    x = torch.randn(3, 32)
    with torch.no_grad():
        want = layer(x)
        twin = copy.deepcopy(layer)
        twin.weight_values.zero_()
        assert torch.equal(layer(x), want)
        assert torch.equal(twin(x), twin.bias.expand(3, -1))
        assert "_kept_operand" not in layer.__getstate__()
        revived = pickle.loads(pickle.dumps(layer))
        assert torch.equal(revived(x), want)


@pytest.mark.parametrize("options", OPTIONS)
def test_a_fused_feed_forward_calls_its_kernel_directly_in_inference(options, operator_calls):
    first, second = _layer(options, 32, 48), _layer(options, 48, 16)
    first.activation = "gelu"
    block = SparseFeedForward(first, second)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        direct = block(x)
    assert operator_calls == []
    with torch.no_grad(), FlopCounter():
        assert torch.equal(block(x), direct)
    assert operator_calls == ["feed_forward"]
    with torch.no_grad():
        want = second(first(x))
    np.testing.assert_allclose(direct.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def FlopCounter():  # noqa: N802 (a context manager, as torch names it)
    from torch.utils.flop_counter import FlopCounterMode
    return FlopCounterMode(display=False)
