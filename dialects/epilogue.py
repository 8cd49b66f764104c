"""Elementwise epilogues of hand-scheduled kernels, built with the MLIR bindings' op builders.

A kernel whose result goes through an elementwise expression
(``relu(A@B + bias[j])``) applies it to its finished sums in place, while
the row is still in L1, instead of writing a temporary that a second loop
nest reads back.  ``epilogue_functions`` builds two private functions, a
vector one and a scalar one for the column tail, each
``(sums, i, j, operand memrefs...) -> result`` for the sums of row ``i`` at
columns ``j ...``; emitters call them and LLVM inlines them.  What each DSL
function means matches ``dialects.linalg`` (relu is max with zero, max is
``maximumf`` on floats, gelu is ``dialects.activations.gelu`` in both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from mlir import ir
from mlir.dialects import arith, func, math, memref, vector

from sparse_mlir.dialects.activations import gelu
from sparse_mlir.dsl.ast import Access, Binary, Call, Expr, Literal, Unary

__all__ = ["SCALAR_EPILOGUE", "VECTOR_EPILOGUE", "Epilogue", "epilogue_functions"]

VECTOR_EPILOGUE = "sm_epilogue_vector"
SCALAR_EPILOGUE = "sm_epilogue_scalar"


class Epilogue(NamedTuple):
    """An elementwise expression of a kernel's sums: ``expr`` reads them as ``temp[i,j]``.

    ``operands`` are the other dense tensors it reads, in the order the
    epilogue functions take them, each indexed ``(i,)``, ``(j,)`` or ``(i,j)``.
    """

    expr: Expr
    temp: str
    i: str
    j: str
    operands: tuple[str, ...]


def epilogue_functions(expr: Expr, temp: str, i: str, j: str, operands: dict[str, int], element: ir.Type,
                       lanes: int) -> None:
    """The two epilogue functions, built at the insertion point (a module's body) of the emitter's module.

    ``operands`` maps each dense tensor the expression reads (besides
    ``temp``) to its rank, in parameter order.
    """
    for name, width in ((VECTOR_EPILOGUE, lanes), (SCALAR_EPILOGUE, 0)):
        _build(name, expr, temp, (i, j), operands, element, width)


def _build(name: str, expr: Expr, temp: str, ij: tuple[str, str], operands: dict[str, int], element: ir.Type,
           lanes: int) -> None:
    value_type = ir.VectorType.get([lanes], element) if lanes else element
    index = ir.IndexType.get()
    memrefs = [ir.MemRefType.get([ir.ShapedType.get_dynamic_size()] * rank, element) for rank in operands.values()]
    fn = func.FuncOp(name, ([value_type, index, index, *memrefs], [value_type]), visibility="private")
    block = fn.add_entry_block()
    with ir.InsertionPoint(block):
        sums, i, j = block.arguments[:3]
        buffers = dict(zip(operands, block.arguments[3:]))
        emit = _Emitter(element, value_type, lanes, sums, temp, {ij[0]: i, ij[1]: j}, buffers)
        func.ReturnOp([emit(expr)])


class _Emitter:
    """One expression over ``value_type`` (a vector of ``lanes`` columns, or a scalar when ``lanes`` is 0)."""

    def __init__(self, element: ir.Type, value_type: ir.Type, lanes: int, sums: ir.Value, temp: str,
                 at: dict[str, ir.Value], buffers: dict[str, ir.Value]):
        self.element, self.type, self.lanes = element, value_type, lanes
        self.sums, self.temp, self.at, self.buffers = sums, temp, at, buffers
        self.column = list(at)[1]  # the index the lanes run along
        self.float = isinstance(element, ir.FloatType)

    def __call__(self, node: Expr) -> ir.Value:
        if isinstance(node, Access):
            return self.sums if node.tensor == self.temp else self.load(node)
        if isinstance(node, Literal):
            return self.constant(float(node.value) if self.float else int(node.value))
        if isinstance(node, Unary):
            x = self(node.operand)
            return arith.negf(x) if self.float else arith.subi(self.constant(0), x)
        if isinstance(node, Binary):
            ops: dict[str, tuple[Callable, Callable]] = {"+": (arith.addf, arith.addi), "-": (arith.subf, arith.subi),
                                                         "*": (arith.mulf, arith.muli)}
            return ops[node.op][0 if self.float else 1](self(node.lhs), self(node.rhs))
        if isinstance(node, Call):
            args = [self(a) for a in node.args]
            if node.func == "relu":
                return self.maximum(args[0], self.constant(0))
            if node.func == "max":
                return self.maximum(*args)
            if node.func == "abs":
                return math.absf(args[0]) if self.float else math.absi(args[0])
            if node.func == "exp":
                return math.exp(args[0])
            if node.func == "sqrt":
                return math.sqrt(args[0])
            if node.func == "gelu":
                return gelu(args[0], self.constant)
        raise AssertionError(f"no epilogue for {node!r}")

    def constant(self, value: float) -> ir.Value:
        value = float(value) if self.float else int(value)
        if not self.lanes:
            return arith.constant(self.element, value)
        attr = ir.FloatAttr.get(self.element, value) if self.float else ir.IntegerAttr.get(self.element, value)
        return arith.constant(self.type, ir.DenseElementsAttr.get_splat(self.type, attr))

    def maximum(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return arith.maximumf(a, b) if self.float else arith.maxsi(a, b)

    def load(self, node: Access) -> ir.Value:
        """Row ``i``'s value (broadcast), or the columns ``j ...`` of a row vector or of row ``i`` of a matrix."""
        buffer = self.buffers[node.tensor]
        where = [self.at[x] for x in node.index]
        if not self.lanes:
            return memref.load(buffer, where)
        if node.index[-1] == self.column:  # (j,) or (i, j): the lanes' columns are contiguous
            return vector.load(self.type, buffer, where)
        return vector.broadcast(self.type, memref.load(buffer, where))
