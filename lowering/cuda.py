"""The CUDA pipeline: kernel module -> sparsified loops -> outlined ``gpu.func`` kernels -> PTX per chip.

Upstream's sparse GPU codegen launches one block and copies every buffer
between host and device around each call (UPSTREAM-NOTES), so it is not
used.  Instead:

1. the same sparsifier front half as the CPU (``frontend.sparsify``), with
   dense outer loops as ``scf.parallel``;
2. the host function is made launchable (``gpu_rewrites``): the
   sparsifier's prefix views of the level buffers are dropped (their sizes
   would be read on the host), temporaries become scratch arguments the
   runtime allocates, and a body that is not just parallel loops runs as one
   single-thread kernel (correct, slow, reported in ``GpuProgram.notes``);
3. each ``scf.parallel`` is tiled by ``BLOCK`` and mapped onto a grid of
   blocks of threads, then outlined (``gpu-kernel-outlining``) and the
   outlined kernels merged into one ``gpu.module``;
4. the host function, now only ``gpu.launch_func``s over its arguments and
   constants, is read into ``Launch`` records; the ``gpu.module`` is lowered
   through NVVM (libdevice for math) to PTX for every chip.

Hand-scheduled kernels (``dialects.native.gpu``, chosen by ``dialects.select``) come as a ``gpu.module``
with their ``Launch`` records and only take step 4's lowering.

Stages recorded (the same names as on the CPU): ``input``; ``sparsified`` (after
step 1; a hand-scheduled module's is its input); ``mapped`` (after step 3: the
host function of launches and the ``gpu.module``); ``llvm`` (the NVVM/LLVM dialect
of the first chip, before PTX).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import gpu

from sparse_mlir.lowering import cuda_toolkit
from sparse_mlir.errors import LoweringError
from sparse_mlir.abi.gpu_program import CHIPS, GpuProgram, KernelArg, Launch
from sparse_mlir.abi.c_signature import Signature

from sparse_mlir.lowering import rewrites
from sparse_mlir.lowering import sparsify as frontend
from sparse_mlir.lowering import cuda_rewrites as gpu_rewrites

__all__ = ["BLOCK", "lower_to_ptx", "ptx_for_chips"]

BLOCK = 128  # threads per block of a mapped parallel loop

MAKE_LAUNCHABLE = "builtin.module(inline,symbol-dce,canonicalize)"
PARALLEL_LOOPS = "builtin.module(func.func(convert-linalg-to-parallel-loops),canonicalize)"
SERIAL_LOOPS = "builtin.module(func.func(scf-parallel-for-to-nested-fors))"
TO_LAUNCHES = ("builtin.module("
               f"func.func(scf-parallel-loop-tiling{{parallel-loop-tile-sizes={BLOCK} no-min-max-bounds=true}}),"
               "func.func(gpu-map-parallel-loops),"
               "func.func(convert-parallel-loops-to-gpu),"
               "canonicalize,"
               "gpu-launch-sink-index-computations,"
               "gpu-kernel-outlining,"
               "canonicalize)")


def _ptx_version(chip: str) -> str:
    """PTX 8.0 (CUDA 12.0 drivers) unless the chip's instructions need more: sparse wgmma needs 8.2 (sm_90a)."""
    return "ptx83" if chip.endswith("a") else "ptx80"


def _to_nvvm(chip: str) -> str:
    # math calls (exp, sqrt, ...) become libdevice calls, linked when the toolkit has libdevice
    link = f" l={bitcode}" if (bitcode := cuda_toolkit.libdevice()) else ""
    return ("builtin.module("
            f"nvvm-attach-target{{chip={chip} features=+{_ptx_version(chip)} O=3{link}}},"
            "gpu.module(lower-affine,convert-scf-to-cf,convert-nvgpu-to-nvvm,convert-gpu-to-nvvm,convert-nvvm-to-llvm,"
            "canonicalize,cse),"
            "reconcile-unrealized-casts)")


TO_BINARY = "builtin.module(gpu-module-to-binary{format=isa})"


