"""Shape-generic GPU kernels: one build (PTX + launches) per index widths takes every size at run time.

The hand-scheduled CSR SpMV (its lanes-per-row kernel and the row-splitting
one for skewed rows) and CSR SpMM (a kernel per tiling, the launch whose
``SizeTest``s the sizes pass runs) read their sizes from the buffers'
descriptors and have their grids sized at launch from the operands
(``LaneRule.rows_of``, ``GridRule``), so ``CudaKernel``, exports, the C
launcher and the CPU emulation of the program take any size from one build.  Numbers come from
the emulation (the very ``gpu.func`` bodies and launch records, run thread
by thread); the runtime and the launcher run against the CuPy and cuda.h
stand-ins, which record launches and compute nothing.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import scipy.sparse as sp
from support.gpu_emulation import GenericEmulation
from test_gpu import _entry_params, _ptxas, check_launches, launcher_run

import sparse_mlir as sm
from sparse_mlir.abi.gpu_program import GpuProgram, GridRule, KernelArg, LaneRule, Launch, ParamPacker, SizeTest
from sparse_mlir.compiler import driver
from sparse_mlir.compiler.emitters import SHAPE_GENERIC_CUDA, shape_generic_cuda_emitter
from sparse_mlir.errors import LoweringError, ShapeError

SPMV = "y[i] = A[i,j]*x[j]"
SPMM = "C[i,j] = A[i,k]*B[k,j]"
SIZES = [(40, 30), (7, 100), (300, 5), (1, 1)]


def spmm_sizes(vector: int) -> list[tuple[int, int, int]]:
    """(rows, inner, cols) picking every tiling of the SpMM with ``vector``-element vectors: few rows or not,
    vectors or single elements, 1 to 4 of them per lane (each at the bottom of its column range)."""
    many = [(2049, 3, 32 * w * (t - 1) + w) for w in (vector, 1) for t in (1, 2, 3, 4)]
    return [(5, 7, 4 * vector), (30, 20, 33), (3, 4, 1), (2048, 2, 32 * vector), *many]


def _kernel(expr: str = SPMV, fmt: str = "csr", dtype: str = "float32", **options):
    return sm.compile(expr, formats={"A": fmt}, dtype=dtype, target="cuda", **options)


# which kernels are generic: one decision, without MLIR, that agrees with the emitter table -------------------------
GENERIC = [(SPMV, "csr", "float32", {}), (SPMV, "csr", "float64", {}), (SPMV, "csr", "float16", {}),
           (SPMV, "csr", "float16", {"out_dtype": "float32"}), (SPMV, "csr", "float16", {"deterministic": True}),
           (SPMM, "csr", "float32", {}), (SPMM, "csr", "float16", {"out_dtype": "float32"}),
           (SPMM + " + b[i]", "csr", "float64", {}), (SPMM + " + b[j]", "csr", "float32", {"deterministic": True}),
           (SPMV, "coo", "float32", {}), (SPMV, "dcsr", "int64", {"deterministic": True}), (SPMM, "csc", "float64", {}),
           ("y[j] = A[i,j]*x[i]", "csr", "int32", {"deterministic": True}), ("y[i] = A[i,j]", "csc", "float32", {}),
           ("s[] = A[i,j]*x[j]", "coo", "float64", {"deterministic": True}), ("s[] = A[i,j]", "dcsr", "int32", {}),
           ("Z[i,j] = A[i,j,k]*D[k,j]", "csf", "float32", {}), ("Y[b,o] = X[b,i]*A[o,i]", "csr", "float32", {}),
           ("Y[b,o] = X[b,i]*A[o,i] + b[b]", "csr", "float16", {"out_dtype": "float32"})]
PER_SHAPE = [(SPMV, "csr", "float32", {"deterministic": True}),  # the merge path: carries sized by the rows
             (SPMV, "csr", "float32", {"emitter": "sparsifier"}), (SPMV, "bsr2x2", "float32", {}),
             (SPMV, "coo", "float32", {"deterministic": True}),  # segments: carries sized by the rows
             (SPMM, "csc", "float32", {"deterministic": True}),  # float scatter: sparsified
             (SPMM, "2:4", "float16", {}), (SPMV, "csr", "int32", {}),
             ("C[i,j] = relu(A[i,k]*B[k,j] + b[i])", "csr", "float32", {}),  # sparsified
             ("Y[b,o] = X[b,i]*A[o,i]", "2:4", "float16", {})]  # Linear on Sparse Tensor Cores


@pytest.mark.parametrize(("expr", "fmt", "dtype", "options"), GENERIC + PER_SHAPE,
                         ids=[f"{e}|{f}|{d}|{o}" for e, f, d, o in GENERIC + PER_SHAPE])
def test_the_csr_spmv_is_shape_generic_and_the_table_agrees_with_the_emitters(expr, fmt, dtype, options):
    from mlir import ir
    from sparse_mlir.dialects import select

    emitter = options.pop("emitter", "auto")
    kernel = _kernel(expr, fmt, dtype, **options)
    if emitter != "auto":
        from sparse_mlir.runtime.cuda import CudaKernel

        kernel = CudaKernel(kernel.spec, emitter=emitter, deterministic=options.get("deterministic", False))
    generic = (expr, fmt, dtype, options) in GENERIC and emitter == "auto"
    assert kernel.shape_generic is generic
    deterministic = options.get("deterministic", False)
    named = shape_generic_cuda_emitter(kernel.spec, kernel.spec.formats, deterministic)
    assert (named is not None) is (generic or emitter != "auto")
    if named is not None:  # the emitter table, tried with every size left to run time, picks the named emitter
        with ir.Context():
            choice = select.cuda_choice(kernel.spec, driver.generic_shapes(kernel.spec), deterministic)
        assert choice is not None and choice.emitter == named
    assert {name for name, _ in SHAPE_GENERIC_CUDA} <= {e.name for e in select.CUDA_EMITTERS}


def test_a_generic_build_of_a_per_shape_kernel_is_refused_not_sparsified_with_unknown_sizes():
    from mlir import ir
    from sparse_mlir.abi.c_signature import Signature
    from sparse_mlir.compiler import build

    spec = _kernel("C[i,j] = A[i,k]*B[k,j]", "bsr2x2").spec
    shapes = driver.generic_shapes(spec)
    with ir.Context(), pytest.raises(LoweringError, match="no shape-generic GPU kernel"):
        build.gpu_program(spec, shapes, Signature.from_spec(spec, spec.formats, shapes, "k"), (), "auto", False)


# numbers: the emulated program, one build, several sizes ----------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_one_emulated_build_computes_every_size(dtype, tmp_path, rng):
    """The row-splitting kernel (the one the emulation can run: no shuffles) at four sizes, two index widths."""
    spec = _kernel(dtype=dtype).spec
    emulation = GenericEmulation(spec, tmp_path, skewed=True)
    for rows, cols in SIZES:
        a = sp.random(rows, cols, density=0.3, format="lil", dtype=dtype, random_state=rows)
        a[rows // 2, :] = rng.standard_normal(cols)  # one long row among short ones
        a = sp.csr_array(a)
        x = rng.standard_normal(cols).astype(dtype)
        for widths in ((32, 32), (64, 64)):
            tensor = sm.SparseTensor.from_scipy(a, sm.CSR.with_widths(*widths))
            y, program = emulation({"A": tensor, "x": x})
            np.testing.assert_allclose(y, a @ x, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-5)
    assert emulation.builds == 2  # one per index widths, whatever the size
    assert [launch.kernel for launch in program.launches] == ["spmv", "spmv_split"]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_one_emulated_spmm_build_runs_the_right_tiling_at_every_size(dtype, tmp_path, rng):
    """Every variant of the SpMM (vector width, vectors per lane, few rows) against scipy, from one build; the
    output starts as NaN, so a size no variant takes (or a variant that misses columns) fails."""
    bias_by = {"float32": None, "float64": "i", "float16": "j"}[dtype]
    expression = SPMM + (f" + b[{bias_by}]" if bias_by else "")
    spec = _kernel(expression, dtype=dtype, **({"out_dtype": "float32"} if dtype == "float16" else {})).spec
    emulation = GenericEmulation(spec, tmp_path)
    kernels = set()
    vector = 16 // np.dtype(dtype).itemsize
    for rows, inner, cols in spmm_sizes(vector):
        dense = sp.random(rows, inner, density=0.3, random_state=rows).toarray().astype(dtype)
        b = rng.standard_normal((inner, cols)).astype(dtype)
        a = sm.SparseTensor.from_dense(dense, "csr")
        args = {"A": a, "B": b}
        want = dense.astype(np.float64) @ b.astype(np.float64)
        if bias_by:
            args["b"] = rng.standard_normal(rows if bias_by == "i" else cols).astype(dtype)
            want = want + (args["b"][:, None] if bias_by == "i" else args["b"][None, :])
        got, program = emulation(args)
        np.testing.assert_allclose(got, want, rtol=1e-3 if dtype == "float16" else 1e-5, atol=1e-3)
        shapes = [(n,) for n in (rows + 1, a.nnz, a.nnz)] + [(inner, cols)] + \
            ([(len(args["b"]),)] if bias_by else []) + [(rows, cols)]
        (picked,) = [launch for launch in program.launches if launch.fits(shapes)]  # exactly one variant runs
        kernels.add(picked.kernel)
    assert emulation.builds == 1
    assert kernels == {f"spmm_w{w}_t{t}" for w in (1, vector) for t in (1, 2, 3, 4)}


@pytest.mark.parametrize("bias", ["", " + b[o]", " + b[b]"])
def test_one_emulated_linear_build_sizes_its_scratch_and_tiling_from_each_call(bias, tmp_path, rng):
    """The CSR Linear layer: X^T and T (scratch) sized from X and Y at the call, the SpMM's variant and grids
    from Y's sizes (T = Y^T), at sizes picking few and many rows, vectors and single elements."""
    spec = _kernel("Y[b,o] = X[b,i]*A[o,i]" + bias, dtype="float32").spec
    emulation = GenericEmulation(spec, tmp_path)
    for outputs, inputs, batch in ((40, 64, 16), (2100, 5, 130), (3, 7, 1), (2049, 3, 96)):
        w = (rng.standard_normal((outputs, inputs)) * (rng.random((outputs, inputs)) < 0.3)).astype(np.float32)
        x = rng.standard_normal((batch, inputs)).astype(np.float32)
        args = {"A": sm.SparseTensor.from_dense(w, "csr"), "X": x}
        want = x.astype(np.float64) @ w.astype(np.float64).T
        if bias:
            args["b"] = rng.standard_normal(outputs if bias == " + b[o]" else batch).astype(np.float32)
            want = want + (args["b"][None, :] if bias == " + b[o]" else args["b"][:, None])
        np.testing.assert_allclose(emulation(args)[0], want, rtol=1e-5, atol=1e-5)
    assert emulation.builds == 1


