"""What a compiled GPU kernel is once MLIR is done: PTX per chip plus the launches to make.

A ``GpuProgram`` is the GPU counterpart of a CPU library's C entry point.
The compiler fills it in (``lowering.gpu``); the runtime (``runtime.cuda``),
the cache and ``export`` read it without MLIR.  Every launch is described by
data, not code:

* ``grid`` and ``block``: three sizes each, or for the grid a ``GridRule``
  (blocks = ceil(count / per_block)) where the count is only known at run
  time (a sparse operand's number of stored entries, or in a shape-generic
  program a dimension of an operand: a grid may mix constants and rules per
  axis), or a ``LaneRule`` (threads per row from the mean row length);
  a launch with ``only_if`` tests (``SizeTest``) runs only for the sizes
  that pass them: a shape-generic program's variants of one kernel;
* ``args``: one ``KernelArg`` per parameter of the outlined ``gpu.func``,
  each a buffer of the kernel function (``Signature.kernel_arguments()``
  order), a scratch buffer the runtime allocates per call, a constant, or
  a buffer of a sparse result (``result``: the SDDMM's values; the result's
  other buffers are copies, ``GpuProgram.result_like``).

A memref parameter is passed as MLIR's expanded descriptor (allocated and
aligned pointer, offset, sizes, strides: ``3 + 2 * rank`` 64-bit words);
``ParamPacker`` produces exactly the PTX entry's parameter list from it.
A shape-generic program (``compiler.driver.shape_generic``) has no size
compiled in: its buffers' sizes are ``None`` in ``KernelArg.shape``, filled
at launch from the operands' shapes, and its kernels read them from the
descriptors (``memref.dim``); so one PTX serves every size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["KernelArg", "GridRule", "SizeOf", "SizeTest", "LaneRule", "Launch", "GpuProgram", "ParamPacker", "TensorMapGeometry",
           "descriptor_words", "is_skewed", "CHIPS"]

CHIPS = ("sm_80", "sm_90")


@dataclass(frozen=True)
class KernelArg:
    """One ``gpu.func`` parameter: ``kind`` is ``buffer``, ``scratch``, ``index``, ``lanes`` (``LaneRule``),
    ``tensormap`` or ``result``.

    ``ref`` is the position in ``Signature.kernel_arguments()`` (buffer,
    tensormap), in ``GpuProgram.scratch`` (scratch), in the sparse result's
    ``Signature.result_buffers()`` (result), or the constant's value
    (index).  ``shape`` is the memref's static shape, ``None`` for a size
    taken from the buffer at run time.  A ``tensormap`` is a pointer to a TMA
    descriptor (``CUtensorMap``) of buffer ``ref`` that the launcher encodes:
    its ``shape`` is ``TensorMapGeometry`` (a row-major 2-d view of the
    buffer and the box one load copies).
    """

    kind: str
    ref: int
    shape: tuple[int | None, ...] = ()


class SizeOf(NamedTuple):
    """A size known only at launch: dimension ``dim`` of kernel argument ``ref`` (a shape-generic program's
    scratch buffer sizes, e.g. the Linear layer's ``X^T``)."""

    ref: int
    dim: int


@dataclass(frozen=True)
class GridRule:
    """``ceil(count / per_block)`` blocks (at least one), ``count`` known only at launch: the stored entries of
    kernel argument ``ref`` (``dim`` is ``None``), or the size of its dimension ``dim``."""

    ref: int
    per_block: int
    dim: int | None = None

    def __post_init__(self) -> None:  # a malformed manifest is refused when it loads (runtime.artifact)
        if not isinstance(self.per_block, int) or self.per_block < 1:
            raise ValueError(f"grid rule per_block must be a positive integer, got {self.per_block!r}")

    def count(self, lengths: list[Any], shapes: list[tuple[Any, ...]] | None = None) -> Any:
        """The count, given each kernel argument's entries and (for ``dim``) sizes."""
        if self.dim is None:
            return lengths[self.ref]
        assert shapes is not None, "a grid over a dimension needs the operands' shapes"
        return shapes[self.ref][self.dim]

    def blocks(self, count: int) -> int:
        return max(1, math.ceil(count / self.per_block))

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.ref, "per_block": self.per_block, **({} if self.dim is None else {"dim": self.dim})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GridRule:
        return cls(data["ref"], data["per_block"], data.get("dim"))


@dataclass(frozen=True)
class SizeTest:
    """A condition on a size known only at launch: dimension ``dim`` of kernel argument ``ref`` is a ``multiple``
    of ``value``, ``not_multiple`` of it, ``below`` it or ``at_least`` it.

    A shape-generic program holds one variant of a kernel per tiling its
    sizes may call for (the SpMM's vector width and vectors per lane); each
    variant's launch carries the tests that pick it, and exactly one runs.
    """

    ref: int
    dim: int
    kind: str
    value: int

    KINDS = ("multiple", "not_multiple", "below", "at_least")

    def __post_init__(self) -> None:  # a malformed manifest is refused when it loads (runtime.artifact)
        if self.kind not in self.KINDS or not isinstance(self.value, int) or self.value < 1:
            raise ValueError(f"size test {self.kind!r} {self.value!r}: the kinds are {', '.join(self.KINDS)}, "
                             f"over a positive integer")

    def holds(self, size: int) -> bool:
        return {"multiple": size % self.value == 0, "not_multiple": size % self.value != 0,
                "below": size < self.value, "at_least": size >= self.value}[self.kind]

    def c_condition(self, size: str) -> str:
        """The test in C over the expression ``size`` (the launcher's)."""
        return {"multiple": f"({size}) % {self.value} == 0", "not_multiple": f"({size}) % {self.value} != 0",
                "below": f"({size}) < {self.value}", "at_least": f"({size}) >= {self.value}"}[self.kind]


@dataclass(frozen=True)
class LaneRule:
    """Threads per row, picked at launch: the power of two at or above half the mean row length, 1 to 32.

    Half: each thread then sums about two entries before the shuffles, which
    measured 10% faster than one (H200, 50M nonzeros, 25 per row).

    ``ref`` is the kernel argument whose length is the number of stored
    entries (known on the host without reading the device), ``rows`` the
    number of rows, or ``None`` in a shape-generic program: then the rows
    are the length of kernel argument ``rows_of`` (the SpMV's ``y``).
    Arguments of kind ``lanes`` receive the value, and the grid covers
    ``rows * lanes`` threads.
    """

    ref: int
    rows: int | None
    rows_of: int | None = None

    def row_count(self, lengths: list[Any]) -> Any:
        """The rows, given each kernel argument's entries."""
        if self.rows is not None:
            return self.rows
        assert self.rows_of is not None, "a LaneRule needs its rows or the argument that has them"
        return lengths[self.rows_of]

    def lanes(self, entries: int, rows: int | None = None) -> int:
        rows = self.rows if rows is None else rows
        assert rows is not None, "the rows of a shape-generic LaneRule come from the call"
        mean = entries / max(rows, 1) / 2
        lanes = 1
        while lanes < 32 and lanes < mean:
            lanes *= 2
        return lanes


@dataclass(frozen=True)
class Launch:
    """One kernel launch, in the order the program runs them (all on one stream)."""

    kernel: str
    grid: tuple[int | GridRule, int | GridRule, int | GridRule] | GridRule
    block: tuple[int, int, int]
    args: tuple[KernelArg, ...]
    shared_bytes: int = 0
    lanes: LaneRule | None = None
    aligned: tuple[int, ...] = ()  # kernel arguments accessed with 16-byte vectors: their pointers must be aligned
    when: str = ""  # "", or "skewed" / "balanced": run only when the sparse operand's rows are (not) skewed
    # needs no zeroed output: stores every element of it, or (an earlier stage) does not write it at all
    fills_output: bool = False
    # the chips whose code holds this kernel ("" / empty: every chip); a chip runs the launches made for it
    chips: tuple[str, ...] = ()
    # fills its scratch arguments from a sparse operand's level buffers alone (the 2:4 wgmma metadata): a runtime
    # may keep them with the operand and skip the launch while the operand's buffers are the same
    derives: bool = False
    # runs only when every test holds (one variant among several of a shape-generic program)
    only_if: tuple[SizeTest, ...] = ()

    def runs(self, skewed: bool) -> bool:
        return not self.when or (self.when == "skewed") == skewed

    def fits(self, shapes: list[tuple[int, ...]] | None) -> bool:
        """Whether the sizes of this call (each kernel argument's shape) pass every ``only_if`` test."""
        if not self.only_if:
            return True
        assert shapes is not None, "a launch with size tests needs the call's shapes"
        return all(test.holds(shapes[test.ref][test.dim]) for test in self.only_if)

    def on(self, chip: str) -> bool:
        """Whether this launch is part of the program when it runs from ``chip``'s code."""
        return not self.chips or chip in self.chips

    def grid_for(self, lengths: list[int], shapes: list[tuple[int, ...]] | None = None) -> tuple[int, int, int]:
        """The grid given each kernel argument's length (entries) and, for rules over a dimension, its sizes."""
        if self.lanes is not None:
            rows = self.lanes.row_count(lengths)
            threads = rows * self.lanes.lanes(lengths[self.lanes.ref], rows)
            return (max(1, math.ceil(threads / self.block[0])), 1, 1)
        grid = (self.grid, 1, 1) if isinstance(self.grid, GridRule) else self.grid
        x, y, z = (g.blocks(g.count(lengths, shapes)) if isinstance(g, GridRule) else g for g in grid)
        return (x, y, z)

    def param_count(self) -> int:
        memrefs = ("buffer", "scratch", "result")
        return sum(descriptor_words(len(a.shape)) if a.kind in memrefs else 1 for a in self.args)


class TensorMapGeometry(NamedTuple):
    """A ``tensormap`` argument's shape: the buffer as ``outer x inner`` elements and the box of one TMA load."""

    inner: int  # elements per row (contiguous)
    outer: int  # rows
    box_inner: int
    box_outer: int
    swizzle: int  # bytes: 0, 32, 64 or 128
    element_bytes: int


def is_skewed(longest_row: int | None, entries: int, rows: int) -> bool:
    """Rows so uneven that one group of threads per row would leave most of the GPU waiting on a few rows.

    ``longest_row`` is ``None`` when unknown (then: not skewed).
    """
    return longest_row is not None and longest_row >= SKEWED_ROW and longest_row > 32 * entries / max(rows, 1)


SKEWED_ROW = 4096  # a row this long keeps one warp busy for 128 steps while short rows finish in one


@dataclass(frozen=True)
class GpuProgram:
    """PTX for each chip, the launches, and the scratch buffers ``(shape, dtype)`` a call needs (a size of a
    shape-generic program's scratch is a ``SizeOf``: ``scratch_shapes`` gives them for a call)."""

    module: str  # the name every launch's kernel lives in (for diagnostics)
    ptx: dict[str, str]
    launches: tuple[Launch, ...]
    scratch: tuple[tuple[tuple[int, ...], str], ...] = ()
    notes: tuple[str, ...] = field(default=())  # how the kernel was mapped (e.g. "serial": one thread)
    # a sparse result's buffers, in its format's order: each has the length and dtype of this kernel argument, and
    # is a copy of it (made on the device before the launches) unless a launch writes it (a ``result`` argument).
    # Empty: a dense result.  (The SDDMM's C takes S's positions and coordinates; its values are new.)
    result_like: tuple[int, ...] = ()

    def result_written(self) -> set[int]:
        """The sparse result's buffers that the launches write (the others are copies: ``result_like``)."""
        return {arg.ref for launch in self.launches for arg in launch.args if arg.kind == "result"}

    def to_json(self, include_ptx: bool = True) -> dict[str, Any]:
        def grid(g: Any) -> Any:
            if isinstance(g, GridRule):
                return g.to_json()
            return [a.to_json() if isinstance(a, GridRule) else a for a in g]

        def lanes(rule: LaneRule | None) -> Any:
            if rule is None:
                return None
            return [rule.ref, rule.rows] + ([] if rule.rows_of is None else [rule.rows_of])

        data: dict[str, Any] = {"module": self.module, "notes": list(self.notes), "result_like": list(self.result_like),
                                "scratch": [[[{"ref": n.ref, "dim": n.dim} if isinstance(n, SizeOf) else n
                                              for n in shape], d] for shape, d in self.scratch],
                                "launches": [{"kernel": k.kernel, "grid": grid(k.grid), "block": list(k.block),
                                              "shared_bytes": k.shared_bytes,
                                              "lanes": lanes(k.lanes),
                                              "aligned": list(k.aligned), "when": k.when,
                                              "fills_output": k.fills_output, "chips": list(k.chips),
                                              "derives": k.derives,
                                              "only_if": [[t.ref, t.dim, t.kind, t.value] for t in k.only_if],
                                              "args": [[a.kind, a.ref, list(a.shape)] for a in k.args]}
                                             for k in self.launches]}
        if include_ptx:
            data["ptx"] = self.ptx
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], ptx: dict[str, str] | None = None) -> GpuProgram:
        def grid(g: Any) -> Any:
            if isinstance(g, dict):
                return GridRule.from_json(g)
            return tuple(GridRule.from_json(a) if isinstance(a, dict) else a for a in g)

        launches = tuple(Launch(k["kernel"], grid(k["grid"]), tuple(k["block"]),
                                tuple(KernelArg(kind, ref, tuple(shape)) for kind, ref, shape in k["args"]),
                                k.get("shared_bytes", 0), LaneRule(*k["lanes"]) if k.get("lanes") else None,
                                tuple(k.get("aligned", ())), k.get("when", ""), k.get("fills_output", False),
                                tuple(k.get("chips", ())), bool(k.get("derives", False)),
                                tuple(SizeTest(*t) for t in k.get("only_if", ())))
                         for k in data["launches"])
        return cls(data["module"], ptx if ptx is not None else data["ptx"], launches,
                   tuple((tuple(SizeOf(n["ref"], n["dim"]) if isinstance(n, dict) else n for n in shape), d)
                         for shape, d in data["scratch"]), tuple(data.get("notes", ())),
                   tuple(data.get("result_like", ())))

    def scratch_shapes(self, shapes: list[tuple[Any, ...]] | None = None) -> list[tuple[Any, ...]]:
        """Each scratch buffer's shape at a call whose kernel arguments have ``shapes`` (numbers, or the C
        launcher's names)."""
        def size(n: Any) -> Any:
            if not isinstance(n, SizeOf):
                return n
            assert shapes is not None, "a scratch size taken from an operand needs the call's shapes"
            return shapes[n.ref][n.dim]

        return [tuple(size(n) for n in shape) for shape, _ in self.scratch]

    def needs_zeroed_output(self, skewed: bool | None = None) -> bool:
        """Whether the launches that run (all of them when ``skewed`` is ``None``) need a zeroed output first.

        Hand-scheduled kernels store every output element; sparsified ones
        and atomic row sums accumulate into it.
        """
        return not all(k.fills_output for k in self.launches if skewed is None or k.runs(skewed))

    def dumps(self) -> str:
        return json.dumps(self.to_json())


