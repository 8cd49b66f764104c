"""Running a ``GpuProgram`` on CuPy buffers: module loading per device, parameters, scratch, launches.

Everything stays on the device and on CuPy's current stream: each ``Launch``
of the program is launched in order (those whose ``when`` matches the
operand's row skew), a dense result is a new CuPy array (or ``out=``), zeroed
on the stream unless every launch stores all of it, a sparse result (the
SDDMM's) a new ``DeviceSparseTensor`` whose buffers are written by the
launches or copied on the device (``GpuProgram.result_like``), and nothing
synchronizes.
Parameters are packed as 64-bit words (``abi.gpu_program.ParamPacker``) and
handed to ``cuLaunchKernel`` as one array.  CuPy is imported on first use.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np

from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.abi.gpu_program import GpuProgram, Launch, ParamPacker, is_skewed
from sparse_mlir.errors import DeviceError, OperandError
from sparse_mlir.files import write_atomically
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime.tensor_maps import TENSOR_MAPS
from sparse_mlir.tensor.device import DeviceSparseTensor, cupy

__all__ = ["GpuFunction", "pick_chip", "write_ptx_files"]

MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


def pick_chip(available: list[str], capability: str, arch_specific: bool | None = None) -> str:
    """The newest ``sm_XY`` in ``available`` that a device of compute capability ``XY`` runs.

    Arch-specific code (``sm_90a``: wgmma, setmaxnreg) runs only on exactly
    its capability and, where enabled (``knobs.hopper``), is
    preferred there over the portable ``sm_90``.
    """
    def version(chip: str) -> int:
        return int(chip.removeprefix("sm_").rstrip("a"))

    allowed = knobs.hopper() if arch_specific is None else arch_specific
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
        # the deterministic SpMV's merge path for skewed rows runs only where enabled (``knobs.merge_spmv``)
        self._merge = any(launch.kernel == "spmv_merge" for launch in program.launches)
        # per launch, the arguments it needs 16-byte aligned (vector accesses; TMA reads too)
        self._aligned = {id(launch): sorted({*launch.aligned, *(a.ref for a in launch.args if a.kind == "tensormap")})
                         for launch in program.launches}

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

    def __call__(self, args: dict[str, Any], out: Any, out_shape: tuple[int, ...] | None = None) -> Any:
        """Launch on ``args``, writing ``out`` (checked by ``checked_device_output``) or a new array; return it.

        ``out_shape`` is the result's shape at this call (a shape-generic
        program's signature has none); by default the signature's.
        """
        cp = cupy()
        functions = self._functions(cp)
        skewed = False
        if self._skew_operand is not None:
            tensor = args[self._skew_operand.name]
            skewed = is_skewed(getattr(tensor, "longest_row", None), tensor.nnz, tensor.shape[0])
            skewed = skewed and (not self._merge or knobs.merge_spmv())
        zero, given = self._zeroed[skewed], out is not None
        sparse_result = bool(self.program.result_like)
        if sparse_result and given:
            raise OperandError(f"out= is only for dense results; {self.signature.output.name} is "
                               f"{self.signature.output.format}")
        if not given and not sparse_result:
            shape = self.signature.output.shape if out_shape is None else out_shape
            out = (cp.zeros if zero else cp.empty)(shape, dtype=self.signature.output.dtype)
        buffers: list[tuple[int, int]] = []
        values: list[Any] = []  # each kernel argument's array (a sparse result's buffers are made from them)
        shapes: list[tuple[int, ...]] = []  # each kernel argument's sizes (a shape-generic program's descriptors)
        for op, index in self._sources:
            if index == -1:
                value = out if op.output else args[op.name]
            elif index is None:
                value = self._positions(cp, op)
            else:
                value = args[op.name].buffers[index]
            buffers.append((value.data.ptr, value.size))
            shapes.append(tuple(value.shape))
            values.append(value)
        running = {id(launch) for launch, _ in functions if launch.runs(skewed) and launch.fits(shapes)}
        for ref in sorted({r for launch in running for r in self._aligned[launch]}):  # before anything is launched
            if buffers[ref][0] % 16:
                raise OperandError(f"{self._arguments[ref][0].name} must start on a 16-byte boundary for this "
                                   f"kernel's vector accesses (it is a view at an odd offset): pass a copy")
        if zero and given:  # after the checks: a refused call leaves the caller's array as it was
            out.fill(0)
        results: list[Any] = self._sparse_result(cp, values) if sparse_result else []
        scratch_shapes = self.program.scratch_shapes(shapes)  # a shape-generic program's from this call's sizes
        scratch_ptrs, skip = self._scratch(cp, args, functions, buffers, scratch_shapes)
        lengths = [n for _, n in buffers]
        stream = cp.cuda.get_current_stream().ptr
        blocks = self._param_blocks(cp, functions)

        def tensor_map(pointer: int, geometry: Any) -> int:
            dtype = self.signature.inputs[0].dtype.name if self.signature.inputs else "float16"
            return TENSOR_MAPS(cp, pointer, geometry, dtype)

        for (launch, function), block in zip(functions, blocks):
            if id(launch) in running and id(launch) not in skip:
                block.words[:] = self._packers[id(launch)](buffers, scratch_ptrs, tensor_map=tensor_map,
                                                            shapes=shapes, scratch_shapes=scratch_shapes,
                                                            results=[(r.data.ptr, r.size) for r in results])
                cp.cuda.driver.launchKernel(function.ptr, *launch.grid_for(lengths, shapes), *launch.block,
                                            launch.shared_bytes, stream, block.pointer, 0)
        if sparse_result:
            return self._result_tensor(args, results, out_shape)
        return out

    def _sparse_result(self, cp: Any, values: list[Any]) -> list[Any]:
        """A sparse result's buffers (``GpuProgram.result_like``): fresh arrays for those the launches write,
        device copies of the rest (the SDDMM's ``C`` owns copies of ``S``'s positions and coordinates, so
        changing one tensor's buffers never changes the other's)."""
        written = self.program.result_written()
        out = []
        for k, ((_, dtype), like) in enumerate(zip(self.signature.result_buffers(), self.program.result_like)):
            source = values[like]
            out.append(cp.empty(source.size, dtype=dtype) if k in written else source.astype(dtype, copy=True))
        return out

    def _result_tensor(self, args: dict[str, Any], buffers: list[Any], shape: tuple[int, ...] | None) -> Any:
        """The sparse result as a ``DeviceSparseTensor`` in the output's format; it keeps the pattern of the input
        it was copied from, and so that input's longest row."""
        output = self.signature.output
        source = self._sources[self.program.result_like[0]][0]
        return DeviceSparseTensor(output.format, output.shape if shape is None else shape, tuple(buffers),
                                  getattr(args[source.name], "longest_row", None))

    def _scratch(self, cp: Any, args: dict[str, Any], functions: list[tuple[Launch, Any]],
                 buffers: list[tuple[int, int]], shapes: list[tuple[int, ...]]) -> tuple[list[int], set[int]]:
        """Scratch pointers for this call, and the ``derives`` launches to skip (their results kept on the operand).

        ``shapes`` are the scratch buffers' shapes at this call.  Only the scratch buffers the launches of this
        chip read are made
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
                   tuple((shapes[a.ref], self.program.scratch[a.ref][1]) for a in launch.args if a.kind == "scratch"))
            kept = derived.get(key)
            if kept is None:
                kept = derived[key] = [cp.empty(shapes[a.ref], np.dtype(self.program.scratch[a.ref][1]))
                                       for a in launch.args if a.kind == "scratch"]
            else:
                skip.add(id(launch))
            for arg, array in zip((a for a in launch.args if a.kind == "scratch"), kept):
                found[arg.ref] = array
        for s, (_, dtype) in enumerate(self.program.scratch):
            if s in used and s not in found:
                found[s] = cp.zeros(shapes[s], dtype=np.dtype(dtype))
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



def write_ptx_files(program: GpuProgram, folder: Path, stem: str) -> dict[str, Path]:
    """Write each chip's PTX as ``stem.<chip>.ptx`` (CuPy loads modules from files); return chip -> path."""
    files = {}
    for chip, ptx in program.ptx.items():
        path = folder / f"{stem}.{chip}.ptx"
        if not path.exists() or path.read_text() != ptx:
            write_atomically(path, ptx)
        files[chip] = path
    return files

