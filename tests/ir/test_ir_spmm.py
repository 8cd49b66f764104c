"""IR of the register-tiled CPU SpMM (``dialects/native/spmm.py``): CSR and N:M, biases, epilogues, the entry
without a ``KernelSpec`` (``spmm_module``)."""

from __future__ import annotations

import numpy as np
import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.epilogue import SCALAR_EPILOGUE, VECTOR_EPILOGUE, Epilogue
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.loops import THREAD_COUNT
from sparse_mlir.dialects.native.spmm import CSR_UNROLL, SpmmProblem, native_spmm, spmm_module

from sparse_mlir.formats import CSR, NM
from sparse_mlir.dialects.native.target import CpuTarget

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"i": 32, "k": 64, "j": 48}
TIERS = (8, 2, 1)  # vectors per column tile: the default accumulators, then 2, then 1


def _build(expression: str, formats: dict, dtype: str = "float32", bits: int = 256) -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_spmm(spec, spec.formats, cpu_shapes(spec, EXTENTS), CpuTarget(bits))


def _types(module: ir.Module, name: str = KERNEL_NAME) -> tuple[list[str], list[str]]:
    signature = ir.FunctionType(ir.TypeAttr(functions(module)[name].attributes["function_type"]).value)
    return [str(t) for t in signature.inputs], [str(t) for t in signature.results]


@pytest.mark.parametrize("bits, lanes", [(256, 8), (512, 16)])
def test_csr_spmm_keeps_column_tiles_in_registers(bits, lanes):
    module = verified(_build("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}, bits=bits))
    kernel = functions(module)[KERNEL_NAME]
    assert "llvm.emit_c_interface" in kernel.attributes and FILLS_OUTPUT in kernel.attributes
    ops = op_counts(module)
    # one parallel iteration per thread, taking ranges of rows from a shared counter (no panels); each thread's
    # aligned copy of B, made and freed when it pays, inside "any range left"
    assert ops["scf.parallel"] == 1 and ops["scf.while"] == 1 and ops["memref.atomic_rmw"] == 2
    assert ops["scf.if"] == 3 and ops["memref.copy"] == 1 and "alignment = 64" in str(module)
    assert ops["func.call"] == 1 and THREAD_COUNT in functions(module)  # the thread count, resolved when lowered
    # one FMA per register per nonzero: the tiers, one masked vector for the last columns, a scalar last column;
    # tiles narrower than the accumulators take CSR_UNROLL nonzeros a step, then the rest one at a time
    per_tile = [count if count == TIERS[0] else count * (CSR_UNROLL + 1) for count in (*TIERS, 1)]
    assert ops["vector.fma"] == sum(per_tile) and ops["math.fma"] == 1
    assert ops["vector.store"] == sum(TIERS) and ops["vector.maskedstore"] == 1  # C stored once per tile
    # B's rows, masked to the last columns: a load per nonzero of the masked tile's steps
    assert ops["vector.maskedload"] == CSR_UNROLL + 1 and ops["vector.create_mask"] == 1
    assert f"vector<{lanes}xf32>" in str(module)
    assert _types(module) == (["memref<?xi32>", "memref<?xi32>", "memref<?xf32>", "memref<?x?xf32>",
                               "memref<?x?xf32>"], ["memref<?x?xf32>"])


def test_nm_rows_walk_unrolled_groups_in_panels():
    module = verified(_build("C[i,j] = A[i,k] * B[k,j]", {"A": "2:4"}))
    ops = op_counts(module)
    # both entries of a group unrolled, in separate accumulator sets while registers allow
    assert ops["vector.fma"] == 2 * (sum(TIERS) + 1) and ops["math.fma"] == 2
    # each tile (the masked one too) and the scalar column start from zero or from C
    assert ops["scf.if"] == len(TIERS) + 1 + 1 + 3
    assert ops["scf.parallel"] == 1 and ops["arith.minui"] >= 2  # blocks of rows, panels of groups
    inputs, _ = _types(module)
    assert inputs[:3] == ["memref<?xi32>", "memref<?xi8>", "memref<?xf32>"]  # positions are implicit: unread


def test_integer_spmm_multiplies_and_adds():
    ops = op_counts(verified(_build("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}, "int32")))
    assert not ops["vector.fma"] and not ops["math.fma"] and ops["arith.muli"] >= sum(TIERS) + 1


@pytest.mark.parametrize("bias, load", [("bias[i]", "vector.broadcast"), ("bias[j]", "vector.load")])
def test_a_bias_seeds_the_sums(bias, load):
    plain = op_counts(verified(_build("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"})))
    ops = op_counts(verified(_build(f"C[i,j] = A[i,k] * B[k,j] + {bias}", {"A": "csr"})))
    assert ops[load] > plain[load] and ops["vector.fma"] == plain["vector.fma"]
    assert ops["func.call"] == plain["func.call"] == 1  # no epilogue (only the thread count): the bias seeds


def test_an_epilogue_runs_on_each_finished_row():
    module = verified(_build("C[i,j] = relu(A[i,k]*B[k,j] + bias[j]) * 2.0", {"A": "csr"}))
    found = functions(module)
    assert set(found) == {KERNEL_NAME, VECTOR_EPILOGUE, SCALAR_EPILOGUE, THREAD_COUNT}
    for name in (VECTOR_EPILOGUE, SCALAR_EPILOGUE):
        assert ir.StringAttr(found[name].attributes["sym_visibility"]).value == "private"
    ops = op_counts(module)
    assert ops["func.call"] == 3 and ops["arith.maximumf"] == 2  # relu, in each epilogue function
    assert _types(module, VECTOR_EPILOGUE) == (["vector<8xf32>", "index", "index", "memref<?xf32>"],
                                               ["vector<8xf32>"])


def test_an_epilogue_may_read_b_and_matrices():
    module = verified(_build("C[i,j] = max(A[i,k]*B[k,j], D[i,j]) - B[i,j]", {"A": "2:4"}))
    inputs, _ = _types(module)
    assert inputs[3:] == ["memref<?x?xf32>", "memref<?x?xf32>", "memref<?x?xf32>"]  # B, D, C
    assert _types(module, SCALAR_EPILOGUE)[0] == ["f32", "index", "index", "memref<?x?xf32>", "memref<?x?xf32>"]


@pytest.mark.parametrize("expression, formats", [
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "bsr2x2"}),  # BSR has its own emitter
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csc"}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr", "C": "csr"}),
    ("C[i,j] = A[i,k] * B[k,j]", {}),
    ("C[i,j] = A[i,k] * B[j,k]", {"A": "csr"}),
    ("y[i] = A[i,j] * x[j]", {"A": "csr"}),
    ("C[i,j] = relu(A[i,k]*B[k,j]) + D[j,i]", {"A": "csr"}),
])
def test_other_kernels_are_not_tiled_spmm(expression, formats):
    spec = planned(expression, formats)
    extents = {"i": 8, "j": 8, "k": 8}
    assert native_spmm(spec, spec.formats, cpu_shapes(spec, extents)) is None


