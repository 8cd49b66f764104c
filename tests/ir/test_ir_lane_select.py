"""IR of the N:M Linear and MLP kernels with output features across lanes (``dialects/native/lane_select.py``):
lane permutes and FMAs in register tiles, no transposes, no private SpMM; which targets, formats and dtypes
take them; and the small-batch path that reads ``W`` as stored (``dialects/native/row_select.py``)."""

from __future__ import annotations

from collections import Counter

import pytest
from ir_helpers import cpu_shapes, functions, op_counts, planned, verified
from mlir import ir
from sparse_mlir.dialects.epilogue import SCALAR_EPILOGUE, VECTOR_EPILOGUE
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.lane_select import CHUNKS_PER_TILE, ROW_TILE
from sparse_mlir.dialects.native.linear import native_linear
from sparse_mlir.dialects.native.loops import THREAD_COUNT
from sparse_mlir.dialects.native.mlp import native_mlp
from sparse_mlir.dialects.native.row_select import BATCH_ROWS
from sparse_mlir.dialects.native.target import CpuTarget

pytestmark = pytest.mark.usefixtures("mlir_context")  # every module here is built in-process

EXTENTS = {"b": 8, "o": 48, "i": 64, "p": 32}
PERMUTE = "llvm.call_intrinsic"
# register tiles: chunks x rows, for pairs of chunks and an odd last one, for tiles of rows and single rows
TILES = sum(c * t for c in (CHUNKS_PER_TILE, 1) for t in (ROW_TILE, 1))


def _linear(expression: str, formats: dict, dtype: str = "float32", bits: int = 512) -> ir.Module | None:
    spec = planned(expression, formats, dtype)
    return native_linear(spec, spec.formats, cpu_shapes(spec, EXTENTS), CpuTarget(bits))


def _intrinsics(module: ir.Module) -> Counter[str]:
    found: Counter[str] = Counter()

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == PERMUTE:
            found[ir.StringAttr(op.attributes["intrin"]).value] += 1
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


@pytest.mark.parametrize("dtype, n, m, entries, permute, two_source", [
    ("float32", 2, 4, 8, "llvm.x86.avx512.permvar.sf.512", "llvm.x86.avx512.vpermi2var.ps.512"),
    ("float64", 2, 4, 4, "llvm.x86.avx512.permvar.df.512", "llvm.x86.avx512.vpermi2var.pd.512"),
    ("int32", 1, 4, 4, "llvm.x86.avx512.permvar.si.512", None),  # m != 2 n: small batches repack W too
    ("int64", 4, 8, 4, "llvm.x86.avx512.permvar.di.512", "llvm.x86.avx512.vpermi2var.q.512")])
def test_an_n_m_linear_layer_permutes_and_multiplies_in_register_tiles(dtype, n, m, entries, permute, two_source):
    module = verified(_linear("Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": f"{n}:{m}"}, dtype))
    assert set(functions(module)) == {KERNEL_NAME, THREAD_COUNT}
    kernel = functions(module)[KERNEL_NAME]
    assert FILLS_OUTPUT in kernel.attributes and "llvm.emit_c_interface" in kernel.attributes
    ops = op_counts(module)
    # per register tile, a window's ``entries`` x chunks x rows permutes, in the loop over whole windows and in
    # the masked last window, in both repacked paths (one block of rows, chunks packed where they are used; several
    # blocks, the whole weight packed first); one FMA (floats) or multiply-add (integers) each
    found = _intrinsics(module)
    assert found[permute] == 2 * 2 * entries * TILES
    assert ops["vector.fma" if dtype.startswith("float") else "arith.muli"] >= ops[PERMUTE]
    # a small batch: for groups of 4, 2 and 1 batch rows, one two-source permute per row of a chunk (a vector's
    # lanes of them) and batch row, in the loop over whole spans and in the masked last span
    lanes = 64 // (8 if dtype.endswith("64") else 4)
    groups = sum(BATCH_ROWS >> k for k in range(BATCH_ROWS.bit_length()))
    assert found == ({permute: found[permute]} | ({two_source: 2 * lanes * groups} if two_source else {}))
    assert ops["scf.if"] >= (1 if two_source else 0)
    # X and Y in place: the only transposes repack W (its values, and its byte coordinates either four to a word
    # or one by one, where a row's entries do not fill whole words: each with one masked edge tile), once per
    # repacked path, each into W's repacked values and indices through a scratch of in-window offsets and one of
    # words, with the workers' counter
    assert ops["vector.transpose"] == 6 and ops["vector.transfer_read"] == 6
    # (and the small batch's workers' counter)
    assert ops["memref.alloc"] == ops["memref.dealloc"] == (11 if two_source else 10)
    # the whole weight's repacking (by chunks), the workers of each path
    assert ops["scf.parallel"] == (4 if two_source else 3)


