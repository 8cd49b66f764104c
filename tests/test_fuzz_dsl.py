"""Fuzzing the DSL and ``Format`` (issue 14 item 9): random text, names, literals and formats.

The contract checked: whatever the user writes, ``plan``/``compile``/``Format``
either give a kernel whose result matches the numpy interpreter of the plan
(``tests/reference.py``) or raise a ``SparseMLIRError`` subclass; never another
exception, a crash of the process or a hang.

The default profile is small (compiles take 0.2-1 s each, the whole file
stays under a minute); ``pytest -m fuzz tests/test_fuzz_dsl.py`` runs the
long profile (``SPARSE_MLIR_FUZZ_EXAMPLES`` examples per test, default 2000).
"""

from __future__ import annotations

import contextlib
import os
import signal
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.reference import evaluate

import sparse_mlir as sm
from sparse_mlir.dsl import parse, plan
from sparse_mlir.errors import SparseMLIRError
from sparse_mlir.formats import MAX_ORDER, Format, Level, LevelExpr, LevelKind, as_format

LONG = int(os.environ.get("SPARSE_MLIR_FUZZ_EXAMPLES", "2000"))
def fuzz_settings(examples: int) -> settings:
    """No deadline (a compile takes up to a second), no health checks (drawing names filters some out)."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
DTYPES = ["float64", "float32", "int64", "int32"]

# -- names: ordinary, tricky but valid, and ones that collide with what the kernel makes --------------------------------
TRICKY_NAMES = ["relu", "exp", "max", "abs", "sqrt", "sum", "i", "j", "k", "x_d", "x_norm", "A0", "lambda", "None",
                "B" * 300, "out", "self", "_t0", "_t1", "_lA", "_dA", "_", "A_d0", "A_pos1", "A_crd1", "A_values",
                "A_implicit", "int", "float", "double", "new", "class", "int64_t", "NULL", "restrict"]
identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
names = st.one_of(st.sampled_from(["A", "B", "x", "y", "C"]), st.sampled_from(TRICKY_NAMES), identifiers)
index_names = st.one_of(st.sampled_from(["i", "j", "k"]), identifiers)

# -- literals: any spelling the grammar might take, in range or not ----------------------------------------------------
WILD_LITERALS = ["0", "-0", "0.0", "-0.0", "00012", "1e400", "1e-400", "1e39", "1e-46", "2147483647", "2147483648",
                 "-2147483648", "9223372036854775807", "9223372036854775808", "-9223372036854775808", "1" + "0" * 400,
                 "0x10", "1_000", "nan", "inf", "1.", ".5", "1e5", "3.4e38", "1e-45", "\u0663", "7" * 5000]
wild_literals = st.one_of(
    st.sampled_from(WILD_LITERALS),
    st.integers(-2**70, 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.from_regex(r"[0-9]{1,25}(\.[0-9]{0,5})?([eE][+-]?[0-9]{1,4})?", fullmatch=True),
)
# literals whose products and sums stay exact in every dtype, so results compare exactly (ints wrap like numpy)
EXACT_LITERALS = {"f": ["0", "-0.0", "0.5", "2", "3.25", "0.125", "-1"],
                  "i": ["0", "1", "-1", "3", "2147483647", "-2147483648"]}


@st.composite
def expressions(draw, leaf_names=names, literals=wild_literals, funcs=("relu", "abs", "exp", "sqrt", "max"),
                max_leaves=6):
    """``(text, tensors)``: an assignment and the tensor names it uses, with ranks 0-3 over random indices."""
    idx_pool = draw(st.lists(index_names, min_size=1, max_size=4, unique=True))
    tensors: dict[str, tuple[str, ...]] = {}

    def access(name: str) -> str:
        if name not in tensors:
            tensors[name] = tuple(draw(st.lists(st.sampled_from(idx_pool), max_size=3)))
        return f"{name}[{','.join(tensors[name])}]"

    leaves = st.one_of(leaf_names.map(access), leaf_names.map(access), literals)

    def extend(children):
        return st.one_of(
            st.tuples(children, st.sampled_from(["+", "-", "*"]), children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            children.map(lambda c: f"-{c}"),
            st.tuples(st.sampled_from([f for f in funcs if f != "max"]), children).map(lambda t: f"{t[0]}({t[1]})"),
            *([st.tuples(children, children).map(lambda t: f"max({t[0]}, {t[1]})")] if "max" in funcs else []),
        )

    rhs = draw(st.recursive(leaves, extend, max_leaves=max_leaves))
    out_name = draw(leaf_names.filter(lambda n: n not in tensors))
    used = sorted({i for index in tensors.values() for i in index})
    out_index = draw(st.lists(st.sampled_from(used), max_size=3, unique=True)) if used else []
    space = draw(st.sampled_from([" ", "", "\n", "\t ", "  "]))
    return f"{out_name}[{','.join(out_index)}]{space}={space}{rhs}", {out_name: tuple(out_index), **tensors}


# -- formats: strings of every form, and Format objects built from random levels --------------------------------------
format_strings = st.one_of(
    st.sampled_from(["csr", "csc", "coo", "dcsr", "csf", "dense", "sparse_vector", "CSR", " csc ", "coo3", "coo0",
                     "csf0", "csf1", "coo999999999", "bsr2x2", "bsr1x2", "bsr0x2", "2:4", "1:2", "1:1", "0:4", "4:2",
                     "", ":", "ds:", "ds:1,1", "ssss", "s" * 9, "ud", "uq", "uc", "ucq"]),
    st.from_regex(r"[dsuqc]{1,4}(:[0-3](,[0-3]){0,3})?", fullmatch=True),
    st.builds(lambda kind, n: f"{kind}{n}", st.sampled_from(["coo", "csf"]), st.integers(0, 5)),
    st.builds(lambda a, b: f"bsr{a}x{b}", st.integers(0, 4), st.integers(0, 4)),
    st.builds(lambda a, b: f"{a}:{b}", st.integers(0, 9), st.integers(0, 9)),
    st.text(alphabet=string.printable + "\u0663\u00e4", max_size=12),
)
levels = st.builds(Level, st.sampled_from(list(LevelKind) + ["dense", "DENSE", "bogus"]), st.booleans(), st.booleans(),
                   st.sampled_from([0, 1, 2, 4, -1, True, 2.0]), st.sampled_from([0, 2, 4, 8, "4"]))
level_exprs = st.builds(LevelExpr, st.integers(-1, 3), st.sampled_from(["", "floordiv", "mod", "div"]),
                        st.sampled_from([0, 1, 2, 4, -2, 2.5]))
format_objects = st.builds(Format, st.lists(levels, max_size=4).map(tuple), st.lists(level_exprs, max_size=4).map(tuple),
                           st.sampled_from([0, 8, 16, 32, 64, 7, True]), st.sampled_from([0, 8, 16, 32, 64, 12, 8.0]))


def _build(strategy, data):
    """Draw from a strategy whose construction may itself refuse (a ``Level`` of kind "bogus")."""
    try:
        return data.draw(strategy)
    except SparseMLIRError:
        return None


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (TimeoutError) instead of hanging: every refusal must come quickly, every kernel within a compile."""
    def expire(signum, frame):
        raise TimeoutError(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# -- checks -------------------------------------------------------------------------------------------------------------
def check_text(text: str) -> None:
    with deadline(30):
        try:
            tree = parse(text)
        except SparseMLIRError:
            return
    assert parse(repr(tree).replace("sum", "s")) is not None or True  # the tree prints (repr never raises)


def check_plan(expression: str, formats: dict, dtype: str) -> None:
    with deadline(30):
        try:
            spec = plan(expression, formats, dtype)
        except SparseMLIRError:
            return
    # what the planner accepts is well-formed: every tensor has a rank <= 3, formats match ranks, names are usable
    for name in (*spec.inputs, spec.output):
        assert 0 <= spec.ranks[name] <= 3
        assert not name.startswith("_") and (name == spec.output or name not in ("out", "self"))
    for name, fmt in spec.formats.items():
        assert fmt.ndim == spec.ranks[name]


def check_format(value) -> None:
    with deadline(30):
        try:
            fmt = as_format(value)
        except SparseMLIRError:
            return
    assert fmt.ndim is None or 1 <= fmt.ndim <= MAX_ORDER, fmt  # orders past 3 are refused by SparseTensor
    str(fmt), repr(fmt), fmt.encoding_text(), fmt.buffer_names  # printing never raises
    if fmt.is_dense:
        return
    if fmt.ndim > 3:
        return
    shape = tuple(4 * (d + 1) for d in range(fmt.ndim))
    array = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) % 3
    try:
        tensor = sm.SparseTensor.from_dense(array, fmt)
    except SparseMLIRError:
        return
    np.testing.assert_array_equal(tensor.to_dense(), array)


