"""The index-expression tree: plain frozen nodes with readable reprs, no MLIR.

``Reduce`` nodes do not come from the parser: the planner inserts them where
an index that is not on the left-hand side is summed (see ``plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Expr", "Access", "Literal", "Unary", "Binary", "Call", "Reduce", "Assignment", "FUNCTIONS"]

# name -> arity; what each means is decided by the emitter
FUNCTIONS = {"relu": 1, "abs": 1, "exp": 1, "sqrt": 1, "gelu": 1, "max": 2}


@dataclass(frozen=True)
class Expr:
    """Base class of expression nodes."""

    def children(self) -> tuple[Expr, ...]:
        return ()

    def indices(self) -> tuple[str, ...]:
        """Index variables used in this subtree, in order of first appearance."""
        seen: dict[str, None] = {}
        for child in self.children():
            seen.update(dict.fromkeys(child.indices()))
        return tuple(seen)


@dataclass(frozen=True)
class Access(Expr):
    tensor: str
    index: tuple[str, ...]
    column: int = 0

    def indices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.index))

    def __repr__(self) -> str:
        return f"{self.tensor}[{','.join(self.index)}]"


@dataclass(frozen=True)
class Literal(Expr):
    value: float | int
    text: str
    column: int = 0

    def __repr__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Unary(Expr):
    op: str  # only '-'
    operand: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.operand,)

    def __repr__(self) -> str:
        return f"(-{self.operand!r})"


@dataclass(frozen=True)
class Binary(Expr):
    op: str  # '+', '-', '*'
    lhs: Expr
    rhs: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.lhs, self.rhs)

    def __repr__(self) -> str:
        return f"({self.lhs!r} {self.op} {self.rhs!r})"


@dataclass(frozen=True)
class Call(Expr):
    func: str
    args: tuple[Expr, ...]
    column: int = 0

    def children(self) -> tuple[Expr, ...]:
        return self.args

    def __repr__(self) -> str:
        return f"{self.func}({', '.join(map(repr, self.args))})"


@dataclass(frozen=True)
class Reduce(Expr):
    """Sum of ``body`` over ``over`` (inserted by the planner)."""

    over: tuple[str, ...]
    body: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.body,)

    def indices(self) -> tuple[str, ...]:
        return tuple(i for i in self.body.indices() if i not in self.over)

    def __repr__(self) -> str:
        return f"sum[{','.join(self.over)}]({self.body!r})"


@dataclass(frozen=True)
class Assignment:
    output: Access
    rhs: Expr

    def __repr__(self) -> str:
        return f"{self.output!r} = {self.rhs!r}"
