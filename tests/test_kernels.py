"""Every kernel family of the DSL against a numpy/scipy oracle, over formats and dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from support.data import DTYPES, prune_nm, random_sparse, random_values
from support.kernels import ran_native_linear

import sparse_mlir as sm

FORMATS_2D = ["csr", "csc", "coo", "dcsr", "ds:1,0", "bsr2x2", "2:4"]


def sparse_operand(rng, shape, fmt, dtype, density=0.3):
    dense = random_sparse(rng, shape, density, dtype)
    if fmt == "2:4":
        dense = prune_nm(dense, 2, 4)
    return sm.SparseTensor.from_dense(dense, fmt), dense


def as_dense(result):
    return result.to_dense() if isinstance(result, sm.SparseTensor) else result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS_2D)
def test_spmv_every_format(rng, fmt, dtype):
    A, dense = sparse_operand(rng, (12, 8), fmt, dtype)
    x = random_values(rng, 8, dtype)
    y = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": fmt}, dtype=dtype)(A=A, x=x)
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, dense @ x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS_2D)
def test_spmm_every_format(rng, fmt, dtype):
    A, dense = sparse_operand(rng, (12, 8), fmt, dtype)
    B = random_values(rng, (8, 5), dtype)
    C = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": fmt}, dtype=dtype)(A=A, B=B)
    np.testing.assert_array_equal(C, dense @ B)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_sddmm_sparse_output(rng, dtype):
    S, s = sparse_operand(rng, (10, 9), "csr", dtype)
    A, B = random_values(rng, (10, 4), dtype), random_values(rng, (4, 9), dtype)
    C = sm.compile("C[i,j] = S[i,j] * A[i,k] * B[k,j]", formats={"S": "csr", "C": "csr"}, dtype=dtype)(S=S, A=A, B=B)
    assert isinstance(C, sm.SparseTensor) and C.format == sm.CSR
    np.testing.assert_array_equal(C.to_dense(), s * (A @ B))


@pytest.mark.parametrize("dtype", DTYPES)
def test_spgemm(rng, dtype):
    A, a = sparse_operand(rng, (9, 7), "csr", dtype)
    B, b = sparse_operand(rng, (7, 6), "csr", dtype)
    C = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr", "B": "csr", "C": "csr"}, dtype=dtype)(A=A, B=B)
    np.testing.assert_array_equal(C.to_dense(), a @ b)
    ref = (sp.csr_matrix(a) @ sp.csr_matrix(b)).tocsr()
    ref.sort_indices()
    assert C.nnz >= ref.count_nonzero()


@pytest.mark.parametrize("op", ["+", "-", "*"])
@pytest.mark.parametrize("fmt", ["csr", "dcsr", "coo", "csc"])
def test_elementwise_sparse_output(rng, op, fmt):
    A, a = sparse_operand(rng, (8, 11), fmt, "float64")
    B, b = sparse_operand(rng, (8, 11), fmt, "float64")
    C = sm.compile(f"C[i,j] = A[i,j] {op} B[i,j]", formats={"A": fmt, "B": fmt, "C": fmt})(A=A, B=B)
    assert C.format.with_widths(32, 32) == sm.parse_format(fmt)
    np.testing.assert_array_equal(C.to_dense(), {"+": a + b, "-": a - b, "*": a * b}[op])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions(rng, dtype):
    A, a = sparse_operand(rng, (7, 9), "csr", dtype)
    np.testing.assert_array_equal(sm.compile("r[i] = A[i,j]", formats={"A": "csr"}, dtype=dtype)(A=A), a.sum(1))
    np.testing.assert_array_equal(sm.compile("c[j] = A[i,j]", formats={"A": "csr"}, dtype=dtype)(A=A), a.sum(0))
    total = sm.compile("s[] = A[i,j]", formats={"A": "csr"}, dtype=dtype)(A=A)
    assert total.shape == () and total.dtype == np.dtype(dtype)
    assert total == a.sum()


def test_transposed_access(rng):
    A, a = sparse_operand(rng, (6, 9), "csr", "float64")
    np.testing.assert_array_equal(sm.compile("C[i,j] = A[j,i]", formats={"A": "csr"})(A=A), a.T)
    x = random_values(rng, 6, "float64")
    np.testing.assert_array_equal(sm.compile("y[j] = A[i,j] * x[i]", formats={"A": "csr"})(A=A, x=x), a.T @ x)


@pytest.mark.parametrize("fmt", ["csf", "coo"])
@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_mttkrp(rng, fmt, dtype):
    b = random_sparse(rng, (5, 6, 7), 0.2, dtype)
    B = sm.SparseTensor.from_dense(b, fmt)
    C, D = random_values(rng, (6, 3), dtype), random_values(rng, (7, 3), dtype)
    A = sm.compile("A[i,j] = B[i,k,l] * C[k,j] * D[l,j]", formats={"B": fmt}, dtype=dtype)(B=B, C=C, D=D)
    np.testing.assert_array_equal(A, np.einsum("ikl,kj,lj->ij", b, C, D))


def test_fused_epilogue(rng):
    A, a = sparse_operand(rng, (10, 8), "csr", "float32")
    B, bias = random_values(rng, (8, 6), "float32"), random_values(rng, 6, "float32")
    k = sm.compile("C[i,j] = relu(A[i,k]*B[k,j] + bias[j])", formats={"A": sm.CSR}, dtype="float32")
    np.testing.assert_array_equal(k(A=A, B=B, bias=bias), np.maximum(a @ B + bias, 0))


@pytest.mark.parametrize("expr,ref", [
    ("C[i,j] = relu(A[i,j])", lambda a, b: np.maximum(a, 0)),
    ("C[i,j] = abs(A[i,j]) * 2", lambda a, b: np.abs(a) * 2),
    ("C[i,j] = sqrt(abs(A[i,j]))", lambda a, b: np.sqrt(np.abs(a))),
    ("C[i,j] = max(A[i,j], B[i,j])", lambda a, b: np.maximum(a, b)),
    ("C[i,j] = -A[i,j] + B[i,j] * 0.5", lambda a, b: -a + b * 0.5),
])
def test_functions_with_sparse_output(rng, expr, ref):
    A, a = sparse_operand(rng, (7, 8), "csr", "float64")
    B, b = sparse_operand(rng, (7, 8), "csr", "float64")
    used = {n: "csr" for n in "ABC" if f"{n}[" in expr}
    C = sm.compile(expr, formats=used)(**{n: t for n, t in (("A", A), ("B", B)) if n in used})
    np.testing.assert_allclose(C.to_dense(), ref(a, b), rtol=1e-12)


def test_non_zero_preserving_function_with_dense_output(rng):
    A, a = sparse_operand(rng, (5, 6), "csr", "float64")
    np.testing.assert_allclose(sm.compile("C[i,j] = exp(A[i,j])", formats={"A": "csr"})(A=A), np.exp(a), rtol=1e-12)
    x = random_values(rng, 6, "float64")
    y = sm.compile("y[i] = exp(A[i,j] * x[j])", formats={"A": "csr"})(A=A, x=x)
    np.testing.assert_allclose(y, np.exp(a @ x), rtol=1e-12)


def test_sparse_plus_dense_and_literal(rng):
    A, a = sparse_operand(rng, (5, 6), "csr", "int32")
    B = random_values(rng, (5, 6), "int32")
    C = sm.compile("C[i,j] = A[i,j] + B[i,j] + 3", formats={"A": "csr"}, dtype="int32")(A=A, B=B)
    np.testing.assert_array_equal(C, a + B + 3)


def test_sparse_vector_operand(rng):
    dense = random_sparse(rng, 20, 0.3, "float64")
    v = sm.SparseTensor.from_dense(dense, "sparse_vector")
    w = random_values(rng, 20, "float64")
    np.testing.assert_array_equal(sm.compile("s[] = v[i] * w[i]", formats={"v": "sparse_vector"})(v=v, w=w),
                                  dense @ w)


def test_real_suitesparse_matrix(rng):
    import gzip
    from importlib.resources import files

    import scipy.io

    with gzip.open(files("sparse_mlir.data") / "west0479.mtx.gz") as f:
        m = sp.csr_matrix(scipy.io.mmread(f))
    x = rng.standard_normal(m.shape[1])
    y = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})(A=m, x=x)
    np.testing.assert_allclose(y, m @ x, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("lhs", ["y[i]", "s[]", "C[i,j]"])
def test_body_that_folds_away(lhs):
    """Found by the fuzzer: integer x - x folds to the output, and the sparsifier crashed on it."""
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    got = sm.compile(f"{lhs} = A[i,j] - A[i,j]", formats={"A": "csr"}, dtype="int64")(
        A=sm.SparseTensor.from_dense(a, "csr"))
    assert not np.any(got)


def test_sparsifier_crash_falls_back_to_dense_copies():
    """Found by the fuzzer: the sparsifier segfaults co-iterating CSC A twice with a dense x; the compile
    retries with A copied to a dense temporary, and the answer is right."""
    from sparse_mlir.compiler.driver import stats

    a = np.array([[1.0, 0, 2], [0, 3, 0]])
    x = np.array([1.0, 2, 3])
    before = stats["densified"]
    k = sm.compile("z[j] = -(A[i,j] + (A[i,j] + x[j]))", formats={"A": "csc"})
    np.testing.assert_array_equal(k(A=sm.SparseTensor.from_dense(a, "csc"), x=x), -(2 * a.sum(0) + 2 * x))
    assert stats["densified"] == before + 1 or stats["compiled"] == 0  # 0: reused from the disk cache


def test_results_that_alias_inputs_are_copied():
    """Found by the fuzzer: the sparsifier returns input buffers as output buffers (C = A, a COO output's
    positions); freeing them with the result aborted the process.  Run where an abort cannot take pytest down."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import gc, numpy as np, sparse_mlir as sm
        a = np.array([[1.0, 0, 2], [0, 0, 3]])
        for fmt, expr in (("csr", "C[i,j] = A[i,j]"), ("coo", "C[i,j] = A[i,j] * 2"), ("dcsr", "C[i,j] = A[i,j]")):
            A = sm.SparseTensor.from_dense(a, fmt)
            for _ in range(3):
                C = sm.compile(expr, formats={"A": fmt, "C": fmt})(A=A)
                assert not any(np.shares_memory(c, b) for c in C.buffers for b in A.buffers)
                del C
                gc.collect()
            assert np.array_equal(A.to_dense(), a)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("fmt", ["csr", "2:4"])
