"""IR of the GPU kernels for COO, CSC and DCSR products and total reductions (``dialects/native/gpu_formats.py``,
``gpu_reduce.py``): they verify, hold the key ops (binary searches, atomics only where allowed) and their
launches name their kernels; other specs are turned down."""

from __future__ import annotations

import pytest
from ir_helpers import functions, op_counts, planned, static_shapes, verified
from sparse_mlir.dialects.native.gpu_formats import CHUNK, gpu_format_products
from sparse_mlir.dialects.native.gpu_reduce import (
    COMBINE,
    PARTIALS,
    gpu_total_reduction,
)

from sparse_mlir.abi.gpu_program import GridRule

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 64, "j": 48, "k": 48, "n": 40}
SPMV, SPMM = "y[i] = A[i,j] * x[j]", "C[i,j] = A[i,k] * B[k,j]"


def _products(expression: str, fmt: str, deterministic: bool, dtype: str = "float32"):
    spec = planned(expression, {"A": fmt}, dtype)
    return gpu_format_products(spec, spec.formats, static_shapes(spec, EXTENTS), deterministic)


def _checked(found) -> dict:
    verified(found.module)
    assert {launch.kernel for launch in found.launches} == set(functions(found.module))
    ops = op_counts(found.module)
    assert not ops["gpu.shuffle"] and not ops["gpu.barrier"]  # one thread's work each: emulated exactly
    return ops


@pytest.mark.parametrize(("expression", "fmt", "deterministic", "kernel", "atomics", "searches"), [
    (SPMV, "coo", False, "coo_spmv_chunks", 2, 0),
    (SPMM, "coo", False, "coo_spmm", 0, 2),
    (SPMV, "dcsr", False, "dcsr_spmv", 0, 0),
    (SPMM, "dcsr", True, "dcsr_spmm", 0, 0),
    (SPMV, "csc", False, "csc_spmv", 1, 0),
    (SPMM, "csc", False, "csc_spmm", 1, 0),
    ("y[j] = A[i,j] * x[i]", "csr", False, "csc_spmv", 1, 0),  # CSR read transposed: its rows scatter
    ("y[j] = A[i,j] * x[i]", "csc", True, "gather_spmv", 0, 0),  # CSC read transposed: its columns gather
    ("C[j,n] = A[i,j] * B[i,n]", "csc", True, "gather_spmm", 0, 0),
])
def test_each_format_gets_its_parallel_kernel(expression, fmt, deterministic, kernel, atomics, searches):
    found = _products(expression, fmt, deterministic)
    ops = _checked(found)
    (launch,) = found.launches
    assert launch.kernel == kernel
    assert ops["memref.atomic_rmw"] == atomics and ops["scf.while"] == searches
    assert launch.fills_output == (kernel in ("coo_spmm", "gather_spmv", "gather_spmm"))  # else zeroed first
    if kernel == "coo_spmv_chunks":
        assert launch.grid == GridRule(ref=1, per_block=128 * CHUNK)  # from the stored entries, at launch
    if fmt == "dcsr":
        assert launch.grid == GridRule(ref=1, per_block=4 if expression == SPMM else 128)  # from the stored rows


def test_the_deterministic_coo_spmv_is_a_segmented_reduction():
    found = _products(SPMV, "coo", True)
    ops = _checked(found)
    assert [launch.kernel for launch in found.launches] == ["coo_spmv_segments", "coo_spmv_fixup"]
    assert not ops["memref.atomic_rmw"] and ops["scf.while"] == 1  # only the fix-up's run over one row's carries
    assert not any(launch.fills_output for launch in found.launches)  # rows without nonzeros: zeroed by the runtime
    assert found.scratch == (((128,), "int64"), ((128,), "float32"))  # one carry per thread of merge_threads(64)


def test_kernels_are_turned_down_where_they_do_not_apply():
    assert _products(SPMV, "csc", deterministic=True) is None  # atomics only: the sparsifier keeps it
    assert _products(SPMV, "csr", deterministic=False) is None  # the CSR kernels' job
    assert _products(SPMV, "coo", deterministic=False, dtype="float16") is None  # float16 sums in float32 elsewhere
    ints = _products(SPMV, "coo", deterministic=False, dtype="int32")  # integers: addi atomics, muli + addi
    assert ints is not None and op_counts(ints.module)["memref.atomic_rmw"] == 2
    assert "addi" in str(ints.module) and "math.fma" not in str(ints.module)
    assert _products("C[i,j] = A[i,k] * B[k,j] + b[j]", "coo", deterministic=False) is None


