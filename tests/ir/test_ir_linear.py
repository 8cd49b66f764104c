"""IR of the Linear orientation (``dialects/native/linear.py``): two register-tile transposes around the tiled SpMM,
a private function; it never plans a kernel of its own."""

from __future__ import annotations

import importlib

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.epilogue import SCALAR_EPILOGUE, VECTOR_EPILOGUE
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.linear import native_linear
from sparse_mlir.dialects.native.loops import THREAD_COUNT
from sparse_mlir.dialects.native.target import CpuTarget

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"b": 8, "o": 48, "i": 64}


def _build(expression: str, formats: dict, dtype: str = "float32", bits: int = 256) -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_linear(spec, spec.formats, cpu_shapes(spec, EXTENTS), CpuTarget(bits))


def _signature(module: ir.Module, name: str) -> tuple[list[str], list[str]]:
    signature = ir.FunctionType(ir.TypeAttr(functions(module)[name].attributes["function_type"]).value)
    return [str(t) for t in signature.inputs], [str(t) for t in signature.results]


@pytest.mark.parametrize("fmt", ["csr", "2:4"])
@pytest.mark.parametrize("bias", ["", " + bias[o]", " + bias[b]"])
def test_linear_transposes_around_a_call_of_the_tiled_spmm(fmt, bias):
    module = verified(_build(f"Y[b,o] = X[b,i] * W[o,i]{bias}", {"W": fmt}))
    found = functions(module)
    assert set(found) == {KERNEL_NAME, "linear_spmm", THREAD_COUNT}
    kernel, core = found[KERNEL_NAME], found["linear_spmm"]
    assert FILLS_OUTPUT in kernel.attributes and "llvm.emit_c_interface" in kernel.attributes
    assert ir.StringAttr(core.attributes["sym_visibility"]).value == "private"
    assert FILLS_OUTPUT not in core.attributes
    ops = op_counts(module)
    # blocks of the batch (two copies of the block: blocks in parallel, or one after the other), unless the
    # bias reads the batch index: then the whole batch, each stage threaded
    copies = 1 if bias == " + bias[b]" else 2
    for op in ("vector.transpose", "vector.transfer_read", "vector.transfer_write"):  # the masked edge tiles
        assert ops[op] == 2 * copies, op
    assert ops["vector.shuffle"] == 2 * copies * 3 * 8  # interior 8x8 tiles: 3 butterfly stages of 8 shuffles
    # XT and T (whole: once; blocks: once per worker and once for the serial blocks, plus the workers' counter),
    # and the SpMM's own work queue's counter
    for op in ("memref.alloc", "memref.dealloc"):
        assert ops[op] == (2 + 1 if copies == 1 else 2 * 2 + 1 + 1), op
    # the kernel calls the SpMM (and, for its workers, the thread count), the SpMM asks for the thread count; each
    # transpose picks interior or edge tiles
    assert ops["func.call"] == (copies + 1 if copies == 1 else copies + 2)
    assert str(kernel).count("scf.if") == copies - 1 + 2 * copies
    # whole: both transposes and the SpMM's rows; blocks: the blocks and the SpMM's rows
    assert ops["scf.parallel"] == (3 if copies == 1 else 2)
    assert ops["vector.fma"] > 0
    inputs, results = _signature(module, KERNEL_NAME)
    crd = "i8" if fmt == "2:4" else "i32"
    assert inputs[:4] == ["memref<?x?xf32>", "memref<?xi32>", f"memref<?x{crd}>", "memref<?xf32>"]  # X, then W
    assert inputs[4:] == ["memref<?xf32>"] * bool(bias) + ["memref<?x?xf32>"] and results == ["memref<?x?xf32>"]
    assert "call @linear_spmm" in str(module)


def test_an_epilogue_over_output_features_runs_in_batch_blocks():
    module = verified(_build("Y[b,o] = relu(X[b,i]*W[o,i] + bias[o]) * s[o]", {"W": "csr"}))
    ops = op_counts(module)
    assert str(functions(module)[KERNEL_NAME]).count("scf.if") == 1 + 2 * 2  # blocks; interior or edge tiles
    # XT and T per worker and for the serial blocks, the workers' counter, the SpMM's work queue's counter
    assert ops["scf.parallel"] == 2 and ops["memref.alloc"] == 4 + 1 + 1


