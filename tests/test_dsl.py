"""The DSL front end: grammar, error columns, summation placement, sparse-output rules (no MLIR)."""

from __future__ import annotations

import pytest

import sparse_mlir as sm
from sparse_mlir.dsl import parse, plan
from sparse_mlir.dsl.ast import Access, Binary, Call, Reduce
from sparse_mlir.errors import DSLError


def test_parse_builds_a_readable_tree():
    tree = parse("C[i,j] = relu(A[i,k]*B[k,j] + bias[j])")
    assert repr(tree) == "C[i,j] = relu(((A[i,k] * B[k,j]) + bias[j]))"
    assert isinstance(tree.rhs, Call)


def test_precedence_and_unary_minus():
    tree = parse("y[i] = -a[i] + b[i] * c[i] - 2")
    assert repr(tree.rhs) == "(((-a[i]) + (b[i] * c[i])) - 2)"


@pytest.mark.parametrize("text,column,match", [
    ("C[i,j] = A[i,k] $ B[k,j]", 17, "unexpected character"),
    ("C[i,j] = A[i,k] *", 18, "expected a tensor"),
    ("C[i,j] = foo(A[i,j])", 10, "unknown function"),
    ("C[i,j] = A", 10, "must be indexed"),
    ("C[i,j] A[i,j]", 8, "expected '='"),
    ("C[i,j] = (A[i,j]", 17, "expected '\\)'"),
    ("C[i,] = A[i,j]", 5, "index variable"),
    ("C[i,j] = max(A[i,j])", 10, "takes 2"),
    ("C[i,j] = A[i,j] B[i,j]", 17, "after the expression"),
    ("= A[i]", 1, "starts with the output"),
])
def test_syntax_errors_point_at_the_column(text, column, match):
    with pytest.raises(DSLError, match=match) as info:
        parse(text)
    assert info.value.column == column
    assert isinstance(info.value, ValueError)
    assert "^" in str(info.value)


def test_no_eval():
    with pytest.raises(DSLError):
        parse("C[i] = __import__('os')")


def test_expression_must_be_a_string():
    with pytest.raises(DSLError):
        parse(42)  # type: ignore[arg-type]


def test_sum_wraps_the_smallest_subexpression():
    spec = plan("C[i,j] = relu(A[i,k]*B[k,j] + bias[j])", {"A": "csr"})
    assert len(spec.stages) == 2
    first, last = spec.stages
    assert first.reduce == ("k",) and first.indices == ("i", "j")
    assert last.reduce == () and last.result == "C"
    assert repr(last.body) == "relu((_t0[i,j] + bias[j]))"


def test_whole_rhs_sum_is_a_single_stage():
    spec = plan("C[i,j] = S[i,j] * A[i,k] * B[k,j]", {"S": "csr", "C": "csr"})
    assert len(spec.stages) == 1 and spec.stages[0].reduce == ("k",)
    assert spec.sparse_output


def test_sum_of_terms_sums_each_term():
    spec = plan("y[i] = A[i,j] + b[i]", {"A": "csr"})
    assert [s.reduce for s in spec.stages] == [("j",), ()]


def test_total_reduction():
    spec = plan("s[] = A[i,j]", {"A": "csr"})
    assert spec.output_indices == () and spec.stages[0].reduce == ("i", "j")


@pytest.mark.parametrize("text", ["C[i,j] = exp(A[i,j])", "C[i,j] = A[i,j] + 1", "C[i,j] = A[i,j] + B[i,j]"])
def test_sparse_output_needs_a_zero_preserving_expression(text):
    with pytest.raises(DSLError, match="not zero where the sparse inputs are zero"):
        plan(text, {"A": "csr", "C": "csr"})


def test_sparse_output_accepts_products_with_dense_operands():
    assert plan("C[i,j] = A[i,j] * B[i,j]", {"A": "csr", "C": "csr"}).sparse_output


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("func", ["exp", "sqrt"])
def test_float_functions_on_integers(dtype, func):
    with pytest.raises(DSLError, match="floating-point"):
        plan(f"C[i,j] = {func}(A[i,j])", {"A": "csr"}, dtype)


def test_float_literal_on_integers():
    with pytest.raises(DSLError, match="not an integer"):
        plan("C[i,j] = A[i,j] * 1.5", {"A": "csr"}, "int32")


@pytest.mark.parametrize("text,match", [
    ("C[i,j] = A[i]", "does not appear on the right"),
    ("C[i,i] = A[i,i]", "repeats an index"),
    ("C[i] = A[i,i]", "repeats an index"),
    ("C[i] = C[i] + A[i]", "in-place"),
    ("C[i] = A[i] + A[i,j]", "used with 1 and with 2"),
    ("C[i] = A[i,j,k,l]", "at most 3"),
])
def test_index_errors(text, match):
    with pytest.raises(DSLError, match=match):
        plan(text)


def test_formats_must_name_tensors_of_the_expression():
    with pytest.raises(DSLError, match="not a tensor"):
        plan("y[i] = A[i,j] * x[j]", {"Z": "csr"})


def test_format_rank_must_match():
    with pytest.raises(sm.errors.FormatError, match="2-d"):
        plan("y[i] = A[i,j,k]", {"A": "csr"})


def test_dtype_errors():
    with pytest.raises(sm.errors.DTypeError):
        plan("y[i] = A[i]", None, "complex64")
    with pytest.raises(sm.errors.DTypeError):
        plan("y[i] = A[i]", None, "not-a-dtype")


def test_static_indices_cover_sparse_operands_only():
    spec = plan("C[i,j] = A[i,k] * B[k,j]", {"A": "csr"})
    assert spec.static_indices == {"i", "k"}
    assert isinstance(spec.stages[0].body, Binary)
    assert spec.stages[0].accesses() == (Access("A", ("i", "k")), Access("B", ("k", "j")))
    assert not isinstance(spec.stages[0].body, Reduce)
