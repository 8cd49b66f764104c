"""Run a GPU program's kernels on the CPU, thread by thread, to test them where there is no GPU.

The emulated module has the kernel function's usual signature (the one the
C entry point wraps), but its body replays the ``GpuProgram``'s launches
from their manifest records: scratch buffers are allocated and zeroed, and
each launch is a loop nest over its grid and block calling the kernel body
as a ``func.func`` whose thread and block ids are arguments.  The kernels
are the very ``gpu.func`` bodies that become PTX, and the launches are the
very records the CUDA runtime reads, so a wrong grid, a wrong argument
order or a wrong index in the mapped loops gives wrong numbers here.

Threads run one after another, so kernels that talk between threads
(``gpu.shuffle``, barriers, warp-wide MMAs) or pick threads per row at
launch time cannot be emulated; ``EmulationError`` says so.  Atomics are
emulated (sequentially, they are plain read-modify-writes).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from mlir import ir

from sparse_mlir.compiler import build
from sparse_mlir.compiler.driver import generic_shapes, with_operand_formats
from sparse_mlir.runtime.library import NativeFunction
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.lowering import cpu, toolchain
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.abi.gpu_program import GpuProgram, GridRule, SizeOf
from sparse_mlir.abi.c_signature import OperandABI, Signature

__all__ = ["EmulationError", "GenericEmulation", "SparseResultEmulation", "emulation_module", "build_emulation",
           "run_emulated", "run_function", "values_signature"]

_IDS = {"thread_id": "t", "block_id": "b", "block_dim": "bd", "grid_dim": "g"}
_ID_ARGS = [f"%emu_{k}{d}" for k in ("b", "t", "g", "bd") for d in "xyz"]


class EmulationError(Exception):
    """The program uses something sequential threads cannot reproduce."""


def emulation_module(program: GpuProgram, gpu_stage: str, sig: Signature, skewed: bool = False) -> ir.Module:
    """A CPU module for ``program`` from the IR that holds its ``gpu.module`` (the ``gpu`` stage).

    ``skewed`` chooses the launches a skewed operand gets (``Launch.when``).
    """
    program = replace(program, launches=tuple(launch for launch in program.launches if launch.runs(skewed)))
    source = ir.Module.parse(gpu_stage)
    kernels = {}
    used = {launch.kernel for launch in program.launches}
    for op in source.body.operations:
        if op.operation.name == "gpu.module":
            for fn in op.regions[0].blocks[0].operations:
                name = ir.StringAttr(fn.attributes["sym_name"]).value
                if name not in used:
                    continue
                kernels[name] = (fn.operation.get_asm(), ir.FunctionType(
                    ir.TypeAttr(fn.attributes["function_type"]).value).inputs)
    functions = "\n".join(_kernel_as_function(asm) for asm, _ in kernels.values())
    text = _host_text(program, sig, {n: t for n, (_, t) in kernels.items()}) + functions
    return ir.Module.parse(f"module {{\n{text}\n}}")


def _kernel_as_function(asm: str) -> str:
    if "gpu.shuffle" in asm or "gpu.barrier" in asm:
        raise EmulationError("the kernel exchanges values between threads (shuffles or barriers)")
    header = re.match(r"\s*gpu\.func @(\w+)\((.*?)\)\s+kernel(?:\s+attributes\s+\{[^{}]*\})?\s*\{", asm, re.S)
    if header is None:
        raise EmulationError(f"unexpected kernel header: {asm[:200]}")
    ids = ", ".join(f"{a}: index" for a in _ID_ARGS)
    body = asm[header.end():]
    body = re.sub(r"(%[\w$.-]+) = gpu\.(thread_id|block_id|block_dim|grid_dim)\s+([xyz])(?:\s+upper_bound\s+\d+)?",
                  lambda m: f"{m.group(1)} = arith.addi %emu_{_IDS[m.group(2)]}{m.group(3)}, %emu_zero : index", body)
    body = body.replace("gpu.return", "func.return")
    if (left := re.search(r"\b(?:nv)?gpu\.\w+", body)) is not None:
        raise EmulationError(f"the kernel uses {left.group(0)}")
    return (f"func.func private @{header.group(1)}({header.group(2)}, {ids}) {{\n"
            f"  %emu_zero = arith.constant 0 : index\n{body}")


def _buffer_types(sig: Signature) -> list[str]:
    out = []
    for op, buf in sig.kernel_arguments():
        if not op.sparse:  # a shape-generic signature's sizes are None: dynamic
            out.append(f"memref<{''.join('?x' if s is None else f'{s}x' for s in op.shape)}"
                       f"{TYPE_NAMES[op.dtype.name]}>")
            continue
        dtypes = dict(op.buffers())
        if buf in dtypes:
            out.append(f"memref<?x{TYPE_NAMES[dtypes[buf].name]}>")
        else:  # the implicit positions of an N:M level
            out.append(f"memref<?xi{op.format.pos_width or 64}>")
    return out


def _host_text(program: GpuProgram, sig: Signature, kernels: dict[str, list[ir.Type]]) -> str:
    types = _buffer_types(sig)
    params = ", ".join(f"%k{i}: {t}" for i, t in enumerate(types))
    fills = f", {FILLS_OUTPUT}" if not program.needs_zeroed_output() else ""  # the C entry point skips zeroing
    lines = [f"func.func @{KERNEL_NAME}({params}) -> {types[-1]} attributes {{llvm.emit_c_interface{fills}}} {{",
             "%c0 = arith.constant 0 : index", "%c1 = arith.constant 1 : index"]
    scratch_types = []
    for s, (shape, dtype) in enumerate(program.scratch):
        elt = TYPE_NAMES[dtype]
        mtype = f"memref<{''.join('?x' if isinstance(d, SizeOf) else f'{d}x' for d in shape)}{elt}>"
        scratch_types.append(mtype)
        sizes = []  # a shape-generic program's scratch sizes, from the operands (SizeOf)
        for d, size in enumerate(shape):
            if isinstance(size, SizeOf):
                lines += [f"%sd{s}_{d}_at = arith.constant {size.dim} : index",
                          f"%sd{s}_{d} = memref.dim %k{size.ref}, %sd{s}_{d}_at : {types[size.ref]}"]
                sizes.append(f"%sd{s}_{d}")
        zero = "0.0" if elt.startswith("f") else "0"
        lines += [f"%s{s} = memref.alloc({', '.join(sizes)}) : {mtype}", f"%z{s} = arith.constant {zero} : {elt}",
                  f"linalg.fill ins(%z{s} : {elt}) outs(%s{s} : {mtype})"]
    fresh = iter(range(10**6))
    for n, launch in enumerate(program.launches):
        if launch.lanes is not None:
            raise EmulationError("the launch's threads per row are picked at run time")
        param_types = kernels[launch.kernel]
        args: list[str] = []
        for arg, ptype in zip(launch.args, param_types):
            if arg.kind == "index":
                value = f"%a{next(fresh)}"
                lines.append(f"{value} = arith.constant {arg.ref} : index")
                args.append(value)
                continue
            if arg.kind == "result":  # the sparse result's values: the emulation's dense output (``values_signature``)
                value, vtype = f"%k{len(types) - 1}", types[-1]
            elif arg.kind == "buffer":
                value, vtype = f"%k{arg.ref}", types[arg.ref]
            else:
                value, vtype = f"%s{arg.ref}", scratch_types[arg.ref]
            if vtype != str(ptype):
                cast = f"%a{next(fresh)}"
                lines.append(f"{cast} = memref.cast {value} : {vtype} to {ptype}")
                value = cast
            args.append(value)
        bounds = []
        grid = (launch.grid, 1, 1) if isinstance(launch.grid, GridRule) else launch.grid
        for k, d in enumerate([*grid, *launch.block]):
            if isinstance(d, GridRule):  # blocks from the buffer's entries or a dimension, as GridRule.blocks
                rank = types[d.ref].count("x")
                dims = [d.dim] if d.dim is not None else list(range(rank))  # entries: every dimension's product
                count = "%c1"
                for m, dim in enumerate(dims):
                    lines += [f"%cd{n}_{k}_{m} = arith.constant {dim} : index",
                              f"%ext{n}_{k}_{m} = memref.dim %k{d.ref}, %cd{n}_{k}_{m} : {types[d.ref]}",
                              f"%len{n}_{k}_{m} = arith.muli {count}, %ext{n}_{k}_{m} : index"]
                    count = f"%len{n}_{k}_{m}"
                lines += [f"%len{n}_{k} = arith.addi {count}, %c0 : index",
                          f"%per{n}_{k} = arith.constant {d.per_block} : index",
                          f"%need{n}_{k} = arith.ceildivui %len{n}_{k}, %per{n}_{k} : index",
                          f"%dim{n}_{k} = arith.maxui %need{n}_{k}, %c1 : index"]
            else:
                lines.append(f"%dim{n}_{k} = arith.constant {d} : index")
            bounds.append(f"%dim{n}_{k}")
        tests = 0
        for t, test in enumerate(launch.only_if):  # a variant: only for the sizes that pass its tests
            size = f"%sz{n}_{t}"
            lines += [f"%tdim{n}_{t} = arith.constant {test.dim} : index",
                      f"{size} = memref.dim %k{test.ref}, %tdim{n}_{t} : {types[test.ref]}",
                      f"%tv{n}_{t} = arith.constant {test.value} : index",
                      f"%rem{n}_{t} = arith.remui {size}, %tv{n}_{t} : index"]
            predicate = {"multiple": f"eq, %rem{n}_{t}, %c0", "not_multiple": f"ne, %rem{n}_{t}, %c0",
                         "below": f"ult, {size}, %tv{n}_{t}", "at_least": f"uge, {size}, %tv{n}_{t}"}[test.kind]
            lines += [f"%test{n}_{t} = arith.cmpi {predicate} : index", f"scf.if %test{n}_{t} {{"]
            tests += 1
        ivs = [f"%iv{n}_{k}" for k in range(6)]
        for k in range(6):
            lines.append(f"scf.for {ivs[k]} = %c0 to {bounds[k]} step %c1 {{")
        call_args = ", ".join([*args, *ivs[:3], *ivs[3:], *bounds[:3], *bounds[3:]])
        call_types = ", ".join([*(str(t) for t in param_types), *["index"] * 12])
        lines.append(f"func.call @{launch.kernel}({call_args}) : ({call_types}) -> ()")
        lines += ["}"] * (6 + tests)
    lines += [f"return %k{len(types) - 1} : {types[-1]}", "}"]
    return "\n".join(lines) + "\n"


def build_emulation(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], sig: Signature, out_path: Path,
                    emitter: str = "auto", skewed: bool = False, deterministic: bool = False
                    ) -> tuple[GpuProgram, dict[str, str]]:
    """A CPU library at ``out_path`` that runs the GPU program of one specialization thread by thread.

    It exports ``sig`` like any CPU kernel, so tests call it with numpy
    operands and compare.  Built in the test's own process (this harness is
    not a job of the compiler process); returns the program and the IR of each stage.
    """
    with ir.Context():
        program, stages = build.gpu_program(spec, shapes, sig, (), emitter, deterministic)
        module = emulation_module(program, stages["mapped"], sig, skewed)
        stages["llvm"] = cpu.loops_to_llvm(module, sig)
    toolchain.compile_shared_library(stages["llvm"], out_path, cpu="native", opt_level=1)
    return program, stages


def run_emulated(spec: KernelSpec, args: dict[str, Any], out_path: Path, *, emitter: str = "auto",
                 skewed: bool = False, deterministic: bool = False) -> tuple[Any, GpuProgram]:
    """Build the emulation of ``spec`` for ``args`` (``A`` a ``SparseTensor``, whose index widths are kept; the
    rest dense) at ``out_path``, run it, and return its result and the program it ran."""
    formats = {"A": args["A"].format}  # index widths as the data needs, as the runtime specializes
    shapes = {n: tuple(v.shape) for n, v in args.items()}
    shapes[spec.output] = _output_shape(spec, args)
    special = with_operand_formats(spec, formats)
    sig = Signature.from_spec(special, formats, shapes, "emulated")
    program, _ = build_emulation(special, shapes, sig, out_path, emitter, skewed, deterministic)
    return run_function(NativeFunction(out_path, sig), spec, args), program


class GenericEmulation:
    """One emulation of a shape-generic GPU program (``driver.generic_shapes``), called at any size.

    ``builds`` counts the emulations built (one per index widths of ``A``),
    so a test sees that every size ran the same build.
    """

    def __init__(self, spec: KernelSpec, folder: Path, *, skewed: bool = False, deterministic: bool = False):
        self.spec, self.folder, self.skewed, self.deterministic = spec, folder, skewed, deterministic
        self.functions: dict[tuple[int | None, int | None], tuple[NativeFunction, GpuProgram]] = {}
        self.builds = 0

    def __call__(self, args: dict[str, Any]) -> tuple[Any, GpuProgram]:
        fmt = args["A"].format
        found = self.functions.get((fmt.pos_width, fmt.crd_width))
        if found is None:
            formats = {"A": fmt}
            special = with_operand_formats(self.spec, formats)
            shapes = generic_shapes(special)
            sig = Signature.from_spec(special, formats, shapes, "emulated")
            path = self.folder / f"generic_{fmt.pos_width}_{fmt.crd_width}_{self.skewed}.so"
            program, _ = build_emulation(special, shapes, sig, path, skewed=self.skewed,
                                         deterministic=self.deterministic)
            found = self.functions[(fmt.pos_width, fmt.crd_width)] = (NativeFunction(path, sig), program)
            self.builds += 1
        return run_function(found[0], self.spec, args), found[1]


def _output_shape(spec: KernelSpec, args: dict[str, Any]) -> tuple[int, ...]:
    extents: dict[str, int] = {}
    for name, value in args.items():
        extents.update(zip(spec.operand_index(name), value.shape))
    return tuple(extents[i] for i in spec.output_indices)


def run_function(function: NativeFunction, spec: KernelSpec, args: dict[str, Any]) -> Any:
    """Call an emulation on ``args`` with a stale output (kernels that skip zeroing must store all of it)."""
    stale = np.nan if spec.output_dtype.kind == "f" else -12345
    out = np.full(_output_shape(spec, args), stale, dtype=spec.output_dtype)
    return function(args, out, out.shape)


def values_signature(sig: Signature) -> Signature:
    """``sig`` with its sparse result replaced by a dense 1-d output: the result's values.

    A program with a sparse result writes only its values (``result``
    arguments); the runtime copies the other buffers (``GpuProgram.result_like``).
    The emulation's C entry point takes that output like any dense one, so a
    test passes a values array and compares it, entry by entry, with scipy.
    """
    out = sig.output
    assert out.sparse, "values_signature is for a program with a sparse result"
    values = OperandABI(out.name, True, out.dtype, (None,), ("emulated_entry",), None)
    return Signature(sig.name, sig.expression, (*sig.inputs, values))


class SparseResultEmulation:
    """One emulation of a shape-generic GPU program with a sparse result (the SDDMM), called at any size.

    ``sparse`` names the input whose pattern the result keeps; a call
    returns the result's values (one per stored entry of that input) and
    the program.  ``builds`` counts the emulations built (one per index widths).
    """

    def __init__(self, spec: KernelSpec, sparse: str, folder: Path):
        self.spec, self.sparse, self.folder = spec, sparse, folder
        self.functions: dict[tuple[int | None, int | None], tuple[NativeFunction, GpuProgram]] = {}
        self.builds = 0

    def __call__(self, args: dict[str, Any]) -> tuple[np.ndarray, GpuProgram]:
        fmt = args[self.sparse].format
        found = self.functions.get((fmt.pos_width, fmt.crd_width))
        if found is None:
            formats = {self.sparse: fmt, self.spec.output: fmt}
            special = with_operand_formats(self.spec, formats)
            shapes = generic_shapes(special)
            sig = Signature.from_spec(special, special.formats, shapes, "emulated")
            path = self.folder / f"sparse_result_{fmt.pos_width}_{fmt.crd_width}.so"
            with ir.Context():
                program, stages = build.gpu_program(special, shapes, sig, (), "auto", False)
                emulated = values_signature(sig)
                module = emulation_module(program, stages["mapped"], emulated)
                llvm = cpu.loops_to_llvm(module, emulated)
            toolchain.compile_shared_library(llvm, path, cpu="native", opt_level=1)
            found = self.functions[(fmt.pos_width, fmt.crd_width)] = (NativeFunction(path, emulated), program)
            self.builds += 1
        stale = np.full(args[self.sparse].nnz, np.nan, dtype=self.spec.output_dtype)  # every entry must be written
        return found[0](args, stale, stale.shape), found[1]
