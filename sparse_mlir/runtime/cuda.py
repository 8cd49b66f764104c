"""``CudaKernel``: what ``compile(..., target="cuda")`` returns; it runs on CuPy arrays and ``DeviceSparseTensor``s.

A shape-generic kernel (``driver.shape_generic``: the hand-scheduled CSR
SpMV) is built once per index widths: its PTX reads every size from the
buffers' descriptors and its grids are sized at launch from the operands
(``GridRule``, ``LaneRule``).  Every other kernel's PTX is specialized per
operand shape (its sizes are compiled in, so its launch grids are
constants).  Builds happen on the first call that needs them, by the driver,
through the compiler process and the disk cache like CPU kernels.  It compiles
without a GPU or CuPy (``specialize``), and raises ``DeviceError`` only when
asked to run without them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.abi.gpu_program import CHIPS, GpuProgram
from sparse_mlir.compiler import driver
from sparse_mlir.compiler.driver import Artifact, BuildOptions
from sparse_mlir.dsl.patterns import gpu_sddmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.errors import DeviceError, OperandError
from sparse_mlir.formats import Format
from sparse_mlir.runtime.calls import kernel_call
from sparse_mlir.runtime.device_operands import checked_device_output, device_operands
from sparse_mlir.runtime.kernel import Kernel, check_shapes_given, not_compiled, operand_table
from sparse_mlir.runtime.launch import GpuFunction, write_ptx_files
from sparse_mlir.runtime.operands import check_extents

__all__ = ["CudaKernel", "ENTRY_NAME"]

ENTRY_NAME = "kernel"


class CudaKernel(Kernel):
    """A kernel compiled for ``target="cuda"``; call it with CuPy / device operands.

    ``emitter="sparsifier"`` skips the hand-scheduled SpMV/SpMM kernels (for
    comparing them).  ``deterministic=True`` leaves out kernels whose atomic
    additions order float sums differently from run to run (the row-splitting
    SpMV for skewed rows).
    """

    target = "cuda"

    def __init__(self, spec: KernelSpec, chips: tuple[str, ...] = CHIPS, emitter: str = "auto",
                 deterministic: bool = False):
        super().__init__()
        # the one sparse result the GPU produces: the SDDMM's, which keeps S's pattern (``_pattern_source``)
        self._pattern_source = _pattern_source(spec) if spec.sparse_output else None
        if spec.sparse_output and (self._pattern_source is None or emitter != "auto"):
            raise DeviceError(f"{spec.expression!r} has a sparse result, which target 'cuda' does not produce yet "
                              f"(only the float SDDMM's, C[i,j] = S[i,j] * A[i,k] * B[k,j] with CSR S and C, "
                              f"hand-scheduled); compile it for the cpu")
        self.spec = spec
        self.options = BuildOptions("cuda", chips=chips, emitter=emitter, deterministic=deterministic)
        self._inputs = operand_table(spec)
        self._sources = tuple((idx, tuple(places)) for idx, places in spec.extent_sources().items())
        self._functions: dict[tuple, tuple[Artifact, GpuFunction]] = {}
        self._last: tuple[Artifact, GpuFunction] | None = None
        self._lock = threading.Lock()
        self._sparse_inputs = tuple(n for n in spec.inputs if spec.is_sparse(n))
        self._generic: dict[tuple, bool] = {}  # index widths of the sparse inputs -> shape-generic?

    def __repr__(self) -> str:
        fmts = ", ".join(f"{k}={v}" for k, v in self.spec.formats.items())
        out = f", out_dtype={self.spec.out_dtype}" if self.spec.out_dtype is not None else ""
        return f"CudaKernel({self.spec.expression!r}, formats={{{fmts}}}, dtype={self.spec.dtype}{out})"

    # -- introspection --------------------------------------------------------------
    @property
    def compiled(self) -> bool:
        """Whether a specialization has been compiled (by a call, ``specialize`` or ``function``)."""
        return self._last is not None

    @property
    def shape_generic(self) -> bool:
        """Whether one build takes every size at run time (operands with the declared index widths): the
        hand-scheduled CSR SpMV; every other GPU kernel compiles once per operand shape."""
        return self._is_generic({n: self.spec.formats[n] for n in self._sparse_inputs})

    def _with_result_format(self, formats: dict[str, Format]) -> dict[str, Format]:
        """``formats`` and, for a sparse result, its format with the index widths of the input whose pattern it
        keeps (a ``cupyx`` matrix with 64-bit indices gives a result with 64-bit indices)."""
        if self._pattern_source is None:
            return formats
        source = formats[self._pattern_source]
        declared = self.spec.formats[self.spec.output]
        return {**formats, self.spec.output: declared.with_widths(source.pos_width, source.crd_width)}

    def _is_generic(self, formats: Mapping[str, Format]) -> bool:
        """Whether the build for these actual formats is shape-generic (asked once per index widths)."""
        widths = tuple((formats[n].pos_width, formats[n].crd_width) for n in self._sparse_inputs)
        found = self._generic.get(widths)
        if found is None:
            formats = self._with_result_format(dict(formats))
            found = self._generic[widths] = driver.shape_generic(self.spec, formats, self.options)
        return found

    @property
    def mlir(self) -> str:
        """The generic module before lowering, every size still ``?`` (each shape specializes it)."""
        return driver.kernel_source(self.spec)

    @property
    def signature(self) -> Signature:
        return self._latest()[0].signature

    @property
    def program(self) -> GpuProgram:
        """The launches and PTX of the most recent specialization."""
        return self._latest()[1].program

    @property
    def ir(self) -> dict[str, str]:
        """IR of every stage of the most recent specialization (``input``, ``sparsified``, ``mapped``, ``llvm``)."""
        return self._latest()[0].ir

    def _latest(self) -> tuple[Artifact, GpuFunction]:
        if self._last is None:
            raise not_compiled(self)
        return self._last

    # -- calling ----------------------------------------------------------------------
    @kernel_call
    def __call__(self, out: Any = None, **operands: Any) -> Any:
        spec = self.spec
        args = device_operands(spec.expression, self._inputs, operands, spec.dtype)
        formats = {n: args[n].format for n in spec.inputs if spec.is_sparse(n)}
        shapes = self._shapes({n: tuple(args[n].shape) for n in spec.inputs})
        if self._pattern_source is not None and out is not None:
            raise OperandError(f"out= is only for dense results; {spec.output} is {spec.formats[spec.output]}")
        function = self.function(formats, shapes)
        if self._pattern_source is not None:
            return function(args, None, shapes[spec.output])
        return function(args, checked_device_output(spec.output, out, shapes[spec.output], spec.output_dtype, args),
                        shapes[spec.output])

    def specialize(self, shapes: Mapping[str, tuple[int, ...]], *, fixed: bool = False) -> CudaKernel:
        """Compile (or load) the specialization for these input shapes and the declared formats, without a GPU.

        ``ShapeError`` names missing, unknown and inconsistent shapes; a
        ``shape_generic`` kernel needs none (``{}`` builds its one variant),
        unless ``fixed``: then it too is built for these shapes (an export with ``shapes=``).
        """
        spec = self.spec
        formats = {n: spec.formats[n] for n in self._sparse_inputs}
        if self._is_generic(formats) and not fixed:
            check_shapes_given(spec, shapes, ())
            self.function(formats, {})
            return self
        checked = check_shapes_given(spec, shapes, spec.inputs)
        self.function(formats, self._shapes({n: checked[n] for n in spec.inputs}), fixed=fixed)
        return self

    def _shapes(self, inputs: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Every operand's shape (the output's from the index sizes), checked where an index repeats."""
        extents = check_extents(self._sources, {n: _Shaped(s) for n, s in inputs.items()})
        return {**inputs, self.spec.output: tuple(extents[i] for i in self.spec.output_indices)}

    def function(self, formats: dict[str, Format], shapes: dict[str, tuple[int, ...]], fixed: bool = False
                 ) -> GpuFunction:
        """The loaded specialization for these formats and shapes (compiled or read from the cache); a
        shape-generic kernel's serves every shape, unless ``fixed`` asks for one built for ``shapes``."""
        formats = self._with_result_format(formats)
        generic = self._is_generic(formats) and not fixed
        local = (tuple(sorted((n, f.pos_width, f.crd_width) for n, f in formats.items())),
                 None if generic else tuple(sorted(shapes.items())))
        found = self._functions.get(local)
        if found is None:
            with self._lock:
                found = self._functions.get(local)
                if found is None:
                    sizes = driver.generic_shapes(self.spec) if generic else shapes
                    artifact = driver.build(self.spec, formats, sizes, self.options, ENTRY_NAME)
                    assert artifact.program is not None
                    files = write_ptx_files(artifact.program, artifact.path.parent, artifact.key)
                    found = self._functions[local] = (artifact, GpuFunction(artifact.program, artifact.signature,
                                                                            files))
                    self._count(artifact)
        self._last = found
        return found[1]


def _pattern_source(spec: KernelSpec) -> str | None:
    """The sparse input whose pattern a sparse result keeps, where the GPU produces one (the float SDDMM's ``S``),
    else ``None``."""
    found = gpu_sddmm_operands(spec, spec.formats)
    return found.s if found is not None else None


class _Shaped:
    """Just a shape, for ``check_extents`` (which reads ``.shape``)."""

    __slots__ = ("shape",)

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
