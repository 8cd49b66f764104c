"""Op-builder helpers shared by the hand-scheduled GPU kernels of other formats (``gpu_formats``, ``gpu_reduce``).

Why a module of its own: those kernels are built with the MLIR Python
bindings' op builders (not parsed text), and they all need the same few
pieces: a ``gpu.module`` to put ``gpu.func``s in, the global thread index,
index loads from level buffers of any width, binary searches over sorted
coordinates or positions, and ``scf.for`` sums.  Every helper inserts at the
current insertion point and location.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import arith, gpu, math, memref, scf
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.native.loops import bisect, level_types

from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = [
    "BLOCK",
    "WARP",
    "KernelModule",
    "accumulator",
    "add",
    "as_float",
    "atomic_add",
    "bisect",
    "buffer_refs",
    "const",
    "dense_type",
    "element_type",
    "float_type",
    "fma",
    "global_thread",
    "index_type",
    "level_buffer_types",
    "load_index",
    "mul",
    "row_bounds",
    "search",
    "sum_range",
    "when",
    "zero",
]

BLOCK = 128  # threads per block, as the other GPU kernels
WARP = 32


def index_type() -> ir.Type:
    return ir.IndexType.get()


def const(value: int) -> ir.Value:
    """An ``index`` constant."""
    return arith.constant(index_type(), value)


def float_type(name: str) -> ir.Type:
    """``f32`` or ``f64`` from its MLIR spelling."""
    return {"f32": ir.F32Type.get, "f64": ir.F64Type.get, "f16": ir.F16Type.get}[name]()


def element_type(spec: KernelSpec) -> ir.Type | None:
    """The data's MLIR type, or ``None`` (no kernel here) unless float32, float64, int32 or int64 with no
    ``out_dtype``.

    float16 needs float32 sums (the CSR kernels do that); these kernels sum
    in the data's own type (integers wrap, as on the CPU).
    """
    name = TYPE_NAMES.get(spec.dtype.name)
    if name not in ("f32", "f64", "i32", "i64") or spec.output_dtype != spec.dtype:
        return None
    return float_type(name) if name.startswith("f") else ir.IntegerType.get_signless(int(name[1:]))


def _is_float(value_or_type: ir.Value | ir.Type) -> bool:
    kind = value_or_type.type if isinstance(value_or_type, ir.Value) else value_or_type
    return not isinstance(kind, ir.IntegerType)


def zero(elt: ir.Type) -> ir.Value:
    """0 of the data's type."""
    return arith.constant(elt, 0.0 if _is_float(elt) else 0)