def _operand(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, sparse: bool) -> np.ndarray:
    values = rng.integers(-3, 4, size=shape)
    if sparse:
        values = values * (rng.random(shape) < 0.4)
    values = values.astype(dtype)
    return values / 4 if dtype.kind == "f" else values  # quarters: sums and products stay exact


def check_kernel(expression: str, formats: dict, dtype: str, seed: int, sizes: dict[str, int]) -> None:
    try:
        spec = plan(expression, formats, dtype)
    except SparseMLIRError:
        return
    rng = np.random.default_rng(seed)
    dense = {n: _operand(rng, tuple(sizes.get(i, 2) for i in spec.operand_index(n)), spec.dtype, spec.is_sparse(n))
             for n in spec.inputs}
    try:
        args = {n: sm.SparseTensor.from_dense(v, spec.formats[n]) if spec.is_sparse(n) else v
                for n, v in dense.items()}
    except SparseMLIRError:
        return  # a shape the format cannot tile, values outside an N:M pattern: the harness's draw, not the DSL's
    with deadline(300), np.errstate(all="ignore"):
        try:
            got = sm.compile(expression, formats=formats, dtype=dtype)(**args)
        except SparseMLIRError:
            return
        want = evaluate(spec, dense)
    got = got.to_dense() if isinstance(got, sm.SparseTensor) else np.asarray(got)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if spec.dtype.kind == "f":
        # where numpy's dense arithmetic meets inf or NaN, a sparse kernel's structural zeros legitimately differ
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


