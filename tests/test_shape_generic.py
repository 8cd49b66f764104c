"""Shape-generic CPU kernels: one build per (expression, formats, dtype, options) takes every size at run time.

The hand-scheduled CPU kernels (CSR SpMV, CSR / N:M / BSR SpMM with a bias or
an epilogue, the Linear orientation, SDDMM) compile once and run on any
size; their C entry point takes the sparse operands' sizes as parameters and
still refuses sizes and buffers that disagree (status codes), from a JIT
kernel, an export loaded from Python and raw C calls alike.  Sparsifier
kernels keep one build per sparse shape.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from support.data import prune_nm, random_sparse, random_values

import sparse_mlir as sm
from sparse_mlir.abi.c_signature import BAD_LEVELS, NULL_POINTER, OK, SIZE_MISMATCH
from sparse_mlir.errors import InvalidIndicesError, ShapeError
from sparse_mlir.tensor.host import SparseTensor


def _csr(a: np.ndarray, fmt: str = "csr") -> SparseTensor:
    return sm.SparseTensor.from_dense(a, fmt)


def _nm(rng, shape, dtype="float32"):
    return prune_nm(random_sparse(rng, shape, 0.9, dtype), 2, 4)


# (expression, formats, run(kernel, rng, sizes) -> (result, expected)), each over sizes (m, k, n)
def _spmv(k, rng, m, n, _):
    a, x = random_sparse(rng, (m, n), 0.3, "float32"), random_values(rng, n, "float32")
    return k(A=_csr(a), x=x), a @ x


def _spmm(fmt):
    def run(k, rng, m, kk, n):
        a = _nm(rng, (m, kk)) if fmt == "2:4" else random_sparse(rng, (m, kk), 0.3, "float32")
        b = random_values(rng, (kk, n), "float32")
        return k(A=_csr(a, fmt), B=b), a @ b
    return run


def _spmm_bias(k, rng, m, kk, n):
    a, b, bias = random_sparse(rng, (m, kk), 0.3, "float32"), random_values(rng, (kk, n), "float32"), \
        random_values(rng, n, "float32")
    return k(A=_csr(a, "bsr2x3"), B=b, bias=bias), a @ b + bias


def _spmm_relu(k, rng, m, kk, n):
    a, b, bias = random_sparse(rng, (m, kk), 0.3, "float32"), random_values(rng, (kk, n), "float32"), \
        random_values(rng, m, "float32")
    return k(A=_csr(a), B=b, bias=bias), np.maximum(a @ b + bias[:, None], 0)


def _linear(fmt):
    def run(k, rng, o, i, b):
        w = _nm(rng, (o, i)) if fmt == "2:4" else random_sparse(rng, (o, i), 0.3, "float32")
        x, bias = random_values(rng, (b, i), "float32"), random_values(rng, o, "float32")
        return k(X=x, W=_csr(w, fmt), bias=bias), x @ w.T + bias
    return run


def _sddmm(k, rng, m, kk, n):
    s = random_sparse(rng, (m, n), 0.3, "float32")
    a, b = random_values(rng, (m, kk), "float32"), random_values(rng, (kk, n), "float32")
    return k(S=_csr(s), A=a, B=b).to_dense(), s * (a @ b)


def _spgemm(k, rng, m, kk, n):
    a, b = random_sparse(rng, (m, kk), 0.3, "float32"), random_sparse(rng, (kk, n), 0.3, "float32")
    return k(A=_csr(a), B=_csr(b)).to_dense(), a @ b


CASES = {
    "spgemm": ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr", "B": "csr", "C": "csr"}, _spgemm),
    "spmv": ("y[i] = A[i,j] * x[j]", {"A": "csr"}, _spmv),
    "spmm_csr": ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}, _spmm("csr")),
    "spmm_24": ("C[i,j] = A[i,k] * B[k,j]", {"A": "2:4"}, _spmm("2:4")),
    "spmm_relu": ("C[i,j] = relu(A[i,k] * B[k,j] + bias[i])", {"A": "csr"}, _spmm_relu),
    "bsr_bias": ("C[i,j] = A[i,k] * B[k,j] + bias[j]", {"A": "bsr2x3"}, _spmm_bias),
    "linear_csr": ("Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "csr"}, _linear("csr")),
    "linear_24": ("Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "2:4"}, _linear("2:4")),
    "sddmm": ("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": "csr"}, _sddmm),
}
# sizes every format takes (rows a multiple of 2, columns of 3 and 4 for bsr2x3 and 2:4), odd vector tails,
# and an empty one
SIZES = [(6, 12, 5), (34, 24, 33), (2, 36, 1), (0, 12, 3)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_build_takes_every_size(case, rng):
    expression, formats, run = CASES[case]
    kernel = sm.compile(expression, formats=formats, dtype="float32")  # compile() is cached: other tests' too
    assert kernel.shape_generic
    got, expected = run(kernel, rng, *SIZES[0])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    before, used = kernel.stats, kernel.specializations[-1] if kernel.specializations else None
    for sizes in SIZES[1:]:
        got, expected = run(kernel, rng, *sizes)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    assert kernel.stats == before and kernel.specializations[-1] is used  # no new build for a new size
    assert all(s is None for s in kernel.signature.inputs[0].shape + kernel.signature.output.shape)


def test_index_widths_still_make_their_own_build(rng):
    # names no other test uses: compile() is cached per process, and so are its kernel's stats
    kernel = sm.compile("y[i] = Widths[i,j] * v[j]", formats={"Widths": "csr"}, dtype="float64")
    a = random_sparse(rng, (9, 7), 0.4, "float64")
    for rows, fmt in ((9, sm.CSR), (9, sm.CSR.with_widths(64, 64)), (5, sm.CSR), (4, sm.CSR.with_widths(64, 64))):
        got = kernel(Widths=sm.SparseTensor.from_dense(a[:rows], fmt), v=np.ones(7))
        np.testing.assert_allclose(got, a[:rows].sum(1))
    assert kernel.stats["specializations"] == 2


def test_sparsifier_kernels_stay_per_shape(rng):
    kernel = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": "csr"}, dtype="float64")
    assert not kernel.shape_generic
    for rows in (3, 4):
        a, b = random_sparse(rng, (rows, 5), 0.4, "float64"), random_values(rng, (rows, 5), "float64")
        np.testing.assert_array_equal(kernel(A=_csr(a), B=b), a + b)
    assert kernel.stats["specializations"] == 2


def test_specialize_needs_no_shapes_for_a_generic_kernel():
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "2:4"}, dtype="float32")
    assert kernel.specialize({}) is kernel
    assert [p.name for p in kernel.signature.params()[:8]] == ["A_crd2", "A_crd2_len", "A_values", "A_values_len",
                                                               "A_d0", "A_d1", "B", "B_d0"]
    with pytest.raises(ShapeError, match="not an operand"):
        kernel.specialize({"Z": (4, 4)})


def test_the_entry_point_still_refuses_buffers_that_disagree_with_the_sizes(rng):
    kernel = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}, dtype="float64")
    good = _csr(random_sparse(rng, (5, 4), 0.5, "float64"))
    kernel(A=good, x=np.ones(4))
    lying = SparseTensor(good.format, (6, 4), good.buffers, validate=False)  # positions are 6 long, not 7
    with pytest.raises(InvalidIndicesError, match="status 3"):
        kernel(A=lying, x=np.ones(4))


# -- exports -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generic")
    kernels = {"spmm": ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}), "nm": ("C[i,j] = A[i,k] * B[k,j]", {"A": "2:4"}),
               "bsr": ("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr2x3"})}
    out = {name: sm.export(sm.compile(e, formats=f, dtype="float32"), folder, f"g_{name}")
           for name, (e, f) in kernels.items()}
    spmm = sm.compile(kernels["spmm"][0], formats=kernels["spmm"][1], dtype="float32")
    out["fixed"] = sm.export(spmm, folder, "f_spmm", shapes={"A": (6, 12)})
    return out


def test_a_generic_export_takes_sizes_at_run_time(exports, rng):
    header = exports["spmm"]["header"].read_text()
    assert "int64_t A_d0" in header and "int64_t A_d1" in header and "shape ?x?" in header
    loaded = sm.load_kernel(exports["spmm"]["manifest"])
    assert loaded.shape_generic
    for m, kk, n in SIZES:
        got, expected = _spmm("csr")(loaded, rng, m, kk, n)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    fixed = sm.load_kernel(exports["fixed"]["manifest"])
    assert not fixed.shape_generic
    with pytest.raises(ShapeError, match="exported for A"):
        _spmm("csr")(fixed, rng, 8, 12, 3)


class _Call:
    """The exported C function called as C would, with every parameter named (``Signature.params()``)."""

    def __init__(self, paths, tensor: SparseTensor, b: np.ndarray, c: np.ndarray):
        manifest = sm.load_kernel(paths["manifest"])
        self.sig = manifest.signature
        self.function = getattr(ctypes.CDLL(str(paths["library"])), self.sig.name)
        self.function.restype = ctypes.c_int32
        self.keep = [*tensor.buffers, b, c]
        self.values: dict[str, int] = {}
        for (name, _), buf in zip(self.sig.inputs[0].buffers(), tensor.buffers):
            self.values[f"A_{name}"], self.values[f"A_{name}_len"] = buf.ctypes.data, buf.size
        for name, array in (("A", tensor), ("B", b), ("C", c)):
            for d, size in enumerate(array.shape):
                self.values[f"{name}_d{d}"] = size
        self.values["B"], self.values["C"] = b.ctypes.data, c.ctypes.data

    def __call__(self, **changes: int) -> int:
        values = {**self.values, **changes}
        args = [ctypes.c_int64(values[p.name]) if p.ctype == "int64_t" else ctypes.c_void_p(values[p.name])
                for p in self.sig.params()]
        return self.function(*args)


def _operands(rng, fmt: str, m: int, k: int, n: int):
    a = prune_nm(random_sparse(rng, (m, k), 0.9, "float32"), 2, 4) if fmt == "2:4" else \
        random_sparse(rng, (m, k), 0.4, "float32")
    b = random_values(rng, (k, n), "float32")
    return a, sm.SparseTensor.from_dense(a, fmt), b, np.zeros((m, n), np.float32)


@pytest.mark.parametrize("name, fmt", [("spmm", "csr"), ("nm", "2:4"), ("bsr", "bsr2x3")])
def test_a_generic_export_checks_every_size_in_c(exports, rng, name, fmt):
    a, tensor, b, c = _operands(rng, fmt, 12, 24, 5)
    call = _Call(exports[name], tensor, b, c)
    assert call() == OK
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-4)
    assert call(A_d1=25, B_d0=25) == (OK if fmt == "csr" else SIZE_MISMATCH)  # CSR: a wider A, its buffers fit
    assert call(A_d1=23) == SIZE_MISMATCH  # disagrees with B's rows
    assert call(C_d0=11) == SIZE_MISMATCH  # disagrees with A's rows
    assert call(A_d0=-12, C_d0=-12) == SIZE_MISMATCH  # negative
    assert call(A_d0=13, C_d0=13) in (SIZE_MISMATCH, BAD_LEVELS)  # the buffers are for 12 rows
    assert call(B=0) == NULL_POINTER
    if fmt == "2:4":
        assert call(A_d1=22, B_d0=22) == SIZE_MISMATCH  # not a multiple of the group
        assert call(A_d0=6, C_d0=6) == BAD_LEVELS  # half the coordinates' rows
    if fmt == "bsr2x3":
        assert call(A_d0=13, C_d0=13) == SIZE_MISMATCH  # not a multiple of the block
        assert call(A_d0=14, C_d0=14) == BAD_LEVELS  # one more block row than the positions have
    if fmt == "csr":
        assert call(A_d0=11, C_d0=11) == BAD_LEVELS  # positions are 13 long, not 12
        assert call(A_pos1_len=12) == BAD_LEVELS


def test_a_fixed_export_of_a_generic_kernel_refuses_other_sizes_in_c(exports, rng):
    a, tensor, b, c = _operands(rng, "csr", 6, 12, 4)
    call = _Call(exports["fixed"], tensor, b, c)
    assert "A_d0" not in [p.name for p in call.sig.params()]  # A's sizes are compiled in
    assert call() == OK
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-4)
    assert call(B_d0=13) == SIZE_MISMATCH
