"""Which emitter builds which kernel (``dialects/select.py``): the ordered tables, the sparsifier last, and no
emitter plans a kernel of its own."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from ir_helpers import cpu_shapes, op_counts, planned, static_shapes, verified
from sparse_mlir.dialects import select
from sparse_mlir.dialects.native.target import CpuTarget

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 32, "j": 32, "k": 64, "b": 8, "o": 32}
DIALECTS = Path(select.__file__).parent

# (expression, formats, dtype) -> (CPU emitter, CUDA emitter or None)
DISPATCH = [
    ("y[i] = A[i,j] * x[j]", {"A": "csr"}, "float32", "spmv", "spmv"),
    ("y[i] = x[j] * A[i,j]", {"A": "csr"}, "float64", "spmv", "spmv"),
    ("y[i] = A[i,j] * x[j]", {"A": "csc"}, "float32", "format_spmv", "format_products"),
    ("y[i] = A[i,j] * x[j]", {"A": "coo"}, "float64", "format_spmv", "format_products"),
    ("y[j] = A[i,j] * x[i]", {"A": "csr"}, "int64", "format_spmv", "format_products"),
    ("y[i] = A[i,j]", {"A": "dcsr"}, "float32", "format_spmv", "format_products"),
    ("s[] = A[i,j] * x[j]", {"A": "dcsr"}, "float32", "sparsifier", "total_reduction"),
    ("y[i] = A[i,j] * x[j] + b[i]", {"A": "csr"}, "float32", "sparsifier", None),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}, "float32", "spmm", "spmm"),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}, "int32", "spmm", None),  # no integer kernels on CUDA
    ("C[i,j] = A[i,k] * B[k,j] + bias[i]", {"A": "2:4"}, "float32", "spmm", None),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "2:4"}, "float16", "spmm", "spmm_2to4"),
    ("C[i,j] = relu(A[i,k]*B[k,j] + bias[j])", {"A": "csr"}, "float32", "spmm", None),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr2x2"}, "float32", "bsr_spmm", None),
    ("C[i,j] = A[i,k] * B[k,j] + bias[j]", {"A": "bsr16x1"}, "float32", "bsr_spmm", None),
    ("C[i,j] = relu(A[i,k]*B[k,j])", {"A": "bsr2x2"}, "float32", "sparsifier", None),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csc"}, "float32", "sparsifier", "format_products"),
    ("C[i,j] = A[i,k] * B[k,j]", {}, "float16", "sparsifier", "gemm_f16"),
    ("C[i,j] = A[i,k] * B[k,j]", {}, "float32", "sparsifier", None),
    ("Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "csr"}, "float32", "linear", "linear"),
    ("Y[b,o] = X[b,i] * W[o,i] + bias[b]", {"W": "2:4"}, "float16", "linear", "linear_2to4"),
    ("Y[b,o] = relu(X[b,i]*W[o,i] + bias[o])", {"W": "2:4"}, "float32", "linear", None),
    ("Y[b,o] = X[b,i] * W[o,i]", {"W": "bsr2x2"}, "float32", "sparsifier", None),
    ("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": "csr"}, "float32", "sddmm", "sddmm"),
    ("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr"}, "float32", "sparsifier", None),
    ("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "C": "csr"}, "float64", "sparsifier", None),
    ("C[i,j] = A[i,j] + B[i,j]", {"A": "csr", "B": "csr", "C": "csr"}, "float32", "sparse_add", None),
    ("C[i,j] = 2*A[i,j] - B[i,j]", {"A": "csr", "B": "csr", "C": "csr"}, "int64", "sparse_add", None),
    ("C[i,j] = A[i,j] + B[i,j]", {"A": "csr", "B": "csr", "C": "dcsr"}, "float32", "sparsifier", None),
    ("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "B": "csr", "C": "csr"}, "float32", "sparse_product", None),
]
IDS = [f"{expression} {formats} {dtype}" for expression, formats, dtype, *_ in DISPATCH]


@pytest.mark.parametrize("expression, formats, dtype, cpu, cuda", DISPATCH, ids=IDS)
def test_the_first_emitter_that_applies_builds_the_kernel(expression, formats, dtype, cpu, cuda):
    spec = planned(expression, formats, dtype)
    shapes = cpu_shapes(spec, EXTENTS)
    choice = select.cpu_module(spec, shapes, CpuTarget(256))
    assert choice.emitter == cpu
    verified(choice.module)
    if cpu == select.SPARSIFIER:
        assert op_counts(choice.module)["linalg.generic"] >= 1
        assert str(choice.module) == str(select.generic_module(spec, shapes))
    # the table's matchers do not overlap here: no other row would have built these kernels either
    assert [row.name for row in select.CPU_EMITTERS if row.build(spec, shapes, CpuTarget(256)) is not None] == \
        ([] if cpu == select.SPARSIFIER else [cpu])
    on_cuda = select.cuda_choice(spec, static_shapes(spec, EXTENTS), deterministic=False)
    assert (on_cuda and on_cuda.emitter) == cuda
    kernels = select.cuda_kernels(spec, static_shapes(spec, EXTENTS), False)
    assert (kernels is None) == (cuda is None)
    if kernels is not None:
        verified(kernels.module)
        assert str(kernels.module) == str(on_cuda.kernels.module) and kernels.launches == on_cuda.kernels.launches


def test_every_row_has_its_own_name():
    for table in (select.CPU_EMITTERS, select.CUDA_EMITTERS):
        names = [row.name for row in table]
        assert len(set(names)) == len(names) and select.SPARSIFIER not in names


def test_deterministic_sums_drop_the_atomic_spmv():
    spec = planned("y[i] = A[i,j] * x[j]", {"A": "csr"})
    shapes = static_shapes(spec, EXTENTS)
    # deterministic: lanes per row, and for skewed rows the merge path (run where knobs.merge_spmv enables it)
    assert [launch.kernel for launch in select.cuda_kernels(spec, shapes, True).launches] == \
        ["spmv", "spmv_merge", "spmv_merge_fixup"]
    assert [launch.kernel for launch in select.cuda_kernels(spec, shapes, False).launches] == ["spmv", "spmv_split"]


def test_no_emitter_plans_a_kernel(monkeypatch):
    """Emitters take the planned spec; going back to the planner would make a second, unchecked spec."""
    specs = [(planned(expression, formats, dtype), cpu) for expression, formats, dtype, cpu, _ in DISPATCH]

    def refuse(*args, **kwargs):
        raise AssertionError("an emitter called the planner")

    monkeypatch.setattr(importlib.import_module("sparse_mlir.dsl.plan"), "_plan", refuse)
    for spec, cpu in specs:
        assert select.cpu_module(spec, cpu_shapes(spec, EXTENTS), CpuTarget(512)).emitter == cpu
        select.cuda_kernels(spec, static_shapes(spec, EXTENTS), False)


def test_no_module_under_dialects_imports_the_planner():
    for path in DIALECTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in ("sparse_mlir.dsl.plan", "sparse_mlir.dsl"):
                assert "plan" not in {alias.name for alias in node.names}, path
