"""Emit a ``KernelSpec`` as ``func.func`` + one ``linalg.generic`` per stage.

Only emission lives here: indices, reductions and checks were decided by
``sparse_mlir.dsl.plan``.  Operands carry their ``#sparse_tensor.encoding``;
sizes given as ``None`` stay dynamic.  Dense results accumulate into the
caller's zeroed output argument (every stage reads it, which keeps
bufferization in place), so nothing is allocated on the hot path; sparse
results start from ``tensor.empty``.

``relu``, ``exp`` and ``max`` of an argument that reads a sparse tensor use
``sparse_tensor.unary``/``binary``, which tell the sparsifier exactly what
happens where an operand is absent; other arguments use plain ``arith``/``math``.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, func, linalg, math, tensor
from mlir.dialects import sparse_tensor as st
from sparse_mlir.dialects.activations import gelu
from sparse_mlir.dialects.encoding import element_type, tensor_type

from sparse_mlir.dsl.ast import Access, Binary, Call, Expr, Literal, Unary
from sparse_mlir.dsl.plan import KernelSpec, Stage
from sparse_mlir.formats import Dense

__all__ = ["FILLS_OUTPUT", "KERNEL_NAME", "build_kernel_module", "fills_output"]

KERNEL_NAME = "kernel"
# unit attribute of a kernel function that stores every element of its dense output itself, so the C
# entry point need not zero-fill it first (hand-scheduled emitters; sparsified kernels accumulate into it)
FILLS_OUTPUT = "sparse_mlir.fills_output"


def fills_output(module: ir.Module) -> bool:
    """Whether ``module``'s kernel function carries ``FILLS_OUTPUT``."""
    return any(FILLS_OUTPUT in op.operation.attributes for op in module.body.operations
               if op.operation.name == "func.func")


def build_kernel_module(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]],
                        name: str = KERNEL_NAME) -> ir.Module:
    """Build the kernel module in the current ``ir.Context``.

    ``shapes`` gives every input's and the output's size per dimension
    (``None`` = dynamic).  The function takes the inputs in ``spec.inputs``
    order, then the output when it is dense, and returns the output.
    """
    with ir.Location.unknown():
        return _build(spec, shapes, name)


def _build(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], name: str) -> ir.Module:
    elt = element_type(spec.dtype)
    types = {n: tensor_type(shapes[n], spec.dtype, spec.formats.get(n, Dense).codegen_format)
             for n in (*spec.inputs, spec.output)}
    params = [*spec.inputs] + ([] if spec.sparse_output else [spec.output])
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
        fn = func.FuncOp(name, ([types[p] for p in params], [types[spec.output]]))
        fn.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
        entry = fn.add_entry_block()
        with ir.InsertionPoint(entry):
            values: dict[str, ir.Value] = dict(zip(params, entry.arguments))
            for stage in spec.stages:
                init = _init_value(spec, stage, types, values, shapes, elt)
                values[stage.result] = _emit_stage(spec, stage, values, init, elt)
            func.ReturnOp([values[spec.output]])
    module.operation.verify()
    return module


def _init_value(spec: KernelSpec, stage: Stage, types: dict, values: dict, shapes: dict, elt: ir.Type) -> ir.Value:
    """Where a stage accumulates: the dense output argument, an empty sparse result, or a zeroed temporary."""
    if stage.result == spec.output:
        if not spec.sparse_output:
            return values[spec.output]
        return tensor.EmptyOp([s for s in shapes[spec.output]], elt,
                              encoding=types[spec.output].encoding).result
    sources = spec.extent_sources()
    sizes: list[int | ir.Value] = []
    for idx in stage.indices:
        tensor_name, dim = sources[idx][0]
        static = shapes[tensor_name][dim]
        sizes.append(static if static is not None else
                     tensor.DimOp(values[tensor_name], arith.ConstantOp(ir.IndexType.get(), dim).result).result)
    empty = tensor.EmptyOp(sizes, elt).result
    return linalg.fill(_zero(elt), outs=[empty])


def _emit_stage(spec: KernelSpec, stage: Stage, values: dict[str, ir.Value], init: ir.Value,
                elt: ir.Type) -> ir.Value:
    loops = stage.loops
    accesses = stage.accesses()
    dims = {idx: ir.AffineDimExpr.get(i) for i, idx in enumerate(loops)}

    def amap(index: tuple[str, ...]) -> ir.AffineMap:
        return ir.AffineMap.get(len(loops), 0, [dims[i] for i in index])

    maps = [amap(a.index) for a in accesses] + [amap(stage.indices)]
    iterators = ("parallel",) * len(stage.indices) + ("reduction",) * len(stage.reduce)
    op = linalg.GenericOp([init.type], [values[a.tensor] for a in accesses], [init],
                          ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps]),
                          ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{t}>") for t in iterators]))
    block = op.region.blocks.append(*([elt] * (len(accesses) + 1)))
    sparse = {a.tensor for a in accesses if spec.is_sparse(a.tensor)}
    with ir.InsertionPoint(block):
        args = dict(zip(accesses, block.arguments))
        value = _ScalarEmitter(elt, args, sparse).emit(stage.body)
        if stage.reduce or not (stage.result == spec.output and spec.sparse_output):
            # accumulate into the zeroed result: reading it keeps bufferization in place
            value = _add(block.arguments[-1], value, elt)
        linalg.YieldOp([value])
    return op.result