def _run(module: ir.Module, pipeline: str, stage: str) -> None:
    frontend.run(module, pipeline, stage, "cuda")


def lower_to_ptx(module: ir.Module, sig: Signature, *, native: tuple[Launch, ...] | None = None,
                 scratch: tuple[tuple[tuple[int, ...], str], ...] = (), chips: tuple[str, ...] = CHIPS
                 ) -> tuple[GpuProgram, dict[str, str]]:
    """Lower ``module`` in place; return the program and each stage's IR.

    ``native`` gives the launches of a module from ``dialects.native.gpu``,
    which is already a ``gpu.module`` of kernels, and ``scratch`` the
    buffers those launches share.
    """
    stages = {"input": str(module)}
    if native is not None:  # hand-scheduled: already a gpu.module of kernels, nothing to sparsify or map
        launches, notes = native, ("native",)
        stages["sparsified"] = stages["input"]
    else:
        launches, mapped_scratch, notes = _map_to_launches(module, sig, stages)
        scratch = tuple(mapped_scratch)
    stages["mapped"] = str(module)
    # arch-specific kernels (sm_90a) add their chip; each chip's code holds only the kernels of its launches
    chips = chips + tuple(sorted({c for launch in launches for c in launch.chips} - set(chips)))
    ptx, nvvm = ptx_for_chips(str(module), chips, {c: {launch.kernel for launch in launches if not launch.on(c)}
                                                   for c in chips})
    stages["llvm"] = nvvm
    return GpuProgram("kernels", ptx, launches, scratch, notes, _result_like(sig, launches)), stages


def _result_like(sig: Signature, launches: tuple[Launch, ...]) -> tuple[int, ...]:
    """Where a sparse result's buffers come from (``GpuProgram.result_like``): those of the first sparse input of
    the result's format and index widths, whose pattern it keeps (the SDDMM's ``C`` is ``S``'s pattern with new
    values); ``()`` for a dense result.  Only hand-scheduled launches write a sparse result."""
    if not sig.output.sparse:
        return ()
    if not any(arg.kind == "result" for launch in launches for arg in launch.args):
        raise LoweringError(f"{sig.expression!r}: no GPU kernel writes its sparse result", stage="gpu",
                            target="cuda")
    position = 0
    for op in sig.inputs:
        names = op.format.codegen_format.buffer_names if op.sparse else ("",)
        if op.sparse and op.format == sig.output.format:
            return tuple(range(position, position + len(names)))
        position += len(names)
    raise LoweringError(f"{sig.expression!r}: its sparse result ({sig.output.format}) keeps the pattern of a sparse "
                        f"input of its format, and there is none", stage="gpu", target="cuda")


def _map_to_launches(module: ir.Module, sig: Signature, stages: dict[str, str]
                     ) -> tuple[tuple[Launch, ...], list[tuple[tuple[int, ...], str]], tuple[str, ...]]:
    """Steps 1-3 of the module docstring: sparsify, make launchable, map and outline; read the launches."""
    parallel = frontend.sparsify(module, parallel=True, target="cuda")
    stages["sparsified"] = str(module)
    _run(module, MAKE_LAUNCHABLE, "gpu")
    gpu_rewrites.forward_argument_views(module)
    _run(module, PARALLEL_LOOPS, "gpu")
    host = gpu_rewrites.host_function(module)
    scratch = gpu_rewrites.hoist_allocations(host)
    notes: tuple[str, ...] = ()
    if not (parallel and gpu_rewrites.only_parallel_loops(host)):
        _run(module, SERIAL_LOOPS, "gpu")
        gpu_rewrites.wrap_in_single_iteration(host)
        notes = ("serial",)
    _run(module, TO_LAUNCHES, "gpu")
    gpu_rewrites.merge_gpu_modules(module)
    return _read_launches(gpu_rewrites.host_function(module), len(sig.kernel_arguments())), scratch, notes