@pytest.mark.parametrize("expr,axis", [("C[i,j] = A[i,k] * B[k,j] + bias[i]", 0),
                                       ("C[i,j] = bias[j] + A[i,k] * B[k,j]", 1)])
@pytest.mark.parametrize("n", [3, 40, 112])
def test_spmm_with_bias_runs_on_the_tiled_emitter(rng, fmt, expr, axis, n):
    A, a = sparse_operand(rng, (12, 16), fmt, "float32")
    B = random_values(rng, (16, n), "float32")
    bias = random_values(rng, 12 if axis == 0 else n, "float32")
    k = sm.compile(expr, formats={"A": fmt}, dtype="float32")
    np.testing.assert_array_equal(k(A=A, B=B, bias=bias), a @ B + (bias[:, None] if axis == 0 else bias))
    assert "vector.load" in k.ir["input"]


@pytest.mark.parametrize("expr", ["y[i] = A[i,j]*x[j]", "y[i] = A[j,i]*x[j]"])
def test_outer_reduction_loops_thread_over_private_partial_sums(rng, expr, monkeypatch):
    """A column-major SpMV scatters into y: its outer loop is a reduction that threads must not split over one y.

    Upstream's ``dense-outer-loop`` strategy parallelizes it anyway; with
    two threads the sums raced (errors of 8 on 4000x4000).  The format
    kernel (``dialects/native/format_spmv.py``) threads it with a private
    vector per extra thread, summed after: the same sums on every run with
    the same thread count.  The thread choice may run a cold call on one
    thread (under load: a clean-clone CI on a busy machine saw 76% of the
    entries differ by 1e-13), so the runs are compared to rounding, which
    still catches a race's errors.
    """
    monkeypatch.setenv("SPARSE_MLIR_NUM_THREADS", "2")
    fmt = "csc" if "A[i,j]" in expr else "csr"
    a = sp.random(3000, 3000, density=0.02, format=fmt, random_state=1)
    x = rng.standard_normal(3000)
    kernel = sm.compile(expr, formats={"A": fmt})
    ref = (a if "A[i,j]" in expr else a.T) @ x
    first = kernel(A=a, x=x)
    np.testing.assert_allclose(first, ref, rtol=1e-10, atol=1e-10)
    for _ in range(5):
        np.testing.assert_allclose(kernel(A=a, x=x), first, rtol=1e-12, atol=1e-12)
    assert "omp.wsloop" in kernel.ir["mapped"] and "memref<?x?xf64>" in kernel.ir["input"]