def _is_float(t: ir.Type) -> bool:
    return isinstance(t, ir.FloatType)


def _zero(t: ir.Type) -> ir.Value:
    return arith.ConstantOp(t, 0.0 if _is_float(t) else 0).result


def _add(a: ir.Value, b: ir.Value, t: ir.Type) -> ir.Value:
    return arith.AddFOp(a, b).result if _is_float(t) else arith.AddIOp(a, b).result


def _max(a: ir.Value, b: ir.Value, t: ir.Type) -> ir.Value:
    return arith.MaximumFOp(a, b).result if _is_float(t) else arith.MaxSIOp(a, b).result


class _ScalarEmitter:
    """Emits the scalar body of one ``linalg.generic``."""

    def __init__(self, elt: ir.Type, args: dict[Access, ir.Value], sparse: set[str]):
        self.elt = elt
        self.args = args
        self.sparse = sparse  # tensors whose absent entries sparse_tensor.unary/binary must describe
        self.float = _is_float(elt)

    def emit(self, node: Expr) -> ir.Value:
        if isinstance(node, Access):
            return self.args[Access(node.tensor, node.index)]
        if isinstance(node, Literal):
            return arith.ConstantOp(self.elt, float(node.value) if self.float else int(node.value)).result
        if isinstance(node, Unary):
            x = self.emit(node.operand)
            if self.float:
                return arith.NegFOp(x).result
            # ``x * -1``, not ``0 - x``: the sparsifier takes ``0 - x`` for its integer negation and crashed on it
            # co-iterating a sparse output (``C[i,j] = -(A[i,j] * x[j])``, CSR, int32/int64: a SIGSEGV in
            # ``TrivialIterator::derefImpl``, LLVM 22.1.8); the product is the same two's-complement negation
            return arith.MulIOp(x, arith.ConstantOp(self.elt, -1).result).result
        if isinstance(node, Binary):
            a, b = self.emit(node.lhs), self.emit(node.rhs)
            ops = {"+": (arith.AddFOp, arith.AddIOp), "-": (arith.SubFOp, arith.SubIOp),
                   "*": (arith.MulFOp, arith.MulIOp)}[node.op]
            return ops[0 if self.float else 1](a, b).result
        if isinstance(node, Call):
            return self.call(node)
        raise AssertionError(f"unexpected node {node!r}")

    def _reads_sparse(self, node: Expr) -> bool:
        if isinstance(node, Access):
            return node.tensor in self.sparse
        return any(self._reads_sparse(c) for c in node.children())

    def call(self, node: Call) -> ir.Value:
        args = [self.emit(a) for a in node.args]
        elt = self.elt
        sparse = any(self._reads_sparse(a) for a in node.args)
        if node.func == "abs":
            return math.AbsFOp(args[0]).result if self.float else math.AbsIOp(args[0]).result
        if node.func == "sqrt":
            return math.SqrtOp(args[0]).result
        relu: Callable[[ir.Value], ir.Value] = lambda x: _max(x, _zero(elt), elt)
        if node.func == "max":
            if not sparse:
                return _max(args[0], args[1], elt)
            op = st.BinaryOp(elt, args[0], args[1])
            self._region(op.overlapRegion, 2, lambda x, y: _max(x, y, elt))
            self._region(op.leftRegion, 1, relu)
            self._region(op.rightRegion, 1, relu)
            return op.result
        present = {"relu": relu, "exp": lambda x: math.ExpOp(x).result,
                   "gelu": lambda x: gelu(x, lambda v: arith.ConstantOp(elt, v).result)}[node.func]
        if not sparse:
            return present(args[0])
        op = st.UnaryOp(elt, args[0])
        self._region(op.presentRegion, 1, present)
        if node.func == "exp":  # exp(0) == 1 where the operand is absent
            self._region(op.absentRegion, 0, lambda: arith.ConstantOp(elt, 1.0).result)
        return op.result

    def _region(self, region: ir.Region, arity: int, body: Callable[..., ir.Value]) -> None:
        block = region.blocks.append(*([self.elt] * arity))
        with ir.InsertionPoint(block):
            st.YieldOp([body(*block.arguments)])