FORMATS = [(SPMV, "coo"), (SPMV, "csc"), (SPMV, "dcsr"), (SPMM, "coo"), (SPMM, "csc"), (SPMM, "dcsr"),
           ("y[j] = A[i,j]*x[i]", "csr"), ("y[j] = A[i,j]*x[i]", "csc"), ("C[j,n] = A[i,j]*B[i,n]", "csc"),
           ("y[i] = A[i,j]", "coo"), ("y[j] = A[i,j]", "csc"), ("s[] = A[i,j]*x[j]", "csr"), ("s[] = A[i,j]", "coo")]


@pytest.mark.parametrize(("expression", "fmt"), FORMATS, ids=[f"{e}|{f}" for e, f in FORMATS])
def test_one_emulated_build_of_each_format_kernel_computes_every_size(expression, fmt, tmp_path, rng):
    """COO, CSC and DCSR products and sums (threads or warps per outer entry, chunks of entries) and total
    reductions: their sizes come from the descriptors and the positions' length, so one build serves all."""
    spec = _kernel(expression, fmt, "float64").spec
    emulation = GenericEmulation(spec, tmp_path)
    operands = [n for n in spec.inputs if n != "A"]
    for rows, cols, n in ((30, 20, 5), (7, 100, 40), (200, 3, 1)):
        dense = sp.random(rows, cols, density=0.3, random_state=rows).toarray()
        args, sizes = {"A": sm.SparseTensor.from_dense(dense, fmt)}, dict(zip(spec.operand_index("A"), (rows, cols)))
        for name in operands:
            index = spec.operand_index(name)
            sizes.setdefault(index[-1], n)
            args[name] = rng.standard_normal(tuple(sizes[i] for i in index))
        subscripts = ",".join("".join(spec.operand_index(name)) for name in ("A", *operands))
        want = np.einsum(f"{subscripts}->{''.join(spec.output_indices)}", dense, *(args[n] for n in operands))
        np.testing.assert_allclose(emulation(args)[0], want, rtol=1e-12, atol=1e-12)
    assert emulation.builds == 1