@pytest.mark.parametrize("expr,fmt,n", [("C[i,j] = A[i,k] * B[k,j]", "csr", 37),
                                        ("C[i,j] = A[i,k] * B[k,j]", "2:4", 37), ("y[i] = A[i,j] * x[j]", "csr", None)])
def test_hand_scheduled_kernels_overwrite_a_stale_out_buffer(rng, expr, fmt, n):
    """Their C entry point skips the zero-fill (they store every element), so nothing stale may survive."""
    A, a = sparse_operand(rng, (24, 16), fmt, "float32")
    a[5] = 0  # an empty row still gets its zeros stored
    A = sm.SparseTensor.from_dense(a, fmt)
    rhs = random_values(rng, (16, n) if n else 16, "float32")
    kernel = sm.compile(expr, formats={"A": fmt}, dtype="float32")
    out = np.full((24, n) if n else 24, np.nan, np.float32)
    got = kernel(A=A, out=out, **({"B": rhs} if n else {"x": rhs}))
    assert got is out
    np.testing.assert_allclose(out, a @ rhs, rtol=1e-5, atol=1e-5)
    assert "llvm.intr.memset" not in kernel.ir["llvm"]


def _entry_point(llvm_text: str) -> str:
    """The C entry point's function in a kernel's LLVM-dialect stage (``kernel.ir["llvm"]``)."""
    return llvm_text[llvm_text.index("llvm.func @sparse_mlir_kernel"):]


