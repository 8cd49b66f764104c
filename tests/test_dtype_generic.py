"""``compile(..., dtype=None)`` (the default): the kernel takes its dtype from the operands, one build per dtype."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import DTYPES, random_sparse, random_values, require

import sparse_mlir as sm
from sparse_mlir.errors import DSLError, DTypeError, NotCompiledError, OperandError

SPMV = "y[i] = A[i,k] * x[k]"


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype_runs_in_its_own_dtype(rng, dtype):
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    dense = random_sparse(rng, (13, 9), 0.3, dtype)
    x = random_values(rng, 9, dtype)
    y = kernel(A=sp.csr_array(dense), x=x)
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, dense @ x)
    assert kernel.signature.inputs[0].dtype == np.dtype(dtype)
    # the kernel of that dtype is the one compile(..., dtype=d) returns: built once, shared
    assert kernel.kernel_for(dtype) is sm.compile(SPMV, formats={"A": "csr"}, dtype=dtype)


def test_one_build_per_dtype_and_the_same_kernel_object(rng):
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    assert sm.compile(SPMV, formats={"A": sm.CSR}) is kernel
    for dtype in ("float32", "float64", "float32"):
        kernel(A=sp.csr_array(random_sparse(rng, (5, 4), 0.5, dtype)), x=random_values(rng, 4, dtype))
    assert {np.dtype("float32"), np.dtype("float64")} <= set(kernel.dtypes)
    assert len(kernel.dtypes) == len(set(kernel.dtypes))
    assert kernel.stats["specializations"] >= 2


def test_float64_default_is_unchanged(rng):
    # a kernel no other test has called (kernels are shared per process, and so is their current dtype)
    kernel = sm.compile("v[r] = M[r,c] * w[c]", formats={"M": "csr"})
    assert kernel.spec.dtype == np.float64  # before any call: float64, as compile() assumed before
    with pytest.raises(NotCompiledError):
        _ = kernel.signature
    kernel.specialize({"M": (6, 5)})
    assert kernel.signature.inputs[0].dtype == np.float64
    kernel.specialize({"M": (6, 5)}, dtype="float32")
    assert kernel.signature.inputs[0].dtype == np.float32 and kernel.spec.dtype == np.float32


def test_mixed_dtypes_name_both_operands(rng):
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    A = sp.csr_array(random_sparse(rng, (5, 4), 0.5, "float32"))
    with pytest.raises(DTypeError, match=r"operand x has dtype float64 but A has float32"):
        kernel(A=A, x=np.ones(4))
    with pytest.raises(DTypeError, match=r"operand x has dtype int32 but A has float32"):
        kernel(A=sm.SparseTensor.from_scipy(A), x=np.ones(4, np.int32))


def test_explicit_dtype_stays_strict(rng):
    kernel = sm.compile(SPMV, formats={"A": "csr"}, dtype="float64")
    A = sp.csr_array(random_sparse(rng, (5, 4), 0.5, "float32"))
    with pytest.raises(DTypeError, match="operand A has dtype float32, the kernel's dtype is float64"):
        kernel(A=A, x=np.ones(4, np.float32))


def test_unsupported_dtypes_are_refused_naming_the_operands(rng):
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    A = sp.csr_array(random_sparse(rng, (5, 4), 0.5, "float64").astype(np.complex128))
    with pytest.raises(DTypeError, match="complex128"):
        kernel(A=A, x=np.ones(4, np.complex128))
    A16 = sm.SparseTensor.from_dense(random_sparse(rng, (5, 4), 0.5, "float16"), "csr")
    with pytest.raises(DTypeError, match=r"operands A, x are float16: .*target='cuda'"):
        kernel(A=A16, x=np.ones(4, np.float16))


def test_python_scalars_follow_the_arrays(rng):
    kernel = sm.compile("y[i] = x[i] * a[]")
    x = random_values(rng, 6, "float32")
    y = kernel(a=2.0, x=x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, 2 * x)
    with pytest.raises(DTypeError, match="not exactly representable as int32"):
        kernel(a=2.5, x=x.astype(np.int32))
    with pytest.raises(DTypeError, match="operand x has dtype float32 but a has float64"):
        kernel(a=np.float64(2.0), x=x)


def test_out_is_checked_not_used_to_choose(rng):
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    A = sp.csr_array(random_sparse(rng, (5, 4), 0.5, "float32"))
    out = np.empty(5, np.float32)
    assert kernel(A=A, x=np.ones(4, np.float32), out=out) is out
    with pytest.raises(DTypeError, match="out= has dtype float64"):
        kernel(A=A, x=np.ones(4, np.float32), out=np.empty(5))


def test_compile_still_checks_the_expression_eagerly():
    with pytest.raises(DSLError):
        sm.compile("y[i] = A[i,k] * ")
    with pytest.raises(DTypeError, match="out_dtype"):
        sm.compile(SPMV, formats={"A": "csr"}, out_dtype="int32", dtype="float64")


def test_out_dtype_is_the_default_and_refuses_other_dtypes(rng):
    kernel = sm.compile(SPMV, formats={"A": "csr"}, out_dtype="float32")
    A = sp.csr_array(random_sparse(rng, (5, 4), 0.5, "float32"))
    assert kernel(A=A, x=np.ones(4, np.float32)).dtype == np.float32
    with pytest.raises(DTypeError, match="operands A, x are float64: out_dtype float32"):
        kernel(A=A.astype(np.float64), x=np.ones(4))


def test_positional_operands_are_refused():
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    with pytest.raises(OperandError, match=r"kernel\(A=\.\.\., x=\.\.\., out=None\)"):
        kernel(np.ones(3))


def test_sparse_output_and_matmul_follow_the_operands(rng):
    dense_a = random_sparse(rng, (6, 5), 0.4, "float32")
    dense_b = random_sparse(rng, (5, 7), 0.4, "float32")
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr", "B": "csr", "C": "csr"})
    C = kernel(A=sp.csr_array(dense_a), B=sp.csr_array(dense_b))
    assert C.dtype == np.float32
    np.testing.assert_array_equal(C.to_dense(), dense_a @ dense_b)
    A = sm.SparseTensor.from_dense(dense_a, "csr")
    np.testing.assert_array_equal(A @ dense_b[:, 0], dense_a @ dense_b[:, 0])


def test_torch_tensors_choose_their_dtype(rng):
    torch = require("torch")
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    dense = random_sparse(rng, (6, 5), 0.5, "float32")
    x = torch.from_numpy(random_values(rng, 5, "float32"))
    y = kernel(A=torch.from_numpy(dense).to_sparse_csr(), x=x)
    assert y.dtype == torch.float32
    np.testing.assert_array_equal(y.numpy(), dense @ x.numpy())
    with pytest.raises(DTypeError, match="operand x has dtype float64 but A has float32"):
        kernel(A=torch.from_numpy(dense).to_sparse_csr(), x=x.double())


def test_auto_schedule_and_cuda_target_take_dtype_none(rng):
    auto = sm.compile(SPMV, formats={"A": "csr"}, schedule="auto")
    dense = random_sparse(rng, (8, 6), 0.4, "float32")
    x = random_values(rng, 6, "float32")
    np.testing.assert_array_equal(auto(A=sp.csr_array(dense), x=x), dense @ x)
    assert auto.schedule is not None  # forwarded to the float32 AutoKernel
    cuda = sm.compile(SPMV, formats={"A": "csr"}, target="cuda")
    assert cuda.target == "cuda" and cuda.kernel_for("float64").spec.dtype == np.float64
    assert cuda.kernel_for("float16").spec.dtype == np.float16  # float16 builds on the GPU target


def test_export_uses_the_current_dtype(rng, tmp_path):
    kernel = sm.compile(SPMV, formats={"A": "csr"})
    kernel(A=sp.csr_array(random_sparse(rng, (5, 4), 0.5, "float32")), x=np.ones(4, np.float32))
    sm.export(kernel, tmp_path, "spmv32", shapes={"A": (5, 4)})
    loaded = sm.load_kernel(tmp_path / "spmv32.json")
    assert loaded.signature.inputs[0].dtype == np.float32
