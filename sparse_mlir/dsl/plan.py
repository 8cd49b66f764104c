"""From a parsed assignment to a ``KernelSpec``: indices, reductions, stages, checks.

Summation rule (TACO/einsum): an index on the right but not on the left is
summed, and the sum wraps the *smallest* subexpression that holds every use
of that index.  So ``C[i,j] = relu(A[i,k]*B[k,j] + bias[j])`` is
``relu(sum_k(A*B) + bias)`` (a fused epilogue) and ``y[i] = A[i,j] + b[i]``
is ``sum_j(A) + b``.  A sum that is not the whole right-hand side becomes a
*stage* of its own that fills a dense temporary; the last stage writes the
output.  Each stage becomes one ``linalg.generic``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sparse_mlir.dsl.ast import (
    Access,
    Assignment,
    Binary,
    Call,
    Expr,
    Literal,
    Reduce,
    Unary,
)
from sparse_mlir.dsl.parser import parse
from sparse_mlir.dtypes import check_dtype
from sparse_mlir.errors import DSLError, DTypeError, FormatError
from sparse_mlir.formats import Dense, Format, as_format

__all__ = ["RESERVED_IN_C", "Stage", "KernelSpec", "plan"]

# f(0) == 0 for these, so a sparse argument keeps the result sparse
_ZERO_PRESERVING = {"relu", "abs", "sqrt", "gelu"}
_FLOAT_ONLY = {"exp", "sqrt", "gelu"}


@dataclass(frozen=True)
class Stage:
    """One loop nest: ``result[indices] (+)= body`` summing over ``reduce``."""

    result: str
    indices: tuple[str, ...]
    reduce: tuple[str, ...]
    body: Expr

    @property
    def loops(self) -> tuple[str, ...]:
        return self.indices + self.reduce

    def accesses(self) -> tuple[Access, ...]:
        """Distinct tensor accesses of the body, in order of first appearance."""
        found: dict[Access, None] = {}

        def walk(node: Expr) -> None:
            if isinstance(node, Access):
                found.setdefault(Access(node.tensor, node.index), None)
            for child in node.children():
                walk(child)

        walk(self.body)
        return tuple(found)


@dataclass(frozen=True)
class KernelSpec:
    """Everything the IR builder needs, with no MLIR in it."""

    expression: str
    output: str
    output_indices: tuple[str, ...]
    inputs: tuple[str, ...]
    ranks: dict[str, int]
    formats: dict[str, Format]
    dtype: np.dtype
    stages: tuple[Stage, ...]
    temporaries: dict[str, tuple[str, ...]] = field(default_factory=dict)
    out_dtype: np.dtype | None = None  # the result's dtype when it differs from ``dtype`` (float16 -> float32)

    @property
    def output_dtype(self) -> np.dtype:
        return self.out_dtype if self.out_dtype is not None else self.dtype

    def is_sparse(self, name: str) -> bool:
        return not self.formats.get(name, Dense).is_dense

    @property
    def sparse_output(self) -> bool:
        return self.is_sparse(self.output)

    def extent_sources(self) -> dict[str, list[tuple[str, int]]]:
        """For each index, the (input, dimension) pairs whose size defines it."""
        sources: dict[str, list[tuple[str, int]]] = {}
        for stage in self.stages:
            for acc in stage.accesses():
                if acc.tensor in self.temporaries:
                    continue
                for dim, idx in enumerate(acc.index):
                    if (acc.tensor, dim) not in sources.setdefault(idx, []):
                        sources[idx].append((acc.tensor, dim))
        return sources

    @property
    def static_indices(self) -> frozenset[str]:
        """Indices a sparse operand uses: its shape is static at the ABI, so they are specialized."""
        used: set[str] = set()
        for stage in self.stages:
            for acc in stage.accesses():
                if self.is_sparse(acc.tensor):
                    used.update(acc.index)
        if self.sparse_output:
            used.update(self.output_indices)
        return frozenset(used)

    @property
    def parallelizable(self) -> bool:
        """Whether threads may split the outer loops: a dense result and an output index in every stage.

        The sparsifier's ``dense-outer-loop`` strategy asserts (aborting the
        process) on a stage with no parallel loop, e.g. a total reduction,
        and never threads insertion into sparse outputs.
        """
        return not self.sparse_output and all(stage.indices for stage in self.stages)

    def operand_index(self, name: str) -> tuple[str, ...]:
        """The index variables of each dimension of ``name`` (its first access)."""
        if name == self.output:
            return self.output_indices
        return next(a.index for st in self.stages for a in st.accesses() if a.tensor == name)

    def specialized_shapes(self, extents: dict[str, int]) -> dict[str, tuple[int | None, ...]]:
        """Every operand's type sizes: static where a sparse operand fixes the index, else ``None``.

        ``extents`` needs only the static indices: the others are never looked up.
        """
        static = self.static_indices
        return {name: tuple(extents[i] if (self.is_sparse(name) or i in static) else None
                            for i in self.operand_index(name)) for name in (*self.inputs, self.output)}

    def densified(self) -> KernelSpec:
        """The same kernel with every sparse input first copied into a dense temporary.

        A fallback for stages the sparsifier cannot compile (it crashes on
        some co-iterations, e.g. ``A[i,j] + (A[i,j] + x[j])`` over CSC): the
        copies are the simplest sparse loops there are, and the rest is dense.
        Only for dense outputs.
        """
        assert not self.sparse_output, "densifying inputs would store every zero of a sparse output"
        renamed = {n: f"_d{n}" for n in self.inputs if self.is_sparse(n)}
        mapping = {a: Access(renamed[a.tensor], a.index) for st in self.stages for a in st.accesses()
                   if a.tensor in renamed}
        copies = [Stage(t, self.operand_index(n), (), Access(n, self.operand_index(n))) for n, t in renamed.items()]
        stages = tuple(copies) + tuple(Stage(st.result, st.indices, st.reduce, _rename(st.body, mapping))
                                       for st in self.stages)
        temps = {**self.temporaries, **{t: self.operand_index(n) for n, t in renamed.items()}}
        return replace(self, stages=stages, temporaries=temps)

    def key(self) -> tuple:
        return (self.expression, tuple(sorted((n, f) for n, f in self.formats.items())), str(self.dtype),
                str(self.output_dtype))


# Co-iteration cases one loop nest may have (the sparsifier's lattice points: a union of n sparse operands has
# 2^n - 1).  Its code grows with their square when it writes a sparse output (compile times measured: 5 sparse
# operands summed 4.6 s, 6 19.5 s, 7 47.7 s) and about as fast with a dense one (6: 4.4 s, 7: 20.9 s); past these
# a compile runs for minutes holding the compiler, so such kernels are refused with the way out in the message.
MAX_CASES_SPARSE_OUTPUT = 31  # a sum of 5 sparse operands
MAX_CASES_DENSE_OUTPUT = 63  # a sum of 6 sparse operands


def plan(expression: str, formats: dict[str, Format | str] | None = None, dtype: str = "float64",
         out_dtype: Any = None) -> KernelSpec:
    """Parse ``expression`` and check it against ``formats``, ``dtype`` and ``out_dtype`` (default: ``dtype``).

    Results are written in the kernel's dtype; a float16 kernel, which sums
    in float32, may keep those sums (``out_dtype="float32"``).
    """
    try:
        return _plan(expression, formats, dtype, out_dtype)
    except RecursionError:  # the parser bounds nesting (MAX_DEPTH); this is for a caller already deep in its stack
        raise DSLError("the expression nests too deeply to plan from this call stack; split it into several "
                       "kernels") from None


def _plan(expression: str, formats: dict[str, Format | str] | None, dtype: str, out_dtype: Any) -> KernelSpec:
    tree = parse(expression)
    _check_names(tree, expression)
    tree = Assignment(tree.output, _fold_negated_literals(tree.rhs))
    dt = check_dtype(dtype, "kernel dtype")
    out_dt = check_dtype(out_dtype, "out_dtype") if out_dtype is not None else dt
    if out_dt != dt and (dt, out_dt) != (np.dtype(np.float16), np.dtype(np.float32)):
        raise DTypeError(f"out_dtype {out_dt} with kernel dtype {dt}: results are written in the kernel's dtype, "
                         f"except that float16 kernels may write their float32 sums (out_dtype='float32')")
    ranks = _ranks(tree, expression)
    inputs = tuple(r for r in ranks if r != tree.output.tensor)
    fmts: dict[str, Format] = {}
    for name, fmt in (formats or {}).items():
        if name not in ranks:
            raise DSLError(f"formats names {name!r}, which is not a tensor of the expression "
                           f"(tensors: {', '.join(ranks)})")
        fmts[name] = as_format(fmt, ranks[name])
    _check_types(tree.rhs, dt, expression)
    _check_literals(tree.rhs, dt, expression)
    out = tree.output
    if len(set(out.index)) != len(out.index):
        raise DSLError(f"output index {out.index} repeats an index", expression, out.column)
    rhs_indices = tree.rhs.indices()
    for idx in out.index:
        if idx not in rhs_indices:
            raise DSLError(f"output index {idx!r} does not appear on the right-hand side, so its size is unknown",
                           expression, out.column)
    uses = Counter(i for acc in _accesses(tree.rhs) for i in acc.index)
    summed = {i for i in uses if i not in out.index}
    body = _place_reductions(tree.rhs, summed, uses)
    spec_formats = {n: f for n, f in fmts.items() if not f.is_dense}
    is_sparse = lambda name: name in spec_formats  # noqa: E731
    if out.tensor in spec_formats and spec_formats[out.tensor].is_nm:
        # the sparsifier writes an N:M output as if it were compressed and returned a malformed tensor
        raise FormatError(f"the output {out.tensor} is declared {spec_formats[out.tensor]}; an N:M result is not "
                          f"produced (nothing guarantees it keeps the pattern): give {out.tensor} the format csr")
    if out.tensor in spec_formats and not _zero_preserving(body, is_sparse):
        raise DSLError(f"the output {out.tensor} has sparse format {spec_formats[out.tensor]}, but the result is not "
                       f"zero where the sparse inputs are zero; give {out.tensor} a dense format",
                       expression, out.column)
    stages, temps = _stages(body, out)
    _check_coiteration(stages[-1], is_sparse, out.tensor in spec_formats, expression)
    for stage in stages[:-1]:
        _check_coiteration(stage, is_sparse, False, expression)
    if out.tensor not in spec_formats:
        stages, temps = _contiguous_layouts(stages, temps, set(spec_formats), out.tensor)
    return KernelSpec(expression=" ".join(expression.split()), output=out.tensor, output_indices=out.index,
                      inputs=inputs, ranks=ranks, formats=spec_formats, dtype=dt, stages=stages, temporaries=temps,
                      out_dtype=out_dt if out_dt != dt else None)


def _check_coiteration(stage: Stage, is_sparse, sparse_output: bool, expression: str) -> None:
    """Refuse a loop nest with more co-iteration cases than the sparsifier compiles in seconds (see the bounds)."""
    limit = MAX_CASES_SPARSE_OUTPUT if sparse_output else MAX_CASES_DENSE_OUTPUT
    cases = _cases(stage.body, is_sparse, limit)
    if cases is None:
        operands = sorted({a.tensor for a in stage.accesses() if is_sparse(a.tensor)})
        raise DSLError(f"{stage.result} co-iterates {len(operands)} sparse operands ({', '.join(operands)}) in one "
                       f"loop nest: more than {limit} cases, and the sparsifier's code (and compile time) grows "
                       f"exponentially with them; add them in steps (several kernels of at most "
                       f"{5 if sparse_output else 6} sparse operands)"
                       + ("" if not sparse_output else f", or give {stage.result} a dense format"), expression)


def _cases(node: Expr, is_sparse, limit: int) -> int | None:
    """The sparsifier's lattice points for ``node``: sets of sparse accesses co-iterated together, or ``None`` once
    there are more than ``limit`` (computed as sets, so ``A + A`` is one case, not three)."""
    empty: frozenset[frozenset[Access]] = frozenset({frozenset()})  # dense operands and literals: no condition

    def conj(a: frozenset, b: frozenset) -> frozenset:
        return frozenset(x | y for x in a for y in b)

    def walk(n: Expr) -> frozenset[frozenset[Access]]:
        if isinstance(n, Access):
            return frozenset({frozenset({Access(n.tensor, n.index)})}) if is_sparse(n.tensor) else empty
        if isinstance(n, (Literal, Reduce)):
            return empty if isinstance(n, Literal) else walk(n.body)
        parts = [walk(c) for c in n.children()]
        if isinstance(n, Binary) and n.op == "*":
            found = conj(parts[0], parts[1])
        elif len(parts) == 2:  # + - max: a union
            found = parts[0] | parts[1] | conj(parts[0], parts[1])
        else:
            found = parts[0]
        if len(found - empty) > limit:
            raise _TooMany
        return found

    try:
        return len(walk(node) - empty)
    except _TooMany:
        return None


class _TooMany(Exception):
    """Raised inside ``_cases`` to stop counting early."""


def _rename(node: Expr, mapping: dict[Access, Access]) -> Expr:
    """``node`` with the accesses in ``mapping`` replaced (columns ignored)."""
    if isinstance(node, Access):
        return mapping.get(Access(node.tensor, node.index), node)
    if isinstance(node, Unary):
        return Unary(node.op, _rename(node.operand, mapping))
    if isinstance(node, Binary):
        return Binary(node.op, _rename(node.lhs, mapping), _rename(node.rhs, mapping))
    if isinstance(node, Call):
        return Call(node.func, tuple(_rename(a, mapping) for a in node.args), node.column)
    return node


def _contiguous_layouts(stages: tuple[Stage, ...], temps: dict[str, tuple[str, ...]], sparse: set[str],
                        output: str) -> tuple[tuple[Stage, ...], dict[str, tuple[str, ...]]]:
    """Lay dense operands out so the loops a sparse operand does not drive are innermost and contiguous.

    The sparsifier must iterate a sparse operand's indices in storage order,
    so the remaining ("free") indices end up innermost.  A dense operand or
    result indexed with a free index first (the Linear orientation
    ``Y[b,o] = X[b,i] * W[o,i]``) would then be walked with a stride:
    transposing it once (``_lX[i,b] = X[b,i]``, and the result back at the
    end) turns every inner loop into contiguous, vectorizable rows, as in
    sparse-times-dense SpMM.  Temporaries simply get the better layout.
    """
    new_stages: list[Stage] = []
    temps = dict(temps)
    relaid: dict[Access, Access] = {}  # temporaries whose layout changed, as later stages see them
    for stage in stages:
        body = _rename(stage.body, relaid)
        stage = Stage(stage.result, stage.indices, stage.reduce, body)
        bound = {i for a in stage.accesses() if a.tensor in sparse for i in a.index}
        free = [i for i in stage.loops if i not in bound]
        if not bound or not free:
            new_stages.append(stage)
            continue

        def better(index: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(i for i in index if i not in free) + tuple(i for i in index if i in free)

        copies: dict[Access, Access] = {}
        for acc in stage.accesses():
            if acc.tensor not in sparse and acc.tensor not in temps and better(acc.index) != acc.index:
                name = f"_l{acc.tensor}"
                copies[acc] = Access(name, better(acc.index))
                temps[name] = better(acc.index)
                new_stages.append(Stage(name, better(acc.index), (), acc))
        indices = better(stage.indices)
        body = _rename(stage.body, copies)
        if indices == stage.indices:
            new_stages.append(Stage(stage.result, indices, stage.reduce, body))
        elif stage.result != output:
            relaid[Access(stage.result, stage.indices)] = Access(stage.result, indices)
            temps[stage.result] = indices
            new_stages.append(Stage(stage.result, indices, stage.reduce, body))
        else:
            name = f"_l{output}"
            temps[name] = indices
            new_stages += [Stage(name, indices, stage.reduce, body),
                           Stage(output, stage.indices, (), Access(name, indices))]
    return tuple(new_stages), temps


def _accesses(node: Expr) -> list[Access]:
    if isinstance(node, Access):
        return [node]
    return [a for child in node.children() for a in _accesses(child)]


def _ranks(tree: Assignment, expression: str) -> dict[str, int]:
    ranks: dict[str, int] = {tree.output.tensor: len(tree.output.index)}
    for acc in _accesses(tree.rhs):
        if acc.tensor == tree.output.tensor:
            raise DSLError(f"the output {acc.tensor} also appears on the right-hand side; in-place updates are not "
                           f"supported", expression, acc.column)
        if len(set(acc.index)) != len(acc.index):
            raise DSLError(f"{acc!r} repeats an index (diagonal access is not supported)", expression, acc.column)
        if ranks.setdefault(acc.tensor, len(acc.index)) != len(acc.index):
            raise DSLError(f"{acc.tensor} is used with {ranks[acc.tensor]} and with {len(acc.index)} indices",
                           expression, acc.column)
        if not 0 <= len(acc.index) <= 3:
            raise DSLError(f"{acc.tensor} has {len(acc.index)} indices; tensors have at most 3", expression,
                           acc.column)
    return ranks


# Names a tensor may not take, and why.  Tensor names become keywords of the kernel call and C identifiers in
# the entry point and in exported headers (``NAME.h``, ``NAME_cuda.h``), beside names the planner and the C ABI
# make from them; a collision there compiled a wrong kernel (``_t0`` read the planner's temporary instead of the
# input) or failed deep in lowering (``A`` and ``A_d0``: "the C entry point did not parse").
_CALL_KEYWORDS = frozenset({"out", "self"})  # Kernel.__call__(self, out=None, **operands)
RESERVED_IN_C = frozenset("""
    auto break case char const continue default do double else enum extern float for goto if inline int long
    register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while
    alignas alignof bool false true nullptr static_assert thread_local typeof typeof_unqual constexpr
    _Alignas _Alignof _Atomic _BitInt _Bool _Complex _Decimal128 _Decimal32 _Decimal64 _Generic _Imaginary
    _Noreturn _Static_assert _Thread_local
    and and_eq asm bitand bitor catch char8_t char16_t char32_t class co_await co_return co_yield compl concept
    const_cast consteval constinit decltype delete dynamic_cast explicit export friend mutable namespace new
    noexcept not not_eq operator or or_eq private protected public reinterpret_cast requires static_cast
    template this throw try typeid typename using virtual wchar_t xor xor_eq
    int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t size_t NULL
    CUdeviceptr CUstream CUresult CUmodule CUfunction CUtensorMap
