"""BSR formats with a block side of 1 and blocks taller than the register budget.

MLIR simplifies ``d floordiv 1``/``d mod 1`` away, so these formats reach it
collapsed (``Format.mlir_levels``); a collapsed map whose inverse MLIR infers
wrongly (a tall block one column wide) is refused with a ``FormatError``
instead of crashing the compiler, and the SpMM runs natively in row chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.data import random_values

import sparse_mlir as sm
from sparse_mlir.errors import FormatError
from sparse_mlir.formats import Format, Level, LevelExpr, LevelKind


def blocked(rng: np.random.Generator, bm: int, bn: int, dtype: str = "float32") -> np.ndarray:
    """A 5x4-block matrix of ``bm x bn`` blocks, about half of them present, block row 1 empty."""
    mask = rng.random((5, 4)) < 0.5
    mask[1] = False
    mask[0, 0] = True
    return (np.kron(mask, np.ones((bm, bn))) * random_values(rng, (5 * bm, 4 * bn), dtype)).astype(dtype)


@pytest.mark.parametrize("fmt", ["bsr1x4", "bsr1x1"])
@pytest.mark.parametrize("expr", ["y[i] = A[i,j] * x[j]", "y[j] = A[i,j] * x[i]"])
def test_one_row_blocks_compile_through_the_sparsifier(rng, fmt, expr):
    """A block one row high is stored with its unit level left out of the MLIR encoding, same buffers."""
    bm, bn = map(int, fmt[3:].split("x"))
    a = blocked(rng, bm, bn)
    x = random_values(rng, a.shape[1] if expr.endswith("x[j]") else a.shape[0], "float32")
    y = sm.compile(expr, formats={"A": fmt}, dtype="float32")(A=sm.SparseTensor.from_dense(a, fmt), x=x)
    np.testing.assert_array_equal(y, a @ x if expr.endswith("x[j]") else a.T @ x)


def test_one_row_blocks_as_a_sparse_output(rng):
    """A sparse result in bsr1x4 comes back with the buffers the Python format describes."""
    a, b = blocked(rng, 1, 4), blocked(rng, 1, 4)
    add = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": "bsr1x4", "B": "bsr1x4", "C": "bsr1x4"},
                     dtype="float32")
    out = add(A=sm.SparseTensor.from_dense(a, "bsr1x4"), B=sm.SparseTensor.from_dense(b, "bsr1x4"))
    np.testing.assert_array_equal(out.to_dense(), a + b)


@pytest.mark.parametrize("bm", [2, 16])
@pytest.mark.parametrize("expr", ["y[i] = A[i,j] * x[j]", "s[] = A[i,j]"])
def test_one_column_blocks_are_refused_outside_the_native_spmm(rng, bm, expr):
    """MLIR would infer the dimensions of ``(d0 floordiv bm, d1, d0 mod bm)`` swapped: a clear error, no crash."""
    fmt = f"bsr{bm}x1"
    a = blocked(rng, bm, 1)
    operands = {"A": sm.SparseTensor.from_dense(a, fmt)}
    if "x[j]" in expr:
        operands["x"] = random_values(rng, a.shape[1], "float32")
    kernel = sm.compile(expr, formats={"A": fmt}, dtype="float32")
    with pytest.raises(FormatError, match=rf"format {fmt} cannot go through MLIR's sparsifier.*bsr{bm}x2 or csr"):
        kernel(**operands)


def test_a_tall_block_one_column_wide_still_runs_as_spmm(rng):
    """The same bsr16x1 operand the sparsifier refuses runs in the register-blocked SpMM."""
    a = blocked(rng, 16, 1)
    B = random_values(rng, (a.shape[1], 21), "float32")
    kernel = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "bsr16x1"}, dtype="float32")
    np.testing.assert_array_equal(kernel(A=sm.SparseTensor.from_dense(a, "bsr16x1"), B=B), a @ B)
    assert "sparse_mlir.fills_output" in kernel.ir["input"]


def test_any_format_whose_inverse_mlir_gets_wrong_is_refused(rng):
    """A hand-made block format with the same flaw used to kill the compiler process (SIGSEGV)."""
    fmt = Format((Level(LevelKind.DENSE), Level(LevelKind.COMPRESSED), Level(LevelKind.DENSE)),
                 (LevelExpr(0, "floordiv", 2), LevelExpr(1), LevelExpr(0, "mod", 2)), name="tall2")
    a = blocked(rng, 2, 1)
    kernel = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": fmt}, dtype="float32")
    with pytest.raises(FormatError, match="infers the level-to-dimension map"):
        kernel(A=sm.SparseTensor.from_dense(a, fmt), x=random_values(rng, a.shape[1], "float32"))


def test_a_unit_level_with_buffers_cannot_be_left_out():
    """Only a dense ``d mod 1`` level is storage-free; a compressed one is refused by name."""
    fmt = Format(tuple(Level(LevelKind(k)) for k in ("dense", "compressed", "dense", "compressed")),
                 (LevelExpr(0, "floordiv", 2), LevelExpr(1, "floordiv", 1), LevelExpr(0, "mod", 2),
                  LevelExpr(1, "mod", 1)))
    with pytest.raises(FormatError, match=r"'d1 mod 1' is compressed"):
        fmt.mlir_levels()


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr", "ds:1,0", "bsr2x3", "bsr1x4", "bsr1x1", "2:4", "csf"])
def test_mlir_infers_the_inverse_each_format_means(fmt):
    """Every format that compiles gets the level-to-dimension map its levels describe."""
    from mlir import ir
    from mlir.dialects import sparse_tensor as st

    from sparse_mlir.dialects.encoding import encoding_attr, level_to_dimension

    fmt = sm.parse_format(fmt).codegen_format
    with ir.Context():
        attr = encoding_attr(fmt)
        assert str(st.EncodingAttr(attr).lvl_to_dim) == str(level_to_dimension(fmt))


def test_unit_block_sides_are_collapsed_in_the_mlir_text_only():
    """``encoding_text`` still describes the four Python levels; MLIR gets the equivalent shorter map."""
    fmt = sm.BSR(1, 4)
    assert "d0 mod 1" in fmt.encoding_text()
    assert fmt.mlir_encoding_text().count(" : ") == 3 and "floordiv 1" not in fmt.mlir_encoding_text()
    assert sm.BSR(1, 1).mlir_encoding_text() == sm.CSR.mlir_encoding_text()
    assert sm.BSR(2, 2).mlir_encoding_text() == sm.BSR(2, 2).encoding_text()


@pytest.mark.parametrize(("bm", "budget", "heights"), [(4, 8, [4]), (8, 8, [8]), (16, 8, [8, 8]),
                                                        (20, 8, [7, 7, 6]), (17, 16, [9, 8]), (1, 8, [1])])
def test_row_chunks_are_balanced_and_cover_the_block(bm, budget, heights):
    from sparse_mlir.dialects.native.bsr import row_chunks

    chunks = row_chunks(bm, budget)
    assert [len(c) for c in chunks] == heights
    assert [r for c in chunks for r in c] == list(range(bm))


def test_the_avx512_budget_chunks_only_blocks_taller_than_sixteen():
    """At 512 bits a 16-row block is one chunk (the kernel it always had); 40 rows are three of at most 16 sums."""
    import re

    from mlir import ir

    from sparse_mlir.dialects.native.bsr import native_bsr_spmm
    from sparse_mlir.dsl import plan

    for bm, heights in ((16, [16]), (40, [14, 13, 13])):
        fmt = sm.BSR(bm, 1)
        spec = plan("C[i,j] = A[i,k] * B[k,j]", {"A": fmt}, "float32")
        with ir.Context():
            text = str(native_bsr_spmm(spec, {"A": fmt}, {"A": (2 * bm, 8), "B": (8, None), "C": (2 * bm, None)},
                                       512))
        # block loops carry each chunk's sums: one vector tier (one vector per row), the masked vector of the last
        # columns and the scalar last column
        sums = [int(n) for n in re.findall(r":(\d+) = scf\.for", text)]
        assert sums == heights * 3
