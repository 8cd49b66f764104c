"""SparseLinear and sparsify against torch.nn.Linear on the same pruned weights."""

from __future__ import annotations

import numpy as np
import pytest
from support.data import require

torch = require("torch")

from sparse_mlir.errors import DeviceError, OperandError  # noqa: E402
from sparse_mlir.torch import SparseLinear, sparsify  # noqa: E402


@pytest.mark.parametrize("kw", [{"pattern": "2:4"}, {"sparsity": 0.9}, {"sparsity": 0.5, "format": "dcsr"}])
def test_sparse_linear_matches_linear_on_pruned_weights(kw):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    sparse = SparseLinear.from_linear(linear, **kw)
    x = torch.randn(3, 7, 64)  # 3-d activations are flattened into rows
    with torch.no_grad():
        want = x @ torch.from_numpy(sparse.weight.to_dense()).T + linear.bias
        got = sparse(x)
    assert got.shape == (3, 7, 48)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_sparsify_replaces_linears_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 8, bias=False))
    returned = sparsify(model, pattern="2:4")
    assert returned is model
    assert all(isinstance(model[i], SparseLinear) for i in (0, 2)) and model[2].bias is None
    with torch.inference_mode():
        assert model(torch.randn(4, 32)).shape == (4, 8)


def test_inference_only_and_cpu_only():
    sparse = SparseLinear.from_linear(torch.nn.Linear(8, 4), sparsity=0.5)
    with pytest.raises(OperandError, match="inference-only"):
        sparse(torch.randn(2, 8, requires_grad=True))
    with pytest.raises(OperandError, match="float32"), torch.no_grad():
        sparse(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(OperandError, match="pattern"):
        SparseLinear.from_linear(torch.nn.Linear(8, 4))
    meta = torch.empty(2, 8, device="meta")
    with pytest.raises(DeviceError), torch.no_grad():
        sparse(meta)
