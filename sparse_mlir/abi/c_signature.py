"""The plain C ABI of a compiled kernel, described once for every user of it.

Every kernel library exports ``int32_t NAME(...)`` taking raw pointers and
sizes (no memref descriptors), plus ``void NAME_free(NAME_result*)`` when the
output is sparse.  ``lowering.c_abi`` emits that function from this
description, the runtime packs ctypes arguments from it, and ``export``
writes the C header and the JSON manifest from it, so the three cannot
disagree.

Parameters, in order:

* a sparse input ``X``: for each level buffer ``b`` (``X.format.buffer_names``)
  ``const T* X_b, int64_t X_b_len``, then ``int64_t X_d{k}`` for each
  dimension ``k`` whose size is not compiled in (every one, in a
  shape-generic kernel: ``compiler.emitters``);
* a dense input ``X`` of rank r: ``const T* X, int64_t X_d0 .. X_d{r-1}``
  (C-contiguous, row-major);
* a dense output ``Y``: ``T* Y, int64_t Y_d0 ..`` (zero-filled, then written);
* a sparse output ``Y``: ``NAME_result* Y``, filled with one
  ``(T* data, int64_t len)`` pair per buffer, then the ``malloc``-ed blocks
  ``NAME_free`` releases.

Status: 0 ok, 1 a NULL pointer, 2 a size that disagrees with the kernel's
shapes or with another operand (or is negative, or is not a multiple of a
block of the format), 3 level buffers whose lengths are inconsistent (e.g.
``pos[last] != crd_len``, or positions not ``rows + 1`` long).  Coordinates themselves are not
range-checked in C: pass buffers that a ``SparseTensor`` would accept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.dtypes import index_dtype

# the format JSON is part of the signature JSON; it lives with the formats (tensor files use it too)
from sparse_mlir.formats import Format, format_from_json, format_to_json

__all__ = ["OK", "NULL_POINTER", "SIZE_MISMATCH", "BAD_LEVELS", "RESULT_OVERFLOW", "Param", "OperandABI", "Signature",
           "format_to_json", "format_from_json", "C_TYPES"]

OK, NULL_POINTER, SIZE_MISMATCH, BAD_LEVELS = 0, 1, 2, 3
# a sparse result whose entry count or coordinates do not fit its format's index widths (5: 4 is the C entry
# point's internal error)
RESULT_OVERFLOW = 5
STATUS_TEXT = {NULL_POINTER: "a NULL pointer",
               SIZE_MISMATCH: "a size that disagrees with the kernel's shapes or another operand's",
               BAD_LEVELS: "inconsistent level buffer lengths",
               RESULT_OVERFLOW: "a sparse result too large for its format's index widths"}

C_TYPES = {"float16": "_Float16", "float32": "float", "float64": "double", "int8": "int8_t", "int16": "int16_t",
           "int32": "int32_t", "int64": "int64_t"}


@dataclass(frozen=True)
class Param:
    """One C parameter: ``kind`` is ``data``, ``len``, ``dim`` or ``result``."""

    name: str
    ctype: str
    kind: str
    operand: str
    buffer: str = ""


@dataclass(frozen=True)
class OperandABI:
    """An operand as the C function sees it."""

    name: str
    output: bool
    dtype: np.dtype
    shape: tuple[int | None, ...]  # None: given at run time
    index: tuple[str, ...]  # the index variable of each dimension
    format: Format | None  # None: dense

    @property
    def sparse(self) -> bool:
        return self.format is not None

    @property
    def size_params(self) -> tuple[int, ...]:
        """The dimensions whose size is a C parameter ``NAME_d{k}``: every one of a dense operand, the
        run-time ones of a sparse input, none of a sparse output (its size follows from the inputs)."""
        if not self.sparse:
            return tuple(range(len(self.shape)))
        return () if self.output else tuple(d for d, s in enumerate(self.shape) if s is None)

    def buffers(self) -> list[tuple[str, np.dtype]]:
        """User-visible buffers (N:M positions are implicit) with their dtypes."""
        assert self.format is not None
        out = []
        for name in self.format.buffer_names:
            if name == "values":
                out.append((name, self.dtype))
            else:
                width = self.format.pos_width if name.startswith("pos") else self.format.crd_width
                out.append((name, index_dtype(width)))
        return out

    def params(self, kernel: str) -> list[Param]:
        ctype = C_TYPES[self.dtype.name]
        const = "" if self.output else "const "
        if self.sparse and self.output:
            return [Param(self.name, f"{kernel}_result*", "result", self.name)]
        dims = [Param(f"{self.name}_d{d}", "int64_t", "dim", self.name, str(d)) for d in self.size_params]
        if self.sparse:
            out = []
            for buf, dt in self.buffers():
                out += [Param(f"{self.name}_{buf}", f"const {C_TYPES[dt.name]}*", "data", self.name, buf),
                        Param(f"{self.name}_{buf}_len", "int64_t", "len", self.name, buf)]
            return out + dims
        return [Param(self.name, f"{const}{ctype}*", "data", self.name), *dims]


@dataclass(frozen=True)
class Signature:
    """The C ABI of one specialization: its name and operands (inputs, then the output)."""

    name: str
    expression: str
    operands: tuple[OperandABI, ...]

    @classmethod
    def from_spec(cls, spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                  name: str) -> Signature:
        operands = tuple(OperandABI(t, t == spec.output, spec.output_dtype if t == spec.output else spec.dtype,
                                    tuple(shapes[t]), spec.operand_index(t),
                                    formats.get(t, spec.formats.get(t))) for t in (*spec.inputs, spec.output))
        return cls(name, spec.expression, operands)

    @property
    def inputs(self) -> tuple[OperandABI, ...]:
        return self.operands[:-1]

    @property
    def output(self) -> OperandABI:
        return self.operands[-1]

    def params(self) -> list[Param]:
        return [p for op in self.operands for p in op.params(self.name)]

    def kernel_arguments(self) -> list[tuple[OperandABI, str]]:
        """The compiled function's buffer arguments in order: ``(operand, buffer)``, ``""`` for a dense one.

        Sparse inputs contribute every buffer of their codegen format, N:M
        positions included (the caller supplies those: see ``c_abi`` and the
        GPU runtime); the dense output comes last.
        """
        out: list[tuple[OperandABI, str]] = []
        for op in self.inputs:
            out += [(op, buf) for buf in op.format.codegen_format.buffer_names] if op.sparse else [(op, "")]
        return out if self.output.sparse else [*out, (self.output, "")]

    def result_buffers(self) -> list[tuple[str, np.dtype]]:
        """Buffers of a sparse output, in the order of the result struct."""
        return self.output.buffers() if self.output.sparse else []

    def extents(self) -> dict[str, tuple[int | None, list[tuple[str, int]]]]:
        """Per index variable: its static size (or None) and the (operand, dim) pairs whose size is a
        C parameter (``OperandABI.size_params``), all of which must agree."""
        out: dict[str, tuple[int | None, list[tuple[str, int]]]] = {}
        for op in self.operands:
            given = op.size_params
            for d, idx in enumerate(op.index):
                static, carriers = out.get(idx, (None, []))
                static = op.shape[d] if op.shape[d] is not None else static
                if d in given:
                    carriers = carriers + [(op.name, d)]
                out[idx] = (static, carriers)
        return out

    @property
    def shape_generic(self) -> bool:
        """Whether a sparse input's size is a run-time parameter (the kernel takes every size)."""
        return any(op.size_params for op in self.inputs if op.sparse)

    # -- manifest ----------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "expression": self.expression, "operands": [
            {"name": op.name, "output": op.output, "dtype": op.dtype.name, "shape": list(op.shape),
             "index": list(op.index), "format": format_to_json(op.format) if op.format else None}
            for op in self.operands]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Signature:
        ops = tuple(OperandABI(o["name"], o["output"], np.dtype(o["dtype"]), tuple(o["shape"]), tuple(o["index"]),
                               format_from_json(o["format"]) if o["format"] else None) for o in data["operands"])
        return cls(data["name"], data["expression"], ops)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