def ptx_for_chips(module_text: str, chips: tuple[str, ...], leave_out: dict[str, set[str]] | None = None
                  ) -> tuple[dict[str, str], str]:
    """PTX of the module's ``gpu.module`` for each chip, and the NVVM-level IR of the first.

    ``leave_out[chip]`` names kernels that chip's code does not hold (they use
    instructions it lacks, or another kernel does their job there).
    """
    ptx: dict[str, str] = {}
    nvvm = ""
    for chip in chips:  # none: stop at the gpu dialect (emulation)
        module = ir.Module.parse(module_text)
        _drop_kernels(module, (leave_out or {}).get(chip, set()))
        _run(module, _to_nvvm(chip), "nvvm")
        rewrites.allow_contraction(module)
        nvvm = nvvm or str(module)
        _run(module, TO_BINARY, "ptx")
        ptx[chip] = _assembly(module)
    return ptx, nvvm


def _drop_kernels(module: ir.Module, names: set[str]) -> None:
    if not names:
        return
    for op in module.body.operations:
        if op.operation.name == "gpu.module":
            for fn in list(op.regions[0].blocks[0].operations):
                if "sym_name" in fn.attributes and ir.StringAttr(fn.attributes["sym_name"]).value in names:
                    fn.operation.erase()


def _assembly(module: ir.Module) -> str:
    for op in module.body.operations:
        if op.operation.name == "gpu.binary":
            return gpu.ObjectAttr(op.operation.attributes["objects"][0]).object.decode()
    raise LoweringError("no gpu.binary produced", stage="ptx", target="cuda")


def _read_launches(host: ir.Operation, n_args: int) -> tuple[Launch, ...]:
    """The host function's launches as data; anything else left on the host is a lowering bug."""
    launches: list[Launch] = []
    for op in host.regions[0].blocks[0].operations:
        name = op.operation.name
        if name in ("arith.constant", "func.return", "memref.cast"):
            continue
        if name != "gpu.launch_func":
            raise LoweringError(f"{name} was left on the host after mapping to the GPU", stage="gpu",
                                target="cuda", diagnostics=str(host))
        launch = op.opview
        grid = tuple(_constant(v) for v in (launch.gridSizeX, launch.gridSizeY, launch.gridSizeZ))
        block = tuple(_constant(v) for v in (launch.blockSizeX, launch.blockSizeY, launch.blockSizeZ))
        shared = _constant(launch.dynamicSharedMemorySize) if launch.dynamicSharedMemorySize is not None else 0
        args = tuple(_kernel_arg(v, n_args) for v in launch.kernelOperands)
        kernel = ir.SymbolRefAttr(launch.attributes["kernel"]).value[-1]
        launches.append(Launch(kernel, grid, block, args, shared))  # type: ignore[arg-type]
    if not launches:
        raise LoweringError("the kernel has no GPU launch", stage="gpu", target="cuda", diagnostics=str(host))
    return tuple(launches)


def _constant(value: ir.Value) -> int:
    owner = value.owner
    if isinstance(owner, ir.OpView) and owner.operation.name == "arith.constant":
        return ir.IntegerAttr(owner.attributes["value"]).value
    raise LoweringError(f"launch size {value} is not a constant", stage="gpu", target="cuda")


def _kernel_arg(value: ir.Value, n_args: int) -> KernelArg:
    while isinstance(value.owner, ir.OpView) and value.owner.operation.name == "memref.cast":
        value = value.owner.operands[0]
    if isinstance(value.type, (ir.IndexType, ir.IntegerType)):
        return KernelArg("index", _constant(value))
    if isinstance(value, ir.BlockArgument) and isinstance(value.type, ir.MemRefType):
        shape = tuple(None if ir.ShapedType(value.type).is_dynamic_dim(d) else s
                      for d, s in enumerate(ir.MemRefType(value.type).shape))
        if value.arg_number < n_args:
            return KernelArg("buffer", value.arg_number, shape)
        return KernelArg("scratch", value.arg_number - n_args, shape)
    raise LoweringError(f"kernel operand {value} is neither a buffer argument nor a constant", stage="gpu",
                        target="cuda")
