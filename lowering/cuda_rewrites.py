"""Rewrites that turn a sparsified host function into one that only launches GPU kernels.

After them every operation of the host function is a constant, a cast of an
argument, or a parallel loop that upstream's mapping turns into a launch, so
no buffer is touched on the host and nothing is copied between host and
device.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, memref, scf

from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.linalg import KERNEL_NAME

__all__ = ["host_function", "forward_argument_views", "hoist_allocations", "only_parallel_loops",
           "wrap_in_single_iteration", "merge_gpu_modules", "GPU_MODULE"]

GPU_MODULE = "kernels"

_LAUNCHABLE = {"arith.constant", "memref.cast", "scf.parallel", "func.return"}
_NUMPY = {**{mlir: numpy for numpy, mlir in TYPE_NAMES.items()}, "index": "int64"}


def host_function(module: ir.Module) -> ir.Operation:
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value \
                == KERNEL_NAME:
            return op.operation
    raise AssertionError(f"no func.func @{KERNEL_NAME} in the module")


def _body(host: ir.Operation) -> ir.Block:
    return host.regions[0].blocks[0]


def forward_argument_views(module: ir.Module) -> None:
    """Replace the sparsifier's prefix views ``subview %arg[0][n][1]`` of level buffers by the buffers.

    ``n`` comes from the storage specifier, i.e. from a position read on the
    host, which a device buffer does not allow; the kernel only indexes
    below ``n`` anyway.
    """
    host = host_function(module)
    views = [op for op in _body(host).operations
             if op.operation.name == "memref.subview" and isinstance(op.operands[0], ir.BlockArgument)]
    for view in views:
        with ir.InsertionPoint(view), view.location:
            cast = memref.CastOp(view.results[0].type, view.operands[0])
        view.results[0].replace_all_uses_with(cast.result)
        view.operation.erase()


def hoist_allocations(host: ir.Operation) -> list[tuple[tuple[int, ...], str]]:
    """Turn the host's statically sized ``memref.alloc``s into trailing arguments; return their (shape, dtype).

    The runtime allocates them on the device per call (zero-filled); their
    ``dealloc``s go away.
    """
    block = _body(host)
    scratch: list[tuple[tuple[int, ...], str]] = []
    for op in list(block.operations):
        if op.operation.name != "memref.alloc" or op.operands:
            continue
        buf = op.results[0]
        t = ir.MemRefType(buf.type)
        arg = block.add_argument(buf.type, op.location)
        for use in list(buf.uses):
            if use.owner.name == "memref.dealloc" or _copies_zeros_into(use.owner, buf):
                use.owner.erase()
        buf.replace_all_uses_with(arg)
        op.operation.erase()
        scratch.append((tuple(t.shape), _NUMPY[str(t.element_type)]))
    for op in list(block.operations):
        if op.operation.name == "memref.get_global" and not list(op.results[0].uses):
            op.operation.erase()
    fn_type = ir.FunctionType(ir.TypeAttr(host.attributes["function_type"]).value)
    host.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([a.type for a in block.arguments], fn_type.results))
    return scratch


def _copies_zeros_into(op: ir.Operation, buf: ir.Value) -> bool:
    """``memref.copy`` of an all-zero constant into ``buf``: redundant, scratch is zero-filled."""
    if op.name != "memref.copy" or op.operands[1] != buf:
        return False
    source = op.operands[0].owner
    if not (isinstance(source, ir.OpView) and source.operation.name == "memref.get_global"):
        return False
    name = ir.FlatSymbolRefAttr(source.attributes["name"]).value
    module = source.operation.parent.parent  # func.func -> module
    for glob in module.regions[0].blocks[0].operations:
        if glob.operation.name == "memref.global" and ir.StringAttr(glob.attributes["sym_name"]).value == name:
            init = glob.attributes["initial_value"]
            if not (isinstance(init, ir.DenseElementsAttr) and init.is_splat):
                return False
            value = str(init.get_splat_value()).split(" :")[0]
            return value == "false" or float(value) == 0
    return False


def only_parallel_loops(host: ir.Operation) -> bool:
    """Whether everything the host function does happens inside parallel loops."""
    return all(op.operation.name in _LAUNCHABLE for op in _body(host).operations)


def wrap_in_single_iteration(host: ir.Operation) -> None:
    """Move the whole body into a one-iteration ``scf.parallel``: it becomes one single-thread kernel.

    For kernels the sparsifier did not parallelize (a reduction across the
    outer loop, a compressed outer level): correct, but serial.
    """
    block = _body(host)
    ops = list(block.operations)[:-1]
    terminator = list(block.operations)[-1]
    with ir.InsertionPoint(terminator), host.location:
        zero = arith.ConstantOp(ir.IndexType.get(), 0)
        one = arith.ConstantOp(ir.IndexType.get(), 1)
        loop = scf.ParallelOp([], [zero], [one], [one], [])
        body = loop.regions[0].blocks.append(ir.IndexType.get())
        with ir.InsertionPoint(body):
            reduce = scf.ReduceOp([], 0)
    for op in ops:
        op.operation.move_before(reduce.operation)


def merge_gpu_modules(module: ir.Module) -> None:
    """Put every outlined kernel into one ``gpu.module @kernels``, each named after the module it came from.

    Outlining makes one ``gpu.module`` per launch, all with a function of
    the same name; one module gives one PTX file per chip and unique entry
    names.
    """
    gpu_modules = [op for op in module.body.operations if op.operation.name == "gpu.module"]
    if not gpu_modules:
        return
    target = gpu_modules[0].regions[0].blocks[0]
    for gm in gpu_modules:
        module_name = ir.StringAttr(gm.attributes["sym_name"]).value
        for fn in list(gm.regions[0].blocks[0].operations):
            fn.attributes["sym_name"] = ir.StringAttr.get(module_name)  # one gpu.func per outlined module
            target.append(fn.operation)
    for gm in gpu_modules[1:]:
        gm.operation.erase()
    gpu_modules[0].attributes["sym_name"] = ir.StringAttr.get(GPU_MODULE)

    def relink(op: ir.Operation) -> ir.WalkResult:
        if op.name == "gpu.launch_func":
            module_name = ir.SymbolRefAttr(op.attributes["kernel"]).value[0]
            op.attributes["kernel"] = ir.SymbolRefAttr.get([GPU_MODULE, module_name])
        return ir.WalkResult.ADVANCE

    module.operation.walk(relink)
