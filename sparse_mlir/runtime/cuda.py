"""Running GPU programs on CuPy buffers: operand checks, module loading, launches.

Everything stays on the device and on CuPy's current stream: operands are
CuPy arrays and ``DeviceSparseTensor``s (a host array or matrix is refused,
never copied behind the caller's back), a dense result is a new CuPy array
(or ``out=``), zeroed on the stream unless every launch stores all of it,
each ``Launch`` of the program is launched in order (those whose ``when``
matches the operand's row skew), and nothing synchronizes.  Parameters are
packed as 64-bit words (``gpu_program.ParamPacker``) and handed to
``cuLaunchKernel`` as one array.  CuPy is imported on first use.

``CudaKernel`` is what ``sm.compile(..., target="cuda")`` returns: PTX is
specialized per operand shape (every size is static, so launch grids are
constants) and compiled on the first call with each shape, through the
compiler process and the disk cache like CPU kernels.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..device_tensor import DeviceSparseTensor, cupy
from ..dsl.plan import KernelSpec
from ..errors import DeviceError, DTypeError, FormatError, OperandError, ShapeError
from ..formats import Format
from ..gpu_program import CHIPS, GpuProgram, Launch, ParamPacker, is_skewed
from ..signature import Signature
from ..tensor import SparseTensor
from . import cache
from .kernel import cache_key
from .operands import check_extents, check_names
from .tensor_maps import TENSOR_MAPS
from .calls import kernel_call

__all__ = ["CudaKernel", "LoadedCudaKernel", "GpuFunction", "device_operands", "pick_chip", "PROGRAM_SUFFIX"]

PROGRAM_SUFFIX = ".gpu.json"
EMITTERS = ("auto", "sparsifier")  # see compiler.build_gpu_program
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


def arch_specific_enabled() -> bool:
    """Whether arch-specific code (the sm_90a TMA + wgmma GEMMs) may run: opt-in with ``SPARSE_MLIR_HOPPER=1``.

    The Hopper kernels pass ptxas but have not yet been checked on a GPU
    (``benchmarks/gpu/tensor_core_check.py`` does that and sets it); until a
    device run confirms them, every chip runs the portable kernels.
    """
    return os.environ.get("SPARSE_MLIR_HOPPER", "0") == "1"


def pick_chip(available: list[str], capability: str, arch_specific: bool | None = None) -> str:
    """The newest ``sm_XY`` in ``available`` that a device of compute capability ``XY`` runs.

    Arch-specific code (``sm_90a``: wgmma, setmaxnreg) runs only on exactly
    its capability and, where enabled (``arch_specific_enabled``), is
    preferred there over the portable ``sm_90``.
    """
    def version(chip: str) -> int:
        return int(chip.removeprefix("sm_").rstrip("a"))

    allowed = arch_specific_enabled() if arch_specific is None else arch_specific
    usable = sorted((version(c), c.endswith("a"), c) for c in available
                    if version(c) <= int(capability) and
                    (not c.endswith("a") or (allowed and version(c) == int(capability))))
    if not usable:
        raise DeviceError(f"no code for compute capability {capability}: the kernel has {', '.join(available)}")
    return usable[-1][2]


class _ParamBlock:
    """One launch's parameter words and the array of their addresses that ``cuLaunchKernel`` reads.

    This is the driver call the C launcher makes.  CuPy's
    ``Function.__call__`` would box each of the ~26 words into an argument
    object per call; here a call only overwrites the words (the driver copies
    them before returning, so one block per launch and thread is reused).
    """

    def __init__(self, count: int):
        self.words = (ctypes.c_uint64 * count)()
        base = ctypes.addressof(self.words)
        self.addresses = (ctypes.c_void_p * count)(*range(base, base + 8 * count, 8))
        self.pointer = ctypes.addressof(self.addresses)


class GpuFunction:
    """A ``GpuProgram`` for one signature, loaded per device on first use.

    ``files`` maps a chip to its PTX (``.ptx``) or cubin (``.cubin``) file;
    a cubin is used only on a device of exactly its compute capability.
    """

    def __init__(self, program: GpuProgram, sig: Signature, files: dict[str, Path]):
        self.program = program
        self.signature = sig
        self.files = files
        self._modules: dict[int, tuple[Any, list[Any]]] = {}
        self._lock = threading.Lock()
        self._arguments = sig.kernel_arguments()
        # where each kernel argument comes from: (operand, buffer index), (output, -1) or (operand, None) for
        # the implicit positions of an N:M operand
        self._sources: list[tuple[Any, int | None]] = [
            (op, -1) if op.output or not op.sparse else
            (op, op.format.buffer_names.index(buf) if buf in op.format.buffer_names else None)
            for op, buf in self._arguments]
        self._packers = {id(launch): ParamPacker(launch) for launch in program.launches}
        # the operand whose row lengths decide between "balanced" and "skewed" launches, if any
        self._skew_operand = next((op for op in sig.inputs if op.sparse), None) \
            if any(launch.when for launch in program.launches) else None
        self._implicit: dict[int, Any] = {}  # N:M positions per device
        self._local = threading.local()  # parameter blocks of this Python thread
        self._zeroed = {s: program.needs_zeroed_output(s) for s in (False, True)}  # by skew
        # TMA reads need 16-byte aligned buffers too
        self._aligned = sorted({ref for launch in program.launches for ref in launch.aligned} |
                               {arg.ref for launch in program.launches for arg in launch.args
                                if arg.kind == "tensormap"})

    def _functions(self, cp: Any) -> list[tuple[Launch, Any]]:
        """The launches of the chip this device runs, each with its loaded function."""
        device = cp.cuda.Device()
        loaded = self._modules.get(device.id)
        if loaded is None:
            with self._lock:
                capability = device.compute_capability
                chip = pick_chip([c for c in self.files if "." not in c], capability)
                cubin = self.files.get(f"{chip}.cubin")
                path = cubin if cubin is not None and chip.rstrip("a") == f"sm_{capability}" else self.files[chip]
                module = cp.RawModule(path=str(path))
                # get_function gives a RawKernel; the driver API takes its CUfunction, ``.kernel.ptr`` (a RawKernel
                # has no ``.ptr``: passing one crashed every launch on real hardware)
                launches = [(launch, module.get_function(launch.kernel).kernel) for launch in self.program.launches
                            if launch.on(chip)]
                for launch, function in launches:
                    if launch.shared_bytes > 48 * 1024:  # above the default limit, the kernel must opt in
                        cp.cuda.driver.funcSetAttribute(function.ptr, MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                        launch.shared_bytes)
                loaded = (module, launches)
                self._modules[device.id] = loaded
        return loaded[1]

    def __call__(self, args: dict[str, Any], out: Any) -> Any:
        """Launch on ``args``, writing ``out`` (checked by ``checked_device_output``) or a new array; return it."""
        cp = cupy()
        functions = self._functions(cp)
        skewed = False
        if self._skew_operand is not None:
            tensor = args[self._skew_operand.name]
            skewed = is_skewed(getattr(tensor, "longest_row", None), tensor.nnz, self._skew_operand.shape[0])
        zero, given = self._zeroed[skewed], out is not None
        if not given:
            out = (cp.zeros if zero else cp.empty)(self.signature.output.shape, dtype=self.signature.output.dtype)
        buffers: list[tuple[int, int]] = []
        for op, index in self._sources:
            if index == -1:
                value = out if op.output else args[op.name]
            elif index is None:
                value = self._positions(cp, op)
            else:
                value = args[op.name].buffers[index]
            buffers.append((value.data.ptr, value.size))
        for ref in self._aligned:  # before anything is launched
            if buffers[ref][0] % 16:
                raise OperandError(f"{self._arguments[ref][0].name} must start on a 16-byte boundary for this "
                                   f"kernel's vector accesses (it is a view at an odd offset): pass a copy")
        if zero and given:  # after the checks: a refused call leaves the caller's array as it was
            out.fill(0)
        scratch_ptrs, skip = self._scratch(cp, args, functions, buffers)
        lengths = [n for _, n in buffers]
        stream = cp.cuda.get_current_stream().ptr
        blocks = self._param_blocks(cp, functions)

        def tensor_map(pointer: int, geometry: Any) -> int:
            dtype = self.signature.inputs[0].dtype.name if self.signature.inputs else "float16"
            return TENSOR_MAPS(cp, pointer, geometry, dtype)

        for (launch, function), block in zip(functions, blocks):
            if launch.runs(skewed) and id(launch) not in skip:
                block.words[:] = self._packers[id(launch)](buffers, scratch_ptrs, tensor_map=tensor_map)
                cp.cuda.driver.launchKernel(function.ptr, *launch.grid_for(lengths), *launch.block,
                                            launch.shared_bytes, stream, block.pointer, 0)
        return out

    def _scratch(self, cp: Any, args: dict[str, Any], functions: list[tuple[Launch, Any]],
                 buffers: list[tuple[int, int]]) -> tuple[list[int], set[int]]:
        """Scratch pointers for this call, and the ``derives`` launches to skip (their results kept on the operand).

        Only the scratch buffers the launches of this chip read are made
        (sm_90a's GEMM needs none of the portable ones); zeroed, except those
        a ``derives`` launch fills, which the operand keeps for later calls.
        """
        used = {arg.ref for launch, _ in functions for arg in launch.args if arg.kind == "scratch"}
        found: dict[int, Any] = {}
        skip: set[int] = set()
        for launch, _ in functions:
            if not launch.derives:
                continue
            refs = [arg.ref for arg in launch.args if arg.kind == "buffer"]
            tensor = args.get(self._sources[refs[0]][0].name)
            derived = getattr(tensor, "derived", None)
            if derived is None:
                continue
            key = (launch.kernel, tuple(buffers[r] for r in refs),
                   tuple(self.program.scratch[a.ref] for a in launch.args if a.kind == "scratch"))
            kept = derived.get(key)
            if kept is None:
                kept = derived[key] = [cp.empty(tuple(self.program.scratch[a.ref][0]),
                                                np.dtype(self.program.scratch[a.ref][1]))
                                       for a in launch.args if a.kind == "scratch"]
            else:
                skip.add(id(launch))
            for arg, array in zip((a for a in launch.args if a.kind == "scratch"), kept):
                found[arg.ref] = array
        for s, (shape, dtype) in enumerate(self.program.scratch):
            if s in used and s not in found:
                found[s] = cp.zeros(shape, dtype=np.dtype(dtype))
        return [found[s].data.ptr if s in found else 0 for s in range(len(self.program.scratch))], skip

    def _param_blocks(self, cp: Any, functions: list[tuple[Launch, Any]]) -> list[_ParamBlock]:
        blocks = getattr(self._local, "blocks", None)
        if blocks is None:
            # a driver-API launch needs a current context, which a fresh Python thread gets only from a runtime
            # call (CuPy's own launches make one too); cudaFree(0) is the documented no-op that does it
            cp.cuda.runtime.free(0)
            blocks = self._local.blocks = [_ParamBlock(launch.param_count()) for launch, _ in functions]
        return blocks

    def _positions(self, cp: Any, op: Any) -> Any:
        """The implicit positions ``0, n, 2n, ...`` of an N:M operand, made once per device."""
        device = cp.cuda.Device().id
        found = self._implicit.get(device)
        if found is None:
            fmt = op.format
            groups = int(np.prod(fmt.level_sizes(op.shape)[:-1]))
            dtype = np.int32 if fmt.pos_width == 32 else np.int64
            found = self._implicit[device] = cp.arange(groups + 1, dtype=dtype) * fmt.levels[-1].n
        return found


def _is_cupy_array(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "cupy" and hasattr(value, "data") and hasattr(value, "ndim")


def device_operands(expression: str, inputs: tuple[tuple[str, Format | None, int], ...], operands: dict[str, Any],
                    dtype: np.dtype) -> dict[str, Any]:
    """Check each operand is on the device with the declared format, dtype and rank; nothing is copied."""
    check_names(expression, tuple(n for n, _, _ in inputs), operands)
    out: dict[str, Any] = {}
    for name, fmt, rank in inputs:
        value = operands[name]
        if fmt is not None:
            value = _sparse_operand(name, value, fmt, dtype)
        elif not _is_cupy_array(value):
            if isinstance(value, (np.ndarray, SparseTensor, DeviceSparseTensor)):
                raise DeviceError(f"operand {name} is a {type(value).__name__}; this kernel runs on the GPU and "
                                  f"takes CuPy arrays for dense operands (cupy.asarray copies once)")
            raise OperandError(f"operand {name} must be a CuPy array, got {type(value).__name__}")
        else:
            if value.dtype != dtype:
                raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {dtype}")
            if value.ndim != rank:
                raise ShapeError(f"operand {name} is used with {rank} indices but has shape {value.shape}")
            if not value.flags.c_contiguous:
                raise OperandError(f"operand {name} must be C-contiguous (cupy.ascontiguousarray)")
        out[name] = value
    return out


def _sparse_operand(name: str, value: Any, declared: Format, dtype: np.dtype) -> DeviceSparseTensor:
    if isinstance(value, SparseTensor) or type(value).__module__.startswith("scipy.sparse"):
        raise DeviceError(f"operand {name} is on the host; move it once with SparseTensor.to('cuda') "
                          f"(or pass a cupyx.scipy.sparse matrix)")
    if type(value).__module__.startswith("cupyx.scipy.sparse"):
        value = DeviceSparseTensor.from_cupyx(value, declared)  # checked on every call: convert once instead
    if not isinstance(value, DeviceSparseTensor):
        raise OperandError(f"operand {name} is declared {declared}; pass a DeviceSparseTensor or a cupyx sparse "
                           f"matrix, got {type(value).__name__}")
    if value.format != declared and value.format.with_widths(declared.pos_width, declared.crd_width) != declared:
        raise FormatError(f"operand {name} is declared {declared}, but the tensor is {value.format}")
    if value.dtype != dtype:
        raise DTypeError(f"operand {name} has dtype {value.dtype}, the kernel's dtype is {dtype}")
    return value


def checked_device_output(name: str, out: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """``out`` checked (``GpuFunction`` zeroes it when its kernels accumulate), or ``None``."""
    if out is None:
        return None
    if not _is_cupy_array(out):
        raise OperandError(f"out= must be a CuPy array, got {type(out).__name__}")
    if out.dtype != dtype:
        raise DTypeError(f"out= has dtype {out.dtype}, the kernel's output dtype is {dtype}")
    if tuple(out.shape) != shape:
        raise ShapeError(f"out= has shape {tuple(out.shape)}, but {name} has shape {shape}")
    if not out.flags.c_contiguous:
        raise OperandError("out= must be C-contiguous")
    return out


class CudaKernel:
    """A kernel compiled for ``target="cuda"``; call it with CuPy / device operands.

    ``emitter="sparsifier"`` skips the hand-scheduled SpMV/SpMM kernels (for
    comparing them).  ``deterministic=True`` leaves out kernels whose atomic
    additions order float sums differently from run to run (the row-splitting
    SpMV for skewed rows).
    """

    target = "cuda"

    def __init__(self, spec: KernelSpec, chips: tuple[str, ...] = CHIPS, emitter: str = "auto",
                 deterministic: bool = False):
        if emitter not in EMITTERS:
            raise DeviceError(f"emitter must be one of {', '.join(EMITTERS)}, got {emitter!r}")
        if spec.sparse_output:
            raise DeviceError(f"{spec.expression!r} has a sparse result, which target 'cuda' does not produce yet; "
                              f"compile it for the cpu")
        self.spec = spec
        self.chips = chips
        self.emitter = emitter
        self.deterministic = deterministic
        self._inputs = tuple((n, spec.formats.get(n), spec.ranks[n]) for n in spec.inputs)
        self._sources = tuple((idx, tuple(places)) for idx, places in spec.extent_sources().items())
        self._functions: dict[tuple, GpuFunction] = {}
        self._keys: list[str] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        fmts = ", ".join(f"{k}={v}" for k, v in self.spec.formats.items())
        out = f", out_dtype={self.spec.out_dtype}" if self.spec.out_dtype is not None else ""
        return f"CudaKernel({self.spec.expression!r}, formats={{{fmts}}}, dtype={self.spec.dtype}{out})"

    @property
    def compiled(self) -> bool:
        """Whether a specialization has been compiled (by a call or ``function``)."""
        return bool(self._keys)

    @property
    def ir(self) -> dict[str, str]:
        """IR of every stage of the most recent specialization (``input``, ``sparsified``, ``gpu``, ``nvvm``)."""
        if not self._keys:
            raise ShapeError("the kernel has not been specialized yet: call it (or use .function(formats, shapes)) "
                             "first")
        return cache.load_ir(self._keys[-1])

    @kernel_call
    def __call__(self, out: Any = None, **operands: Any) -> Any:
        spec = self.spec
        args = device_operands(spec.expression, self._inputs, operands, spec.dtype)
        formats = {n: args[n].format for n in spec.inputs if spec.is_sparse(n)}
        shapes = self._shapes(args)
        function = self.function(formats, shapes)
        return function(args, checked_device_output(spec.output, out, shapes[spec.output], spec.output_dtype))

    def specialize(self, shapes: dict[str, tuple[int, ...]]) -> GpuFunction:
        """Compile (or load) the specialization for these input shapes and the declared formats, without a GPU.

        ``ShapeError`` names missing, unknown and inconsistent shapes.
        """
        spec = self.spec
        if missing := [n for n in spec.inputs if n not in shapes]:
            raise ShapeError(f"a GPU kernel is specialized on every input's shape: give shapes for "
                             f"{', '.join(missing)}")
        if unknown := sorted(set(shapes) - set(spec.inputs) - {spec.output}):
            raise ShapeError(f"shapes names {', '.join(unknown)}, not an input of {spec.expression!r}")
        operands = {}
        for name in spec.inputs:
            shape = tuple(int(s) for s in shapes[name])
            if len(shape) != spec.ranks[name]:
                raise ShapeError(f"{name} has {spec.ranks[name]} dimensions, but its shape is {shape}")
            if spec.is_sparse(name):
                spec.formats[name].check_shape(shape)
            operands[name] = SimpleNamespace(shape=shape)
        return self.function({n: spec.formats[n] for n in spec.inputs if spec.is_sparse(n)}, self._shapes(operands))

    def _shapes(self, operands: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Every operand's shape (the output's from the index sizes), checked where an index repeats."""
        extents = check_extents(self._sources, operands)
        shapes = {n: tuple(operands[n].shape) for n in self.spec.inputs}
        shapes[self.spec.output] = tuple(extents[i] for i in self.spec.output_indices)
        return shapes

    def function(self, formats: dict[str, Format], shapes: dict[str, tuple[int, ...]]) -> GpuFunction:
        """The loaded specialization for these formats and shapes (compiled or read from the cache)."""
        local = (tuple(sorted((n, f.pos_width, f.crd_width) for n, f in formats.items())),
                 tuple(sorted(shapes.items())))
        found = self._functions.get(local)
        if found is None:
            with self._lock:
                key, program, sig = compile_program(self.spec, formats, shapes, self.chips, self.emitter,
                                                    self.deterministic)
                files = write_ptx_files(program, cache.entry_paths(key, PROGRAM_SUFFIX)[0].parent, key)
                found = self._functions[local] = GpuFunction(program, sig, files)
                self._keys.append(key)
        return found


class LoadedCudaKernel:
    """An exported GPU kernel (``NAME.json`` + PTX/cubin files): fixed shapes, runs with CuPy alone."""

    target = "cuda"

    def __init__(self, manifest: dict[str, Any], folder: Path):
        self.manifest = manifest
        self.signature = sig = Signature.from_json(manifest["signature"])
        program = GpuProgram.from_json(manifest["program"], ptx={})
        self.function = GpuFunction(program, sig, {chip: folder / name for chip, name in manifest["code"].items()})
        self._inputs = tuple((op.name, op.format, len(op.shape)) for op in sig.inputs)

    @kernel_call
    def __call__(self, out: Any = None, **operands: Any) -> Any:
        sig = self.signature
        args = device_operands(sig.expression, self._inputs, operands, sig.inputs[0].dtype)
        for op in sig.inputs:
            if tuple(args[op.name].shape) != op.shape:
                raise ShapeError(f"{sig.name} was exported for {op.name} of shape {op.shape}, "
                                 f"got {tuple(args[op.name].shape)}")
        output = sig.output
        return self.function(args, checked_device_output(output.name, out, output.shape, output.dtype))

    def __repr__(self) -> str:
        return f"LoadedCudaKernel({self.signature.name!r}: {self.signature.expression!r})"


def compile_program(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int, ...]],
                    chips: tuple[str, ...], emitter: str, deterministic: bool = False
                    ) -> tuple[str, GpuProgram, Signature]:
    """Compile (or load from the disk cache) the program of one specialization: ``(key, program, signature)``."""
    from .. import worker
    from ..compiler import specialize

    special = specialize(spec, formats)
    sig = Signature.from_spec(special, formats, shapes, "kernel")
    key = cache_key(spec, formats, shapes, f"cuda;{chips};{emitter};{deterministic}")
    path, _ = cache.load_or_build(
        key, {"expression": spec.expression, "signature": sig.to_json()},
        lambda path: worker.call("build_gpu_program", special, shapes, sig, path, chips, emitter, deterministic),
        PROGRAM_SUFFIX)
    return key, GpuProgram.from_json(json.loads(path.read_text())), sig


def write_ptx_files(program: GpuProgram, folder: Path, stem: str) -> dict[str, Path]:
    """Write each chip's PTX as ``stem.<chip>.ptx`` (CuPy loads modules from files); return chip -> path."""
    files = {}
    for chip, ptx in program.ptx.items():
        path = folder / f"{stem}.{chip}.ptx"
        if not path.exists() or path.read_text() != ptx:
            cache.write_atomically(path, ptx)
        files[chip] = path
    return files