def descriptor_words(rank: int) -> int:
    """64-bit words of an expanded memref descriptor: two pointers, offset, sizes, strides."""
    return 3 + 2 * rank


class ParamPacker:
    """A launch's parameters as 64-bit words, given ``(device pointer, entries)`` per kernel argument.

    Static sizes come from the manifest; a dynamic size is the buffer's
    actual length (a 1-d buffer: a sparse level, or a dense vector of a
    shape-generic program) or, for a buffer of higher rank, the operand's
    size at the call (``shapes``).  Strides are row-major.  Every word that
    does not depend on the call is computed once, at construction.  The C
    launcher packs with C expressions in place of the numbers
    (``export.cuda_header``): sizes and strides then come out as products of names.
    """

    def __init__(self, launch: Launch):
        self.lanes = launch.lanes
        # per argument: (kind, ref, words after the two pointers, or None when the size comes from the buffer,
        # or the shape with None at each size the call gives)
        self.items: list[tuple[str, int, list[int] | None, tuple[int | None, ...]]] = []
        for arg in launch.args:
            if arg.kind in ("index", "lanes"):
                self.items.append((arg.kind, arg.ref, None, ()))
                continue
            if arg.kind == "tensormap":
                self.items.append((arg.kind, arg.ref, list(arg.shape), ()))
                continue
            shape = arg.shape
            if all(s is not None for s in shape):
                sizes = list(shape)
                self.items.append((arg.kind, arg.ref, [0, *sizes, *_strides(sizes)], ()))
            else:
                self.items.append((arg.kind, arg.ref, None, shape))

    def __call__(self, buffers: list[tuple[Any, Any]], scratch: list[Any], lanes: Any = None,
                 tensor_map: Any = None, shapes: list[tuple[Any, ...]] | None = None,
                 scratch_shapes: list[tuple[Any, ...]] | None = None,
                 results: list[tuple[Any, Any]] | None = None) -> list[Any]:
        """The words; ``lanes`` overrides the lane rule's value (the C launcher passes names, not numbers).

        ``tensor_map(pointer, geometry)`` gives the device address of the TMA
        descriptor of a ``tensormap`` argument; ``shapes`` each kernel
        argument's sizes at this call (needed for a run-time size of a buffer
        of rank 2 or more), ``scratch_shapes`` each scratch buffer's
        (``GpuProgram.scratch_shapes``, for a scratch size taken from an operand); ``results`` the sparse
        result's buffers as ``(device pointer, entries)`` (1-d, like ``buffers``).
        """
        words: list[Any] = []
        for kind, ref, tail, dynamic in self.items:
            if kind == "index":
                words.append(ref)
            elif kind == "tensormap":
                assert tensor_map is not None, "a tensormap argument needs the launcher's descriptor maker"
                words.append(tensor_map(buffers[ref][0], TensorMapGeometry(*tail)))
            elif kind == "lanes":
                assert self.lanes is not None, "a lanes argument needs the launch's LaneRule"
                lengths = [length for _, length in buffers]
                words.append(lanes if lanes is not None else
                             self.lanes.lanes(buffers[self.lanes.ref][1], self.lanes.row_count(lengths)))
            else:
                if kind == "result":
                    assert results is not None, "a result argument needs the sparse result's buffers"
                    ptr, length = results[ref]
                else:
                    ptr, length = buffers[ref] if kind == "buffer" else (scratch[ref], 0)
                if tail is None and kind in ("buffer", "result") and len(dynamic) == 1:
                    tail = [0, length, 1]
                elif tail is None:
                    given = shapes if kind == "buffer" else scratch_shapes
                    assert given is not None, "a run-time size of a buffer of rank 2 or more needs the call's shapes"
                    sizes = [size if static is None else static for static, size in zip(dynamic, given[ref])]
                    tail = [0, *sizes, *_strides(sizes)]
                words += [ptr, ptr, *tail]
        return words


def _strides(sizes: list[Any]) -> list[Any]:
    """Row-major strides of ``sizes``: numbers, or C products when a size is a C expression."""
    strides: list[Any] = []
    step: Any = 1
    for size in reversed(sizes):
        strides.insert(0, step)
        if isinstance(step, int) and isinstance(size, int):
            step *= size
        else:
            step = size if step == 1 else f"({step}) * ({size})"
    return strides