def test_the_signature_is_the_transposing_kernels():
    """Both are the sparse assembler's signature, so the C entry point cannot tell them apart."""
    def signature(bits: int) -> list[str]:
        module = verified(_linear("Y[b,o] = X[b,i] * W[o,i] + bias[o]", {"W": "2:4"}, bits=bits))
        function_type = functions(module)[KERNEL_NAME].attributes["function_type"]
        return [str(t) for t in ir.FunctionType(ir.TypeAttr(function_type).value).inputs]

    assert signature(512) == signature(256)


def test_an_epilogue_gets_both_functions_with_lanes_along_the_features():
    module = verified(_linear("Y[b,o] = max(X[b,i]*W[o,i], s[b]) * 2.0 - bias[o]", {"W": "2:4"}))
    found = functions(module)
    assert set(found) == {KERNEL_NAME, THREAD_COUNT, VECTOR_EPILOGUE, SCALAR_EPILOGUE}
    vector_type = ir.FunctionType(ir.TypeAttr(found[VECTOR_EPILOGUE].attributes["function_type"]).value)
    assert [str(t) for t in vector_type.inputs] == ["vector<16xf32>", "index", "index", "memref<?xf32>",
                                                     "memref<?xf32>"]
    assert "call @" + SCALAR_EPILOGUE in str(found[KERNEL_NAME])  # the partial last chunk, lane by lane


@pytest.mark.parametrize("expression, formats, dtype, bits", [
    ("Y[b,o] = X[b,i] * W[o,i]", {"W": "2:4"}, "float32", 256),  # AVX2: loads are cheap, the transposes win
    ("Y[b,o] = X[b,i] * W[o,i]", {"W": "csr"}, "float32", 512),  # rows of different lengths
    ("Y[b,o] = X[b,i] * W[o,i]", {"W": "4:16"}, "float64", 512),  # a group wider than a window of 8
])
def test_other_weights_and_targets_keep_the_transposing_kernel(expression, formats, dtype, bits):
    module = verified(_linear(expression, formats, dtype, bits))
    assert "linear_spmm" in functions(module) and PERMUTE not in op_counts(module)


@pytest.mark.parametrize("formats, lanes", [(("2:4", "2:4"), True), (("2:4", "csr"), False),
                                            (("csr", "2:4"), False)])
def test_a_feed_forward_block_takes_the_lanes_when_both_weights_are_n_m(formats, lanes):
    spec = planned("Y[b,p] = W2[p,o] * gelu(X[b,i] * W1[o,i] + b1[o]) + b2[p]", dict(zip(("W1", "W2"), formats)))
    module = verified(native_mlp(spec, spec.formats, cpu_shapes(spec, EXTENTS), CpuTarget(512)))
    ops = op_counts(module)
    assert (PERMUTE in ops) == lanes and ("mlp_first" in functions(module)) != lanes
    if lanes:
        # several blocks: both weights repacked, the hidden scratch per worker, the workers' counter; one block
        # (each layer's chunks packed by its workers) and a small batch (W as stored): the batch's hidden scratch,
        # the counters of the two layers' workers (and one block: each worker's packed chunks); a packed weight
        # holds 4 buffers (values, indices, byte offsets, words of them) and transposes 3 ways (values, words, bytes)
        assert ops["memref.alloc"] == 2 * 4 + 1 + 1 + (3 + 2 * 4) + 3
        assert ops["vector.transpose"] == 2 * 2 * 3
        groups = sum(BATCH_ROWS >> k for k in range(BATCH_ROWS.bit_length()))
        assert _intrinsics(module)["llvm.x86.avx512.vpermi2var.ps.512"] == 2 * 2 * 16 * groups
        assert "call @" + VECTOR_EPILOGUE in str(functions(module)[KERNEL_NAME])
