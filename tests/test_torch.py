"""SparseLinear and sparsify against torch.nn.Linear on the same pruned weights."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support.data import require

torch = require("torch")

from sparse_mlir.errors import (
    DeviceError,
    DTypeError,
    FormatError,
    OperandError,
    OptionError,
    PatternError,
    ShapeError,
)
from sparse_mlir.torch import SparseLinear, sparsify, sparsity_report


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


@pytest.mark.parametrize("kw", [{"pattern": "2:4"}, {"sparsity": 0.9}])
@pytest.mark.parametrize("rows", [1, 300, 1100])
def test_the_output_is_row_major_over_batch_blocks(kw, rows):
    """The Linear kernel writes ``y`` rows directly (no transposed view for the next layers to copy), whether the
    batch runs as one block, blocks one after the other (300 rows) or blocks in parallel (1100 rows)."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(384, 200)
    sparse = SparseLinear.from_linear(linear, **kw)
    x = torch.randn(rows, 384)
    with torch.no_grad():
        want = x @ torch.from_numpy(sparse.weight.to_dense()).T + linear.bias
        got = sparse(x)
    assert got.is_contiguous()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


def test_sparsify_replaces_linears_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 8, bias=False))
    returned = sparsify(model, pattern="2:4")
    assert returned is model
    assert all(isinstance(model[i], SparseLinear) for i in (0, 2)) and model[2].bias is None
    with torch.inference_mode():
        assert model(torch.randn(4, 32)).shape == (4, 8)


def test_what_the_layer_cannot_run_is_refused_by_name():
    sparse = SparseLinear.from_linear(torch.nn.Linear(8, 4), sparsity=0.5)
    with pytest.raises(OperandError, match="computes in torch.float32.*torch.float64"):
        sparse(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(OperandError, match="8 features"):
        sparse(torch.randn(2, 7))
    with pytest.raises(DeviceError):
        sparse(torch.empty(2, 8, device="meta"))
    with pytest.raises(DTypeError, match="float16"):
        SparseLinear.from_linear(torch.nn.Linear(8, 4), sparsity=0.5).half()(torch.randn(2, 8).half())


def test_double_switches_the_layer_to_float64_kernels():
    sparse = SparseLinear.from_linear(torch.nn.Linear(8, 4), sparsity=0.5).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        want = x @ torch.from_numpy(sparse.weight.to_dense()).T + sparse.bias
        got = sparse(x)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


def test_a_bare_linear_is_converted_and_returned():
    linear = torch.nn.Linear(16, 8)
    before = linear.weight.detach().clone()
    sparse = sparsify(linear, sparsity=0.75)
    assert isinstance(sparse, SparseLinear)
    assert torch.equal(linear.weight, before)  # the user's layer is copied, not changed
    report = sparsity_report(sparse)
    assert [layer.name for layer in report.layers] == [""] and report.sparsity == pytest.approx(0.75)


def test_sparsify_reports_layers_by_qualified_name_and_the_sparsity_reached():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(32, 16)), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    sparsify(model, sparsity=0.9)
    report = sparsity_report(model)
    assert [(layer.name, layer.shape) for layer in report.layers] == [("0.0", (16, 32)), ("2", (8, 16))]
    stored = model[0][0].weight.nnz + model[2].weight.nnz
    assert report.sparsity == pytest.approx(1 - stored / (16 * 32 + 8 * 16)) and report.sparsity == pytest.approx(0.9,
                                                                                                                   abs=0.01)
    assert "0.0: csr 16x32" in str(report) and "2 sparse layers" in str(report)


