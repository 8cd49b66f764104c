"""The one kernel protocol: every kind of kernel is called and inspected the same way.

``sm.compile`` returns a ``CpuKernel``, ``AutoKernel`` or ``CudaKernel``;
``sm.load_kernel`` a ``LoadedKernel`` or ``LoadedCudaKernel``.  Each one

* is called with keyword operands and an optional ``out=``;
* has ``.signature`` (how its most recent specialization, or its export, is
  called: operands, dtypes, shapes, index widths) and ``.ir`` (the IR of every
  stage, ``input``, ``sparsified``, ``mapped``, ``llvm``, on every target);
* compiles without running with ``.specialize(shapes)`` (an exported kernel is
  already specialized: it checks the shapes against its export);
* counts what it did in ``.stats``;
* says with ``.shape_generic`` whether one build serves every size.

The CLI and the tests talk to this protocol, never to a class.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.errors import NotCompiledError, ShapeError
from sparse_mlir.tensor.storage import check_shape

__all__ = ["Kernel", "operand_table", "extent_sources", "check_shapes_given"]


class Kernel(abc.ABC):
    """What every kernel offers; subclasses implement the four abstract members."""

    target: str
    # the C-level call of the most recent specialization (``runtime.fast_call``): ``kernel_call`` tries it first,
    # and it returns ``NotImplemented`` for any call it does not cover
    _native_fast: Any = None

    @abc.abstractmethod
    def __call__(self, out: Any = None, **operands: Any) -> Any:
        """Run on keyword operands; ``out=`` receives a dense result in place."""

    @property
    @abc.abstractmethod
    def signature(self) -> Signature:
        """How the most recent specialization (or the export) is called; ``NotCompiledError`` before any."""

    @property
    @abc.abstractmethod
    def ir(self) -> dict[str, str]:
        """The IR of every stage of the most recent specialization; ``NotCompiledError`` before any."""

    @abc.abstractmethod
    def specialize(self, shapes: Mapping[str, tuple[int, ...]]) -> Kernel:
        """Compile (or load) the specialization for these operand shapes without running it; returns ``self``."""

    @property
    def shape_generic(self) -> bool:
        """Whether one build takes every operand size at run time (else one build per sparse shape)."""
        return False

    @property
    def stats(self) -> dict[str, int]:
        """Counts of what this kernel did: ``specializations`` (compiled or read from the disk cache),
        ``compiled`` (by this process), ``densified`` (compiled on dense copies of its sparse inputs)."""
        return dict(self._stats)

    def __init__(self) -> None:
        self._stats = {"specializations": 0, "compiled": 0, "densified": 0}

    def _count(self, artifact: Any) -> None:
        """Record one artifact the driver handed over (``compiler.driver.Artifact``)."""
        self._stats["specializations"] += 1
        self._stats["compiled"] += artifact.compiled
        self._stats["densified"] += artifact.densified


def not_compiled(kernel: Kernel) -> NotCompiledError:
    """The error for asking a kernel that has not been specialized for what only a specialization has."""
    return NotCompiledError(f"{kernel!r} has not been specialized yet: call it or use .specialize(shapes) first")


def operand_table(spec: Any) -> tuple[tuple[str, Any, int], ...]:
    """``(name, declared format or None, rank)`` of each input: what every call checks its operands against."""
    return tuple((n, spec.formats.get(n), spec.ranks[n]) for n in spec.inputs)


def extent_sources(signature_inputs: Any) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """For each index, the ``(operand, dimension)`` places that give its size, from a signature's inputs."""
    places: dict[str, list[tuple[str, int]]] = {}
    for op in signature_inputs:
        for d, idx in enumerate(op.index):
            places.setdefault(idx, []).append((op.name, d))
    return tuple((idx, tuple(p)) for idx, p in places.items())


def check_shapes_given(spec: Any, shapes: Mapping[str, tuple[int, ...]], needed: tuple[str, ...]
                       ) -> dict[str, tuple[int, ...]]:
    """``shapes`` as int tuples, checked: no unknown operand, ranks right, sparse shapes fit their formats,
    every name in ``needed`` present (``ShapeError`` naming what is wrong)."""
    if not isinstance(shapes, Mapping):
        raise ShapeError(f"shapes must map operand names to shapes, got {type(shapes).__name__}")
    if unknown := sorted(set(shapes) - set(spec.inputs) - {spec.output}):
        raise ShapeError(f"shapes names {', '.join(map(repr, unknown))}, which is not an operand of "
                         f"{spec.expression!r}")
    if missing := [n for n in needed if n not in shapes]:
        raise ShapeError(f"give shapes for {', '.join(missing)}")
    checked = {}
    for name, shape in shapes.items():
        shape = check_shape(shape)  # integers (4.7 was truncated to 4, -1 and True taken), below 2**63
        if len(shape) != spec.ranks[name]:
            raise ShapeError(f"{name} has {spec.ranks[name]} dimensions, but its shape is {shape}")
        if spec.is_sparse(name):
            spec.formats[name].check_shape(shape)
        checked[name] = shape
    return checked