@pytest.mark.parametrize("deterministic", [False, True])
def test_total_reductions_run_in_passes(deterministic):
    spec = planned("s[] = A[i,j] * x[j]", {"A": "coo"}, "float64")
    found = gpu_total_reduction(spec, spec.formats, static_shapes(spec, EXTENTS), deterministic)
    ops = _checked(found)
    kernels = [launch.kernel for launch in found.launches]
    assert kernels == ["reduce_partials", "reduce_combine"] + (["reduce_final"] if deterministic else [])
    assert ops["memref.atomic_rmw"] == (0 if deterministic else 1)
    assert found.scratch[0] == ((PARTIALS,), "float64") and len(found.scratch) == (2 if deterministic else 1)
    first = found.launches[0]
    assert first.grid[0] * first.block[0] == PARTIALS
    assert [arg.ref for arg in first.args if arg.kind == "buffer"] == [2, 3, 4]  # COO's crd1, values, then x
    assert found.launches[1].grid[0] * found.launches[1].block[0] == COMBINE


def test_total_reductions_are_turned_down_where_they_do_not_apply():
    def build(expression: str, fmt: str):
        spec = planned(expression, {"A": fmt}, "float32")
        return gpu_total_reduction(spec, spec.formats, static_shapes(spec, EXTENTS), False)

    assert build("s[] = A[i,j] * x[i]", "coo") is None  # x at the first level's coordinate
    assert build("y[i] = A[i,j]", "coo") is None  # not a scalar
    assert build("s[] = A[i,j]", "bsr2x2") is not None  # stored zeros add nothing


def test_csf_contractions_take_a_thread_per_fiber():
    from sparse_mlir.dialects.native.gpu_fibers import gpu_csf_fibers

    def build(expression: str, fmt: str = "csf", dtype: str = "float32"):
        spec = planned(expression, {"A": fmt}, dtype)
        return gpu_csf_fibers(spec, spec.formats, static_shapes(spec, EXTENTS))

    found = build("Z[i,j] = A[i,j,k] * B[k,j]")
    ops = _checked(found)
    (launch,) = found.launches
    assert launch.kernel == "csf_fibers" and launch.grid == GridRule(ref=3, per_block=128)  # stored fibers (crd1)
    assert ops["scf.while"] == 1 and not ops["memref.atomic_rmw"] and not launch.fills_output
    assert build("Z[i,j] = A[i,j,k] * x[k]") is not None
    assert build("Z[i,k] = A[i,j,k] * x[j]") is None  # the sum is not over the last level
    assert build("Z[i,j] = A[i,j,k] * B[k,j]", "coo3") is None
    assert build("Z[i,j] = A[i,j,k] * B[k,j]", dtype="float16") is None


def test_the_deterministic_spmv_gets_the_merge_path_for_skewed_rows():
    from sparse_mlir.dialects.native.gpu_merge import gpu_spmv_merge, merge_threads

    spec = planned(SPMV, {"A": "csr"}, "float64")
    shapes = static_shapes(spec, EXTENTS)
    assert gpu_spmv_merge(spec, spec.formats, shapes, deterministic=False) is None  # the atomic split kernel's job
    found = gpu_spmv_merge(spec, spec.formats, shapes, deterministic=True)
    verified(found.module)
    ops = op_counts(found.module)
    assert not ops["memref.atomic_rmw"] and ops["scf.while"] == 2  # the diagonal search and the carry run
    assert ops["gpu.shuffle"] == 5  # the lanes-per-row kernel is kept for balanced rows
    assert [(launch.kernel, launch.when) for launch in found.launches] == [
        ("spmv", "balanced"), ("spmv_merge", "skewed"), ("spmv_merge_fixup", "skewed")]
    assert all(launch.fills_output for launch in found.launches)  # every row end is stored once: no zeroing
    threads = merge_threads(64)
    assert found.scratch == (((threads,), "int64"), ((threads,), "float64"))
    assert found.launches[1].grid == (threads // 128, 1, 1)
    half = planned(SPMV, {"A": "csr"}, "float16")
    assert gpu_spmv_merge(half, half.formats, static_shapes(half, EXTENTS), deterministic=True) is None
