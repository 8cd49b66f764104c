"""Recursive-descent parser for tensor index notation (never ``eval``).

Grammar::

    assignment := access '=' expr
    access     := NAME '[' [NAME (',' NAME)*] ']'
    expr       := term (('+' | '-') term)*
    term       := unary ('*' unary)*
    unary      := '-' unary | primary
    primary    := NUMBER | access | FUNC '(' expr [',' expr] ')' | '(' expr ')'

Errors are ``DSLError`` with the 1-based column of the offending token.

Nesting is bounded (``MAX_DEPTH`` operations from the root to the deepest
leaf, a chain ``a + b + c`` counting one per operator): the parser, the
planner and the IR emitter all walk the tree recursively, and a flat sum of
600 terms used to end in a raw ``RecursionError`` somewhere among them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sparse_mlir.errors import DSLError
from sparse_mlir.dsl.ast import FUNCTIONS, Access, Assignment, Binary, Call, Expr, Literal, Unary

__all__ = ["parse", "MAX_DEPTH"]

MAX_DEPTH = 128  # far above any kernel a sparsifier compiles in reasonable time; far below Python's stack limit

# ASCII only (re.ASCII): without it ``\d`` also matches other scripts' digits ('٣', '３'), which int() and
# float() read, so a literal no user meant and no printout shows plainly went into the kernel
_TOKEN = re.compile(r"(?:(?P<number>\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\d+(?:[eE][+-]?\d+)?)"
                    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<op>[-+*=\[\](),]))", re.ASCII)
_SPACE = re.compile(r"\s*")
# digits of the largest finite value of any kernel dtype (float64, about 1.8e308): an integer literal with more is
# out of range whatever the dtype, and Python's int() refuses strings past 4300 digits with a raw ValueError
_MAX_INT_DIGITS = 310


@dataclass(frozen=True)
class _Token:
    kind: str  # number, name, op, end
    text: str
    column: int


def _tokenize(text: str) -> list[_Token]:
    """Split ``text`` into tokens in one linear pass.

    Matching at positions of the one string (never slicing the rest of it per
    token) keeps this linear: slicing made a 224 KB expression take 3.6 s to
    tokenize and a few MB hang for minutes before the depth bound refused it.
    """
    tokens, pos = [], 0
    while True:
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]  # \s* always matches
        if pos >= len(text):
            break
        match = _TOKEN.match(text, pos)
        if not match:
            raise DSLError(f"unexpected character {text[pos]!r}", text, pos + 1)
        kind = match.lastgroup or "op"
        tokens.append(_Token(kind, match.group(kind), pos + 1))
        pos = match.end()
    tokens.append(_Token("end", "", len(text) + 1))
    return tokens


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0
        self.depths: dict[int, int] = {}  # id(node) -> levels below and including it (leaves: 1, not stored)
        self.nesting = 0  # open parentheses, calls and unary minuses: how deep the parser itself recursed

    @property
    def tok(self) -> _Token:
        return self.tokens[self.i]

    def error(self, message: str, tok: _Token | None = None) -> DSLError:
        tok = tok or self.tok
        return DSLError(message, self.text, tok.column)

    def made(self, node: Expr, tok: _Token) -> Expr:
        """Record ``node``'s depth; refuse it (at ``tok``) past ``MAX_DEPTH``."""
        depth = 1 + max((self.depths.get(id(c), 1) for c in node.children()), default=0)
        if depth > MAX_DEPTH:
            raise self.error(f"the expression nests deeper than {MAX_DEPTH} operations (a chain a + b + ... counts "
                             f"one per operator); split it into several kernels", tok)
        self.depths[id(node)] = depth
        return node

    def nested(self, tok: _Token) -> None:
        """Count one more level of parser recursion; refuse past ``MAX_DEPTH`` before Python's stack runs out."""
        self.nesting += 1
        if self.nesting > MAX_DEPTH:
            raise self.error(f"the expression nests deeper than {MAX_DEPTH} levels of parentheses, calls and "
                             f"unary minus; split it into several kernels", tok)

    def expect(self, text: str) -> _Token:
        if self.tok.text != text or self.tok.kind not in ("op",):
            found = self.tok.text or "end of expression"
            raise self.error(f"expected '{text}', found {found!r}")
        tok = self.tok
        self.i += 1
        return tok

    def accept(self, text: str) -> bool:
        if self.tok.kind == "op" and self.tok.text == text:
            self.i += 1
            return True
        return False

    def assignment(self) -> Assignment:
        if self.tok.kind != "name":
            raise self.error("an assignment starts with the output tensor, e.g. 'C[i,j] = ...'")
        out = self.access()
        self.expect("=")
        rhs = self.expr()
        if self.tok.kind != "end":
            raise self.error(f"unexpected {self.tok.text!r} after the expression")
        return Assignment(out, rhs)

    def access(self) -> Access:
        name = self.tok
        self.i += 1
        self.expect("[")
        index: list[str] = []
        if not self.accept("]"):
            while True:
                if self.tok.kind != "name":
                    raise self.error(f"expected an index variable, found {self.tok.text or 'end of expression'!r}")
                index.append(self.tok.text)
                self.i += 1
                if self.accept("]"):
                    break
                self.expect(",")
        return Access(name.text, tuple(index), name.column)

    def expr(self) -> Expr:
        node = self.term()
        while self.tok.kind == "op" and self.tok.text in "+-":
            tok = self.tok
            self.i += 1
            node = self.made(Binary(tok.text, node, self.term()), tok)
        return node

    def term(self) -> Expr:
        node = self.unary()
        while self.tok.kind == "op" and self.tok.text == "*":
            tok = self.tok
            self.i += 1
            node = self.made(Binary("*", node, self.unary()), tok)
        return node

    def unary(self) -> Expr:
        tok = self.tok
        if self.accept("-"):
            self.nested(tok)
            node = self.made(Unary("-", self.unary()), tok)
            self.nesting -= 1
            return node
        return self.primary()

    def primary(self) -> Expr:
        tok = self.tok
        if tok.kind == "number":
            self.i += 1
            if not tok.text.isdigit():
                return Literal(float(tok.text), tok.text, tok.column)  # range per dtype: checked by the planner
            digits = tok.text.lstrip("0") or "0"
            if len(digits) > _MAX_INT_DIGITS:
                raise self.error(f"literal {tok.text[:12]}... ({len(digits)} digits) is out of the range of every "
                                 f"kernel dtype", tok)
            return Literal(int(digits), tok.text, tok.column)
        if tok.kind == "name":
            nxt = self.tokens[self.i + 1]
            if nxt.text == "(":
                return self.call()
            if nxt.text == "[":
                return self.access()
            raise self.error(f"{tok.text!r} must be indexed, e.g. {tok.text}[i,j], or called as a function", tok)
        if self.accept("("):
            self.nested(tok)
            node = self.expr()
            self.expect(")")
            self.nesting -= 1
            return node
        raise self.error(f"expected a tensor, a number, a function or '(', found {tok.text or 'end of expression'!r}")

    def call(self) -> Call:
        tok = self.tok
        if tok.text not in FUNCTIONS:
            raise self.error(f"unknown function {tok.text!r}; known: {', '.join(sorted(FUNCTIONS))}", tok)
        self.i += 1
        self.expect("(")
        self.nested(tok)
        args = [self.expr()]
        while self.accept(","):
            args.append(self.expr())
        self.expect(")")
        self.nesting -= 1
        if len(args) != FUNCTIONS[tok.text]:
            raise self.error(f"{tok.text} takes {FUNCTIONS[tok.text]} argument(s), got {len(args)}", tok)
        return self.made(Call(tok.text, tuple(args), tok.column), tok)


def parse(text: str) -> Assignment:
    """Parse one assignment in tensor index notation."""
    if not isinstance(text, str):
        raise DSLError(f"an expression must be a string, got {type(text).__name__}")
    return _Parser(text).assignment()