def test_spmm_module_takes_no_kernel_spec():
    """The entry ``native_linear`` uses: sizes, format, inputs and epilogue given directly, a private helper."""
    from sparse_mlir.dsl.ast import Access, Call

    epilogue = Epilogue(Call("relu", (Access("T", ("o", "b")),)), "T", "o", "b", ())
    problem = SpmmProblem(np.dtype("float64"), NM(2, 4).with_widths(32, 8), (16, 32), (("W", 2), ("XT", 2)),
                          "W", "XT", epilogue=epilogue)
    module = verified(spmm_module(problem, CpuTarget(512), function_name="core"))
    found = functions(module)
    assert set(found) == {"core", VECTOR_EPILOGUE, SCALAR_EPILOGUE, THREAD_COUNT}
    assert ir.StringAttr(found["core"].attributes["sym_visibility"]).value == "private"
    assert "llvm.emit_c_interface" not in found["core"].attributes and FILLS_OUTPUT not in found["core"].attributes
    assert "vector<8xf64>" in str(module)
    plain = SpmmProblem(np.dtype("float32"), CSR, (8, 8), (("B", 2), ("A", 2), ("bias", 1)), "A", "B", "bias", 1)
    inputs, _ = _types(verified(spmm_module(plain)))
    assert inputs == ["memref<?x?xf32>", "memref<?xi32>", "memref<?xi32>", "memref<?xf32>", "memref<?xf32>",
                      "memref<?x?xf32>"]


@pytest.mark.parametrize("parallel", [True, False])
def test_the_thread_count_becomes_the_openmp_team_size_or_one(parallel):
    """``lowering.rewrites.resolve_thread_count``: a threaded build asks the OpenMP runtime, a serial one has 1."""
    from sparse_mlir.lowering.rewrites import OPENMP_THREADS, resolve_thread_count

    module = verified(_build("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}))
    resolve_thread_count(module, parallel)
    module.operation.verify()
    found = functions(module)
    assert THREAD_COUNT not in found and THREAD_COUNT not in str(module)
    assert (OPENMP_THREADS in found) == parallel
    assert op_counts(module)["func.call"] == (1 if parallel else 0)