def test_exactly_one_spmm_variant_fits_each_size_and_it_is_the_per_shape_tiling():
    from sparse_mlir.dialects.native.gpu_spmm import _variants, spmm_tiling

    for element_bytes in (2, 4, 8):
        variants = _variants(element_bytes)
        for rows in (0, 1, 2047, 2048, 5000):
            for cols in range(0, 800):
                sizes = (rows, cols)
                fitting = [(w, p) for w, p, tests in variants
                           if all(SizeTest(0, 0, kind, value).holds(sizes[d]) for d, kind, value in tests)]
                assert fitting == [spmm_tiling(element_bytes, rows, cols)], (element_bytes, rows, cols)


ASSEMBLED = [(SPMV, "csr"), (SPMM, "csr"), (SPMM + " + b[j]", "csr"), (SPMV, "coo"), (SPMM, "csc"),
             ("y[i] = A[i,j]", "dcsr"), ("s[] = A[i,j]*x[j]", "csr"), ("Z[i,j] = A[i,j,k]*D[k,j]", "csf"),
             ("Y[b,o] = X[b,i]*A[o,i] + b[o]", "csr")]


@pytest.mark.parametrize(("expression", "fmt"), ASSEMBLED, ids=[f"{e}|{f}" for e, f in ASSEMBLED])
def test_the_generic_ptx_assembles_for_sm80_and_sm90a(expression, fmt, tmp_path):
    tool = _ptxas()
    kernel = _kernel(expression, fmt).specialize({})
    program = kernel.program
    assert all(s is None for op in kernel.signature.operands for s in op.shape)  # nothing compiled in
    for chip, arch in (("sm_80", "sm_80"), ("sm_90", "sm_90a")):
        src = tmp_path / f"{chip}.ptx"
        src.write_text(program.ptx[chip])
        done = subprocess.run([tool, f"-arch={arch}", str(src), "-o", str(tmp_path / f"{arch}.cubin")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        params = _entry_params(program.ptx[chip])
        assert all(params[launch.kernel] == launch.param_count() for launch in program.launches)


# the runtime: one build serves every size, grids and descriptors from each call ------------------------------------
def test_cuda_kernel_builds_once_and_sizes_each_launch_from_the_call(monkeypatch):
    import support.fake_cupy as fake_cupy

    record = fake_cupy.install(monkeypatch)
    kernel = _kernel()
    assert kernel.shape_generic
    for rows, cols, lanes in ((1000, 300, 8), (50, 70, 2), (3000, 10, 1)):
        a = sp.random(rows, cols, density=0.03 if cols > 100 else 0.05, format="csr", dtype=np.float32,
                      random_state=0)
        tensor = sm.SparseTensor.from_scipy(a).to("cuda")
        y = kernel(A=tensor, x=fake_cupy.device(np.ones(cols, np.float32)))
        assert y.shape == (rows,)
        name, grid, _, words, _ = record.launches[-1]
        assert name == "spmv" and words[-1] == LaneRule(1, rows).lanes(a.nnz)
        assert grid == (max(1, -(-rows * words[-1] // 128)), 1, 1)
        assert words[15:20] == [words[15], words[15], 0, cols, 1] and words[20:25] == [y.data.ptr, y.data.ptr, 0,
                                                                                         rows, 1]
    assert kernel.stats["specializations"] == 1  # three sizes, one build
    assert len(record.modules) == 1  # and one module load
    tensor = sm.SparseTensor.from_scipy(sp.random(20, 10, density=0.3, format="csr", dtype=np.float32)).to("cuda")
    with pytest.raises(ShapeError, match="index 'j'"):
        kernel(A=tensor, x=fake_cupy.device(np.ones(11, np.float32)))
    with pytest.raises(ShapeError, match="out= has shape"):
        kernel(A=tensor, x=fake_cupy.device(np.ones(10, np.float32)), out=fake_cupy.device(np.zeros(21, np.float32)))


def test_the_spmm_runs_the_variant_its_sizes_pick_and_checks_alignment_only_for_vectors(monkeypatch):
    import support.fake_cupy as fake_cupy

    record = fake_cupy.install(monkeypatch)
    kernel = _kernel(SPMM + " + b[j]")
    assert kernel.shape_generic
    for rows, inner, cols, picked, grid in ((50, 40, 64, "spmm_w4_t1", (13, 1, 1)),
                                            (3000, 40, 301, "spmm_w1_t4", (750, 3, 1)),
                                            (2048, 40, 200, "spmm_w4_t2", (512, 1, 1))):
        a = sp.random(rows, inner, density=0.2, format="csr", dtype=np.float32, random_state=0)
        b, bias = fake_cupy.device(np.ones((inner, cols), np.float32)), fake_cupy.device(np.ones(cols, np.float32))
        c = kernel(A=sm.SparseTensor.from_scipy(a).to("cuda"), B=b, b=bias)
        name, got_grid, _, words, _ = record.launches[-1]
        assert (name, got_grid, c.shape) == (picked, grid, (rows, cols))
        assert words[15:22] == [b.data.ptr, b.data.ptr, 0, inner, cols, cols, 1]  # B's descriptor from the call
    assert kernel.stats["specializations"] == 1 and len(record.launches) == 3  # one build, one launch per call
    a = sm.SparseTensor.from_scipy(sp.random(50, 40, density=0.2, format="csr", dtype=np.float32)).to("cuda")
    for cols, refused in ((64, True), (63, False)):  # single elements need no 16-byte alignment
        offset = np.ones(40 * cols + 1, np.float32)[1:].reshape(40, cols).view(fake_cupy.FakeArray)
        bias = fake_cupy.device(np.ones(cols, np.float32))
        if refused:
            with pytest.raises(sm.errors.OperandError, match="16-byte boundary"):
                kernel(A=a, B=offset, b=bias)
        else:
            assert kernel(A=a, B=offset, b=bias).shape == (50, cols)


def test_specialize_needs_no_shapes_and_fixed_builds_per_shape():
    kernel = _kernel()
    kernel.specialize({})
    assert all(s is None for op in kernel.signature.operands for s in op.shape)
    kernel.specialize({"A": (30, 20), "x": (20,)}, fixed=True)
    assert kernel.signature.operands[0].shape == (30, 20)
    assert kernel.program.launches[0].lanes == LaneRule(1, 30)  # rows compiled in


# exports: sizes at run time, inconsistent buffers refused ---------------------------------------------------------
def test_an_export_without_shapes_loads_and_runs_at_every_size(monkeypatch, tmp_path):
    import support.fake_cupy as fake_cupy

    record = fake_cupy.install(monkeypatch)
    paths = sm.export(_kernel(), tmp_path, "spmv")
    manifest = json.loads(paths["manifest"].read_text())
    assert [op["shape"] for op in manifest["signature"]["operands"]] == [[None, None], [None], [None]]
    loaded = sm.load_kernel(paths["manifest"])
    assert loaded.shape_generic
    for rows, cols in ((1000, 300), (17, 4)):
        a = sp.random(rows, cols, density=0.1, format="csr", dtype=np.float32, random_state=1)
        y = loaded(A=sm.SparseTensor.from_scipy(a).to("cuda"), x=fake_cupy.device(np.ones(cols, np.float32)))
        assert y.shape == (rows,) and record.launches[-1][3][23] == rows  # y's descriptor size
    with pytest.raises(ShapeError, match="index 'j'"):
        loaded(A=sm.SparseTensor.from_scipy(a).to("cuda"), x=fake_cupy.device(np.ones(cols + 1, np.float32)))
    fixed = sm.load_kernel(sm.export(_kernel(), tmp_path / "fixed", "spmv", shapes={"A": (17, 4), "x": (4,)})["manifest"])
    assert not fixed.shape_generic
    with pytest.raises(ShapeError, match="exported for A of shape"):
        fixed(A=sm.SparseTensor.from_scipy(sp.random(18, 4, density=0.5, format="csr", dtype=np.float32)).to("cuda"),
              x=fake_cupy.device(np.ones(4, np.float32)))


@pytest.mark.parametrize("skewed", [False, True])
def test_one_exported_launcher_takes_two_sizes_and_refuses_inconsistent_buffers(skewed, tmp_path):
    sm.export(_kernel(), tmp_path, "k")
    header = (tmp_path / "k.h").read_text()
    assert "int64_t A_d0, int64_t A_d1" in header and "int64_t x_d0" in header and "int64_t y_d0" in header
    for n, (rows, cols) in enumerate(((100, 50), (3, 7000))):
        status, out, found = launcher_run(tmp_path, "k", {"A": (rows, cols), "x": (cols,), "y": (rows,)},
                                          nnz=rows * 2, main=f"size{n}", skewed=skewed)
        assert status == 0, out
        check_launches(out, found)
        # y zeroed, at this call's size (the program's row splitting accumulates into it)
        assert f"memset {found['given'][('y', '')][0]} 0 {rows * 4}\n" in out
    shapes = {"A": (100, 50), "x": (50,), "y": (100,)}
    for bad, case in ((dict(shapes, x=(51,)), "x disagrees with A"), (dict(shapes, y=(99,)), "y disagrees"),
                      ({"A": (-1, 50), "x": (50,), "y": (-1,)}, "negative")):
        status, out, _ = launcher_run(tmp_path, "k", bad, main="bad", skewed=skewed)
        assert status == 1 and "launch" not in out and "memset" not in out, case  # CUDA_ERROR_INVALID_VALUE
    status, out, _ = launcher_run(tmp_path, "k", shapes, main="bad", values_off=1, skewed=skewed)
    assert status == 1 and "launch" not in out  # crd and values of different lengths


def test_one_exported_spmm_launcher_picks_each_sizes_variant_in_c(tmp_path):
    sm.export(_kernel(SPMM + " + b[i]"), tmp_path, "k")
    for n, (rows, inner, cols) in enumerate(((40, 64, 16), (3000, 9, 301), (2048, 5, 200))):
        status, out, found = launcher_run(tmp_path, "k", {"A": (rows, inner), "B": (inner, cols), "b": (rows,),
                                                          "C": (rows, cols)}, main=f"size{n}")
        assert status == 0, out
        assert len(found["launches"]) == 1  # exactly one variant
        check_launches(out, found)
    status, out, _ = launcher_run(tmp_path, "k", {"A": (40, 64), "B": (64, 16), "b": (41,), "C": (40, 16)},
                                  main="bad")
    assert status == 1 and "launch" not in out


def test_the_generic_linear_layer_sizes_its_scratch_per_call_in_python_and_in_c(monkeypatch, tmp_path):
    import support.fake_cupy as fake_cupy

    record = fake_cupy.install(monkeypatch)
    kernel = _kernel("Y[b,o] = X[b,i]*A[o,i] + b[o]")
    for outputs, inputs, batch in ((40, 64, 16), (7, 3, 130)):
        w = sp.random(outputs, inputs, density=0.3, format="csr", dtype=np.float32, random_state=0)
        y = kernel(A=sm.SparseTensor.from_scipy(w).to("cuda"), X=fake_cupy.device(np.ones((batch, inputs), np.float32)),
                   b=fake_cupy.device(np.ones(outputs, np.float32)))
        assert y.shape == (batch, outputs)
        transpose_in, product, transpose_out = record.launches[-3:]
        assert transpose_in[0] == "transpose_in" and transpose_out[0] == "transpose_out"
        pointer = transpose_in[3][-7]
        assert transpose_in[3][-7:] == [pointer, pointer, 0, inputs, batch, batch, 1]  # X^T, sized at this call
    assert kernel.stats["specializations"] == 1
    sm.export(_kernel("Y[b,o] = X[b,i]*A[o,i] + b[o]"), tmp_path, "k")
    for n, (outputs, inputs, batch) in enumerate(((40, 64, 16), (2100, 5, 130))):
        status, out, found = launcher_run(tmp_path, "k", {"A": (outputs, inputs), "X": (batch, inputs),
                                                          "b": (outputs,), "Y": (batch, outputs)}, main=f"size{n}")
        assert status == 0, out
        check_launches(out, found)
        assert f"alloc {0xA000} {inputs * batch * 4}" in out  # X^T's bytes at this call's sizes


# the launch data: rules over a dimension, per axis, through JSON ---------------------------------------------------
def test_grid_rules_over_dimensions_are_data_that_round_trips():
    args = (KernelArg("buffer", 0, (None,)), KernelArg("buffer", 1, (None, None)))
    launch = Launch("k", (GridRule(1, 4, dim=0), GridRule(1, 32, dim=1), 1), (128, 1, 1), args,
                    lanes=None)
    lanes = Launch("s", (1, 1, 1), (128, 1, 1), (*args[:1], KernelArg("lanes", 0)), lanes=LaneRule(0, None, 1))
    program = GpuProgram("kernels", {}, (launch, lanes))
    assert GpuProgram.from_json(json.loads(program.dumps()), ptx={}) == program
    lengths, shapes = [1600, 10 * 70], [(1600,), (10, 70)]
    assert launch.grid_for(lengths, shapes) == (3, 3, 1)  # ceil(10 / 4), ceil(70 / 32)
    # 700 rows (rows_of: argument 1's length), 1600 entries: 2 lanes per row, 1400 threads
    assert lanes.grid_for(lengths) == (11, 1, 1)
    words = ParamPacker(launch)([(0xA0, 1600), (0xB0, 700)], [], shapes=shapes)
    assert words == [0xA0, 0xA0, 0, 1600, 1, 0xB0, 0xB0, 0, 10, 70, 70, 1]
    c_words = ParamPacker(launch)([("p", "n"), ("q", "m")], [], shapes=[("n",), ("B_d0", "B_d1")])
    assert c_words[-4:] == ["B_d0", "B_d1", "B_d1", 1]


def test_malformed_rules_are_refused_when_the_manifest_is_read():
    with pytest.raises(ValueError, match="size test"):
        SizeTest(0, 1, "sometimes", 4)
    with pytest.raises(ValueError, match="per_block"):
        GridRule(0, 0)
