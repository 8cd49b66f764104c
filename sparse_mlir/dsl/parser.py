"""Recursive-descent parser for tensor index notation (never ``eval``).

Grammar::

    assignment := access '=' expr
    access     := NAME '[' [NAME (',' NAME)*] ']'
    expr       := term (('+' | '-') term)*
    term       := unary ('*' unary)*
    unary      := '-' unary | primary
    primary    := NUMBER | access | FUNC '(' expr [',' expr] ')' | '(' expr ')'

Errors are ``DSLError`` with the 1-based column of the offending token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import DSLError
from .ast import FUNCTIONS, Access, Assignment, Binary, Call, Expr, Literal, Unary

__all__ = ["parse"]

_TOKEN = re.compile(r"\s*(?:(?P<number>\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\d+(?:[eE][+-]?\d+)?)"
                    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<op>[-+*=\[\](),]))")


@dataclass(frozen=True)
class _Token:
    kind: str  # number, name, op, end
    text: str
    column: int


def _tokenize(text: str) -> list[_Token]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if not match:
            column = pos + len(text[pos:]) - len(text[pos:].lstrip()) + 1
            raise DSLError(f"unexpected character {text[column - 1]!r}", text, column)
        kind = match.lastgroup or "op"
        tokens.append(_Token(kind, match.group(kind), match.start(kind) + 1))
        pos = match.end()
    tokens.append(_Token("end", "", len(text) + 1))
    return tokens


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0

    @property
    def tok(self) -> _Token:
        return self.tokens[self.i]

    def error(self, message: str, tok: _Token | None = None) -> DSLError:
        tok = tok or self.tok
        return DSLError(message, self.text, tok.column)

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
            op = self.tok.text
            self.i += 1
            node = Binary(op, node, self.term())
        return node

    def term(self) -> Expr:
        node = self.unary()
        while self.accept("*"):
            node = Binary("*", node, self.unary())
        return node

    def unary(self) -> Expr:
        if self.accept("-"):
            return Unary("-", self.unary())
        return self.primary()

    def primary(self) -> Expr:
        tok = self.tok
        if tok.kind == "number":
            self.i += 1
            is_int = re.fullmatch(r"\d+", tok.text) is not None
            return Literal(int(tok.text) if is_int else float(tok.text), tok.text, tok.column)
        if tok.kind == "name":
            nxt = self.tokens[self.i + 1]
            if nxt.text == "(":
                return self.call()
            if nxt.text == "[":
                return self.access()
            raise self.error(f"{tok.text!r} must be indexed, e.g. {tok.text}[i,j], or called as a function", tok)
        if self.accept("("):
            node = self.expr()
            self.expect(")")
            return node
        raise self.error(f"expected a tensor, a number, a function or '(', found {tok.text or 'end of expression'!r}")

    def call(self) -> Call:
        tok = self.tok
        if tok.text not in FUNCTIONS:
            raise self.error(f"unknown function {tok.text!r}; known: {', '.join(sorted(FUNCTIONS))}", tok)
        self.i += 1
        self.expect("(")
        args = [self.expr()]
        while self.accept(","):
            args.append(self.expr())
        self.expect(")")
        if len(args) != FUNCTIONS[tok.text]:
            raise self.error(f"{tok.text} takes {FUNCTIONS[tok.text]} argument(s), got {len(args)}", tok)
        return Call(tok.text, tuple(args), tok.column)


def parse(text: str) -> Assignment:
    """Parse one assignment in tensor index notation."""
    if not isinstance(text, str):
        raise DSLError(f"an expression must be a string, got {type(text).__name__}")
    return _Parser(text).assignment()
