"""Issue 14 item 9: names, literals and formats the DSL or ``Format`` used to accept and then mis-handle.

Each test failed on the code before its fix: a wrong answer, a raw Python
exception, a hang, or a refusal deep in lowering that named nothing the user
wrote.  Planner checks need no compiler; the few that compile are small.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import sparse_mlir as sm
from sparse_mlir.dsl import parse, plan
from sparse_mlir.errors import DSLError, FormatError
from sparse_mlir.formats import NM, BSR, Format, Level, LevelExpr, LevelKind, coo, csf, parse_format


# -- names -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression,match", [
    ("C[i] = _t0[i] + B[i,j]", "reserved for the kernel's temporaries"),  # read the planner's sum: [4,4,4]
    ("Y[b,o] = _lX[b,i] * W[o,i]", "reserved"),
    ("y[i] = out[i] * 2", "taken by the kernel call"),  # kernel(out=x) is the output buffer, never an operand
    ("y[i] = self[i] * 2", "taken by the kernel call"),  # kernel(self=x): raw TypeError
    ("C[i] = A[i] + A_d0[i]", "collides with the C parameters made for 'A'"),  # "C entry point did not parse"
    ("C[i] = A_values[i] * A[i,j]", "collides"),
    ("C[i] = A[i,j] * A_implicit[i]", "collides"),
    ("y[i] = int[i] * 2", "reserved in C"),
    ("y[i] = int64_t[i] * 2", "reserved in C"),
    ("y[i] = class[i] * 2", "reserved in C"),
])
def test_names_that_collide_are_refused(expression, match):
    with pytest.raises(DSLError, match=match) as info:
        plan(expression, {"A": "csr"} if "A[i,j]" in expression else None)
    assert info.value.column is not None


def test_temporary_named_input_computed_wrong_before():
    """The old planner summed B into ``_t0`` and then read that sum for the input named ``_t0`` too."""
    with pytest.raises(DSLError):
        sm.compile("C[i] = _t0[i] + B[i,j]")


@pytest.mark.parametrize("expression", [
    "out[i] = 2 * x[i]",  # the output is never a keyword of the call
    "y[i] = relu[i] * max[i] + exp[i]",  # function names are tensors when indexed
    "y[i] = x_d[i] * x[i] + x_norm[i]",  # near misses of the C suffixes
    "y[i] = i[i] * 2",  # a tensor named like an index
])
def test_ordinary_names_still_compile_right(expression):
    spec = plan(expression)
    x = np.arange(1.0, 4.0)
    args = {n: x * (k + 1) for k, n in enumerate(spec.inputs)}
    got = sm.compile(expression)(**args)
    from support.reference import evaluate
    np.testing.assert_array_equal(got, evaluate(spec, args))


def test_very_long_names_compile():
    name = "A" * 3000
    np.testing.assert_array_equal(sm.compile(f"y[i] = {name}[i] * 2")(**{name: np.ones(2)}), [2.0, 2.0])


@pytest.mark.parametrize("expression", ["y[i] = \u0663 * x[i]", "y[i] = \uff13 * x[i]", "y[\u00e4] = x[\u00e4]"])
def test_non_ascii_digits_and_names_are_refused(expression):
    with pytest.raises(DSLError, match="unexpected character"):
        parse(expression)


def test_tokenizer_is_linear():
    """Tokenizing sliced the rest of the text per token: 224 KB took 3.6 s, a few MB hung for minutes."""
    def seconds(terms: int) -> float:
        """The fastest of three runs (a busy machine only ever adds time), with the garbage collector paused:
        late in a full run its collections scan the whole suite's heap, which made 4x the text look 12x."""
        text = "y[i] = " + " + ".join(["A[i]"] * terms)
        times = []
        for _ in range(3):
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                with pytest.raises(DSLError, match="nests deeper"):
                    parse(text)
                times.append(time.perf_counter() - start)
            finally:
                gc.enable()
        return min(times)

    small, large = seconds(10_000), seconds(40_000)
    assert large < 10 * max(small, 0.01), (small, large)  # linear: about 4x; the old quadratic tokenizer: 16x


