"""Differential fuzzing: random expressions, formats, dtypes, shapes and densities against numpy.

The CI profile runs a few dozen examples per family; ``pytest -m fuzz`` runs
thousands (set ``SPARSE_MLIR_FUZZ_EXAMPLES`` to change how many).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.reference import evaluate

import sparse_mlir as sm
from sparse_mlir.dsl import plan
from sparse_mlir.errors import DSLError

LONG = int(os.environ.get("SPARSE_MLIR_FUZZ_EXAMPLES", "2000"))
SIZES = {"i": [0, 1, 4], "j": [1, 3, 5], "k": [1, 6]}  # 0 and 1 included; few enough to bound compiles
FORMATS_2D = ["csr", "csc", "coo", "dcsr", "ds:1,0", "sd"]


@st.composite
def expressions(draw):
    """An expression over A (sparse, i x j), B (sparse or dense, i x j), x (dense, j), s (dense, i)."""
    dtype = draw(st.sampled_from(["float64", "float32", "int64", "int32"]))
    leaves = st.sampled_from(["A[i,j]", "B[i,j]", "x[j]", "s[i]", "2", "3"])

    def extend(children):
        return st.one_of(
            st.tuples(children, st.sampled_from(["+", "-", "*"]), children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            children.map(lambda c: f"-{c}"),
            st.tuples(st.sampled_from(["relu", "abs"]), children).map(lambda t: f"{t[0]}({t[1]})"),
            # float-only functions on small arguments, so no NaN or Inf meets an implicit zero: sparse
            # products skip absent entries (as scipy does), where dense numpy would give 0 * NaN = NaN
            *([st.tuples(st.sampled_from(["exp", "sqrt"]), leaves).map(lambda t: f"{t[0]}(abs({t[1]}))")]
              if dtype.startswith("float") else []),
            st.tuples(children, children).map(lambda t: f"max({t[0]}, {t[1]})"),
        )

    rhs = draw(st.recursive(leaves, extend, max_leaves=5))
    if "A[" not in rhs:
        rhs = f"A[i,j] * {rhs}"
    lhs = draw(st.sampled_from(["C[i,j]", "y[i]", "z[j]", "t[]"]))
    formats = {"A": draw(st.sampled_from(FORMATS_2D))}
    if "B[" in rhs and draw(st.booleans()):
        formats["B"] = draw(st.sampled_from(FORMATS_2D))
    if lhs.startswith("C") and draw(st.booleans()):
        formats["C"] = formats["A"]
    return f"{lhs} = {rhs}", formats, dtype


@st.composite
def operands(draw, spec):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    sizes = {idx: draw(st.sampled_from(choices)) for idx, choices in SIZES.items()}
    density = draw(st.sampled_from([0.0, 0.3, 1.0]))
    out = {}
    for name in spec.inputs:
        shape = tuple(sizes[i] for i in spec.operand_index(name))
        values = rng.integers(-3, 4, size=shape).astype(spec.dtype)
        if spec.is_sparse(name):
            values = values * (rng.random(shape) < density)
        if spec.dtype.kind == "f" and draw(st.booleans()):
            values = values / 4  # exact in binary, keeps sqrt/exp well away from overflow
        out[name] = values.astype(spec.dtype)
    return out


def check(data, expression, formats, dtype):
    try:
        spec = plan(expression, formats, dtype)
    except DSLError:
        return  # e.g. a sparse output the expression cannot have: the planner refused it cleanly
    dense = data.draw(operands(spec))
    args = {n: sm.SparseTensor.from_dense(v, formats[n]) if n in spec.formats else v for n, v in dense.items()}
    got = sm.compile(expression, formats=formats, dtype=dtype)(**args)
    got = got.to_dense() if isinstance(got, sm.SparseTensor) else got
    want = evaluate(spec, dense)
    if spec.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-5, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), case=expressions())
def test_random_expressions_match_numpy(data, case):
    check(data, *case)


@pytest.mark.parametrize("dtype", ["int64", "int32"])
@pytest.mark.parametrize("expression, formats", [
    ("C[i,j] = -(A[i,j] * x[j])", {"A": "csr", "C": "csr"}),
    ("C[i,j] = -A[i,j] + B[i,j]", {"A": "csr", "B": "csr", "C": "csr"}),
    ("y[i] = -(A[i,j] * x[j])", {"A": "csr"}),
])
@pytest.mark.parametrize("shape", [(0, 1), (3, 4)])
def test_integer_negation_into_a_sparse_output(dtype, expression, formats, shape):
    """Found by the fuzz test: ``0 - x``, the integer negation, crashed the sparsifier (the compiler process died
    of a SIGSEGV) co-iterating a sparse output; it is now ``x * -1``."""
    rng = np.random.default_rng(0)
    dense = {name: (rng.integers(-3, 4, shape) * (rng.random(shape) < 0.5)).astype(dtype) for name in "AB"}
    x = rng.integers(-3, 4, shape[1]).astype(dtype)
    args = {name: sm.SparseTensor.from_dense(dense[name], "csr") for name in "AB" if f"{name}[" in expression}
    if "x[" in expression:
        args["x"] = x
    got = sm.compile(expression, formats=formats, dtype=dtype)(**args)
    got = got.to_dense() if isinstance(got, sm.SparseTensor) else got
    want = {"C[i,j] = -(A[i,j] * x[j])": -(dense["A"] * x), "C[i,j] = -A[i,j] + B[i,j]": -dense["A"] + dense["B"],
            "y[i] = -(A[i,j] * x[j])": -(dense["A"] @ x)}[expression]
    np.testing.assert_array_equal(got, want)


@pytest.mark.fuzz
@pytest.mark.slow
@settings(max_examples=LONG, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), case=expressions())
def test_random_expressions_match_numpy_long(data, case):
    check(data, *case)