@pytest.mark.parametrize("options, error, match", [
    ({"pattern": "2:4", "sparsity": 0.9}, OptionError, "conflicts"),
    ({}, OptionError, "pattern='N:M'"),
    ({"sparsity": 0.9, "formats": "bsr4x4"}, OptionError, "ineffective.*block"),
    ({"sparsity": 0.9, "formats": "2:4"}, OptionError, "ineffective.*pattern="),
    ({"pattern": "2:4", "formats": "bsr2x2"}, OptionError, "does not store"),
    ({"pattern": "2:4", "formats": "4:8"}, OptionError, "does not store"),
    ({"pattern": "two:four"}, PatternError, "N:M"),
    ({"sparsity": 1.0}, PatternError, r"\[0, 1\)"),
    ({"sparsity": "0.5"}, PatternError, "fraction"),
    ({"sparsity": 0.5, "formats": "coo3"}, FormatError, "3-d"),
])
def test_conflicting_or_ineffective_options_raise_before_anything_changes(options, error, match):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(error, match=match):
        sparsify(model, **options)
    assert type(model[0]) is torch.nn.Linear


def test_layers_that_cannot_be_swapped_are_left_dense_with_a_warning():
    attention = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    with pytest.warns(UserWarning, match="self_attn.out_proj .*subclasses nn.Linear"):
        sparsify(attention, sparsity=0.5)
    assert [layer.name for layer in sparsity_report(attention).layers] == ["linear1", "linear2"]
    with torch.no_grad():  # MultiheadAttention still reads its out_proj.weight
        assert attention(torch.randn(2, 3, 16)).shape == (2, 3, 16)
    tied = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.warns(UserWarning, match="tied"), pytest.raises(OptionError, match="no nn.Linear"):
        sparsify(tied, sparsity=0.5)
    with pytest.raises(OptionError, match="no nn.Linear"):
        sparsify(torch.nn.Sequential(torch.nn.ReLU()), sparsity=0.5)


def test_a_layer_that_cannot_be_pruned_leaves_the_whole_model_as_it_was():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 6))  # 6 columns of the second: not 2:4
    model.append(torch.nn.Linear(6, 4))
    with pytest.raises(PatternError, match="layer 2: 2:4 pruning groups columns by 4, but there are 6"):
        sparsify(model, pattern="2:4")
    assert all(type(layer) is torch.nn.Linear for layer in model)


def test_replaced_values_or_bias_of_the_wrong_size_are_refused_not_read_out_of_bounds():
    sparse = SparseLinear.from_linear(torch.nn.Linear(8, 4), sparsity=0.5)
    sparse.weight_values = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ShapeError, match="weight_values has shape .3,., but the weight's pattern stores 16"):
        sparse(torch.randn(2, 8))
    sparse = SparseLinear.from_linear(torch.nn.Linear(8, 4), sparsity=0.5)
    sparse.bias = torch.nn.Parameter(torch.randn(2))
    with pytest.raises(OperandError, match="bias .* shape .2,.*shape .4,."):
        sparse(torch.randn(2, 8))


def test_sparse_linear_calls_let_the_pool_sleep_at_once_and_other_kernels_spin_again():
    """Between SparseLinear calls torch's own OpenMP pool runs on the same cores: our idle workers must not spin
    there (blocktime 0); a kernel called outside a layer gets the usual few milliseconds back."""
    script = textwrap.dedent("""
        import ctypes, numpy as np, scipy.sparse as sp, torch, sparse_mlir as sm
        from sparse_mlir.runtime import threads
        from sparse_mlir.torch import SparseLinear
        if threads.openmp_library() is None:
            print("no-openmp")
        else:
            get = threads.load_runtime().kmp_get_blocktime
            get.restype = ctypes.c_int
            layer = SparseLinear.from_linear(torch.nn.Linear(256, 256), sparsity=0.5)
            with torch.no_grad():
                layer(torch.randn(600, 256))
            inside = get()
            a = sp.random(3000, 3000, density=0.01, format="csr", random_state=0)
            sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})(A=a, x=np.ones(3000))
            print(inside, get())
    """)
    environ = {k: v for k, v in os.environ.items() if k != "KMP_BLOCKTIME"} | {"SPARSE_MLIR_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "no-openmp":
        pytest.skip("no OpenMP runtime")
    assert out.stdout.split() == ["0", "5"]