def test_nm_positions_are_built_only_for_kernels_that_read_them(rng):
    """The hand-scheduled N:M SpMM computes where each row's entries start, so its C entry point passes the
    implicit positions empty (they were a malloc and a fill of a position per group on every call); a
    sparsified N:M kernel reads them, and gets them built."""
    a = prune_nm(rng.standard_normal((64, 64)).astype(np.float32), 2, 4)
    A = sm.SparseTensor.from_dense(a, "2:4")
    spmm = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "2:4"}, dtype="float32")
    B = random_values(rng, (64, 8), "float32")
    np.testing.assert_allclose(spmm(A=A, B=B), a @ B, rtol=1e-5, atol=1e-5)
    assert "@malloc(" not in _entry_point(spmm.ir["llvm"])
    sparsified = sm.compile("C[i,j] = A[i,j] * 2", formats={"A": "2:4"}, dtype="float32")
    np.testing.assert_allclose(sparsified(A=A), 2 * a)
    assert "sparse_tensor" in sparsified.ir["input"] and "@malloc(" in _entry_point(sparsified.ir["llvm"])


@pytest.mark.parametrize("nm", [(2, 4), (1, 4), (3, 8)])
@pytest.mark.parametrize("n", [3, 37, 128])
@pytest.mark.parametrize("axis", [0, 1])
def test_nm_spmm_walks_rows_in_panels_of_b(rng, nm, n, axis):
    """Wide N:M rows span many panels of B and row blocks: partial sums go through C, an empty row stays zero."""
    from sparse_mlir.dialects.native.spmm import ROW_BLOCK
    from sparse_mlir.lowering.toolchain import cpu_target

    panel_groups = cpu_target("native").panel_bytes // (n * 4 * nm[1])  # groups of B's rows in one panel here
    rows, cols = 3 * ROW_BLOCK + 5, nm[1] * max(256, 2 * panel_groups + 3)  # more than two panels, the last partial
    a = prune_nm(rng.standard_normal((rows, cols)).astype(np.float32), *nm)
    a[ROW_BLOCK + 2] = 0
    B = random_values(rng, (cols, n), "float32")
    bias = random_values(rng, rows if axis == 0 else n, "float32")
    fmt = f"{nm[0]}:{nm[1]}"
    A = sm.SparseTensor.from_dense(a, fmt)
    expr = f"C[i,j] = A[i,k] * B[k,j] + bias[{'ij'[axis]}]"
    got = sm.compile(expr, formats={"A": fmt}, dtype="float32")(A=A, B=B, bias=bias)
    ref = a.astype(np.float64) @ B + (bias[:, None] if axis == 0 else bias)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("fmt", ["csr", "2:4"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("n", [1, 2, 7, 8, 15, 17, 18, 31])
@pytest.mark.parametrize("bias", [None, "i", "j"])
def test_spmm_last_columns_take_one_masked_vector(rng, fmt, dtype, n, bias):
    """Fewer columns left than a vector's lanes run as one masked vector (one walk of the row, not one per
    column); a single last column stays scalar.  Column biases load masked; N:M rows span more than two panels of
    B, so later panels continue from C's last columns, read masked."""
    from sparse_mlir.lowering.toolchain import cpu_target

    panel_groups = cpu_target("native").panel_bytes // (n * np.dtype(dtype).itemsize * 4)
    rows, cols = 29, 4 * (2 * panel_groups + 3)
    a = prune_nm(random_values(rng, (rows, cols), dtype), 2, 4) if fmt == "2:4" else \
        random_sparse(rng, (rows, cols), 0.2, dtype)
    b = random_values(rng, (cols, n), dtype)
    expr = "C[i,j] = A[i,k] * B[k,j]" + ("" if bias is None else f" + bias[{bias}]")
    operands = {"A": sm.SparseTensor.from_dense(a, fmt), "B": b}
    want = a @ b
    if bias is not None:
        operands["bias"] = random_values(rng, rows if bias == "i" else n, dtype)
        want = want + (operands["bias"][:, None] if bias == "i" else operands["bias"])
    out = np.full((rows, n), -7, dtype)
    sm.compile(expr, formats={"A": fmt}, dtype=dtype)(out=out, **operands)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("n", [8, 16, 32, 40, 130])
def test_csr_spmm_rows_of_every_length_around_the_unrolled_steps(rng, dtype, n):
    """Tiles narrower than the accumulators take ``CSR_UNROLL`` nonzeros a step into as many accumulator sets,
    then the row's rest one by one: every row length from 0 to 3 steps and a remainder, in order and shuffled,
    sums exactly (small integers), in every column tier (8, 2 and 1 vectors, the masked last columns)."""
    from sparse_mlir.dialects.native.spmm import CSR_UNROLL

    lengths = list(range(3 * CSR_UNROLL + 2)) * 2
    cols = 64
    for order in (lengths, list(rng.permutation(lengths))):
        a = np.zeros((len(order), cols), dtype)
        for r, length in enumerate(order):
            a[r, rng.choice(cols, length, replace=False)] = rng.integers(1, 5, size=length) * rng.choice([-1, 1],
                                                                                                       size=length)
        b = rng.integers(-4, 5, size=(cols, n)).astype(dtype)
        kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}, dtype=dtype)
        got = kernel(A=sm.SparseTensor.from_dense(a, "csr"), B=b)
        np.testing.assert_array_equal(got, a @ b)


