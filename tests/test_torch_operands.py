"""torch tensors in and out of every kernel kind (``runtime/torch_tensors.py``): zero-copy, validated, refused clearly."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.errors import DTypeError, FormatError, InvalidIndicesError, OperandError

torch = pytest.importorskip("torch")

SPMM = "C[i,j] = A[i,k] * B[k,j]"


@pytest.fixture
def matrix():
    return sp.random(30, 20, density=0.2, format="csr", dtype=np.float32, random_state=4)


def test_dense_torch_operands_give_a_torch_result_over_the_kernels_memory(matrix):
    kernel = sm.compile(SPMM, formats={"A": "csr"}, dtype="float32")
    b = torch.randn(20, 7)
    before = b.clone()
    got = kernel(A=sm.SparseTensor.from_scipy(matrix), B=b)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (30, 7)
    np.testing.assert_allclose(got.numpy(), matrix @ b.numpy(), rtol=1e-5, atol=1e-5)
    assert torch.equal(b, before)
    out = torch.full((30, 7), float("nan"))
    assert kernel(A=sm.SparseTensor.from_scipy(matrix), B=b, out=out) is out  # written in place
    np.testing.assert_allclose(out.numpy(), matrix @ b.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["csr", "coo"])
def test_torch_sparse_operands_are_checked_like_scipy_ones(matrix, layout):
    kernel = sm.compile(SPMM, formats={"A": "csr"}, dtype="float32")
    dense = torch.from_numpy(matrix.toarray())
    a = dense.to_sparse_csr() if layout == "csr" else dense.to_sparse_coo()
    b = torch.randn(20, 5)
    got = kernel(A=a, B=b)
    np.testing.assert_allclose(got.numpy(), matrix @ b.numpy(), rtol=1e-5, atol=1e-5)
    if layout == "csr":  # a column index out of range, as a careless builder of the tensor might leave it
        bad = torch.sparse_csr_tensor(a.crow_indices(), a.col_indices().clone().fill_(25), a.values(), size=(30, 20),
                                      check_invariants=False)
        with pytest.raises(InvalidIndicesError):
            kernel(A=bad, B=b)


def test_a_csr_result_comes_back_as_a_torch_sparse_csr_tensor(matrix):
    add = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": "csr", "B": "csr", "C": "csr"}, dtype="float32")
    a = torch.from_numpy(matrix.toarray()).to_sparse_csr()
    got = add(A=a, B=a)
    assert got.layout == torch.sparse_csr
    np.testing.assert_allclose(got.to_dense().numpy(), 2 * matrix.toarray(), rtol=1e-6)


def test_what_torch_cannot_give_a_kernel_is_refused_by_name(matrix):
    kernel = sm.compile(SPMM, formats={"A": "csr"}, dtype="float32")
    a = sm.SparseTensor.from_scipy(matrix)
    with pytest.raises(OperandError, match="B requires grad.*detach"):
        kernel(A=a, B=torch.randn(20, 3, requires_grad=True))
    with pytest.raises(DTypeError, match="B is a torch.bfloat16"):
        kernel(A=a, B=torch.randn(20, 3).to(torch.bfloat16))
    with pytest.raises(DTypeError):  # float64 into a float32 kernel: never cast
        kernel(A=a, B=torch.randn(20, 3, dtype=torch.float64))
    with pytest.raises(OperandError, match="out= must be a contiguous"):
        kernel(A=a, B=torch.randn(20, 3), out=torch.empty(3, 30).t())
    with pytest.raises(FormatError, match="sparse_csc"):
        kernel(A=torch.from_numpy(matrix.toarray()).to_sparse_csc(), B=torch.randn(20, 3))


def test_exported_kernels_take_torch_tensors_too(matrix, tmp_path):
    kernel = sm.compile(SPMM, formats={"A": "csr"}, dtype="float32")
    sm.export(kernel, tmp_path, "spmm", shapes={"A": (30, 20), "B": (20, 4)})
    loaded = sm.load_kernel(tmp_path / "spmm.json")
    b = torch.randn(20, 4)
    got = loaded(A=torch.from_numpy(matrix.toarray()).to_sparse_csr(), B=b)
    np.testing.assert_allclose(got.numpy(), matrix @ b.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["coo row past the end", "coo row -1", "csr crow past nnz", "csr crow too short"])
def test_torch_sparse_tensors_with_broken_invariants_are_invalid_indices(case):
    """Built with ``check_invariants=False``; these reached scipy's constructors, which raised bare ``ValueError``s
    (a negative COO row went through ``coalesce`` folded into another entry's linear index first)."""
    kernel = sm.compile("y[i] = A[i,k] * x[k]", formats={"A": "csr"}, dtype="float64")
    one, two = torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64)
    a = {"coo row past the end": lambda: torch.sparse_coo_tensor(torch.tensor([[5], [0]]), one, (3, 3),
                                                                  check_invariants=False),
         "coo row -1": lambda: torch.sparse_coo_tensor(torch.tensor([[-1], [0]]), one, (3, 3), check_invariants=False),
         "csr crow past nnz": lambda: torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 9]), torch.tensor([0, 1]), two,
                                                              (3, 3), check_invariants=False),
         "csr crow too short": lambda: torch.sparse_csr_tensor(torch.tensor([0, 2]), torch.tensor([0, 1]), two, (3, 3),
                                                               check_invariants=False)}[case]()
    with pytest.raises(InvalidIndicesError, match="operand A"):
        kernel(A=a, x=torch.ones(3, dtype=torch.float64))
