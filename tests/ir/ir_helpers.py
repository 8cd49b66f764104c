"""What the IR tests share: small planned kernels, their shapes, and what a built module holds."""

from __future__ import annotations

from collections import Counter

from mlir import ir

from sparse_mlir.dsl.plan import KernelSpec, plan

Shapes = dict[str, tuple[int | None, ...]]


def planned(expression: str, formats: dict | None = None, dtype: str = "float32", out_dtype: str | None = None
            ) -> KernelSpec:
    return plan(expression, formats or {}, dtype, out_dtype)


def cpu_shapes(spec: KernelSpec, extents: dict[str, int]) -> Shapes:
    """What the CPU build gets: static sizes where a sparse operand fixes the index, else ``None``."""
    return spec.specialized_shapes(extents)


def static_shapes(spec: KernelSpec, extents: dict[str, int]) -> Shapes:
    """What the CUDA build gets: every size static."""
    return {name: tuple(extents[i] for i in spec.operand_index(name)) for name in (*spec.inputs, spec.output)}


def op_counts(module: ir.Module) -> Counter[str]:
    """How many operations of each name ``module`` holds, nested ones included."""
    counts: Counter[str] = Counter()

    def visit(op: ir.Operation) -> ir.WalkResult:
        counts[op.name] += 1
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return counts


def functions(module: ir.Module) -> dict[str, ir.Operation]:
    """The ``func.func`` and ``gpu.func`` operations of ``module``, by symbol name."""
    found: dict[str, ir.Operation] = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("func.func", "gpu.func"):
            found[ir.StringAttr(op.attributes["sym_name"]).value] = op
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def verified(module: ir.Module) -> ir.Module:
    """``module`` after checking that the verifier accepts it (and that it is a module at all)."""
    assert module is not None
    assert module.operation.verify()
    return module