@pytest.mark.parametrize("blocks", [(2, 2), (4, 4), (2, 8), (8, 2), (16, 1), (20, 1)])
@pytest.mark.parametrize("n", [1, 3, 17, 37, 130])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_bsr_spmm_uses_dense_register_blocks(rng, blocks, n, axis):
    """Block rows with several blocks, an empty block row, column tiles of every tier, a masked vector for the
    last columns (3, 37 and 130 columns leave 2 to 5 at either width) and a scalar last column (1 and 17).

    16x1 and 20x1 are taller than AVX2's accumulator budget (20x1 than AVX-512's too): walked in row chunks.
    """
    bm, bn = blocks
    rows, cols = 6 * bm, 5 * bn
    mask = rng.random((6, 5)) < 0.5
    mask[2] = False
    a = (np.kron(mask, np.ones(blocks)) * rng.standard_normal((rows, cols))).astype(np.float32)
    B = random_values(rng, (cols, n), "float32")
    fmt = f"bsr{bm}x{bn}"
    expr = "C[i,j] = A[i,k] * B[k,j]" + ("" if axis is None else f" + bias[{'ij'[axis]}]")
    operands = {"A": sm.SparseTensor.from_dense(a, fmt), "B": B}
    ref = a.astype(np.float64) @ B
    if axis is not None:
        operands["bias"] = random_values(rng, rows if axis == 0 else n, "float32")
        ref = ref + (operands["bias"][:, None] if axis == 0 else operands["bias"])
    kernel = sm.compile(expr, formats={"A": fmt}, dtype="float32")
    out = np.full((rows, n), np.nan, np.float32)
    kernel(out=out, **operands)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # every block height gets the register-blocked kernel (taller than the budget: in row chunks)
    assert "vector.fma" in kernel.ir["input"] and "sparse_mlir.fills_output" in kernel.ir["input"]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("shape", [(37, 52, 70), (1, 16, 16), (64, 96, 33)])