@st.composite
def kernels(draw):
    """A compilable-looking case: few names, exact literals, formats of every kind for the 2-d operands."""
    dtype = draw(st.sampled_from(DTYPES))
    pool = draw(st.lists(st.sampled_from(["A", "B", "x", "relu", "max", "i", "x_d", "L" * 200, "y", "C"]),
                         min_size=2, max_size=4, unique=True))
    funcs = ("relu", "abs", "max") + (("exp", "sqrt") if dtype.startswith("float") and draw(st.booleans()) else ())
    expression, tensors = draw(expressions(leaf_names=st.sampled_from(pool[:-1] or pool),
                                           literals=st.sampled_from(EXACT_LITERALS[dtype[0]]), funcs=funcs,
                                           max_leaves=4))
    formats = {}
    for name, index in tensors.items():
        if index and draw(st.booleans()):
            rank = len(index)
            choices = {1: ["sparse_vector", "s", "d", "u", "coo1"],
                       2: ["csr", "csc", "coo", "dcsr", "ds:1,0", "sd", "uq", "uc", "dd", "bsr2x2", "bsr1x2", "2:4"],
                       3: ["csf", "coo3", "ucq", "dss", "sds:2,0,1", "ddd"]}[rank]
            formats[name] = draw(st.sampled_from(choices))
    sizes = {i: draw(st.sampled_from([0, 1, 4, 8])) for index in tensors.values() for i in index}
    return expression, formats, dtype, draw(st.integers(0, 2**31)), sizes


# -- the fast profile ---------------------------------------------------------------------------------------------------
@fuzz_settings(300)
@given(text=st.one_of(st.text(max_size=40), st.text(alphabet="ABijk[],=+-*() .0123456789e_relumax", max_size=60)))
def test_any_text_parses_or_raises_dsl_error(text):
    check_text(text)


@fuzz_settings(300)
@given(case=expressions(), dtype=st.sampled_from(DTYPES + ["float16"]), data=st.data())
def test_any_expression_plans_or_raises_sparse_mlir_error(case, dtype, data):
    expression, tensors = case
    formats = {name: data.draw(format_strings) for name in tensors if data.draw(st.booleans())}
    check_plan(expression, formats, dtype)


@fuzz_settings(300)
@given(data=st.data())
def test_any_format_is_a_usable_format_or_raises_format_error(data):
    value = _build(st.one_of(format_strings, format_objects), data)
    if value is not None:
        check_format(value)


@fuzz_settings(20)
@given(case=kernels())
def test_any_accepted_kernel_computes_the_reference(case):
    check_kernel(*case)


# -- the long profile ---------------------------------------------------------------------------------------------------
@pytest.mark.fuzz
@pytest.mark.slow
@fuzz_settings(LONG)
@given(text=st.one_of(st.text(max_size=80), st.text(alphabet="ABijk[],=+-*() .0123456789e_relumax", max_size=120)))
def test_any_text_long(text):
    check_text(text)


@pytest.mark.fuzz
@pytest.mark.slow
@fuzz_settings(LONG)
@given(case=expressions(max_leaves=12), dtype=st.sampled_from(DTYPES + ["float16"]), data=st.data())
def test_any_expression_long(case, dtype, data):
    expression, tensors = case
    formats = {name: data.draw(format_strings) for name in tensors if data.draw(st.booleans())}
    check_plan(expression, formats, dtype)


@pytest.mark.fuzz
@pytest.mark.slow
@fuzz_settings(LONG)
@given(data=st.data())
def test_any_format_long(data):
    value = _build(st.one_of(format_strings, format_objects), data)
    if value is not None:
        check_format(value)


@pytest.mark.fuzz
@pytest.mark.slow
@fuzz_settings(max(LONG // 10, 1))
@given(case=kernels())
def test_any_accepted_kernel_long(case):
    check_kernel(*case)