""".split())
# what the C ABI appends to a tensor's name for its other parameters (``A_d0``, ``A_pos1_len``, ``A_values``,
# ``A_implicit_pos2`` for N:M positions): a tensor named like that beside ``A`` would share a parameter name
_GENERATED_SUFFIX = re.compile(r"_(?:d\d+|pos\d+|crd\d+|values|implicit)(?:_.*)?", re.ASCII | re.DOTALL)


def _check_names(tree: Assignment, expression: str) -> None:
    """Refuse tensor names that collide with names the kernel makes or the languages it is written in reserve."""
    first: dict[str, Access] = {}
    for acc in (tree.output, *_accesses(tree.rhs)):
        first.setdefault(acc.tensor, acc)
    for name, acc in first.items():
        if name.startswith("_"):
            raise DSLError(f"tensor name {name!r}: names starting with '_' are reserved for the kernel's "
                           f"temporaries (_t0, _lX, _dA...)", expression, acc.column)
        if name in _CALL_KEYWORDS and acc is not tree.output:
            raise DSLError(f"input name {name!r} is taken by the kernel call (kernel({name}=...) would not pass "
                           f"an operand); rename the tensor", expression, acc.column)
        if name in RESERVED_IN_C:
            raise DSLError(f"tensor name {name!r} is reserved in C or C++, where it names a parameter of the "
                           f"kernel's entry point and exported headers; rename the tensor", expression, acc.column)
    for name, acc in first.items():
        for other in first:
            if other != name and name.startswith(other) and _GENERATED_SUFFIX.fullmatch(name, len(other)):
                raise DSLError(f"tensor name {name!r} collides with the C parameters made for {other!r} "
                               f"({other}_d0, {other}_pos1, {other}_crd1, {other}_values...); rename one of them",
                               expression, acc.column)


def _fold_negated_literals(node: Expr) -> Expr:
    """``-5`` as the literal -5, not the negation of 5.

    The range of a literal is then checked on the value the user wrote:
    ``-2147483648`` fits an int32 kernel, while its positive part does not.
    """
    if isinstance(node, Unary):
        operand = _fold_negated_literals(node.operand)
        if isinstance(operand, Literal):
            text = operand.text[1:] if operand.text.startswith("-") else f"-{operand.text}"
            return Literal(-operand.value, text, operand.column)
        return Unary(node.op, operand)
    if isinstance(node, Binary):
        return Binary(node.op, _fold_negated_literals(node.lhs), _fold_negated_literals(node.rhs))
    if isinstance(node, Call):
        return Call(node.func, tuple(_fold_negated_literals(a) for a in node.args), node.column)
    return node


def _check_literals(node: Expr, dtype: np.dtype, expression: str) -> None:
    """Refuse literals the kernel's dtype cannot hold.

    MLIR's constant builder wraps integers silently (``2147483648`` became
    -2147483648 in an int32 kernel), raises a raw TypeError past 64 bits, and
    float literals past the dtype's range became inf (``1e400``, ``1e39`` in
    float32) or 0 (``1e-400``).
    """
    if isinstance(node, Literal):
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            if not info.min <= node.value <= info.max:
                raise DSLError(f"literal {node.text} is out of the range of {dtype} ({info.min} to {info.max})",
                               expression, node.column)
        else:
            try:
                value = float(node.value)
            except OverflowError:  # an integer literal past float64
                value = float("inf")
            with np.errstate(all="ignore"):
                stored = dtype.type(value)
            written_nonzero = any(c in "123456789" for c in node.text.lower().split("e")[0])  # 1e-400 parses to 0.0
            if not np.isfinite(stored) or (stored == 0 and written_nonzero):
                info = np.finfo(dtype)
                became = "inf" if not np.isfinite(stored) else "0"
                raise DSLError(f"literal {node.text} is out of the range of {dtype} (it would become {became}; "
                               f"nonzero magnitudes run from {info.smallest_subnormal:g} to {info.max:g})",
                               expression, node.column)
    for child in node.children():
        _check_literals(child, dtype, expression)


def _check_types(node: Expr, dtype: np.dtype, expression: str) -> None:
    if isinstance(node, Call) and node.func in _FLOAT_ONLY and dtype.kind != "f":
        raise DSLError(f"{node.func} needs a floating-point dtype, but the kernel dtype is {dtype}", expression,
                       node.column)
    if isinstance(node, Literal) and isinstance(node.value, float) and dtype.kind != "f":
        raise DSLError(f"literal {node.text} is not an integer, but the kernel dtype is {dtype}", expression,
                       node.column)
    for child in node.children():
        _check_types(child, dtype, expression)


def _place_reductions(node: Expr, summed: set[str], uses: Counter) -> Expr:
    """Wrap each summed index around the smallest subtree holding all its uses.

    A sum is then pulled out through negation and through products with a
    factor free of sums (``sum_k(A*B) * 2`` is ``sum_k(A*B*2)``), which is the
    same value and saves a stage and its temporary.
    """
    children = tuple(_place_reductions(c, summed, uses) for c in node.children())
    if isinstance(node, Unary):
        node = Unary(node.op, children[0])
    elif isinstance(node, Binary):
        node = Binary(node.op, children[0], children[1])
    elif isinstance(node, Call):
        node = Call(node.func, children, node.column)
    here = Counter(i for acc in _accesses(node) for i in acc.index)
    wrapped_below = {i for c in children for i in _reduced(c)}
    over = tuple(i for i in node.indices() if i in summed and here[i] == uses[i] and i not in wrapped_below)
    node = _hoist_sum(node)
    if isinstance(node, Reduce) and over:
        return Reduce(node.over + over, node.body)
    return Reduce(over, node) if over else node


def _hoist_sum(node: Expr) -> Expr:
    """``-sum(x)`` -> ``sum(-x)``; ``sum(x) * y`` -> ``sum(x * y)`` when ``y`` holds no sum."""
    if isinstance(node, Unary) and isinstance(node.operand, Reduce):
        return Reduce(node.operand.over, Unary(node.op, node.operand.body))
    if isinstance(node, Binary) and node.op == "*":
        lhs, rhs = node.lhs, node.rhs
        if isinstance(lhs, Reduce) and not _reduced(rhs):
            return Reduce(lhs.over, Binary("*", lhs.body, rhs))
        if isinstance(rhs, Reduce) and not _reduced(lhs):
            return Reduce(rhs.over, Binary("*", lhs, rhs.body))
    return node


def _reduced(node: Expr) -> set[str]:
    own = set(node.over) if isinstance(node, Reduce) else set()
    return own.union(*(_reduced(c) for c in node.children()))


def _zero_preserving(node: Expr, is_sparse) -> bool:
    """True when ``node`` is zero wherever every sparse input is zero (dense inputs arbitrary)."""
    if isinstance(node, Access):
        return is_sparse(node.tensor)
    if isinstance(node, Literal):
        return node.value == 0
    if isinstance(node, Reduce):
        return _zero_preserving(node.body, is_sparse)
    if isinstance(node, Unary):
        return _zero_preserving(node.operand, is_sparse)
    if isinstance(node, Binary):
        lhs, rhs = (_zero_preserving(c, is_sparse) for c in node.children())
        return (lhs or rhs) if node.op == "*" else (lhs and rhs)
    if isinstance(node, Call):
        args = [_zero_preserving(a, is_sparse) for a in node.args]
        return node.func in _ZERO_PRESERVING and args[0] if node.func != "max" else all(args)
    raise AssertionError(f"unknown node {node!r}")


def _stages(body: Expr, out: Access) -> tuple[tuple[Stage, ...], dict[str, tuple[str, ...]]]:
    """Split nested sums into stages that fill dense temporaries, innermost first."""
    stages: list[Stage] = []
    temps: dict[str, tuple[str, ...]] = {}

    def lift(node: Expr) -> Expr:
        if isinstance(node, Reduce):
            inner = lift_children(node.body)
            name = f"_t{len(temps)}"
            temps[name] = node.indices()
            stages.append(Stage(name, node.indices(), node.over, inner))
            return Access(name, node.indices())
        return lift_children(node)

    def lift_children(node: Expr) -> Expr:
        if isinstance(node, Unary):
            return Unary(node.op, lift(node.operand))
        if isinstance(node, Binary):
            return Binary(node.op, lift(node.lhs), lift(node.rhs))
        if isinstance(node, Call):
            return Call(node.func, tuple(lift(a) for a in node.args), node.column)
        return node

    if isinstance(body, Reduce):
        stages_body, over = lift_children(body.body), body.over
    else:
        stages_body, over = lift_children(body), ()
    stages.append(Stage(out.tensor, out.index, over, stages_body))
    return tuple(stages), temps