@pytest.mark.parametrize("bias", [None, "o", "b"])
@pytest.mark.parametrize("fmt", ["csr", "2:4"])
def test_linear_orientation_runs_its_native_kernel(rng, dtype, shape, bias, fmt):
    """``Y[b,o] = X[b,i] * W[o,i]`` (torch.nn.Linear with a sparse weight): edge tiles of every transpose (or, N:M
    on AVX-512, of the lane kernel's chunks and windows), biases."""
    batch, inputs, outputs = shape
    w = random_sparse(rng, (outputs, inputs), 0.2, dtype)
    if fmt == "2:4":
        w = prune_nm(random_values(rng, (outputs, inputs), dtype), 2, 4)
    x = random_values(rng, (batch, inputs), dtype)
    expr = "Y[b,o] = X[b,i] * W[o,i]" + ("" if bias is None else f" + bias[{bias}]")
    operands = {"X": x, "W": sm.SparseTensor.from_dense(w, fmt)}
    ref = x @ w.T
    if bias is not None:
        operands["bias"] = random_values(rng, outputs if bias == "o" else batch, dtype)
        ref = ref + (operands["bias"] if bias == "o" else operands["bias"][:, None])
    kernel = sm.compile(expr, formats={"W": fmt}, dtype=dtype)
    out = np.full((batch, outputs), np.nan if dtype != "int32" else -7, dtype)
    kernel(out=out, **operands)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * max(1, np.abs(ref).max()))
    assert ran_native_linear(kernel.ir["input"], fmt)


def test_spmv_rows_short_and_long_take_both_loops(rng):
    """Rows of 0 to 40 nonzeros: under ``SHORT_ROW`` the plain loop, above it the unrolled one with its tail."""
    from sparse_mlir.dialects.native.spmv import SHORT_ROW

    lengths = np.arange(41) % (5 * SHORT_ROW + 1)
    a = np.zeros((41, 64))
    for row, n in enumerate(lengths):
        a[row, rng.choice(64, n, replace=False)] = rng.standard_normal(n)
    x = rng.standard_normal(64)
    y = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})(A=sp.csr_matrix(a), x=x)
    np.testing.assert_allclose(y, a @ x, rtol=1e-12, atol=1e-12)
