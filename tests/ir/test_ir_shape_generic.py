"""Shape-generic CPU builds (``compiler/emitters.py``): the MLIR-free rule agrees with ``dialects/select.py``, every
shape-generic emitter builds with every size ``None`` and reads its sizes from its arguments, and a sparsifier
module is refused a shape-generic signature."""

from __future__ import annotations

import re

import pytest
from ir_helpers import op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects import select
from sparse_mlir.lowering import cpu as cpu_pipeline
from test_ir_select import DISPATCH, IDS

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.compiler.driver import generic_shapes
from sparse_mlir.compiler.emitters import SHAPE_GENERIC_CPU, shape_generic_emitter
from sparse_mlir.errors import LoweringError
from sparse_mlir.dialects.native.target import CpuTarget

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process


def test_the_generic_rows_follow_the_select_table_in_its_order():
    names = [row.name for row in select.CPU_EMITTERS]
    generic = [name for name, _ in SHAPE_GENERIC_CPU]
    assert set(generic) <= set(names)
    assert generic == [name for name in names if name in generic]


@pytest.mark.parametrize("expression, formats, dtype, cpu, cuda", DISPATCH, ids=IDS)
def test_the_rule_names_the_emitter_that_builds_the_kernel(expression, formats, dtype, cpu, cuda):
    spec = planned(expression, formats, dtype)
    name = shape_generic_emitter(spec, spec.formats)
    assert name == (None if cpu == select.SPARSIFIER else cpu)
    if name is None:
        return
    choice = select.cpu_module(spec, generic_shapes(spec), CpuTarget(256))
    assert choice.emitter == name
    text = str(verified(choice.module))
    assert "#sparse_tensor" not in text and "memref.dim" in text


@pytest.mark.parametrize("expression, formats", [
    ("y[i] = A[i,j] * x[j]", {"A": "csr"}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "2:4"}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr4x2"}),
    ("Y[b,o] = X[b,i] * W[o,i]", {"W": "csr"}),
    ("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": "csr"}),
])
def test_a_generic_module_compiles_in_no_size(expression, formats):
    """Constants in the module are loop steps, offsets and block sizes: none is a size of the problem."""
    spec = planned(expression, formats)
    size = 97 * 4  # a multiple of every block here; 97 is no loop step or offset
    sized = select.cpu_module(spec, {n: tuple(size for _ in s) for n, s in generic_shapes(spec).items()},
                              CpuTarget(256))
    generic = select.cpu_module(spec, generic_shapes(spec), CpuTarget(256))
    assert _literal(97, sized.module) or _literal(size, sized.module)
    assert not _literal(97, generic.module) and not _literal(size, generic.module)
    assert op_counts(generic.module)["memref.dim"] > op_counts(sized.module)["memref.dim"]


def _literal(value: int, module: ir.Module) -> bool:
    """Whether ``value`` is written as a literal in ``module`` (``97 : index``, ``[97]``), not in a value's name
    (``%97 : vector<8xf32>``)."""
    return re.search(rf"(?<![%#\w]){value} :", str(module)) is not None


def test_a_sparsifier_module_is_refused_a_generic_signature():
    spec = planned("C[i,j] = A[i,j] + B[i,j]", {"A": "csr"})
    shapes = generic_shapes(spec)
    sig = Signature.from_spec(spec, spec.formats, shapes, "kernel")
    assert sig.shape_generic
    with pytest.raises(LoweringError, match="static sparse shapes"):
        cpu_pipeline.lower_to_llvm(select.generic_module(spec, shapes), sig, cpu_pipeline.CpuOptions())


def test_the_c_entry_point_takes_the_sparse_sizes_and_checks_them():
    spec = planned("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr2x3"})
    sig = Signature.from_spec(spec, spec.formats, generic_shapes(spec), "entry")
    params = [p.name for p in sig.params()]
    assert params[params.index("A_values_len") + 1:][:2] == ["A_d0", "A_d1"]
    module = select.cpu_module(spec, generic_shapes(spec), CpuTarget(256)).module
    text = cpu_pipeline.loops_to_llvm(module, sig)
    entry = text[text.index("llvm.func @entry("):]
    assert entry.count("llvm.srem") == 2  # rows by 2, columns by 3
    assert ir.Module.parse(text).operation.verify()
