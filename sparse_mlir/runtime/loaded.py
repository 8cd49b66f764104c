"""Kernels loaded from an export (``load_kernel``): the export's shapes (fixed, or run-time ones), run without MLIR.

``LoadedKernel`` runs a CPU export's library on numpy operands,
``LoadedCudaKernel`` a GPU export's PTX/cubin on CuPy operands.  Both follow
the ``Kernel`` protocol; their ``.ir`` is what the export folder keeps (the
``input`` stage, ``NAME.mlir``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.abi.gpu_program import GpuProgram
from sparse_mlir.errors import OperandError, ShapeError
from sparse_mlir.runtime import fast_call
from sparse_mlir.runtime.calls import kernel_call
from sparse_mlir.runtime.device_operands import checked_device_output, device_operands
from sparse_mlir.runtime.kernel import Kernel, extent_sources
from sparse_mlir.runtime.launch import GpuFunction
from sparse_mlir.runtime.library import NativeFunction
from sparse_mlir.runtime.operands import check_extents, dense_output, prepare

__all__ = ["LoadedKernel", "LoadedCudaKernel"]


class _Exported(Kernel):
    """What both loaded kinds share: the manifest, its signature, the export folder."""

    def __init__(self, manifest: dict[str, Any], folder: Path):
        super().__init__()
        self.manifest = manifest
        self.folder = folder
        self._signature = Signature.from_json(manifest["signature"])
        self._inputs = tuple((op.name, op.format, len(op.shape)) for op in self._signature.inputs)

    @property
    def signature(self) -> Signature:
        return self._signature

    @property
    def ir(self) -> dict[str, str]:
        """The stages the export folder keeps: ``input`` (``NAME.mlir``), when it is there."""
        source = self.folder / f"{self._signature.name}.mlir"
        return {"input": source.read_text()} if source.is_file() else {}

    def specialize(self, shapes: Mapping[str, tuple[int, ...]]) -> _Exported:
        """An export is specialized already: check that ``shapes`` are ones it takes (``ShapeError`` if not)."""
        by_name = {op.name: op for op in self._signature.operands}
        for name, shape in shapes.items():
            if name not in by_name:
                raise ShapeError(f"shapes names {name!r}, which is not an operand of {self._signature.name}")
            self._check_shape(name, by_name[name].shape, tuple(shape))
        return self

    def _check_shape(self, name: str, exported: tuple[int | None, ...], got: tuple[int, ...]) -> None:
        if len(exported) != len(got) or any(s is not None and s != g for s, g in zip(exported, got)):
            raise ShapeError(f"{self._signature.name} was exported for {name} of shape "
                             f"{tuple('?' if s is None else s for s in exported)}, got {got}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._signature.name!r}: {self._signature.expression!r})"


class LoadedKernel(_Exported):
    """An exported CPU kernel: keyword numpy / SparseTensor operands, as for ``sm.compile`` kernels."""

    target = "cpu"

    @property
    def shape_generic(self) -> bool:
        """Whether the export takes every size at run time (a shape-generic kernel exported without shapes)."""
        return self._signature.shape_generic

    def __init__(self, manifest: dict[str, Any], folder: Path):
        super().__init__(manifest, folder)
        sig = self._signature
        self.native = NativeFunction(folder / manifest["library"], sig, threaded=bool(manifest.get("threads")))
        self._sources = extent_sources(sig.inputs)
        self._planner = fast_call.Planner(self.native)  # the C-level call of a shape-generic export

    @kernel_call
    def __call__(self, out: np.ndarray | None = None, **operands: Any) -> Any:
        sig = self._signature
        args = prepare(sig.expression, self._inputs, operands, sig.output.dtype, "cpu")
        for op in sig.inputs:
            self._check_shape(op.name, op.shape, args[op.name].shape)
        extents = check_extents(self._sources, args)
        out_op = sig.output
        out_shape = tuple(extents[i] if i in extents else s for i, s in zip(out_op.index, out_op.shape))
        if out_op.sparse:
            if out is not None:
                raise OperandError(f"out= is only for dense results; {out_op.name} is sparse")
            return self.native(args, None, out_shape)
        result = self.native(args, dense_output(out_op.name, out, out_shape, out_op.dtype, args), out_shape)
        # the next call with operands like these goes straight to the library (``fast_call``): planned for the
        # operands' own format objects, which a SparseTensor operand must then carry
        self._native_fast = self._planner.call_for({op.name: args[op.name].format for op in sig.inputs if op.sparse})
        return result


class LoadedCudaKernel(_Exported):
    """An exported GPU kernel (``NAME.json`` + PTX/cubin files): the export's shapes (fixed, or every size for a
    shape-generic kernel exported without shapes), runs with CuPy alone."""

    target = "cuda"

    def __init__(self, manifest: dict[str, Any], folder: Path):
        super().__init__(manifest, folder)
        program = GpuProgram.from_json(manifest["program"], ptx={})
        self.function = GpuFunction(program, self._signature,
                                    {chip: folder / name for chip, name in manifest["code"].items()})
        self._sources = extent_sources(self._signature.inputs)

    @property
    def shape_generic(self) -> bool:
        """Whether the export takes every size at run time (a shape-generic kernel exported without shapes)."""
        return self._signature.shape_generic

    @kernel_call
    def __call__(self, out: Any = None, **operands: Any) -> Any:
        sig = self._signature
        args = device_operands(sig.expression, self._inputs, operands, sig.inputs[0].dtype)
        for op in sig.inputs:
            self._check_shape(op.name, op.shape, tuple(args[op.name].shape))
        extents = check_extents(self._sources, args)  # operands that disagree on an index's size are refused
        output = sig.output
        shape = tuple(extents[i] if i in extents else s for i, s in zip(output.index, output.shape))
        if output.sparse:  # the SDDMM's CSR result: made by the function (out= is refused there)
            return self.function(args, out, shape)
        return self.function(args, checked_device_output(output.name, out, shape, output.dtype, args), shape)