def test_the_transposes_use_register_tiles_of_the_vector_width():
    text = str(verified(_build("Y[b,o] = X[b,i] * W[o,i]", {"W": "csr"}, "float64", 512)))
    assert "vector<8x8xf64>" in text and "vector<8xf64>" in text


@pytest.mark.parametrize("fmt", ["csr", "2:4"])
def test_an_activation_runs_as_the_spmm_epilogue(fmt):
    module = verified(_build("Y[b,o] = max(X[b,i]*W[o,i], s[b]) * 2.0 - bias[o]", {"W": fmt}))
    assert set(functions(module)) == {KERNEL_NAME, "linear_spmm", VECTOR_EPILOGUE, SCALAR_EPILOGUE, THREAD_COUNT}
    ops = op_counts(module)
    assert ops["func.call"] == 4 and ops["arith.maximumf"] == 2
    # the SpMM takes W's buffers, X^T, then the epilogue's operands in the order they are read
    inputs, _ = _signature(module, "linear_spmm")
    assert inputs[3:] == ["memref<?x?xf32>", "memref<?xf32>", "memref<?xf32>", "memref<?x?xf32>"]
    assert _signature(module, VECTOR_EPILOGUE)[0] == ["vector<8xf32>", "index", "index", "memref<?xf32>",
                                                      "memref<?xf32>"]


def test_linear_never_plans_a_kernel(monkeypatch):
    """Emitters take the planned spec: ``native_linear`` builds its SpMM without going back to the planner."""
    planner = importlib.import_module("sparse_mlir.dsl.plan")  # the module: the package exports a function ``plan``
    spec = planned("Y[b,o] = relu(X[b,i]*W[o,i] + bias[o])", {"W": "csr"})

    def refuse(*args, **kwargs):
        raise AssertionError("an emitter called the planner")

    monkeypatch.setattr(planner, "_plan", refuse)
    verified(native_linear(spec, spec.formats, cpu_shapes(spec, EXTENTS)))


@pytest.mark.parametrize("expression, formats", [
    ("Y[b,o] = X[b,i] * W[o,i]", {"W": "bsr2x2"}),
    ("Y[b,o] = X[b,i] * W[o,i]", {}),
    ("Y[b,o] = X[b,i] * W[i,o]", {"W": "csr"}),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"}),
    ("Y[b,o] = X[b,i] * W[o,i] + D[o,b]", {"W": "csr"}),  # a 2-d addend not shaped like Y
    ("Y[b,o] = X[b,i] * W[o,i] * D[b,o]", {"W": "csr"}),  # multiplied, not added (a residual is)
])
def test_other_kernels_are_not_linear(expression, formats):
    spec = planned(expression, formats)
    assert native_linear(spec, spec.formats, cpu_shapes(spec, {**EXTENTS, "k": 8, "j": 8})) is None


def test_a_residual_is_added_in_the_transpose_into_y():
    """``+ R[b,o]``: ``R`` is the kernel's matrix input after ``X``'s and ``W``'s, read by the transpose into ``Y``
    (one more load per interior tile row and one more masked read per edge tile), and no input of the SpMM."""
    plain = op_counts(verified(_build("Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "csr"})))
    module = verified(_build("Y[b,o] = X[b,i] * W[o,i] + bias[o] + R[b,o]", {"W": "csr"}))
    ops = op_counts(module)
    # two copies of the block (workers, serial), 8x8 tiles at 256 bits
    assert ops["vector.load"] - plain["vector.load"] == 2 * 8
    assert ops["vector.transfer_read"] - plain["vector.transfer_read"] == 2
    inputs, _ = _signature(module, KERNEL_NAME)
    assert inputs[-2:] == ["memref<?x?xf32>", "memref<?x?xf32>"]  # R, then Y
    assert len(_signature(module, "linear_spmm")[0]) == len(_signature(
        verified(_build("Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "csr"})), "linear_spmm")[0])