# -- literals --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("literal,dtype", [
    ("2147483648", "int32"),  # wrapped to -2147483648
    ("9223372036854775808", "int64"),  # raw TypeError in the constant builder
    ("1" + "0" * 400, "float64"),  # int -> float OverflowError
    ("1e400", "float64"),  # inf
    ("1e39", "float32"),  # inf
    ("70000", "float16"),  # inf
    ("1e-400", "float64"),  # parsed as 0.0
    ("1e-46", "float32"),  # rounds to 0
    ("9" * 5000, "float64"),  # raw ValueError: int() past 4300 digits
])
def test_literals_out_of_range_are_refused(literal, dtype):
    with pytest.raises(DSLError, match="out of the range"):
        plan(f"y[i] = {literal} * x[i]", dtype=dtype)


@pytest.mark.parametrize("literal,dtype,value", [
    ("-2147483648", "int32", -2**31),  # INT_MIN is in range although its positive part is not
    ("2147483647", "int32", 2**31 - 1),
    ("-9223372036854775808", "int64", -2**63),
    ("0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000012", "int64", 12),
    ("1e-45", "float32", np.float32(1e-45)),  # a subnormal, not zero
    ("3.4e38", "float32", np.float32(3.4e38)),
    ("0e999", "float64", 0.0),
])
def test_literals_at_the_edge_of_the_range_compute(literal, dtype, value):
    got = sm.compile(f"y[i] = x[i] * {literal}", dtype=dtype)(x=np.ones(2, dtype))
    np.testing.assert_array_equal(got, np.full(2, value, dtype))


def test_double_negation_is_checked_on_its_value():
    with pytest.raises(DSLError, match="out of the range"):
        plan("y[i] = --2147483648 * x[i]", dtype="int32")


# -- formats ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: parse_format("csf0"),  # was a format with no levels, equal to Dense: the operand silently dense
    lambda: csf(0), lambda: csf(-1), lambda: coo(0), lambda: coo(9),
    lambda: coo("2"), lambda: csf("3"), lambda: coo(2.0),  # raw TypeError
    lambda: BSR("2", 2),  # raw TypeError
    lambda: NM(1, 1),  # refused only at compile time, naming "1:1-as-compressed"
    lambda: NM(2, 2**70),
    lambda: parse_format("s" * 9),  # more levels than MAX_ORDER
    lambda: parse_format("ud"), lambda: parse_format("us"), lambda: parse_format("uu"), lambda: parse_format("sud"),
    lambda: parse_format("ucd"),  # the compiler process died (SIGABRT)
    lambda: Format((Level(LevelKind.DENSE), Level(LevelKind.LOOSE_COMPRESSED)), (LevelExpr(0), LevelExpr(1))),
])
def test_formats_that_were_mishandled_are_refused(make):
    with pytest.raises(FormatError):
        make()


def test_huge_coo_order_is_refused_at_once():
    """``coo999999999`` built a billion levels."""
    start = time.perf_counter()
    with pytest.raises(FormatError, match="order"):
        parse_format("coo999999999")
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize("fmt", ["uq", "uc", "coo", "coo3", "ucq", "u", "csf", "csf1", "coo1"])
def test_non_unique_levels_followed_by_singletons_stay_accepted(fmt):
    parse_format(fmt)


def test_nm_with_a_group_past_32_bits_gets_64_bit_coordinates():
    assert NM(1, 2**40).crd_width == 64 and NM(2, 4).crd_width == 8


@pytest.mark.parametrize("fmt", ["2:4", "1:4"])
def test_an_n_m_output_is_refused_before_it_can_come_back_malformed(fmt):
    """The sparsifier wrote an N:M output as if compressed: 9 coordinates for 16 values came back."""
    with pytest.raises(sm.errors.FormatError, match="N:M result"):
        sm.compile("C[i,j] = A[i,j] * s[i]", formats={"A": fmt, "C": fmt}, dtype="float64")