def add(a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.addf(a, b) if _is_float(a) else arith.addi(a, b)


def mul(a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.mulf(a, b) if _is_float(a) else arith.muli(a, b)


def fma(a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c``: one fused ``math.fma`` for floats (as the CSR kernels), multiply and add for integers."""
    return math.fma(a, b, c) if _is_float(a) else arith.addi(arith.muli(a, b), c)


def atomic_add(value: ir.Value, target: ir.Value, indices: Sequence[ir.Value]) -> None:
    """``target[indices] += value`` atomically (``addf`` or ``addi``)."""
    kind = arith.AtomicRMWKind.addf if _is_float(value) else arith.AtomicRMWKind.addi
    memref.atomic_rmw(kind, value, target, list(indices))


def accumulator(elt: ir.Type) -> ir.Type:
    """The type float sums are kept in: float16 data is summed in float32 (the CSR SpMV and SpMM)."""
    return ir.F32Type.get() if isinstance(elt, ir.F16Type) else elt


def as_float(value: ir.Value, target: ir.Type) -> ir.Value:
    """A float ``value`` (scalar or vector) widened or narrowed to ``target`` (unchanged if it is that type)."""
    if value.type == target:
        return value

    def width(kind: ir.Type) -> int:
        return ir.FloatType(ir.VectorType(kind).element_type if isinstance(kind, ir.VectorType) else kind).width

    return arith.extf(target, value) if width(target) > width(value.type) else arith.truncf(target, value)


def row_bounds(pos: ir.Value, row: ir.Value, valid: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """``(row or 0, start, end)`` of ``row``'s entries in a CSR ``pos``; start and end are 0 (nothing to sum)
    when ``valid`` is false (a thread past the last row reads row 0's bounds, never beyond ``pos``)."""
    safe = arith.select(valid, row, const(0))
    start = arith.select(valid, load_index(pos, safe), const(0))
    end = arith.select(valid, load_index(pos, arith.addi(safe, const(1))), const(0))
    return safe, start, end


def level_buffer_types(fmt: Format, elt: ir.Type) -> list[ir.Type]:
    """The ``memref<?x...>`` of each buffer of ``fmt``'s codegen format (N:M positions included), in order."""
    with ir.Location.unknown():
        return level_types(fmt, elt)


def dense_type(shape: Sequence[int | None], elt: ir.Type) -> ir.Type:
    """``memref<AxBxT>``; a ``None`` size (a shape-generic kernel's) is dynamic."""
    return ir.MemRefType.get([ir.ShapedType.get_dynamic_size() if s is None else s for s in shape], elt,
                             loc=ir.Location.unknown())


def buffer_refs(spec: KernelSpec, formats: dict[str, Format]) -> dict[str, int]:
    """Each operand's first position in ``Signature.kernel_arguments()``: a sparse input has one per buffer."""
    refs: dict[str, int] = {}
    position = 0
    for name in (*spec.inputs, *(() if spec.sparse_output else (spec.output,))):
        refs[name] = position
        position += len(formats[name].codegen_format.buffer_names) if name in formats else 1
    return refs


class KernelModule:
    """A ``module { gpu.module @kernels { ... } }`` that ``gpu.func``s are added to."""

    def __init__(self, module: ir.Module | None = None) -> None:
        """A new module, or ``module`` (one ``gpu.module`` first, as the other GPU emitters make) to add to."""
        if module is None:
            with ir.Location.unknown():
                module = ir.Module.create()
                module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
                with ir.InsertionPoint(module.body):
                    gpu.GPUModuleOp("kernels").bodyRegion.blocks.append()
        self.module = module
        self._body = self.module.body.operations[0].regions[0].blocks[0]

    def kernel(self, name: str, params: Sequence[ir.Type], build: Callable[..., None]) -> None:
        """Add kernel ``name``; ``build(*arguments)`` emits its body (``gpu.return`` is added after it)."""
        with ir.InsertionPoint(self._body), ir.Location.unknown():
            func = gpu.GPUFuncOp(ir.TypeAttr.get(ir.FunctionType.get(list(params), [])), sym_name=name, kernel=True)
            block = func.body.blocks.append(*params)
        with ir.InsertionPoint(block), ir.Location.unknown():
            build(*block.arguments)
            gpu.ReturnOp([])


def global_thread() -> ir.Value:
    """``block_id.x * block_dim.x + thread_id.x``."""
    return arith.addi(arith.muli(gpu.block_id(gpu.Dimension.x), gpu.block_dim(gpu.Dimension.x)),
                      gpu.thread_id(gpu.Dimension.x))


def load_index(buffer: ir.Value, at: ir.Value) -> ir.Value:
    """``buffer[at]`` (an integer level buffer of any width, unsigned) as an ``index``."""
    value = memref.load(buffer, [at])
    return value if isinstance(value.type, ir.IndexType) else arith.index_castui(index_type(), value)


def when(condition: ir.Value) -> ir.InsertionPoint:
    """An insertion point in the then-block of a new ``scf.if condition`` (the block ends in its yield)."""
    branch = scf.IfOp(condition)
    with ir.InsertionPoint(branch.then_block):
        scf.YieldOp([])
    return ir.InsertionPoint.at_block_terminator(branch.then_block)


def search(buffer: ir.Value, lo: ir.Value, hi: ir.Value, key: ir.Value, above: bool) -> ir.Value:
    """The first ``k`` in ``[lo, hi)`` with ``buffer[k] > key`` (``above``) or ``>= key``, else ``hi``.

    ``buffer`` is sorted over ``[lo, hi)`` (coordinates of a row-sorted COO,
    positions).  A binary search: ``log2(hi - lo)`` dependent loads.
    """
    predicate = arith.CmpIPredicate.ule if above else arith.CmpIPredicate.ult
    return bisect(lo, hi, lambda mid: arith.cmpi(predicate, load_index(buffer, mid), key))


def sum_range(lo: ir.Value, hi: ir.Value, step: ir.Value, zero: ir.Value,
              term: Callable[[ir.Value], ir.Value | tuple[ir.Value, ir.Value]]) -> ir.Value:
    """``sum over k in range(lo, hi, step)`` of ``term(k)``: a value, or a pair ``(a, b)`` added as ``fma(a, b, acc)``."""
    loop = scf.ForOp(lo, hi, step, [zero])
    with ir.InsertionPoint(loop.body):
        k, acc = loop.induction_variable, loop.inner_iter_args[0]
        value = term(k)
        total = fma(value[0], value[1], acc) if isinstance(value, tuple) else add(acc, value)
        scf.YieldOp([total])
    return loop.results[0]
